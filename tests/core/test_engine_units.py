"""Engine mode's dispatch on a fake clock: slots, reserved slots, charge-back as tokens stream.

An ``EndpointRuntime`` for a decoupled ``llm`` in engine mode (``max_inflight``), its
scheduler on virtual token counters, and a fake Triton whose streams emit a token
whenever the test says so: who holds which slot is read at every step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence

import grpc
import numpy as np
from dispatch_support import SETTLE_ROUNDS, RecordingRoute, StepClock

from fair_frontend.config import CostUnit, Endpoint
from fair_frontend.core.dispatch import Backend, CoreRequest, EndpointRuntime
from fair_frontend.errors import DeadlineExceeded, FrontendError, Unavailable, UpstreamError
from fair_frontend.forwarder import NoProgress, StreamReply
from fair_frontend.models import ModelInfo, TensorSpec
from fair_frontend.protocol import InferRequest, ParamValue, RequestedOutput, Tensor
from fair_frontend.records import Call
from fair_frontend.scheduler import (
    EndpointPolicy,
    GlobalCaps,
    Scheduler,
    TenantSpec,
    VirtualTokenCounter,
)
from fair_frontend.upstream import upstream_message_error

LLM = ModelInfo(
    name="llm",
    max_batch_size=0,
    inputs={"text_input": TensorSpec("text_input", "BYTES", (1,))},
    outputs={"text_output": TensorSpec("text_output", "BYTES", (-1,))},
    decoupled=True,
)


class Stream:
    """One request's stream to the fake engine; the test makes it emit and end."""

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.replies: asyncio.Queue[StreamReply] = asyncio.Queue()
        self.closed = False

    def token(self) -> None:
        data = np.array([b"x"], dtype=object)
        self.replies.put_nowait(StreamReply("1", [Tensor("text_output", "BYTES", (1,), data)]))

    def end(self) -> None:
        self.replies.put_nowait(StreamReply("1", [], final=True))


class FakeEngine:
    """A ``Forwarder`` for a decoupled model: every stream waits on the test."""

    def __init__(self) -> None:
        self.streams: list[Stream] = []

    def open(self, tenant: str) -> list[Stream]:
        return [s for s in self.streams if s.tenant == tenant and not s.closed]

    async def infer(self, *args: object, **kwargs: object) -> tuple[str, list[Tensor]]:
        raise AssertionError("llm is decoupled: everything streams")

    async def stream(
        self,
        model: str,
        version: str,
        inputs: Sequence[Tensor],
        outputs: Sequence[RequestedOutput] | None,
        parameters: dict[str, ParamValue],
        request_id: str = "",
        sequence: Mapping[str, ParamValue] | None = None,
    ) -> AsyncIterator[StreamReply]:
        stream = Stream(request_id.split(":")[0])
        self.streams.append(stream)
        try:
            while True:
                reply = await stream.replies.get()
                yield reply
                if reply.final:
                    return
        finally:
            stream.closed = True


class Engine:
    """The runtime of ``llm`` in engine mode, wired as ``Core._runtime`` wires it."""

    def __init__(self, *, slots: int, reserved: int) -> None:
        self.clock = StepClock()
        self.triton = FakeEngine()
        self.endpoint = Endpoint(
            cost=CostUnit.TOKENS,
            max_inflight=slots,
            reserved_slots=reserved,
            token_output="text_output",
        )
        policy = EndpointPolicy(CostUnit.TOKENS, 0, None, None, ("paid",))
        tenants = {t: TenantSpec("paid") for t in ("a", "b")}
        self.scheduler = Scheduler(policy, tenants, GlobalCaps(), fairness=VirtualTokenCounter())
        self.runtime = EndpointRuntime(
            model="llm",
            info=LLM,
            endpoint=self.endpoint,
            scheduler=self.scheduler,
            forwarder=self.triton,
            backend=Backend(self.clock),
            clock=self.clock,
            on_tokens=lambda req, n: self.scheduler.charge_back(req.tenant, float(n)),
        )
        self._ids = 0

    def submit(self, tenant: str, prompt_tokens: int) -> CoreRequest:
        self._ids += 1
        text = Tensor("text_input", "BYTES", (1,), np.array([b"hi"], dtype=object))
        request = InferRequest("llm", id=f"{tenant}:{self._ids}", inputs=[text])
        call = Call(
            self._ids,
            tenant,
            1,
            time.monotonic(),
            time.time(),
            1,
            prompt_tokens,
            2,
            [prompt_tokens],
            request,
            True,
        )
        req = CoreRequest(
            tenant, 1, prompt_tokens, 2, 1, None, None, call=call, route=RecordingRoute()
        )
        self.runtime.submit(req)
        return req

    async def settle(self) -> None:
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(0)

    async def close(self) -> None:
        """Answer what is queued and end every stream: no task outlives the test."""
        self.runtime.fail_queued(Unavailable("test over"))
        for stream in self.triton.streams:
            if not stream.closed:
                stream.end()
        await self.runtime.drain()


def counters(e: Engine) -> dict[str, float]:
    return e.scheduler.deficits()


