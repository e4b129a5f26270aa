"""Unit tests of the scheduling core, one behaviour each, on explicit times."""

from __future__ import annotations

import math

import pytest
from sched_support import drain, make_request, make_scheduler, tags

from fair_frontend.config import CostUnit, parse_config
from fair_frontend.core.plan import global_caps
from fair_frontend.endpoint import plan
from fair_frontend.errors import MSG_QUEUE_FULL, Internal, QueueFull
from fair_frontend.models import ModelInfo
from fair_frontend.scheduler import (
    Backlog,
    Counters,
    EndpointPolicy,
    GlobalCaps,
    QueueState,
    RequestCost,
    Scheduler,
    TenantSpec,
    TokenCost,
)
from fair_frontend.scheduler.caps import DEFAULT_TENANT_MAX_QUEUED


def batching_model(max_batch_size: int) -> ModelInfo:
    """A model that batches up to ``max_batch_size`` rows (what a policy reads of it)."""
    return ModelInfo(name="m", max_batch_size=max_batch_size, inputs={}, outputs={})


PAID2 = {"a": "paid", "b": "paid"}


# ---- order inside a tenant's queue -------------------------------------------------------


def test_tenant_order_is_priority_then_deadline_then_arrival() -> None:
    s = make_scheduler({"a": "paid"})
    arrivals = [
        ("p2-none", 2, None),
        ("p1-none-1st", 1, None),
        ("p1-d9", 1, 9.0),
        ("p3-d1", 3, 1.0),
        ("p1-d5", 1, 5.0),
        ("p1-none-2nd", 1, None),
        ("p1-d5-later", 1, 5.0),
    ]
    for i, (tag, priority, deadline) in enumerate(arrivals):
        s.enqueue(make_request("a", priority=priority, deadline=deadline, tag=tag), float(i))
    assert drain(s) == [
        ["p1-d5", "p1-d5-later", "p1-d9", "p1-none-1st", "p1-none-2nd", "p2-none", "p3-d1"]
    ]


def test_priority_does_not_cross_tenants() -> None:
    """Priority orders one tenant's requests; DRR alone decides between tenants."""
    s = make_scheduler(PAID2)
    for i in range(3):
        s.enqueue(make_request("a", priority=5, tag=f"a{i}"), 0.0)
    for i in range(3):
        s.enqueue(make_request("b", priority=1, tag=f"b{i}"), 0.0)
    assert drain(s) == [["a0", "b0", "a1", "b1", "a2", "b2"]]


# ---- tiers ---------------------------------------------------------------------------------


def test_higher_tier_goes_first_whatever_the_arrival_order() -> None:
    s = make_scheduler({"p": "paid", "t": "trial"}, max_batch_size=3)
    for i in range(2):
        s.enqueue(make_request("t", tag=f"t{i}"), 0.0)
    for i in range(2):
        s.enqueue(make_request("p", tag=f"p{i}"), 1.0)
    assert tags(s.next_batch(2.0)) == ["p0", "p1", "t0"]
    s.enqueue(make_request("p", tag="p2"), 3.0)
    assert drain(s, 3.0) == [["p2", "t1"]]


def test_lower_tier_starves_under_strict_order_without_guard() -> None:
    s = make_scheduler({"p": "paid", "t": "trial"}, max_batch_size=4)
    for _ in range(200):
        s.enqueue(make_request("p", tag="p"), 0.0)
        s.enqueue(make_request("t", tag="t"), 0.0)
    served = [tag for _ in range(50) for tag in tags(s.next_batch(1.0))]
    assert served == ["p"] * 200


def test_tier_guard_gives_the_lower_tier_its_minimum_share() -> None:
    s = make_scheduler(
        {"p": "paid", "t": "trial"}, max_batch_size=4, min_share={"trial": 0.25}, window=100
    )
    for _ in range(400):
        s.enqueue(make_request("p", tag="p"), 0.0)
        s.enqueue(make_request("t", tag="t"), 0.0)
    served = [tag for _ in range(100) for tag in tags(s.next_batch(1.0))]
    recent = served[-200:]
    assert recent.count("t") / len(recent) == pytest.approx(0.25, abs=0.02)
    assert served.count("p") > served.count("t")


def test_tier_guard_reserves_nothing_for_an_idle_tier() -> None:
    s = make_scheduler(
        {"p": "paid", "t": "trial"}, max_batch_size=4, min_share={"trial": 0.5}, window=100
    )
    for _ in range(40):
        s.enqueue(make_request("p", tag="p"), 0.0)
    assert [len(b) for b in drain(s)] == [4] * 10


# ---- deficit round robin ---------------------------------------------------------------------


