"""A streamed answer waits for its client: at most a window of parts, then back-pressure.

Issue 17: the parts of a decoupled request whose client stopped reading piled up
without bound in the answer queues. Now the core relays at most ``ANSWER_WINDOW`` parts
its client has not taken; at the bound it stops reading the request's stream from
Triton, and a client that takes nothing for ``stalled_stream_s`` has its request
cancelled in Triton (its slot freed), answered once. On a fake clock, with a fake
engine whose streams emit whenever the test says so.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from dispatch_support import SETTLE_ROUNDS, RecordingRoute, StepClock
from test_engine_units import LLM, FakeEngine, Stream

from fair_frontend.config import CostUnit, Endpoint
from fair_frontend.core.dispatch import Backend, CoreRequest, EndpointRuntime
from fair_frontend.errors import FrontendError, Unavailable
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.records import ANSWER_WINDOW, Call
from fair_frontend.scheduler import EndpointPolicy, GlobalCaps, Scheduler, TenantSpec

STALLED_S = 5.0


class Streams:
    """``llm`` in engine mode with ``slots`` slots; its outcomes recorded."""

    def __init__(self, slots: int = 1) -> None:
        self.clock = StepClock()
        self.triton = FakeEngine()
        self.done: list[tuple[CoreRequest, Outcome, FrontendError | None]] = []
        endpoint = Endpoint(max_inflight=slots, token_output="text_output")
        policy = EndpointPolicy(CostUnit.REQUESTS, 0, None, 1.0, ("paid",), slots=slots)
        self.scheduler = Scheduler(policy, {t: TenantSpec("paid") for t in "ab"}, GlobalCaps())
        self.runtime = EndpointRuntime(
            model="llm",
            info=LLM,
            endpoint=endpoint,
            scheduler=self.scheduler,
            forwarder=self.triton,
            backend=Backend(self.clock),
            clock=self.clock,
            on_done=lambda req, outcome, err, version: self.done.append((req, outcome, err)),
            stalled_stream_s=STALLED_S,
        )
        self._ids = 0

    def submit(self, tenant: str) -> CoreRequest:
        self._ids += 1
        text = Tensor("text_input", "BYTES", (1,), np.array([b"hi"], dtype=object))
        request = InferRequest("llm", id=f"{tenant}:{self._ids}", inputs=[text])
        call = Call(
            self._ids, tenant, 1, time.monotonic(), time.time(), 1, 1, 2, [1], request, True
        )
        req = CoreRequest(tenant, 1, 1, 2, 1, None, None, call=call, route=RecordingRoute())
        self.runtime.submit(req)
        return req

    async def settle(self) -> None:
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(0)

    async def close(self) -> None:
        """End every stream; a request still held back for its client is answered by the
        drain (no task outlives the test)."""
        self.runtime.fail_queued(Unavailable("test over"))
        for stream in self.triton.streams:
            if not stream.closed:
                stream.end()
        await self.runtime.drain(timeout_s=0.5)


def answers(req: CoreRequest) -> RecordingRoute:
    route = req.route
    assert isinstance(route, RecordingRoute)
    return route


def stream_of(s: Streams, tenant: str) -> Stream:
    (stream,) = s.triton.open(tenant)
    return stream


async def test_a_client_that_takes_nothing_gets_a_window_and_triton_is_not_read() -> None:
    s = Streams()
    req = s.submit("a")
    await s.settle()
    stream = stream_of(s, "a")
    for _ in range(100):
        stream.token()
    await s.settle()
    assert len(answers(req).answers) == ANSWER_WINDOW
    assert not any(a.final for a in answers(req).answers)
    # The core took one more reply from Triton's stream (waiting for room), no further:
    # the rest waits in Triton (gRPC's flow control holds its sender).
    assert stream.replies.qsize() == 100 - ANSWER_WINDOW - 1
    assert req.unread == ANSWER_WINDOW and not s.done
    await s.close()


async def test_what_the_client_takes_lets_as_much_through_and_all_arrives_once() -> None:
    s = Streams()
    req = s.submit("a")
    await s.settle()
    stream = stream_of(s, "a")
    for _ in range(100):
        stream.token()
    stream.end()
    await s.settle()
    taken = 0
    while not answers(req).answers[-1].final:
        sent = len(answers(req).answers)
        assert sent - taken <= ANSWER_WINDOW + 1  # a window of parts, and the final
        for _ in range(min(3, sent - taken)):  # the client reads 3 at a time
            req.parts_read(1)
            taken += 1
        await s.settle()
    parts = [a for a in answers(req).answers if not a.final]
    assert len(parts) == 101  # 100 tokens and Triton's empty final response
    assert [a.final for a in answers(req).answers].count(True) == 1
    assert answers(req).answers[-1].fault is None
    assert [(r, o) for r, o, _ in s.done] == [(req, Outcome.DISPATCHED)]
    await s.close()


async def test_a_client_that_takes_nothing_for_stalled_stream_s_is_cancelled_in_triton() -> None:
    s = Streams(slots=1)
    req = s.submit("a")
    waiting = s.submit("b")  # queued for the one slot
    await s.settle()
    stream = stream_of(s, "a")
    for _ in range(ANSWER_WINDOW + 5):
        stream.token()
    await s.settle()
    s.clock.advance(STALLED_S * 0.99)
    await s.settle()
    assert not s.done and not stream.closed  # not yet
    s.clock.advance(STALLED_S * 0.02)
    await s.settle()
    final = answers(req).answers[-1]
    assert final.final and final.fault is not None
    assert final.fault.kind == "StalledStream" and final.fault.outcome == "cancelled"
    assert "queues.stalled_stream_s" in final.fault.message
    assert len(answers(req).answers) == ANSWER_WINDOW + 1  # the window, then its end
    assert [(r, o) for r, o, _ in s.done] == [(req, Outcome.CANCELLED)]
    assert stream.closed  # its stream to Triton is closed: cancelled there
    # Its slot is free: the request waiting for it has it now.
    assert len(s.triton.open("b")) == 1 and waiting.dispatched_at is not None
    await s.close()


async def test_a_client_that_keeps_taking_however_slowly_is_never_cancelled() -> None:
    s = Streams()
    req = s.submit("a")
    await s.settle()
    stream = stream_of(s, "a")
    for _ in range(ANSWER_WINDOW + 20):
        stream.token()
    stream.end()
    await s.settle()
    for _ in range(10):  # one part taken a little before each stall would be declared
        s.clock.advance(STALLED_S * 0.9)
        req.parts_read(1)
        await s.settle()
        assert not s.done
    while not answers(req).answers[-1].final:
        req.parts_read(ANSWER_WINDOW)
        await s.settle()
    assert answers(req).answers[-1].fault is None
    assert [(r, o) for r, o, _ in s.done] == [(req, Outcome.DISPATCHED)]
    await s.close()


async def test_a_client_that_goes_away_while_held_back_ends_once_and_closes_the_stream() -> None:
    s = Streams()
    req = s.submit("a")
    await s.settle()
    stream = stream_of(s, "a")
    for _ in range(ANSWER_WINDOW + 5):
        stream.token()
    await s.settle()
    s.runtime.cancel(req)
    await s.settle()
    assert stream.closed
    assert [(r, o) for r, o, _ in s.done] == [(req, Outcome.CANCELLED)]
    assert not any(a.final for a in answers(req).answers)  # nobody to answer
    s.clock.advance(STALLED_S * 2)  # the stall timer is gone with it
    await s.settle()
    assert len(s.done) == 1
    await s.close()
