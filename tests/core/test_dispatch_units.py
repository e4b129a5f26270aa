"""Unit tests of one model's batch-mode dispatch (``BatchDispatcher``) and of ``Backend``.

On a fake clock and a fake Triton (``dispatch_support``): every Triton call waits for
the test to answer it, time moves only when the test says so, and the runtime's tasks
run on the test's event loop between steps. No real Triton, no sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest
from dispatch_support import (
    WIDTH,
    FixedService,
    Harness,
    RecordingRoute,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fair_frontend.config import Endpoint
from fair_frontend.core.dispatch import CoreRequest
from fair_frontend.errors import (
    MSG_TIMEOUT_EXPIRED,
    FrontendError,
    InvalidArgument,
    Unavailable,
    UpstreamError,
)
from fair_frontend.feedback import ServiceModel
from fair_frontend.outcomes import Outcome
from fair_frontend.scheduler import Counters
from fair_frontend.wire.records import Fault

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


def model_error(message: str = "model failed") -> UpstreamError:
    return UpstreamError(message, grpc.StatusCode.INTERNAL, 500)


def triton_down() -> Unavailable:
    return Unavailable("failed to connect to all addresses", never_sent=True)


@pytest.fixture
async def make() -> AsyncIterator[Callable[..., Harness]]:
    """Builds harnesses; stops what they left running when the test ends."""
    made: list[Harness] = []

    def build(*args: Any, **kwargs: Any) -> Harness:
        h = Harness(*args, **kwargs)
        made.append(h)
        return h

    yield build
    for h in made:
        await h.close()


def assert_served(h: Harness, req: CoreRequest) -> None:
    """One answer, the request's own rows of the batch's output, outcome DISPATCHED."""
    (answer,) = h.answers(req)
    assert answer.fault is None
    (out,) = answer.outputs
    assert out.name == "EMBEDDING" and out.shape == (req.rows, 4)
    assert np.all(out.data == req.call.id)  # its own rows, not a neighbour's
    assert h.outcomes(req) == [Outcome.DISPATCHED]


def fault_of(h: Harness, req: CoreRequest) -> Fault:
    """The one answer of ``req``, an error; its outcome matches the error's."""
    (answer,) = h.answers(req)
    assert answer.fault is not None and not answer.outputs
    assert h.outcomes(req) == [Outcome(answer.fault.outcome)]
    return answer.fault


def assert_unanswered(h: Harness, *reqs: CoreRequest) -> None:
    for req in reqs:
        assert h.answers(req) == [] and h.outcomes(req) == [], req.call.request.id


def ids(*reqs: CoreRequest) -> list[str]:
    return [r.call.request.id for r in reqs]


async def blocker(h: Harness) -> CoreRequest:
    """A lone request in Triton: what is submitted next queues, and goes as one batch
    when this one is answered (``h.triton.sent[-1].ok()``)."""
    req = h.submit("c")
    await h.settle()
    assert h.triton.batches()[-1] == ids(req)
    return req


async def hold_one_batch(h: Harness, *reqs: CoreRequest) -> None:
    """Answer the blocker in front of ``reqs``; their batch then never reaches Triton."""
    h.triton.sent[-1].ok()
    await h.settle()
    assert h.triton.batches()[-1] == ids(*reqs)
    h.triton.sent[-1].fail(triton_down())
    await h.settle()
    assert not h.backend.available


# ---- 1. every request is answered exactly once ------------------------------------------

TENANT_NAMES = ("a", "b", "c")

OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"),
            st.sampled_from(TENANT_NAMES),
            st.integers(1, 12),  # rows: three 12-row requests overflow a batch of 32
            st.sampled_from([None, None, 0.05, 0.3]),  # timeout (s)
            st.integers(0, 1),  # route
        ),
        st.tuples(st.just("cancel"), st.integers(0, 63)),
        st.tuples(st.just("drop"), st.integers(0, 1)),
        st.tuples(st.just("ok"), st.integers(0, 7)),
        st.tuples(st.just("model_error"), st.integers(0, 7)),
        st.tuples(st.just("down"), st.integers(0, 7)),  # never reached Triton (twice as
        st.tuples(st.just("down"), st.integers(0, 7)),  # likely: outages are the hard part)
        st.tuples(st.just("lost"), st.integers(0, 7)),  # Unavailable after it was sent
        st.tuples(st.just("advance"), st.sampled_from([0.001, 0.01, 0.1, 0.25, 0.6, 1.5])),
        st.tuples(st.just("ready"), st.sampled_from([True, False, False, False])),
    ),
    min_size=20,
    max_size=60,
)
# No service data here (no dispatch lead): with it an outage can hang the loop on the fake
# clock (test_no_busy_loop_when_the_lead_time_passes_while_triton_is_down).
SETUPS = st.fixed_dictionaries(
    {
        "max_inflight_batches": st.sampled_from([None, 2]),
        "max_queue_delay_ms": st.sampled_from([0.0, 5.0]),
    }
)


