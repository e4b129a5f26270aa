"""Selector 2 in engine mode: fair shares over tokens served (virtual token counters).

Engine mode (``Endpoint.max_inflight``) sends each request to a model that batches inside
itself (continuous batching: vLLM, TensorRT-LLM, the shipped ``llm``); the frontend decides
who gets the engine's next free slot. What a request costs is only known as it runs: its
output tokens stream one decode step at a time. So, as VTC does (Sheng et al., "Fairness
in Serving Large Language Models", OSDI 2024), each tenant f of a tier has a counter
``c_f`` of the service it got, in weighted tokens:

* when one of f's requests gets a slot, ``c_f += w_in * input_tokens / weight_f``
  (``charge``: the request's cost, fixed at enqueue, is its input tokens);
* as its output streams, ``c_f += w_out * tokens / weight_f`` (``credit``: charge-back,
  from the core, per response);
* the next free slot goes to the tenant with the least counter among those with queued
  work (ties: a tenant not yet served since it joined first, then the one charged
  longest ago);
* a tenant whose queue was empty is lifted when it queues again: ``c_f = max(c_f, V -
  L_f)``; one new to the tier starts at ``V`` (it was owed nothing). ``V``, the tier's
  floor, is the most the least active counter has been (the counter of the last tenant
  to leave where none was active): it never falls. ``L_f``, the debt a tenant carries
  back, is ``debt_carried`` turnovers of the engine (``S`` requests of the mean cost
  seen, input and output) over its weight; ``debt_carried`` 0 is VTC's own lift. Idle
  time banks at most ``L_f``: a tenant back from lunch does not get the engine to
  itself until it has caught up, but an agent whose queue empties while its step's
  last calls run, and fills with its next step, comes back owed what the others took
  meanwhile (up to ``L_f``) instead of losing it at every step.

Bounds (one tier; ``S`` slots; ``I`` the largest input and ``O`` the largest output of a
request, in tokens; ``U_f = (w_in * I + w_out * O * S) / weight_f``):

(V) Every tenant active (queued work) has ``c_f >= V - L_f``. Proof: it held at f's join
    (the lift); while f stays active, ``V`` rises only to the least active counter,
    which is at most ``c_f``, and ``c_f`` only grows (refunds aside: they lower a
    counter by what its admission overcharged).
(N) A tenant that joins, with no other newly joined tenant of its tier, gets one of the
    next free slots: the first one, unless a tenant whose counter is lower still is
    waiting: one that carried debt in and has not yet caught up, by (V) at most
    ``L_g`` below ``V``. With ``debt_carried`` 0 its counter is the least of all when it
    joins, and every other tenant's counter can only grow. Its first token therefore
    waits for a slot to turn over, not for the other tenants' queues: the
    noisy-neighbour guarantee (``reserved_slots`` keeps one free of any one tenant).
(B) For two tenants f and g continuously backlogged over an interval, the weighted
    service they get differs by at most ``U_f + U_g + L``, ``L`` the larger of their
    carried debts (``U_f + U_g`` over an interval that does not begin at a join).
    Proof: while both are backlogged nobody is lifted, so each counter grows by exactly
    the weighted service. At f's last pick its counter was at most g's; since then it
    grew by at most one input charge and the output of its requests in flight (at most
    S of them, O tokens each), while g's did not shrink: ``c_f - c_g <= U_f`` at every
    moment once f has been picked, and symmetrically. Before its first pick, f is not
    served. At the interval's start, where f has just joined, ``c_f >= V - L_f`` and
    ``c_g - V <= U_g`` (g was picked at most ``U_g`` ago at the least counter, ``<= V``
    where both were active), so ``c_g - c_f <= U_g + L_f`` there; the difference of
    the growths over the interval is then at most ``U_f + U_g + L``. With one slot and
    no carried debt this is VTC's own bound, 2 * max(w_in * I, w_out * O) for equal
    weights; the S * O term is the engine's memory, as VTC's M.

Complexity: a lazy heap of (counter, rank, order, tenant) entries; ``pick`` pops stale
entries (a tenant charged or credited since, or gone), so O(log n) amortised; a credit
pushes an entry (only for a tenant with queued work), and the heap is rebuilt when stale
entries outnumber live ones.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator

from fair_frontend.scheduler.fairness import FAIRNESS_POLICIES, FairnessPolicy
from fair_frontend.scheduler.queues import TenantQueue
from fair_frontend.scheduler.snapshot import TierFairness
from fair_frontend.scheduler.types import EndpointPolicy


class VtcState:
    """One tier's counters, active tenants and heap."""

    __slots__ = (
        "active",
        "counters",
        "floor",
        "heap",
        "last_left",
        "live",
        "order",
        "resumed",
        "weights",
    )

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.active: dict[str, TenantQueue] = {}  # tenants with queued work
        self.heap: list[tuple[float, int, int, str]] = []
        self.live: dict[str, int] = {}  # tenant -> order of its one live heap entry
        self.order = itertools.count()
        self.last_left = 0.0
        self.floor = 0.0  # V: the most the least active counter has been (it never falls)
        # A failed-over leader's backlogged tenants: their joins keep the counter
        # restored, without the lift (``snapshot``), until the scheduler forgets them.
        self.resumed: set[str] = set()


