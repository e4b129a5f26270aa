"""One model's dispatch, in any mode: queue, slots, answers, expiry.

The scheduler core is pure and synchronous; this module owns the timers (through one
injected ``Clock``), the tasks that talk to Triton and the bound on what is in flight.
``Dispatcher`` is what every model runs; its mode is one of three subclasses, named by
the endpoint's plan (``EndpointPlan.mode``) and built by ``Core._runtime``:

* ``batches.BatchDispatcher``: batches of rows are assembled here, at most
  ``max_inflight_batches`` (one per model instance) in Triton at once;
* ``granted.GrantedDispatcher`` (a unary endpoint with ``unary: one_hop``, the default):
  batch mode whose batches the shells that hold their rows send to Triton, one hop;
* ``engine.EngineDispatcher`` (``max_inflight``): a model that batches inside itself
  (continuous batching) gets each request alone, at most ``max_inflight`` at once.

Each mode's own invariants are in its module. Those of both:

* every request submitted here is answered exactly once (``CoreRequest.answered``): a
  result, or an error (expired, Triton's error, unavailable, shutdown); a request whose
  client went away is not answered, and its outcome is ``CANCELLED``;
* at most ``max_inflight`` batches (in engine mode, requests) of this model are in
  Triton at once, so requests wait here, where fairness is decided, not in Triton's
  queue, and each batch is assembled at the moment a slot frees up: a request that
  arrives while Triton is busy can still make the very next batch;
* work-conserving: whenever a slot is free and anything is queued, a batch goes out
  (unless the mode asks to wait: ``max_queue_delay_ms`` for a fuller batch, a tenant at
  its share of an engine's slots);
* Triton's answer that a model (version) is not ready fails the batch that asked for it,
  nothing else: only a failure to reach Triton at all (no connection, a connection
  lost; in batch mode, a batch not answered in time) marks the backend down. A
  request's own length never does: a stream's limit is time without progress
  (``watchdog.NoProgress``, this request's failure alone);
* while Triton is unreachable nothing is sent: a batch that never reached it is held
  (with its slot) and goes first when it is back; deadlines still expire, on time, and
  after ``max_outage_s`` everything waiting is answered UNAVAILABLE; so is everything
  held or still in Triton when a shutdown's drain ends (``drain``);
* a decoupled model's request (in any mode) takes one hop: when its turn comes its
  slot is granted to the shell that holds its client (``records.Grant``), which sends it
  to Triton and relays the responses itself, reporting the output tokens they carry
  (``produced``: charged to its tenant's counter as they come, one loop iteration late at
  most over a socket) and, once, how it ended (``ended``); the slot is held until then,
  or until the shell is gone (``drop``). A shutdown that stops waiting takes the slot
  back (an ``Answer`` with the reason, which ends the stream in the shell);
* a stream whose Triton is gone before anything of it reached its client (its shell
  could not reach that Triton, or lost it before the first response: an ``Unavailable``
  with ``never_sent``) is a batch that never reached Triton: that backend is marked
  down and the request is held, with its slot, for the next backend with a free one
  (granted again, ahead of the queue); its shell waits for that grant, or for the
  answer (its deadline, ``max_outage_s``, a shutdown). A stream that had sent its client
  anything fails with its Triton: it cannot be replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fair_frontend.admission.slo import SloClass
from fair_frontend.backends.protocol import Forwarder
from fair_frontend.batching import Packed, batch_key, pack, unpack
from fair_frontend.config import CostUnit
from fair_frontend.core.clock import Clock, Timer
from fair_frontend.core.pool import BackendPool
from fair_frontend.core.sequences import Pins
from fair_frontend.core.silence import SilentGrants
from fair_frontend.endpoint import EndpointPlan
from fair_frontend.errors import (
    SHUTTING_DOWN,
    DeadlineExceeded,
    FrontendError,
    Internal,
    ModelUnavailable,
    TimeoutExpired,
    Unavailable,
)
from fair_frontend.observability.observe import BatchReport
from fair_frontend.observability.tracing import carried, failed, wall_ns
from fair_frontend.outcomes import Outcome
from fair_frontend.parts import Registry
from fair_frontend.protocol import (
    InferRequest,
    ParamValue,
    Tensor,
)
from fair_frontend.quota import Quota
from fair_frontend.scheduler import QueuedRequest, QueueState, Scheduler
from fair_frontend.tokens import output_tokens
from fair_frontend.wire.records import Answer, Call, Fault, Grant, RowsDone

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

    from fair_frontend.core.admission import EndpointAdmission
    from fair_frontend.feedback import ServiceModel
    from fair_frontend.observability.tracing import Traces

log = logging.getLogger(__name__)

# Parts of admitted calls queued per loop iteration (``Dispatcher.submit_all``): a call of
# 10,000 parts holds the core's loop for a slice at a time (about 2 ms here).
PARTS_PER_SLICE = 256


class Route(Protocol):
    """Where do the answers to a call go? (a shell: in this process or over a socket)"""

    def answer(self, answer: Answer | Grant) -> None: ...


@dataclass(eq=False, slots=True, kw_only=True)
class CoreRequest(QueuedRequest):
    """One request in the core, from admission to its answer.

    The scheduler's entry (the fields it reads), the shell's ``Call`` and the ``Route``
    its answer takes: created once at admission, carried through queue, batch and
    answer. Also what ``batching.pack`` reads of each request (``request``, ``lengths``,
    ``deadline_us``).
    """

    call: Call
    route: Route
    dispatched_at: float | None = None  # when its batch went to Triton (the clock's time)
    cancelled: bool = False  # its client went away while it was in a batch
    answered: bool = False
    produced: int = 0  # output tokens counted so far (Endpoint.token_output)
    # Accounting.wall() when its tokens were counted in its limits (None again once corrected)
    limits_at: float | None = None
    # Granted: set when its shell says it ended (served or not; None: it never reached
    # its Triton, and waits for another grant).
    ended: asyncio.Future[bool | None] | None = None
    backend: int = -1  # the pool's backend its batch (or stream) went to last
    adopted: bool = False  # a stream another core granted (``Dispatcher.adopt``)
    quota: Quota | None = None  # its tenant's rate-limit state after its check: answered
    batch_trace: SpanContext | None = None  # its batch's span, where traced (``tracing``)
    # Its model's dispatcher, from the moment the core has one for it (at admission, or
    # once a model looked up later is set up): what it is told of goes there, not to a
    # dispatcher looked up again by the model's name.
    runtime: Dispatcher | None = None
    # Its SLO class (``admission.slo``; None: none), resolved at admission; for an
    # interactive one, the time to first token the throttle predicted; whether its
    # attainment was counted (once: at its first token, or at its end).
    slo: SloClass | None = None
    predicted_ttft_s: float | None = None
    slo_counted: bool = False

    @property
    def request(self) -> InferRequest:
        return self.call.request

    @property
    def lengths(self) -> list[int] | None:
        return self.call.lengths

    @property
    def deadline_us(self) -> int:
        """The deadline as unix microseconds, for the model (0: none)."""
        return self.call.deadline_us

    @property
    def queued_s(self) -> float:
        return -1.0 if self.dispatched_at is None else self.dispatched_at - self.arrival


class Backend:
    """Is Triton reachable? Batches are held (not failed) while it is not.

    A batch that fails with UNAVAILABLE marks the backend down; from then on queued
    requests stay queued (their deadlines still expire) and a probe asks Triton whether
    it is ready every ``probe_interval_s`` until it answers yes; then dispatch resumes.
    After ``max_outage_s`` the outage is given up on: what waits is answered UNAVAILABLE,
    and so are new requests until Triton is back.
    """

    def __init__(
        self,
        clock: Clock,
        probe: Callable[[], Awaitable[bool]] | None = None,
        probe_interval_s: float = 0.1,
        max_outage_s: float = 60.0,
        name: str = "",
    ) -> None:
        self.clock = clock
        self.name = name  # its address, in a pool's log lines and metrics
        self.available = True
        self.listeners: list[Callable[[], None]] = []  # called when Triton is back
        self.down_listeners: list[Callable[[], None]] = []  # ... when it goes down
        self.give_up_listeners: list[Callable[[], None]] = []  # ... when the outage is too long
        self.probe = probe
        self.probe_interval_s = probe_interval_s
        self.max_outage_s = max_outage_s
        self.down_since: float | None = None
        self.gave_up = False
        self._timer: Timer | None = None
        self._probing: asyncio.Task[None] | None = None
        self.closed = False

    def mark_down(self) -> None:
        if self.available:
            log.warning(
                "Triton%s unavailable: holding queued requests until it is back",
                f" {self.name}" if self.name else "",
            )
            self.down_since = self.clock.now()
            self.available = False
            for down in self.down_listeners:
                down()
        if self.probe is not None and self._timer is None and self._probing is None:
            self._timer = self.clock.call_at(self.clock.now() + self.probe_interval_s, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self.available or self.closed:
            return
        if not self.gave_up and self.outage_s > self.max_outage_s:
            log.error(
                "Triton unavailable for %.0f s: answering waiting requests UNAVAILABLE",
                self.outage_s,
            )
            self.gave_up = True
            for give_up in self.give_up_listeners:
                give_up()
        self._probing = asyncio.get_running_loop().create_task(self._probe_once())

    async def _probe_once(self) -> None:
        assert self.probe is not None
        try:
            ready = await self.probe()
        except Exception:  # a probe that errs is a "not yet"
            log.debug("Triton readiness probe failed", exc_info=True)
            ready = False
        finally:
            self._probing = None
        if ready:
            self.mark_up()
        else:
            self.mark_down()  # the next probe

    @property
    def outage_s(self) -> float:
        if self.available or self.down_since is None:
            return 0.0
        return self.clock.now() - self.down_since

    def mark_up(self) -> None:
        if not self.available:
            log.info(
                "Triton%s available again: resuming dispatch", f" {self.name}" if self.name else ""
            )
            self.available = True
            self.down_since = None
            self.gave_up = False
            for kick in self.listeners:
                kick()

    async def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._probing is not None:
            self._probing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probing


Done = Callable[[CoreRequest, Outcome, "FrontendError | None", str], None]
"""(request, outcome, the error it was answered with, model version): once per request."""
Tokens = Callable[[CoreRequest, int], None]
"""(request, output tokens it just produced): as a stream's responses arrive, or once."""
Served = Callable[[Sequence[CoreRequest], str], None]
"""(requests, model version): ``Done`` of each, served, at one moment (a batch part)."""


