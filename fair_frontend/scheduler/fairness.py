"""Selector 2: fair shares between the tenants of one tier (deficit round robin).

The algorithm, its fairness bound and its cost are derived in the package docstring
(``fair_frontend.scheduler``, sections "Deficit round robin" and "Round jumps").
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol, TypeVar

from fair_frontend.parts import Registry
from fair_frontend.scheduler.queues import TenantQueue
from fair_frontend.scheduler.snapshot import TierFairness
from fair_frontend.scheduler.types import EndpointPolicy

S = TypeVar("S")

# Rounds a stalled tenant needs are computed in floats; shaving a relative epsilon off
# makes a rounding error undershoot (one extra pass) instead of overshooting (a skipped
# round in which someone could have sent).
_ROUND_EPSILON = 1e-9


class FairnessPolicy(Protocol[S]):
    """Which tenant in this tier sends next?

    The policy is stateless; ``new_state()`` makes the state of one tier, which every
    other call takes. ``pick`` answers the question and must be idempotent until the
    pick is charged: the scheduler may pick, look at the request, and leave it for the
    next batch (a batch boundary), and the next pick must return the same tenant.
    ``join``/``leave`` tell the policy that a tenant's queue became non-empty/empty.

    A policy is one module that subclasses this and adds itself to ``FAIRNESS_POLICIES``
    (below) by name, which an endpoint's config names (``Endpoint.fairness``). What the
    scheduler and the core need to know of a policy beyond the questions above, it
    answers here, for itself (``quantum``, ``learn_quantum``, ``gauge``): nothing asks
    which class it is.
    """

    __slots__ = ()

    # The metric its ``deficits`` are exported as (``metrics.STATE_GAUGES``); None: it
    # keeps no per-tenant number worth one.
    gauge: ClassVar[str | None] = None

    @property
    def quantum(self) -> float | None:
        """Its budget per turn before weight, where it grants one (None: it grants none)."""
        return None

    def learn_quantum(self, quantum: float) -> None:
        """A full batch in cost units, learned from the requests (an endpoint with no
        quantum configured: ``Scheduler``), or carried over from a failed leader: a policy
        that grants a quantum takes it as its own. Others ignore it."""
        return

    def learn_request_cost(self, mean: float) -> None:
        """The mean cost of a dispatched request (charged when it was sent, and charged
        back since: an engine's output tokens), over about the last thousand requests;
        told before each join (``Scheduler``). A policy that measures something in
        requests' worth takes it. Others ignore it."""
        return

    def new_state(self) -> S: ...

    def join(self, state: S, queue: TenantQueue) -> None: ...

    def leave(self, state: S, queue: TenantQueue) -> None: ...

    def pick(self, state: S) -> TenantQueue | None: ...

    def charge(self, state: S, queue: TenantQueue, cost: float) -> None:
        """The picked tenant's head request, of this cost, was dispatched."""

    def ranked(self, state: S) -> Iterator[TenantQueue]:
        """The tier's tenants with queued work, the one it would serve first first, with
        nothing changed (``Scheduler.next_where``: a request taken out of turn, charged
        by ``credit``). A policy that cannot rank without picking yields its pick."""
        queue = self.pick(state)
        if queue is not None:
            yield queue

    def credit(self, state: S, tenant: str, cost: float) -> None:
        """Charge-back: the tenant's requests cost ``cost`` more (less, if negative) than
        was charged when they were dispatched (output tokens, known only as they come)."""

    def deficits(self, state: S) -> dict[str, float]:
        """Tenant -> its current budget, for tenants with queued work (for metrics)."""
        ...

    def export(self, state: S) -> TierFairness:
        """What this tier owes its tenants, for a standby to resume from
        (``fair_frontend.scheduler.snapshot``)."""
        ...

    def resume(self, state: S, saved: TierFairness) -> None:
        """Take over ``saved`` (an ``export``) into a state that has served nothing: the
        tenants backlogged then get their own state back as they join again. An empty
        ``saved`` forgets what a resume left for tenants that have not joined since."""


class _Turn:
    """One tenant's DRR record in one tier's state."""

    __slots__ = (
        "budget",
        "deficit",
        "entries",
        "grant",
        "listed",
        "queue",
        "round",
        "seen_jumps",
        "spent",
        "weight",
    )

    def __init__(self, queue: TenantQueue) -> None:
        self.queue = queue
        self.weight = queue.weight  # fixed while listed
        self.grant = 0.0  # quantum * weight, as of its latest grant
        self.deficit = 0.0  # excludes round jumps after seen_jumps (see effective())
        self.seen_jumps = 0
        self.round = -1  # the round of its latest grant
        self.spent = 0.0  # sent in its current visit
        self.budget = 0.0  # what its current visit may send before it passes the turn on
        self.listed = False  # has queued work, so is in a round list
        self.entries = 0  # entries in the round lists: only the last one is live

    def effective(self, jumps: int) -> float:
        return self.deficit + (jumps - self.seen_jumps) * self.grant


class DrrState:
    """One tier's deficit round robin: the round's lists, the current visit, the deficits.

    ``active`` holds, in visit order, the listed tenants that may still send in this
    round; ``later`` those done with it (their head did not fit what was left) and those
    that joined during it, in that order: the next round's list. Both may hold stale
    entries of tenants that left (skipped and dropped when reached). ``current`` is the
    tenant whose visit is in progress; it is always ``active[0]``. ``jumps`` counts the
    empty rounds skipped at once (package docstring, "Round jumps"); ``sent``: whether
    anything was sent in this round.
    """

    __slots__ = (
        "active",
        "count",
        "current",
        "jumps",
        "later",
        "resumed",
        "round",
        "sent",
        "turns",
    )

    def __init__(self) -> None:
        self.turns: dict[str, _Turn] = {}
        self.active: deque[_Turn] = deque()
        self.later: deque[_Turn] = deque()
        self.current: _Turn | None = None
        self.count = 0  # listed tenants
        self.jumps = 0
        self.round = 0
        self.sent = False
        # Deficits of a failed-over leader's backlogged tenants, restored as each joins
        # again and kept as each leaves (``snapshot``), until the scheduler forgets them.
        self.resumed: dict[str, float] = {}


class DeficitRoundRobin(FairnessPolicy[DrrState]):
    """Deficit round robin with weights, interleaved: each round adds ``quantum * weight``
    to every backlogged tenant's budget, and the tenants take turns within the round a
    slice at a time (``visits`` slices a round: a batch's rows), until none can afford
    its head (package docstring, "Deficit round robin").

    ``quantum`` may be changed between picks (a learned full batch, ``Scheduler``): each
    grant is the quantum of the moment it is made; the bounds then hold with ``q`` the
    largest quantum granted over the interval.
    """

    __slots__ = ("_quantum", "_visits")

    gauge = "fair_drr_deficit"

    def __init__(self, quantum: float, visits: int = 1) -> None:
        if not (quantum > 0 and math.isfinite(quantum)):
            raise ValueError(f"quantum must be a positive number, not {quantum}")
        if visits < 1:
            raise ValueError(f"visits must be at least 1, not {visits}")
        self._quantum = quantum
        self._visits = visits

    @classmethod
    def of(cls, policy: EndpointPolicy) -> DeficitRoundRobin:
        """For an endpoint: its quantum (one cost unit until one is learned, if unset), in
        as many slices as a batch has rows (one, whole, where it does not batch)."""
        return cls(policy.quantum or 1.0, max(1, policy.max_batch_size))

    @property
    def quantum(self) -> float:
        return self._quantum

    def learn_quantum(self, quantum: float) -> None:
        self._quantum = quantum

    def new_state(self) -> DrrState:
        return DrrState()

    def join(self, state: DrrState, queue: TenantQueue) -> None:
        turn = state.turns.get(queue.tenant)
        if turn is None:
            turn = state.turns[queue.tenant] = _Turn(queue)
        turn.queue = queue
        turn.weight = queue.weight
        turn.grant = self._quantum * queue.weight
        # What it owes from before it left (0, or a debt), or what a failover carried.
        if state.resumed and queue.tenant in state.resumed:
            turn.deficit = state.resumed[queue.tenant]
        turn.seen_jumps = state.jumps  # no credit for rounds skipped before it joined
        turn.listed = True
        turn.entries += 1
        state.later.append(turn)  # it waits for the next round
        state.count += 1

    def leave(self, state: DrrState, queue: TenantQueue) -> None:
        turn = state.turns[queue.tenant]
        if state.resumed and queue.tenant in state.resumed:
            # Carried over from a failed leader: kept for its next join (the held calls
            # come back one by one, and each may empty the queue as it is sent).
            state.resumed[queue.tenant] = turn.effective(state.jumps)
        turn.listed = False
        # An emptied queue keeps no budget (no hoarding while idle), but keeps its debt:
        # what was charged back beyond its budget is paid by its next grants, as if it
        # had stayed (else a tenant whose queue empties between its requests would never
        # pay for their output tokens, counted after they were sent).
        turn.deficit = min(0.0, turn.effective(state.jumps))
        turn.seen_jumps = state.jumps
        state.count -= 1
        if state.current is turn:
            state.current = None
            state.active.popleft()
            turn.entries -= 1
        # Otherwise its entry stays in its list, stale, until the rotation reaches it.

    def pick(self, state: DrrState) -> TenantQueue | None:
        active = state.active
        while True:
            turn = state.current
            if turn is not None:  # a visit in progress
                head = turn.queue.head()
                if head is None:
                    raise AssertionError(f"tenant {turn.queue.tenant!r} is listed with no work")
                if head.cost > turn.deficit:
                    # Done with this round: it keeps what is left for the next.
                    active.popleft()
                    state.later.append(turn)
                elif turn.spent and turn.spent + head.cost > turn.budget:
                    active.rotate(-1)  # its slice is spent: the next tenant's visit
                else:
                    return turn.queue
                state.current = None
            if not state.count:
                return None
            if not active:
                self._next_round(state)
                active = state.active
                continue
            turn = active[0]
            if turn.entries > 1 or not turn.listed:
                active.popleft()  # stale: the tenant left (and maybe rejoined behind)
                turn.entries -= 1
                continue
            if turn.round < state.round:
                # Its grant for this round: one quantum, plus any skipped rounds it has
                # not seen (at the quantum of now, which a learned quantum may have moved).
                turn.grant = self._quantum * turn.weight
                turn.deficit += (state.jumps - turn.seen_jumps + 1) * turn.grant
                turn.seen_jumps = state.jumps
                turn.round = state.round
            head = turn.queue.head()
            if head is None:
                raise AssertionError(f"tenant {turn.queue.tenant!r} is listed with no work")
            if head.cost > turn.deficit:
                active.popleft()  # saving: done with this round at once
                state.later.append(turn)
                continue
            # A new visit: about ``weight`` requests like its head (at least this one), or
            # ``weight`` of the ``visits`` slices of a quantum where a slice is more.
            turn.spent = 0.0
            if self._visits > 1:
                turn.budget = turn.weight * max(self._quantum / self._visits, head.cost)
            else:
                turn.budget = math.inf  # one visit a round: the classic turn
            state.current = turn
            return turn.queue

    def _next_round(self, state: DrrState) -> None:
        """The round is over: every listed tenant is in ``later``. If nobody sent in it,
        the next rounds up to the first in which someone can afford its head would be
        empty too: skipped at once (package docstring, "Round jumps")."""
        if not state.sent:
            fewest = math.inf
            for turn in state.later:
                if turn.listed:
                    head = turn.queue.head()
                    assert head is not None
                    short = (head.cost - turn.effective(state.jumps)) / turn.grant
                    fewest = min(fewest, math.ceil(short * (1 - _ROUND_EPSILON)))
            if math.isfinite(fewest):
                state.jumps += max(int(fewest), 1) - 1
        state.active, state.later = state.later, state.active
        state.round += 1
        state.sent = False

    def charge(self, state: DrrState, queue: TenantQueue, cost: float) -> None:
        turn = state.current
        assert turn is not None and turn.queue is queue, "charge follows pick"
        turn.deficit -= cost
        turn.spent += cost
        state.sent = True

    def ranked(self, state: DrrState) -> Iterator[TenantQueue]:
        """Visit order from the current visit: the listed tenants, each once."""
        seen: set[str] = set()
        for turn in itertools.chain(state.active, state.later):
            tenant = turn.queue.tenant
            if turn.listed and tenant not in seen:
                seen.add(tenant)
                yield turn.queue

    def credit(self, state: DrrState, tenant: str, cost: float) -> None:
        """Charge-back, from the budget of a tenant: a debt (a budget below 0) is paid off
        by its next grants before it sends again, so (I1) becomes D_f >= -debt, and the
        bounds hold with C_f including what was charged back. A tenant that has left the
        round keeps its debt for its return (``leave``): a charge-back adds to it, a
        refund pays it off but saves nothing beyond (its queue is empty: no budget)."""
        turn = state.turns.get(tenant)
        if turn is None:
            return
        if turn.listed:
            turn.deficit -= cost
        else:
            turn.deficit = min(0.0, turn.deficit - cost)

    def deficits(self, state: DrrState) -> dict[str, float]:
        jumps = state.jumps
        return {
            tenant: turn.effective(jumps) for tenant, turn in state.turns.items() if turn.listed
        }

    def export(self, state: DrrState) -> TierFairness:
        """The deficits of the backlogged tenants (an idle one's is 0 by definition), and
        those restored but not yet joined again (still owed from the failover before),
        and the debts of tenants that left owing (``leave``)."""
        owed = {t: turn.deficit for t, turn in state.turns.items() if turn.deficit < 0}
        deficits = {**owed, **state.resumed, **self.deficits(state)}
        return TierFairness(deficits, active=list(deficits))

    def resume(self, state: DrrState, saved: TierFairness) -> None:
        state.resumed = {t: saved.counters[t] for t in saved.active if t in saved.counters}


FairnessFactory = Callable[[EndpointPolicy], FairnessPolicy[Any]]
"""Builds an endpoint's policy from its ``EndpointPolicy`` (one per scheduler)."""

# The fairness policies by the name an endpoint's config gives (``Endpoint.fairness``),
# each added by the module that defines it (the package imports them all).
FAIRNESS_POLICIES: Registry[FairnessFactory] = Registry("fairness policy")
FAIRNESS_POLICIES.add("drr", DeficitRoundRobin.of)
