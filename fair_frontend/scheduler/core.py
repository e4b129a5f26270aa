"""The scheduler of one endpoint: queues, selectors and batch assembly, without I/O.

Every entry point takes ``now`` from the caller (the shell reads the clock once per
operation); nothing here reads a clock, sleeps or blocks. The algorithm is explained in
the package docstring; this module is its bookkeeping.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

from fair_frontend.errors import Internal, QueueFull
from fair_frontend.scheduler.assembly import BatchAssembler, Peek, Take
from fair_frontend.scheduler.caps import GlobalCaps
from fair_frontend.scheduler.cost import CostModel, cost_model_for
from fair_frontend.scheduler.fairness import FAIRNESS_POLICIES, FairnessPolicy
from fair_frontend.scheduler.ordering import OrderingPolicy, PriorityDeadlineArrival
from fair_frontend.scheduler.queues import ArrivalQueue, DeadlineQueue, TenantQueue
from fair_frontend.scheduler.snapshot import SchedulerFairness, TierFairness
from fair_frontend.scheduler.tiers import GuardedTierOrder, StrictTierOrder, Tier, TierSelector
from fair_frontend.scheduler.types import (
    Backlog,
    Counters,
    EndpointPolicy,
    Handle,
    QueuedRequest,
    QueueState,
    TenantDirectory,
    TenantTerms,
)
from fair_frontend.scheduler.window import (
    WINDOW_S,
    ServiceLog,
    WindowFairness,
    window_end,
)

Mode = Literal["fair", "fifo"]

PROGRAM_HALF_LIFE_S = 10.0
"""A program's attained service halves every this many seconds (``TenantQueue``).

