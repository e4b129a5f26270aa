"""The throttle's verdict per tier (what the shells refuse without asking the core).

``EndpointAdmission.verdict``: a tier is closed on an endpoint when even its most
favourable request would be refused. Units through the real scheduler (driven by explicit
times, no clock), and the property that makes it safe to act on in a shell: whenever the
verdict says closed, ``admit`` refuses every request of that tier.
"""

from __future__ import annotations

from typing import Any

from feedback_support import Truth, trained
from hypothesis import given, settings
from hypothesis import strategies as st

from fair_frontend.admission import EngineThrottle, Throttle
from fair_frontend.config import CostUnit
from fair_frontend.core import EndpointAdmission, TierShares
from fair_frontend.feedback import SlotTimes
from fair_frontend.scheduler import (
    EndpointPolicy,
    GlobalCaps,
    Mode,
    QueuedRequest,
    Scheduler,
    TenantSpec,
)

TIERS = ("paid", "free")
TRUTH = Truth()  # 2 ms per batch + 20 us per token


def directory(weights: dict[str, float] | None = None) -> dict[str, TenantSpec]:
    weights = weights or {}
    return {
        name: TenantSpec(tier, weights.get(name, 1.0), max_queued=10**6)
        for name, tier in (("p1", "paid"), ("p2", "paid"), ("f1", "free"), ("f2", "free"))
    }


def endpoint(
    tenants: dict[str, TenantSpec], *, mode: Mode = "fair", target_s: float = 0.1
) -> tuple[Scheduler, EndpointAdmission]:
    policy = EndpointPolicy(
        cost=CostUnit.TOKENS, max_batch_size=32, max_batch_tokens=None, quantum=4096.0, tiers=TIERS
    )
    scheduler = Scheduler(policy, tenants, GlobalCaps(10**7), mode=mode)
    admission = EndpointAdmission(
        service=trained(TRUTH, batches=200),
        throttle=Throttle(max_batch_size=32, latency_target_s=target_s),
        tiers=TIERS,
        strict_tiers=mode == "fair",
    )
    return scheduler, admission


def largest_weight(tenants: dict[str, TenantSpec], tier: str) -> float:
    return max(t.weight for t in tenants.values() if t.tier == tier)


def test_a_higher_tiers_backlog_closes_the_lower_tier_until_it_drains() -> None:
    tenants = directory()
    scheduler, admission = endpoint(tenants)
    for _ in range(400):  # 400 requests of 100 tokens: about 13 full batches ahead
        scheduler.enqueue(QueuedRequest("p1", 1, 100, 0, 1, None), 0.0)
    free = admission.verdict(scheduler, 2, "free", 1.0, 2)
    assert free is not None and not free.admitted and free.retry_after_s
    assert free.predicted_wait_s > free.target_s == 0.1
    # The paid tier is open: p1 can send above its own queue's level, p2 has nothing
    # queued (only its fair share of p1's work would be ahead of it).
    assert admission.verdict(scheduler, 2, "paid", 1.0, 2) is None
    d = admission.admit(
        scheduler, 2, tenant="p2", tier="paid", priority=1, rows=1, tokens=0, remaining_s=None
    )
    assert d is not None and d.admitted
    # Drained (dispatched): open again.
    now = 0.0
    while scheduler.queued_requests > 64:
        now += 0.01
        scheduler.next_batch(now)
    assert admission.verdict(scheduler, 2, "free", 1.0, 2) is None


def test_a_tier_is_open_while_one_of_its_tenants_could_still_get_in() -> None:
    # f1's own backlog: f2 (nothing queued) finds only its DRR turn's worth of f1's
    # work ahead, and f1 itself, at level 1, nothing of its own work at level 2.
    tenants = directory()
    scheduler, admission = endpoint(tenants)
    for _ in range(400):
        scheduler.enqueue(QueuedRequest("f1", 1, 100, 0, 2, None), 0.0)
    args: dict[str, Any] = {"tier": "free", "rows": 1, "tokens": 0, "remaining_s": None}
    f1 = admission.admit(scheduler, 2, tenant="f1", priority=1, **args)
    f1_low = admission.admit(scheduler, 2, tenant="f1", priority=2, **args)
    f2 = admission.admit(scheduler, 2, tenant="f2", priority=3, **args)
    assert f1 is not None and f1.admitted
    assert f1_low is not None and not f1_low.admitted
    assert f2 is not None and f2.admitted
    assert admission.verdict(scheduler, 2, "free", 1.0, 2) is None
    # f1's backlog at level 1: f1 cannot get past it, f2 still can: open.
    scheduler.cancel_all(0.0)
    for _ in range(400):
        scheduler.enqueue(QueuedRequest("f1", 1, 100, 0, 1, None), 0.0)
    f1 = admission.admit(scheduler, 2, tenant="f1", priority=1, **args)
    assert f1 is not None and not f1.admitted
    assert admission.verdict(scheduler, 2, "free", 1.0, 2) is None
    # Both free tenants backlogged at level 1: neither gets in, closed.
    for _ in range(400):
        scheduler.enqueue(QueuedRequest("f2", 1, 100, 0, 1, None), 0.0)
    closed = admission.verdict(scheduler, 2, "free", 1.0, 2)
    assert closed is not None and not closed.admitted
    # ... but not for a tenant of the tier nobody has seen yet, if it could weigh more.
    assert admission.verdict(scheduler, 2, "free", 1000.0, 3) is None


def test_fifo_closes_every_tier_alike() -> None:
    tenants = directory()
    scheduler, admission = endpoint(tenants, mode="fifo")
    for _ in range(400):
        scheduler.enqueue(QueuedRequest("p1", 1, 100, 0, 1, None), 0.0)
    for tier in TIERS:
        assert admission.verdict(scheduler, 2, tier, 1.0, 2) is not None