def test_drr_with_request_cost_saves_for_a_multi_row_request() -> None:
    s = make_scheduler(PAID2, quantum=1.0)
    for i in range(3):
        s.enqueue(make_request("a", tag=f"a{i}"), 0.0)
    s.enqueue(make_request("b", rows=2, tag="b0"), 0.0)
    s.enqueue(make_request("b", tag="b1"), 0.0)
    # a: +1, sends a0. b: +1, cannot pay 2, keeps 1. a: a1. b: 2, sends b0. a: a2. b: b1.
    assert drain(s) == [["a0", "a1", "b0", "a2", "b1"]]


def test_drr_with_token_cost() -> None:
    s = make_scheduler(PAID2, cost=CostUnit.TOKENS, quantum=100.0)
    for i in range(4):
        s.enqueue(make_request("a", tokens=30, tag=f"a{i}"), 0.0)
    for i in range(2):
        s.enqueue(make_request("b", tokens=60, tag=f"b{i}"), 0.0)
    # Round 1, a request a visit: a 100 -> a0 (70), b 100 -> b0 (40), a -> a1 (40); b's
    # b1 does not fit: done; a -> a2 (10), a3 does not fit: done. Round 2 (b, a): b 140 ->
    # b1, a 110 -> a3.
    assert drain(s) == [["a0", "b0", "a1", "a2", "b1", "a3"]]
    assert s.counters == Counters(admitted=6, dispatched=6, expired=0, cancelled=0)


def test_weights_two_to_one_give_two_to_one() -> None:
    s = make_scheduler({"a": TenantSpec("paid", weight=2.0), "b": TenantSpec("paid")})
    for _ in range(300):
        s.enqueue(make_request("a", tag="a"), 0.0)
        s.enqueue(make_request("b", tag="b"), 0.0)
    served = [tag for _ in range(10) for tag in tags(s.next_batch(1.0))]
    assert served[:300] == ["a", "a", "b"] * 100


def test_deficit_resets_when_the_queue_empties() -> None:
    s = make_scheduler(PAID2, cost=CostUnit.TOKENS, quantum=100.0, max_batch_size=1)
    s.enqueue(make_request("a", tokens=30, tag="a0"), 0.0)
    for i in range(1, 5):
        s.enqueue(make_request("b", tokens=60, tag=f"b{i}"), 0.0)
    assert tags(s.next_batch(1.0)) == ["a0"]  # a: 100 - 30 = 70 left, but its queue is empty
    assert s.deficits() == {"b": 0.0}
    s.enqueue(make_request("a", tokens=80, tag="a1"), 2.0)
    s.enqueue(make_request("a", tokens=80, tag="a2"), 2.0)
    assert s.deficits() == {"a": 0.0, "b": 0.0}
    # a rejoined at the back with 0: its first turn pays one 80 only (with the old 70 it
    # would have sent a1 and a2 back to back).
    assert drain(s, 3.0) == [["b1"], ["a1"], ["b2"], ["b3"], ["a2"], ["b4"]]


def test_a_debt_stays_owed_when_the_queue_empties() -> None:
    """A budget is dropped when the queue empties, a debt is not: a's request was charged
    back 150 after it was sent (its output), while a had nothing queued. On its return a
    pays it before it sends again (with the debt forgiven, a1 would go right after b1)."""
    s = make_scheduler(PAID2, cost=CostUnit.TOKENS, quantum=100.0, max_batch_size=1)
    s.enqueue(make_request("a", tokens=30, tag="a0"), 0.0)
    for i in range(1, 5):
        s.enqueue(make_request("b", tokens=60, tag=f"b{i}"), 0.0)
    assert tags(s.next_batch(1.0)) == ["a0"]  # its queue empty, a left with 70: dropped
    s.charge_back("a", 150.0)  # its output, counted after it left: 150 owed
    s.charge_back("a", -20.0)  # a refund pays 20 of it (and would save nothing beyond)
    s.enqueue(make_request("a", tokens=80, tag="a1"), 2.0)
    assert s.deficits() == {"a": -130.0, "b": 0.0}
    # a's turns: -30, 70 (< 80), 170: a1 on its third.
    assert drain(s, 3.0) == [["b1"], ["b2"], ["b3"], ["b4"], ["a1"]]


def test_a_tenant_whose_queue_empties_between_requests_gets_its_share_of_their_cost() -> None:
    """Two tenants of equal weight, their requests' output charged back after dispatch: b
    stays backlogged, a sends one request at a time (its queue empties after each, so
    every charge-back comes while it is out of the round). Each gets half of what was
    served, counted with the charge-backs; a tenant whose debts were forgiven on leaving
    would take 4 times b's share."""
    s = make_scheduler(PAID2, cost=CostUnit.TOKENS, quantum=100.0, max_batch_size=1)
    cost = {"a": 0.0, "b": 0.0}
    for _ in range(400):
        s.enqueue(make_request("b", tokens=50), 0.0)
    s.enqueue(make_request("a", tokens=50), 0.0)
    for step in range(300):
        (req,) = s.next_batch(float(step))
        cost[req.tenant] += 200.0  # 50 charged at enqueue, 150 charged back now
        s.charge_back(req.tenant, 150.0, now=float(step))
        if req.tenant == "a":
            s.enqueue(make_request("a", tokens=50), float(step))
    assert abs(cost["a"] - cost["b"]) <= 100.0 + 200.0  # a quantum and a request's cost


