"""Engine mode's dispatch on a fake clock: slots, reserved slots, charge-back as tokens stream.

An ``EngineDispatcher`` for a decoupled ``llm`` in engine mode (``max_inflight``), its
scheduler on virtual token counters, and a fake shell that relays each granted stream
(one hop: ``records.Grant``) and reports a token whenever the test says so: who holds
which slot is read at every step.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import cast

import grpc
import numpy as np
from dispatch_support import SETTLE_ROUNDS, Probe, RecordingRoute, StepClock, plan_of

from fair_frontend.backends.triton.upstream import upstream_message_error
from fair_frontend.backends.triton.watchdog import NoProgress
from fair_frontend.config import CostUnit, Endpoint
from fair_frontend.core.dispatch import Backend, CoreRequest
from fair_frontend.core.engine import EngineDispatcher
from fair_frontend.errors import DeadlineExceeded, FrontendError, Unavailable, UpstreamError
from fair_frontend.models import ModelInfo, TensorSpec
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.scheduler import (
    EndpointPolicy,
    GlobalCaps,
    Scheduler,
    TenantSpec,
    VirtualTokenCounter,
)
from fair_frontend.wire.records import Answer, Call, Grant

LLM = ModelInfo(
    name="llm",
    max_batch_size=0,
    inputs={"text_input": TensorSpec("text_input", "BYTES", (1,))},
    outputs={"text_output": TensorSpec("text_output", "BYTES", (-1,))},
    decoupled=True,
)


class Stream:
    """One granted request's stream, as its shell relays it: the test makes it emit and
    end, and the shell reports to the runtime as the real one does."""

    def __init__(self, runtime: EngineDispatcher, req: CoreRequest) -> None:
        self.runtime = runtime
        self.req = req
        self.tenant = req.tenant
        self.closed = False

    def token(self, n: int = 1) -> None:
        self.runtime.produced(self.req, n)

    def end(self) -> None:
        self.closed = True
        self.runtime.ended(self.req, "1", None, False)

    def fail(self, err: FrontendError) -> None:
        self.closed = True
        self.runtime.ended(self.req, "", err, False)

    def cancel(self) -> None:
        self.closed = True
        self.runtime.ended(self.req, "", None, True)


class FakeShell:
    """The ``Route`` of every request: a grant opens a ``Stream``; answers are kept."""

    def __init__(self) -> None:
        self.runtime: EngineDispatcher | None = None
        self.reqs: dict[int, CoreRequest] = {}
        self.streams: list[Stream] = []
        self.answers: list[Answer] = []
        self.grants: list[Grant] = []

    def answer(self, answer: Answer | Grant) -> None:
        if isinstance(answer, Grant):
            assert self.runtime is not None
            self.grants.append(answer)
            self.streams.append(Stream(self.runtime, self.reqs[answer.id]))
        else:
            self.answers.append(answer)

    def open(self, tenant: str) -> list[Stream]:
        return [s for s in self.streams if s.tenant == tenant and not s.closed]


class NoTriton:
    """The core never calls Triton for a decoupled model: its shells do."""

    async def infer(self, *args: object, **kwargs: object) -> tuple[str, list[Tensor]]:
        raise AssertionError("llm is decoupled: its shell streams it")


class Engine:
    """The runtime of ``llm`` in engine mode, wired as ``Core._runtime`` wires it."""

    def __init__(
        self,
        *,
        slots: int,
        reserved: int,
        max_outage_s: float = 60.0,
        light: int = 0,
        silent_after_s: float | None = None,
    ) -> None:
        self.clock = StepClock()
        self.probe = Probe(self.clock)  # Triton's readiness, once it is down
        self.triton = FakeShell()
        self.done: list[tuple[CoreRequest, Outcome, FrontendError | None]] = []
        self.endpoint = Endpoint(
            cost=CostUnit.TOKENS,
            max_inflight=slots,
            reserved_slots=reserved,
            light_slots=light,
            token_output="text_output",
        )
        policy = EndpointPolicy(CostUnit.TOKENS, 0, None, None, ("paid",))
        tenants = {t: TenantSpec("paid") for t in ("a", "b", "c")}
        self.scheduler = Scheduler(policy, tenants, GlobalCaps(), fairness=VirtualTokenCounter())
        self.runtime = EngineDispatcher(
            plan=plan_of(self.endpoint, LLM, "llm"),
            scheduler=self.scheduler,
            forwarder=NoTriton(),
            backend=Backend(self.clock, probe=self.probe, max_outage_s=max_outage_s),
            clock=self.clock,
            on_done=lambda req, outcome, err, version: self.done.append((req, outcome, err)),
            on_tokens=self._charge,
            silent_after_s=silent_after_s,
        )
        self.charged: list[tuple[str, int]] = []
        self.triton.runtime = self.runtime
        self._ids = 0

    def submit(self, tenant: str, prompt_tokens: int, program: str = "") -> CoreRequest:
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
            tenant, 1, prompt_tokens, 2, 1, None, None, program, call=call, route=self.triton
        )
        self.triton.reqs[call.id] = req
        self.runtime.submit(req)
        return req

    def _charge(self, req: CoreRequest, tokens: int) -> None:
        self.charged.append((req.tenant, tokens))
        self.scheduler.charge_back(req.tenant, float(tokens), req.program)

    def outcomes(self, req: CoreRequest) -> list[Outcome]:
        return [outcome for r, outcome, _ in self.done if r is req]

    async def settle(self) -> None:
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        """Move the fake time on, timer by timer, letting the tasks run after each."""
        until = self.clock.now() + seconds
        await self.settle()
        while (due := self.clock.next_timer) is not None and due <= until:
            self.clock.advance_to(due)
            await self.settle()
        self.clock.advance_to(until)
        await self.settle()

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


async def test_the_light_slots_go_to_programs_holding_none_the_fairest_first() -> None:
    """4 slots, 1 light. An agent's calls take 3 and wait for the fourth; a chat's call
    (its program holds no slot) takes it at once; the chat's next call waits, as its
    program holds a slot now. The kept slot, once free, waits for a light call however
    long the agent's queue; a slot freed beyond it goes to the next in line."""
    e = Engine(slots=4, reserved=0, light=1)
    for _ in range(6):
        e.submit("a", 1, "agent")
    await e.settle()
    assert len(e.triton.open("a")) == 3 and e.scheduler.depth("a") == 3
    e.submit("c", 1, "chat")
    e.submit("c", 1, "chat")
    await e.settle()
    assert [s.req.program for s in e.triton.open("c")] == ["chat"]  # at once, one slot
    assert e.runtime.inflight == 4 and e.scheduler.depth("c") == 1
    e.triton.open("a")[0].end()  # 1 free, the kept one: no light call queued, none goes
    await e.settle()
    assert e.runtime.inflight == 3
    # c joined lifted to a's counter and was charged its chat's input: a is next in line.
    assert counters(e) == {"a": 3.0, "c": 4.0}
    e.triton.open("c")[0].end()  # 2 free: a's agent takes one, c's chat (light now) the last
    await e.settle()
    assert [s.req.program for s in e.triton.open("a")] == ["agent"] * 3
    assert [s.req.program for s in e.triton.open("c")] == ["chat"]
    e.submit("b", 1, "chat")  # every slot busy: it waits for one
    await e.settle()
    assert e.triton.open("b") == []
    e.triton.open("a")[0].end()  # the kept slot again: b's chat, not a's agents
    await e.settle()
    assert [s.req.program for s in e.triton.open("b")] == ["chat"]
    assert e.scheduler.depth("a") == 2
    await e.close()


