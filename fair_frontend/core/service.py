"""The core: one process's policy over every request the shells hand it.

A shell has decoded, identified and validated a request (a ``Call``); the core takes it
through, in this fixed order: the throttle (``EndpointAdmission``) -> the tenant's rate
limits (``Accounting``) -> the model's scheduler (tier, deficit round robin, priority)
-> a batch to Triton (the model's ``Dispatcher``) -> its share of the answer, back along
the call's ``Route``. Every call is answered exactly once; every request ends in exactly
one ``Outcome``, reported to the observers (metrics, the request log) and the statistics
(by the ``Accounting``), whatever path it took.

``Core`` is the facade the shells call; what it decides itself is admission's order and
the endpoints' set-up (``_runtime``: a dispatcher per model, in the mode its plan says).

The parts of one API call (``records.Group``) take the same path together, admitted or
refused whole (``submit_group``). The hot path is synchronous: a call is admitted, queued
and, when a slot is free, batched in one step, without a task of its own. Only a
rate-limit check that must wait for its storage (Redis) continues asynchronously.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from fair_frontend.admission import (
    RateLimiter,
    ThrottleDecision,
    overloaded_error,
)
from fair_frontend.admission.slo import SloClass, SloClasses
from fair_frontend.auth import KeyRing
from fair_frontend.backends import metrics_reader
from fair_frontend.backends.protocol import BackendServer, MetricsReader
from fair_frontend.batching import batch_key
from fair_frontend.config import Config, ConfigError, Tenant, parse_config
from fair_frontend.core.accounting import Accounting
from fair_frontend.core.admission import EndpointAdmission, TierShares
from fair_frontend.core.carried import Carried
from fair_frontend.core.clock import Clock, LoopClock
from fair_frontend.core.dispatch import DISPATCH_MODES, Backend, CoreRequest, Dispatcher, Route
from fair_frontend.core.engine import EngineDispatcher
from fair_frontend.core.metrics import (
    FrontendMetrics,
    StateCollector,
    slo_samples,
    window_samples,
)
from fair_frontend.core.plan import (
    batch_throttle,
    engine_throttle,
    global_caps,
    queue_limits,
    rate_limiter,
    service_model,
)
from fair_frontend.core.pool import BackendPool
from fair_frontend.core.sequences import SequenceIds
from fair_frontend.core.shedding import Shedding
from fair_frontend.core.silence import SILENT_MARGIN_S
from fair_frontend.core.stats import Statistics
from fair_frontend.endpoint import plan as endpoint_plan
from fair_frontend.errors import (
    SHUTTING_DOWN,
    FrontendError,
    Internal,
    InvalidArgument,
    Unauthenticated,
    Unavailable,
    UnknownModel,
    UpstreamError,
)
from fair_frontend.feedback import FeedbackCost, SlotTimes, TritonDelta
from fair_frontend.models import ModelInfo
from fair_frontend.observability.logs import RequestLog
from fair_frontend.observability.observe import Observer, Observers
from fair_frontend.observability.tracing import Traces
from fair_frontend.outcomes import Outcome
from fair_frontend.quota import Quota
from fair_frontend.scheduler import (
    QueueState,
    Scheduler,
    cost_model_for,
)
from fair_frontend.wire.records import (
    CONNECTION_DOOR,
    NO_GAPS,
    Answer,
    Call,
    Fault,
    Gaps,
    Group,
    RowsDone,
    Tally,
)

log = logging.getLogger(__name__)

REMOVED_TENANT = "unknown tenant: it was removed by a configuration reload"


class ModelRegistry:
    """What is this model? Fetched from Triton once, shared by concurrent first callers.

    In a pool of Tritons (which serve the same models) it asks the first, and the next
    only where one is unreachable.

    The lookup runs in a task of its own, not in the first caller: a caller that goes
    away (a client disconnects, its request is cancelled) only stops waiting, and every
    other caller still gets the answer. Only the lookup's own error (an unknown model,
    Triton unreachable) reaches them, and it is not kept: the next caller asks again.
    """

    def __init__(self, forwarders: BackendServer | Sequence[BackendServer]) -> None:
        self.forwarders = _each(forwarders)
        self.forwarder = self.forwarders[0]
        self._infos: dict[str, asyncio.Task[ModelInfo]] = {}

    def cached(self, model: str) -> ModelInfo | None:
        task = self._infos.get(model)
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return None
        return task.result()

    async def get(self, model: str) -> ModelInfo:
        task = self._infos.get(model)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._lookup(model))
            task.add_done_callback(lambda done: self._settled(model, done))
            self._infos[model] = task
        return await asyncio.shield(task)

    async def _lookup(self, model: str) -> ModelInfo:
        for i, forwarder in enumerate(self.forwarders):
            try:
                return await forwarder.describe(model)
            except Unavailable:
                if i + 1 < len(self.forwarders):
                    continue  # that one is away: the next one serves the same models
                raise
            except FrontendError as err:
                raise _unknown_model(model, err) from None
        raise AssertionError("a registry has at least one forwarder")

    def _settled(self, model: str, task: asyncio.Task[ModelInfo]) -> None:
        """Keep a found model; forget a failed (or, at shutdown, cancelled) lookup."""
        failed = task.cancelled() or task.exception() is not None  # exception(): retrieved
        if failed and self._infos.get(model) is task:
            del self._infos[model]


def _each(forwarders: BackendServer | Sequence[BackendServer]) -> list[BackendServer]:
    """The pool's forwarders: one given alone is a pool of one."""
    if isinstance(forwarders, (list, tuple)):
        return list(forwarders)
    return [forwarders]  # type: ignore[list-item]