def test_turn_continues_across_a_batch_boundary() -> None:
    # A model that does not batch: one visit a round, the classic turn of a quantum.
    s = make_scheduler(PAID2, quantum=3.0, max_batch_size=0)
    for i in range(1, 6):
        s.enqueue(make_request("a", tag=f"a{i}"), 0.0)
        s.enqueue(make_request("b", tag=f"b{i}"), 0.0)
    assert tags(s.next_batch(1.0)) == ["a1"]
    assert s.deficits() == {"a": 2.0, "b": 0.0}  # mid-turn: no second quantum next batch
    assert drain(s, 1.0) == [["a2"], ["a3"], ["b1"], ["b2"], ["b3"], ["a4"], ["a5"], ["b4"], ["b5"]]


def test_round_continues_across_a_batch_boundary() -> None:
    # Batches of 2 rows: the round's quantum of 3 is taken a slice (one request) a visit.
    s = make_scheduler(PAID2, quantum=3.0, max_batch_size=2)
    for i in range(1, 6):
        s.enqueue(make_request("a", tag=f"a{i}"), 0.0)
        s.enqueue(make_request("b", tag=f"b{i}"), 0.0)
    assert tags(s.next_batch(1.0)) == ["a1", "b1"]
    assert s.deficits() == {"a": 2.0, "b": 2.0}  # mid-round: no second quantum next batch
    assert tags(s.next_batch(1.0)) == ["a2", "b2"]
    assert drain(s, 1.0) == [["a3", "b3"], ["a4", "b4"], ["a5", "b5"]]


def test_a_full_batch_quantum_shares_every_batch_by_weight() -> None:
    # A round's quantum is a full batch, but the tenants take it in turns within the
    # round: while both are backlogged every batch holds each one's share, whatever the
    # phase of rounds against batches (with whole-quantum turns, batches of one tenant).
    tenants = {"a": TenantSpec("paid", weight=2.0), "b": "paid"}
    s = make_scheduler(tenants, cost=CostUnit.TOKENS, quantum=3072.0, max_batch_size=6)
    for i in range(40):
        s.enqueue(make_request("a", tokens=512, tag=f"a{i}"), 0.0)
        s.enqueue(make_request("b", tokens=512, tag=f"b{i}"), 0.0)
    for _ in range(5):
        batch = s.next_batch(1.0)
        assert len(batch) == 6
        assert [r.tenant for r in batch].count("a") == 4, tags(batch)


def test_after_a_join_the_difference_stays_within_theorem_b() -> None:
    """The package docstring's example of theorem B: B holds a fresh grant and its
    leftover when A joins, spends both, then takes 50 a visit against A's 12. The
    difference goes past the classic turn's -(q + C_A + C_B) and stays within the
    restated -(2q + C_A + C_B)."""
    s = make_scheduler(
        PAID2, cost=CostUnit.TOKENS, quantum=100.0, max_batch_size=8, max_batch_tokens=52
    )
    s.enqueue(make_request("b", tokens=51), 0.0)
    for _ in range(60):
        s.enqueue(make_request("b", tokens=50), 0.0)
    assert len(s.next_batch(1.0)) == 1  # b's 51; its next head, peeked, waits granted
    assert s.deficits() == {"b": 149.0}
    for _ in range(2000):
        s.enqueue(make_request("a", tokens=1), 0.0)
    served = {"a": 0.0, "b": 0.0}
    worst = 0.0
    for _ in range(60):
        for r in s.next_batch(1.0):
            served[r.tenant] += r.cost
            worst = min(worst, served["a"] - served["b"])
    assert -(2 * 100 + 1 + 51) < worst < -(100 + 1 + 51)
    assert worst == -188.0


def test_a_request_larger_than_many_quanta_is_served_in_one_jump() -> None:
    s = make_scheduler({"a": "paid"}, cost=CostUnit.TOKENS, quantum=1.0)
    s.enqueue(make_request("a", tokens=1_000_000, tag="huge"), 0.0)
    assert tags(s.next_batch(1.0)) == ["huge"]


