"""Programs inside tenants (issue 33, item 1): a tenant's programs share its turns by
least attained service, decayed; the tenants' shares do not change.

On the scheduler alone, with explicit ``now`` values (the fake clock): how a tenant
splits its work into programs never changes which tenant is served when; inside a
tenant, the program with the least attained service goes first (ties: the existing
order of the heads); a flood of program ids costs a bounded number of programs.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_support import make_request, make_scheduler, tags

from fair_frontend.scheduler import (
    GlobalCaps,
    QueuedRequest,
    QueueState,
    Scheduler,
    SchedulerFairness,
    TenantQueue,
    TenantSpec,
)
from fair_frontend.scheduler.caps import DEFAULT_PROGRAMS_PER_TENANT
from fair_frontend.scheduler.core import PROGRAM_HALF_LIFE_S
from fair_frontend.scheduler.cost import CostUnit

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WEIGHTS = [0.5, 1.0, 2.0, 3.0]


def queue_of(s: Scheduler, tenant: str) -> TenantQueue:
    return s._queues[tenant]


# ---- (a) the tenants' shares do not depend on programs -----------------------------------


@st.composite
def split_runs(draw: st.DrawFn) -> dict[str, Any]:
    names = ["a", "b", "c"][: draw(st.integers(2, 3))]
    enqueue = st.tuples(
        st.just("enqueue"),
        st.sampled_from(names),
        st.integers(1, 6),  # how many
        st.integers(1, 3),  # priority
        st.integers(0, 4),  # the program of a's requests, split
    )
    op = st.one_of(
        enqueue,
        enqueue,
        st.tuples(st.just("batch")),
        st.tuples(st.just("batch")),
        st.tuples(st.just("tick"), st.sampled_from([0.25, 1.0, 4.0, 12.0])),
        st.tuples(st.just("cancel"), st.sampled_from(names), st.integers(0, 50)),
        st.tuples(st.just("credit"), st.sampled_from(names), st.integers(-2, 6)),
    )
    return {
        "fairness": draw(st.sampled_from(["drr", "vtc"])),
        "weights": {n: draw(st.sampled_from(WEIGHTS)) for n in names},
        "quantum": draw(st.sampled_from([0.5, 1.0, 3.0])),
        "max_batch_size": draw(st.sampled_from([0, 1, 3, 8])),
        "ops": draw(st.lists(op, min_size=5, max_size=80)),
    }


def served_tenants(run: dict[str, Any], *, split: bool) -> tuple[list[str], int]:
    """The tenant of every request dispatched, in order, and how many programs tenant
    ``a``'s queue kept apart at most (``split``: a's requests name programs p0..p4;
    otherwise none)."""
    tenants = {n: TenantSpec("paid", weight=w) for n, w in run["weights"].items()}
    s = make_scheduler(
        tenants,
        tiers=("paid",),
        fairness=run["fairness"],
        quantum=run["quantum"],
        max_batch_size=run["max_batch_size"],
    )
    now = 0.0
    out: list[str] = []
    queued: list[QueuedRequest] = []
    most = 0
    for op in run["ops"]:
        if op[0] == "enqueue":
            _, tenant, count, priority, program = op
            named = f"p{program}" if split and tenant == "a" else ""
            for _ in range(count):
                req = make_request(tenant, priority=priority, program=named)
                s.enqueue(req, now)
                queued.append(req)
        elif op[0] == "batch":
            out.extend(r.tenant for r in s.next_batch(now))
        elif op[0] == "tick":
            now += op[1]
        elif op[0] == "cancel":
            # The k-th of the tenant's queued requests: each run has as many of them
            # queued (the runs serve the tenants alike), though not the same ones.
            mine = [r for r in queued if r.tenant == op[1] and r.state is QueueState.QUEUED]
            if mine:
                assert s.cancel(mine[op[2] % len(mine)], now)
        else:
            s.charge_back(op[1], float(op[2]))
        if "a" in s._queues:
            most = max(most, queue_of(s, "a").programs)
    out.extend(r.tenant for batch in iter(lambda: s.next_batch(now), []) for r in batch)
    return out, most


@SETTINGS
@given(split_runs())
def test_the_tenants_served_are_the_same_however_a_tenant_splits_its_work(
    run: dict[str, Any],
) -> None:
    """Mutations caught: a program that joins its tier's round as a tenant would (a flat
    fairness over programs: a's share grows with its programs), or a queue of several
    programs whose counts drift from its requests (it leaves the round with work queued,
    or stays with none)."""
    alone, _ = served_tenants(run, split=False)
    split, _ = served_tenants(run, split=True)
    assert split == alone


def test_the_split_runs_do_keep_programs_apart() -> None:
    """The property above is not vacuous: the split run's queue holds several programs."""
    run = {
        "fairness": "drr",
        "weights": {"a": 1.0, "b": 1.0},
        "quantum": 1.0,
        "max_batch_size": 3,
        "ops": [("enqueue", "a", 3, 1, 0), ("enqueue", "a", 3, 1, 1), ("enqueue", "b", 4, 1, 0)]
        + [("batch",)] * 4,
    }
    alone, one = served_tenants(run, split=False)
    split, several = served_tenants(run, split=True)
    assert (one, several) == (1, 2)
    assert split == alone == ["a", "b", "a", "b", "a", "b", "a", "b", "a", "a"]