async def test_the_throttle_is_told_which_calls_may_take_a_light_slot() -> None:
    """``light_place`` (``EngineThrottle``'s ``light``): None for a call of a program
    that holds a slot or queues calls, or where no slot is light; else the rivals that
    a light slot may go to first (a head of each other tenant with work queued), and
    the call itself."""
    e = Engine(slots=4, reserved=0, light=1)
    for _ in range(6):
        e.submit("a", 1, "agent")
    await e.settle()
    assert len(e.triton.open("a")) == 3 and e.scheduler.depth("a") == 3
    place = e.runtime.light_place
    assert place("a", "agent") is None  # it holds slots and queues calls
    assert place("a", "chat") == 1  # its own tenant's queue is no rival
    assert place("c", "chat") == 2  # a's head may take the light slot first
    e.submit("c", 1, "chat")
    await e.settle()
    assert [s.req.program for s in e.triton.open("c")] == ["chat"]  # the light slot
    assert place("c", "chat") is None  # it holds one
    e.submit("b", 1, "chat")  # every slot busy: it waits
    await e.settle()
    assert place("b", "chat") is None  # queued
    assert place("c", "other") == 3  # a's and b's heads
    plain = Engine(slots=4, reserved=0)
    assert plain.runtime.light_place("c", "chat") is None  # no slot is light
    await plain.close()
    await e.close()


