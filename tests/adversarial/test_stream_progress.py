"""A stream's time limit is time without progress, and a generation's length never marks
Triton down (issue 17, item 1).

``triton.request_timeout_s`` was a total deadline on the ``ModelStreamInfer`` call: a
generation streaming for longer was cut with DEADLINE_EXCEEDED, read as "Triton is
unreachable", and marked the backend down for every model. Now it bounds the wait for
each next response: a stream that keeps producing runs as long as it produces; one that
stops (a stuck model, a Triton that stopped answering: SIGSTOP) is answered UNAVAILABLE
after the timeout, alone, and nothing is marked down.

``repeat_int32`` (tests/model_repository: one response per element of ``IN``, each
``DELAY[i]`` ms after the one before) streams for a known time, whatever the machine's
speed; it is an engine endpoint here (``max_inflight``), as ``llm`` is. A request that
names a gate (``fair_frontend.kit.testing.Gate``) is held after its first response until the
test opens it: a model that stops answering for as long as the test says. Whether
anything was marked down is read once the core has recorded the stream's end.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio

from fair_frontend.backends.protocol import StreamReply
from fair_frontend.backends.triton.embedded import EmbeddedTriton, default_model_repository
from fair_frontend.backends.triton.forwarder import TritonForwarder
from fair_frontend.config import Config
from fair_frontend.kit.testing import GATE_PARAMETER, Gate, aeventually
from fair_frontend.protocol import Batch, Tensor
from tests.support import (
    KEYS,
    TEST_MODEL_REPOSITORY,
    config_dict,
    ids_input,
    make_config,
    repeat_stream,
    running_frontend,
)

DEADLINE_S = 60.0  # bounds every wait below (a failure, not a timing)
NO_PROGRESS = "no response from Triton for"


def config(timeout_s: float) -> Config:
    data = config_dict()
    data["endpoints"]["repeat_int32"] = {"max_inflight": 4, "throttle": False}
    data["triton"] = {"request_timeout_s": timeout_s}
    return make_config(**data)


async def count_mark_down(fe: Any) -> list[float]:
    """Every call of the core's ``Backend.mark_down`` from now on (the core runs in this
    process, whatever the number of shells)."""
    backend = fe.frontend.backend
    calls: list[float] = []
    original = backend.mark_down

    def counted() -> None:
        calls.append(backend.clock.now())
        original()

    backend.mark_down = counted
    return calls


async def settled(fe: Any, model: str = "repeat_int32") -> None:
    """Until the core has recorded the end of every stream of ``model`` (its slots back):
    a mark-down would have come with it."""

    async def idle() -> bool:
        runtime = fe.frontend.runtimes.get(model)
        return runtime is not None and runtime.inflight == 0

    what = f"the end of {model}'s stream recorded by the core"
    await aeventually(lambda: fe.acall(idle()), DEADLINE_S, 0.01, what=what)


async def gated_stream(url: str, gate: Gate) -> tuple[int, Any]:
    """One repeat_int32 request of two responses, held at ``gate`` after its first, on a
    gRPC stream through the frontend: (responses with a value, the error that ended it or
    None), the stream read to its end."""
    client = grpcaio.InferenceServerClient(url)
    tensors = []
    for name, dtype, values in (
        ("IN", "INT32", np.arange(2, dtype=np.int32)),
        ("DELAY", "UINT32", np.zeros(2, dtype=np.uint32)),
        ("WAIT", "UINT32", np.array([0], dtype=np.uint32)),
    ):
        tensor = grpcaio.InferInput(name, list(values.shape), dtype)
        tensor.set_data_from_numpy(values)
        tensors.append(tensor)

    async def one() -> AsyncIterator[dict[str, Any]]:
        yield {
            "model_name": "repeat_int32",
            "inputs": tensors,
            "parameters": {GATE_PARAMETER: gate.parameter},
        }

    got = 0
    try:
        async for result, error in client.stream_infer(one(), headers={"x-api-key": KEYS["acme"]}):
            if error is not None:
                return got, error
            if result.as_numpy("OUT") is not None:
                got += 1
    finally:
        await client.close()
    return got, None


async def test_a_stream_longer_than_the_request_timeout_completes_and_marks_nothing_down(
    triton: EmbeddedTriton, workers: int
) -> None:
    """Six responses 0.5 s apart (3 s in all) under a 2 s request timeout: all arrive (a
    total deadline cut it at 2 s and marked Triton down)."""
    with running_frontend(config(2.0), triton, workers=workers) as fe:
        marked = await fe.acall(count_mark_down(fe))
        got, error = await asyncio.wait_for(repeat_stream(fe.grpc_url, [500] * 6), DEADLINE_S)
        assert (got, error) == (6, None)
        await settled(fe)
        assert marked == []


async def test_a_stream_without_progress_fails_alone_after_the_timeout(
    triton: EmbeddedTriton, workers: int, tmp_path: Path
) -> None:
    """The model stops answering after its first response (held at a gate the test opens
    only once the stream has ended) under a 1.5 s timeout: the request is answered
    UNAVAILABLE once the timeout passes without a response, nothing is marked down, and
    another model is served right after."""
    gate = Gate(tmp_path)
    with running_frontend(config(1.5), triton, workers=workers) as fe:
        marked = await fe.acall(count_mark_down(fe))
        try:
            got, error = await asyncio.wait_for(gated_stream(fe.grpc_url, gate), DEADLINE_S)
        finally:
            gate.open()  # the model's instance goes on
        assert got == 1 and error is not None
        assert NO_PROGRESS in error.message() and "1.5 s" in error.message(), error
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        try:
            ids = np.full((1, 8), 3, dtype=np.int32)
            await asyncio.wait_for(
                client.infer(
                    "embed", [ids_input(grpcaio, ids)], headers={"x-api-key": KEYS["acme"]}
                ),
                DEADLINE_S,
            )
        finally:
            await client.close()
        await settled(fe)
        assert marked == []


@pytest.fixture
def own_triton() -> Iterator[EmbeddedTriton]:
    """A Triton of this test's own (it gets paused), serving only repeat_int32."""
    server = EmbeddedTriton(
        [default_model_repository(), TEST_MODEL_REPOSITORY],
        extra_args=["--model-control-mode=explicit", "--load-model=repeat_int32"],
    )
    server.start()
    try:
        yield server
    finally:
        if server.pid is not None:
            os.killpg(server.pid, signal.SIGCONT)
        server.stop()