# ---- (b) least attained service first, inside a tenant ------------------------------------


@st.composite
def program_runs(draw: st.DrawFn) -> dict[str, Any]:
    programs = ["", "p1", "p2", "p3"]
    enqueue = st.tuples(
        st.just("enqueue"),
        st.sampled_from(["a", "a", "b"]),
        st.integers(1, 5),  # how many
        st.sampled_from(programs),
        st.integers(1, 3),  # priority
        st.integers(0, 30),  # tokens
        st.one_of(st.none(), st.integers(1, 20)),  # deadline offset
    )
    op = st.one_of(
        enqueue,
        enqueue,
        st.tuples(st.just("batch")),
        st.tuples(st.just("batch")),
        st.tuples(st.just("tick"), st.sampled_from([0.3, 1.0, 2.5, 7.0])),
        st.tuples(st.just("cancel"), st.integers(0, 1000)),
        st.tuples(st.just("expire")),
    )
    return {
        "fairness": draw(st.sampled_from(["drr", "vtc", "fifo"])),
        "cost": draw(st.sampled_from(list(CostUnit))),
        "max_batch_size": draw(st.sampled_from([0, 1, 4])),
        "ops": draw(st.lists(op, min_size=5, max_size=80)),
    }


def order_key(r: QueuedRequest) -> tuple[int, float, int]:
    return (r.priority, math.inf if r.deadline is None else r.deadline, r.seq)


@SETTINGS
@given(program_runs())
def test_inside_a_tenant_the_program_with_least_attained_service_goes_first(
    run: dict[str, Any],
) -> None:
    """Each dispatched request is, among its tenant's requests queued at that moment, the
    head (priority, deadline, arrival) of the program with the least attained service
    (what it was charged at dispatch, times 2 ** (t / half-life) on the clock's whole
    seconds: the scheduler's scale), ties to the program whose head goes first.
    Mutations caught: the most served program first, a tie broken otherwise than by the
    heads' order, a charge to the wrong program (or none), service that does not decay
    (or decays on another clock), a queue that forgets the service its one program got
    before a second one came."""
    s = make_scheduler(
        {"a": "paid", "b": "paid"},
        tiers=("paid",),
        fairness=run["fairness"],
        cost=run["cost"],
        quantum=8.0,
        max_batch_size=run["max_batch_size"],
    )
    now = 0.0
    live: list[QueuedRequest] = []
    service: dict[tuple[str, str], float] = {}
    base: int | None = None
    steps = round(PROGRAM_HALF_LIFE_S)
    for op in run["ops"]:
        if op[0] == "enqueue":
            _, tenant, count, program, priority, tokens, offset = op
            for _ in range(count):
                deadline = None if offset is None else now + offset
                req = make_request(
                    tenant, tokens=tokens, priority=priority, deadline=deadline, program=program
                )
                s.enqueue(req, now)
                live.append(req)
        elif op[0] == "batch":
            batch = s.next_batch(now)
            for i, r in enumerate(batch):
                if base is None:
                    base = math.floor(now)
                queued = [q for q in live if q.state is QueueState.QUEUED] + batch[i:]
                heads: dict[str, QueuedRequest] = {}
                for q in queued:
                    if q.tenant == r.tenant:
                        head = heads.get(q.program)
                        if head is None or order_key(q) < order_key(head):
                            heads[q.program] = q
                want = min(
                    heads.values(),
                    key=lambda h: (service.get((h.tenant, h.program), 0.0), order_key(h)),
                )
                assert r is want, (r, want, service)
                charge = r.cost * 2.0 ** ((math.floor(now) - base) / steps)
                service[r.tenant, r.program] = service.get((r.tenant, r.program), 0.0) + charge
            live = [q for q in live if q.state is QueueState.QUEUED]
        elif op[0] == "tick":
            now += op[1]
        elif op[0] == "cancel":
            queued = [q for q in live if q.state is QueueState.QUEUED]
            if queued:
                assert s.cancel(queued[op[1] % len(queued)], now)
        else:
            s.expire(now)