@dataclass
class Story:
    """What the property's operations did, for the checks at the end."""

    reqs: list[CoreRequest] = field(default_factory=list)
    gone: set[int] = field(default_factory=set)  # calls whose client left before an answer
    seen: set[str] = field(default_factory=set)  # what happened on the way (statistics)


async def play(setup: dict[str, Any], ops: list[tuple[Any, ...]]) -> tuple[Harness, Story]:
    h = Harness(Endpoint(**setup), max_outage_s=0.5)
    routes = [RecordingRoute("x"), RecordingRoute("y")]
    story = Story()
    cap = h.runtime.max_inflight
    try:
        for op, *args in ops:
            pending = h.triton.pending
            if op == "submit":
                tenant, rows, timeout_s, route = args
                story.reqs.append(
                    h.submit(tenant, rows=rows, timeout_s=timeout_s, route=routes[route])
                )
            elif op == "cancel" and story.reqs:
                req = story.reqs[args[0] % len(story.reqs)]
                if not req.answered:
                    story.gone.add(req.call.id)
                h.runtime.cancel(req)
            elif op == "drop":
                route = routes[args[0]]
                story.gone.update(
                    r.call.id for r in story.reqs if r.route is route and not r.answered
                )
                h.runtime.drop(route)
            elif op in ("ok", "model_error", "down", "lost") and pending:
                sent = pending[args[0] % len(pending)]
                if op == "ok":
                    sent.ok()
                elif op == "model_error":
                    sent.fail(model_error())
                elif op == "down":
                    sent.fail(triton_down())
                else:
                    sent.fail(Unavailable("connection reset"))
            elif op == "advance":
                await h.advance(args[0])
            elif op == "ready":
                h.probe.ready = args[0]
            await h.settle()
            # At most max_inflight batches in Triton (no service data: no early send).
            assert len(h.triton.pending) <= cap
            if h.runtime._held:
                story.seen.add("held a batch")
            if h.backend.gave_up:
                story.seen.add("gave up")
        # The end: Triton is back and answers everything it is sent.
        h.probe.ready = True
        for _ in range(1000):
            for sent in h.triton.pending:
                sent.ok()
            await h.advance(h.backend.probe_interval_s)
            if h.runtime.idle and not h.triton.pending and not h.runtime._held:
                break
        await h.advance(10.0)  # any timer still armed fires into an empty runtime
        return h, story
    finally:
        await h.close()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=SETUPS, ops=OPS)
def test_every_request_is_answered_exactly_once(
    setup: dict[str, Any], ops: list[tuple[Any, ...]]
) -> None:
    h, story = asyncio.run(play(setup, ops))
    for seen in story.seen | {f"outcome {f.outcome.value}" for f in h.finished}:
        event(seen)
    assert h.runtime.idle and h.runtime.inflight == 0 and not h.triton.pending
    for req in story.reqs:
        answers = h.answers(req)
        done = [f for f in h.finished if f.req is req]
        assert len(done) == 1, f"on_done called {len(done)} times for {req.call.request.id}"
        (finished,) = done
        assert req.answered
        if req.call.id in story.gone:  # its client went away before any answer
            assert answers == [] and finished.outcome is Outcome.CANCELLED
            continue
        assert len(answers) == 1
        fault = answers[0].fault
        if fault is None:
            assert finished.outcome is Outcome.DISPATCHED and finished.err is None
            assert np.all(answers[0].outputs[0].data == req.call.id)
        else:
            assert finished.err is not None and finished.outcome is finished.err.outcome
            assert Outcome(fault.outcome) is finished.outcome is not Outcome.CANCELLED
    c = h.scheduler.counters
    assert c.admitted == len(story.reqs) == c.dispatched + c.expired + c.cancelled
    assert len(h.finished) == len(story.reqs)


