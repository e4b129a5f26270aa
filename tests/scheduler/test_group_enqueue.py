"""``Scheduler.enqueue_all``: the parts of one call queued all or none.

Each cap ``enqueue`` checks is checked for the whole group (its count and its bytes
together) before any part is queued; a refused group leaves the scheduler, the caps and
the parts as they were. The negative controls queue the same parts one by one: a cap the
group does not fit then takes its first parts and refuses the rest.
"""

from __future__ import annotations

import pytest
from sched_support import make_request, make_scheduler

from fair_frontend.errors import QueueFull
from fair_frontend.scheduler import GlobalCaps, QueueState, Scheduler, TenantSpec


def _state(s: Scheduler, caps: GlobalCaps) -> tuple[object, ...]:
    """The counts a refused group must leave as they were."""
    return (
        s.counters.admitted,
        s.queued_requests,
        s.queued_bytes,
        caps.queued,
        caps.queued_bytes,
        dict(caps.tenant_bytes),
    )


def test_a_group_that_fits_is_queued_in_its_order_and_dispatched_as_one_tenants() -> None:
    s = make_scheduler({"a": "paid", "b": "paid"})
    group = [make_request("a", tag=i) for i in range(4)]
    s.enqueue_all(group, 0.0)
    assert s.counters.admitted == 4 and s.depth("a") == 4
    assert all(r.state is QueueState.QUEUED for r in group)
    assert [r.tag for r in s.next_batch(1.0)] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("terms", "caps", "sizes", "cap"),
    [
        (TenantSpec("paid", max_queued=5), GlobalCaps(), [0] * 6, "tenant 'a' max_queued=5"),
        (
            TenantSpec("paid", max_queued_bytes=100),
            GlobalCaps(),
            [30, 30, 30, 30],
            "tenant 'a' max_queued_bytes=100",
        ),
        (
            TenantSpec("paid"),
            GlobalCaps(max_queued_bytes=1000, tenant_bytes_share=0.25),
            [100, 100, 100],
            "tenant 'a' max_queued_bytes=250 (its default",
        ),
        (TenantSpec("paid"), GlobalCaps(max_queued=3), [0] * 4, "global max_queued=3"),
        (
            TenantSpec("paid", max_queued_bytes=1000),  # its own cap, above the global one
            GlobalCaps(max_queued_bytes=100),
            [40, 40, 40],
            "global max_queued_bytes=100",
        ),
    ],
)
def test_a_group_over_a_cap_is_refused_whole(
    terms: TenantSpec, caps: GlobalCaps, sizes: list[int], cap: str
) -> None:
    s = make_scheduler({"a": terms}, caps=caps)
    before = _state(s, caps)
    group = [make_request("a", nbytes=n) for n in sizes]
    with pytest.raises(QueueFull) as err:
        s.enqueue_all(group, 0.0)
    assert err.value.cap.startswith(cap)
    assert _state(s, caps) == before
    assert all(r.state is QueueState.NEW for r in group)
    # One part fewer fits (each cap above is met by the last part exactly).
    s.enqueue_all(group[:-1], 0.0)
    assert s.depth("a") == len(group) - 1
    # Negative control: the refused part alone is refused, as the whole was.
    with pytest.raises(QueueFull):
        s.enqueue(group[-1], 0.0)


def test_negative_control_one_by_one_a_cap_takes_the_first_parts() -> None:
    s = make_scheduler({"a": TenantSpec("paid", max_queued=5)})
    group = [make_request("a") for _ in range(6)]
    queued = 0
    for req in group:
        try:
            s.enqueue(req, 0.0)
            queued += 1
        except QueueFull:
            break
    assert queued == 5  # the call was half queued when its last part was refused


def test_a_group_counts_what_is_queued_already() -> None:
    s = make_scheduler({"a": TenantSpec("paid", max_queued=5)})
    s.enqueue(make_request("a"), 0.0)
    s.enqueue(make_request("a"), 0.0)
    with pytest.raises(QueueFull):
        s.enqueue_all([make_request("a") for _ in range(4)], 0.0)
    assert s.depth("a") == 2
    s.enqueue_all([make_request("a") for _ in range(3)], 0.0)
    assert s.depth("a") == 5


def test_a_group_is_one_tenants_and_new() -> None:
    s = make_scheduler({"a": "paid", "b": "paid"})
    with pytest.raises(ValueError, match="one tenant's"):
        s.enqueue_all([make_request("a"), make_request("b")], 0.0)
    queued = make_request("a")
    s.enqueue(queued, 0.0)
    with pytest.raises(ValueError, match="enqueue it once"):
        s.enqueue_all([make_request("a"), queued], 0.0)
    assert s.depth("a") == 1 and s.depth("b") == 0
    s.enqueue_all([], 0.0)  # nothing to queue: nothing happens
    assert s.counters.admitted == 1
