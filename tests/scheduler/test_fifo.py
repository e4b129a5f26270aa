"""The ``fifo`` fairness policy (``scheduler.fifo``): first come, first served across the
tenants of one tier, by the name an endpoint's policy gives (``FAIRNESS_POLICIES``).

Its point is to be the baseline the fair policies are compared against, so each test
sets it beside ``drr`` on the same arrivals: fifo follows the arrivals, whoever sent
them and whatever their weights, where drr shares by weight.
"""

from __future__ import annotations

from sched_support import drain, make_request, make_scheduler

from fair_frontend.scheduler import FirstComeFirstServed, Scheduler, TenantSpec

# Tenant a sends in bursts, b in between: arrival order differs from both "a then b"
# (by tenant) and "a, b, a, b" (round robin).
ARRIVALS = ["a1", "a2", "b1", "a3", "b2", "b3", "a4"]


def served(s: Scheduler, arrivals: list[str] = ARRIVALS) -> list[str]:
    """The order ``s`` sends ``arrivals`` in, one request per batch, all queued first."""
    for i, tag in enumerate(arrivals):
        s.enqueue(make_request(tag[0], tag=tag), now=float(i))
    return [tag for batch in drain(s, now=10.0) for tag in batch]


def test_fifo_serves_the_tier_in_arrival_order_where_drr_alternates() -> None:
    tenants = {"a": "paid", "b": "paid"}
    fifo = make_scheduler(tenants, fairness="fifo", max_batch_size=0)
    drr = make_scheduler(tenants, fairness="drr", max_batch_size=0)
    assert isinstance(fifo.fairness, FirstComeFirstServed)  # by the policy's name
    assert served(fifo) == ARRIVALS
    assert served(drr) == ["a1", "b1", "a2", "b2", "a3", "b3", "a4"]


def test_fifo_ignores_weights() -> None:
    # b weighs 3: drr sends three of b's per turn of a's; fifo, the arrivals still.
    tenants = {"a": TenantSpec("paid"), "b": TenantSpec("paid", weight=3.0)}
    fifo = make_scheduler(tenants, fairness="fifo", max_batch_size=0)
    drr = make_scheduler(tenants, fairness="drr", max_batch_size=0)
    assert served(fifo) == ARRIVALS
    assert served(drr) == ["a1", "b1", "b2", "b3", "a2", "a3", "a4"]


def test_fifo_keeps_the_tiers_and_each_tenants_own_order() -> None:
    # A paid tenant's later request goes before every trial one (tiers are the tier
    # selector's, not the policy's); within a tenant, its own order (priority first).
    s = make_scheduler({"a": "trial", "b": "trial", "p": "paid"}, fairness="fifo", max_batch_size=0)
    s.enqueue(make_request("a", tag="a1", priority=2), now=0.0)
    s.enqueue(make_request("b", tag="b1"), now=1.0)
    s.enqueue(make_request("a", tag="a2", priority=1), now=2.0)
    s.enqueue(make_request("p", tag="p1"), now=3.0)
    # a's head is a2 (priority 1), which came after b1: b1 goes first, then a's two.
    assert [t for batch in drain(s, now=10.0) for t in batch] == ["p1", "b1", "a2", "a1"]


def test_fifo_batches_follow_arrivals_and_owe_nothing() -> None:
    tenants = {"a": "paid", "b": "paid"}
    s = make_scheduler(tenants, fairness="fifo", max_batch_size=3)
    for i, tag in enumerate(ARRIVALS):
        s.enqueue(make_request(tag[0], tag=tag), now=float(i))
    assert s.deficits() == {}
    assert drain(s, now=10.0) == [["a1", "a2", "b1"], ["a3", "b2", "b3"], ["a4"]]
    s.charge_back("a", 100.0)  # nothing is owed: a charge-back moves no one
    exported = s.export_fairness()
    assert all(not tier.counters for tier in exported.tiers.values())
