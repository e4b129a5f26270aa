"""Selector 2 as a baseline: first come, first served across the tenants of one tier.

The tenant whose next request (its head, by its own order: ``OrderingPolicy``) came
first sends next, whatever the tenants' weights and whatever each has been served: a
tenant that sends ten times as often gets ten times the endpoint. This is what the fair
policies are measured against (with tiers, caps and deadlines as they are: unlike
``scheduling: fifo``, which puts the whole endpoint in one queue, tiers are still served
in their order here). Nothing is owed to anyone, so nothing is charged, credited or
carried over a failover.

Cost: ``pick`` looks at the head of every tenant of the tier with queued work, O(tenants
backlogged in the tier): a baseline's price, not a fair policy's.
"""

from __future__ import annotations

from collections.abc import Iterator

from fair_frontend.scheduler.fairness import FAIRNESS_POLICIES, FairnessPolicy
from fair_frontend.scheduler.queues import TenantQueue
from fair_frontend.scheduler.snapshot import TierFairness

_NOTHING_OWED = TierFairness({})


class FifoState:
    """One tier's tenants with queued work."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active: dict[str, TenantQueue] = {}


class FirstComeFirstServed(FairnessPolicy[FifoState]):
    """The tenant whose head request arrived first (least ``seq``) goes next."""

    __slots__ = ()

    def new_state(self) -> FifoState:
        return FifoState()

    def join(self, state: FifoState, queue: TenantQueue) -> None:
        state.active[queue.tenant] = queue

    def leave(self, state: FifoState, queue: TenantQueue) -> None:
        state.active.pop(queue.tenant, None)

    def pick(self, state: FifoState) -> TenantQueue | None:
        first: TenantQueue | None = None
        first_seq = 0
        for queue in state.active.values():
            head = queue.head()
            if head is not None and (first is None or head.seq < first_seq):
                first, first_seq = queue, head.seq
        return first

    def ranked(self, state: FifoState) -> Iterator[TenantQueue]:
        """By their heads' arrival."""
        heads = [(q.head(), q) for q in state.active.values()]
        for _, queue in sorted((h.seq, q) for h, q in heads if h is not None):
            yield queue

    def charge(self, state: FifoState, queue: TenantQueue, cost: float) -> None:
        """Nothing is owed: arrival alone decides."""

    def credit(self, state: FifoState, tenant: str, cost: float) -> None:
        """Nothing is owed: arrival alone decides."""

    def deficits(self, state: FifoState) -> dict[str, float]:
        return {}

    def export(self, state: FifoState) -> TierFairness:
        return _NOTHING_OWED

    def resume(self, state: FifoState, saved: TierFairness) -> None:
        """Nothing to take over: the calls come back in an order of their own."""


FAIRNESS_POLICIES.add("fifo", lambda policy: FirstComeFirstServed())
