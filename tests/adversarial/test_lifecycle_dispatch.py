"""Lifecycle holes in dispatch: shutdown during an outage, an abandoned stream, Triton's
RESOURCE_EXHAUSTED.

Every admitted request gets exactly one answer, also when the frontend shuts down while
Triton is unreachable or hung; a stream whose client went away stops running in Triton
too; and Triton's RESOURCE_EXHAUSTED reaches the client as itself (429), not as 400.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton, default_model_repository
from fair_frontend.backends.triton.http import error_of
from fair_frontend.backends.triton.upstream import upstream_error
from fair_frontend.errors import Unavailable
from fair_frontend.kit.testing import aeventually, scrape
from fair_frontend.outcomes import Outcome
from tests.core.dispatch_support import Harness
from tests.support import KEYS, ids_input, make_config, running_frontend

SHUTTING_DOWN = "the frontend is shutting down"
DEADLINE_S = 120.0  # bounds every wait below (a failure, not a timing)


# ---- 9a. shutdown during an outage -------------------------------------------------------


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = Harness()
    yield h
    await h.close()


async def test_a_batch_held_during_the_drain_is_answered_when_it_ends(harness: Harness) -> None:
    """Triton went away (the backend is down) while a batch was on its way: shutdown
    answers what is queued, then drains; the batch comes back unsent during the drain and
    is held for Triton's return, which will not come. The drain answers it."""
    h = harness
    first = h.submit("a")
    await h.settle()
    second = h.submit("b")  # queued behind the first (one slot)
    h.backend.mark_down()  # another model's batch found Triton gone
    assert h.runtime.fail_queued(Unavailable(SHUTTING_DOWN)) == 1  # Core.shutdown's step
    drain = asyncio.ensure_future(h.runtime.drain())  # its default: shutdown's error
    await h.settle()
    h.triton.sent[0].fail(Unavailable("failed to connect to all addresses", never_sent=True))
    await asyncio.wait_for(drain, DEADLINE_S)
    for req in (first, second):
        (answer,) = h.answers(req)
        assert answer.fault is not None and answer.fault.message == SHUTTING_DOWN
        assert answer.fault.grpc_code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert h.outcomes(req) == [Outcome.FAILED]
    assert h.runtime.inflight == 0 and h.runtime.idle and not h.runtime._held


async def test_a_batch_triton_never_answers_is_answered_when_the_drain_ends(
    harness: Harness,
) -> None:
    h = harness
    hung = h.submit("a")
    await h.settle()
    assert h.triton.pending  # in Triton, which will never answer
    await asyncio.wait_for(h.runtime.drain(0.0, Unavailable(SHUTTING_DOWN)), DEADLINE_S)
    (answer,) = h.answers(hung)
    assert answer.fault is not None and answer.fault.message == SHUTTING_DOWN
    assert h.runtime.inflight == 0 and not h.runtime._tasks


@pytest.fixture
def own_triton() -> Iterator[EmbeddedTriton]:
    """A Triton of this test's own (it gets paused), serving only embed."""
    server = EmbeddedTriton(
        default_model_repository(),
        extra_args=["--model-control-mode=explicit", "--load-model=embed"],
    )
    server.start()
    try:
        yield server
    finally:
        if server.pid is not None:
            os.killpg(server.pid, signal.SIGCONT)
        server.stop()


async def _embed(client: grpcaio.InferenceServerClient, tenant: str) -> Any:
    ids = np.full((1, 16), 3, dtype=np.int32)
    try:
        return await client.infer(
            "embed", [ids_input(grpcaio, ids)], headers={"x-api-key": KEYS[tenant]}
        )
    except InferenceServerException as err:
        return err


async def test_shutdown_answers_requests_stuck_in_a_hung_triton(
    own_triton: EmbeddedTriton, workers: int
) -> None:
    """Triton hangs (SIGSTOP: connections open, nothing answers). A request in it and one
    queued behind it both get UNAVAILABLE "shutting down" by the end of the drain, not
    whatever the listeners' close would have left them with."""
    with running_frontend(make_config(), own_triton, workers=workers) as fe:
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        try:
            assert not isinstance(await _embed(client, "acme"), Exception)
            assert own_triton.pid is not None
            os.killpg(own_triton.pid, signal.SIGSTOP)
            # One request in Triton, the next maybe too (one batch per instance), or queued.
            waiting = [asyncio.ensure_future(_embed(client, t)) for t in ("acme", "globex")]
            until = asyncio.get_running_loop().time() + DEADLINE_S
            while (await fe.counters("embed")).admitted < 3:
                assert asyncio.get_running_loop().time() < until, "requests never admitted"
                await asyncio.sleep(0.01)
            assert await fe.acall(_inflight(fe)) >= 1
            await asyncio.wait_for(fe.acall(fe.frontend.shutdown(grace_s=0.5)), DEADLINE_S)
            results = await asyncio.wait_for(asyncio.gather(*waiting), DEADLINE_S)
        finally:
            await client.close()
            assert own_triton.pid is not None
            os.killpg(own_triton.pid, signal.SIGCONT)
    for r in results:
        assert isinstance(r, InferenceServerException), r
        assert r.status() == "StatusCode.UNAVAILABLE" and r.message() == SHUTTING_DOWN