def _unknown_model(model: str, err: BaseException) -> BaseException:
    """The lookup's error: "no such model" in the frontend's words for the model asked
    (Triton's answer to a config or metadata lookup may name a version)."""
    if isinstance(err, UpstreamError) and "unknown model" in err.message:
        return UnknownModel(model)
    return err


class Core:
    """Admission, scheduling and dispatch for every endpoint; the shells' one peer."""

    def __init__(
        self,
        config: Config,
        forwarder: BackendServer | Sequence[BackendServer],
        *,
        keyring: KeyRing | None = None,
        observers: Sequence[Observer] | None = None,
        limiter: RateLimiter | None = None,
        clock: Clock | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        # Two clocks, both injected (unit tests run the core on fake ones):
        # ``clock`` (a ``LoopClock`` by default: ``time.monotonic()`` and the loop's
        # timers) for every duration, deadline and timer. A ``Call`` is stamped
        # ``arrived = time.monotonic()`` by its shell, perhaps in another process:
        # CLOCK_MONOTONIC is one clock for every process of a host, so latencies and
        # deadlines taken against ``clock.now()`` are on the shell's scale too.
        # ``wall`` (``time.time`` by default) for the rate limits' windows only (the
        # ``accounting`` reads it): they are shared through their storage by replicas on
        # other hosts, which agree on the wall clock and on no monotonic one.
        # ``forwarder``: the Triton, or each Triton of the pool (``core.pool``), in the
        # order of the shells' ``Settings.triton_urls`` (a grant names one by its index).
        self.config = config
        self.forwarders = _each(forwarder)
        self.forwarder = self.forwarders[0]
        self.models = ModelRegistry(self.forwarders)
        # The schedulers read tenants from this dict: a reload updates it in place.
        self.tenants: dict[str, Tenant] = dict(config.tenants)
        # SLO classes (``admission.slo``): the configured ones (a restart changes them);
        # a tenant's own or its tier's, read from the running config (a reload: live).
        self.slo = SloClasses(config.slo_classes_by_name(), lambda t: self.config.slo_class_of(t))
        self.keyring = keyring or KeyRing.from_config(config)
        self.metrics = FrontendMetrics(config)
        self.metrics.registry.register(StateCollector(self.state_samples))
        self.registry = self.metrics.registry
        self.observer = Observers([self.metrics, *(observers or ())])
        self.request_log = RequestLog()  # what no shell logs itself (``Call.logged``)
        self.traces = Traces.of(config)  # ``tracing.*`` takes a restart: the first config's
        self._clock = clock
        self._pool: BackendPool | None = None
        self.caps = global_caps(config.queues)
        self.limiter = limiter or rate_limiter(config.rate_limiting)
        self.runtimes: dict[str, Dispatcher] = {}
        self.stats = Statistics()
        self.accounting = Accounting(
            config,
            limiter=self.limiter,
            observer=self.observer,
            request_log=self.request_log,
            stats=self.stats,
            runtimes=self.runtimes,
            known_model=self.models.cached,
            tier_of=self._tier,
            spawn=self._spawn,
            now=lambda: self.clock.now(),  # the clock is made on first use (a loop's)
            wall=wall,
        )
        self.accounting.traces = self.traces
        self.sequences = SequenceIds()  # tenants' sequence ids -> the ids Triton sees
        self.backend_metrics: MetricsReader | None = None  # the first Triton's, where read
        self.accepting = True
        self.last_call_at = 0.0  # clock.now() of the latest call (shutdown's quiet)
        self._admitting: set[asyncio.Task[None]] = set()
        self._ticking: set[Dispatcher] | None = None  # in a tick: the runtimes to settle
        # What the shells shed before a call reaches this core: its full queues, and the
        # tiers its throttle closed.
        self.shedding = Shedding(self)
        # What a failover carries: this core's export, a failed leader's state resumed.
        self.carried = Carried(self)

    @property
    def clock(self) -> Clock:
        if self._clock is None:
            self._clock = LoopClock()
        return self._clock

    @property
    def pool(self) -> BackendPool:
        """The Tritons behind every endpoint, each with its reachability (made on first
        use: the clock's)."""
        if self._pool is None:
            backends = [
                Backend(
                    self.clock,
                    probe=f.server_ready,
                    max_outage_s=self.config.triton.max_outage_s,
                    name=name if len(self.forwarders) > 1 else "",
                )
                for f, name in zip(self.forwarders, self.backend_names, strict=True)
            ]
            self._pool = BackendPool(backends, self.forwarders, self.backend_names)
        return self._pool

    @property
    def pool_if_made(self) -> BackendPool | None:
        """The pool where it has been made (``pool`` makes it)."""
        return self._pool

    @property
    def backend_names(self) -> list[str]:
        """Each Triton's address, its ``backend`` label (a fake one's: its index)."""
        return [str(getattr(f, "url", i)) for i, f in enumerate(self.forwarders)]

    @property
    def backend(self) -> Backend:
        """The first Triton's reachability (with one Triton: the only one's)."""
        return self.pool.backends[0]

    # ---- calls from the shells ----------------------------------------------------------

    def submit(self, call: Call, route: Route, *, judged: bool = False) -> CoreRequest | None:
        """Take a call through admission into its model's queue; its answers go to
        ``route``. Returns the queued request (to ``cancel`` it), or None when the call
        was answered at once (refused). ``judged``: the throttle admitted it already, with
        its tenant's other calls of the same intake slice (``judge_together``)."""
        model = call.request.model
        runtime = self.runtimes.get(model)
        self.last_call_at = self.clock.now()
        req: CoreRequest | None = None
        try:
            if not self.accepting:
                raise Unavailable(SHUTTING_DOWN)
            self._known(call.tenant)
            pool = self.pool
            if pool.gave_up:
                raise Unavailable(f"Triton has been unavailable for {pool.outage_s:.0f} s")
            if runtime is None:
                info = self.models.cached(model)
                if info is None:
                    # A shell validated the call against this model, so Triton served it
                    # a moment ago: look it up again (a rare path, e.g. after a restart).
                    req = self._new_request(call, route, None)
                    self._spawn(self._admit_later(req, route, lookup=True))
                    return req
                runtime = self._runtime(model, info)
            req = self._new_request(call, route, runtime)
            if not judged:
                self._throttle(runtime, req)
            decision = self.accounting.check_now(req)
            if decision is None:  # the storage must be waited for
                self._spawn(self._admit_later(req, route, lookup=False))
                return req
            self.accounting.apply(req, decision)
            self._own_sequence(runtime, req)
            ticking = self._ticking
            runtime.submit(req, later=ticking is not None)
            if ticking is not None:
                ticking.add(runtime)
            return req
        except FrontendError as err:
            route.answer(Answer(call.id, fault=Fault.of(err, req.quota if req else None)))
            if req is not None:
                self.accounting.charge_back_limits(req)  # refused after its limits counted it
            self.accounting.record(call, err.outcome, err, "", -1.0, None)
            return None

    @contextlib.contextmanager
    def tick(self) -> Iterator[None]:
        """The calls submitted within are one tick's (``shells.Intake``: one slice): each
        model's batches (or slots) are decided once, at its end, from all that the tick
        queued (``Dispatcher.settle``), not at each call. So the tick's first batch is
        assembled in fair order from every tenant's calls of the tick, not sent with
        whichever call came first while the rest were still to be read, and the decision
        costs one look per tick. Nothing waits for it: the tick is one run of the loop."""
        if self._ticking is not None:  # within one already: it settles at that one's end
            yield
            return
        ticking: set[Dispatcher] = set()
        self._ticking = ticking
        try:
            yield
        finally:
            self._ticking = None
            for runtime in ticking:
                try:
                    runtime.settle()
                except Exception:
                    log.exception("settling the tick of %s failed", runtime.model)

    def judge_together(self, calls: Sequence[Call]) -> list[bool]:
        """The throttle per tick: the calls of one intake slice (``shells.Intake``), in
        the order they will be submitted; for each, whether the throttle admitted it
        already, together with its tenant's other calls of the slice for the same model
        (then ``submit(..., judged=True)`` skips the throttle).

        A tenant's calls of one slice for one model (two or more, of one priority) are
        judged as one request: their rows and tokens together, behind the queues as they
        stand before the slice, against the tightest of their deadlines. The throttle's
        decision is monotone in each of those (``EndpointAdmission.verdict``), and each
        call's own backlog, judged one by one, is its tenant's calls of the slice up to
        itself (a batch or a slot granted meanwhile moves work from the queue to Triton,
        which the wait counts alike): so where the whole is admitted, each call alone
        would have been, and the calls go in as they would have, at one decision's cost.
        Where the whole is refused, or the calls are of several priorities, each call is
        judged alone in ``submit``, as before (those that fit still go in). What the
        slice's other tenants' calls add is not counted: a slice holds at most
        ``shells.INTAKE_SLICE`` calls, all of one tick, and DRR does not order a tick's
        arrivals by arrival. The decision is recorded once for each call."""
        passed = [False] * len(calls)
        groups: dict[tuple[str, str], list[int]] = {}
        for i, call in enumerate(calls):
            key = (call.tenant, call.request.model)
            members = groups.get(key)
            if members is None:
                groups[key] = [i]
            else:
                members.append(i)
        if len(groups) == len(calls) or self.slo.classes:
            # One call each, or SLO classes: each call judged one by one (each its own
            # class's target, and its own predicted time to first token).
            return passed
        now = self.clock.now()
        for (tenant, model), members in groups.items():
            if len(members) < 2 or tenant not in self.tenants:
                continue
            runtime = self.runtimes.get(model)
            if runtime is None:
                continue  # looked up first (``_admit_later``), then judged alone
            admission = runtime.admission
            if admission is None or not admission.throttles:
                continue
            priority = calls[members[0]].priority
            rows = tokens = 0
            remaining_s: float | None = None
            for i in members:
                call = calls[i]
                if call.priority != priority:
                    break
                rows += call.rows
                tokens += _scheduled_tokens(call, runtime)
                if call.deadline is not None:
                    left = call.deadline - now
                    remaining_s = left if remaining_s is None else min(remaining_s, left)
            else:
                decision = self._decide(
                    runtime, admission, tenant, priority, rows, tokens, remaining_s
                )
                if decision.admitted:
                    self.observer.throttle_decision(
                        model=model, decision=decision, count=len(members)
                    )
                    for i in members:
                        passed[i] = True
        return passed

    def submit_group(self, group: Group, route: Route) -> list[CoreRequest] | None:
        """Take the parts of one API call (``records.Group``) through admission together,
        all into their model's queue or none: the throttle judges the call by its first
        part (whether the call can start within its target: its later parts wait behind
        it by its own doing, as a long generation's tokens do), the tenant's rate limits
        count the call's request once and every part's tokens in one check, and the
        queue caps take every part at once (``Scheduler.enqueue_all``). A refusal answers
        every part with it, and records each. Returns the queued parts (each to
        ``cancel``), or None when the call was answered at once (refused)."""
        calls = group.calls
        head = calls[0]
        model = head.request.model
        runtime = self.runtimes.get(model)
        self.last_call_at = self.clock.now()
        reqs: list[CoreRequest] = []
        try:
            if not self.accepting:
                raise Unavailable(SHUTTING_DOWN)
            _one_call(calls)
            self._known(head.tenant)
            pool = self.pool
            if pool.gave_up:
                raise Unavailable(f"Triton has been unavailable for {pool.outage_s:.0f} s")
            if runtime is None:
                info = self.models.cached(model)
                if info is None:  # as in ``submit``: looked up again
                    reqs = [self._new_request(c, route, None) for c in calls]
                    self._spawn(self._admit_group_later(reqs, route, lookup=True))
                    return reqs
                runtime = self._runtime(model, info)
            # The batch keys are taken as the parts are queued (``Dispatcher.submit_all``).
            reqs = [self._new_request(c, route, runtime, keyed=False) for c in calls]
            self._throttle(runtime, reqs[0])
            decision = self.accounting.check_group_now(reqs)
            if decision is None:  # the storage must be waited for
                self._spawn(self._admit_group_later(reqs, route, lookup=False))
                return reqs
            self.accounting.apply(reqs[0], decision)
            runtime.submit_all(reqs)
            return reqs
        except FrontendError as err:
            self._refuse_all(calls, reqs, route, err)
            return None

    def _refuse_all(
        self, calls: Sequence[Call], reqs: Sequence[CoreRequest], route: Route, err: FrontendError
    ) -> None:
        """Answer each part of a refused call with ``err`` (but for those whose client went
        away), correct what its limits counted, and record each."""
        quota = reqs[0].quota if reqs else None
        for i, call in enumerate(calls):
            req = reqs[i] if reqs else None
            if req is None or not req.cancelled:
                route.answer(Answer(call.id, fault=Fault.of(err, quota)))
            if req is not None:
                self.accounting.charge_back_limits(req)
            self.accounting.record(call, err.outcome, err, "", -1.0, None)

    def adopt(
        self,
        call: Call,
        route: Route,
        backend: int,
        limits_at: float = -1.0,
        produced: int = 0,
    ) -> CoreRequest | None:
        """A stream a lost core granted, still relayed by the shell of ``route`` (a
        failover): its slot on ``backend`` is held here until it ends, so the engine's
        slots stay exact across the failover. No admission: it was admitted before (its
        limits counted then, at wall time ``limits_at``; -1: not counted); when it ends,
        its token limits are corrected by what it produced (``produced`` so far, and what
        its shell reports from now on), as the core that admitted it would have. None
        where it cannot be placed (a model this core has not looked up yet is looked up
        first)."""
        runtime = self.runtimes.get(call.request.model)
        req = self._new_request(call, route, runtime)
        req.limits_at = limits_at if limits_at >= 0 else None
        req.produced = max(0, produced)
        if runtime is not None:
            return req if runtime.adopt(req, backend) else None
        self._spawn(self._adopt_later(req, backend))
        return req

    async def _adopt_later(self, req: CoreRequest, backend: int) -> None:
        model = req.request.model
        try:
            info = await self.models.get(model)
            runtime = self.runtimes.get(model)  # another call may have made it meanwhile
            if runtime is None:
                runtime = self._runtime(model, info)
        except FrontendError as err:
            log.warning("a running stream of %s cannot be held here: %s", model, err)
            return
        if not req.answered and not req.cancelled:
            req.shape_key = batch_key(req.request, runtime.plan)
            req.runtime = runtime
            runtime.adopt(req, backend)

    async def precharge(
        self, tenant: str, model: str, *, requests: int, tokens: int
    ) -> tuple[float | None, Quota | None]:
        """Count what a request's text costs at least against its tenant's limits, before
        its shell tokenises it (``records.Precharge``; ``Accounting.precharge``): the
        wall time it was counted at (None: not counted) and the quota after. Raises the
        429 where it does not fit, and what admission would raise for a core that is
        stopping or a tenant a reload removed."""
        if not self.accepting:
            raise Unavailable(SHUTTING_DOWN)
        self._known(tenant)
        return await self.accounting.precharge(tenant, model, requests=requests, tokens=tokens)

    def cancel(self, req: CoreRequest) -> None:
        """The client of ``req`` went away (it is answered no more)."""
        runtime = req.runtime
        if req.state is QueueState.NEW:  # admission still running: it stops there
            req.cancelled = True
        elif runtime is not None:
            runtime.cancel(req)

    def produced(
        self,
        req: CoreRequest,
        tokens: int,
        first_token_s: float = -1.0,
        gaps: Gaps = NO_GAPS,
    ) -> None:
        """The stream of granted ``req`` relayed ``tokens`` output tokens (its shell says
        so, with their times at the client: ``first_token_s`` since arrival if the first
        is among them, else -1, and the gaps between them, binned: ``records.Gaps``):
        charged to its tenant, and observed, as a record of one report (``produced_all``)."""
        times = [(req.tenant, req.call.request.model, *gaps)] if gaps[1] else []
        self.produced_all(((req, tokens, first_token_s),), times)

    def produced_all(
        self,
        reports: Iterable[tuple[CoreRequest, int, float]],
        gaps: Sequence[tuple[str, str, float, list[int]]] = (),
    ) -> None:
        """``produced`` for each report of one record (a shell's ``Produced``: its streams'
        tokens of one tick), counted per stream, charged and observed per tenant and
        program: one charge and one observation for the tick's tokens of each, not one
        per stream, and each model is asked once, after them all, whether a slot waits
        on the charges (``Dispatcher.charged``). The charges are the
        sums of those ``produced`` makes one by one, at the same moment of the core's
        clock, with no decision between them: the fairness bounds
        (``tests/core/test_report_delays.py``) are the same. ``gaps``: the record's
        inter-token times, binned by its shell per tenant and model, observed as they
        come (one observation per tenant and model, not one per token or stream)."""
        # (runtime, tenant, program) -> [cost (None: not charged), tokens]
        groups: dict[tuple[Dispatcher, str, str], list[Any]] = {}
        observe = self.observer.tokens_produced
        for req, tokens, first_token_s in reports:
            runtime = req.runtime
            if runtime is None or req.answered or tokens <= 0:
                continue
            cost = runtime.count_report(req, tokens)
            key = (runtime, req.tenant, req.program)
            group = groups.get(key)
            if group is None:
                groups[key] = [cost, tokens]
            else:
                if cost is not None:
                    group[0] += cost
                group[1] += tokens
            if first_token_s >= 0:
                observe(tenant=req.tenant, model=runtime.model, tokens=0,
                        first_token_s=first_token_s)  # fmt: skip
                self.accounting.first_token(req, first_token_s)
        for tenant, model, total_s, bins in gaps:
            observe(tenant=tenant, model=model, tokens=0, first_token_s=None,
                    inter_token=(total_s, bins))  # fmt: skip
        if not groups:
            return
        now = self.clock.now()
        charged: list[Dispatcher] = []
        for (runtime, tenant, program), (cost, tokens) in groups.items():
            observe(tenant=tenant, model=runtime.model, tokens=tokens, first_token_s=None)
            if cost is None:
                continue  # its output is not counted here (``count_report``)
            if cost:
                runtime.scheduler.charge_back(tenant, cost, program, now)
            if runtime not in charged:
                charged.append(runtime)
        for runtime in charged:
            runtime.charged()

    def stream_ended(
        self,
        req: CoreRequest,
        version: str,
        err: FrontendError | None,
        cancelled: bool,
    ) -> None:
        """The stream of granted ``req`` ended (its shell, once, after reporting all its
        tokens): served, the error its client was answered with, or ``cancelled``."""
        runtime = req.runtime
        if runtime is not None:
            runtime.ended(req, version, err, cancelled)

    def rows_done(self, done: RowsDone, route: Route) -> None:
        """A shell's report on its part of a granted batch (``core.granted``)."""
        runtime = self.runtimes.get(done.model)
        if runtime is not None:
            runtime.rows_done(route, done)

    def drop_route(self, route: Route) -> int:
        """A shell went away: drop every request whose answer would go to it."""
        dropped = 0
        for runtime in list(self.runtimes.values()):
            dropped += runtime.drop(route)
        return dropped

    def tally(self, tally: Tally) -> None:
        """Requests a shell answered itself (refused before they reached the core)."""
        for e in tally.entries:
            if e.door == CONNECTION_DOOR:  # connections the shell closed, not requests
                self.metrics.connection_refused(e.model, e.outcome, e.count)
                continue
            if e.door:  # a side door's calls, not requests
                self.metrics.side_door(e.tenant, e.door, e.outcome, e.count)
                continue
            self.metrics.requests_answered(e.tenant, e.model, Outcome(e.outcome), e.count)
            if e.failed_version is not None:
                self.stats.failures(e.model, e.failed_version, e.failed_s, e.count)

    async def model_info(self, model: str) -> ModelInfo:
        info = await self.models.get(model)
        self._runtime(model, info)  # ready before the shell's first call arrives
        return info

    # ---- admission ----------------------------------------------------------------------

    def _new_request(
        self, call: Call, route: Route, runtime: Dispatcher | None, *, keyed: bool = True
    ) -> CoreRequest:
        """The core's request for ``call``; its batch key taken now where ``keyed`` (and
        the runtime is there), else left None for whoever queues it. A model whose
        requests go one per batch (engine mode, decoupled, not batching: the plan's
        ``max_batch_size`` 0) never compares keys: none is taken."""
        if call.key and runtime is not None and not runtime.takes_facts:
            # Its shell kept the tensors for an endpoint this core relays: the shell and
            # the core read different configs (the plan is the same function of it).
            raise Internal(f"model '{runtime.model}' takes whole calls here, not their facts")
        slo = self.slo.resolve(call.tenant, call.slo_class)
        priority = call.priority
        if slo is not None and not slo.interactive:
            # Batch work takes the slack: inside its tenant, below every level
            # (``admission.slo``, "Order").
            priority += self.config.priority_levels
        return CoreRequest(
            call.tenant,
            call.rows,
            _scheduled_tokens(call, runtime),
            call.nbytes,
            priority,
            call.deadline,
            _shape_key(call, runtime) if keyed or call.key else None,
            call.program,
            call=call,
            route=route,
            runtime=runtime,
            slo=slo,
        )

    def _throttle(self, runtime: Dispatcher, req: CoreRequest) -> None:
        """Reject at once (503 + Retry-After) what cannot be served within its target."""
        admission = runtime.admission
        if admission is None or not admission.throttles:
            return
        # The time left to its deadline, not its whole timeout: the time it already
        # spent in its shell and on the way here is gone (one clock: ``Call.arrived``).
        deadline = req.call.deadline
        remaining_s = None if deadline is None else deadline - self.clock.now()
        elapsed = max(0.0, self.clock.now() - req.call.arrived)
        decision = self._decide(
            runtime,
            admission,
            req.tenant,
            req.priority,
            req.rows,
            req.tokens,
            remaining_s,
            req.slo,
            elapsed,
            req.program,
        )
        self.observer.throttle_decision(model=runtime.model, decision=decision)
        if not decision.admitted:
            raise overloaded_error(decision, runtime.model)
        if req.slo is not None and req.slo.interactive:
            req.predicted_ttft_s = admission.predicted_ttft_s(decision, elapsed)

    def _decide(
        self,
        runtime: Dispatcher,
        admission: EndpointAdmission,
        tenant: str,
        priority: int,
        rows: int,
        tokens: int,
        remaining_s: float | None,
        slo: SloClass | None = None,
        elapsed_s: float = 0.0,
        program: str | None = None,
    ) -> ThrottleDecision:
        """The throttle's decision for ``rows`` and ``tokens`` of ``tenant`` at
        ``priority`` (a call of ``program``, or a tenant's calls of one tick: None) of
        SLO class ``slo``, unrecorded."""
        # An engine's throttle also weighs the slots the tenant holds already, and its
        # light slots, which a call of a program holding none may take out of turn.
        own = runtime.in_engine(tenant)
        light = None
        if program is not None and isinstance(runtime, EngineDispatcher):
            light = runtime.light_place(tenant, program)
        decision = admission.admit(
            runtime.scheduler,
            runtime.inflight,
            tenant=tenant,
            tier=self._tier(tenant),
            priority=priority,
            rows=rows,
            tokens=tokens,
            remaining_s=remaining_s,
            own_inflight=own,
            slo=slo,
            elapsed_s=elapsed_s,
            program=program,
            light=light,
        )
        assert decision is not None  # the caller checked that the endpoint throttles
        return decision

    def _known(self, tenant: str) -> None:
        """Refuse a tenant a reload removed (its identity was checked before the reload: a
        shell's, or before an await in admission) as identity would refuse it now."""
        if tenant not in self.tenants:
            raise Unauthenticated(REMOVED_TENANT)

    async def _set_up(self, model: str, tenant: str) -> Dispatcher:
        """The dispatcher of ``model`` for a call of ``tenant`` that came before the model
        was set up: set up since by another call's lookup, else looked up now."""
        runtime = self.runtimes.get(model)
        if runtime is None:
            runtime = self._runtime(model, await self.models.get(model))
            self._known(tenant)  # a reload may have removed it meanwhile
        return runtime

    async def _admit_later(self, req: CoreRequest, route: Route, *, lookup: bool) -> None:
        """The rest of admission, where it must wait: a model lookup, a rate-limit storage."""
        call = req.call
        try:
            model = call.request.model
            runtime = req.runtime
            if runtime is None:  # its model was not set up when it came
                runtime = await self._set_up(model, req.tenant)
                # Its batch key and the tokens the scheduler charges were taken without
                # the dispatcher (the input and the output asked for): taken again now.
                req.shape_key = _shape_key(call, runtime)
                req.tokens = _scheduled_tokens(call, runtime)
                req.runtime = runtime
            if lookup:
                self._throttle(runtime, req)
            decision = self.accounting.check_now(req)
            if decision is None:
                decision = await self.accounting.check(req)
            self.accounting.apply(req, decision)
            if req.cancelled:
                self.accounting.charge_back_limits(req)
                self.accounting.record(call, Outcome.CANCELLED, None, "", -1.0, None)
                return
            if not self.accepting:
                raise Unavailable(SHUTTING_DOWN)
            self._own_sequence(runtime, req)
            self._known(req.tenant)  # a reload may have removed it during the check
            runtime.submit(req)
        except FrontendError as err:
            if not req.cancelled:
                route.answer(Answer(call.id, fault=Fault.of(err, req.quota)))
            self.accounting.charge_back_limits(req)
            self.accounting.record(call, err.outcome, err, "", -1.0, None)
        except Exception as err:
            log.exception("internal error admitting a request to %s", call.request.model)
            error = Internal(f"internal error: {type(err).__name__}")
            if not req.cancelled:
                route.answer(Answer(call.id, fault=Fault.of(error)))
            self.accounting.charge_back_limits(req)
            self.accounting.record(call, Outcome.FAILED, error, "", -1.0, None)

    async def _admit_group_later(
        self, reqs: list[CoreRequest], route: Route, *, lookup: bool
    ) -> None:
        """``_admit_later`` for the parts of one call (``submit_group``): all or none."""
        head = reqs[0]
        calls = [r.call for r in reqs]
        try:
            model = head.request.model
            runtime = head.runtime
            if runtime is None:  # its model was not set up when it came
                runtime = await self._set_up(model, head.tenant)
                for req in reqs:  # (the batch keys: as they are queued)
                    req.tokens = _scheduled_tokens(req.call, runtime)
                    req.runtime = runtime
            if lookup:
                self._throttle(runtime, head)
            decision = self.accounting.check_group_now(reqs)
            if decision is None:
                decision = await self.accounting.check_group(reqs)
            self.accounting.apply(head, decision)
        except FrontendError as err:
            self._refuse_all(calls, reqs, route, err)
            return
        except Exception as err:
            log.exception("internal error admitting a call to %s", head.request.model)
            self._refuse_all(calls, reqs, route, Internal(f"internal error: {type(err).__name__}"))
            return
        # Admitted: parts whose client went away during the check end here (the shell
        # cancels a call's parts together); the others queue together.
        live = []
        for req in reqs:
            if req.cancelled:
                self.accounting.charge_back_limits(req)
                self.accounting.record(req.call, Outcome.CANCELLED, None, "", -1.0, None)
            else:
                live.append(req)
        if not live:
            return
        try:
            if not self.accepting:
                raise Unavailable(SHUTTING_DOWN)
            self._known(head.tenant)  # a reload may have removed it during the check
            runtime.submit_all(live)
        except FrontendError as err:
            self._refuse_all([r.call for r in live], live, route, err)

    def _own_sequence(self, runtime: Dispatcher, req: CoreRequest) -> None:
        """A stateful model's request goes under the frontend's id for its tenant's
        sequence, never the client's (``core.sequences``); mapped last, once admitted."""
        request = req.request
        if runtime.info.sequence_batching and request.sequence:
            request.sequence = self.sequences.assign(
                runtime.model,
                req.tenant,
                request.sequence,
                idle_s=runtime.info.sequence_idle_s,
                now=self.clock.now(),
            )

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._admitting.add(task)
        task.add_done_callback(self._admitting.discard)

    def _tier(self, tenant: str) -> str:
        terms = self.tenants.get(tenant)
        return terms.tier if terms is not None else ""

    # ---- endpoints ----------------------------------------------------------------------

    def _runtime(self, model: str, info: ModelInfo) -> Dispatcher:
        runtime = self.runtimes.get(model)
        if runtime is None:
            plan = endpoint_plan(self.config, model, info)
            endpoint = plan.endpoint
            service = service_model(plan, self.config)
            cost_model = None
            if endpoint.normalize_cost:
                cost_model = FeedbackCost(cost_model_for(plan.cost), service)
            engine = plan.engine  # engine mode: the model batches inside
            # The batch throttle predicts waits from batch times, one batch after another;
            # an engine serves max_inflight requests at once: its throttle predicts the
            # wait for a slot from how long requests hold theirs.
            throttled = endpoint.throttle and not engine
            admission = EndpointAdmission(
                service=service,
                throttle=batch_throttle(plan, len(self.pool)) if throttled else None,
                tiers=tuple(self.config.tiers),
                strict_tiers=self.config.scheduling == "fair",
                tier_shares=TierShares(
                    batch_rows=plan.max_batch_size or 1, batch_tokens=endpoint.max_batch_tokens
                ),
                engine=(
                    engine_throttle(plan, backends=len(self.pool))
                    if engine and endpoint.throttle
                    else None
                ),
                slot_times=SlotTimes.for_slots((plan.slots if engine else 1) * len(self.pool)),
                slo_classes=self.slo if self.slo.classes else None,
            )
            runtime = DISPATCH_MODES[plan.mode](
                plan=plan,
                scheduler=Scheduler(
                    plan.policy,
                    self.tenants,
                    self.caps,
                    mode=self.config.scheduling,
                    cost_model=cost_model,
                ),
                pool=self.pool,
                clock=self.clock,
                admission=admission,
                on_batches=self.accounting.on_batches,
                on_done=self.accounting.on_done,
                on_tokens=self.accounting.on_tokens,
                on_served=self.accounting.on_served,
                silent_after_s=self.config.triton.request_timeout_s
                + self.config.queues.stalled_stream_s
                + SILENT_MARGIN_S,
            )
            runtime.traces = self.traces
            self.runtimes[model] = runtime
            self.carried.set_up(model, runtime)
        return runtime

    # ---- feedback from Triton's metrics -------------------------------------------------

    async def start(self) -> None:
        """Learn the configured endpoints' models (best effort: a model Triton does not
        serve yet is looked up on first use) and start reading Triton's metrics."""
        for model in self.config.endpoints:
            try:
                await self.model_info(model)
            except FrontendError as err:
                log.warning("endpoint %s: not served by Triton yet (%s)", model, err.message)
        url = self.config.triton.first_metrics_url()
        if url:
            self.backend_metrics = metrics_reader(
                url,
                interval_s=self.config.triton.metrics_interval_s,
                on_delta=self._on_triton_delta,
                on_scrape=self._on_scrape,
            )
            self.backend_metrics.start()

    def _on_triton_delta(self, delta: TritonDelta) -> None:
        runtime = self.runtimes.get(delta.model)
        if runtime is not None and runtime.admission is not None:
            runtime.admission.service.observe_triton(delta)

    def _on_scrape(self, at: float, ok: bool) -> None:
        for runtime in list(self.runtimes.values()):
            if runtime.admission is not None:
                runtime.admission.service.tick(at)

    def state_samples(self) -> list[tuple[str, dict[str, str], float]]:
        """Live gauges for the metrics port: queue depths, deficits, in-flight batches,
        the fairness window's figures."""
        pool = self._pool
        available = pool is None or pool.available
        out: list[tuple[str, dict[str, str], float]] = [
            ("fair_backend_available", {}, 1.0 if available else 0.0)
        ]
        names = self.backend_names
        for name, backend in zip(names, pool.backends if pool is not None else (), strict=False):
            up = 1.0 if backend.available else 0.0
            out.append(("fair_triton_backend_available", {"backend": name}, up))
        label = self.metrics.tenant_label
        now = self.clock.now()
        for model, rt in list(self.runtimes.items()):
            sched = rt.scheduler
            out.append(("fair_inflight_batches", {"endpoint": model}, float(rt.inflight)))
            for name, running in zip(names, rt.running, strict=True):
                out.append(
                    (
                        "fair_triton_backend_inflight",
                        {"endpoint": model, "backend": name},
                        float(running),
                    )
                )
            for tier, depth in sched.tier_depths().items():
                out.append(("fair_queue_depth", {"endpoint": model, "tier": tier}, float(depth)))
            gauge = sched.fairness.gauge
            if gauge is not None:
                for tenant, deficit in sched.deficits().items():
                    out.append((gauge, {"endpoint": model, "tenant": label(tenant)}, deficit))
            out.extend(window_samples(model, sched.window(now), label))
            if rt.admission is not None and rt.admission.slo_classes is not None:
                out.extend(slo_samples(model, rt.admission.slo.window(now), label))
            if rt.admission is not None:
                out.extend(rt.admission.service.status().samples())
        return out

    # ---- config, statistics, shutdown ---------------------------------------------------

    def reload(self, config: Config, keyring: KeyRing | None = None) -> list[str]:
        """Apply a new config without dropping a request; say loudly what waits for a restart.

        Applied at once (``LIVE_SECTIONS``): tenants and their API keys (inline, files,
        environment: read again), rate limits, who may call which model (``tier_models``
        and the tenants' lists: the shells ask), identity (``auth``), priority levels, the
        global queue caps, and the rate limiter's ``on_storage_error``. A tenant's weight,
        tier and caps apply once its queue has drained (the scheduler's snapshot rule).
        Every other change (endpoints, scheduling, listeners, Triton, tier_guard,
        observability, the rate-limit storage and its timeout, and any section added
        later) needs a restart: its running value is kept, ``self.config`` says what
        runs, and each such key is logged as an error and returned in the notes. Raises
        ``ConfigError`` (and changes nothing) if the new keys cannot be loaded, the tiers
        changed, or the config with the running values kept is not valid.
        """
        if list(config.tiers) != list(self.config.tiers):
            raise ConfigError("(reload)", ["tiers changed: restart the frontend to apply"])
        kept = restart_only_changes(self.config, config)
        config = with_running_values(self.config, config, kept)
        keyring = keyring or KeyRing.from_config(config)  # raises before anything changes
        self.tenants.update(config.tenants)
        for gone in set(self.tenants) - set(config.tenants):
            del self.tenants[gone]
        self.shedding.reload()
        self.keyring = keyring
        self.caps.configure(queue_limits(config.queues))
        self.limiter.on_storage_error = config.rate_limiting.on_storage_error
        self.config = config
        self.metrics.config = config  # tier labels of new or moved tenants
        self.accounting.reload(config)
        notes = [f"{key} changed: restart the frontend to apply" for key in kept]
        if notes:
            log.error(
                "reload: not applied, the running values are kept until a restart: %s",
                "; ".join(notes),
            )
        log.info("reloaded: %d tenants, %d API keys", len(config.tenants), keyring.size)
        return notes

    async def statistics(self, model: str = "", version: str = "") -> Any:
        """Triton's ``ModelStatisticsResponse`` for what went through the frontend."""
        msg = self.stats.message(model, version)
        if model and not msg.model_stats:
            info = await self.models.get(model)  # unknown model: Triton's error
            if version and version not in info.versions:
                raise InvalidArgument(
                    f"requested model version is not available for model '{model}'"
                )
            return self.stats.empty(model, version or info.latest_version)
        return msg

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop accepting; finish what is queued and in flight within ``grace_s``; answer
        what is still queued then with UNAVAILABLE, and so, at ``grace_s``, whatever is
        still in a Triton that has not answered or held for one that is unreachable:
        nothing is left unanswered when this returns."""
        self.accepting = False
        # Real time, not ``clock``: the wait is the loop's (it sleeps, and each runtime's
        # drain waits on the loop's clock), and a fake clock would never reach its end.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._admitting or not all(rt.idle for rt in self.runtimes.values()):
            if loop.time() >= deadline or not self.pool.available:
                break
            await asyncio.sleep(0.02)
        err = Unavailable(SHUTTING_DOWN)
        left = sum(rt.fail_queued(err) for rt in self.runtimes.values())
        if left:
            log.warning("shutdown: answered %d still-queued requests with UNAVAILABLE", left)
        for runtime in self.runtimes.values():
            await runtime.drain(max(0.0, deadline - loop.time()), err)
        await self.pool.close()
        if self.backend_metrics is not None:
            await self.backend_metrics.stop()
        await self.limiter.close()
        if self.traces is not None:  # the last spans out (off the loop: a blocking flush)
            await asyncio.to_thread(self.traces.flush)


# What a reload applies at once (``Core.reload``); every other section, and any added
# later, keeps its running value until a restart, and the reload says so.
LIVE_SECTIONS = frozenset(
    {"tenants", "tier_limits", "tier_models", "auth", "priority_levels", "queues"}
)
# Sections applied in part: these fields at once, the section's others at a restart.
LIVE_FIELDS: dict[str, frozenset[str]] = {"rate_limiting": frozenset({"on_storage_error"})}
# Not applied, and refused outright: tenants name tiers, so the rest cannot apply alone.
REFUSED_SECTIONS = frozenset({"tiers"})


def restart_only_changes(running: Config, new: Config) -> list[str]:
    """The keys whose change ``new`` asks for but only a restart applies (dotted names)."""
    kept: list[str] = []
    for name in Config.model_fields:
        if name in LIVE_SECTIONS or name in REFUSED_SECTIONS:
            continue
        old_value, new_value = getattr(running, name), getattr(new, name)
        live = LIVE_FIELDS.get(name)
        if live is None:
            if old_value != new_value:
                kept.append(name)
            continue
        for field in type(old_value).model_fields:
            if field not in live and getattr(old_value, field) != getattr(new_value, field):
                kept.append(f"{name}.{field}")
    return kept


def with_running_values(running: Config, new: Config, kept: Sequence[str]) -> Config:
    """``new`` with the ``kept`` keys at their running values, validated again (a live
    change may not fit a kept value: ``ConfigError``)."""
    if not kept:
        return new
    data = new.model_dump(mode="json")
    old = running.model_dump(mode="json")
    for key in kept:
        section, _, field = key.partition(".")
        if field:
            data[section][field] = old[section][field]
        else:
            data[section] = old[section]
    return parse_config(data, "(reload, with the running values of what needs a restart)")


def _one_call(calls: Sequence[Call]) -> None:
    """The parts of a ``Group`` are one call's: one tenant and model, none streamed."""
    head = calls[0]
    for call in calls:
        if call.tenant != head.tenant or call.request.model != head.request.model or call.stream:
            raise Internal("a group of calls must be one tenant's, for one model, not streamed")


def _shape_key(call: Call, runtime: Dispatcher | None) -> Any:
    """Which calls may share a batch (``batching.batch_key``): the key its shell took,
    where it kept the tensors (``Call.key``), else taken here (None: no runtime yet)."""
    if call.key:
        return call.key
    if runtime is None or not runtime.plan.max_batch_size:
        return None  # no runtime yet, or one request per batch: keys never compared
    return batch_key(call.request, runtime.plan)


def _scheduled_tokens(call: Call, runtime: Dispatcher | None) -> int:
    """The tokens the scheduler charges at dispatch (``Dispatcher.scheduled_tokens``; no
    runtime yet: the input and the output asked for)."""
    return call.tokens if runtime is None else runtime.scheduled_tokens(call)
