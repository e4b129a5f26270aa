"""Failover keeps the debt (``fair_frontend.scheduler.snapshot``): a scheduler's fairness
state, exported by a leader and resumed by the scheduler of the core that takes over,
keeps who is ahead by how much, whatever order the tenants' calls come back in.

A failover is played on the fake clock: the leader's scheduler runs, its state is
exported (through msgpack, as it travels), a fresh scheduler resumes it, and the
tenants' queued calls are enqueued again as the shells would send them. Each test has
its negative control: the same fresh scheduler without the resume (today's new leader).
"""

from __future__ import annotations

import msgspec
import pytest
from sched_support import make_request, make_scheduler
from test_vtc import Engine, Running, backlog, engine_scheduler, out_of

from fair_frontend.scheduler import Scheduler, SchedulerFairness, TenantSpec, VirtualTokenCounter

KEEP_S = 10.0
SHORT = 16  # output tokens of every queued generation


def carried(s: Scheduler) -> SchedulerFairness:
    """The leader's export, as a standby decodes it."""
    wire = msgspec.msgpack.encode(s.export_fairness())
    return msgspec.msgpack.decode(wire, type=SchedulerFairness)


def a_ahead_of_b() -> tuple[Scheduler, Engine]:
    """Engine mode: A holds all 8 slots with 200-token generations (its queued ones are
    short); B joins (lifted to A's counter) and waits, while A's outputs stream for 140
    steps more: A is 1,120 tokens ahead, B has had nothing since it joined."""
    s = engine_scheduler({"a": TenantSpec("paid"), "b": TenantSpec("paid")})
    backlog(s, "a", 8, prompt=8, out=200)
    backlog(s, "a", 100, prompt=8, out=SHORT)
    engine = Engine(s, slots=8, output=out_of)
    engine.fill()
    for _ in range(50):
        engine.step()
    backlog(s, "b", 100, prompt=8, out=SHORT, at=float(engine.step_no))
    for _ in range(140):
        engine.step()
    assert "b" not in engine.first_slot
    return s, engine


def failover(
    leader: Scheduler, engine: Engine, order: tuple[str, ...], *, resume: bool
) -> tuple[Scheduler, Engine]:
    """A new leader's scheduler: the old one's export resumed (or not), the running
    generations carried on (the shells relay them; their tokens are charged to the new
    one), and each tenant's queued calls sent again, in ``order``."""
    saved = carried(leader)
    s = engine_scheduler({"a": TenantSpec("paid"), "b": TenantSpec("paid")})
    now = 0.0
    if resume:
        s.resume_fairness(saved, now, KEEP_S)
    new = Engine(s, slots=8, output=out_of)
    new.running = [Running(r.req, r.left) for r in engine.running]
    for tenant in order:
        left = leader.depth(tenant)
        backlog(s, tenant, left, prompt=8, out=SHORT, at=now)
    return s, new


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_a_tenant_ahead_before_the_failover_is_ahead_by_as_much_after(
    order: tuple[str, ...],
) -> None:
    leader, engine = a_ahead_of_b()
    before = leader.deficits()
    assert before["a"] - before["b"] >= 1000
    s, _ = failover(leader, engine, order, resume=True)
    assert s.deficits() == before  # exactly: counters restored, not lifted nor re-based


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_the_tenant_behind_gets_every_free_slot_until_even(order: tuple[str, ...]) -> None:
    """After the failover A's long generations end (10 tokens each to go); each free slot
    goes to B's short ones until B's counter has caught up with A's: 1,200 tokens, some
    50 generations of 24. Negative control: a new leader that forgot (it counts A's last
    80 tokens only) gives A about half of them."""
    leader, engine = a_ahead_of_b()
    _s, new = failover(leader, engine, order, resume=True)
    _forgot, control = failover(leader, engine, order, resume=False)
    first: dict[str, list[str]] = {"resumed": [], "forgot": []}
    for name, eng in (("resumed", new), ("forgot", control)):
        while len(first[name]) < 24:
            running = {id(r.req) for r in eng.running}
            eng.step()
            first[name] += [r.req.tenant for r in eng.running if id(r.req) not in running]
    assert first["resumed"] == ["b"] * 24, first
    assert first["forgot"].count("a") >= 8, first


