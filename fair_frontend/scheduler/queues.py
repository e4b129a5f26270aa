"""Queues with exact aggregates and lazy removal.

Every index (a tenant's heap, the deadline heap, the arrival deque) holds a request's
``Handle``, never the request. Expiry and cancellation empty the handle (O(1)); the index
drops the tombstone when it reaches it, or rebuilds itself once tombstones outnumber live
entries (amortised O(1)). The aggregates (``Load``) are updated at once, so every count the
scheduler reports is exact while tombstones wait.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fair_frontend.scheduler.types import Handle, Load, QueuedRequest, TenantTerms

if TYPE_CHECKING:
    from fair_frontend.scheduler.caps import GlobalCaps
    from fair_frontend.scheduler.tiers import Tier

# Rebuild an index when it holds more than 2 * live + slack entries.
_COMPACT_SLACK = 64


class Program(Load):
    """One program's queued requests in a tenant queue of several (``TenantQueue``), and
    their load (the throttle's count of the work ahead: ``ahead_in_programs``)."""

    __slots__ = ("heap", "name", "service")

    def __init__(self, name: str, heap: list[tuple[Any, ...]], service: float):
        super().__init__()
        self.name = name
        self.heap = heap  # its requests' entries, in its ordering policy's order
        self.service = service  # attained, decayed (scaled: ``TenantQueue``)


class TenantQueue(Load):
    """One tenant's queued requests on one endpoint, in its ordering policy's order.

    Programs. A request may name its program (``QueuedRequest.program``: an agent's
    run, a chat session); the tenant's next request is then the head (in the ordering
    policy's order) of its program with the least attained service among those with
    queued work, ties to the program whose head goes first by that order. Service is
    what the scheduler charges a request at dispatch (the endpoint's cost unit) and
    charges back as its output streams (``charge_back``), decayed: ``Scheduler`` hands
    each charge already scaled by 2 ** (t / half-life) (``PROGRAM_HALF_LIFE_S``), which
    orders programs exactly as service halved every half-life would, without touching
    a program's count as time passes. A tenant that
    names one program (or none) keeps one heap, as before programs: the same order and
    costs, one float added per dispatch. The queue turns to one heap per program
    (``Program``) the first time a second program queues work, for its life (until its
    tenant's terms change). Programs keep their service while idle; at most
    ``GlobalCaps.programs_per_tenant`` of them are kept: a new program takes the place
    of the idle one with the least service, or, where every kept one has queued work,
    shares one overflow program with every further id (a flood of ids costs bounded
    memory). A program's id never leaves the scheduler (no metric names it).

    Also the tenant's load on the endpoint, in total and per priority level (for the
    throttle's estimate of the work ahead of a new request). ``tier``, ``weight`` and the
    caps are a snapshot of the tenant's terms taken when its queue was last empty (a
    config reload applies to a tenant once its queue drains): a tenant never changes tier
    or weight while it has queued work, which keeps the tier aggregates and the DRR
    active weight exact, and its hot path never reads the directory.
    """

    __slots__ = (
        "_busy",
        "_caps",
        "_chosen",
        "_heap",
        "_key",
        "_overflow",
        "_program_of",
        "_programs",
        "_restored",
        "_sole",
        "busy_since",
        "by_priority",
        "idle_since",
        "max_queued",
        "max_queued_bytes",
        "served",
        "service",
        "tenant",
        "terms",
        "tier",
        "weight",
    )

    def __init__(
        self,
        tenant: str,
        terms: TenantTerms,
        tier: Tier,
        key: Callable[[QueuedRequest], tuple[Any, ...]],
        *,
        default_max_queued: int,
        caps: GlobalCaps | None = None,
    ) -> None:
        super().__init__()
        self.tenant = tenant
        self.terms = terms
        self.tier = tier
        self.weight = float(terms.weight)
        self.max_queued = terms.max_queued if terms.max_queued is not None else default_max_queued
        # None: the process-wide default share applies (GlobalCaps.tenant_max_queued_bytes).
        self.max_queued_bytes = terms.max_queued_bytes
        self._key = key
        self._heap: list[tuple[Any, ...]] = []
        self.by_priority: dict[int, Load] = {}
        self._caps = caps  # its programs_per_tenant (None: 64, the default)
        # One program: its name, its heap (``_heap``) and its service (``service``);
        # _SEVERAL once the queue keeps several, which no program's name equals.
        self._sole: str | object = ""
        self.service = 0.0
        # Several: name -> program (at most the bound less one), the overflow program,
        # those with queued work, and the one whose head ``head`` chose (None: choose).
        self._programs: dict[str, Program] | None = None
        self._overflow: Program | None = None
        self._busy: dict[Program, None] = {}
        self._program_of: dict[int, Program] = {}  # a queued request's (by its seq)
        self._chosen: Program | None = None
        # A failed leader's service of this tenant's programs, scaled, given to each
        # program as it first queues here (``restore_programs``); None: nothing left.
        self._restored: dict[str, float] | None = None
        # For the fairness window (``fair_frontend.scheduler.window``): the cost served
        # (undecayed, charge-backs included), when the queue last turned from empty to
        # queued and when it last emptied (the scheduler keeps them).
        self.served = 0.0
        self.busy_since = math.inf
        self.idle_since = -math.inf

    def add(self, req: QueuedRequest) -> None:
        """Count a request in this queue's load, its priority level's and its tier's.

        One call for the three, written out: this runs on every enqueue.
        """
        rows = req.rows
        tokens = req.tokens
        nbytes = req.nbytes
        cost = req.cost
        self.requests += 1
        self.rows += rows
        self.tokens += tokens
        self.nbytes += nbytes
        self.cost += cost
        tier = self.tier
        tier.requests += 1
        tier.rows += rows
        tier.tokens += tokens
        tier.nbytes += nbytes
        tier.cost += cost
        level = self.by_priority.get(req.priority)
        if level is None:
            level = self.by_priority[req.priority] = Load()
        level.requests += 1
        level.rows += rows
        level.tokens += tokens
        level.cost += cost

    def remove(self, req: QueuedRequest) -> None:
        """Uncount a request from the three loads ``add`` counted it in."""
        rows = req.rows
        tokens = req.tokens
        nbytes = req.nbytes
        cost = req.cost
        self.requests -= 1
        self.rows -= rows
        self.tokens -= tokens
        self.nbytes -= nbytes
        # An empty load is reset to exactly 0.0: no float residue survives emptiness.
        self.cost = self.cost - cost if self.requests else 0.0
        tier = self.tier
        tier.requests -= 1
        tier.rows -= rows
        tier.tokens -= tokens
        tier.nbytes -= nbytes
        tier.cost = tier.cost - cost if tier.requests else 0.0
        level = self.by_priority[req.priority]
        level.requests -= 1
        if level.requests:
            level.rows -= rows
            level.tokens -= tokens
            level.cost -= cost
        else:
            del self.by_priority[req.priority]
        if self._programs is not None:
            program = self._program_of.pop(req.seq)
            program.requests -= 1
            program.rows -= rows
            program.tokens -= tokens
            program.nbytes -= nbytes
            program.cost = program.cost - cost if program.requests else 0.0
            if not program.requests:
                del self._busy[program]
            self._chosen = None

    def push(self, req: QueuedRequest, handle: Handle) -> None:
        """Index a request (its accounting is ``add``'s job)."""
        if req.program != self._sole:  # never equal once it keeps several (_SEVERAL)
            self._push_program(req, handle)
            return
        heap = self._heap
        if len(heap) > 2 * self.requests + _COMPACT_SLACK:
            heap[:] = [e for e in heap if e[-1][0] is not None]
            heapq.heapify(heap)
        heapq.heappush(heap, (*self._key(req), handle))

    def head(self) -> QueuedRequest | None:
        """The live request that goes first, or None; drops tombstones on the way."""
        if self._programs is not None:
            return self._head_program()
        heap = self._heap
        while heap:
            req: QueuedRequest | None = heap[0][-1][0]
            if req is not None:
                return req
            heapq.heappop(heap)
        return None

    def pop_head(self, service: float) -> None:
        """Remove the entry ``head()`` just returned; its program attained ``service``
        (its cost, scaled: the class docstring)."""
        if self._programs is None:
            heapq.heappop(self._heap)
            self.service += service
            return
        chosen = self._chosen
        assert chosen is not None, "pop_head follows head"
        heapq.heappop(chosen.heap)
        chosen.service += service
        self._chosen = None

    def charge_back(self, program: str, service: float) -> None:
        """``program`` attained ``service`` more (less, if negative) than it was charged
        at dispatch (scaled: the class docstring); nothing where this queue no longer
        keeps it apart (its place taken, or in the overflow)."""
        programs = self._programs
        if programs is None:
            if program == self._sole:
                self.service += service
            return
        kept = programs.get(program)
        if kept is not None:
            kept.service += service
            self._chosen = None

    def rescale(self, factor: float) -> None:
        """Multiply every program's service by ``factor`` (the scale's rebase, rare)."""
        self.service *= factor
        for program in self._named():
            program.service *= factor

    def export_programs(self, factor: float) -> dict[str, float]:
        """Each program's attained service times ``factor`` (the scale's inverse: its
        service now), those this queue keeps apart and has served; the overflow aside (no
        name is its own). Service still restorable (``restore_programs``) counts too."""
        out = {name: service * factor for name, service in (self._restored or {}).items()}
        if self._programs is None:
            if isinstance(self._sole, str) and self.service:
                out[self._sole] = self.service * factor
        else:
            for program in self._programs.values():
                if program.service:
                    out[program.name] = program.service * factor
        return out

    def restore_programs(self, services: dict[str, float], scale: float) -> None:
        """A failed leader's ``export_programs`` of this tenant (a fresh queue's): each
        program gets its service back, times ``scale`` (the scale now), as it first
        queues here; the unnamed one's at once (the one heap's, until another comes)."""
        restored = {name: service * scale for name, service in services.items() if service}
        self.service = restored.pop("", 0.0)
        self._restored = restored or None

    def forget_restored(self) -> None:
        """The resume is over: a program not back by now starts as a new one."""
        self._restored = None

    def _restored_service(self, name: str) -> float:
        restored = self._restored
        if restored is None:
            return 0.0
        service = restored.pop(name, 0.0)
        if not restored:
            self._restored = None
        return service

    def program_queued(self, name: str) -> bool:
        """Whether requests of program ``name`` are queued here (one past the bound of
        programs counts as queued where the overflow program holds any). O(1)."""
        programs = self._programs
        if programs is None:
            return bool(self.requests) and self._sole == name
        kept = programs.get(name)
        if kept is not None:
            return bool(kept.requests)
        return self._overflow is not None and bool(self._overflow.requests)

    @property
    def programs(self) -> int:
        """Programs this queue keeps apart (the overflow one included)."""
        if self._programs is None:
            return 1
        return len(self._programs) + (self._overflow is not None)

    def _named(self) -> list[Program]:
        if self._programs is None:
            return []
        overflow = [self._overflow] if self._overflow is not None else []
        return [*self._programs.values(), *overflow]

    def _push_program(self, req: QueuedRequest, handle: Handle) -> None:
        """``push`` for a request of another program than the one heap's, or into a
        queue of several programs."""
        programs = self._programs
        if programs is None:
            limit = self._limit()
            if limit < 2 or (self.requests == 1 and not self.service):
                # One program for all; or a fresh queue's first program, which it takes
                # for its one heap's (the unnamed program before it has no history).
                self._sole = req.program  # one program for all: the one heap
                if limit >= 2:  # its own service, where a resume carried one
                    self.service = self._restored_service(req.program)
                self.push(req, handle)
                return
            # Now two programs: the one heap becomes its program's.
            # (its load: the queue's, but for the request being pushed)
            sole = Program(str(self._sole), self._heap, self.service)
            sole.requests = self.requests - 1
            sole.rows = self.rows - req.rows
            sole.tokens = self.tokens - req.tokens
            sole.nbytes = self.nbytes - req.nbytes
            sole.cost = self.cost - req.cost if sole.requests else 0.0
            for entry in self._heap:
                queued = entry[-1][0]
                if queued is not None:
                    self._program_of[queued.seq] = sole
            programs = self._programs = {sole.name: sole}
            if sole.requests:
                self._busy[sole] = None
            self._heap = []
            self.service = 0.0
            self._sole = _SEVERAL
        program = programs.get(req.program)
        if program is None:
            program = self._new_program(programs, req.program)
        heap = program.heap
        if len(heap) > 2 * program.requests + _COMPACT_SLACK:
            heap[:] = [e for e in heap if e[-1][0] is not None]
            heapq.heapify(heap)
        heapq.heappush(heap, (*self._key(req), handle))
        self._program_of[req.seq] = program
        program.requests += 1
        program.rows += req.rows
        program.tokens += req.tokens
        program.nbytes += req.nbytes
        program.cost += req.cost
        if program.requests == 1:
            self._busy[program] = None
        self._chosen = None

    def _new_program(self, programs: dict[str, Program], name: str) -> Program:
        """A kept place for program ``name``, or the overflow program (the class
        docstring): at most the bound less one kept by name, and the overflow. O(programs
        kept), once per id the queue has not seen (or no longer keeps)."""
        limit = self._limit()
        while len(programs) >= limit - 1:
            idle = [p for p in programs.values() if not p.requests]
            if not idle:
                if self._overflow is None:
                    self._overflow = Program("", [], 0.0)
                return self._overflow
            del programs[min(idle, key=_service).name]
        program = programs[name] = Program(name, [], self._restored_service(name))
        return program

    def _head_program(self) -> QueuedRequest | None:
        """``head`` in a queue of several programs: the head of the busy program with
        the least service, ties to the one whose head goes first. O(busy programs)
        when something changed since the last answer, else O(1)."""
        chosen = self._chosen
        if chosen is None:
            best: tuple[Any, ...] = ()
            for program in self._busy:
                heap = program.heap
                while heap[0][-1][0] is None:  # a busy program has a live entry
                    heapq.heappop(heap)
                if (
                    chosen is None
                    or program.service < chosen.service
                    or (program.service == chosen.service and heap[0] < best)
                ):
                    chosen, best = program, heap[0]
            if chosen is None:
                return None
            self._chosen = chosen
        return chosen.heap[0][-1][0]

    def ahead_of(
        self, priority: int, program: str | None = None, cost: float = 0.0, scale: float = 1.0
    ) -> tuple[float, int, int]:
        """(cost, rows, tokens) queued that goes before a new request at ``priority``:
        its levels or higher (a lower or equal level).

        Equal levels count as ahead: a new request is behind them unless its deadline is
        earlier, and the throttle prefers to overestimate a wait. O(priority levels).

        ``program``: the request's program, where the queue keeps programs apart (or the
        request names another than its one): then ``ahead_in_programs`` (None: the whole
        queue, as for a tenant's calls judged together).
        """
        # (a bound of 1 keeps every program in the one heap: the whole queue is ahead)
        apart = self._programs is not None or program != self._sole
        if program is not None and apart and self._limit() >= 2:
            return self.ahead_in_programs(program, cost, scale)
        cost = 0.0
        rows = tokens = 0
        for level, load in self.by_priority.items():
            if level <= priority:
                cost += load.cost
                rows += load.rows
                tokens += load.tokens
        return cost, rows, tokens

    def ahead_in_programs(self, name: str, cost: float, scale: float) -> tuple[float, int, int]:
        """``ahead_of`` for a new request of program ``name`` costing ``cost``: its own
        program's queued work (all of it, every level: an overestimate), and from each
        other program with queued work what least attained service serves it first:
        the gap between the two programs' service (``scale``: the scale their services
        are kept in), then as much as the request's program sends meanwhile (the two
        alternate), at most what it has queued (a program of zero-cost work counts in
        full). A chat's call beside its own agent's fan-out finds one or two of the
        agent's calls ahead of it, not the fan-out. O(programs with queued work)."""
        others: list[tuple[float, Load]]
        if self._programs is None:  # one program (the one heap) and the request's new one
            others = [(self.service, self)] if self.requests else []
            mine = None
        else:
            busy = self._busy
            kept = self._programs.get(name)
            if kept is None and self._overflow is not None and not self._room():
                kept = self._overflow  # where a new id goes while every kept one is busy
            mine = kept if kept is not None and kept in busy else None
            others = [(p.service, p) for p in busy if p is not mine]
        if mine is not None:
            service = mine.service
            own_cost, own_rows, own_tokens = mine.cost, mine.rows, mine.tokens
        else:  # a program with nothing queued: its service kept, or carried, or none
            known = self._programs.get(name) if self._programs is not None else None
            service = known.service if known is not None else self._restored_peek(name)
            own_cost, own_rows, own_tokens = 0.0, 0, 0
        ahead_cost, ahead_rows, ahead_tokens = own_cost, own_rows, own_tokens
        sends = own_cost + cost
        for other_service, load in others:
            if load.cost <= 0:
                ahead_rows += load.rows
                ahead_tokens += load.tokens
                continue
            take = min(load.cost, max(0.0, (service - other_service) / scale + sends))
            if take > 0:
                ahead_cost += take
                ahead_rows += math.ceil(load.rows * take / load.cost)
                ahead_tokens += math.ceil(load.tokens * take / load.cost)
        return ahead_cost, ahead_rows, ahead_tokens

    def _limit(self) -> int:
        """Its programs_per_tenant (64, the default, without caps)."""
        return self._caps.programs_per_tenant if self._caps is not None else 64

    def _room(self) -> bool:
        """Whether a new program id would be kept apart (a place free, or an idle one to
        take), not sent to the overflow program."""
        programs = self._programs
        if programs is None or len(programs) < self._limit() - 1:
            return True
        return any(not p.requests for p in programs.values())

    def _restored_peek(self, name: str) -> float:
        """The service a failed leader's state carries for program ``name`` (0: none),
        left for it to take when it first queues (``_restored_service``)."""
        restored = self._restored
        return restored.get(name, 0.0) if restored else 0.0


_SEVERAL = object()


def _service(program: Program) -> float:
    return program.service


class ArrivalQueue:
    """Queued requests in arrival order: the fifo mode's queue and ``oldest_arrival``."""

    __slots__ = ("_entries", "live")

    def __init__(self) -> None:
        self._entries: deque[Handle] = deque()
        self.live = 0

    def push(self, handle: Handle) -> None:
        entries = self._entries
        if len(entries) > 2 * self.live + _COMPACT_SLACK:
            self._entries = entries = deque(h for h in entries if h[0] is not None)
        entries.append(handle)
        self.live += 1

    def discard(self) -> None:
        """One live entry was emptied elsewhere; drop the tombstones now at the front.

        In the common case requests leave roughly in arrival order, so this keeps the
        deque near its live size without waiting for a rebuild.
        """
        self.live -= 1
        entries = self._entries
        while entries and entries[0][0] is None:
            entries.popleft()

    def head(self) -> QueuedRequest | None:
        entries = self._entries
        while entries:
            req = entries[0][0]
            if req is not None:
                return req
            entries.popleft()
        return None

    def pop_head(self) -> None:
        """Remove the entry ``head()`` just returned (the caller empties its handle)."""
        self._entries.popleft()
        self.live -= 1

    def requests(self) -> list[QueuedRequest]:
        """Every live request, oldest first."""
        return [req for handle in self._entries if (req := handle[0]) is not None]


class DeadlineQueue:
    """Queued requests that have a deadline, earliest first (ties: arrival).

    Two sorted structures: a deque for the entries pushed in non-decreasing deadline
    order (the common case: one timeout for everyone, so a deadline is ``now + timeout``
    and ``now`` never goes back), where push, pop and tombstone drops are O(1); and a
    heap, O(log d), for the entries that arrive out of that order. The earliest live
    deadline is at the front of one of the two.
    """

    __slots__ = ("_heap", "_run", "live")

    def __init__(self) -> None:
        self._run: deque[tuple[float, int, Handle]] = deque()  # sorted by (deadline, seq)
        self._heap: list[tuple[float, int, Handle]] = []
        self.live = 0

    def push(self, deadline: float, seq: int, handle: Handle) -> None:
        run = self._run
        heap = self._heap
        if len(run) + len(heap) > 2 * self.live + _COMPACT_SLACK:
            self._run = run = deque(e for e in run if e[2][0] is not None)  # stays sorted
            heap[:] = [e for e in heap if e[2][0] is not None]
            heapq.heapify(heap)
        if not run or deadline >= run[-1][0]:
            run.append((deadline, seq, handle))  # seq grows: (deadline, seq) stays sorted
        else:
            heapq.heappush(heap, (deadline, seq, handle))
        self.live += 1

    def _drop_tombstones(self) -> None:
        run = self._run
        while run and run[0][2][0] is None:
            run.popleft()
        heap = self._heap
        while heap and heap[0][2][0] is None:
            heapq.heappop(heap)

    def discard(self) -> None:
        """One live entry was emptied elsewhere; drop the tombstones now at the fronts.

        Requests mostly leave (by dispatch) in about arrival order, which with one
        timeout is deadline order: this keeps both structures near their live size.
        """
        self.live -= 1
        self._drop_tombstones()

    def _front(self) -> tuple[float, int, Handle] | None:
        """The earliest live entry (after dropping tombstones), or None."""
        self._drop_tombstones()
        run = self._run
        heap = self._heap
        if not run:
            return heap[0] if heap else None
        if not heap:
            return run[0]
        return run[0] if run[0][:2] <= heap[0][:2] else heap[0]

    def earliest(self) -> float | None:
        front = self._front()
        return front[0] if front is not None else None

    def pop_due(self, now: float) -> QueuedRequest | None:
        """Remove and return the earliest live request with ``deadline <= now``, else None.

        The caller empties its handle and calls no ``discard`` for it.
        """
        front = self._front()
        if front is None or front[0] > now:
            return None
        if self._run and self._run[0] is front:
            self._run.popleft()
        else:
            heapq.heappop(self._heap)
        self.live -= 1
        return front[2][0]