def test_service_halves_every_half_life() -> None:
    """A program served 4 units a half-life ago (2 now) goes before one served 3 just
    now: the older service counts half. Mutation caught: service that never decays (4 >
    3: p2 would go first)."""
    s = make_scheduler({"a": "paid"}, tiers=("paid",), max_batch_size=0)
    for _ in range(4):
        s.enqueue(make_request("a", program="p1"), 0.0)
    assert len([s.next_batch(0.0) for _ in range(4)]) == 4
    half = PROGRAM_HALF_LIFE_S
    for _ in range(3):
        s.enqueue(make_request("a", program="p2"), half)
    for _ in range(3):
        assert [r.program for r in s.next_batch(half)] == ["p2"]
    # p1: 4 units at scale 1 (2 at t = 10 s); p2: 3 at scale 2 (3 at t = 10 s).
    s.enqueue(make_request("a", program="p2", tag="p2"), half)
    s.enqueue(make_request("a", program="p1", tag="p1"), half)
    assert [r.program for r in s.next_batch(half)] == ["p1"]


def test_output_charged_back_counts_in_its_programs_service() -> None:
    """Output tokens charged back as they stream (``charge_back``, engine endpoints) are
    service of the request's program, as its charge at dispatch is: p1, charged 1 at
    dispatch and 10 after, goes after p2, charged 3 (mutation caught: charge-back to the
    tenant alone, where p1 at 1 would go first). A one-program tenant's charge-back
    counts for its program once a second comes."""
    s = make_scheduler({"a": "paid"}, tiers=("paid",), max_batch_size=0, cost=CostUnit.TOKENS)
    s.enqueue(make_request("a", tokens=1, program="p1"), 0.0)
    assert [r.program for r in s.next_batch(0.0)] == ["p1"]
    s.charge_back("a", 10.0, "p1")
    s.enqueue(make_request("a", tokens=3, program="p2"), 0.0)
    assert [r.program for r in s.next_batch(0.0)] == ["p2"]
    s.enqueue(make_request("a", tokens=1, program="p1"), 0.0)
    s.enqueue(make_request("a", tokens=1, program="p2"), 0.0)
    assert [r.program for r in s.next_batch(0.0)] == ["p2"]  # 3 < 11
    s.enqueue(make_request("a", tokens=1, program="p2"), 0.0)
    s.charge_back("a", -100.0, "gone")  # a program the queue does not keep: nothing
    assert [r.program for r in s.next_batch(0.0)] == ["p2"]  # 4 < 11


def test_a_rebase_keeps_the_order_and_the_services_exact() -> None:
    """Past 64 half-lives the scale is taken back by a power of two: every program's
    service divided alike, exactly (mutation caught: a rebase that skips a queue, or
    divides by another factor, reorders the programs after it)."""
    s = make_scheduler({"a": "paid"}, tiers=("paid",), max_batch_size=0)
    s.enqueue(make_request("a", program="p1"), 0.0)
    s.enqueue(make_request("a", program="p2"), 0.0)
    s.enqueue(make_request("a", program="p2"), 0.0)
    assert [r.program for r in s.next_batch(0.0)] == ["p1"]
    assert [r.program for r in s.next_batch(0.0)] == ["p2"]
    assert [r.program for r in s.next_batch(0.0)] == ["p2"]  # p1 has nothing queued
    programs = queue_of(s, "a")._programs
    assert programs is not None
    assert (programs["p1"].service, programs["p2"].service) == (1.0, 2.0)
    later = 64 * PROGRAM_HALF_LIFE_S + 0.5
    s.enqueue(make_request("a", program="p2"), later)
    s.enqueue(make_request("a", program="p1"), later)
    assert [r.program for r in s.next_batch(later)] == ["p1"]  # 1 < 2, as before
    assert (programs["p1"].service, programs["p2"].service) == (0.5**64 + 1.0, 2 * 0.5**64)


# ---- one program, as before; a flood of programs, bounded ---------------------------------


