"""The asyncio layer around one model's scheduler: queue, dispatch, answer, expire.

The scheduler core is pure and synchronous; this module owns the timers (through one
injected ``Clock``), the tasks that talk to Triton and the bound on batches in flight.
Invariants:

* every request submitted here is answered exactly once (``CoreRequest.answered``): a
  result, or an error (expired, Triton's error, unavailable, shutdown); a request whose
  client went away is not answered, and its outcome is ``CANCELLED``;
* at most ``max_inflight`` batches of this model are in Triton at once (by default one
  per model instance), so requests wait here, where fairness is decided, not in
  Triton's queue, and each batch is assembled at the moment an instance frees up: a
  request that arrives while Triton is busy can still make the very next batch;
* work-conserving: whenever a slot is free and anything is queued, a batch goes out
  (unless ``max_queue_delay_ms`` asks to wait for a fuller batch, Triton-style);
* a batch whose model call fails for one bad row does not fail its neighbours: on a
  model error it is bisected (each half sent on its own, a failing half split again), so
  only the culprit sees the error, at about 2 log2(n) extra sends for one culprit among
  n, not n; a half that succeeded is finished and never sent again. This resends the
  requests of a failed call, which assumes what Triton's batching assumes of a model: a
  call that fails as a whole had no effect (the Python backend fails every request of
  an ``execute`` that raises; a model with side effects per row must answer per-row
  errors in its responses instead of raising);
* Triton's answer that a model (version) is not ready fails the batch that asked for it,
  nothing else: only a failure to reach Triton at all (no connection, a connection
  lost, a batch not answered in time) marks the backend down. A request's own length
  never does: a stream's limit is time without progress (``forwarder.NoProgress``, this
  request's failure alone), and in engine mode a call past its deadline fails only the
  request it carried (a generation may be long; gRPC's keepalive, not a deadline, finds a
  Triton that stopped answering);
* while Triton is unreachable nothing is sent: a batch that never reached it is held
  (with its slot) and goes first when it is back; deadlines still expire, on time, and
  after ``max_outage_s`` everything waiting is answered UNAVAILABLE; so is everything
  held or still in Triton when a shutdown's drain ends (``drain``);
* a decoupled model's request takes one hop: when its turn comes its slot is granted to
  the shell that holds its client (``records.Grant``), which sends it to Triton and relays
  the responses itself, reporting the output tokens they carry (``produced``: charged to
  its tenant's counter as they come, one loop iteration late at most over a socket) and,
  once, how it ended (``ended``); the slot is held until then, or until the shell is gone
  (``drop``). A shutdown that stops waiting takes the slot back (an ``Answer`` with the
  reason, which ends the stream in the shell).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fair_frontend.batching import Packed, pack, unpack
from fair_frontend.clock import Clock, Timer
from fair_frontend.config import Endpoint
from fair_frontend.errors import (
    DeadlineExceeded,
    FrontendError,
    Internal,
    ModelUnavailable,
    TimeoutExpired,
    Unavailable,
)
from fair_frontend.models import ModelInfo
from fair_frontend.observe import BatchReport
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import (
    InferRequest,
    ParamValue,
    RequestedOutput,
    Tensor,
)
from fair_frontend.scheduler import QueuedRequest, Scheduler
from fair_frontend.tokens import output_tokens
from fair_frontend.wire.records import Answer, Call, Fault, Grant

if TYPE_CHECKING:
    from collections.abc import Mapping

    from fair_frontend.core.admission import EndpointAdmission
    from fair_frontend.feedback import ServiceModel

log = logging.getLogger(__name__)


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
    # Core.wall() when its tokens were counted in its limits (None again once corrected)
    limits_at: float | None = None
    ended: asyncio.Future[bool] | None = None  # granted: set when its shell says it ended

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


class Forwarder(Protocol):
    """What the dispatch loop needs of Triton (``TritonForwarder`` in production)."""

    async def infer(
        self,
        model: str,
        version: str,
        inputs: Sequence[Tensor],
        outputs: Sequence[RequestedOutput] | None,
        parameters: dict[str, ParamValue],
        request_id: str = "",
        sequence: Mapping[str, ParamValue] | None = None,
    ) -> tuple[str, list[Tensor]]: ...


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
    ) -> None:
        self.clock = clock
        self.available = True
        self.listeners: list[Callable[[], None]] = []  # called when Triton is back
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
            log.warning("Triton unavailable: holding queued requests until it is back")
            self.down_since = self.clock.now()
            self.available = False
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
            log.info("Triton available again: resuming dispatch")
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


class EndpointRuntime:
    """Feeds one model's batches to Triton, at most ``max_inflight`` at a time."""

    def __init__(
        self,
        *,
        model: str,
        info: ModelInfo,
        endpoint: Endpoint,
        scheduler: Scheduler,
        forwarder: Forwarder,
        backend: Backend,
        clock: Clock,
        admission: EndpointAdmission | None = None,
        on_batch: Callable[[BatchReport], None] = lambda report: None,
        on_done: Done = lambda req, outcome, err, version: None,
        on_tokens: Tokens = lambda req, n: None,
    ) -> None:
        self.model = model
        self.info = info
        self.endpoint = endpoint
        self.scheduler = scheduler
        self.forwarder = forwarder
        self.backend = backend
        self.clock = clock
        self.admission = admission
        self.on_batch = on_batch
        self.on_done = on_done
        self.on_tokens = on_tokens
        # Engine mode (max_inflight): requests in the engine at once, each alone.
        self.engine = endpoint.max_inflight is not None
        configured = endpoint.max_inflight or endpoint.max_inflight_batches
        self._max_inflight = configured if configured is not None else info.instances
        self._token_output = endpoint.token_output
        self._reserved = endpoint.reserved_slots if self.engine else 0
        self._capped: str | None = None  # holds its cap while next in line (a slot waits)
        self._isolating = 0  # failed batches being bisected
        self._isolation: asyncio.Lock | None = None  # they take turns (made on first use)
        self._overlapped: set[asyncio.Task[None]] = set()  # were in Triton beside another
        self.inflight = 0  # batches in Triton (or held for it, with their slot)
        self.batches_sent = 0
        self._busy_until = 0.0  # when the batches in flight are predicted to be done
        self._timer: Timer | None = None
        self._timer_at: float | None = None
        self._held: list[list[CoreRequest]] = []  # batches that never reached Triton
        self._tasks: dict[asyncio.Task[None], list[CoreRequest]] = {}
        # Per batch in Triton: (sent at, predicted seconds); _busy_until is derived from
        # them and recomputed as each batch comes back, early or late.
        self._predicted: dict[asyncio.Task[None], tuple[float, float]] = {}
        # Set when a shutdown's drain ran out of time: the batches it cancels are
        # answered with it (not dropped as a client's cancellation).
        self._abandoned: FrontendError | None = None
        backend.listeners.append(self.kick)
        backend.give_up_listeners.append(self.give_up)

    @property
    def service(self) -> ServiceModel | None:
        """What batches cost (the feedback loop's estimates), if the endpoint learns it."""
        return self.admission.service if self.admission is not None else None

    @property
    def max_inflight(self) -> int:
        return self._max_inflight

    def now(self) -> float:
        return self.clock.now()

    # ---- the request side ---------------------------------------------------------------

    def submit(self, req: CoreRequest) -> None:
        """Queue a request (raises ``QueueFull`` before anything is queued); its answers go
        to ``req.route``."""
        now = self.clock.now()
        self.scheduler.enqueue(req, now)
        if self.backend.available and self._may_send(now):
            self.kick()
            return
        # No batch can go now (the hot path under load): only its timers may change.
        self._arm_lead()
        if req.deadline is not None:
            self._arm(req.deadline)

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
                task.cancel()
        for batch in self._held:
            if req in batch:
                batch.remove(req)
                self._done(req, Outcome.CANCELLED, None, "")

    # ---- the dispatch side --------------------------------------------------------------

    def kick(self) -> None:
        """Send batches while a slot is free and work is queued; re-arm the timer."""
        now = self.clock.now()
        self._expire(now)
        while self.backend.available and self._may_send(now):
            if self._held:
                batch = self._held.pop(0)
                self.inflight -= 1  # its slot was kept: _launch takes it again
            else:
                hold = self._hold_until(now)
                if hold is not None:
                    self._arm(hold)
                    break
                batch = self.scheduler.next_batch(now)  # type: ignore[assignment]
            if not batch:
                break
            self._launch(batch, now)
        if self.scheduler.queued_requests:
            self._arm_lead()
        due = self._next_deadline()
        if due is not None:
            self._arm(due)

    def _arm_lead(self) -> None:
        """The early send's timer, while every slot is taken and Triton is there (while it
        is not, nothing is sent: the moment passes, and a timer for it would fire at once,
        for ever; ``kick`` runs again when Triton is back)."""
        lead = self._lead()
        if (
            lead > 0
            and not self._isolating
            and self.inflight == self.max_inflight
            and self.backend.available
        ):
            self._arm(self._busy_until - lead)

    def _launch(self, batch: list[CoreRequest], now: float) -> None:
        self.inflight += 1
        self.batches_sent += 1
        task = asyncio.get_running_loop().create_task(self._run(batch))
        if self._tasks and not self.engine:  # batches that meet in Triton's queue
            self._overlapped.update(self._tasks)
            self._overlapped.add(task)
        self._tasks[task] = batch
        self._predicted[task] = (now, self._predict(batch))
        self._busy_until = self._predicted_end(now)
        task.add_done_callback(self._forget)

    def in_engine(self, tenant: str) -> int:
        """``tenant``'s requests in Triton (or held for it): a scan of the slots, made only
        where slots are reserved."""
        return sum(
            1 for batch in (*self._tasks.values(), *self._held) for r in batch if r.tenant == tenant
        )

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        self._predicted.pop(task, None)
        self._overlapped.discard(task)

    def _predicted_end(self, now: float) -> float:
        """When the batches in Triton are predicted to be done: one instance runs them one
        after another, each from when it was sent or the one before it ends."""
        busy = now
        for sent, seconds in sorted(self._predicted.values()):
            busy = max(busy, sent) + seconds
        return busy

    def _may_send(self, now: float) -> bool:
        """A free slot, or the early send: one more batch ``dispatch_lead_ms`` before the
        batches in flight are predicted to finish, so that Triton starts it without a gap
        while it is still assembled at the last moment (late binding). In engine mode the
        ``reserved_slots`` are kept from any one tenant: none holds more than
        ``max_inflight - reserved_slots``, so the others always find a slot."""
        if self.inflight < self.max_inflight:
            if not self._reserved:
                return True
            head = self.scheduler.peek(now)
            if head is None:
                return False
            # The next in line holds its cap: wait until the order changes (its counter
            # grows as its streams produce: _send_stream kicks again meanwhile).
            capped = self.in_engine(head.tenant) >= self.max_inflight - self._reserved
            self._capped = head.tenant if capped else None
            return not capped
        if self._held:
            return True  # a held batch kept its slot
        lead = self._lead()
        return (
            lead > 0
            and not self._isolating
            and self.inflight == self.max_inflight
            and now >= self._busy_until - lead
        )

    def _lead(self) -> float:
        service = self.service
        if self.engine or service is None or not service.has_data:
            return 0.0  # an engine's slot frees when a request ends: no batch time to lead
        return self.endpoint.dispatch_lead_ms / 1000.0

    def _predict(self, batch: list[CoreRequest]) -> float:
        service = self.service
        if service is None or not service.has_data:
            return 0.0
        rows = sum(r.rows for r in batch)
        tokens = sum(r.tokens for r in batch)
        return float(service.predict_batch_seconds(rows, tokens))

    def _hold_until(self, now: float) -> float | None:
        """Triton-style max_queue_delay: wait (only while idle) for a fuller batch."""
        delay = self.endpoint.max_queue_delay_ms / 1000.0
        if delay <= 0 or self.inflight > 0:
            return None
        oldest = self.scheduler.oldest_arrival()
        if oldest is None or oldest + delay <= now:
            return None
        policy = self.scheduler.policy
        if self.scheduler.queued_rows >= (policy.max_batch_size or 1):
            return None  # a full batch by rows
        if policy.max_batch_tokens is not None and (
            self.scheduler.queued_tokens >= policy.max_batch_tokens
        ):
            return None  # ... or by tokens
        return oldest + delay

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

    async def _run(self, batch: list[CoreRequest]) -> None:
        started = self.clock.now()
        for r in batch:
            r.dispatched_at = started
        ok = False
        held = False
        try:
            if self.info.decoupled:
                ok = await self._grant(batch[0])
            else:
                ok, held = await self._send(batch)
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
            self._busy_until = self._predicted_end(self.clock.now())
            if not held:
                self.inflight -= 1
                # Its accounting (metrics, the feedback loop's batch times) runs once the
                # answers are on their way: they are written (or their handlers woken) in
                # the loop's next callbacks, which this one would otherwise hold back.
                report = _report(self.model, batch, started, self.clock.now(), ok)
                asyncio.get_running_loop().call_soon(self.on_batch, report)
            self.kick()

    async def _send(self, batch: list[CoreRequest]) -> tuple[bool, bool]:
        """(the batch succeeded, it was held for Triton's return)."""
        batch = [r for r in batch if not r.answered]
        if not batch:
            return True, False
        try:
            packed = pack(batch, self.info, self.endpoint)
            version, outputs = await self._forward(packed, batch)
        except DeadlineExceeded as err:
            # A call Triton did not answer in time. In engine mode a call is one request,
            # as long as its generation: its length says nothing of Triton, and only that
            # request fails. A batch is expected back in time: Triton is taken for down.
            if not self.engine:
                self.backend.mark_down()
            for r in batch:
                self._fail(r, err)
            return False, False
        except Unavailable as err:
            self.backend.mark_down()
            if err.never_sent and not self.backend.gave_up:
                # It never reached Triton: hold the batch (its slot too) and send it
                # first once Triton is back; its deadlines still apply meanwhile.
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
            task = asyncio.current_task()
            if len(batch) == 1 and task not in self._overlapped:
                self._fail(batch[0], err)
                return False, False
            # One bad row must not fail its neighbours: find it by bisection (also a
            # request alone whose batch overlapped another in Triton, whose own batcher
            # may have run them as one execution: it is tried once more alone), and
            # nothing beside it (no early send: Triton's own batcher would put a request
            # sent meanwhile into the same execution as the culprit).
            self._isolating += 1
            try:
                if self._isolation is None:
                    self._isolation = asyncio.Lock()
                async with self._isolation:  # one batch at a time: none meets another's
                    unsent = await self._bisect(batch)
            finally:
                self._isolating -= 1
            if unsent:  # Triton went away meanwhile: the rest waits for it, as a batch
                self._held.append(unsent)
                return False, True
            return False, False
        for r, outs in zip(
            batch, unpack(outputs, batch, self.info, self.endpoint, packed.stripped), strict=True
        ):
            self._finish(r, version, outs)
        return True, False

    async def _grant(self, req: CoreRequest) -> bool:
        """A decoupled model's request: its slot goes to the shell that holds its client,
        which streams it from Triton itself (one hop) and reports what it produced and how
        it ended (``produced``, ``ended``); the slot is held until then. True when it was
        served."""
        if req.answered:
            return True
        ended = req.ended = asyncio.get_running_loop().create_future()
        req.route.answer(Grant(req.call.id, dict(req.request.sequence), req.queued_s))
        return await ended

    def produced(self, req: CoreRequest, tokens: int) -> None:
        """A granted request's stream relayed ``tokens`` output tokens (its shell says so,
        as they come): charged to its tenant now."""
        if req.answered or tokens <= 0:
            return
        req.produced += tokens
        if self._token_output is None:
            return
        self.on_tokens(req, tokens)
        capped = self._capped
        if capped is not None and self.scheduler.queued_requests > self.scheduler.depth(capped):
            self.kick()  # the charge may have moved another tenant ahead of it

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
        ``request_timeout_s`` (``forwarder.NoProgress``) are this request's alone."""
        if req.answered:
            return  # taken back meanwhile, or its shell went away
        if cancelled:
            self._done(req, Outcome.CANCELLED, None, version)
        elif err is not None:
            if isinstance(err, Unavailable):
                self.backend.mark_down()
            self._done(req, err.outcome, err, version)
        else:
            self._done(req, Outcome.DISPATCHED, None, version)
        if req.ended is not None and not req.ended.done():
            req.ended.set_result(err is None and not cancelled)

    async def _bisect(self, batch: list[CoreRequest]) -> list[CoreRequest]:
        """Answer a batch that failed with a model error, culprits found by halves.

        Each half is sent on its own: one that succeeds is finished (never sent again),
        one that fails is split again, and a request alone that fails gets its error. One
        culprit among n costs 2 sends per halving, about 2 log2(n), where one by one cost
        n. Halves go one after another, in batch order. Returns the requests not sent
        because Triton became unreachable (to hold), [] when every one was answered.
        """
        todo = [batch] if len(batch) == 1 else list(reversed(_halves(batch)))
        while todo:
            group = self._still_wanted(todo.pop())
            if not group:
                continue
            try:
                await self._send_group(group)
            except Unavailable as err:
                self.backend.mark_down()
                if not err.never_sent:  # it may have run: never sent twice
                    for r in group:
                        self._fail(r, err)
                    group = []
                rest = [r for g in (group, *reversed(todo)) for r in g if not r.answered]
                if not self.backend.gave_up:
                    return rest
                for r in rest:
                    self._fail(r, self.outage_error())
                return []
            except ModelUnavailable as err:
                for r in group:
                    self._fail(r, err)
            except FrontendError as err:
                if len(group) == 1:
                    self._fail(group[0], err)
                else:
                    todo.extend(reversed(_halves(group)))
        return []

    def _still_wanted(self, group: list[CoreRequest]) -> list[CoreRequest]:
        """The requests of ``group`` still to send: not answered, and whose client is still
        there (one that went away is done with, CANCELLED: no work for an answer nobody
        reads)."""
        wanted = []
        for r in group:
            if r.answered:
                continue
            if r.cancelled:
                self._done(r, Outcome.CANCELLED, None, "")
                continue
            wanted.append(r)
        return wanted

    async def _send_group(self, group: list[CoreRequest]) -> None:
        """Send part of a failed batch as one call, and finish its requests (raises the
        call's error, nothing answered, when it fails)."""
        packed = pack(group, self.info, self.endpoint)
        version, outputs = await self._forward(packed, group)
        outs = unpack(outputs, group, self.info, self.endpoint, packed.stripped)
        for r, out in zip(group, outs, strict=True):
            self._finish(r, version, out)

    async def _forward(self, packed: Packed, batch: list[CoreRequest]) -> tuple[str, list[Tensor]]:
        first = batch[0].request
        return await self.forwarder.infer(
            self.model,
            first.version,
            packed.inputs,
            packed.outputs,
            packed.parameters,
            request_id=first.id if len(batch) == 1 else "",
            sequence=packed.sequence,
        )

    # ---- answers: exactly one per request -----------------------------------------------

    def _finish(self, req: CoreRequest, version: str, outputs: list[Tensor]) -> None:
        if req.answered:
            return
        if outputs and self._token_output is not None:
            n = output_tokens(outputs, self._token_output, self.endpoint.tokenizer, req.request)
            if n:
                req.produced += n
                self.on_tokens(req, n)
        if req.cancelled:
            self._done(req, Outcome.CANCELLED, None, version)
            return
        req.route.answer(Answer(req.call.id, version, outputs, queued_s=req.queued_s))
        self._done(req, Outcome.DISPATCHED, None, version)

    def _fail(self, req: CoreRequest, err: FrontendError) -> None:
        if req.answered:
            return
        if req.cancelled:
            self._done(req, Outcome.CANCELLED, None, "")
            return
        req.route.answer(Answer(req.call.id, fault=Fault.of(err), queued_s=req.queued_s))
        self._done(req, err.outcome, err, "")

    def _done(self, req: CoreRequest, outcome: Outcome, err: FrontendError | None, v: str) -> None:
        req.answered = True
        self.on_done(req, outcome, err, v)

    # ---- outages and shutdown -----------------------------------------------------------

    def outage_error(self) -> Unavailable:
        return Unavailable(
            f"Triton has been unavailable for {self.backend.outage_s:.0f} s "
            f"(triton.max_outage_s is {self.backend.max_outage_s:g})"
        )

    def give_up(self) -> None:
        """The outage outlasted ``max_outage_s``: answer what waits, UNAVAILABLE."""
        self.fail_queued(self.outage_error())

    @property
    def idle(self) -> bool:
        return self.inflight == 0 and self.scheduler.queued_requests == 0

    def fail_queued(self, err: FrontendError) -> int:
        """Answer everything queued or held with ``err`` (shutdown, a given-up outage);
        returns how many. The queued leave the scheduler as cancelled: neither dispatched
        nor charged to anyone's DRR budget. The held were dispatched (and charged) when
        their batch was assembled; they are answered all the same."""
        failed = 0
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
        err = err or Unavailable("the frontend is shutting down")
        loop = asyncio.get_running_loop()  # asyncio.wait's clock: the timeout is real time
        until = None if timeout_s is None else loop.time() + timeout_s
        while self._tasks:
            left = None if until is None else until - loop.time()
            if left is not None and left <= 0:
                self._abandoned = err
                for task in self._tasks:
                    task.cancel()
            await asyncio.wait(list(self._tasks), timeout=left if left and left > 0 else None)
        self.fail_queued(err)


def _halves(batch: list[CoreRequest]) -> list[list[CoreRequest]]:
    """The two halves of a batch, in order (the first one the larger)."""
    middle = (len(batch) + 1) // 2
    return [batch[:middle], batch[middle:]]


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
