"""The fairness window (``Scheduler.window``, the gauges' figures) against logs computed
by hand: which tenant was served what, when, and who had queued work throughout."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sched_support import make_request, make_scheduler

from fair_frontend.core.metrics import window_samples
from fair_frontend.scheduler import QueuedRequest, Scheduler, TenantSpec
from fair_frontend.scheduler.window import jain_index, service_gap


def _dispatch_every_half_second(
    s: Scheduler, until: float, start: float = 0.5
) -> list[tuple[float, str]]:
    """One request (``max_batch_size=1``) at ``start``, 0.5 s later, ... up to ``until``:
    the log, (time, tenant)."""
    log = []
    t = start
    while t <= until:
        (req,) = s.next_batch(t)
        log.append((t, req.tenant))
        t += 0.5
    return log


def test_window_of_a_fifo_log_by_hand() -> None:
    """FIFO serves in the order queued: a, a, b repeated (a: weight 2, b: 1), one request
    of cost 1 every 0.5 s from 0.5 s. At 12.7 s the window is [2 s, 12 s): the
    dispatches at 2.0 .. 11.5 s, the 4th to the 23rd (k = 3..22): b at k = 5, 8, 11, 14,
    17, 20 (6), a at the other 14. Normalised: a 14 / 2 = 7, b 6 / 1 = 6: gap 1, Jain
    13^2 / (2 (7^2 + 6^2)) = 169/170; goodput a 1.4, b 0.6 per second. The dispatch at
    1.5 s (b) is before the window, those at 12.0 and 12.5 s (a, b) after it: a window
    shifted by a second either way, or one that counts the partial second, differs."""
    s = make_scheduler(
        {"a": TenantSpec("paid", 2.0), "b": TenantSpec("paid", 1.0)},
        mode="fifo",
        max_batch_size=1,
    )
    for _ in range(20):
        for tenant in ("a", "a", "b"):
            s.enqueue(make_request(tenant), 0.0)
    log = _dispatch_every_half_second(s, 12.5)
    assert [tenant for _, tenant in log[3:23]].count("b") == 6  # the hand count above

    window = s.window(12.7)
    assert (window.start, window.end) == (2.0, 12.0)
    assert window.served == {"a": 14.0, "b": 6.0}
    assert window.backlogged == {"paid": {"a": 7.0, "b": 6.0}}
    assert window.goodput() == {"a": pytest.approx(1.4), "b": pytest.approx(0.6)}
    samples = {
        (name, tuple(sorted(labels.items()))): value
        for name, labels, value in window_samples("embed", window, lambda t: t)
    }
    tier = (("endpoint", "embed"), ("tier", "paid"))
    assert samples[("fair_service_gap", tier)] == 1.0
    assert samples[("fair_jain_index", tier)] == pytest.approx(float(Fraction(169, 170)), 1e-15)
    assert samples[("fair_goodput", (("endpoint", "embed"), ("tenant", "a")))] == pytest.approx(1.4)
    assert len(samples) == 4


def test_tenants_not_backlogged_through_the_window_are_left_out() -> None:
    """FIFO, queued at 0 s: a, b, a, b, a, c, then (a, b) x 30; d queues one request at
    4 s (behind all of them). One request every 0.5 s from 0.5 s; at 12.7 s the window
    [2 s, 12 s) holds k = 3..22: b@2.0, a@2.5, c@3.0, then a at even k 6..22 (9) and b
    at odd k 7..21 (8): a 10, b 9, c 1, d 0. c emptied at 3.0 s, inside the window; d
    had nothing queued at its start: both are left out of the gap and Jain. With a
    (10 / 2 = 5) and b (9 / 1 = 9) alone: gap 4, Jain 14^2 / (2 (25 + 81)) = 49/53.
    Counting c would make the gap 8 (9 - 1), d 9 (9 - 0). c's goodput is still there."""
    s = make_scheduler(
        {
            "a": TenantSpec("paid", 2.0),
            "b": TenantSpec("paid", 1.0),
            "c": TenantSpec("paid", 1.0),
            "d": TenantSpec("paid", 1.0),
        },
        mode="fifo",
        max_batch_size=1,
    )
    for tenant in ("a", "b", "a", "b", "a", "c", *("a", "b") * 30):
        s.enqueue(make_request(tenant), 0.0)
    log = _dispatch_every_half_second(s, 3.5)
    s.enqueue(make_request("d"), 4.0)
    log += [(t, s.next_batch(t)[0].tenant) for t in (4.0, 4.5)]
    log += _dispatch_every_half_second(s, 12.5, start=5.0)
    assert [tenant for t, tenant in log if 2.0 <= t < 12.0].count("a") == 10

    window = s.window(12.7)
    assert window.served == {"a": 10.0, "b": 9.0, "c": 1.0}
    assert window.backlogged == {"paid": {"a": 5.0, "b": 9.0}}
    assert service_gap(window.backlogged["paid"].values()) == 4.0
    assert jain_index(window.backlogged["paid"].values()) == pytest.approx(49 / 53, 1e-15)
    assert window.goodput()["c"] == pytest.approx(0.1)