def test_round_jump_matches_walking_the_empty_rounds() -> None:
    s = make_scheduler(
        {"a": "paid", "b": TenantSpec("paid", weight=2.0)},
        cost=CostUnit.TOKENS,
        quantum=1.0,
        max_batch_size=1,
    )
    s.enqueue(make_request("a", tokens=7, tag="a0"), 0.0)
    s.enqueue(make_request("a", tokens=1, tag="a1"), 0.0)
    s.enqueue(make_request("b", tokens=10, tag="b0"), 0.0)
    s.enqueue(make_request("b", tokens=1, tag="b1"), 0.0)
    # Rounds: a gets 1 per round, b 2. a reaches 7 in round 7; b reaches 10 in round 5.
    assert tags(s.next_batch(1.0)) == ["b0"]
    assert s.deficits() == {"a": 5.0, "b": 0.0}
    # Round 6: a 6 (saving), b 2 -> b1 (b empties). Round 7: a 7 -> a0, then a1 is 1 > 0.
    assert drain(s, 1.0) == [["b1"], ["a0"], ["a1"]]


# ---- batches -------------------------------------------------------------------------------


def test_max_batch_size_counts_rows() -> None:
    s = make_scheduler({"a": "paid"}, max_batch_size=4)
    for i, rows in enumerate([2, 1, 2, 1]):
        s.enqueue(make_request("a", rows=rows, tag=i), 0.0)
    assert drain(s) == [[0, 1], [2, 3]]


def test_max_batch_tokens() -> None:
    s = make_scheduler({"a": "paid"}, max_batch_tokens=100)
    for i in range(5):
        s.enqueue(make_request("a", tokens=40, tag=i), 0.0)
    assert drain(s) == [[0, 1], [2, 3], [4]]


def test_an_oversize_request_goes_alone() -> None:
    s = make_scheduler({"a": "paid"}, max_batch_size=4, max_batch_tokens=100)
    s.enqueue(make_request("a", tag="small"), 0.0)
    s.enqueue(make_request("a", rows=6, tag="wide"), 0.0)
    s.enqueue(make_request("a", tokens=500, tag="long"), 0.0)
    s.enqueue(make_request("a", tag="last"), 0.0)
    assert drain(s) == [["small"], ["wide"], ["long"], ["last"]]


def test_shape_key_ends_the_batch_and_the_tenant_keeps_its_turn() -> None:
    s = make_scheduler(PAID2, quantum=2.0, max_batch_size=8)
    for i, shape in enumerate([0, 1, 1]):
        s.enqueue(make_request("a", shape=shape, tag=f"a{i}"), 0.0)
    for i in range(2):
        s.enqueue(make_request("b", shape=0, tag=f"b{i}"), 0.0)
    assert tags(s.next_batch(1.0)) == ["a0", "b0"]
    assert s.deficits() == {"a": 1.0, "b": 1.0}  # a1 waits first in line, a's visit goes on
    assert drain(s, 1.0) == [["a1"], ["b1"], ["a2"]]


def test_max_batch_size_zero_sends_one_request_per_batch() -> None:
    s = make_scheduler({"a": "paid"}, max_batch_size=0)
    for i in range(3):
        s.enqueue(make_request("a", tag=i), 0.0)
    assert drain(s) == [[0], [1], [2]]


def test_next_batch_is_empty_only_when_nothing_is_queued() -> None:
    s = make_scheduler({"a": "paid"})
    assert s.next_batch(0.0) == []
    s.enqueue(make_request("a"), 0.0)
    assert len(s.next_batch(0.0)) == 1
    assert s.next_batch(0.0) == []


# ---- fifo mode -------------------------------------------------------------------------------


def test_fifo_is_arrival_order_regardless_of_tier_weight_and_priority() -> None:
    s = make_scheduler(
        {"p": TenantSpec("paid", weight=5.0), "t": "trial"}, mode="fifo", max_batch_size=3
    )
    plan = [("t", 3), ("t", 1), ("p", 1), ("t", 2), ("p", 1)]
    for i, (tenant, priority) in enumerate(plan):
        s.enqueue(make_request(tenant, priority=priority, tag=i), float(i))
    assert drain(s, 9.0) == [[0, 1, 2], [3, 4]]
    assert s.deficits() == {}


def test_fifo_keeps_caps_deadlines_and_cancellation() -> None:
    s = make_scheduler({"a": TenantSpec("paid", max_queued=3)}, mode="fifo")
    r0 = make_request("a", deadline=5.0, tag=0)
    r1 = make_request("a", tag=1)
    r2 = make_request("a", tag=2)
    for r in (r0, r1, r2):
        s.enqueue(r, 0.0)
    with pytest.raises(QueueFull):
        s.enqueue(make_request("a"), 0.0)
    assert s.cancel(r1, 1.0)
    assert s.expire(5.0) == [r0]
    assert tags(s.next_batch(6.0)) == [2]
    assert s.counters == Counters(admitted=3, dispatched=1, expired=1, cancelled=1)


# ---- deadlines -------------------------------------------------------------------------------


def test_expiry_happens_exactly_at_the_deadline() -> None:
    s = make_scheduler({"a": "paid"})
    r = make_request("a", deadline=10.0)
    s.enqueue(r, 0.0)
    assert s.expire(math.nextafter(10.0, 0.0)) == []
    assert r.state is QueueState.QUEUED
    assert s.expire(10.0) == [r]
    assert r.state is QueueState.EXPIRED and r.left_at == 10.0
    assert s.expire(11.0) == []
    assert s.next_batch(11.0) == []
    assert s.counters == Counters(admitted=1, dispatched=0, expired=1, cancelled=0)