class Dispatcher(ABC):
    """Feeds one model's work to Triton, at most ``max_inflight`` at a time (its slots).

    What both modes share: the queue's side (``submit``, ``cancel``), the dispatch loop
    (``kick``: send while a slot is free, then arm the one timer), deadlines, the call to
    Triton and its answers, grants, outages and shutdown. What a mode decides, it is
    asked: whether one more may go now (``_may_send``),
    whether to wait for a fuller batch (``_hold_until``), what a call not answered in time
    says of Triton (``_timed_out``) and what a model error fails (``_model_error``).
    """

    traces: Traces | None = None  # request traces, where configured (set by the core)
    # Whether its shells send it a unary call's facts and keep the tensors (one hop:
    # ``granted``), where the others take whole calls.
    takes_facts: bool = False

    def __init__(
        self,
        *,
        plan: EndpointPlan,
        scheduler: Scheduler,
        forwarder: Forwarder | None = None,
        backend: Backend | None = None,
        pool: BackendPool | None = None,
        clock: Clock,
        admission: EndpointAdmission | None = None,
        on_batches: Callable[[list[BatchReport]], None] = lambda reports: None,
        on_done: Done = lambda req, outcome, err, version: None,
        on_tokens: Tokens = lambda req, n: None,
        on_served: Served | None = None,
        silent_after_s: float | None = None,
    ) -> None:
        self.plan = plan  # what the endpoint is: mode, slots, rows (``fair_frontend.endpoint``)
        self.model = plan.model
        self.info = info = plan.info
        self.endpoint = plan.endpoint
        self.scheduler = scheduler
        if pool is None:  # one Triton: the pool of one
            if forwarder is None or backend is None:
                raise ValueError("a dispatcher needs a pool, or a forwarder and its backend")
            pool = BackendPool([backend], [forwarder])
        self.pool = pool
        self.forwarder = pool.forwarders[0]  # the first Triton's (one: the only one)
        self.backend = pool.backends[0]
        self.clock = clock
        self.admission = admission
        self.on_batches = on_batches
        self._reports: list[BatchReport] = []  # batches ended this loop turn, not told yet
        self.on_done = on_done
        self.on_tokens = on_tokens
        self.on_served = on_served or self._each_done
        self._max_inflight = plan.slots
        self._token_output = plan.token_output
        self.inflight = 0  # batches in Triton (or held for it)
        self.running = [0] * len(pool)  # batches in each backend of the pool (not held)
        self._where: dict[asyncio.Task[None], int] = {}  # each batch's backend
        # A stateful model's open sequences in a pool of more than one: the backend that
        # holds each one's state.
        self.pins: Pins | None = None
        if info.sequence_batching and len(pool) > 1:
            self.pins = Pins(info.sequence_idle_s, len(pool))
        self.batches_sent = 0
        self._timer: Timer | None = None
        self._timer_at: float | None = None
        self._held: list[list[CoreRequest]] = []  # batches that never reached Triton
        # Parts of admitted calls, their room held, waiting for their slice (``submit_all``).
        self._incoming: deque[CoreRequest] = deque()
        self._slicing = False
        # Queued within a tick (``submit(later=True)``), decided at its end (``settle``):
        # whether anything was, and the earliest deadline of it.
        self._unsettled = False
        self._unsettled_deadline: float | None = None
        self._tasks: dict[asyncio.Task[None], list[CoreRequest]] = {}
        # Each tenant's requests in the batches of ``_tasks`` (kept by ``_launch`` and
        # ``_forget``, the only two that change ``_tasks``): an engine's cap per tenant
        # reads it per slot it fills, not a scan of every slot.
        self._in_tasks: dict[str, int] = {}
        # Set when a shutdown's drain ran out of time: the batches it cancels are
        # answered with it (not dropped as a client's cancellation).
        self._abandoned: FrontendError | None = None
        # Tasks of ``_tasks`` stopped (``_stop``) before their first step: each stops at
        # its first (``_run``), where its answers and its slot are seen to.
        self._stopping: set[asyncio.Task[None]] = set()
        # A decoupled model's granted streams whose shell went silent for
        # ``silent_after_s``: taken back (``core.silence``).
        self._silence: SilentGrants | None = None
        if info.decoupled and silent_after_s:
            self._silence = SilentGrants(
                clock, silent_after_s, self._streams_granted, self._take_back
            )
        self._start()
        for member in pool.backends:
            member.listeners.append(self.kick)  # one is back: its slots are free
        pool.give_up_listeners.append(self.give_up)
        if len(pool) > 1:
            # One went down: what must go to it alone (a pinned sequence) fails now.
            pool.down_listeners.append(self.kick)

    @property
    def service(self) -> ServiceModel | None:
        """What batches cost (the feedback loop's estimates), if the endpoint learns it."""
        return self.admission.service if self.admission is not None else None

    @property
    def max_inflight(self) -> int:
        return self._max_inflight

    # ---- what a mode decides ------------------------------------------------------------

    @abstractmethod
    def _start(self) -> None:
        """Set up the mode's own state (by ``__init__``, once its slots are known: the
        plan's, ``max_inflight``)."""

    @abstractmethod
    def _may_send(self, now: float) -> int | None:
        """Which backend may one more batch go to now? (None: none may; the pool's
        ``choose``, and what the mode adds)"""

    def _hold_until(self, now: float) -> float | None:
        """Until when should the next batch wait to be fuller? (None: send it now)"""
        return None

    @abstractmethod
    def _arm_lead(self) -> None:
        """Arm the timer of a send before a slot frees up, if the mode sends early."""

    @abstractmethod
    def _timed_out(self, backend: int) -> None:
        """A call to ``backend`` was not answered in time (its requests fail): what does
        that say of that Triton?"""

    async def _model_error(
        self, batch: list[CoreRequest], err: FrontendError, backend: int
    ) -> tuple[bool, bool]:
        """A call failed with the model's error: whom does it fail? (Here: each of its
        requests.) Returns ``_send``'s (succeeded, held)."""
        for r in batch:
            self._fail(r, err)
        return False, False

    @abstractmethod
    def _tokens_charged(self) -> None:
        """A stream's tokens were just charged to its tenant: does a slot wait on that?"""

    # ---- what the core asks of any mode -------------------------------------------------

    def in_engine(self, tenant: str) -> int:
        """``tenant``'s requests holding one of an engine's slots (its throttle weighs
        them); 0 where a model's slots hold batches, not a tenant's requests."""
        return 0

    def scheduled_tokens(self, call: Call) -> int:
        """The tokens the scheduler charges ``call`` at dispatch: its input and the output
        it asks for (a token-cost endpoint corrects the output as it comes:
        ``output_cost``)."""
        return call.tokens

    def output_cost(self, req: CoreRequest, tokens: int) -> float:
        """What ``tokens`` output tokens of ``req``, as they come, add to its tenant's
        fair share (token cost): at its first count, the difference to the output it
        asked for (charged at dispatch: ``scheduled_tokens``); after it, all of them."""
        if req.produced == tokens:
            return float(tokens - req.call.max_tokens)
        return float(tokens)

    def rows_done(self, route: Route, done: RowsDone) -> None:
        """A shell's report on rows of a batch granted to it (``granted``); a mode that
        grants no rows has none to hear of."""
        return

    # ---- the request side ---------------------------------------------------------------

    def submit(self, req: CoreRequest, *, later: bool = False) -> None:
        """Queue a request (raises ``QueueFull`` before anything is queued); its answers go
        to ``req.route``. ``later``: one of a tick's (``Core.tick``): whether a batch goes
        (or a slot is granted), and the timers, are decided once at the tick's end
        (``settle``), from everything it queued, not at each request."""
        now = self.clock.now()
        self.scheduler.enqueue(req, now)
        if not later:
            self._queued(now, req.deadline)
            return
        deadline = req.deadline
        if not self._unsettled:
            self._unsettled = True
            self._unsettled_deadline = deadline
        elif deadline is not None and (
            self._unsettled_deadline is None or deadline < self._unsettled_deadline
        ):
            self._unsettled_deadline = deadline

    def settle(self) -> None:
        """The end of a tick: what its requests queued goes (``_queued``) as one."""
        if not self._unsettled:
            return
        self._unsettled = False
        deadline, self._unsettled_deadline = self._unsettled_deadline, None
        self._queued(self.clock.now(), deadline)

    def submit_all(self, reqs: Sequence[CoreRequest]) -> None:
        """Queue the parts of one call, all or none: their room in the queue caps is held
        at once (raises ``QueueFull`` before any is: ``Scheduler.reserve``), and they are
        queued ``PARTS_PER_SLICE`` per loop iteration (a call of 10,000 parts does not
        hold the loop), oldest call first; each one's answers go to its ``route``. A part
        whose client goes away before its turn ends there. Its batch key is taken then
        too (``batching.batch_key``: the costly part of making a request)."""
        self.scheduler.reserve(reqs)
        self._incoming.extend(reqs)
        if not self._slicing:
            self._slice()

    def _slice(self) -> None:
        """Queue the next ``PARTS_PER_SLICE`` parts that wait; the rest at the next loop
        iteration."""
        self._slicing = False
        now = self.clock.now()
        incoming = self._incoming
        deadline: float | None = None
        queued = False
        for _ in range(min(PARTS_PER_SLICE, len(incoming))):
            req = incoming.popleft()
            if req.cancelled:
                self.scheduler.release(req)
                self._done(req, Outcome.CANCELLED, None, "")
                continue
            if req.shape_key is None:
                req.shape_key = batch_key(req.request, self.plan)
            self.scheduler.enqueue_reserved((req,), now)
            queued = True
            if req.deadline is not None and (deadline is None or req.deadline < deadline):
                deadline = req.deadline
        if incoming:
            self._slicing = True
            asyncio.get_running_loop().call_soon(self._slice)
        if queued:
            self._queued(now, deadline)

    def _release_incoming(self, keep: Callable[[CoreRequest], bool]) -> list[CoreRequest]:
        """Take the parts waiting for their slice that ``keep`` does not keep out of the
        waiting line, their room given back; returns them."""
        gone = [r for r in self._incoming if not keep(r)]
        if gone:
            self._incoming = deque(r for r in self._incoming if keep(r))
            for req in gone:
                self.scheduler.release(req)
        return gone

    def _queued(self, now: float, deadline: float | None) -> None:
        """Work was queued (with ``deadline``, its earliest): send, or arm the timers."""
        if self.pool.available and self._may_send(now) is not None:
            self.kick()
            return
        # No batch can go now (the hot path under load): only its timers may change.
        self._arm_lead()
        if deadline is not None:
            self._arm(deadline)

    def cancel(self, req: CoreRequest) -> None:
        """The client went away. Still queued: it leaves and is never sent. In a batch: the
        batch still serves its neighbours and this answer is dropped; a decoupled
        request's stream is closed, which cancels it in Triton too."""
        if req.answered:
            return
        if self.scheduler.cancel(req, self.clock.now()):
            self._done(req, Outcome.CANCELLED, None, "")
            self.kick()
            return
        req.cancelled = True
        for task, batch in self._tasks.items():
            if self.info.decoupled and batch[0] is req:
                self._stop(task)
        for batch in self._held:
            if req in batch:
                batch.remove(req)
                self._done(req, Outcome.CANCELLED, None, "")

    # ---- the dispatch side --------------------------------------------------------------

    def kick(self) -> None:
        """Send batches while a slot is free and work is queued; re-arm the timer."""
        now = self.clock.now()
        self._expire(now)
        if self.pins is not None:
            self._drop_orphans(now)
        while self.pool.available:
            backend = self._may_send(now)
            if backend is None:
                break
            if self._held:
                batch = self._held.pop(0)
                self.inflight -= 1  # its slot was kept: _launch takes it again
            else:
                hold = self._hold_until(now)
                if hold is not None:
                    self._arm(hold)
                    break
                batch = self._next(now)
            if not batch:
                break
            self._launch(batch, now, backend)
        if self.scheduler.queued_requests:
            self._arm_lead()
        due = self._next_deadline()
        if due is not None:
            self._arm(due)

    def _next(self, now: float) -> list[CoreRequest]:
        """The next batch, in the scheduler's order (a mode may choose among the queued)."""
        return self.scheduler.next_batch(now)  # type: ignore[return-value]

    def _launch(self, batch: list[CoreRequest], now: float, backend: int) -> asyncio.Task[None]:
        self.inflight += 1
        self.running[backend] += 1
        self.batches_sent += 1
        self.pool.took(backend)
        if self.pins is not None:
            self.pins.pin(_sequences(batch), backend, now)
        task = asyncio.get_running_loop().create_task(self._run(batch, backend))
        self._tasks[task] = batch
        in_tasks = self._in_tasks
        for r in batch:
            in_tasks[r.tenant] = in_tasks.get(r.tenant, 0) + 1
        self._where[task] = backend
        task.add_done_callback(self._forget)
        return task

    def _stop(self, task: asyncio.Task[None]) -> None:
        """Cancel the batch of ``task`` (one of ``_tasks``). A task cancelled before its
        first step never runs its coroutine: ``_run`` would not answer its requests nor
        give its slot back, and a granted stream's slot would stay taken for ever (the
        slot a client that went away between its call's grant and the grant's send held:
        under load, every slot in time). Such a task runs, and stops at its start."""
        coro = task.get_coro()
        if isinstance(coro, Coroutine) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            self._stopping.add(task)
        else:
            task.cancel()

    def _forget(self, task: asyncio.Task[None]) -> None:
        batch = self._tasks.pop(task, None)
        self._where.pop(task, None)
        if batch is not None:  # (called twice per task: by its end, and its callback)
            in_tasks = self._in_tasks
            for r in batch:
                left = in_tasks[r.tenant] - 1
                if left:
                    in_tasks[r.tenant] = left
                else:
                    del in_tasks[r.tenant]

    # ---- sequences in a pool: each stays on the backend that holds its state -----------

    def _pinned(self, now: float) -> int | None:
        """The backend the next batch must go to (its sequence's), if it must."""
        if self.pins is None:
            return None
        head = self._held[0][0] if self._held else self.scheduler.peek(now)
        if head is None:
            return None
        return self.pins.backend_of(_sequence_id(head))  # type: ignore[arg-type]

    def _drop_orphans(self, now: float) -> None:
        """Answer UNAVAILABLE the next in line whose sequence's backend is down: its
        state went with it, and no other backend can serve it (every other request goes
        on)."""
        while (pin := self._pinned(now)) is not None and not self.pool.backends[pin].available:
            name = self.pool.names[pin]
            err = Unavailable(f"Triton {name}, which holds this request's sequence, is unavailable")
            if self._held:
                for r in self._held.pop(0):
                    self._fail(r, err)
                self.inflight -= 1
                continue
            head = self.scheduler.peek(now)
            assert head is not None
            self.scheduler.cancel(head, now)
            self._fail(head, err)  # type: ignore[arg-type]

    def _next_deadline(self) -> float | None:
        due = self.scheduler.next_deadline()
        for batch in self._held:
            for r in batch:
                if r.deadline is not None and (due is None or r.deadline < due):
                    due = r.deadline
        return due

    def _arm(self, at: float) -> None:
        """One timer per model, at the earliest moment something is due."""
        if self._timer is not None and self._timer_at is not None and self._timer_at <= at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.clock.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.kick()

    def _expire(self, now: float) -> None:
        for req in self.scheduler.expire(now):
            self._fail(req, TimeoutExpired())  # type: ignore[arg-type]
        for batch in self._held:
            for r in [r for r in batch if r.deadline is not None and r.deadline <= now]:
                batch.remove(r)
                self._fail(r, TimeoutExpired())
        if any(not batch for batch in self._held):
            self.inflight -= sum(1 for batch in self._held if not batch)
            self._held = [batch for batch in self._held if batch]

    async def _run(self, batch: list[CoreRequest], backend: int) -> None:
        started = self.clock.now()
        for r in batch:
            r.dispatched_at = started
            r.backend = backend
        ok = False
        held = False
        try:
            if self._stopping and asyncio.current_task() in self._stopping:
                raise asyncio.CancelledError  # stopped before it started (``_stop``)
            if self.info.decoupled:
                ok, held = await self._grant(batch[0], backend)
            else:
                ok, held = await self._send(batch, backend)
        except asyncio.CancelledError:
            # A decoupled request whose client went away (its stream is closed), or a
            # batch a shutdown's drain stopped waiting for (answered with the reason).
            for r in batch:
                if self._abandoned is not None:
                    self._fail(r, self._abandoned)
                else:
                    self._done(r, Outcome.CANCELLED, None, "")
        except Exception as err:  # never lose an answer, whatever went wrong
            log.exception("batch for %s failed unexpectedly", self.model)
            for r in batch:
                self._fail(r, Internal(f"internal error: {type(err).__name__}"))
        finally:
            task = asyncio.current_task()
            if task is not None:
                self._forget(task)
                self._stopping.discard(task)
            self.running[backend] -= 1  # held or not, it is not on that backend any more
            if not held:
                self.inflight -= 1
                # Its accounting (metrics, the feedback loop's batch times) runs once the
                # answers are on their way: they are written (or their handlers woken) in
                # the loop's next callbacks, which this one would otherwise hold back;
                # with the other batches (or granted streams) that end in this loop turn.
                reports = self._reports
                if not reports:
                    asyncio.get_running_loop().call_soon(self._report_turn)
                reports.append(_report(self.model, batch, started, self.clock.now(), ok))
            self.kick()

    def _report_turn(self) -> None:
        """The reports of the batches that ended in a loop turn, together (``on_batches``)."""
        reports, self._reports = self._reports, []
        self.on_batches(reports)

    async def _send(self, batch: list[CoreRequest], backend: int) -> tuple[bool, bool]:
        """(the batch succeeded, it was held for Triton's return)."""
        batch = [r for r in batch if not r.answered]
        if not batch:
            return True, False
        try:
            packed = pack(batch, self.plan)
            version, outputs = await self._forward(packed, batch, backend)
        except DeadlineExceeded as err:
            self._timed_out(backend)
            for r in batch:
                self._fail(r, err)
            return False, False
        except Unavailable as err:
            self.pool.backends[backend].mark_down()
            if err.never_sent and not self.pool.gave_up:
                # It never reached Triton: hold the batch and send it first to the next
                # backend with a free slot (another of the pool's at once; with one
                # Triton, once it is back); its deadlines still apply meanwhile.
                self._held.append(batch)
                return False, True
            for r in batch:
                self._fail(r, err)
            return False, False
        except ModelUnavailable as err:
            # About the model and version every request of the batch asked for: theirs
            # alone (nothing to bisect, Triton itself is fine).
            for r in batch:
                self._fail(r, err)
            return False, False
        except FrontendError as err:
            return await self._model_error(batch, err, backend)
        for r, outs in zip(batch, unpack(outputs, batch, self.plan, packed.stripped), strict=True):
            self._finish(r, version, outs)
        return True, False

    async def _forward(
        self, packed: Packed, batch: list[CoreRequest], backend: int
    ) -> tuple[str, list[Tensor]]:
        first = batch[0].request
        forwarder = self.pool.forwarders[backend]
        span = None
        if self.traces is not None:
            url = str(getattr(forwarder, "url", backend))
            span = self.traces.batch(self.model, [r.call for r in batch], url, self.clock.now())
        traceparent = carried(span)[0] if span is not None else ""
        sent = forwarder.infer(packed.batch(self.model, first, len(batch), traceparent))
        if span is None:
            return await sent
        context = span.get_span_context()
        for r in batch:
            r.batch_trace = context
        try:
            return await sent
        except FrontendError as err:
            failed(span, err)
            raise
        finally:
            span.end(wall_ns(self.clock.now()))

    # ---- grants: a decoupled model's request, streamed by its shell ---------------------

    async def _grant(self, req: CoreRequest, backend: int) -> tuple[bool, bool]:
        """A decoupled model's request: its slot (on ``backend``) goes to the shell that
        holds its client, which streams it from that Triton itself (one hop) and reports
        what it produced and how it ended (``produced``, ``ended``); the slot is held
        until then. Returns ``_send``'s (served, held): held where it never reached that
        Triton (``ended``), to be granted again as the next batch with a free slot."""
        if req.answered:
            return True, False
        ended = req.ended = asyncio.get_running_loop().create_future()
        if self._silence is not None:
            self._silence.watch()
        if not req.adopted:
            req.route.answer(
                Grant(
                    req.call.id,
                    dict(req.request.sequence),
                    req.queued_s,
                    backend=backend,
                    quota=req.quota,
                    limits_at=req.limits_at if req.limits_at is not None else -1.0,
                )
            )
        served = await ended
        if served is None and not req.answered:
            req.adopted = False  # granted from here on, whoever granted it first
            self._held.append([req])
            return False, True
        return bool(served), False

    def _streams_granted(self) -> list[CoreRequest]:
        """The granted streams still held (``SilentGrants``)."""
        return [b[0] for b in self._tasks.values() if b and b[0].ended is not None]

    def _take_back(self, req: CoreRequest, err: Unavailable) -> None:
        """A granted stream its shell lost (``SilentGrants``): failed, its slot free."""
        log.warning("%s: %s", self.model, err.message)
        self._fail(req, err)  # (to its shell: the revoke a live relay stops on)
        if req.ended is not None and not req.ended.done():
            req.ended.set_result(False)

    def adopt(self, req: CoreRequest, backend: int) -> bool:
        """A stream another core granted, still relayed by its shell (a failover): it
        holds a slot on ``backend`` here until its shell says it ended, as if granted
        here (its tokens are charged from now on). False where this model or backend has
        no such stream (not decoupled, or no such backend)."""
        if not self.info.decoupled or not 0 <= backend < len(self.pool):
            return False
        req.adopted = True
        req.state = QueueState.DISPATCHED
        req.arrival = self.clock.now()  # its time in a queue was the old core's
        self._launch([req], self.clock.now(), backend)
        return True

    def produced(self, req: CoreRequest, tokens: int) -> None:
        """A granted request's stream relayed ``tokens`` output tokens (its shell says so,
        as they come): charged to its tenant now."""
        if req.answered or tokens <= 0 or self.count_report(req, tokens) is None:
            return
        self.on_tokens(req, tokens)
        self._tokens_charged()

    def count_report(self, req: CoreRequest, tokens: int) -> float | None:
        """``produced`` without the charge, for a record's reports charged together
        (``Core.produced_all``): ``tokens`` counted to ``req``; what they cost its
        tenant's fair share (its output cost, 0.0 on an endpoint that counts requests),
        or None where this endpoint does not count its output (nothing to charge)."""
        req.produced += tokens
        if self._token_output is None:
            return None
        return self.output_cost(req, tokens) if self.plan.cost is CostUnit.TOKENS else 0.0

    def charged(self) -> None:
        """Streams' tokens were charged to their tenants (``count_report``)."""
        self._tokens_charged()

    def ended(
        self,
        req: CoreRequest,
        version: str,
        err: FrontendError | None,
        cancelled: bool,
    ) -> None:
        """A granted request's stream ended (its shell says so, once): its slot is free.
        Only a failure to reach Triton marks it down: the model's error for this request,
        Triton's answer about the model, a stream without progress for
        ``request_timeout_s`` (``watchdog.NoProgress``) are this request's alone. One
        that never reached its client (``never_sent``) is not over: its shell waits for
        another grant (held, as a batch that never reached Triton is) or, where the pool
        has given up, for the answer."""
        if req.answered:
            return  # taken back meanwhile, or its shell went away
        if cancelled:
            self._done(req, Outcome.CANCELLED, None, version)
        elif err is not None:
            if isinstance(err, Unavailable) and req.backend >= 0:
                self.pool.backends[req.backend].mark_down()
            if isinstance(err, Unavailable) and err.never_sent:
                if req.ended is not None and not req.ended.done() and not self.pool.gave_up:
                    req.ended.set_result(None)  # _grant holds it for the next backend
                    return
                self._fail(req, err)  # its shell waits for an answer
            else:
                self._done(req, err.outcome, err, version)
        else:
            self._done(req, Outcome.DISPATCHED, None, version)
        if req.ended is not None and not req.ended.done():
            req.ended.set_result(err is None and not cancelled)

    # ---- answers: exactly one per request -----------------------------------------------

    def _finish(self, req: CoreRequest, version: str, outputs: list[Tensor]) -> None:
        if req.answered:
            return
        if outputs and self._token_output is not None:
            n = output_tokens(outputs, self._token_output, self.plan.tokenizer, req.request)
            if n:
                req.produced += n
                self.on_tokens(req, n)
        if req.cancelled:
            self._done(req, Outcome.CANCELLED, None, version)
            return
        req.route.answer(
            Answer(req.call.id, version, outputs, queued_s=req.queued_s, quota=req.quota)
        )
        self._done(req, Outcome.DISPATCHED, None, version)

    def _fail(self, req: CoreRequest, err: FrontendError) -> None:
        if req.answered:
            return
        if req.cancelled:
            self._done(req, Outcome.CANCELLED, None, "")
            return
        req.route.answer(Answer(req.call.id, fault=Fault.of(err, req.quota), queued_s=req.queued_s))
        self._done(req, err.outcome, err, "")

    def _done(self, req: CoreRequest, outcome: Outcome, err: FrontendError | None, v: str) -> None:
        req.answered = True
        self.on_done(req, outcome, err, v)

    def _done_served(self, reqs: Sequence[CoreRequest], version: str) -> None:
        """``_done`` of each, served, counted together (``on_served``): each must be
        unanswered and not cancelled."""
        for req in reqs:
            req.answered = True
        self.on_served(reqs, version)

    def _each_done(self, reqs: Sequence[CoreRequest], version: str) -> None:
        """``on_served`` where none was given: ``on_done`` of each."""
        for req in reqs:
            self.on_done(req, Outcome.DISPATCHED, None, version)

    # ---- outages and shutdown -----------------------------------------------------------

    def outage_error(self) -> Unavailable:
        return Unavailable(
            f"Triton has been unavailable for {self.pool.outage_s:.0f} s "
            f"(triton.max_outage_s is {self.pool.max_outage_s:g})"
        )

    def give_up(self) -> None:
        """The outage outlasted ``max_outage_s``: answer what waits, UNAVAILABLE."""
        self.fail_queued(self.outage_error())

    @property
    def incoming(self) -> int:
        """Parts of admitted calls waiting for their slice (``submit_all``)."""
        return len(self._incoming)

    @property
    def idle(self) -> bool:
        return self.inflight == 0 and self.scheduler.queued_requests == 0 and not self._incoming

    def fail_queued(self, err: FrontendError) -> int:
        """Answer everything queued or held with ``err`` (shutdown, a given-up outage);
        returns how many. The queued leave the scheduler as cancelled: neither dispatched
        nor charged to anyone's DRR budget. The held were dispatched (and charged) when
        their batch was assembled; they are answered all the same."""
        failed = 0
        for waiting in self._release_incoming(lambda r: False):
            self._fail(waiting, err)
            failed += 1
        for req in self.scheduler.cancel_all(self.clock.now()):
            self._fail(req, err)  # type: ignore[arg-type]
            failed += 1
        for batch in self._held:
            for r in batch:
                self._fail(r, err)
                failed += 1
        self.inflight -= len(self._held)
        self._held = []
        return failed

    def drop(self, route: Route) -> int:
        """A shell went away: forget every request whose answer would go to it; returns
        how many were still waiting. Queued ones leave; in a batch, answers are dropped."""
        dropped = 0
        for gone in self._release_incoming(lambda r: r.route is not route):
            self._done(gone, Outcome.CANCELLED, None, "")
            dropped += 1
        for req in self.scheduler.queued():
            if req.route is route:  # type: ignore[attr-defined]
                self.cancel(req)  # type: ignore[arg-type]
                dropped += 1
        for batch in [*self._tasks.values(), *self._held]:
            for r in list(batch):
                if r.route is route and not r.answered:
                    self.cancel(r)
                    dropped += 1
        return dropped

    async def drain(self, timeout_s: float | None = None, err: FrontendError | None = None) -> None:
        """Wait for every batch in flight (shutdown), for at most ``timeout_s``.

        Whatever has no answer when it ends is answered ``err``: batches Triton has not
        answered by then (their calls are cancelled), and batches held for a Triton that
        is not back (a batch can come back unsent, held, while the drain waits: one sent
        just as Triton went away, or the rest of a bisection).
        """
        err = err or Unavailable(SHUTTING_DOWN)
        loop = asyncio.get_running_loop()  # asyncio.wait's clock: the timeout is real time
        until = None if timeout_s is None else loop.time() + timeout_s
        while self._tasks:
            left = None if until is None else until - loop.time()
            if left is not None and left <= 0:
                self._abandoned = err
                for task in self._tasks:
                    self._stop(task)
            await asyncio.wait(list(self._tasks), timeout=left if left and left > 0 else None)
        self.fail_queued(err)