async def _inflight(fe: Any) -> int:
    return int(fe.frontend.runtimes["embed"].inflight)


# ---- 9b. an abandoned decoupled request is cancelled in Triton ---------------------------


def llm_inputs(prompt: str, max_tokens: int) -> list[Any]:
    text = grpcaio.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    flag = grpcaio.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([True]))
    sampling = grpcaio.InferInput("sampling_parameters", [1], "BYTES")
    params = json.dumps({"max_tokens": max_tokens, "temperature": 0}).encode()
    sampling.set_data_from_numpy(np.array([params], dtype=object))
    return [text, flag, sampling]


async def test_an_abandoned_stream_stops_running_in_triton(triton: Any, workers: int) -> None:
    """A client cancels its llm stream after 3 of 480 tokens: the frontend ends its call to
    Triton, and the model sees the cancellation (its ``fair_llm_cancelled_total`` counts
    it). Had the generation been left running, it would end by itself, uncounted, and be
    metered as served (``fair_model_rows_total``): on a machine so loaded that all 480
    tokens were made before the client read its third (seen beside a CPU hog), that is
    what happens whatever the frontend does, so such a run is tried again, at most 3."""

    def metric(name: str) -> float:
        return scrape(triton.metrics_url).sum(name, model="llm")

    def served() -> float:
        return scrape(triton.metrics_url).sum("fair_model_rows_total", model="llm")

    with running_frontend(make_config(), triton, workers=workers) as fe:
        for _attempt in range(3):
            before = metric("fair_llm_cancelled_total")
            rows_before = served()
            client = grpcaio.InferenceServerClient(fe.grpc_url)

            async def one() -> AsyncIterator[dict[str, Any]]:
                yield {"model_name": "llm", "inputs": llm_inputs("an endless story", 480)}

            stream = client.stream_infer(one(), headers={"x-api-key": KEYS["initech"]})
            got = 0
            try:
                async for _result, error in stream:
                    assert error is None
                    got += 1
                    if got == 3:
                        break
                stream.cancel()
            finally:
                await client.close()
            await aeventually(
                lambda: metric("fair_llm_running_sequences") == 0,
                DEADLINE_S,
                0.02,
                what="the sequence to leave the engine",
            )
            # Counted cancelled, or metered as served to its end (then try again).

            def counted(b: float = before, r: float = rows_before) -> bool:
                return metric("fair_llm_cancelled_total") > b or served() > r

            await aeventually(
                counted,
                DEADLINE_S,
                0.02,
                what="the model to count the cancellation (or the sequence as served)",
            )
            if metric("fair_llm_cancelled_total") > before:
                break
        else:
            pytest.fail("3 times the 480 tokens were all made before the client's cancel")
    assert metric("fair_llm_cancelled_total") - before == 1
    assert served() == rows_before  # cut, not served


# ---- 9c. RESOURCE_EXHAUSTED -------------------------------------------------------------


def test_triton_resource_exhausted_is_429_over_grpc() -> None:
    """Triton's core has no RESOURCE_EXHAUSTED of its own; it reaches the forwarder from
    gRPC's limits. The client sees it as it is, 429 on HTTP (docs/PROTOCOL.md), not the
    400 a code missing from the table fell back to."""
    message = "Received message larger than max (2147483648 vs. 2147483647)"
    err = upstream_error(InferenceServerException(message, "StatusCode.RESOURCE_EXHAUSTED"))
    assert err.grpc_code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.http_status == 429 and err.message == message


def test_a_429_answer_from_triton_http_is_resource_exhausted() -> None:
    err = error_of(429, b'{"error": "too many requests"}')
    assert err.grpc_code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.http_status == 429 and err.message == "too many requests"