# ---- 2. the in-flight cap -----------------------------------------------------------------


async def test_one_instance_sends_the_next_batch_only_when_the_first_is_answered(
    make: Callable[..., Harness],
) -> None:
    h = make()
    r1 = h.submit("a")
    await h.settle()
    r2, r3 = h.submit("b"), h.submit("a")
    await h.advance(1.0)
    assert h.triton.batches() == [ids(r1)]
    assert h.runtime.inflight == 1 and h.scheduler.queued_requests == 2

    h.triton.sent[0].ok()
    await h.settle()
    assert_served(h, r1)
    assert h.triton.batches() == [ids(r1), ids(r2, r3)]  # the two queued, one batch
    h.triton.sent[1].ok()
    await h.settle()
    assert_served(h, r2)
    assert_served(h, r3)
    assert h.runtime.idle


@pytest.mark.parametrize(
    ("instances", "endpoint"),
    [(1, Endpoint(max_inflight_batches=2)), (2, Endpoint())],
    ids=["max_inflight_batches-2", "two-instances"],
)
async def test_two_batches_in_flight_when_the_cap_is_two(
    make: Callable[..., Harness], instances: int, endpoint: Endpoint
) -> None:
    h = make(endpoint, instances=instances)
    r1 = h.submit("a")
    await h.settle()
    r2 = h.submit("b")
    await h.settle()
    r3 = h.submit("c")
    await h.advance(1.0)
    assert h.triton.batches() == [ids(r1), ids(r2)]  # the third waits for a slot

    h.triton.sent[1].ok()  # the second answers first: its slot goes to the third
    await h.settle()
    assert h.triton.batches() == [ids(r1), ids(r2), ids(r3)]
    for sent in h.triton.pending:
        sent.ok()
    await h.settle()
    for r in (r1, r2, r3):
        assert_served(h, r)


# ---- 3. the dispatch lead -------------------------------------------------------------------


async def test_dispatch_lead_sends_one_extra_batch_lead_before_the_running_one_ends(
    make: Callable[..., Harness],
) -> None:
    h = make(service=FixedService(0.010))  # every batch predicted 10 ms; lead 3 ms
    t0 = h.clock.now()
    r1 = h.submit("a")
    await h.settle()
    r2 = h.submit("b")
    await h.advance_to(t0 + 0.007 - 1e-6)
    assert h.triton.batches() == [ids(r1)]  # not earlier

    await h.advance_to(t0 + 0.007)
    assert h.triton.batches() == [ids(r1), ids(r2)]
    assert h.triton.sent[1].at == pytest.approx(t0 + 0.007, abs=1e-9)

    r3 = h.submit("c")  # one extra batch only: r3 waits
    await h.advance_to(t0 + 0.010)
    assert h.triton.batches() == [ids(r1), ids(r2)]
    h.triton.sent[0].ok()  # on time: r2 (queued behind r1) is predicted to end at 20 ms
    await h.settle()
    assert_served(h, r1)
    await h.advance_to(t0 + 0.017 - 1e-6)
    assert h.triton.batches() == [ids(r1), ids(r2)]
    await h.advance_to(t0 + 0.017)  # 20 ms - 3 ms
    assert h.triton.batches() == [ids(r1), ids(r2), ids(r3)]
    for sent in h.triton.pending:
        sent.ok()
    await h.settle()
    for r in (r1, r2, r3):
        assert_served(h, r)


async def test_dispatch_lead_follows_the_learned_batch_time(
    make: Callable[..., Harness],
) -> None:
    service = ServiceModel("embed", max_batch_size=32)
    h = make(service=service)
    t = h.clock.now() - 10.0
    for _ in range(5):  # five batches of one row took 20 ms each
        service.observe_batch(1, WIDTH, t, t + 0.020, h.clock.now())
        t += 1.0
    assert service.has_data
    predicted = service.predict_batch_seconds(1, WIDTH)
    assert predicted > 0.003

    t0 = h.clock.now()
    r1 = h.submit("a")
    await h.settle()
    r2 = h.submit("b")
    await h.advance(predicted - 0.003 - 1e-6)
    assert h.triton.batches() == [ids(r1)]
    await h.advance_to(t0 + predicted - 0.003)
    assert h.triton.batches() == [ids(r1), ids(r2)]