def test_next_batch_never_dispatches_a_request_past_its_deadline() -> None:
    s = make_scheduler({"a": "paid"})
    late = make_request("a", deadline=5.0, tag="late")
    s.enqueue(late, 0.0)
    s.enqueue(make_request("a", deadline=50.0, tag="ok"), 0.0)
    assert tags(s.next_batch(5.0)) == ["ok"]
    assert late.state is QueueState.EXPIRED
    assert s.queued_requests == 0
    assert s.next_deadline() == 5.0  # in the past: the shell calls expire() at once
    assert s.expire(6.0) == [late]
    assert s.next_deadline() is None


def test_next_deadline_is_the_earliest_queued_deadline() -> None:
    s = make_scheduler({"a": "paid"}, max_batch_size=1)
    assert s.next_deadline() is None
    r5 = make_request("a", deadline=5.0, tag="d5")
    r3 = make_request("a", priority=2, deadline=3.0, tag="d3")
    s.enqueue(r5, 0.0)
    s.enqueue(make_request("a", tag="none"), 0.0)
    s.enqueue(r3, 0.0)
    assert s.next_deadline() == 3.0
    assert s.cancel(r3, 1.0)
    assert s.next_deadline() == 5.0
    assert tags(s.next_batch(1.0)) == ["d5"]
    assert s.next_deadline() is None


# ---- cancellation ----------------------------------------------------------------------------


def test_a_cancelled_request_is_never_dispatched_and_counts_stay_exact() -> None:
    s = make_scheduler(PAID2)
    reqs = [
        make_request(t, rows=2, tokens=5, nbytes=7, tag=f"{t}{i}") for i in range(3) for t in "ab"
    ]
    for r in reqs:
        s.enqueue(r, 0.0)
    victim = reqs[2]  # a1
    assert s.cancel(victim, 1.0)
    assert victim.state is QueueState.CANCELLED and victim.left_at == 1.0
    assert (s.queued_requests, s.queued_rows, s.queued_tokens, s.queued_bytes) == (5, 10, 25, 35)
    assert s.depths() == {"a": 2, "b": 3}
    assert not s.cancel(victim, 1.0)
    assert drain(s, 2.0) == [["a0", "b0", "a2", "b1", "b2"]]
    assert s.counters == Counters(admitted=6, dispatched=5, expired=0, cancelled=1)
    assert not s.cancel(reqs[0], 3.0)  # already dispatched


def test_cancelling_a_tenants_last_request_takes_it_out_of_the_round() -> None:
    s = make_scheduler(PAID2)
    r = make_request("a", tag="a0")
    s.enqueue(r, 0.0)
    s.enqueue(make_request("b", tag="b0"), 0.0)
    assert s.cancel(r, 0.0)
    assert s.deficits() == {"b": 0.0}
    assert s.depth("a") == 0
    s.enqueue(make_request("a", tag="a1"), 1.0)  # rejoins behind b
    assert drain(s, 1.0) == [["b0", "a1"]]


def test_cancel_refuses_requests_of_another_scheduler_and_new_ones() -> None:
    s1 = make_scheduler({"a": "paid"})
    s2 = make_scheduler({"a": "paid"})
    r = make_request("a")
    assert not s1.cancel(r, 0.0)
    s2.enqueue(r, 0.0)
    assert not s1.cancel(r, 0.0)
    assert s2.cancel(r, 0.0)


def test_cancel_then_expiry_does_not_count_twice() -> None:
    s = make_scheduler({"a": "paid"})
    r = make_request("a", deadline=2.0)
    s.enqueue(r, 0.0)
    assert s.cancel(r, 1.0)
    assert s.expire(3.0) == []
    assert s.counters == Counters(admitted=1, dispatched=0, expired=0, cancelled=1)


# ---- caps ----------------------------------------------------------------------------------


def test_tenant_max_queued_is_named_in_the_error() -> None:
    s = make_scheduler({"acme": TenantSpec("paid", max_queued=2)})
    s.enqueue(make_request("acme"), 0.0)
    s.enqueue(make_request("acme"), 0.0)
    refused = make_request("acme")
    with pytest.raises(QueueFull) as err:
        s.enqueue(refused, 0.0)
    assert err.value.cap == "tenant 'acme' max_queued=2"
    assert str(err.value) == f"{MSG_QUEUE_FULL}: tenant 'acme' max_queued=2"
    assert refused.state is QueueState.NEW
    assert s.counters.admitted == 2
    s.next_batch(1.0)
    s.enqueue(refused, 1.0)  # room again once the queue drained


