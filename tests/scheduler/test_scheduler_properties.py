"""Properties of the scheduler on random interleavings, checked against a plain model.

The model keeps the set of queued requests and what the scheduler must guarantee about
them; after every operation the scheduler's answers and counts are compared with it:

- per-tenant order: each dispatched request is its tenant's smallest (priority,
  deadline, arrival) among the requests queued at that moment (fifo: the oldest of all);
- strict tiers: it comes from the highest tier with queued work (guard off);
- work conservation and caps: a batch is non-empty iff something is queued, within
  max_batch_size / max_batch_tokens unless it is one oversize request, one shape_key,
  and it ends only for a reason (the next request does not fit);
- the DRR bound, theorem B of the package docstring, after every single dispatch;
- accounting: admitted == dispatched + expired + cancelled + queued, and every view.

Theorem A (common start) and exact equality with a naive DRR (the round jumps) have
their own properties below.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_support import make_request

from fair_frontend.errors import QueueFull
from fair_frontend.scheduler import (
    Backlog,
    EndpointPolicy,
    GlobalCaps,
    Mode,
    QueuedRequest,
    Scheduler,
    TenantSpec,
)
from fair_frontend.scheduler.cost import CostUnit

EPS = 1e-9
WEIGHTS = [0.5, 1.0, 2.0, 3.0]
PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def model_cost(unit: CostUnit, rows: int, tokens: int) -> float:
    return float(rows) if unit is CostUnit.REQUESTS else float(max(1, tokens))


def order_key(r: QueuedRequest) -> tuple[int, float, int]:
    return (r.priority, math.inf if r.deadline is None else r.deadline, r.seq)


# ---- the main property -------------------------------------------------------------------


@dataclass
class Scenario:
    mode: Mode
    tiers: tuple[str, ...]
    tenants: dict[str, TenantSpec]
    cost: CostUnit
    quantum: float
    max_batch_size: int
    max_batch_tokens: int | None
    min_share: dict[str, float]
    global_max_queued: int
    global_max_bytes: int
    tenant_bytes_share: float
    ops: list[tuple[Any, ...]]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    tiers = tuple(f"tier{i}" for i in range(draw(st.integers(1, 3))))
    tenants = {
        f"u{i}": TenantSpec(
            tier=draw(st.sampled_from(tiers)),
            weight=draw(st.sampled_from(WEIGHTS)),
            max_queued=draw(st.integers(2, 25)),
            max_queued_bytes=draw(st.one_of(st.none(), st.integers(50, 600))),
        )
        for i in range(draw(st.integers(2, 5)))
    }
    cost = draw(st.sampled_from(list(CostUnit)))
    quanta = [0.5, 1.0, 2.0, 5.0] if cost is CostUnit.REQUESTS else [1.0, 8.0, 30.0]
    names = sorted(tenants)
    request = st.tuples(
        st.sampled_from(names),
        st.sampled_from([1, 1, 1, 2, 3]),  # rows
        st.integers(0, 40),  # tokens
        st.integers(0, 120),  # bytes
        st.integers(1, 3),  # priority
        st.one_of(st.none(), st.integers(0, 12)),  # deadline offset
        st.sampled_from([None, None, None, 1]),  # shape key
    )
    op = st.one_of(
        st.tuples(st.just("enqueue"), st.lists(request, min_size=1, max_size=6)),
        st.tuples(st.just("batch")),
        st.tuples(st.just("batch")),
        st.tuples(st.just("tick"), st.integers(1, 4)),
        st.tuples(st.just("expire")),
        st.tuples(st.just("cancel"), st.integers(0, 1000), st.booleans()),
    )
    return Scenario(
        mode=draw(st.sampled_from(["fair", "fair", "fifo"])),
        tiers=tiers,
        tenants=tenants,
        cost=cost,
        quantum=draw(st.sampled_from(quanta)),
        max_batch_size=draw(st.sampled_from([0, 1, 3, 6, 8, 8])),
        max_batch_tokens=draw(st.one_of(st.none(), st.integers(20, 100))),
        min_share=draw(st.one_of(st.just({}), st.just({tiers[-1]: 0.3}))) if len(tiers) > 1 else {},
        global_max_queued=draw(st.integers(5, 60)),
        global_max_bytes=draw(st.integers(200, 3000)),
        tenant_bytes_share=draw(st.sampled_from([0.1, 0.25, 0.5, 1.0])),
        ops=draw(st.lists(op, min_size=10, max_size=100)),
    )


@dataclass
class Model:
    """What must be queued, and the DRR bookkeeping of theorem B."""

    sc: Scenario
    now: float = 0.0
    queued: dict[int, QueuedRequest] = field(default_factory=dict)  # id -> request
    done: list[QueuedRequest] = field(default_factory=list)
    pending_expired: list[QueuedRequest] = field(default_factory=list)
    admitted: int = 0
    dispatched: int = 0
    expired: int = 0
    cancelled: int = 0
    served: dict[str, float] = field(default_factory=dict)  # cost sent, ever
    period_max: dict[str, float] = field(default_factory=dict)  # C_f since f last joined
    pairs: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)

    def depth(self, tenant: str) -> int:
        return sum(1 for r in self.queued.values() if r.tenant == tenant)

    def tier_of(self, tenant: str) -> str:
        return self.sc.tenants[tenant].tier

    def join(self, r: QueuedRequest) -> None:
        """r is queued; if its tenant was idle, open pairs with the backlogged peers."""
        t = r.tenant
        if self.depth(t) == 1:
            self.period_max[t] = r.cost
            for u in self.sc.tenants:
                if u != t and self.tier_of(u) == self.tier_of(t) and self.depth(u):
                    # t is the later joiner: theorem B's A.
                    self.pairs[(t, u)] = (self.served.get(t, 0.0), self.served.get(u, 0.0))
        else:
            self.period_max[t] = max(self.period_max[t], r.cost)

    def leave(self, r: QueuedRequest) -> None:
        del self.queued[id(r)]
        self.done.append(r)
        if not self.depth(r.tenant):
            self.pairs = {p: b for p, b in self.pairs.items() if r.tenant not in p}

    def check_drr_bound(self) -> None:
        q = self.sc.quantum
        for (a_name, b_name), (a0, b0) in self.pairs.items():
            a = self.sc.tenants[a_name].weight
            b = self.sc.tenants[b_name].weight
            diff = (self.served.get(a_name, 0.0) - a0) / a - (self.served.get(b_name, 0.0) - b0) / b
            c_a = self.period_max[a_name] / a
            c_b = self.period_max[b_name] / b
            assert -(2 * q + c_a + c_b) - EPS < diff < q + c_b + EPS, (a_name, b_name, diff)


def expected_refusal(sc: Scenario, m: Model, caps: GlobalCaps, tenant: str, nbytes: int) -> str:
    spec = sc.tenants[tenant]
    mine = [r for r in m.queued.values() if r.tenant == tenant]
    assert spec.max_queued is not None  # every scenario's tenant has a cap of its own
    if len(mine) >= spec.max_queued:
        return f"tenant {tenant!r} max_queued={spec.max_queued}"
    if spec.max_queued_bytes is not None and sum(r.nbytes for r in mine) + nbytes > (
        spec.max_queued_bytes
    ):
        return f"tenant {tenant!r} max_queued_bytes={spec.max_queued_bytes}"
    # Without its own byte cap, a tenant's default: its share of the global cap (here one
    # scheduler holds every request, so its bytes here are its bytes everywhere).
    share = max(1, int(sc.global_max_bytes * sc.tenant_bytes_share))
    if spec.max_queued_bytes is None and nbytes and sum(r.nbytes for r in mine) + nbytes > share:
        return (
            f"tenant {tenant!r} max_queued_bytes={share} (its default: tenant_bytes_share "
            f"{sc.tenant_bytes_share:g} of the global max_queued_bytes={sc.global_max_bytes})"
        )
    if len(m.queued) >= caps.max_queued:
        return f"global max_queued={caps.max_queued}"
    if sum(r.nbytes for r in m.queued.values()) + nbytes > caps.max_queued_bytes:
        return f"global max_queued_bytes={caps.max_queued_bytes}"
    return ""


def check_views(s: Scheduler, m: Model, caps: GlobalCaps) -> None:
    queued = list(m.queued.values())
    c = s.counters
    assert (c.admitted, c.dispatched, c.expired, c.cancelled) == (
        m.admitted,
        m.dispatched,
        m.expired,
        m.cancelled,
    )
    assert c.admitted == c.dispatched + c.expired + c.cancelled + s.queued_requests
    assert s.queued_requests == len(queued) == caps.queued
    per_tenant: dict[str, int] = {}
    for r in queued:
        if r.nbytes:
            per_tenant[r.tenant] = per_tenant.get(r.tenant, 0) + r.nbytes
    assert caps.tenant_bytes == per_tenant
    assert s.queued_rows == sum(r.rows for r in queued)
    assert s.queued_tokens == sum(r.tokens for r in queued)
    assert s.queued_bytes == sum(r.nbytes for r in queued) == caps.queued_bytes
    depths: dict[str, int] = {}
    for r in queued:
        depths[r.tenant] = depths.get(r.tenant, 0) + 1
    assert s.depths() == depths
    if m.sc.mode == "fair":
        assert set(s.deficits()) == set(depths)
        assert all(d >= -EPS for d in s.deficits().values())
    deadlines = [r.deadline for r in queued if r.deadline is not None]
    if m.pending_expired:
        expired = [r.deadline for r in m.pending_expired if r.deadline is not None]
        assert len(expired) == len(m.pending_expired)  # each expired: each had a deadline
        assert s.next_deadline() == min(expired)
    else:
        assert s.next_deadline() == (min(deadlines) if deadlines else None)
    assert s.oldest_arrival() == (min(r.arrival for r in queued) if queued else None)
    for tenant in m.sc.tenants:
        for priority in (1, 2, 3):
            assert s.backlog_ahead(tenant, priority, 2, 10) == model_backlog(
                m, tenant, priority, 2, 10
            )


def model_backlog(m: Model, tenant: str, priority: int, rows: int, tokens: int) -> Backlog:
    """``backlog_ahead`` recomputed from the queued requests themselves (docstring formula)."""
    queued = list(m.queued.values())
    if m.sc.mode == "fifo":
        return Backlog(sum(r.rows for r in queued) + rows, sum(r.tokens for r in queued) + tokens)
    rank = {t: i for i, t in enumerate(m.sc.tiers)}
    mine = rank[m.tier_of(tenant)]
    higher = [r for r in queued if rank[m.tier_of(r.tenant)] < mine]
    ahead = [r for r in queued if r.tenant == tenant and r.priority <= priority]
    peers = [r for r in queued if r.tenant != tenant and rank[m.tier_of(r.tenant)] == mine]
    weight = m.sc.tenants[tenant].weight
    active = {r.tenant for r in peers} | {tenant}
    active_weight = sum(m.sc.tenants[t].weight for t in active)
    same_tier = [r for r in queued if rank[m.tier_of(r.tenant)] == mine]
    extra_rows = extra_tokens = 0
    if peers:
        peers_cost = sum(r.cost for r in peers)
        if peers_cost > 0:
            cost = sum(r.cost for r in ahead) + model_cost(m.sc.cost, rows, tokens)
            others = active_weight - weight
            share = cost * others / weight
            grants = m.sc.quantum * others
            share += grants / 2 * min(1.0, peers_cost / grants)
            tier_cost = sum(r.cost for r in same_tier)
            extra_rows = math.ceil(share * sum(r.rows for r in same_tier) / tier_cost)
            extra_tokens = math.ceil(share * sum(r.tokens for r in same_tier) / tier_cost)
        else:
            extra_rows = sum(r.rows for r in peers)
            extra_tokens = sum(r.tokens for r in peers)
    return Backlog(
        sum(r.rows for r in higher + ahead) + extra_rows + rows,
        sum(r.tokens for r in higher + ahead) + extra_tokens + tokens,
    )


def check_batch(s: Scheduler, m: Model, batch: list[QueuedRequest]) -> None:
    sc = m.sc
    if not m.queued:
        assert batch == []
        return
    assert batch, "work-conserving: something is queued"
    if sc.max_batch_size == 0:
        assert len(batch) == 1
    elif len(batch) > 1:
        assert sum(r.rows for r in batch) <= sc.max_batch_size
        if sc.max_batch_tokens is not None:
            assert sum(r.tokens for r in batch) <= sc.max_batch_tokens
        assert len({r.shape_key for r in batch}) == 1
    tier_rank = {t: i for i, t in enumerate(sc.tiers)}
    for r in batch:
        assert id(r) in m.queued, "dispatched a request that is not queued"
        assert r.deadline is None or r.deadline > m.now
        if sc.mode == "fifo":
            assert r.seq == min(x.seq for x in m.queued.values())
        else:
            mine = [x for x in m.queued.values() if x.tenant == r.tenant]
            assert order_key(r) == min(order_key(x) for x in mine)
            if not sc.min_share:
                top = min(tier_rank[m.tier_of(x.tenant)] for x in m.queued.values())
                assert tier_rank[m.tier_of(r.tenant)] == top
        m.dispatched += 1
        m.served[r.tenant] = m.served.get(r.tenant, 0.0) + r.cost
        if sc.mode == "fair":
            m.check_drr_bound()
        m.leave(r)


def batch_ended_for_a_reason(sc: Scenario, prev: list[QueuedRequest], nxt: QueuedRequest) -> bool:
    if sc.max_batch_size == 0:
        return True
    rows = sum(r.rows for r in prev)
    tokens = sum(r.tokens for r in prev)
    cap = sc.max_batch_tokens
    return (
        rows + nxt.rows > sc.max_batch_size
        or (cap is not None and tokens + nxt.tokens > cap)
        or nxt.shape_key != prev[0].shape_key
        or (cap is not None and tokens >= cap)
    )


def enqueue_one(
    s: Scheduler,
    m: Model,
    caps: GlobalCaps,
    tenant: str,
    rows: int,
    tokens: int,
    nbytes: int,
    priority: int,
    offset: int | None,
    shape: int | None,
) -> None:
    deadline = None if offset is None else m.now + offset
    r = make_request(
        tenant,
        rows=rows,
        tokens=tokens,
        nbytes=nbytes,
        priority=priority,
        deadline=deadline,
        shape=shape,
    )
    refusal = expected_refusal(m.sc, m, caps, tenant, nbytes)
    # What the shells are told to shed is what enqueue refuses.
    assert (s.full(tenant, nbytes) or "") == refusal
    try:
        s.enqueue(r, m.now)
    except QueueFull as err:
        assert err.cap == refusal
    else:
        assert not refusal, f"should have refused: {refusal}"
        assert r.cost == model_cost(m.sc.cost, rows, tokens)
        assert r.seq == m.admitted
        m.admitted += 1
        m.queued[id(r)] = r
        m.join(r)


@PROPERTY_SETTINGS
@given(scenarios())
def test_random_interleavings_keep_every_guarantee(sc: Scenario) -> None:
    caps = GlobalCaps(
        sc.global_max_queued, sc.global_max_bytes, tenant_bytes_share=sc.tenant_bytes_share
    )
    policy = EndpointPolicy(
        sc.cost,
        sc.max_batch_size,
        sc.max_batch_tokens,
        sc.quantum,
        sc.tiers,
        sc.min_share,
        share_window_rows=20,
    )
    s = Scheduler(policy, sc.tenants, caps, mode=sc.mode)
    m = Model(sc)
    last_batch: list[QueuedRequest] | None = None  # the previous op's batch, if it was one
    for op in sc.ops:
        kind = op[0]
        prev_batch, last_batch = last_batch, None
        if kind == "enqueue":
            for tenant, rows, tokens, nbytes, priority, offset, shape in op[1]:
                enqueue_one(s, m, caps, tenant, rows, tokens, nbytes, priority, offset, shape)
        elif kind == "batch":
            for r in [x for x in m.queued.values() if x.deadline is not None]:
                if r.deadline is not None and r.deadline <= m.now:  # expired, not dispatched
                    m.expired += 1
                    m.pending_expired.append(r)
                    m.leave(r)
            batch = s.next_batch(m.now)
            if prev_batch and batch:
                assert batch_ended_for_a_reason(sc, prev_batch, batch[0])
            check_batch(s, m, batch)
            last_batch = batch
        elif kind == "tick":
            m.now += op[1]
        elif kind == "expire":
            due = [r for r in m.queued.values() if r.deadline is not None and r.deadline <= m.now]
            for r in due:
                m.expired += 1
                m.leave(r)
            expected = {id(r) for r in m.pending_expired + due}
            m.pending_expired = []
            got = s.expire(m.now)
            assert {id(r) for r in got} == expected and len(got) == len(expected)
        elif kind == "cancel":
            _, index, queued_one = op
            pool = list(m.queued.values()) if queued_one else m.done
            if pool:
                r = pool[index % len(pool)]
                was_queued = id(r) in m.queued
                assert s.cancel(r, m.now) == was_queued
                if was_queued:
                    m.cancelled += 1
                    m.leave(r)
        check_views(s, m, caps)


# ---- theorem A: a common start -------------------------------------------------------------


@PROPERTY_SETTINGS
@given(
    st.lists(st.sampled_from(WEIGHTS), min_size=2, max_size=4),
    st.sampled_from(list(CostUnit)),
    st.sampled_from([0.5, 1.0, 3.0, 10.0]),
    st.integers(0, 5),
    st.one_of(st.none(), st.integers(10, 80)),
    st.data(),
)
def test_common_start_keeps_the_tighter_bound(
    weights: list[float],
    unit: CostUnit,
    quantum: float,
    max_batch_size: int,
    max_batch_tokens: int | None,
    data: st.DataObject,
) -> None:
    """Tenants that start together: |S_A/a - S_B/b| < q + max(C_A/a, C_B/b) throughout."""
    tenants = {f"u{i}": TenantSpec("paid", weight=w) for i, w in enumerate(weights)}
    policy = EndpointPolicy(unit, max_batch_size, max_batch_tokens, quantum, ("paid",))
    s = Scheduler(policy, tenants, GlobalCaps())
    left: dict[str, int] = {}
    largest: dict[str, float] = {}
    for name in tenants:
        backlog = data.draw(
            st.lists(
                st.tuples(st.integers(1, 3), st.integers(0, 40), st.one_of(st.none(), st.just(1))),
                min_size=1,
                max_size=15,
            )
        )
        for rows, tokens, shape in backlog:
            s.enqueue(make_request(name, rows=rows, tokens=tokens, shape=shape), 0.0)
        left[name] = len(backlog)
        largest[name] = max(model_cost(unit, rows, tokens) for rows, tokens, _ in backlog)
    served = dict.fromkeys(tenants, 0.0)
    while all(left.values()):
        batch = s.next_batch(1.0)
        assert batch
        for r in batch:
            if not all(left.values()):
                break  # someone stopped being backlogged earlier in this batch
            served[r.tenant] += r.cost
            left[r.tenant] -= 1
            for a_name, a_spec in tenants.items():
                for b_name, b_spec in tenants.items():
                    a, b = a_spec.weight, b_spec.weight
                    diff = served[a_name] / a - served[b_name] / b
                    bound = quantum + max(largest[a_name] / a, largest[b_name] / b)
                    assert abs(diff) < bound + EPS, (a_name, b_name, diff, bound)


# ---- round jumps: exactly a naive DRR --------------------------------------------------------


class NaiveDrr:
    """Interleaved deficit round robin walked visit by visit and round by round, with no
    shortcut (the reference): each round grants every listed tenant its quantum, then the
    tenants take turns, a visit sending about ``weight`` requests like its head (or the
    grant's share of one of ``visits`` slices, if more), until none can afford its head."""

    def __init__(self, quantum: float, weights: dict[str, float], visits: int) -> None:
        self.quantum = quantum
        self.weights = weights
        self.visits = visits
        self.queues: dict[str, deque[QueuedRequest]] = {t: deque() for t in weights}
        self.active: deque[str] = deque()  # this round's, still sending
        self.later: deque[str] = deque()  # the next round's
        self.round = 0
        self.granted = dict.fromkeys(weights, -1)
        self.deficit = dict.fromkeys(weights, 0.0)
        self.current: str | None = None
        self.spent = 0.0
        self.budget = 0.0

    def enqueue(self, r: QueuedRequest) -> None:
        if not self.queues[r.tenant]:
            self.later.append(r.tenant)
            self.deficit[r.tenant] = 0.0
        self.queues[r.tenant].append(r)

    def next(self) -> QueuedRequest | None:
        while self.active or self.later:
            if self.current is None:
                if not self.active:
                    self.active, self.later = self.later, deque()
                    self.round += 1
                    continue
                t = self.current = self.active[0]
                weight = self.weights[t]
                if self.granted[t] < self.round:
                    self.deficit[t] += self.quantum * weight
                    self.granted[t] = self.round
                self.spent = 0.0
                head_cost = self.queues[t][0].cost
                slice_ = max(self.quantum / self.visits, head_cost)
                self.budget = weight * slice_ if self.visits > 1 else math.inf
            t = self.current
            head = self.queues[t][0]
            if head.cost > self.deficit[t]:
                self.active.popleft()
                self.later.append(t)
            elif self.spent and self.spent + head.cost > self.budget:
                self.active.rotate(-1)
            else:
                self.queues[t].popleft()
                self.deficit[t] -= head.cost
                self.spent += head.cost
                if not self.queues[t]:
                    self.active.popleft()
                    self.deficit[t] = 0.0
                    self.current = None
                return head
            self.current = None
        return None


@PROPERTY_SETTINGS
@given(
    st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0]), min_size=1, max_size=5),
    st.sampled_from([0.5, 1.0, 2.0]),
    st.integers(1, 8),
    st.lists(
        st.one_of(st.tuples(st.integers(0, 4), st.integers(0, 60)), st.just(None)),
        max_size=80,
    ),
)
def test_round_jumps_dispatch_exactly_like_naive_drr(
    weights: list[float],
    quantum: float,
    max_batch_size: int,
    ops: list[tuple[int, int] | None],
) -> None:
    tenants = {f"u{i}": TenantSpec("paid", weight=w) for i, w in enumerate(weights)}
    policy = EndpointPolicy(CostUnit.TOKENS, max_batch_size, None, quantum, ("paid",))
    s = Scheduler(policy, tenants, GlobalCaps())
    weights_of = {t: spec.weight for t, spec in tenants.items()}
    naive = NaiveDrr(quantum, weights_of, max(1, max_batch_size))
    names = sorted(tenants)
    for op in [*ops, None, None, None]:
        if op is None:
            # rows of 1 and no other cap: a batch peeks only when full or empty, so the
            # batch boundary cannot change the decision sequence.
            for r in s.next_batch(1.0):
                assert naive.next() is r
        else:
            index, tokens = op
            r = make_request(names[index % len(names)], tokens=tokens)
            s.enqueue(r, 0.0)
            naive.enqueue(r)
    assert s.deficits() == {t: naive.deficit[t] for t in (*naive.active, *naive.later)}