async def test_no_dispatch_lead_without_service_data(make: Callable[..., Harness]) -> None:
    service = ServiceModel("embed", max_batch_size=32)
    assert not service.has_data
    h = make(service=service)
    r1 = h.submit("a")
    await h.settle()
    h.submit("b")
    await h.advance(5.0)
    assert h.triton.batches() == [ids(r1)]  # a slot must free up first


async def test_no_dispatch_lead_when_the_lead_is_zero(make: Callable[..., Harness]) -> None:
    h = make(Endpoint(dispatch_lead_ms=0), service=FixedService(0.010))
    r1 = h.submit("a")
    await h.settle()
    h.submit("b")
    await h.advance(5.0)
    assert h.triton.batches() == [ids(r1)]


async def test_no_busy_loop_when_the_lead_time_passes_while_triton_is_down(
    make: Callable[..., Harness],
) -> None:
    h = make(service=FixedService(0.010))
    t0 = h.clock.now()
    h.submit("a")
    await h.settle()
    h.triton.sent[0].fail(triton_down())  # held, with its slot; Triton is down
    await h.settle()
    h.submit("b")
    await h.advance_to(t0 + 0.010)  # past the lead time (7 ms) of the held batch
    assert len(h.triton.sent) == 1


async def test_dispatch_lead_counts_from_the_batches_still_in_flight(
    make: Callable[..., Harness],
) -> None:
    h = make(service=FixedService(0.010))
    t0 = h.clock.now()
    r1 = h.submit("a")
    await h.advance_to(t0 + 0.002)
    h.triton.sent[0].ok()  # done at 2 ms, predicted 10 ms
    await h.settle()
    assert_served(h, r1)
    r2 = h.submit("b")  # alone in Triton from 2 ms: predicted done at 12 ms
    await h.settle()
    r3 = h.submit("c")
    await h.advance_to(t0 + 0.009)  # 12 ms - 3 ms
    assert h.triton.batches() == [ids(r1), ids(r2), ids(r3)]


# ---- 4. max_queue_delay_ms ------------------------------------------------------------------

DELAYED = Endpoint(max_queue_delay_ms=5)


async def test_queue_delay_holds_a_lone_request_for_a_fuller_batch(
    make: Callable[..., Harness],
) -> None:
    h = make(DELAYED)
    t0 = h.clock.now()
    r1 = h.submit("a")
    await h.advance_to(t0 + 0.004)
    assert h.triton.sent == []
    r2 = h.submit("b")  # joins the waiting batch
    await h.advance_to(t0 + 0.005 - 1e-6)
    assert h.triton.sent == []
    await h.advance_to(t0 + 0.005)  # the oldest has waited the delay
    assert h.triton.batches() == [ids(r1, r2)]
    assert h.triton.sent[0].at == t0 + 0.005


async def test_queue_delay_sends_a_full_batch_at_once(make: Callable[..., Harness]) -> None:
    h = make(DELAYED)
    r1 = h.submit("a", rows=16)
    await h.settle()
    assert h.triton.sent == []
    r2 = h.submit("b", rows=16)  # 32 rows: a full batch
    await h.settle()
    assert h.triton.batches() == [ids(r1, r2)]
    assert h.triton.sent[0].at == r1.arrival


async def test_queue_delay_does_not_hold_while_a_batch_is_in_flight(
    make: Callable[..., Harness],
) -> None:
    h = make(Endpoint(max_queue_delay_ms=5, max_inflight_batches=2))
    r1 = h.submit("a")
    await h.advance(0.005)
    assert h.triton.batches() == [ids(r1)]
    r2 = h.submit("b")  # Triton is busy, a slot is free: no reason to wait
    await h.settle()
    assert h.triton.batches() == [ids(r1), ids(r2)]


async def test_queue_delay_sends_a_batch_full_by_tokens_at_once(
    make: Callable[..., Harness],
) -> None:
    h = make(Endpoint(max_queue_delay_ms=5, max_batch_tokens=2 * WIDTH))
    r1 = h.submit("a", rows=2)  # 2 rows of WIDTH tokens: the token cap, a full batch
    await h.settle()
    assert h.triton.batches() == [ids(r1)]


# ---- 5. deadlines ----------------------------------------------------------------------------