def test_tenant_max_queued_bytes() -> None:
    s = make_scheduler({"acme": TenantSpec("paid", max_queued_bytes=100)})
    s.enqueue(make_request("acme", nbytes=60), 0.0)
    with pytest.raises(QueueFull, match="tenant 'acme' max_queued_bytes=100"):
        s.enqueue(make_request("acme", nbytes=41), 0.0)
    s.enqueue(make_request("acme", nbytes=40), 0.0)


def test_global_caps_are_shared_by_every_endpoint() -> None:
    # One tenant may fill the whole byte cap here (its default share is all of it).
    caps = GlobalCaps(max_queued=3, max_queued_bytes=1000, tenant_bytes_share=1.0)
    s1 = make_scheduler({"a": "paid"}, caps=caps)
    s2 = make_scheduler({"a": "paid"}, caps=caps)
    s1.enqueue(make_request("a", nbytes=100), 0.0)
    s1.enqueue(make_request("a", nbytes=100), 0.0)
    s2.enqueue(make_request("a", nbytes=100), 0.0)
    with pytest.raises(QueueFull, match="global max_queued=3"):
        s2.enqueue(make_request("a"), 0.0)
    assert (caps.queued, caps.queued_bytes) == (3, 300)
    assert len(s1.next_batch(1.0)) == 2
    assert (caps.queued, caps.queued_bytes) == (1, 100)
    with pytest.raises(QueueFull, match="global max_queued_bytes=1000"):
        s2.enqueue(make_request("a", nbytes=901), 1.0)
    s2.enqueue(make_request("a", nbytes=900), 1.0)


def test_global_cap_message_names_the_byte_cap_from_config() -> None:
    # Its own byte cap above the global one: the global cap is the one it meets.
    acme = {"tier": "paid", "max_queued_bytes": 1 << 31}
    cfg = parse_config({"tiers": ["paid"], "tenants": {"acme": acme}})
    caps = global_caps(cfg.queues)
    policy = plan(cfg, "m", batching_model(8)).policy
    s = Scheduler(policy, cfg.tenants, caps)
    with pytest.raises(QueueFull) as err:
        s.enqueue(make_request("acme", nbytes=(1 << 30) + 1), 0.0)
    assert err.value.cap == "global max_queued_bytes=1073741824"


def test_a_tenant_without_its_own_byte_cap_holds_at_most_its_share_of_the_global_one() -> None:
    """Issue 17: one tenant filled the global byte cap and every other tenant got 503.
    Its default share counts its bytes on every endpoint together; another tenant, and
    one with its own cap, still queue; what leaves frees the share again."""
    caps = GlobalCaps(max_queued=100, max_queued_bytes=1000, tenant_bytes_share=0.25)
    tenants = {"hog": "paid", "b": "paid"}
    s1, s2 = make_scheduler(tenants, caps=caps), make_scheduler(tenants, caps=caps)
    s1.enqueue(make_request("hog", nbytes=100), 0.0)
    s2.enqueue(make_request("hog", nbytes=150), 0.0)  # 250: all of its share, over both
    expected = (
        "tenant 'hog' max_queued_bytes=250 (its default: tenant_bytes_share 0.25 of the "
        "global max_queued_bytes=1000)"
    )
    with pytest.raises(QueueFull) as err:
        s1.enqueue(make_request("hog", nbytes=1), 0.0)
    assert err.value.cap == expected
    assert s1.full("hog", 1) == expected and s2.full("hog", 1) == expected
    assert s1.full("hog") is None  # the count caps alone: room
    s1.enqueue(make_request("hog", nbytes=0), 0.0)  # no bytes: no byte cap to meet
    s1.enqueue(make_request("b", nbytes=250), 0.0)  # another tenant: its own share
    assert caps.tenant_bytes == {"hog": 250, "b": 250}
    assert [r.tenant for r in s2.next_batch(1.0)] == ["hog"]
    s1.enqueue(make_request("hog", nbytes=150), 1.0)  # what left freed its share
    with pytest.raises(QueueFull, match="tenant 'hog' max_queued_bytes=250"):
        s2.enqueue(make_request("hog", nbytes=1), 1.0)
    # Its own max_queued_bytes replaces the default (per endpoint, as ever).
    own = make_scheduler({"hog": TenantSpec("paid", max_queued_bytes=400)}, caps=caps)
    own.enqueue(make_request("hog", nbytes=400), 1.0)
    with pytest.raises(QueueFull) as err:
        own.enqueue(make_request("hog", nbytes=1), 1.0)
    assert err.value.cap == "tenant 'hog' max_queued_bytes=400"