async def test_without_light_slots_a_chat_waits_for_a_turnover() -> None:
    """The control: the same agents fill every slot, and the chat's call waits."""
    e = Engine(slots=4, reserved=0)
    for _ in range(6):
        e.submit("a", 1, "agent")
    await e.settle()
    e.submit("c", 1, "chat")
    await e.settle()
    assert len(e.triton.open("a")) == 4 and len(e.triton.open("c")) == 0
    await e.close()


async def test_a_stream_its_shell_went_silent_on_is_taken_back_and_its_slot_reused() -> None:
    """Two slots, both granted; one stream's shell reports tokens, the other's says
    nothing (its relay lost). Past ``silent_after_s`` (40 s here), the silent
    one is failed UNAVAILABLE to its shell (the revoke a live relay stops on) and its slot
    goes to the queued call; the talking one, and the new one, run on."""
    e = Engine(slots=2, reserved=0, silent_after_s=40.0)
    talking, silent = e.submit("a", 1), e.submit("b", 1)
    queued = e.submit("a", 1)
    await e.settle()
    assert e.runtime.inflight == 2 and e.scheduler.depth("a") == 1
    stream = next(s for s in e.triton.streams if s.req is talking)
    for _ in range(12):  # 60 s, a token every 5 s
        stream.token()
        await e.advance(5.0)
    assert e.outcomes(silent) == [Outcome.FAILED]
    (revoke,) = [a for a in e.triton.answers if a.id == silent.call.id]
    assert revoke.fault is not None and "said nothing of it" in revoke.fault.message
    assert e.outcomes(talking) == [] and not talking.answered
    assert [s.req for s in e.triton.streams if not s.closed and s.req is not silent] == [
        talking,
        queued,
    ]
    assert e.runtime.inflight == 2
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
        stream.fail(err)
    await e.settle()
    for req, err in zip(reqs, errors, strict=True):
        assert [(o, x) for r, o, x in e.done if r is req] == [(Outcome.FAILED, err)]
    assert errors[1].grpc_code is grpc.StatusCode.UNAVAILABLE  # 503, not 500
    assert errors[2].grpc_code is grpc.StatusCode.UNAVAILABLE
    assert e.runtime.backend.available and e.runtime.inflight == 0
    assert not e.triton.answers  # the shell answered its clients: the core adds nothing
    lost = e.submit("b", 1)
    await e.settle()
    e.triton.open("b")[0].fail(Unavailable("connection reset"))
    await e.settle()
    assert lost.answered and not e.runtime.backend.available
    await e.close()


# ---- one hop: the slot is the shell's until it says the stream ended -------------------


async def test_a_granted_stream_holds_its_slot_until_its_shell_says_it_ended() -> None:
    """The grant is the core's one answer; tokens reported are charged to the tenant as
    they come (the fair share sees them before the stream ends); the end frees the slot
    and counts the outcome once, whatever the shell says after."""
    e = Engine(slots=1, reserved=0)
    first, second = e.submit("a", 1), e.submit("b", 1)
    await e.settle()
    assert [g.id for g in e.triton.grants] == [first.call.id] and e.runtime.inflight == 1
    (stream,) = e.triton.open("a")
    stream.token(5)
    assert e.charged == [("a", 5)] and first.produced == 5
    assert not e.triton.open("b")  # the one slot is a's until its stream ends
    stream.end()
    stream.end()  # a second end (a late duplicate) changes nothing
    await e.settle()
    assert e.outcomes(first) == [Outcome.DISPATCHED]
    assert [g.id for g in e.triton.grants] == [first.call.id, second.call.id]
    e.triton.open("b")[0].cancel()  # its client went away
    await e.settle()
    assert e.outcomes(second) == [Outcome.CANCELLED] and e.runtime.inflight == 0
    assert not e.triton.answers
    await e.close()