def assert_timed_out(h: Harness, req: CoreRequest) -> None:
    fault = fault_of(h, req)
    assert fault.message == MSG_TIMEOUT_EXPIRED
    assert fault.grpc_code == UNAVAILABLE and fault.http_status == 503
    assert h.outcomes(req) == [Outcome.EXPIRED]


async def test_a_queued_request_expires_exactly_at_its_deadline(
    make: Callable[..., Harness],
) -> None:
    h = make()
    r1 = h.submit("a")
    await h.settle()
    r2 = h.submit("b", timeout_s=0.05)  # queued behind r1
    assert r2.deadline is not None
    await h.advance_to(r2.deadline - 1e-6)
    assert_unanswered(h, r2)
    await h.advance_to(r2.deadline)
    assert_timed_out(h, r2)
    h.triton.sent[0].ok()
    await h.settle()
    assert h.triton.batches() == [ids(r1)]  # r2 never reached Triton
    assert h.scheduler.counters == Counters(admitted=2, dispatched=1, expired=1, cancelled=0)


async def test_a_request_held_by_the_queue_delay_expires_at_its_deadline(
    make: Callable[..., Harness],
) -> None:
    h = make(Endpoint(max_queue_delay_ms=100))
    r1 = h.submit("a", timeout_s=0.05)
    assert r1.deadline is not None
    await h.advance_to(r1.deadline - 1e-6)
    assert_unanswered(h, r1)
    await h.advance_to(r1.deadline)
    assert_timed_out(h, r1)
    await h.advance(1.0)
    assert h.triton.sent == []


async def test_a_request_held_through_an_outage_expires_at_its_deadline(
    make: Callable[..., Harness],
) -> None:
    h = make()
    r0 = await blocker(h)
    r1, r2 = h.submit("a", timeout_s=0.05), h.submit("b")
    await hold_one_batch(h, r1, r2)  # held: r1 and r2, with their slot
    assert_served(h, r0)
    assert r1.deadline is not None
    await h.advance_to(r1.deadline - 1e-6)
    assert_unanswered(h, r1, r2)
    await h.advance_to(r1.deadline)
    assert_timed_out(h, r1)
    assert_unanswered(h, r2)

    h.probe.ready = True  # back: the held batch goes without r1
    await h.advance(h.backend.probe_interval_s)
    assert h.triton.batches() == [ids(r0), ids(r1, r2), ids(r2)]
    h.triton.sent[2].ok()
    await h.settle()
    assert_served(h, r2)
    assert fault_of(h, r1).message == MSG_TIMEOUT_EXPIRED  # still its only answer


async def test_a_held_batch_whose_requests_all_expire_frees_its_slot(
    make: Callable[..., Harness],
) -> None:
    h = make()
    r1 = h.submit("a", timeout_s=0.05)
    await h.settle()
    h.triton.sent[0].fail(triton_down())
    await h.settle()
    assert h.runtime.inflight == 1
    assert r1.deadline is not None
    await h.advance_to(r1.deadline)
    assert_timed_out(h, r1)
    assert h.runtime.inflight == 0 and h.runtime.idle
    h.probe.ready = True
    await h.advance(1.0)
    assert len(h.triton.sent) == 1  # nothing to resend


# ---- 6. outage hold --------------------------------------------------------------------------


async def test_an_unsent_batch_is_held_while_triton_is_down_and_goes_first_when_back(
    make: Callable[..., Harness],
) -> None:
    h = make(probe_interval_s=0.25)
    r1 = h.submit("a")
    await h.settle()
    h.triton.sent[0].fail(triton_down())
    await h.settle()
    down_at = h.clock.now()
    assert not h.backend.available
    assert_unanswered(h, r1)
    assert h.runtime.inflight == 1  # held with its slot

    r2, r3 = h.submit("b"), h.submit("c")
    await h.advance(0.75)
    assert len(h.triton.sent) == 1  # nothing goes while Triton is down
    assert h.probe.calls == [down_at + 0.25, down_at + 0.5, down_at + 0.75]
    assert_unanswered(h, r1, r2, r3)

    h.probe.ready = True
    await h.advance_to(down_at + 1.0 - 1e-6)
    assert len(h.triton.sent) == 1  # back only once the probe says so
    await h.advance_to(down_at + 1.0)
    assert h.backend.available
    assert h.triton.batches() == [ids(r1), ids(r1)]  # the held batch first, alone
    h.triton.sent[1].ok()
    await h.settle()
    assert_served(h, r1)
    assert h.triton.batches() == [ids(r1), ids(r1), ids(r2, r3)]  # then the queue
    h.triton.sent[2].ok()
    await h.settle()
    assert_served(h, r2)
    assert_served(h, r3)
    assert h.probe.calls[-1] == down_at + 1.0 and len(h.probe.calls) == 4