def test_an_engine_endpoint_queues_a_few_turnovers_of_its_slots_per_tenant() -> None:
    """Issue 17: a tenant could queue 10,000 generations on an engine of 64 slots. On an
    engine endpoint (``slots``) a tenant without its own max_queued gets
    ``engine_queue_slots`` x slots; a batching endpoint keeps 10,000; its own wins."""
    caps = GlobalCaps(engine_queue_slots=2.5)
    engine = EndpointPolicy(CostUnit.TOKENS, 0, None, None, ("paid",), slots=8)
    s = Scheduler(engine, {"a": TenantSpec("paid"), "b": TenantSpec("paid")}, caps)
    for _ in range(20):
        s.enqueue(make_request("a"), 0.0)
    with pytest.raises(QueueFull) as err:
        s.enqueue(make_request("a"), 0.0)
    assert err.value.cap == "tenant 'a' max_queued=20"
    assert s.full("a") == "tenant 'a' max_queued=20"
    s.enqueue(make_request("b"), 0.0)  # another tenant: a queue of its own
    own = Scheduler(engine, {"a": TenantSpec("paid", max_queued=30)}, GlobalCaps())
    for _ in range(30):
        own.enqueue(make_request("a"), 0.0)
    batching = make_scheduler({"a": "paid"})
    for _ in range(DEFAULT_TENANT_MAX_QUEUED):
        batching.enqueue(make_request("a"), 0.0)
    with pytest.raises(QueueFull, match=f"max_queued={DEFAULT_TENANT_MAX_QUEUED}"):
        batching.enqueue(make_request("a"), 0.0)


# ---- errors ------------------------------------------------------------------------------


def test_unknown_tenant_is_an_error() -> None:
    s = make_scheduler({"a": "paid"})
    with pytest.raises(Internal, match="unknown tenant 'mallory'"):
        s.enqueue(make_request("mallory"), 0.0)
    with pytest.raises(Internal):
        s.backlog_ahead("mallory", 1, 1, 1)


def test_a_request_is_enqueued_once_and_must_be_well_formed() -> None:
    s = make_scheduler({"a": "paid"})
    r = make_request("a")
    s.enqueue(r, 0.0)
    with pytest.raises(ValueError, match="enqueue it once"):
        s.enqueue(r, 0.0)
    for bad in (make_request("a", rows=0), make_request("a", priority=0)):
        with pytest.raises(ValueError, match="bad request"):
            s.enqueue(bad, 0.0)
    assert s.counters.admitted == 1


def test_tenant_terms_change_only_when_its_queue_is_empty() -> None:
    directory = {"a": TenantSpec("paid"), "p": TenantSpec("paid"), "t": TenantSpec("trial")}
    s = Scheduler(
        EndpointPolicy(CostUnit.REQUESTS, 32, None, 1.0, ("paid", "trial")),
        directory,
        GlobalCaps(),
    )
    s.enqueue(make_request("t", tag="t0"), 0.0)
    s.enqueue(make_request("a", tag="a0"), 0.0)
    directory["a"] = TenantSpec("trial")  # a config reload moves a down
    s.enqueue(make_request("a", tag="a1"), 1.0)  # still paid: a has queued work
    assert drain(s, 2.0) == [["a0", "a1", "t0"]]
    s.enqueue(make_request("a", tag="a2"), 3.0)
    s.enqueue(make_request("p", tag="p0"), 3.0)
    assert drain(s, 4.0) == [["p0", "a2"]]


def test_a_new_cap_applies_once_the_tenants_queue_drains() -> None:
    directory = {"a": TenantSpec("paid", max_queued=3)}
    s = Scheduler(
        EndpointPolicy(CostUnit.REQUESTS, 32, None, 1.0, ("paid",)), directory, GlobalCaps()
    )
    s.enqueue(make_request("a"), 0.0)
    directory["a"] = TenantSpec("paid", max_queued=1)
    s.enqueue(make_request("a"), 0.0)  # the old cap of 3 holds while a has queued work
    drain(s)
    s.enqueue(make_request("a"), 1.0)
    with pytest.raises(QueueFull, match="tenant 'a' max_queued=1"):
        s.enqueue(make_request("a"), 1.0)


# ---- views ---------------------------------------------------------------------------------


def test_backlog_ahead_counts_higher_tiers_own_work_and_a_weighted_share() -> None:
    s = make_scheduler(
        {
            "a": "paid",
            "b": TenantSpec("paid", weight=2.0),
            "c": "paid",
            "t": "trial",
        }
    )
    for _ in range(3):
        s.enqueue(make_request("a", tokens=10, priority=1), 0.0)
    for _ in range(2):
        s.enqueue(make_request("a", tokens=10, priority=3), 0.0)
    for _ in range(10):
        s.enqueue(make_request("b", tokens=10), 0.0)
    for _ in range(5):
        s.enqueue(make_request("t", tokens=10), 0.0)
    # a at level 2: its 3 requests at level 1, plus itself: cost 4; b (weight 2 of 3)
    # gets 4 * 2 / 1 = 8 meanwhile, plus half its grant (quantum 1 * 2 / 2 = 1): 9.
    assert s.backlog_ahead("a", 2, 1, 10) == Backlog(rows=3 + 9 + 1, tokens=130)
    # At level 3 a's 5 queued requests count: 6 * 2 + 1 = 13, more than b has queued
    # now: b is backlogged, and its later arrivals take that share too.
    assert s.backlog_ahead("a", 3, 1, 10) == Backlog(rows=5 + 13 + 1, tokens=190)
    # c is idle: active weight becomes 4; 1 * 3 / 1 + 3 / 2 = 4.5 of the others' cost.
    assert s.backlog_ahead("c", 1, 1, 10) == Backlog(rows=5 + 1, tokens=55)
    # trial waits for all of paid, its own queue, and itself.
    assert s.backlog_ahead("t", 1, 2, 7) == Backlog(rows=15 + 5 + 2, tokens=150 + 50 + 7)