async def test_no_tenant_holds_more_than_max_inflight_less_the_reserved_slots() -> None:
    e = Engine(slots=3, reserved=1)
    for _ in range(5):
        e.submit("a", 1)
    await e.settle()
    assert len(e.triton.open("a")) == 2  # its cap: the third slot is kept from a
    assert e.runtime.inflight == 2 and e.scheduler.depth("a") == 3
    for _ in range(3):
        e.submit("b", 1)
    await e.settle()
    # b joins lifted to a's counter (2: no credit for having been idle) and a, earlier
    # in line at the same counter, stays next: the slot waits for the order to change.
    assert counters(e) == {"a": 2.0, "b": 2.0}
    assert len(e.triton.open("b")) == 0
    e.triton.open("a")[0].token()  # a: 3, b is next and takes the kept slot at once
    await e.settle()
    assert len(e.triton.open("b")) == 1
    assert e.runtime.inflight == 3  # every slot busy: b's next ones wait for a turnover
    e.triton.open("a")[0].end()
    await e.settle()
    # The freed slot: a (under its cap again) and b were both at 3; a was charged longer
    # ago, so it was next, and has been charged its next request's input.
    assert counters(e) == {"a": 4.0, "b": 3.0}
    assert (len(e.triton.open("a")), len(e.triton.open("b"))) == (2, 1)
    await e.close()


async def test_a_held_back_slot_is_given_as_soon_as_the_order_changes() -> None:
    """a holds its cap and is next in line (least served); b's request waits while a
    free slot is held back. a's streamed tokens raise its counter past b's: the slot goes
    to b at that very token, not when one of a's generations ends."""
    e = Engine(slots=4, reserved=2)
    for _ in range(4):
        e.submit("a", 1)
    await e.settle()
    e.submit("b", 10)
    e.submit("b", 10)
    await e.settle()
    e.triton.open("a")[0].token()  # a: 3 > b's 2: b's first takes a slot (b: 12)
    await e.settle()
    assert counters(e) == {"a": 3.0, "b": 12.0}
    assert (len(e.triton.open("a")), len(e.triton.open("b"))) == (2, 1)  # one slot waits
    for _ in range(8):  # a: 11, still behind b: the slot stays held
        e.triton.open("a")[0].token()
    await e.settle()
    assert len(e.triton.open("b")) == 1
    e.triton.open("a")[1].token()
    e.triton.open("a")[1].token()  # a: 13 > 12: b is next, and gets the slot now
    await e.settle()
    assert len(e.triton.open("b")) == 2
    assert len(e.triton.open("a")) == 2  # none of a's generations has ended
    await e.close()


# ---- what marks Triton down: a failure to reach it, never a request's own answer -------


async def test_a_streams_own_error_fails_it_alone_and_marks_nothing_down() -> None:
    """The model's error for one request, Triton's answer that the model is not ready, a
    stream without progress for request_timeout_s: that request's answer alone. A
    failure to reach Triton (a transport error) marks it down."""
    e = Engine(slots=4, reserved=0)
    errors = [
        UpstreamError("llm engine: cannot sample ...", grpc.StatusCode.INTERNAL, 500),
        upstream_message_error("llm engine is not ready: it is restarting after a failure"),
        NoProgress(60.0),
    ]
    reqs = [e.submit("a", 1) for _ in errors]
    await e.settle()
    streams = e.triton.open("a")
    for stream, err in zip(streams, errors, strict=True):
        stream.token()
        stream.replies.put_nowait(StreamReply(error=err))
    await e.settle()
    for req, err in zip(reqs, errors, strict=True):
        (last,) = [a for a in req.route.answers if a.final]  # type: ignore[attr-defined]
        assert last.fault is not None and last.fault.message == err.message
    assert errors[1].grpc_code is grpc.StatusCode.UNAVAILABLE  # 503, not 500
    assert errors[2].grpc_code is grpc.StatusCode.UNAVAILABLE
    assert e.runtime.backend.available
    lost = e.submit("b", 1)
    await e.settle()
    e.triton.open("b")[0].replies.put_nowait(StreamReply(error=Unavailable("connection reset")))
    await e.settle()
    assert lost.answered and not e.runtime.backend.available
    await e.close()


class UnaryEngine:
    """A non-decoupled engine (one request per call): every call fails with ``error``."""

    def __init__(self, error: FrontendError) -> None:
        self.error = error
        self.calls = 0

    async def infer(self, *args: object, **kwargs: object) -> tuple[str, list[Tensor]]:
        self.calls += 1
        raise self.error

    def stream(self, *args: object, **kwargs: object) -> AsyncIterator[StreamReply]:
        raise AssertionError("not decoupled")


async def test_in_engine_mode_a_call_past_its_deadline_fails_that_request_alone() -> None:
    """A unary engine (TensorRT-LLM without streaming): a generation longer than
    request_timeout_s is that request's timeout, not a sign that Triton is down."""
    clock = StepClock()
    triton = UnaryEngine(DeadlineExceeded("Triton is unavailable: Deadline Exceeded"))
    info = ModelInfo(
        name="llm",
        max_batch_size=0,
        inputs=LLM.inputs,
        outputs=LLM.outputs,
    )
    policy = EndpointPolicy(CostUnit.REQUESTS, 0, None, None, ("paid",))
    scheduler = Scheduler(policy, {"a": TenantSpec("paid")}, GlobalCaps())
    runtime = EndpointRuntime(
        model="llm",
        info=info,
        endpoint=Endpoint(max_inflight=2),
        scheduler=scheduler,
        forwarder=triton,
        backend=Backend(clock),
        clock=clock,
    )
    text = Tensor("text_input", "BYTES", (1,), np.array([b"hi"], dtype=object))
    request = InferRequest("llm", id="a:1", inputs=[text])
    call = Call(1, "a", 1, time.monotonic(), time.time(), 1, 1, 2, [1], request, False)
    req = CoreRequest("a", 1, 1, 2, 1, None, None, call=call, route=RecordingRoute())
    runtime.submit(req)
    for _ in range(SETTLE_ROUNDS):
        await asyncio.sleep(0)
    assert triton.calls == 1 and req.answered
    (answer,) = req.route.answers  # type: ignore[attr-defined]
    assert answer.fault is not None and "Deadline Exceeded" in answer.fault.message
    assert runtime.backend.available
    await runtime.drain()