def test_a_tenant_with_one_program_keeps_one_heap() -> None:
    """A tenant that names one program (or none) is served from one heap, as before
    programs (mutation caught: a queue that keeps a program apart for its first id, the
    per-request work the one-program path must not do)."""
    s = make_scheduler({"a": "paid", "b": "paid"}, tiers=("paid",))
    for _ in range(5):
        s.enqueue(make_request("a", program="agent-1"), 0.0)
        s.enqueue(make_request("b"), 0.0)
    s.next_batch(0.0)
    for tenant in ("a", "b"):
        assert queue_of(s, tenant)._programs is None
        assert queue_of(s, tenant).programs == 1


def test_programs_per_tenant_one_tells_no_programs_apart() -> None:
    """``programs_per_tenant: 1``: one queue per tenant, in (priority, deadline, arrival)
    order whatever its requests name."""
    s = make_scheduler({"a": "paid"}, tiers=("paid",), caps=GlobalCaps(programs_per_tenant=1))
    for i in range(6):
        s.enqueue(make_request("a", program=f"p{i % 3}", priority=3 - i % 3, tag=i), 0.0)
    assert [r.tag for r in s.next_batch(0.0)] == [2, 5, 1, 4, 0, 3]
    assert queue_of(s, "a").programs == 1


def test_a_flood_of_program_ids_keeps_at_most_the_bound() -> None:
    """10,000 distinct program ids from one tenant: the queue keeps at most
    ``programs_per_tenant`` programs (the overflow one included) at every moment, loses
    no request, and takes an idle program's place for a new id (mutation caught: a
    program kept for every id, or an overflow never left again)."""
    bound = 8
    s = make_scheduler(
        {"a": "paid", "b": "paid"}, tiers=("paid",), caps=GlobalCaps(programs_per_tenant=bound)
    )
    queue = None
    sent = 0
    for i in range(10_000):
        s.enqueue(make_request("a", program=f"flood-{i}"), float(i))
        if i % 3 == 0:
            s.enqueue(make_request("b"), float(i))
        queue = queue_of(s, "a")
        assert queue.programs <= bound
        if i % 50 == 49:
            sent += sum(r.tenant == "a" for r in s.next_batch(float(i)))
    assert queue is not None
    assert queue.programs == bound  # 7 by name and the overflow
    while batch := s.next_batch(1e4):
        sent += sum(r.tenant == "a" for r in batch)
    assert sent == 10_000
    # Drained, a new id takes an idle program's place rather than the overflow.
    s.enqueue(make_request("a", program="late"), 1e4)
    assert queue.programs == bound
    assert queue._programs is not None and "late" in queue._programs


def test_the_default_bound_holds_against_a_flood() -> None:
    s = make_scheduler({"a": "paid"}, tiers=("paid",))
    for i in range(2_000):
        s.enqueue(make_request("a", program=f"id-{i}"), 0.0)
    assert queue_of(s, "a").programs == DEFAULT_PROGRAMS_PER_TENANT
    assert sum(len(b) for b in iter(lambda: s.next_batch(0.0), [])) == 2_000


# ---- a failover keeps the programs' order ------------------------------------------------


def _resumed(leader: Scheduler | None, now: float) -> Scheduler:
    """A new leader's scheduler, resuming ``leader``'s export as a standby decodes it
    (None: today's new leader, which resumes nothing)."""
    s = make_scheduler({"a": "paid", "b": "paid"}, tiers=("paid",), max_batch_size=0)
    if leader is not None:
        wire = msgspec.msgpack.encode(leader.export_fairness())
        s.resume_fairness(msgspec.msgpack.decode(wire, type=SchedulerFairness), now, 10.0)
    return s


def test_a_program_that_took_more_before_a_failover_goes_after_the_others_after_it() -> None:
    """Inside tenant a, the agent took 6 units before the leader failed (one call, and
    its output charged back), the chat 1, the unnamed program 1; all still have calls
    queued. The shells send them again to the new leader, the agent's first: the chat's
    and the unnamed program's go before the agent's, which has had most, as at the old
    leader. Negative control: a new leader without the export serves the agent first
    (every program even, its head first)."""
    leader = make_scheduler({"a": "paid", "b": "paid"}, tiers=("paid",), max_batch_size=0)
    for program in ("agent", "chat", "", "agent", "chat", ""):
        leader.enqueue(make_request("a", program=program), 0.0)
    assert [leader.next_batch(0.0)[0].program for _ in range(3)] == ["agent", "chat", ""]
    leader.charge_back("a", 5.0, "agent")
    exported = leader.export_fairness().programs["a"]
    assert exported == {"agent": 6.0, "chat": 1.0, "": 1.0}

    def first_served(s: Scheduler) -> list[str]:
        for program in ("agent", "agent", "chat", ""):
            s.enqueue(make_request("a", program=program), 1.0)
        return [s.next_batch(1.0)[0].program for _ in range(4)]

    assert first_served(_resumed(leader, 1.0)) == ["chat", "", "agent", "agent"]
    assert first_served(_resumed(None, 1.0))[0] == "agent"