async def test_a_probe_that_raises_counts_as_not_ready(make: Callable[..., Harness]) -> None:
    h = make(probe_interval_s=0.25)
    calls: list[float] = []

    async def failing_probe() -> bool:
        calls.append(h.clock.now())
        raise ConnectionError("refused")

    h.backend.probe = failing_probe
    h.submit("a")
    await h.settle()
    h.triton.sent[0].fail(triton_down())
    await h.advance(1.0)
    assert len(calls) == 4 and not h.backend.available  # it keeps probing
    assert len(h.triton.sent) == 1


async def test_an_unavailable_answer_after_sending_is_not_resent(
    make: Callable[..., Harness],
) -> None:
    h = make()
    r1 = h.submit("a")
    await h.settle()
    h.triton.sent[0].fail(Unavailable("connection reset"))  # may have run: not resent
    await h.settle()
    fault = fault_of(h, r1)
    assert fault.kind == "Unavailable" and fault.message == "connection reset"
    assert not h.backend.available
    r2 = h.submit("b")
    await h.settle()
    assert len(h.triton.sent) == 1
    h.probe.ready = True
    await h.advance(h.backend.probe_interval_s)
    assert h.triton.batches() == [ids(r1), ids(r2)]


async def test_an_outage_during_the_bisection_holds_the_rest(
    make: Callable[..., Harness],
) -> None:
    h = make()
    r0 = h.submit("a")
    await h.settle()
    r1, r2, r3 = h.submit("a"), h.submit("b"), h.submit("c")
    h.triton.sent[0].ok()
    await h.settle()
    h.triton.sent[1].fail(model_error())  # [r1, r2, r3]: bisected
    await h.settle()
    h.triton.sent[2].fail(triton_down())  # its first half never reached Triton
    await h.settle()
    assert not h.backend.available
    assert h.triton.batches() == [ids(r0), ids(r1, r2, r3), ids(r1, r2)]  # nothing more sent
    assert_unanswered(h, r1, r2, r3)  # held, not failed
    assert h.runtime._held == [[r1, r2, r3]]  # as one batch, in order


# ---- 7. giving up on an outage -------------------------------------------------------------


async def test_an_outage_longer_than_max_outage_answers_everything_waiting_unavailable(
    make: Callable[..., Harness],
) -> None:
    h = make(probe_interval_s=0.25, max_outage_s=1.0)
    r0 = await blocker(h)
    r1, r2 = h.submit("a"), h.submit("b")
    await hold_one_batch(h, r1, r2)  # held: r1, r2 (the scheduler dispatched them)
    down_at = h.clock.now()
    queued = [h.submit(t) for t in ("a", "b", "c", "a")]
    await h.settle()
    assert h.scheduler.deficits()  # a and b have queued work

    await h.advance_to(down_at + 1.0)  # an outage of exactly max_outage_s: still held
    assert_unanswered(h, r1, r2, *queued)
    assert not h.backend.gave_up

    await h.advance_to(down_at + 1.25)  # the first probe after it: given up
    assert h.backend.gave_up and not h.backend.available
    for req in (r1, r2, *queued):
        fault = fault_of(h, req)
        assert fault.kind == "Unavailable" and fault.grpc_code == UNAVAILABLE
        assert "has been unavailable" in fault.message and "max_outage_s is 1" in fault.message
        assert h.outcomes(req) == [Outcome.FAILED]
    assert len(h.triton.sent) == 2
    assert h.runtime.inflight == 0 and h.runtime.idle
    # The queued ones left the scheduler cancelled: not dispatched, charged to nobody.
    # (r1 and r2 had left it already, dispatched, when their batch was assembled.)
    assert h.scheduler.counters == Counters(admitted=7, dispatched=3, expired=0, cancelled=4)
    assert h.scheduler.deficits() == {}

    h.probe.ready = True  # Triton back: dispatch resumes for new requests
    await h.advance(0.25)
    assert h.backend.available and not h.backend.gave_up
    r7 = h.submit("c")
    await h.settle()
    assert h.triton.batches() == [ids(r0), ids(r1, r2), ids(r7)]
    h.triton.sent[2].ok()
    await h.settle()
    assert_served(h, r7)