def test_a_late_joiner_after_keep_s_is_lifted_as_from_idle() -> None:
    """A tenant backlogged at the export whose calls come back only after ``keep_s``
    cannot bank its old, lower counter: it joins as a tenant back from idle does."""
    leader, _engine = a_ahead_of_b()
    saved = carried(leader)
    s = engine_scheduler({"a": TenantSpec("paid"), "b": TenantSpec("paid")})
    s.resume_fairness(saved, 0.0, KEEP_S)
    backlog(s, "a", 5, prompt=8, out=200, at=1.0)
    backlog(s, "b", 5, prompt=8, out=200, at=KEEP_S + 1)
    got = s.deficits()
    assert got["b"] == got["a"] == leader.deficits()["a"]


def test_drr_deficits_and_a_charge_back_debt_survive_the_failover() -> None:
    """Request cost, DRR: A's requests were charged back 5 units after dispatch (A owes
    them: its deficit is below 0), B sits on a partial budget. Resumed, both deficits are
    exact, and B is served before A sends again; a new leader that forgot alternates."""
    tenants = {"a": "paid", "b": "paid"}
    leader = make_scheduler(tenants, quantum=4.0, max_batch_size=1)
    for tenant in ("a", "b"):
        for i in range(20):
            leader.enqueue(make_request(tenant, tag=(tenant, i)), 0.0)
    for _ in range(6):  # A's turn: 4 of its requests; B's: 2 of its 4 units
        leader.next_batch(0.0)
    leader.charge_back("a", 5.0)
    before = leader.deficits()
    assert before["a"] < 0 < before["b"]
    saved = carried(leader)

    def after(resume: bool) -> tuple[Scheduler, list[str]]:
        s = make_scheduler(tenants, quantum=4.0, max_batch_size=1)
        if resume:
            s.resume_fairness(saved, 0.0, KEEP_S)
        for tenant in ("a", "b"):  # A's calls come back first
            for i in range(leader.depth(tenant)):
                s.enqueue(make_request(tenant, tag=(tenant, i)), 0.0)
        return s, [s.next_batch(0.0)[0].tenant for _ in range(6)]

    _, served = after(resume=True)
    resumed = make_scheduler(tenants, quantum=4.0, max_batch_size=1)
    resumed.resume_fairness(saved, 0.0, KEEP_S)
    for tenant in ("b", "a"):
        resumed.enqueue(make_request(tenant), 0.0)
    assert resumed.deficits() == before
    # B's budget and A's debt: B sends its saved units and a full turn before A's first.
    assert served[:3] == ["b", "b", "b"], served
    _, forgot = after(resume=False)
    assert forgot[:2] == ["a", "a"], forgot  # A joined first, with its debt forgotten


def test_an_export_after_a_resume_still_carries_what_is_owed() -> None:
    """A second failover before every tenant came back: the first one's debts are kept."""
    leader, _engine = a_ahead_of_b()
    saved = carried(leader)
    s = engine_scheduler({"a": TenantSpec("paid"), "b": TenantSpec("paid")})
    s.resume_fairness(saved, 0.0, KEEP_S)
    backlog(s, "a", 5, prompt=8, out=200)  # only A's calls came back
    third = engine_scheduler({"a": TenantSpec("paid"), "b": TenantSpec("paid")})
    third.resume_fairness(carried(s), 0.0, KEEP_S)
    backlog(third, "a", 5, prompt=8, out=200)
    backlog(third, "b", 5, prompt=8, out=200)
    assert third.deficits() == leader.deficits()