def test_a_program_back_after_the_resume_is_over_starts_as_a_new_one() -> None:
    """The carried service waits for each program ``keep_s`` (10 s here); one that comes
    back later starts with none, as any program new to the queue (mutation caught: a
    restore that never ends, which would bank an old position for later)."""
    leader = make_scheduler({"a": "paid", "b": "paid"}, tiers=("paid",), max_batch_size=0)
    for program in ("agent", "agent", "agent", "chat"):
        leader.enqueue(make_request("a", program=program), 0.0)
    assert [leader.next_batch(0.0)[0].program for _ in range(2)] == ["agent", "chat"]
    assert leader.next_batch(0.0)[0].program == "agent"  # 2 units; chat 1; one still queued
    s = _resumed(leader, 0.0)
    s.enqueue(make_request("b"), 0.0)  # another tenant's calls come back in time ...
    s.enqueue(make_request("a", program="agent"), 20.0)  # ... a's after keep_s
    s.enqueue(make_request("a", program="chat"), 20.0)
    assert queue_of(s, "a").export_programs(1.0) == {}
    s.next_batch(20.0)
    assert [s.next_batch(20.0)[0].program for _ in range(2)] == ["agent", "chat"]


# ---- (d) the throttle's work ahead follows the programs --------------------------------------


@st.composite
def program_histories(draw: st.DrawFn) -> dict[str, Any]:
    programs = ["", "agent", "chat", "p3"]
    op = st.one_of(
        st.tuples(st.just("enqueue"), st.sampled_from(programs), st.integers(1, 8)),
        st.tuples(st.just("batch")),
    )
    return {
        "max_batch_size": draw(st.sampled_from([1, 3])),
        "ops": draw(st.lists(op, min_size=1, max_size=40)),
        "program": draw(st.sampled_from(programs)),
    }


@SETTINGS
@given(program_histories())
def test_the_work_ahead_of_a_new_request_is_what_its_tenant_serves_before_it(
    run: dict[str, Any],
) -> None:
    """The throttle's count of a tenant's own work ahead of a new request
    (``own_ahead``, of its program) is exactly how many of the tenant's queued requests
    go before it: its program's own, and of each other program what least attained
    service serves first (requests of one cost and level, no time passing). Mutations
    caught: the whole queue counted (a chat's call behind its own agent's fan-out), the
    service gap ignored or taken the wrong way round, the alternation left out."""
    s = make_scheduler({"a": "paid"}, max_batch_size=run["max_batch_size"])
    for op in run["ops"]:
        if op[0] == "enqueue":
            for _ in range(op[2]):
                s.enqueue(make_request("a", program=op[1]), 0.0)
        else:
            s.next_batch(0.0)
    program = run["program"]
    predicted = s.own_ahead("a", 1, program)
    assert s.own_ahead("a", 1) >= predicted  # the whole queue: never less
    new = make_request("a", program=program, tag="new")
    s.enqueue(new, 0.0)
    before = 0
    while (batch := s.next_batch(0.0)) and new not in batch:
        before += len(batch)
    before += [r.tag for r in batch].index("new")
    assert predicted == before


def test_a_chat_call_beside_its_own_agents_fan_out_has_none_of_it_ahead() -> None:
    """The agent has been served and has 64 calls queued; the chat's new call goes
    before all of them (its program has less service): nothing of the tenant's ahead of
    it, where the tenant's whole queue counted 64."""
    s = make_scheduler({"a": "paid"}, max_batch_size=1)
    for _ in range(8):
        s.enqueue(make_request("a", program="agent"), 0.0)
    for _ in range(4):
        s.next_batch(0.0)  # the agent: 4 served
    for _ in range(60):
        s.enqueue(make_request("a", program="agent"), 0.0)
    assert s.own_ahead("a", 1) == 64
    assert s.own_ahead("a", 1, "chat") == 0
    backlog = s.backlog_ahead("a", 1, 1, 0, "chat")
    assert backlog.rows == 1  # the call itself
    assert s.backlog_ahead("a", 1, 1, 0).rows == 65  # the tenant's calls judged together
    s.enqueue(make_request("a", program="chat", tag="chat"), 0.0)
    assert tags(s.next_batch(0.0)) == ["chat"]