async def test_give_up_fails_a_batch_that_comes_back_unsent_afterwards(
    make: Callable[..., Harness],
) -> None:
    h = make(Endpoint(max_inflight_batches=2), probe_interval_s=0.25, max_outage_s=1.0)
    r1 = h.submit("a")
    await h.settle()
    r2 = h.submit("b")
    await h.settle()
    h.triton.sent[0].fail(triton_down())
    await h.advance(1.25)  # given up while r2's batch is still out
    assert h.backend.gave_up
    assert "has been unavailable" in fault_of(h, r1).message
    h.triton.sent[1].fail(triton_down())  # after giving up, nothing is held any more
    await h.settle()
    assert fault_of(h, r2).message == "failed to connect to all addresses"
    assert h.runtime.inflight == 0


# ---- 8. a model error on a batch -----------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [model_error("bad row"), InvalidArgument("bad row")],
    ids=["UpstreamError", "InvalidArgument"],
)
async def test_a_model_error_is_bisected_so_only_the_culprit_fails(
    make: Callable[..., Harness], error: FrontendError
) -> None:
    h = make()
    r0 = await blocker(h)
    r1, r2, r3 = h.submit("a"), h.submit("b"), h.submit("c", rows=2)
    h.triton.sent[0].ok()
    await h.settle()
    assert_served(h, r0)
    assert h.triton.batches()[1] == ids(r1, r2, r3)
    h.triton.sent[1].fail(error)
    await h.settle()
    r4 = h.submit("a")  # the batch keeps its slot while it is bisected
    await h.settle()
    assert h.triton.batches()[2:] == [ids(r1, r2)]  # the first half

    h.triton.sent[2].fail(error)  # it holds the culprit: split again
    await h.settle()
    h.triton.sent[3].ok()
    await h.settle()
    h.triton.sent[4].fail(error)
    await h.settle()
    h.triton.sent[5].ok()
    await h.settle()
    assert h.triton.batches()[2:6] == [ids(r1, r2), ids(r1), ids(r2), ids(r3)]
    assert [s.request_id for s in h.triton.sent[3:6]] == ids(r1, r2, r3)  # each alone
    assert_served(h, r1)
    assert_served(h, r3)
    fault = fault_of(h, r2)
    assert fault.kind == type(error).__name__ and fault.message == "bad row"
    assert h.outcomes(r2) == [error.outcome]

    assert h.triton.batches()[6:] == [ids(r4)]  # only now
    assert [report.ok for report in h.reports] == [True, False]


async def test_a_model_error_on_a_lone_request_is_not_retried(
    make: Callable[..., Harness],
) -> None:
    h = make()
    r1 = h.submit("a", rows=3)
    await h.settle()
    h.triton.sent[0].fail(model_error("bad row"))
    await h.settle()
    assert fault_of(h, r1).message == "bad row"
    assert len(h.triton.sent) == 1 and h.runtime.idle


# ---- 9. cancellation -------------------------------------------------------------------------


async def test_a_cancelled_queued_request_never_reaches_triton(
    make: Callable[..., Harness],
) -> None:
    h = make()
    r1 = h.submit("a")
    await h.settle()
    r2, r3 = h.submit("b"), h.submit("c")
    h.runtime.cancel(r2)
    assert h.answers(r2) == [] and h.outcomes(r2) == [Outcome.CANCELLED]
    h.triton.sent[0].ok()
    await h.settle()
    assert h.triton.batches() == [ids(r1), ids(r3)]
    h.triton.sent[1].ok()
    await h.settle()
    assert_served(h, r3)
    assert h.answers(r2) == [] and h.outcomes(r2) == [Outcome.CANCELLED]
    assert h.scheduler.counters == Counters(admitted=3, dispatched=2, expired=0, cancelled=1)