def test_a_tenant_that_emptied_after_the_window_ended_was_backlogged_through_it() -> None:
    """FIFO, queued at 0 s: (a, b) x 12, b, a; one request every 0.5 s from 0.5 s. b's
    last goes at 12.5 s, after the window's end (12 s) and before the scrape (12.7 s):
    b had queued work throughout [2 s, 12 s] and counts. a at even k = 4..22, b at odd
    k = 3..21: 10 each, weights 1: gap 0, Jain 1. Leaving out a tenant empty at the
    scrape (its emptying time not kept) would leave a alone."""
    s = make_scheduler({"a": "paid", "b": "paid"}, mode="fifo", max_batch_size=1)
    for tenant in (*("a", "b") * 12, "b", "a"):
        s.enqueue(make_request(tenant), 0.0)
    log = _dispatch_every_half_second(s, 12.5)
    assert log[-1] == (12.5, "b") and s.depth("b") == 0
    window = s.window(12.7)
    assert window.backlogged == {"paid": {"a": 10.0, "b": 10.0}}


def test_window_of_a_drr_log_with_charge_backs_matches_the_log() -> None:
    """Fair mode (DRR, weights 2:1:3), batches of up to 4 rows, requests of 1-3 rows
    (cost: rows), each tenant kept at 6 queued requests, a batch every 0.3 s; after each
    batch tenant a is charged back 0.5 per request (output as it streams). The window at
    20.9 s, [10 s, 20 s), against the sums of the log's entries in it (dispatches and
    charge-backs alike, at the batch's time): every tenant was backlogged throughout."""
    weights = {"a": 2.0, "b": 1.0, "c": 3.0}
    s = make_scheduler(
        {name: TenantSpec("paid", w) for name, w in weights.items()},
        max_batch_size=4,
        quantum=2.0,
    )
    log: list[tuple[float, str, float]] = []
    size = 0
    for step in range(70):
        t = round(step * 0.3, 1)
        for tenant in weights:
            while s.depth(tenant) < 6:
                size = size % 3 + 1
                s.enqueue(make_request(tenant, rows=size), t)
        for req in s.next_batch(t):
            log.append((t, req.tenant, req.cost))
            if req.tenant == "a":
                s.charge_back("a", 0.5)
                log.append((t, "a", 0.5))
    by_hand = {tenant: 0.0 for tenant in weights}
    for t, tenant, cost in log:
        if 10.0 <= t < 20.0:
            by_hand[tenant] += cost
    assert all(by_hand.values())

    window = s.window(20.9)
    assert window.served == by_hand
    normalised = {tenant: by_hand[tenant] / w for tenant, w in weights.items()}
    assert window.backlogged == {"paid": normalised}
    values = list(normalised.values())
    total, squares = sum(values), sum(x * x for x in values)
    assert service_gap(values) == max(values) - min(values)
    assert jain_index(values) == pytest.approx(total * total / (3 * squares), 1e-15)


def test_window_samples_need_two_backlogged_tenants_and_fold_goodput_labels() -> None:
    """One backlogged tenant: no gap or Jain sample (nothing to compare), its goodput
    alone; goodput of tenants folded into one label is summed by the collector, so each
    is given under its label."""
    s = make_scheduler({"a": "paid", "b": "paid"}, mode="fifo", max_batch_size=1)
    for _ in range(30):
        s.enqueue(make_request("a"), 0.0)
    _dispatch_every_half_second(s, 12.5)
    window = s.window(12.7)
    assert window.backlogged == {"paid": {"a": 20.0}}
    samples = window_samples("embed", window, lambda t: "other")
    assert samples == [("fair_goodput", {"endpoint": "embed", "tenant": "other"}, 2.0)]


def test_jain_index_and_gap_of_simple_shares() -> None:
    assert jain_index([1.0, 1.0, 1.0]) == 1.0
    assert jain_index([4.0, 0.0, 0.0, 0.0]) == 0.25  # one got all: 1/n
    assert jain_index([0.0, 0.0]) == 1.0  # nobody served: equal
    assert service_gap([3.0, 7.5, 5.0]) == 4.5


# ---- against a log kept by the test, on random runs ----------------------------------------