async def test_a_triton_that_stops_answering_mid_stream_is_answered_after_the_timeout(
    own_triton: EmbeddedTriton, workers: int
) -> None:
    """SIGSTOP after the first response (connections stay open, nothing answers): the
    stream is answered with the no-progress error, not left waiting for its end."""
    assert own_triton.pid is not None
    pid = own_triton.pid
    with running_frontend(config(2.0), own_triton, workers=workers) as fe:
        try:
            got, error = await asyncio.wait_for(
                repeat_stream(
                    fe.grpc_url, [0, 500, 500, 500], on_first=lambda: os.killpg(pid, signal.SIGSTOP)
                ),
                DEADLINE_S,
            )
        finally:
            os.killpg(pid, signal.SIGCONT)
        assert got == 1 and error is not None
        assert NO_PROGRESS in error.message() and "2 s" in error.message(), error


async def test_time_the_consumer_holds_a_response_is_not_triton_without_progress(
    triton: EmbeddedTriton,
) -> None:
    """A shell holds a stream back while its client does not read (up to
    queues.stalled_stream_s); that pause is not Triton's lack of progress. Here the
    consumer of the forwarder's stream holds its first response for twice the 1 s timeout
    while Triton has already sent the rest: every response still arrives, none is
    ``NoProgress`` (the watchdog counted the consumer's pause and cancelled the call)."""
    fwd = TritonForwarder(triton.grpc_url, request_timeout_s=1.0)
    n = 4
    inputs = [
        Tensor("IN", "INT32", (n,), np.arange(n, dtype=np.int32)),
        Tensor("DELAY", "UINT32", (n,), np.zeros(n, dtype=np.uint32)),
        Tensor("WAIT", "UINT32", (1,), np.zeros(1, dtype=np.uint32)),
    ]
    got: list[StreamReply] = []
    try:

        async def consume() -> None:
            async for reply in fwd.stream(Batch("repeat_int32", "", inputs)):
                got.append(reply)
                if len(got) == 1:
                    await asyncio.sleep(2.0)  # the client not reading, as the core sees it

        await asyncio.wait_for(consume(), DEADLINE_S)
    finally:
        await fwd.close()
    assert [r.error for r in got if r.error is not None] == []
    assert sum(1 for r in got if r.outputs) == n
