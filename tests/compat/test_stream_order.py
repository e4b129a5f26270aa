"""Order on one gRPC stream: Triton's sequence example, side by side (issue 12, item 2).

Triton's ModelStreamInfer reads a stream's requests one after another and issues each to
its model's scheduler in that order; the responses of a non-decoupled model are written in
the order the requests were read (``src/grpc/stream_infer_handler.cc``: the state is
queued with ``EnqueueForResponse``). A stateful model therefore sees a sequence's requests
in the order sent, and tritonclient's ``simple_grpc_aio_sequence_stream_infer_client.py``
files each answer under its sequence in the order it arrives. Through the frontend the
stream must do the same: the example is run here as written (its three sequences on one
asyncio stream, ``simple_sequence``) and with two sequences interleaved on a model whose
answer is the running sum (``sequence_sum``: computed on reordered requests, it differs),
many rounds, against Triton and through the frontend, and every answer, in the order it
came back, must be Triton's.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcaio
from compat_support import KEY_HEADER

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from tests.support import RunningFrontend

VALUES = [11, 7, 5, 3, 2, 0, 1]  # the example's
ROUNDS = 20


@dataclass(frozen=True)
class Step:
    """One request of a sequence, as the example's ``async_stream_yield`` makes it."""

    model: str
    sequence_id: int | str
    value: int
    start: bool
    end: bool
    request_id: str
    batched: bool  # the model batches (max_batch_size > 0): INPUT is [1, 1], else [1]


def sequence(model: str, sequence_id: int | str, values: list[int], batched: bool) -> list[Step]:
    return [
        Step(model, sequence_id, v, i == 0, i == len(values) - 1, f"{sequence_id}_{i + 1}", batched)
        for i, v in enumerate(values)
    ]


def example_steps(offset: int) -> list[Step]:
    """The example's stream (not ``--dyna``): sequence 0, then 1, then the string one."""
    return [
        *sequence("simple_sequence", 1000 + offset * 2, [0, *VALUES], True),
        *sequence("simple_sequence", 1001 + offset * 2, [100, *(-v for v in VALUES)], True),
        *sequence("simple_sequence", str(uuid.uuid4()), [20, *(-v for v in VALUES)], True),
    ]


def interleaved_steps(offset: int) -> list[Step]:
    """Two running sums, their requests alternating on the stream."""
    first = sequence("sequence_sum", 5000 + offset * 2, [0, *VALUES], False)
    second = sequence("sequence_sum", 5001 + offset * 2, [100, *(-v for v in VALUES)], False)
    return [step for pair in zip(first, second, strict=True) for step in pair]


async def run_stream(url: str, headers: dict[str, str], steps: list[Step]) -> list[Any]:
    """The steps on one asyncio stream, sent as fast as the client goes; the answers as
    they came back: (request id, OUTPUT) or the error's text."""

    async def requests() -> AsyncIterator[dict[str, Any]]:
        for step in steps:
            shape = [1, 1] if step.batched else [1]
            data = np.full(shape, step.value, dtype=np.int32)
            inputs = [grpcaio.InferInput("INPUT", data.shape, "INT32")]
            inputs[0].set_data_from_numpy(data)
            yield {
                "model_name": step.model,
                "inputs": inputs,
                "outputs": [grpcaio.InferRequestedOutput("OUTPUT")],
                "request_id": step.request_id,
                "sequence_id": step.sequence_id,
                "sequence_start": step.start,
                "sequence_end": step.end,
            }

    answers: list[Any] = []
    async with grpcaio.InferenceServerClient(url) as client:
        stream = client.stream_infer(inputs_iterator=requests(), headers=headers)
        async for result, error in stream:
            if error is not None:
                answers.append(str(error))
            else:
                output = int(result.as_numpy("OUTPUT").reshape(-1)[0])
                answers.append((result.get_response().id, output))
    return answers


async def test_the_sequence_examples_get_tritons_answers_in_tritons_order(
    triton: EmbeddedTriton, frontend: RunningFrontend
) -> None:
    """Each round, the example's stream and the interleaved one: through the frontend,
    the same answers in the same order as from Triton, which answers in request order."""
    negated = [-v for v in VALUES]
    mismatched = []
    for offset in range(ROUNDS):
        for steps in (example_steps(offset), interleaved_steps(offset)):
            direct = await run_stream(triton.grpc_url, {}, steps)
            assert [a[0] for a in direct] == [s.request_id for s in steps], (
                "Triton itself answers a stream in request order"
            )
            if steps[0].model == "simple_sequence":  # the example's own check
                assert [a[1] for a in direct] == [1, *VALUES, 101, *negated, 21, *negated]
            through = await run_stream(frontend.grpc_url, dict(KEY_HEADER), steps)
            if through != direct:
                mismatched.append((offset, steps[0].model, direct, through))
    # Answers right but out of order, or answers computed on reordered requests (or
    # refused: an end that overtook its sequence's other requests).
    wrong = [m for m in mismatched if sorted(map(str, m[2])) != sorted(map(str, m[3]))]
    assert not mismatched, (
        f"{len(mismatched)} of {2 * ROUNDS} streams differ from Triton ({len(wrong)} with "
        f"answers other than Triton's, the rest out of order); first: {mismatched[0]}"
    )


async def test_unrelated_requests_answer_in_tritons_order(
    triton: EmbeddedTriton, frontend: RunningFrontend
) -> None:
    """Beyond sequences: Triton answers every request of a stream to a model that is not
    decoupled in request order (a fast one waits for the slow one before it), while a
    decoupled model's responses go out as they come, ahead of both. The same through the
    frontend, which must not hold the decoupled ones back either."""
    tokens = 25_000  # sleeper: 2 ms + 20 us a token, about half a second

    def message(model: str, request_id: str, **tensors: np.ndarray) -> dict[str, Any]:
        inputs = []
        for name, data in tensors.items():
            inputs.append(grpcaio.InferInput(name, list(data.shape), "INT32"))
            inputs[-1].set_data_from_numpy(data)
        return {"model_name": model, "inputs": inputs, "request_id": request_id}

    row = np.ones((1, 16), dtype=np.int32)
    messages = [
        message("sleeper", "slow", INPUT_IDS=np.ones((1, tokens), dtype=np.int32)),
        message("simple", "fast", INPUT0=row, INPUT1=row),
        message("repeat_decoupled", "parts", IN=np.array([7, 8, 9], dtype=np.int32)),
    ]

    async def run(url: str, headers: dict[str, str]) -> list[str]:
        async def requests() -> AsyncIterator[dict[str, Any]]:
            for m in messages:
                yield m

        order: list[str] = []
        async with grpcaio.InferenceServerClient(url) as client:
            stream = client.stream_infer(inputs_iterator=requests(), headers=headers)
            async for result, error in stream:
                assert error is None, error
                order.append(result.get_response().id)
                if len(order) == 5:  # a decoupled stream stays open: the client ends it
                    stream.cancel()
                    break
        return order

    direct = await run(triton.grpc_url, {})
    assert direct == ["parts", "parts", "parts", "slow", "fast"]
    assert await run(frontend.grpc_url, dict(KEY_HEADER)) == direct