async def test_a_shell_gone_returns_every_slot_its_streams_held() -> None:
    """A shell process dies while it relays streams (its connection closes): the core
    drops its route, and every slot its streams held is free at once, each request
    counted once, as cancelled; another shell's stream is untouched."""
    e = Engine(slots=4, reserved=0)
    other = FakeShell()
    other.runtime = e.runtime
    mine = [e.submit("a", 1) for _ in range(3)]
    e._ids += 1
    text = Tensor("text_input", "BYTES", (1,), np.array([b"hi"], dtype=object))
    call = Call(e._ids, "b", 1, time.monotonic(), time.time(), 1, 1, 2, [1],
                InferRequest("llm", id="b:x", inputs=[text]), True)  # fmt: skip
    theirs = CoreRequest("b", 1, 1, 2, 1, None, None, call=call, route=other)
    other.reqs[call.id] = theirs
    e.runtime.submit(theirs)
    await e.settle()
    assert e.runtime.inflight == 4
    assert e.runtime.drop(e.triton) == 3
    await e.settle()
    assert e.runtime.inflight == 1
    assert all(e.outcomes(r) == [Outcome.CANCELLED] for r in mine)
    for stream in e.triton.streams:
        stream.end()  # what a dead shell can no longer say: ignored if it did
    await e.settle()
    assert all(e.outcomes(r) == [Outcome.CANCELLED] for r in mine)
    other.streams[0].end()
    await e.settle()
    assert e.outcomes(theirs) == [Outcome.DISPATCHED] and e.runtime.inflight == 0
    await e.close()


async def test_a_drain_that_stops_waiting_takes_the_slot_back() -> None:
    """Shutdown: a stream still running when the drain's time is up is answered with the
    reason (the shell ends it on that answer), once."""
    e = Engine(slots=1, reserved=0)
    req = e.submit("a", 1)
    await e.settle()
    await e.runtime.drain(0.0, Unavailable("the frontend is shutting down"))
    (answer,) = e.triton.answers
    assert answer.id == req.call.id and answer.fault is not None
    assert answer.fault.kind == "Unavailable"
    assert e.outcomes(req) == [Outcome.FAILED] and e.runtime.inflight == 0
    e.triton.open("a")[0].end()  # the shell's end, after: ignored
    assert e.outcomes(req) == [Outcome.FAILED]
    await e.close()


async def test_a_client_gone_before_its_streams_grant_went_out_frees_the_slot() -> None:
    """Its slot was taken (the task that sends the grant made) and its client went away
    before that task ran: the request ends once, cancelled, no grant goes out, and the
    slot serves the next in line. (A task cancelled before its first step never runs: the
    slot stayed taken for ever, and under load, with clients dropping their calls, every
    slot in time.)"""
    e = Engine(slots=1, reserved=0)
    gone = e.submit("a", 1)  # granted at once: one slot, free
    assert e.runtime.inflight == 1 and not e.triton.grants  # its grant not sent yet
    e.runtime.cancel(gone)
    nxt = e.submit("b", 1)
    await e.settle()
    assert e.outcomes(gone) == [Outcome.CANCELLED]
    assert [g.id for g in e.triton.grants] == [nxt.call.id] and e.runtime.inflight == 1
    e.triton.open("b")[0].end()
    await e.settle()
    assert e.outcomes(nxt) == [Outcome.DISPATCHED] and e.runtime.inflight == 0
    await e.close()


async def test_a_drain_out_of_time_answers_a_grant_not_yet_sent() -> None:
    """Shutdown with no time left, a slot taken and its grant not sent yet: that request
    is answered with the reason too, and its slot given back."""
    e = Engine(slots=1, reserved=0)
    req = e.submit("a", 1)
    assert e.runtime.inflight == 1 and not e.triton.grants
    await e.runtime.drain(0.0, Unavailable("the frontend is shutting down"))
    (answer,) = e.triton.answers
    assert answer.id == req.call.id and answer.fault is not None
    assert e.outcomes(req) == [Outcome.FAILED] and e.runtime.inflight == 0
    await e.close()


def never_reached() -> Unavailable:
    """A granted stream's shell could not reach its Triton: nothing reached its client."""
    return Unavailable("Triton is unavailable: not connected within 2 s", never_sent=True)