_TENANTS = {"a": ("paid", 2.0), "b": ("paid", 1.0), "c": ("trial", 1.0), "d": ("paid", 0.5)}
_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["enqueue", "enqueue", "dispatch", "dispatch", "cancel", "charge", "scrape"]
        ),
        st.sampled_from(sorted(_TENANTS)),
        st.integers(1, 3),  # rows; a charge-back of half as many cost units
        st.sampled_from([0, 1, 3, 8, 24]),  # sixteenths of a second before the op
    ),
    min_size=40,
    max_size=200,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS, fifo=st.booleans())
def test_window_matches_a_log_of_random_runs(
    ops: list[tuple[str, str, int, int]], fifo: bool
) -> None:
    """Random enqueues, batches (of up to 2 rows), cancellations and charge-backs, with
    scrapes in between, against the test's own log: the service each tenant got from a
    dispatch or a charge-back of a tenant served before (at the time of the latest
    dispatch), and each
    tenant's spells of queued work, from its queue turning non-empty to turning empty.
    At a scrape, the window [end - 10 s, end) counts the log's service in it, and a
    tenant is backlogged when one spell covers it. Times are sixteenths of a second
    (exact floats); a scrape is at a whole second and 1/16 s, so nothing happened
    between the window's end and it (where the window, keeping only each queue's latest
    spell, could not tell an emptying after the end followed by a new spell)."""
    s = make_scheduler(
        {name: TenantSpec(tier, w) for name, (tier, w) in _TENANTS.items()},
        mode="fifo" if fifo else "fair",
        max_batch_size=2,
        quantum=2.0,
    )
    t = 0.0
    service: list[tuple[float, str, float]] = []
    spells: dict[str, list[list[float]]] = {name: [] for name in _TENANTS}
    queued: list[QueuedRequest] = []
    last_dispatch = -math.inf

    def left(req: QueuedRequest) -> None:
        queued.remove(req)
        if not any(r.tenant == req.tenant for r in queued):
            spells[req.tenant][-1][1] = t

    for op, tenant, rows, wait in ops:
        t += wait / 16
        if op == "enqueue":
            req = make_request(tenant, rows=rows)
            if not any(r.tenant == tenant for r in queued):
                spells[tenant].append([t, math.inf])
            s.enqueue(req, t)
            queued.append(req)
        elif op == "dispatch":
            for req in s.next_batch(t):
                service.append((t, req.tenant, req.cost))
                last_dispatch = t
                left(req)
        elif op == "cancel":
            mine = [r for r in queued if r.tenant == tenant]
            if mine:
                assert s.cancel(mine[0], t)
                left(mine[0])
        elif op == "charge":
            if any(name == tenant for _, name, _ in service):  # its output, as it streams
                s.charge_back(tenant, rows / 2)
                service.append((last_dispatch, tenant, rows / 2))
        else:
            t = math.floor(t) + 1 + 1 / 16
            end = float(math.floor(t))
            start = end - 10
            served: dict[str, float] = {}
            for when, name, cost in service:
                if start <= when < end:
                    served[name] = served.get(name, 0.0) + cost
            backlogged: dict[str, dict[str, float]] = {}
            for name, (tier, weight) in _TENANTS.items():
                if any(a <= start and b >= end for a, b in spells[name]):
                    backlogged.setdefault(tier, {})[name] = served.get(name, 0.0) / weight
            window = s.window(t)
            event(f"served {bool(served)} backlogged {sum(map(len, backlogged.values()))}")
            assert (window.start, window.end) == (start, end)
            assert window.served == {n: v for n, v in served.items() if v}
            assert window.backlogged == backlogged


def test_tokens_charged_back_count_in_the_second_they_came() -> None:
    """One request dispatched at 1000.2 s (cost 1), its output charged back at 1003.5 s
    (5), nothing dispatched after: at 1013.7 s the window is [1003 s, 1013 s), and the
    five tokens are in it, the dispatch is not. Counted in the second of the latest
    dispatch (the charge-back told no time), they would be before the window: 0 served."""
    s = make_scheduler({"a": TenantSpec("paid", 1.0)}, max_batch_size=1)
    s.enqueue(make_request("a"), 1000.0)
    assert len(s.next_batch(1000.2)) == 1
    s.charge_back("a", 5.0, "", 1003.5)
    window = s.window(1013.7)
    assert (window.start, window.end) == (1003.0, 1013.0)
    assert window.served == {"a": 5.0}
    untimed = make_scheduler({"a": TenantSpec("paid", 1.0)}, max_batch_size=1)
    untimed.enqueue(make_request("a"), 1000.0)
    untimed.next_batch(1000.2)
    untimed.charge_back("a", 5.0)
    assert untimed.window(1013.7).served == {}  # the control: the second it was told