class VirtualTokenCounter(FairnessPolicy[VtcState]):
    """Least served first, in weighted tokens (the module docstring). ``debt_carried``:
    turnovers of an engine of ``slots`` slots that a tenant's lift leaves it owed (0:
    VTC's own lift; no slots: none)."""

    __slots__ = ("_mean_cost", "_turnover")

    gauge = "fair_vtc_counter"

    def __init__(self, debt_carried: float = 0.0, slots: int | None = None) -> None:
        if not (debt_carried >= 0 and math.isfinite(debt_carried)):
            raise ValueError(f"debt_carried {debt_carried} is not a number >= 0")
        self._turnover = debt_carried * slots if slots else 0.0  # requests' worth
        self._mean_cost = 0.0  # of a request, input and output (``learn_request_cost``)

    @classmethod
    def of(cls, policy: EndpointPolicy) -> VirtualTokenCounter:
        return cls(policy.debt_carried, policy.slots)

    def learn_request_cost(self, mean: float) -> None:
        self._mean_cost = mean

    def carried(self, weight: float) -> float:
        """L_f: the debt a tenant of ``weight`` keeps when it joins, in counter units (0
        until a request has been dispatched)."""
        return max(0.0, self._turnover * self._mean_cost / weight)

    def new_state(self) -> VtcState:
        return VtcState()

    def join(self, state: VtcState, queue: TenantQueue) -> None:
        tenant = queue.tenant
        if state.resumed and tenant in state.resumed:
            # The same backlog, carried over: no lift, however often its queue empties
            # while the held calls come back one by one into free slots.
            state.counters.setdefault(tenant, state.last_left)
        else:
            floor = state.floor = self._floor(state)
            known = state.counters.get(tenant)
            # A tenant new to the tier was owed nothing: it starts at the floor.
            if known is None:
                state.counters[tenant] = floor
            else:
                state.counters[tenant] = max(known, floor - self.carried(queue.weight))
        state.weights[tenant] = queue.weight
        state.active[tenant] = queue
        self._push(state, tenant, rank=0)

    def leave(self, state: VtcState, queue: TenantQueue) -> None:
        tenant = queue.tenant
        state.active.pop(tenant, None)
        state.live.pop(tenant, None)
        state.last_left = state.counters.get(tenant, 0.0)

    def pick(self, state: VtcState) -> TenantQueue | None:
        heap = state.heap
        while heap:
            _, _, order, tenant = heap[0]
            if state.live.get(tenant) == order:
                return state.active[tenant]
            heapq.heappop(heap)
        return None

    def ranked(self, state: VtcState) -> Iterator[TenantQueue]:
        """Least counter first: the heap's live entries in order (a copy popped, so
        ``pick`` and the heap are as they were)."""
        heap = list(state.heap)
        live = state.live
        while heap:
            _, _, order, tenant = heapq.heappop(heap)
            if live.get(tenant) == order:
                yield state.active[tenant]

    def charge(self, state: VtcState, queue: TenantQueue, cost: float) -> None:
        tenant = queue.tenant
        state.counters[tenant] = state.counters.get(tenant, 0.0) + cost / queue.weight
        if tenant in state.active:
            self._push(state, tenant, rank=1)

    def credit(self, state: VtcState, tenant: str, cost: float) -> None:
        """Service its requests got after their slot: output tokens, as they stream (a
        negative cost refunds what admission charged beyond the real cost)."""
        weight = state.weights.get(tenant)
        if weight is None:
            return  # never queued on this tier: nothing to correct
        state.counters[tenant] = state.counters.get(tenant, 0.0) + cost / weight
        if tenant in state.active:
            self._push(state, tenant, rank=1)

    def deficits(self, state: VtcState) -> dict[str, float]:
        """Tenant -> its counter, for tenants with queued work."""
        return {t: state.counters[t] for t in state.active}

    def export(self, state: VtcState) -> TierFairness:
        """Every counter and weight known, and the floor a tenant joining now would be
        lifted from (``_floor``)."""
        active = [*state.active, *(t for t in state.resumed if t not in state.active)]
        return TierFairness(dict(state.counters), dict(state.weights), self._floor(state), active)

    def resume(self, state: VtcState, saved: TierFairness) -> None:
        state.counters.update(saved.counters)
        state.weights.update(saved.weights)
        # A tenant that joins without a restored counter, first in the tier, starts at
        # the least counter of the backlogged tenants the leader had: none ahead of them.
        if saved.counters or saved.active:
            state.last_left = saved.floor
            state.floor = saved.floor
        state.resumed = {t for t in saved.active if t in saved.counters}

    def _floor(self, state: VtcState) -> float:
        """V as of now: the most the least active counter has been (the last to leave's
        where none is active), the kept floor or the least active counter now."""
        least = self._least(state)
        return max(state.floor, state.last_left if least is None else least)

    def _least(self, state: VtcState) -> float | None:
        """The least counter among the active tenants (None: none is active)."""
        if self.pick(state) is None:
            return None
        return state.heap[0][0]

    def _push(self, state: VtcState, tenant: str, rank: int) -> None:
        order = next(state.order)
        state.live[tenant] = order
        heapq.heappush(state.heap, (state.counters[tenant], rank, order, tenant))
        if len(state.heap) > 4 * len(state.active) + 64:
            state.heap = [e for e in state.heap if state.live.get(e[3]) == e[2]]
            heapq.heapify(state.heap)


FAIRNESS_POLICIES.add("vtc", VirtualTokenCounter.of)