def test_calls_coming_back_one_by_one_into_free_slots_keep_the_debt() -> None:
    """At the new leader the slots are free as the held calls come back, one at a time:
    each is sent as it comes and its tenant's queue empties again. Every join of a
    carried tenant keeps its counter (a lift at the second would undo the first), so B
    still gets the slots once both are backlogged. Negative control: lifted joins."""
    leader, _ = a_ahead_of_b()
    saved = carried(leader)

    def then_backlogged(resume: bool) -> list[str]:
        s = engine_scheduler({"a": TenantSpec("paid"), "b": TenantSpec("paid")})
        if resume:
            s.resume_fairness(saved, 0.0, KEEP_S)
        for _ in range(4):  # one call each, sent at once into a free slot
            for tenant in ("a", "b"):
                backlog(s, tenant, 1, prompt=8, out=SHORT)
                assert [r.tenant for r in s.next_batch(0.0)] == [tenant]
        backlog(s, "a", 20, prompt=8, out=SHORT)
        backlog(s, "b", 20, prompt=8, out=SHORT)
        return [s.next_batch(0.0)[0].tenant for _ in range(20)]

    assert then_backlogged(resume=True) == ["b"] * 20
    assert then_backlogged(resume=False).count("a") >= 8


def test_a_drr_deficit_left_with_is_the_one_joined_with_again() -> None:
    tenants = {"a": "paid", "b": "paid"}
    leader = make_scheduler(tenants, quantum=4.0, max_batch_size=1)
    for tenant in ("a", "b"):
        for _ in range(20):
            leader.enqueue(make_request(tenant), 0.0)
    for _ in range(6):
        leader.next_batch(0.0)
    saved = carried(leader)
    s = make_scheduler(tenants, quantum=4.0, max_batch_size=1)
    s.resume_fairness(saved, 0.0, KEEP_S)
    s.enqueue(make_request("b"), 0.0)
    s.next_batch(0.0)  # b's turn: its 2 units + 4, one spent; its queue empties
    s.enqueue(make_request("b"), 0.0)
    assert s.deficits() == {"b": 5.0}


def test_a_debt_owed_by_a_tenant_with_nothing_queued_survives_the_failover() -> None:
    """A's request was charged back after A's queue emptied: the debt it owes on its
    return (``DeficitRoundRobin.leave``) is carried, and A rejoins the new leader owing it."""
    leader = make_scheduler({"a": "paid", "b": "paid"}, quantum=4.0, max_batch_size=1)
    leader.enqueue(make_request("a"), 0.0)
    leader.enqueue(make_request("b"), 0.0)
    leader.next_batch(0.0)  # a's request: a leaves the round
    leader.charge_back("a", 6.0)
    s = make_scheduler({"a": "paid", "b": "paid"}, quantum=4.0, max_batch_size=1)
    s.resume_fairness(carried(leader), 0.0, KEEP_S)
    s.enqueue(make_request("a"), 1.0)
    assert s.deficits()["a"] == -6.0


def test_the_mean_request_cost_that_sizes_the_carried_debt_survives_the_failover() -> None:
    """A new leader carries a returning tenant's debt from its first join, in requests
    of the cost the old leader measured: it has dispatched nothing to measure yet.
    Negative control: without the export it carries none."""
    tenants = {"a": TenantSpec("paid"), "b": TenantSpec("paid")}
    lead = VirtualTokenCounter(1.0, slots=8)
    leader = engine_scheduler(tenants, carried=lead)
    backlog(leader, "a", 50, prompt=8, out=SHORT)
    engine = Engine(leader, slots=8, output=out_of)
    engine.fill()
    for _ in range(100):
        engine.step()
    backlog(leader, "b", 1, prompt=8, out=SHORT, at=float(engine.step_no))
    expected = lead.carried(1.0)
    assert expected == pytest.approx(8 * (8 + SHORT), rel=0.05)
    for resume in (True, False):
        policy = VirtualTokenCounter(1.0, slots=8)
        s = engine_scheduler(tenants, carried=policy)
        if resume:
            s.resume_fairness(carried(leader), 0.0, KEEP_S)
        backlog(s, "b", 1, prompt=8, out=SHORT, at=1.0)
        assert policy.carried(1.0) == (pytest.approx(expected) if resume else 0.0)