# ---- the verdict is a lower bound: closed means every request of the tier is refused ---

queued = st.lists(
    st.tuples(
        st.sampled_from(["p1", "p2", "f1", "f2"]),
        st.integers(1, 4),  # rows
        st.integers(0, 400),  # tokens
        st.integers(1, 3),  # priority
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(
    backlog=queued,
    weights=st.dictionaries(st.sampled_from(["p1", "p2", "f1", "f2"]), st.floats(0.1, 10.0)),
    inflight=st.integers(0, 2),
    target_s=st.floats(0.005, 0.5),
    paid_share=st.floats(0.0, 1.0),
    mode=st.sampled_from(["fair", "fifo"]),
    dispatched=st.integers(0, 5),
    requests=st.lists(
        st.tuples(
            st.sampled_from(["p1", "p2", "f1", "f2"]),
            st.integers(1, 4),
            st.integers(0, 400),
            st.integers(1, 3),
            st.one_of(st.none(), st.floats(0.0, 1.0)),
        ),
        min_size=1,
        max_size=20,
    ),
)
def test_a_closed_tier_refuses_every_request_of_it(
    backlog: list[tuple[str, int, int, int]],
    weights: dict[str, float],
    inflight: int,
    target_s: float,
    paid_share: float,
    mode: Mode,
    dispatched: int,
    requests: list[tuple[str, int, int, int, float | None]],
) -> None:
    tenants = directory(weights)
    scheduler, admission = endpoint(tenants, mode=mode, target_s=target_s)
    admission.tier_shares.share["paid"] = paid_share
    for tenant, rows, tokens, priority in backlog:
        scheduler.enqueue(QueuedRequest(tenant, rows, tokens, 0, priority, None), 0.0)
    for i in range(dispatched):  # DRR state other than fresh
        scheduler.next_batch(float(i))
    verdicts = {
        t: admission.verdict(scheduler, inflight, t, largest_weight(tenants, t), 2) for t in TIERS
    }
    for tenant, rows, tokens, priority, remaining_s in requests:
        tier = tenants[tenant].tier
        d = admission.admit(
            scheduler, inflight, tenant=tenant, tier=tier, priority=priority, rows=rows,
            tokens=tokens, remaining_s=remaining_s,
        )  # fmt: skip
        assert d is not None
        closed = verdicts[tier]
        if closed is not None:
            assert not d.admitted
            assert d.predicted_wait_s >= closed.predicted_wait_s - 1e-12


@settings(max_examples=300, deadline=None)
@given(
    backlog=queued,
    weights=st.dictionaries(st.sampled_from(["p1", "p2", "f1", "f2"]), st.floats(0.1, 10.0)),
    slots=st.integers(1, 16),
    reserved=st.integers(0, 15),
    inflight=st.integers(0, 16),
    hold_s=st.floats(0.01, 5.0),
    target_s=st.floats(0.01, 5.0),
    paid_share=st.floats(0.0, 1.0),
    mode=st.sampled_from(["fair", "fifo"]),
    light_slots=st.integers(0, 15),
    requests=st.lists(
        st.tuples(
            st.sampled_from(["p1", "p2", "f1", "f2"]),
            st.integers(1, 2),
            st.integers(0, 400),
            st.integers(1, 3),
            st.integers(0, 16),  # own_inflight
            st.booleans(),  # may take a light slot
        ),
        min_size=1,
        max_size=20,
    ),
)
def test_a_closed_tier_refuses_every_request_of_it_on_an_engine(
    backlog: list[tuple[str, int, int, int]],
    weights: dict[str, float],
    slots: int,
    reserved: int,
    inflight: int,
    hold_s: float,
    target_s: float,
    paid_share: float,
    mode: Mode,
    light_slots: int,
    requests: list[tuple[str, int, int, int, int, bool]],
) -> None:
    """Light slots included: a request that may take one is judged by its rivals
    (``Scheduler.light_rivals``), and a tier closed refuses it too."""
    tenants = directory(weights)
    policy = EndpointPolicy(CostUnit.REQUESTS, 0, None, 1.0, TIERS, slots=slots)
    scheduler = Scheduler(policy, tenants, GlobalCaps(10**7), mode=mode)
    times = SlotTimes.for_slots(slots)
    for _ in range(4 * slots):
        times.observe(hold_s)
    admission = EndpointAdmission(
        service=trained(TRUTH, batches=10),
        throttle=None,
        tiers=TIERS,
        strict_tiers=mode == "fair",
        tier_shares=TierShares(),
        engine=EngineThrottle(
            slots=slots,
            reserved_slots=min(reserved, slots - 1),
            latency_target_s=target_s,
            light_slots=min(light_slots, slots - 1),
        ),
        slot_times=times,
    )
    admission.tier_shares.share["paid"] = paid_share
    for tenant, rows, tokens, priority in backlog:
        scheduler.enqueue(QueuedRequest(tenant, rows, tokens, 0, priority, None), 0.0)
    verdicts = {
        t: admission.verdict(scheduler, inflight, t, largest_weight(tenants, t), 2) for t in TIERS
    }
    for tenant, rows, tokens, priority, own_inflight, may_light in requests:
        tier = tenants[tenant].tier
        rivals = scheduler.light_rivals(tenant)
        light = rivals + 1 if may_light and rivals is not None else None
        d = admission.admit(
            scheduler, inflight, tenant=tenant, tier=tier, priority=priority, rows=rows,
            tokens=tokens, remaining_s=None, own_inflight=min(own_inflight, inflight),
            light=light,
        )  # fmt: skip
        assert d is not None
        if verdicts[tier] is not None:
            assert not d.admitted