def _report(
    model: str, batch: list[CoreRequest], started: float, finished: float, ok: bool
) -> BatchReport:
    rows: dict[str, int] = {}
    tokens: dict[str, int] = {}
    cost: dict[str, float] = {}
    for r in batch:
        rows[r.tenant] = rows.get(r.tenant, 0) + r.rows
        tokens[r.tenant] = tokens.get(r.tenant, 0) + r.tokens
        cost[r.tenant] = cost.get(r.tenant, 0.0) + r.cost
    return BatchReport(
        model=model,
        rows=sum(rows.values()),
        tokens=sum(tokens.values()),
        items=len(batch),
        tenants=rows,
        tenant_tokens=tokens,
        tenant_cost=cost,
        started=started,
        finished=finished,
        ok=ok,
    )


def _sequences(batch: list[CoreRequest]) -> list[tuple[ParamValue, bool]]:
    """The sequences of a batch's requests: (Triton's id, whether the request ends it)."""
    out = []
    for r in batch:
        sequence_id = _sequence_id(r)
        if sequence_id is not None:
            out.append((sequence_id, bool(r.request.sequence.get("sequence_end", False))))
    return out


def _sequence_id(req: CoreRequest) -> ParamValue | None:
    """The id Triton knows ``req``'s sequence by (the core's, ``core.sequences``), if any."""
    sequence = req.request.sequence
    return sequence.get("sequence_id") if sequence else None


# The dispatch modes, by the name the plan gives (``EndpointPlan.mode``), each added by
# the module that defines it (the package imports them all).
DISPATCH_MODES: Registry[type[Dispatcher]] = Registry("dispatch mode")