async def test_a_stream_whose_triton_is_gone_waits_for_it_with_its_slot() -> None:
    """One Triton, gone when a stream was granted (its shell could not reach it): the
    stream is not answered but held with its slot, and granted again, ahead of the queue,
    once Triton is back (its probe); served, it is counted once."""
    e = Engine(slots=1, reserved=0)
    first, second = e.submit("a", 1), e.submit("b", 1)
    await e.settle()
    e.triton.open("a")[0].fail(never_reached())
    await e.advance(1.0)
    assert not e.runtime.backend.available and e.probe.calls  # probed: not back yet
    assert [g.id for g in e.triton.grants] == [first.call.id]
    assert not e.triton.answers and not e.done  # neither answered
    assert e.runtime.inflight == 1 and e.runtime.running == [0]  # its slot, held
    e.probe.ready = True
    await e.advance(1.0)
    assert [g.id for g in e.triton.grants] == [first.call.id] * 2  # again, before b's
    assert e.runtime.running == [1]
    e.triton.open("a")[0].end()
    await e.settle()
    assert e.outcomes(first) == [Outcome.DISPATCHED] and not e.triton.answers
    assert e.triton.grants[-1].id == second.call.id
    e.triton.open("b")[0].end()
    await e.settle()
    assert e.outcomes(second) == [Outcome.DISPATCHED] and e.runtime.inflight == 0
    await e.close()


async def test_a_stream_held_for_its_triton_is_answered_unavailable_after_max_outage() -> None:
    """The held stream waits as a batch would: once Triton has been gone ``max_outage_s``
    it is answered UNAVAILABLE (the answer its shell waits for), and so is what is
    queued."""
    e = Engine(slots=1, reserved=0, max_outage_s=5.0)
    first, second = e.submit("a", 1), e.submit("b", 1)
    await e.settle()
    e.triton.open("a")[0].fail(never_reached())
    await e.advance(4.0)
    assert not e.triton.answers and not e.done
    await e.advance(2.0)
    assert sorted(a.id for a in e.triton.answers) == [first.call.id, second.call.id]
    assert all(a.fault is not None and a.fault.kind == "Unavailable" for a in e.triton.answers)
    assert e.outcomes(first) == [Outcome.FAILED] and e.outcomes(second) == [Outcome.FAILED]
    assert e.runtime.inflight == 0 and e.runtime.running == [0]
    await e.close()


class UnaryEngine:
    """A non-decoupled engine (one request per call): every call fails with ``error``."""

    def __init__(self, error: FrontendError) -> None:
        self.error = error
        self.calls = 0

    async def infer(self, *args: object, **kwargs: object) -> tuple[str, list[Tensor]]:
        self.calls += 1
        raise self.error


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
    runtime = EngineDispatcher(
        plan=plan_of(Endpoint(max_inflight=2), info, "llm"),
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
    (answer,) = cast(RecordingRoute, req.route).answers
    assert answer.fault is not None and "Deadline Exceeded" in answer.fault.message
    assert runtime.backend.available
    await runtime.drain()


async def test_each_tenants_slots_are_counted_as_streams_start_and_end_however_they_end() -> None:
    """``in_engine`` (what the cap per tenant and the throttle read) is kept as streams
    are granted and end, not scanned: after every step it equals a scan of the slots,
    whether a stream ended, failed, was cancelled by its shell or its client went away."""
    rng = random.Random(30)
    e = Engine(slots=4, reserved=1)

    def scanned(tenant: str) -> int:
        return sum(1 for batch in e.runtime._tasks.values() for r in batch if r.tenant == tenant)

    for step in range(200):
        open_streams = [s for s in e.triton.streams if not s.closed]
        move = rng.random()
        if move < 0.4 or not open_streams:
            e.submit(rng.choice("ab"), rng.randint(1, 5))
        else:
            stream = rng.choice(open_streams)
            if move < 0.6:
                stream.end()
            elif move < 0.7:
                stream.fail(UpstreamError("the model's error", grpc.StatusCode.INTERNAL, 500))
            elif move < 0.8:
                stream.cancel()
            elif move < 0.9:
                stream.token(rng.randint(1, 3))
            else:
                stream.closed = True
                e.runtime.cancel(stream.req)  # its client went away
        await e.settle()
        for tenant in "ab":
            assert e.runtime.in_engine(tenant) == scanned(tenant), step
    await e.close()
    assert e.runtime.in_engine("a") == e.runtime.in_engine("b") == 0