def test_backlog_ahead_in_fifo_mode_is_everything_queued() -> None:
    s = make_scheduler({"a": "paid", "t": "trial"}, mode="fifo")
    s.enqueue(make_request("t", rows=2, tokens=3), 0.0)
    s.enqueue(make_request("a", rows=1, tokens=4), 0.0)
    assert s.backlog_ahead("a", 1, 1, 1) == Backlog(rows=4, tokens=8)


def test_oldest_arrival_follows_what_is_still_queued() -> None:
    s = make_scheduler({"p": "paid", "t": "trial"}, max_batch_size=1)
    assert s.oldest_arrival() is None
    s.enqueue(make_request("t"), 1.0)
    s.enqueue(make_request("p"), 2.0)
    s.next_batch(3.0)  # dispatches p
    assert s.oldest_arrival() == 1.0
    s.next_batch(3.0)
    assert s.oldest_arrival() is None


def test_tier_depths_and_tenant_depths() -> None:
    s = make_scheduler({"a": "paid", "b": "paid", "t": "trial"})
    for tenant in "aabt":
        s.enqueue(make_request(tenant), 0.0)
    assert s.depths() == {"a": 2, "b": 1, "t": 1}
    assert s.depth("a") == 2 and s.depth("nobody") == 0
    assert s.tier_depths() == {"paid": 3, "trial": 1}


# ---- cost models and policy ------------------------------------------------------------------


class Scaled:
    """A cost model whose factor the test changes (as the feedback loop's estimate does)."""

    def __init__(self, factor: list[float]) -> None:
        self.factor = factor

    def cost(self, rows: int, tokens: int) -> float:
        return TokenCost().cost(rows, tokens) * self.factor[0]


def test_cost_is_fixed_at_enqueue() -> None:
    factor = [2.0]
    assert TokenCost().cost(3, 0) == 1.0
    assert RequestCost().cost(3, 999) == 3.0
    s = Scheduler(
        EndpointPolicy(CostUnit.TOKENS, 8, None, 100.0, ("paid",)),
        {"a": TenantSpec("paid")},
        GlobalCaps(),
        cost_model=Scaled(factor),
    )
    factor[0] = 3.0
    r = make_request("a", tokens=5)
    s.enqueue(r, 0.0)
    factor[0] = 7.0
    assert r.cost == 15.0


def test_policy_from_config() -> None:
    guarded = parse_config(
        {
            "tiers": ["paid", "trial"],
            "tier_guard": {"min_share": {"trial": 0.1}},
            "endpoints": {"m": {"cost": "tokens", "max_batch_tokens": 512}},
        }
    )
    tokens = plan(guarded, "m", batching_model(16)).policy
    assert (tokens.max_batch_size, tokens.max_batch_tokens, tokens.quantum) == (16, 512, 512.0)
    assert tokens.tier_min_share == {"trial": 0.1}
    unbatched = plan(
        parse_config({"tiers": ["paid"], "endpoints": {"m": {"max_batch_size": 0}}}),
        "m",
        batching_model(16),
    ).policy
    assert (unbatched.max_batch_size, unbatched.quantum) == (0, 1.0)
    with pytest.raises(ValueError, match="unknown tier"):
        EndpointPolicy(CostUnit.REQUESTS, 8, None, 1.0, ("paid",), {"gold": 0.1})


def test_token_cost_without_a_token_cap_grants_a_full_batch_of_tokens_per_turn() -> None:
    """The quantum is max_batch_size rows of the mean tokens per row (learned), not
    max_batch_size read as tokens: a round grants each tenant a full batch of its rows,
    which the tenants take a row at a time."""
    s = make_scheduler(
        {"a": "paid", "b": "paid"}, cost=CostUnit.TOKENS, max_batch_size=4, quantum=None
    )
    for tenant in ("a", "b"):
        for i in range(8):
            s.enqueue(make_request(tenant, tokens=100, tag=f"{tenant}{i}"), 0.0)
    assert s.quantum == 400
    batches = drain(s)
    assert batches[0] == ["a0", "b0", "a1", "b1"]
    assert batches[1] == ["a2", "b2", "a3", "b3"]