An agent's step (its calls fanned out, then the model's answers) takes seconds: ten
remember the last few steps, so a program that just had a burst waits behind one that
had little, while what it got a minute ago counts under 2 %: a program back after a
pause is not held back for long by service it no longer takes."""
# Service is scaled in steps of this many seconds (the scale grows by 2 ** (1 / 10) a
# step): charges within one step weigh alike, so equal charges tie exactly.
_PROGRAM_STEP_S = 1.0
_STEPS_PER_HALF_LIFE = round(PROGRAM_HALF_LIFE_S / _PROGRAM_STEP_S)
# The scale is taken back to 1 (every program's service divided alike, exactly: a power
# of 2) once it reaches 2 ** 64, far from a float's range.
_REBASE_HALF_LIVES = 64

_NEW = QueueState.NEW
_QUEUED = QueueState.QUEUED
_DISPATCHED = QueueState.DISPATCHED
_EXPIRED = QueueState.EXPIRED
_CANCELLED = QueueState.CANCELLED


class Scheduler:
    """Queues and dispatch order of one endpoint (model), for many tenants.

    ``mode="fair"``: tier -> deficit round robin -> (priority, deadline, arrival), as the
    package docstring derives. ``mode="fifo"``: one shared queue in arrival order (no
    tiers, weights or priorities): the baseline and the fairness tests' negative control.
    Both modes share the caps, deadlines, cancellation and accounting.

    The selectors are injectable for tests and experiments; by default they follow
    ``policy`` (strict tiers, or guarded ones if ``policy.tier_min_share`` is set).
    """

    def __init__(
        self,
        policy: EndpointPolicy,
        tenants: TenantDirectory,
        caps: GlobalCaps,
        *,
        mode: Mode = "fair",
        cost_model: CostModel | None = None,
        tier_selector: TierSelector[Any] | None = None,
        fairness: FairnessPolicy[Any] | None = None,
        ordering: OrderingPolicy | None = None,
    ) -> None:
        if mode not in ("fair", "fifo"):
            raise ValueError(f"mode must be 'fair' or 'fifo', not {mode!r}")
        self.policy = policy
        self.mode: Mode = mode
        self._fair = mode == "fair"
        self._tenants = tenants
        self._caps = caps
        self._cost: CostModel = cost_model or cost_model_for(policy.cost)
        if tier_selector is None:
            if policy.tier_min_share:
                tier_selector = GuardedTierOrder(
                    policy.tiers, policy.tier_min_share, policy.share_window_rows
                )
            else:
                tier_selector = StrictTierOrder()
        self._tier_selector: TierSelector[Any] = tier_selector
        self._tier_state = tier_selector.new_state()
        # A token-cost endpoint without a token cap learns its full batch in tokens:
        # max_batch_size rows (1 if it does not batch) of the mean cost per row so far.
        self._learn_quantum = policy.quantum is None
        self._batch_rows = max(1, policy.max_batch_size)
        self._mean_row_cost = 0.0
        self._seen_rows = 0
        # What dispatched requests cost, sent and charged back since, and how many they
        # were: both halved every ``_HALVE_REQUESTS`` (``learn_request_cost``).
        self._request_cost = 0.0
        self._requests = 0.0
        if fairness is None:
            fairness = FAIRNESS_POLICIES[policy.fairness](policy)
        self._fairness: FairnessPolicy[Any] = fairness
        self._ordering: OrderingPolicy = ordering or PriorityDeadlineArrival()
        self._tiers = [
            Tier(name, i, self._fairness.new_state()) for i, name in enumerate(policy.tiers)
        ]
        self._tier_by_name = {tier.name: tier for tier in self._tiers}
        self._assembler = BatchAssembler(policy.max_batch_size, policy.max_batch_tokens)
        self._queues: dict[str, TenantQueue] = {}
        # Per tenant: (requests, bytes) whose room ``reserve`` holds, not queued yet.
        self._reserved: dict[str, tuple[int, int]] = {}
        self._arrivals = ArrivalQueue()
        self._deadlines = DeadlineQueue()
        self._expired: list[QueuedRequest] = []  # expired inside next_batch, not yet returned
        self._seq = 0
        self._admitted = 0
        self._dispatched = 0
        self._expired_count = 0
        self._cancelled = 0
        self._resumed_until: float | None = None  # see resume_fairness
        # A resumed leader's programs' service, by tenant, for their queues to come.
        self._resumed_programs: dict[str, dict[str, float]] = {}
        # Programs' decay (``TenantQueue``): a charge's scale, 2 ** ((step - base) / steps
        # per half-life), until the step that ends at ``_step_end``.
        self._scale = 1.0
        self._step_end = -math.inf
        self._base_step: int | None = None
        # Every tenant's service at the start of the recent seconds with a dispatch (the
        # fairness window's, ``fair_frontend.scheduler.window``: taken at a step's start).
        self._service_log = ServiceLog()
        self._peek: Peek = self._peek_fair if self._fair else self._arrivals.head
        self._take: Take = self._take_fair if self._fair else self._take_fifo

    # ---- entry points -------------------------------------------------------------------

    def enqueue(self, req: QueuedRequest, now: float) -> None:
        """Queue a request, or raise ``QueueFull`` naming the first cap it would exceed.

        Caps are checked in this order: the tenant's ``max_queued`` and
        ``max_queued_bytes`` on this endpoint (without its own ``max_queued``: the
        endpoint's default, ``GlobalCaps.default_max_queued``; without its own
        ``max_queued_bytes``: its default share of the global byte cap, over every
        endpoint), then the process-wide ``max_queued`` and ``max_queued_bytes``. A
        refused request is left untouched (state ``NEW``).
        The tenant directory is consulted when the tenant has nothing queued here; while
        it has, its terms (tier, weight, caps) stay as they were (see ``TenantQueue``).
        """
        _check_new(req)
        queue = self._queue_for(req.tenant)
        self._room(queue, 1, req.nbytes)
        self._add(req, queue, now)

    def enqueue_all(self, reqs: Sequence[QueuedRequest], now: float) -> None:
        """Queue every one of ``reqs`` (the parts of one call, all of one tenant), or
        none: ``QueueFull`` naming the first cap the whole group would exceed, checked
        as ``enqueue`` checks one request (the group counts as ``len(reqs)`` requests
        and its bytes together), before any of them is queued; a refused group is left
        untouched. Queued in the order given (its requests' own order then decides).
        ``reserve`` and ``enqueue_reserved`` together, at once."""
        if not reqs:
            return
        self.reserve(reqs)
        self.enqueue_reserved(reqs, now)

    def reserve(self, reqs: Sequence[QueuedRequest]) -> None:
        """Hold the room ``reqs`` (the parts of one call, all of one tenant) take in every
        cap, or raise ``QueueFull`` as ``enqueue_all`` would (nothing held then): they
        are counted in the caps from now on, as if queued, and each is queued later by
        ``enqueue_reserved`` (or its room given back by ``release``). So a call too
        large to queue in one step is admitted whole at once, and queued in slices
        without another request taking its room meanwhile."""
        tenant = reqs[0].tenant
        for req in reqs:
            _check_new(req)
            if req.tenant != tenant:
                raise ValueError(f"a group is one tenant's: {req.tenant!r} in {tenant!r}'s")
        count, nbytes = len(reqs), sum(r.nbytes for r in reqs)
        self._room(self._queue_for(tenant), count, nbytes)
        held = self._reserved.get(tenant, (0, 0))
        self._reserved[tenant] = (held[0] + count, held[1] + nbytes)
        self._caps.hold(tenant, count, nbytes)

    def enqueue_reserved(self, reqs: Sequence[QueuedRequest], now: float) -> None:
        """Queue ``reqs``, whose room ``reserve`` holds (no cap is checked again)."""
        for req in reqs:
            _check_new(req)
            self._unreserve(req.tenant, 1, req.nbytes)
            self._add(req, self._queue_for(req.tenant), now, counted=True)

    def release(self, req: QueuedRequest) -> None:
        """Give back the room ``reserve`` holds for ``req``, which will not be queued."""
        self._unreserve(req.tenant, 1, req.nbytes)
        self._caps.release(req.tenant, 1, req.nbytes)

    def _unreserve(self, tenant: str, count: int, nbytes: int) -> None:
        held_count, held_bytes = self._reserved[tenant]
        if held_count == count:
            del self._reserved[tenant]
        else:
            self._reserved[tenant] = (held_count - count, held_bytes - nbytes)

    def _queue_for(self, tenant: str) -> TenantQueue:
        """The tenant's queue here, made anew from the directory's terms when it is empty
        (the terms apply from the moment a tenant's queue is empty: ``TenantQueue``)."""
        queue = self._queues.get(tenant)
        if queue is None or not queue.requests:
            terms = self._tenants.get(tenant)
            if terms is None:
                raise Internal(f"scheduler: unknown tenant {tenant!r}")
            if queue is None or queue.terms is not terms:
                queue = self._new_queue(tenant, terms)
        return queue

    def _room(self, queue: TenantQueue, count: int, nbytes: int) -> None:
        """Raise ``QueueFull`` naming the first cap ``count`` more requests of
        ``nbytes`` tensor bytes in all would exceed (the order ``enqueue`` documents)."""
        tenant = queue.tenant
        held_count, held_bytes = self._reserved.get(tenant, _NONE_HELD)
        if queue.requests + held_count + count > queue.max_queued:
            raise QueueFull(f"tenant {tenant!r} max_queued={queue.max_queued}")
        cap = queue.max_queued_bytes
        caps = self._caps
        if cap is not None:
            if queue.nbytes + held_bytes + nbytes > cap:
                raise QueueFull(f"tenant {tenant!r} max_queued_bytes={cap}")
        elif nbytes and caps.tenant_bytes.get(tenant, 0) + nbytes > caps.tenant_max_queued_bytes:
            raise QueueFull(f"tenant {tenant!r} {caps.tenant_default_cap()}")
        if caps.queued + count > caps.max_queued:
            raise QueueFull(f"global max_queued={caps.max_queued}")
        if caps.queued_bytes + nbytes > caps.max_queued_bytes:
            raise QueueFull(f"global max_queued_bytes={caps.max_queued_bytes}")

    def _add(
        self, req: QueuedRequest, queue: TenantQueue, now: float, *, counted: bool = False
    ) -> None:
        """Queue ``req`` in ``queue`` (its caps checked: ``_room``; ``counted``: in the
        process-wide caps already, by ``reserve``)."""
        tenant = req.tenant
        caps = self._caps
        seq = self._seq
        self._seq = seq + 1
        req.arrival = now
        req.seq = seq
        req.cost = self._cost.cost(req.rows, req.tokens)
        if self._learn_quantum:
            self._learn(req.cost, req.rows)
        req.state = _QUEUED
        handle: Handle = [req]
        req._handle = handle
        req._queue = queue

        if self._resumed_until is not None and now >= self._resumed_until:
            self._forget_resumed()
        was_idle = not queue.requests
        queue.add(req)
        if not counted:
            caps.add(tenant, req.nbytes)
        self._admitted += 1
        self._arrivals.push(handle)
        if req.deadline is not None:
            self._deadlines.push(req.deadline, seq, handle)
        if self._fair:
            queue.push(req, handle)
            if was_idle:
                queue.busy_since = now
                tier = queue.tier
                tier.active_weight += queue.weight
                tier.busy_tenants += 1
                if self._requests:
                    self._fairness.learn_request_cost(self._request_cost / self._requests)
                self._fairness.join(tier.fair_state, queue)
        elif was_idle:
            queue.busy_since = now

    def next_batch(self, now: float) -> list[QueuedRequest]:
        """The next batch to send, in dispatch order; [] only if nothing is queued.

        Requests whose deadline is ``<= now`` are never dispatched: they are expired
        first and handed back by the next ``expire()`` (``next_deadline()`` then says so).
        """
        if self._deadlines.live:
            self._expire_due(now, self._expired)
        return self._assembler.assemble(self._peek, self._take, now)

    def peek(self, now: float) -> QueuedRequest | None:
        """The request ``next_batch`` would send first, left queued (the selectors may
        grant or rotate as they would on the way to sending it: it stays the answer until
        it is sent); None if nothing is queued."""
        if self._deadlines.live:
            self._expire_due(now, self._expired)
        return self._peek()

    def next_where(self, now: float, ok: Callable[[QueuedRequest], bool]) -> list[QueuedRequest]:
        """The next request ``ok`` takes, alone: ``next_batch``'s first request where
        ``ok`` takes it; else the first head ``ok`` takes in the order the selectors
        would reach it (tiers highest first, each tier's tenants as its policy ranks
        them, ``FairnessPolicy.ranked``; a tenant's own head), taken out of turn and
        charged to its tenant as a charge-back is (``credit``: DRR's budget owes it,
        VTC's counter counts it). [] where no queued head is one ``ok`` takes: nothing
        is taken. With ``scheduling: fifo``, the first arrival or nothing.

        An engine's light slots (``core.engine``): a slot kept for a program that holds
        none goes to the fairest such request queued, not to whoever is next."""
        if self._deadlines.live:
            self._expire_due(now, self._expired)
        head = self._peek()
        if head is None:
            return []
        if ok(head):
            self._take(head, now)
            return [head]
        if not self._fair:
            return []
        for tier in self._tiers:
            if not tier.requests:
                continue
            for queue in self._fairness.ranked(tier.fair_state):
                req = queue.head()
                if req is not None and ok(req):
                    self._take_fair(req, now, picked=False)
                    return [req]
        return []

    def expire(self, now: float) -> list[QueuedRequest]:
        """Remove and return every request whose deadline is ``<= now``."""
        out = self._expired
        self._expired = []
        self._expire_due(now, out)
        return out

    def next_deadline(self) -> float | None:
        """When ``expire()`` next has something to return: the earliest queued deadline
        (or a past one if ``next_batch`` already expired requests), None if no deadline."""
        if self._expired:
            return self._expired[0].deadline
        return self._deadlines.earliest()

    def cancel(self, req: QueuedRequest, now: float) -> bool:
        """Remove a queued request; False if it is not queued here (already left, or
        another scheduler's). A cancelled request is never dispatched."""
        queue = req._queue
        if req.state is not _QUEUED or queue is None or self._queues.get(req.tenant) is not queue:
            return False
        self._finish(req, _CANCELLED, now)
        # After _finish: the emptied handle makes its entries tombstones to drop.
        self._arrivals.discard()
        if req.deadline is not None:
            self._deadlines.discard()
        self._cancelled += 1
        return True

    def cancel_all(self, now: float) -> list[QueuedRequest]:
        """Remove every queued request (shutdown, an outage given up on), oldest first.

        They leave as ``cancel`` leaves them: never dispatched, charged to nobody's budget.
        """
        out = self._arrivals.requests()
        for req in out:
            self.cancel(req, now)
        return out

    @property
    def quantum(self) -> float:
        """The DRR quantum now (configured, or the full batch learned so far); a policy
        that grants none: the configured one, or one cost unit."""
        quantum = self._fairness.quantum
        return float(quantum if quantum is not None else self.policy.quantum or 1.0)

    def _learn(self, cost: float, rows: int) -> None:
        """A full batch in the cost unit: mean cost per row (a moving mean over about the
        last thousand rows) times the batch's rows."""
        self._seen_rows += rows
        alpha = max(rows / self._seen_rows, min(1.0, rows / 1000))
        self._mean_row_cost += (cost / rows - self._mean_row_cost) * alpha
        if self._mean_row_cost > 0:
            self._fairness.learn_quantum(self._batch_rows * self._mean_row_cost)

    def charge_back(
        self, tenant: str, cost: float, program: str = "", now: float | None = None
    ) -> None:
        """A dispatched request of ``tenant`` cost ``cost`` more than it was charged (less,
        if negative): output tokens, as they stream. Fair mode only (fifo charges nobody),
        but the service the fairness window counts (``window``) takes it in both modes.
        Its ``program`` attains it too, where its tenant's queue still keeps that program.
        ``now``: when it is charged; a second begun since the latest dispatch begins here
        (its service at its start recorded, the programs' scale moved on), so the window
        counts the tokens in the second they came, not in the latest dispatch's (an
        engine's slots held by long streams: seconds apart). Without it, the latest
        dispatch's second."""
        if not cost:
            return
        if now is not None and now >= self._step_end:
            self._next_step(now)
        queue = self._queues.get(tenant)
        if queue is not None:
            queue.served += cost
        if not self._fair:
            return
        self._request_cost += cost
        if queue is not None:
            queue.charge_back(program, cost * self._scale)
            tier = queue.tier
        else:
            terms = self._tenants.get(tenant)
            if terms is None:
                return  # removed by a reload: nobody to correct
            tier = self._tier_of(tenant, terms)
        self._fairness.credit(tier.fair_state, tenant, cost)

    # ---- failover (``fair_frontend.scheduler.snapshot``) ---------------------------------

    def export_fairness(self) -> SchedulerFairness:
        """What this endpoint's fairness owes each tenant now, exactly (fifo: nothing)."""
        if not self._fair:
            return SchedulerFairness({})
        learned = self.quantum if self._learn_quantum and self._seen_rows else 0.0
        unscale = 1.0 / self._scale
        programs = {}
        for tenant, queue in self._queues.items():
            if queue.requests:  # backlogged: its programs' order matters at the resume
                services = queue.export_programs(unscale)
                if services:
                    programs[tenant] = services
        return SchedulerFairness(
            {tier.name: self._fairness.export(tier.fair_state) for tier in self._tiers},
            learned,
            self._mean_row_cost,
            self._seen_rows,
            programs,
            self._request_cost,
            self._requests,
        )

    def resume_fairness(self, saved: SchedulerFairness, now: float, keep_s: float) -> None:
        """Take over a failed leader's ``export_fairness`` (this scheduler has served
        nothing yet): its backlogged tenants get their state back as their calls, sent
        again by the shells, join within ``keep_s`` of ``now``; later, joins are plain."""
        if not self._fair:
            return
        for tier in self._tiers:
            state = saved.tiers.get(tier.name)
            if state is not None:
                self._fairness.resume(tier.fair_state, state)
        if self._learn_quantum and saved.seen_rows:
            self._mean_row_cost, self._seen_rows = saved.mean_row_cost, saved.seen_rows
            if saved.quantum > 0:
                self._fairness.learn_quantum(saved.quantum)
        if saved.requests > 0:
            self._request_cost, self._requests = saved.request_cost, saved.requests
        self._resumed_programs = dict(saved.programs)
        self._resumed_until = now + keep_s

    def _forget_resumed(self) -> None:
        self._resumed_until = None
        self._resumed_programs = {}
        for queue in self._queues.values():
            queue.forget_restored()
        for tier in self._tiers:
            self._fairness.resume(tier.fair_state, _NOTHING)

    # ---- views --------------------------------------------------------------------------

    @property
    def fairness(self) -> FairnessPolicy[Any]:
        """Selector 2: the endpoint's fairness policy (``EndpointPolicy.fairness``)."""
        return self._fairness

    def full(self, tenant: str, nbytes: int = 0) -> str | None:
        """The cap a new request of ``tenant`` with ``nbytes`` tensor bytes would hit now,
        if any: what ``enqueue`` would name in its ``QueueFull`` (for the shells' early
        shedding; ``nbytes`` 0: the count caps alone, before the request's size is known).
        A tenant with nothing queued here is judged by its terms as ``enqueue`` would read
        them; an unknown tenant by the process-wide caps alone."""
        caps = self._caps
        queue = self._queues.get(tenant)
        held_count, held_bytes = self._reserved.get(tenant, _NONE_HELD)
        if queue is not None and queue.requests:
            if queue.requests + held_count >= queue.max_queued:
                return f"tenant {tenant!r} max_queued={queue.max_queued}"
            own = queue.max_queued_bytes
            here = queue.nbytes + held_bytes
        else:
            terms = self._tenants.get(tenant)
            own = terms.max_queued_bytes if terms is not None else None
            here = held_bytes
        if nbytes:
            if own is not None:
                if here + nbytes > own:
                    return f"tenant {tenant!r} max_queued_bytes={own}"
            elif caps.tenant_bytes.get(tenant, 0) + nbytes > caps.tenant_max_queued_bytes:
                return f"tenant {tenant!r} {caps.tenant_default_cap()}"
        if caps.queued >= caps.max_queued:
            return f"global max_queued={caps.max_queued}"
        if caps.queued_bytes + nbytes > caps.max_queued_bytes:
            return f"global max_queued_bytes={caps.max_queued_bytes}"
        return None

    def byte_room(self, below: int) -> list[tuple[str, int, str]]:
        """Tenants with their own ``max_queued_bytes`` and less than ``below`` bytes of it
        left here: (tenant, bytes left, the cap as ``enqueue`` names it)."""
        out = []
        for tenant, queue in self._queues.items():
            cap = queue.max_queued_bytes
            if cap is not None and queue.requests and cap - queue.nbytes < below:
                cap_text = f"tenant {tenant!r} max_queued_bytes={cap}"
                out.append((tenant, cap - queue.nbytes, cap_text))
        return out

    def queued(self) -> list[QueuedRequest]:
        """Every queued request, oldest first (O(queued): for rare events, not per request)."""
        return self._arrivals.requests()

    # Totals add up the tiers (O(tiers)): one aggregate fewer to update per request.

    @property
    def queued_requests(self) -> int:
        return sum(tier.requests for tier in self._tiers)

    @property
    def queued_rows(self) -> int:
        return sum(tier.rows for tier in self._tiers)

    @property
    def queued_tokens(self) -> int:
        return sum(tier.tokens for tier in self._tiers)

    @property
    def queued_bytes(self) -> int:
        return sum(tier.nbytes for tier in self._tiers)

    @property
    def counters(self) -> Counters:
        return Counters(self._admitted, self._dispatched, self._expired_count, self._cancelled)

    def depth(self, tenant: str) -> int:
        """The tenant's queued requests on this endpoint."""
        queue = self._queues.get(tenant)
        return queue.requests if queue is not None else 0

    def depths(self) -> dict[str, int]:
        """Tenant -> queued requests, for tenants with queued work."""
        return {t: q.requests for t, q in self._queues.items() if q.requests}

    def tier_depths(self) -> dict[str, int]:
        """Tier -> queued requests (every tier of the policy)."""
        return {tier.name: tier.requests for tier in self._tiers}

    def deficits(self) -> dict[str, float]:
        """Tenant -> DRR budget, for tenants with queued work (empty in fifo mode)."""
        if not self._fair:
            return {}
        out: dict[str, float] = {}
        for tier in self._tiers:
            out.update(self._fairness.deficits(tier.fair_state))
        return out

    def window(self, now: float) -> WindowFairness:
        """What this endpoint served over the last ``WINDOW_S`` whole seconds before
        ``now``, and to which tenants backlogged through them
        (``fair_frontend.scheduler.window``). O(tenants ever queued here + seconds of
        the window): for a scrape, not per request."""
        end = window_end(now)
        start = end - WINDOW_S
        queues = self._queues
        current = {tenant: queue.served for tenant, queue in queues.items()}
        log = self._service_log
        at_end, at_start = log.at(end, current), log.at(start, current)
        served: dict[str, float] = {}
        backlogged: dict[str, dict[str, float]] = {}
        for tenant, queue in queues.items():
            cost = at_end.get(tenant, 0.0) - at_start.get(tenant, 0.0)
            if cost:
                served[tenant] = cost
            if queue.busy_since <= start and (queue.requests or queue.idle_since >= end):
                tier = backlogged.setdefault(queue.tier.name, {})
                tier[tenant] = cost / queue.weight
        return WindowFairness(start, end, served, backlogged)

    def oldest_arrival(self) -> float | None:
        """Arrival time of the longest-queued request, None if nothing is queued."""
        head = self._arrivals.head()
        return head.arrival if head is not None else None

    def backlog_ahead(
        self, tenant: str, priority: int, rows: int, tokens: int, program: str | None = None
    ) -> Backlog:
        """Work served before a new request of ``tenant`` at ``priority``, plus the request.

        For the throttle's predicted wait; O(tiers + priority levels), independent of the
        number of tenants and requests. In fair mode it adds up:

        - everything queued in higher tiers (strict order serves it first; the tier
          guard, if on, lets this tier in earlier, so this overestimates);
        - the tenant's own queued work at this priority level or a higher one (equal
          levels count as ahead, whatever their deadlines); where the request names its
          ``program`` and the tenant's queue keeps programs apart, what least attained
          service serves before it instead (``TenantQueue.ahead_in_programs``: its own
          program's work, and of each other program its service gap and alternation);
        - from the other tenants of its tier, what DRR serves them while the tenant's own
          work ahead, of cost ``c`` (including the new request), is served: each other
          active tenant j gets ``c * w_j / w``, plus what is left of its current grant,
          on average half a grant ``quantum * w_j / 2``: in all ``c * (W - w) / w`` plus
          half the others' grants ``G = quantum * (W - w)``, the latter scaled by
          ``min(1, others' queued cost / G)`` so that it fades as their queues run short.
          ``W`` is the tier's active weight with the tenant in it. Not capped at what the
          others have queued *now*: under sustained overload their later arrivals take
          that share too. It is converted to rows and tokens at the tier's queued mix
          (the others' own queues can be a request or two, too few to stand for what
          they will send). Measured in the throttle's overload simulation (one tier,
          2-8 tenants): capping at the others' queue let 7-40 % of admitted requests
          finish late; this estimate, <= 0.3 % at 2x overload, and no rejection at all
          at 0.5x and 0.9x load. Others that queued work of zero cost count in full;
        - the request itself.

        In fifo mode: everything queued, plus the request.
        """
        terms = self._tenants.get(tenant)
        if terms is None:
            raise Internal(f"scheduler: unknown tenant {tenant!r}")
        if not self._fair:
            return Backlog(self.queued_rows + rows, self.queued_tokens + tokens)
        queue = self._queues.get(tenant)
        if queue is not None and queue.requests:
            own = queue.ahead_of(priority, program, self._cost.cost(rows, tokens), self._scale)
            return self._backlog(queue.tier, queue.weight, own, queue, rows, tokens)
        return self._backlog(
            self._tier_of(tenant, terms), float(terms.weight), None, None, rows, tokens
        )

    def least_backlogs(
        self, tier: str, weight: float, tenants: int, limit: int = 1000
    ) -> list[tuple[Backlog, int]] | None:
        """What any request of a tenant of ``tier`` (by the directory) would find ahead of
        it at best: for each tenant that could send one, the ``backlog_ahead`` and
        ``own_ahead`` (the request included) of its most favourable request, one row and
        no tokens at the highest priority level (1). The throttle's verdict for the tier (the
        core publishes it to the shells) is the best of these.

        A lower bound for every request of the tier, tenant by tenant: a tenant's backlog
        grows with the request's rows, tokens (its cost) and priority level (more of its
        own work ahead), and nothing else of the request enters it. Tenants with work
        queued here count one by one (only their own work at level 1 is ahead of their
        best request, and their queue is not among the "others" their share is taken
        against: they can find less ahead than a tenant with nothing queued); every other
        tenant finds the same backlog but for its weight, the larger the less, so one entry with
        ``weight``, the tier's largest, stands for them all (whether or not such a tenant
        exists: an extra entry only lowers the bound). Fifo mode: one entry, the same for
        every tenant. None: more than ``limit`` tenants of the tier have work queued
        here (too many to go through; no verdict). O(tenants queued here)."""
        top = 1  # the highest level (a shell resolves 0, "the default", to a level >= 1)
        if not self._fair:
            return [(Backlog(self.queued_rows + 1, self.queued_tokens), 1)]
        level = self._tier_by_name.get(tier)
        if level is None:
            return []
        out: list[tuple[Backlog, int]] = []
        for name, queue in self._queues.items():
            if not queue.requests:
                continue
            terms = self._tenants.get(name)
            if terms is None or terms.tier != tier:
                continue  # removed by a reload (refused), or another tier's
            if len(out) > limit:
                return None
            ahead = queue.ahead_of(top)
            out.append((self._backlog(queue.tier, queue.weight, ahead, queue, 1, 0), ahead[1] + 1))
        if len(out) < tenants:
            out.append((self._backlog(level, float(weight), None, None, 1, 0), 1))
        return out

    def _backlog(
        self,
        tier: Tier,
        weight: float,
        own: tuple[float, int, int] | None,
        queue: TenantQueue | None,
        rows: int,
        tokens: int,
    ) -> Backlog:
        """``backlog_ahead`` in fair mode, for a tenant of ``tier`` and ``weight`` with
        ``own`` (cost, rows, tokens) of its work ahead of the request in ``queue`` (both
        None: nothing queued here)."""
        if queue is not None and own is not None:
            own_cost, own_rows, own_tokens = own
            all_cost, all_rows, all_tokens = queue.cost, queue.rows, queue.tokens
            active_weight = tier.active_weight
        else:
            own_cost, own_rows, own_tokens = 0.0, 0, 0
            all_cost, all_rows, all_tokens = 0.0, 0, 0
            active_weight = tier.active_weight + weight
        ahead_rows = own_rows + rows
        ahead_tokens = own_tokens + tokens
        for higher in self._tiers[: tier.index]:
            ahead_rows += higher.rows
            ahead_tokens += higher.tokens
        others_cost = tier.cost - all_cost
        others_rows = tier.rows - all_rows
        others_tokens = tier.tokens - all_tokens
        if others_rows > 0:
            if others_cost > 0:
                others_weight = active_weight - weight
                share = (own_cost + self._cost.cost(rows, tokens)) * others_weight / weight
                # What is left of the others' current grants: half a grant each on average
                # while they are backlogged, scaled down as their queues run short.
                grants = self.quantum * others_weight
                share += grants / 2 * min(1.0, others_cost / grants)
                # In rows and tokens at the tier's queued mix (the others' alone can be a
                # request or two, too few to stand for what they will send).
                ahead_rows += math.ceil(share * tier.rows / tier.cost)
                ahead_tokens += math.ceil(share * tier.tokens / tier.cost)
            else:
                ahead_rows += others_rows
                ahead_tokens += others_tokens
        return Backlog(ahead_rows, ahead_tokens)

    def own_ahead(
        self,
        tenant: str,
        priority: int,
        program: str | None = None,
        rows: int = 1,
        tokens: int = 0,
    ) -> int:
        """Rows of ``tenant``'s own queued here that go before a new request of it at
        ``priority`` (its levels at or above it; in fifo mode all of them), of ``rows``
        and ``tokens``, of ``program`` (``backlog_ahead``): the engine throttle's count
        of the tenant's own work ahead. O(priority levels), or O(programs queued)."""
        queue = self._queues.get(tenant)
        if queue is None or not queue.requests:
            return 0
        if not self._fair:
            return queue.rows
        return queue.ahead_of(priority, program, self._cost.cost(rows, tokens), self._scale)[1]

    def light_rivals(self, tenant: str) -> int | None:
        """The other tenants with work queued in ``tenant``'s tier or a higher one: the
        most heads an engine's light slots go to before a new request of ``tenant``
        that may take one (``EngineThrottle``; ``next_where`` gives each light slot to
        the fairest head that may). None in fifo mode (no request goes out of turn).
        O(tiers)."""
        terms = self._tenants.get(tenant)
        if terms is None or not self._fair:
            return None
        tier = self._tier_of(tenant, terms)
        queue = self._queues.get(tenant)
        own = 1 if queue is not None and queue.requests else 0
        return self._busy_through(tier) - own

    def tier_light_rivals(self, tier: str) -> int:
        """``light_rivals`` at its least for a tenant of ``tier``: one with work queued
        (the throttle's verdict for the tier, ``EndpointAdmission.verdict``)."""
        level = self._tier_by_name.get(tier)
        if level is None or not self._fair:
            return 0
        return max(0, self._busy_through(level) - 1)

    def program_queued(self, tenant: str, program: str) -> bool:
        """Whether ``tenant`` has requests of ``program`` queued here. O(1)."""
        queue = self._queues.get(tenant)
        return queue is not None and queue.program_queued(program)

    # ---- internals ----------------------------------------------------------------------

    def _busy_through(self, tier: Tier) -> int:
        """Tenants with work queued in ``tier`` and the tiers above it. O(tiers)."""
        return sum(t.busy_tenants for t in self._tiers[: tier.index + 1])

    def _tier_of(self, tenant: str, terms: TenantTerms) -> Tier:
        tier = self._tier_by_name.get(terms.tier)
        if tier is None:
            raise Internal(
                f"scheduler: tenant {tenant!r} has tier {terms.tier!r}, "
                f"not one of {list(self.policy.tiers)}"
            )
        return tier

    def _new_queue(self, tenant: str, terms: TenantTerms) -> TenantQueue:
        # Also replaces an empty queue whose tenant's terms changed (a config reload):
        # terms apply from the moment a tenant's queue is empty (TenantQueue docstring).
        old = self._queues.get(tenant)
        queue = TenantQueue(
            tenant,
            terms,
            self._tier_of(tenant, terms),
            self._ordering.key,
            default_max_queued=self._caps.default_max_queued(self.policy.slots),
            caps=self._caps,
        )
        if old is not None:  # the fairness window's record goes on
            queue.served, queue.busy_since, queue.idle_since = (
                old.served,
                old.busy_since,
                old.idle_since,
            )
        saved = self._resumed_programs.pop(tenant, None)
        if saved:
            queue.restore_programs(saved, self._scale)
        self._queues[tenant] = queue
        return queue

    def _peek_fair(self) -> QueuedRequest | None:
        """The request the selectors choose next (tier, then tenant, then its head).

        DRR may grant a quantum or rotate while looking, exactly as it would on the way
        to dispatching; the chosen request stays the answer until it is taken.
        """
        tier = self._tier_selector.choose(self._tier_state, self._tiers)
        if tier is None:
            return None
        queue = self._fairness.pick(tier.fair_state)
        if queue is None:
            raise AssertionError(f"tier {tier.name!r} has work but no tenant to pick")
        return queue.head()

    def _take_fair(self, req: QueuedRequest, now: float, picked: bool = True) -> None:
        """Dispatch the request ``_peek_fair`` just returned; or (``picked`` False) a
        tenant's head its policy did not pick (``next_where``), charged as a charge-back
        is (``credit``)."""
        queue = req._queue
        assert queue is not None
        if now >= self._step_end:
            self._next_step(now)
        queue.pop_head(req.cost * self._scale)
        queue.served += req.cost
        self._request_cost += req.cost
        self._requests += 1.0
        if self._requests >= _HALVE_REQUESTS:
            self._request_cost *= 0.5
            self._requests *= 0.5
        tier = queue.tier
        if picked:
            self._fairness.charge(tier.fair_state, queue, req.cost)
        else:
            self._fairness.credit(tier.fair_state, queue.tenant, req.cost)
        self._tier_selector.record(self._tier_state, tier, req.rows)
        self._finish(req, _DISPATCHED, now)
        self._arrivals.discard()
        if req.deadline is not None:
            self._deadlines.discard()
        self._dispatched += 1

    def _next_step(self, now: float) -> None:
        """The programs' scale for the step ``now`` is in (``PROGRAM_HALF_LIFE_S``)."""
        step = math.floor(now / _PROGRAM_STEP_S)
        base = self._base_step
        if base is None:
            base = self._base_step = step
        elif step - base >= _REBASE_HALF_LIVES * _STEPS_PER_HALF_LIFE:
            halvings = (step - base) // _STEPS_PER_HALF_LIFE
            for queue in self._queues.values():
                queue.rescale(0.5**halvings)
            base = self._base_step = base + halvings * _STEPS_PER_HALF_LIFE
        self._scale = 2.0 ** ((step - base) / _STEPS_PER_HALF_LIFE)
        self._step_end = (step + 1) * _PROGRAM_STEP_S
        # Nothing was dispatched since the step began: this is the service at its start.
        served = {tenant: queue.served for tenant, queue in self._queues.items()}
        self._service_log.record(step * _PROGRAM_STEP_S, served)

    def _take_fifo(self, req: QueuedRequest, now: float) -> None:
        """Dispatch the request at the head of the arrival queue."""
        if now >= self._step_end:
            self._next_step(now)
        queue = req._queue
        assert queue is not None
        queue.served += req.cost
        self._arrivals.pop_head()
        self._finish(req, _DISPATCHED, now)
        if req.deadline is not None:
            self._deadlines.discard()
        self._dispatched += 1

    def _expire_due(self, now: float, out: list[QueuedRequest]) -> None:
        deadlines = self._deadlines
        while (req := deadlines.pop_due(now)) is not None:
            self._finish(req, _EXPIRED, now)
            self._arrivals.discard()
            self._expired_count += 1
            out.append(req)

    def _finish(self, req: QueuedRequest, state: QueueState, now: float) -> None:
        """Account for a request leaving the queue; its index entries become tombstones."""
        handle = req._handle
        assert handle is not None
        handle[0] = None
        req._handle = None
        queue = req._queue
        assert queue is not None
        req._queue = None
        req.state = state
        req.left_at = now
        queue.remove(req)
        tier = queue.tier
        self._caps.remove(req.tenant, req.nbytes)
        if not queue.requests:
            queue.idle_since = now
            if self._fair:
                # A tenant whose queue empties leaves its tier's round (and its budget).
                tier.active_weight = tier.active_weight - queue.weight if tier.requests else 0.0
                tier.busy_tenants = tier.busy_tenants - 1 if tier.requests else 0
                self._fairness.leave(tier.fair_state, queue)


_NONE_HELD = (0, 0)
# Every this many dispatched requests, the cost and count behind the mean request cost
# are halved: the mean follows the last thousand or so.
_HALVE_REQUESTS = 1024.0
_NOTHING = TierFairness({})


def _check_new(req: QueuedRequest) -> None:
    """``req`` may be queued: new (never queued before) and well formed."""
    if req.state is not _NEW:
        raise ValueError(f"request is {req.state.value}, not new: enqueue it once")
    if req.rows < 1 or req.tokens < 0 or req.nbytes < 0 or req.priority < 1:
        raise ValueError(
            f"bad request: rows={req.rows} (>= 1), tokens={req.tokens} (>= 0), "
            f"nbytes={req.nbytes} (>= 0), priority={req.priority} (>= 1)"
        )