@pytest.mark.parametrize("answer", ["ok", "lost"])
async def test_a_request_cancelled_in_flight_gets_no_answer_and_its_neighbours_do(
    make: Callable[..., Harness], answer: str
) -> None:
    h = make()
    r0 = h.submit("a")
    await h.settle()
    r1, r2 = h.submit("a"), h.submit("b")
    h.triton.sent[0].ok()
    await h.settle()
    assert h.triton.batches()[1] == ids(r1, r2)
    h.runtime.cancel(r1)
    assert h.outcomes(r1) == []  # decided when its batch comes back
    if answer == "ok":
        h.triton.sent[1].ok()
        await h.settle()
        assert_served(h, r2)
    else:
        h.triton.sent[1].fail(Unavailable("connection reset"))
        await h.settle()
        assert fault_of(h, r2).message == "connection reset"
    assert h.answers(r1) == [] and h.outcomes(r1) == [Outcome.CANCELLED]
    assert_served(h, r0)


async def test_a_request_cancelled_while_held_leaves_its_batch(
    make: Callable[..., Harness],
) -> None:
    h = make()
    r0 = await blocker(h)
    r1, r2 = h.submit("a"), h.submit("b")
    await hold_one_batch(h, r1, r2)
    h.runtime.cancel(r1)
    assert h.answers(r1) == [] and h.outcomes(r1) == [Outcome.CANCELLED]
    h.probe.ready = True
    await h.advance(h.backend.probe_interval_s)
    assert h.triton.batches() == [ids(r0), ids(r1, r2), ids(r2)]
    h.triton.sent[2].ok()
    await h.settle()
    assert_served(h, r2)
    assert h.outcomes(r1) == [Outcome.CANCELLED]


async def test_a_request_cancelled_in_flight_is_not_resent_in_the_one_by_one_retry(
    make: Callable[..., Harness],
) -> None:
    h = make()
    r0 = h.submit("a")
    await h.settle()
    r1, r2 = h.submit("a"), h.submit("b")
    h.triton.sent[0].ok()
    await h.settle()
    h.runtime.cancel(r1)
    h.triton.sent[1].fail(model_error())
    await h.settle()
    assert h.outcomes(r1) == [Outcome.CANCELLED]
    assert h.triton.batches() == [ids(r0), ids(r1, r2), ids(r2)]


# ---- 10. drop(route) -------------------------------------------------------------------------


async def test_drop_forgets_every_request_of_one_route_and_no_other(
    make: Callable[..., Harness],
) -> None:
    h = make()
    x, y = RecordingRoute("x"), RecordingRoute("y")
    y0 = h.submit("c", route=y)
    await h.settle()
    x1, y1 = h.submit("a", route=x), h.submit("b", route=y)
    h.triton.sent[0].ok()
    await h.settle()
    assert h.triton.batches()[1] == ids(x1, y1)  # in flight
    x2, y2, x3 = h.submit("a", route=x), h.submit("b", route=y), h.submit("c", route=x)

    assert h.runtime.drop(x) == 3  # x1 in flight, x2 and x3 queued
    assert [h.outcomes(r) for r in (x2, x3)] == [[Outcome.CANCELLED]] * 2
    h.triton.sent[1].ok()
    await h.settle()
    assert h.triton.batches()[2] == ids(y2)  # the queued x requests left
    h.triton.sent[2].ok()
    await h.settle()
    assert x.answers == []
    assert h.outcomes(x1) == [Outcome.CANCELLED]
    for r in (y0, y1, y2):
        assert_served(h, r)
    assert [a.id for a in y.answers] == [r.call.id for r in (y0, y1, y2)]
    assert h.runtime.drop(x) == 0  # nothing of x left
    assert h.runtime.idle


async def test_drop_forgets_the_route_in_a_held_batch(make: Callable[..., Harness]) -> None:
    h = make()
    x, y = RecordingRoute("x"), RecordingRoute("y")
    r0 = await blocker(h)
    x1, y1 = h.submit("a", route=x), h.submit("b", route=y)
    await hold_one_batch(h, x1, y1)
    x2 = h.submit("a", route=x)  # queued while Triton is down
    assert h.runtime.drop(x) == 2
    assert h.outcomes(x1) == h.outcomes(x2) == [Outcome.CANCELLED]
    h.probe.ready = True
    await h.advance(h.backend.probe_interval_s)
    assert h.triton.batches() == [ids(r0), ids(x1, y1), ids(y1)]
    h.triton.sent[2].ok()
    await h.settle()
    assert_served(h, y1)
    assert x.answers == []
