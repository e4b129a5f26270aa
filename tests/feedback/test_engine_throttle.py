"""The engine throttle: refuse at once what would wait for a slot beyond its target.

Issue 17: engine endpoints (``max_inflight``) were never throttled, so a tenant could
queue 10,000 generations. Units of ``EngineThrottle`` and ``SlotTimes``, a monotonicity
property, and an overload simulation on a fake clock through the real scheduler: an
engine of 16 slots serving requests concurrently (hold times varying 9x), Poisson
arrivals; admitted requests get a slot within their target, and without the throttle
(the negative control) they do not. A model that ran the backlog as batches one after
another (the batch throttle's) would predict waits S times too long here.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fair_frontend.admission import EngineThrottle, ThrottleDecision, overloaded_error
from fair_frontend.admission.throttle import DEFAULT_THROTTLE_SAFETY
from fair_frontend.config import Config, CostUnit, Endpoint
from fair_frontend.core.admission import EndpointAdmission
from fair_frontend.core.plan import engine_throttle
from fair_frontend.endpoint import plan
from fair_frontend.errors import Overloaded
from fair_frontend.feedback import ServiceModel, SlotTimes
from fair_frontend.models import ModelInfo
from fair_frontend.outcomes import Outcome
from fair_frontend.scheduler import EndpointPolicy, GlobalCaps, QueuedRequest, Scheduler, TenantSpec


def slot_times(hold_s: float, samples: int = 10) -> SlotTimes:
    times = SlotTimes()
    for _ in range(samples):
        times.observe(hold_s)
    return times


def engine(slots: int = 8, reserved: int = 0, target_s: float = 1.0) -> EngineThrottle:
    return EngineThrottle(slots=slots, reserved_slots=reserved, latency_target_s=target_s)


def check(t: EngineThrottle, hold_s: float = 2.0, **counts: int) -> ThrottleDecision:
    args = {"ahead": 1, "own_ahead": 1, "inflight": 0, "own_inflight": 0, **counts}
    return t.check(slot_times=slot_times(hold_s), **args)


def test_a_free_slot_is_always_admitted() -> None:
    d = check(engine(), inflight=7, ahead=1, own_ahead=1)
    assert d.admitted and d.reason == "free slot" and d.predicted_wait_s == 0.0


def test_the_next_in_line_is_admitted_whatever_the_prediction() -> None:
    d = check(engine(target_s=0.001), hold_s=100.0, inflight=8, ahead=1)
    assert d.admitted and d.reason == "next in line" and d.batches == 1
    assert d.predicted_wait_s > d.target_s


def test_a_long_queue_for_the_slots_is_refused_with_retry_after() -> None:
    # 8 slots busy, 20 ahead (itself included): 20 must leave, at 8 per 2 s.
    d = check(engine(target_s=1.0), hold_s=2.0, inflight=8, ahead=20, own_ahead=20)
    assert not d.admitted and d.reason == "over target" and d.batches == 20
    assert d.predicted_wait_s == pytest.approx(20 * 2.0 / 8)
    assert d.retry_after_s == pytest.approx(5.0 - 1.0)
    err = overloaded_error(d, "llm")
    assert isinstance(err, Overloaded) and err.http_status == 503
    assert err.outcome is Outcome.REJECTED_OVERLOAD and err.retry_after_header == "4"
    assert "predicted wait 5.00 s exceeds the latency target of 1.00 s" in err.message


def test_within_target_is_admitted() -> None:
    d = check(engine(target_s=1.0), hold_s=2.0, inflight=8, ahead=4, own_ahead=4)
    assert d.admitted and d.reason == "within target"
    assert d.predicted_wait_s == pytest.approx(4 * 2.0 / 8)


def test_a_tenant_at_its_share_of_the_slots_waits_for_its_own() -> None:
    """reserved_slots 2 of 8: a tenant holds at most 6. Holding 6, with slots free, it
    waits for its own requests to leave, at 6 per hold time."""
    t = engine(slots=8, reserved=2, target_s=1.0)
    assert check(t, inflight=6, own_inflight=6, ahead=1, own_ahead=1).reason == "next in line"
    d = check(t, hold_s=2.0, inflight=6, own_inflight=6, ahead=4, own_ahead=4)
    assert not d.admitted and d.predicted_wait_s == pytest.approx(4 * 2.0 / 6)
    # Another tenant finds the kept slots free.
    other = check(t, hold_s=2.0, inflight=6, own_inflight=0, ahead=1, own_ahead=1)
    assert other.admitted and other.reason == "free slot"


def test_the_requests_deadline_tightens_the_target() -> None:
    t = engine(target_s=5.0)
    assert check(t, inflight=8, ahead=8).admitted  # 2 s of waiting
    d = t.check(
        ahead=8, own_ahead=1, inflight=8, own_inflight=0, slot_times=slot_times(2.0), remaining_s=1
    )
    assert not d.admitted and d.deadline_bound and d.target_s == 1
    assert "exceeds the request's deadline of 1.00 s" in overloaded_error(d, "llm").message


def test_light_slots_count_for_the_requests_that_may_take_them() -> None:
    """8 slots, the last 2 light, all busy, 10 requests' worth ahead: a request whose
    program holds a slot waits until 2 are still free after its own (12 releases); one
    whose program holds none takes a light slot once the 2 rivals before it have (3
    releases), where without light slots it waited its turn (10)."""
    t = EngineThrottle(slots=8, latency_target_s=1.0, light_slots=2)
    busy = {"ahead": 10, "own_ahead": 1, "inflight": 8}
    heavy = check(t, hold_s=2.0, **busy)
    light = t.check(slot_times=slot_times(2.0), own_inflight=0, light=3, **busy)
    plain = check(engine(target_s=1.0), hold_s=2.0, **busy)
    assert (heavy.batches, light.batches, plain.batches) == (12, 3, 10)
    assert not heavy.admitted and light.admitted and not plain.admitted
    assert light.predicted_wait_s == pytest.approx(3 * 2.0 / 8)
    # Slots free but only the light ones: the next heavy request waits for a release,
    # a light one takes a slot at once (never later than its turn: the fewer of the two).
    assert check(t, inflight=6, ahead=1).reason == "next in line"
    assert t.check(slot_times=slot_times(2.0), **LONE, inflight=6, light=1).reason == "free slot"
    assert t.check(slot_times=slot_times(2.0), **LONE, inflight=8, light=5).batches == 1


LONE = {"ahead": 1, "own_ahead": 1, "own_inflight": 0}


@settings(max_examples=300, deadline=None)
@given(
    light_slots=st.integers(1, 7),
    ahead=st.integers(1, 500),
    more=st.integers(0, 500),
    rivals=st.integers(1, 64),
    more_rivals=st.integers(0, 64),
    inflight=st.integers(0, 8),
)
def test_with_light_slots_more_ahead_or_more_rivals_never_admits_what_was_refused(
    light_slots: int, ahead: int, more: int, rivals: int, more_rivals: int, inflight: int
) -> None:
    """Monotone in the work ahead and in the light rivals; and a request that may take a
    light slot never waits longer than one that may not."""
    t = EngineThrottle(slots=8, latency_target_s=0.5, light_slots=light_slots)
    times = slot_times(2.0)

    def judge(ahead: int, light: int | None) -> ThrottleDecision:
        return t.check(
            ahead=ahead, own_ahead=1, inflight=inflight, own_inflight=0, slot_times=times,
            light=light,
        )  # fmt: skip

    for light in (None, rivals):
        small, large = judge(ahead, light), judge(ahead + more, light)
        assert large.predicted_wait_s >= small.predicted_wait_s
        assert small.admitted or not large.admitted
    fewer, more_of_them = judge(ahead, rivals), judge(ahead, rivals + more_rivals)
    assert more_of_them.predicted_wait_s >= fewer.predicted_wait_s
    assert fewer.admitted or not more_of_them.admitted
    assert judge(ahead, rivals).predicted_wait_s <= judge(ahead, None).predicted_wait_s


def test_no_slot_times_yet_never_refuses() -> None:
    t = engine(target_s=0.001)
    d = t.check(ahead=10**5, own_ahead=10**5, inflight=8, own_inflight=8, slot_times=SlotTimes())
    assert d.admitted and d.reason == "no service data"


def test_from_the_endpoint_config() -> None:
    ep = Endpoint(max_inflight=64, reserved_slots=8, latency_target_ms=2500, throttle_safety=1.5)
    llm = ModelInfo(name="llm", max_batch_size=0, inputs={}, outputs={}, decoupled=True)
    t = engine_throttle(plan(Config(tiers=["paid"], endpoints={"llm": ep}), "llm", llm), 2)
    assert (t.slots, t.tenant_slots, t.latency_target_s, t.safety) == (128, 120, 2.5, 1.5)
    assert t.light_slots == 0
    ep = Endpoint(max_inflight=64, light_slots=4)
    light = engine_throttle(plan(Config(tiers=["paid"], endpoints={"llm": ep}), "llm", llm), 2)
    assert light.light_slots == 4
    with pytest.raises(ValueError):
        engine_throttle(plan(Config(tiers=["paid"]), "llm", llm))  # not an engine


def test_slot_times_average_then_follow_the_recent_requests() -> None:
    times = SlotTimes(alpha=0.1, min_samples=3)
    times.observe(1.0)
    times.observe(3.0)
    assert not times.has_data and times.mean_hold_s == pytest.approx(2.0)
    times.observe(float("nan"))  # a broken measurement is not one
    times.observe(2.0)
    assert times.has_data and times.mean_hold_s == pytest.approx(2.0)
    for _ in range(100):
        times.observe(10.0)
    assert times.mean_hold_s == pytest.approx(10.0, rel=1e-3)


def test_endpoint_admission_feeds_the_slot_times_and_asks_the_engine_throttle() -> None:
    policy = EndpointPolicy(CostUnit.REQUESTS, 0, None, 1.0, ("paid",), slots=2)
    scheduler = Scheduler(policy, {"a": TenantSpec("paid")}, GlobalCaps())
    admission = EndpointAdmission(
        service=ServiceModel("llm"),
        throttle=None,
        tiers=("paid",),
        engine=EngineThrottle(slots=2, latency_target_s=1.0),
    )
    for i in range(6):
        admission.observe_batch(
            rows={"a": 1}, tokens={"a": 8}, tier_of=lambda t: "paid", ok=i % 2 == 0,
            started=10.0, finished=14.0, now=14.0,
        )  # fmt: skip
    assert admission.slot_times.has_data and admission.slot_times.mean_hold_s == 4.0
    for _ in range(3):
        scheduler.enqueue(QueuedRequest("a", 1, 8, 0, 1, None), 0.0)
    args: dict[str, Any] = {"tenant": "a", "tier": "paid", "priority": 1, "rows": 1, "tokens": 8}
    d = admission.admit(scheduler, 2, own_inflight=2, remaining_s=None, **args)
    # 3 queued ahead of it and itself; 2 slots busy: 4 must leave, 2 per 4 s.
    assert d is not None and not d.admitted and d.predicted_wait_s == pytest.approx(8.0)


@settings(max_examples=300, deadline=None)
@given(
    slots=st.integers(1, 64),
    reserved=st.integers(0, 63),
    hold_s=st.floats(0.001, 100.0),
    target_s=st.floats(0.001, 30.0),
    ahead=st.integers(1, 5000),
    more_ahead=st.integers(0, 5000),
    own=st.integers(1, 5000),
    more_own=st.integers(0, 5000),
    inflight=st.integers(0, 64),
    own_inflight=st.integers(0, 64),
    remaining_s=st.one_of(st.none(), st.floats(-1.0, 30.0)),
)
def test_more_work_ahead_never_turns_a_refusal_into_an_admission(
    slots: int,
    reserved: int,
    hold_s: float,
    target_s: float,
    ahead: int,
    more_ahead: int,
    own: int,
    more_own: int,
    inflight: int,
    own_inflight: int,
    remaining_s: float | None,
) -> None:
    reserved = min(reserved, slots - 1)
    inflight = min(inflight, slots)
    own_inflight = min(own_inflight, inflight)
    own = min(own, ahead)
    t = EngineThrottle(slots=slots, reserved_slots=reserved, latency_target_s=target_s)
    times = slot_times(hold_s)
    small = t.check(
        ahead=ahead, own_ahead=own, inflight=inflight, own_inflight=own_inflight,
        slot_times=times, remaining_s=remaining_s,
    )  # fmt: skip
    large = t.check(
        ahead=ahead + more_ahead, own_ahead=own + min(more_own, more_ahead),
        inflight=inflight, own_inflight=own_inflight, slot_times=times,
        remaining_s=remaining_s,
    )  # fmt: skip
    assert large.predicted_wait_s >= small.predicted_wait_s
    if not small.admitted:
        assert not large.admitted


# ---- overload, through the real scheduler, on a fake clock -----------------------------


SLOTS = 16
MEAN_HOLD_S = 1.0  # hold times uniform in 0.2-1.8 s: generations of varying length
TARGET_S = 2.0
WARM_UP_S = 10.0  # requests arriving before are not judged: the slot times are being learned


@dataclass
class Outcomes:
    admitted: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    late: dict[str, int] = field(default_factory=dict)  # admitted, a slot after the target
    judged: dict[str, int] = field(default_factory=dict)  # admitted after the warm-up
    waits: list[float] = field(default_factory=list)

    def fraction_rejected(self, tenant: str) -> float:
        sent = self.admitted.get(tenant, 0) + self.rejected.get(tenant, 0)
        return self.rejected.get(tenant, 0) / max(1, sent)

    def late_fraction(self, tenant: str) -> float:
        return self.late.get(tenant, 0) / max(1, self.judged.get(tenant, 0))


def simulate(
    rates: dict[str, float],
    *,
    use_throttle: bool,
    reserved: int = 0,
    seconds: float = 60.0,
    seed: int = 0,
) -> Outcomes:
    """Tenants (one tier) send requests at ``rates`` x the engine's capacity (Poisson;
    capacity: SLOTS / MEAN_HOLD_S requests per second) to an engine of SLOTS slots, each
    request holding its slot 0.2-1.8 s. A free slot goes to the scheduler's next request
    (with ``reserved`` slots kept from any one tenant, as dispatch keeps them); the
    throttle decides at each arrival from the slot times measured so far. Waits are
    judged for requests that arrive after ``WARM_UP_S``."""
    rng = random.Random(seed)
    capacity = SLOTS / MEAN_HOLD_S
    tenants = {name: TenantSpec("paid", max_queued=10**6) for name in rates}
    policy = EndpointPolicy(CostUnit.REQUESTS, 0, None, 1.0, ("paid",), slots=SLOTS)
    scheduler = Scheduler(policy, tenants, GlobalCaps(10**7))
    gate = EngineThrottle(
        slots=SLOTS, reserved_slots=reserved, latency_target_s=TARGET_S,
        safety=DEFAULT_THROTTLE_SAFETY,
    )  # fmt: skip
    times = SlotTimes.for_slots(SLOTS)
    out = Outcomes()
    running: list[tuple[float, int, QueuedRequest]] = []  # (ends at, seq, request)
    held: dict[str, int] = {}
    seq = 0

    def fill(now: float) -> None:
        nonlocal seq
        while len(running) < SLOTS:
            head = scheduler.peek(now)
            if head is None or (reserved and held.get(head.tenant, 0) >= SLOTS - reserved):
                return
            (req,) = scheduler.next_batch(now)
            wait = now - req.arrival
            if req.arrival >= WARM_UP_S:
                out.waits.append(wait)
                out.judged[req.tenant] = out.judged.get(req.tenant, 0) + 1
                out.late[req.tenant] = out.late.get(req.tenant, 0) + (wait > TARGET_S)
            held[req.tenant] = held.get(req.tenant, 0) + 1
            seq += 1
            hold = MEAN_HOLD_S * rng.uniform(0.2, 1.8)
            heapq.heappush(running, (now + hold, seq, req))

    arrivals = [(rng.expovariate(rate * capacity), name) for name, rate in rates.items()]
    heapq.heapify(arrivals)
    while arrivals[0][0] < seconds or running:
        if running and (arrivals[0][0] >= seconds or running[0][0] <= arrivals[0][0]):
            now, _, req = heapq.heappop(running)
            times.observe(now - (req.left_at or now))
            held[req.tenant] -= 1
        else:
            now, tenant = heapq.heappop(arrivals)
            heapq.heappush(arrivals, (now + rng.expovariate(rates[tenant] * capacity), tenant))
            if use_throttle:
                d = gate.check(
                    ahead=scheduler.backlog_ahead(tenant, 1, 1, 0).rows,
                    own_ahead=scheduler.own_ahead(tenant, 1) + 1,
                    inflight=len(running),
                    own_inflight=held.get(tenant, 0),
                    slot_times=times,
                )
                if not d.admitted:
                    out.rejected[tenant] = out.rejected.get(tenant, 0) + 1
                    continue
            scheduler.enqueue(QueuedRequest(tenant, 1, 0, 0, 1, None), now)
            out.admitted[tenant] = out.admitted.get(tenant, 0) + 1
        fill(now)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_under_overload_admitted_requests_get_a_slot_within_their_target(seed: int) -> None:
    throttled = simulate({"a": 2.0}, use_throttle=True, seed=seed)
    # Twice the capacity arrives: about half must be turned away...
    assert 0.35 < throttled.fraction_rejected("a") < 0.65
    # ...and what is admitted gets its slot in time (measured: 0.6-2.1 % a little late,
    # the spread of 30 releases of 16 slots against the safety margin of 25 %).
    assert throttled.late_fraction("a") < 0.05, sorted(throttled.waits)[-10:]
    assert max(throttled.waits) < 1.5 * TARGET_S
    # Negative control: without the throttle the queue for the slots grows without end.
    unthrottled = simulate({"a": 2.0}, use_throttle=False, seed=seed)
    assert unthrottled.late_fraction("a") > 0.5


def test_under_light_load_nothing_is_refused() -> None:
    light = simulate({"a": 0.3, "b": 0.3}, use_throttle=True, seconds=30.0)
    assert not light.rejected and sum(light.admitted.values()) > 200
    assert not sum(light.late.values())


@pytest.mark.parametrize("seed", range(3))
def test_a_hog_is_refused_and_a_light_tenant_is_not(seed: int) -> None:
    """With reserved slots (the shipped llm's), a tenant sending 3x the capacity is
    mostly refused; another, sending a tenth of it, is never refused and never late.
    The light tenant's arrivals take slots ahead of the hog's admitted requests, which
    the prediction does not foresee (measured: 1-3 % of the hog's late with 4 slots
    reserved, where its own bound sets its wait; 11-17 % without)."""
    out = simulate({"hog": 3.0, "light": 0.1}, use_throttle=True, reserved=4, seed=seed)
    assert out.fraction_rejected("hog") > 0.5
    assert out.rejected.get("light", 0) == 0 and out.admitted["light"] > 50
    assert out.late.get("light", 0) == 0
    assert out.late_fraction("hog") < 0.05
