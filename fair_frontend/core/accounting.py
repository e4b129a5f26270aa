"""What each request counts against, and its record once it ends.

A request is counted in three places, each exactly: its tenant's rate limits (checked at
admission against the tokens it asked for, ``check_now`` / ``check`` / ``apply``, and
corrected by what it produced once it ends, ``charge_back_limits``); its tenant's fair
share in its model's scheduler (charged back as its output tokens are counted,
``on_tokens``); and its outcome (``record``: the statistics and the observers, once per
request, whatever path it took; the served rows of one batch part together, each counted
as alone, ``on_served``). ``Core`` holds one ``Accounting``, calls it from admission and
hands its ``on_done``, ``on_served``, ``on_tokens`` and ``on_batches`` to every dispatcher.

The parts of one API call (``records.Group``) are checked together, once: the call's
request and every part's tokens (``check_group_now``). A request whose text its shell
tokenised paid before (``precharge``: its request and the tokens its text has at least,
counted then); its admission counts the rest, and gives back what the precharge counted
beyond its tokens (``Call.precharged``). Refused after the precharge, it stays paid.

Two clocks, both injected: ``now`` (the core's monotonic clock) for latencies, ``wall``
for the rate limits' windows, which replicas on other hosts share through their storage.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fair_frontend.admission import (
    RateLimiter,
    RateLimitItem,
    items_from_limits,
    limit_key,
    rate_limited_error,
)
from fair_frontend.admission.ratelimit import Decision, StorageUnavailable
from fair_frontend.admission.slo import prediction_error
from fair_frontend.config import Config, CostUnit
from fair_frontend.core.dispatch import CoreRequest, Dispatcher
from fair_frontend.core.stats import Statistics
from fair_frontend.errors import FrontendError, UnknownModel
from fair_frontend.models import ModelInfo
from fair_frontend.observability.observe import BatchReport, Finished, Observer
from fair_frontend.outcomes import Outcome
from fair_frontend.quota import Quota
from fair_frontend.usage import Usage
from fair_frontend.wire.records import Call

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

    from fair_frontend.observability.tracing import Traces

_NO_LIMITS = Decision(True)


def _cost(reqs: Sequence[CoreRequest]) -> tuple[int, int]:
    """What admission counts of a request (or of the parts of one call, together):
    its ``requests``, and its tokens less what a precharge counted of them already."""
    requests = tokens = precharged = 0
    for r in reqs:
        call = r.call
        requests += call.requests
        tokens += call.tokens
        precharged += call.precharged
    return requests, max(0, tokens - precharged)


def _end(
    call: Call,
    outcome: Outcome,
    err: FrontendError | None,
    queued_s: float,
    latency_s: float,
    service_s: float | None,
    produced: int,
) -> Finished:
    """A request's end as the observers hear it (``queued_s`` < 0: never queued)."""
    return Finished(
        call.tenant,
        call.request.model,
        outcome,
        queued_s if queued_s >= 0 else None,
        call.request.id,
        latency_s,
        err.message if err is not None else None,
        Usage(call.tokens - call.max_tokens, produced),
        service_s,
    )


class Accounting:
    """A request's rate limits, its fair-share charge-back and the record of its outcome."""

    def __init__(
        self,
        config: Config,
        *,
        limiter: RateLimiter,
        observer: Observer,
        request_log: Observer,
        stats: Statistics,
        runtimes: Mapping[str, Dispatcher],
        known_model: Callable[[str], ModelInfo | None],
        tier_of: Callable[[str], str],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
        now: Callable[[], float],
        wall: Callable[[], float],
    ) -> None:
        self.config = config
        self.limiter = limiter
        self.observer = observer
        self.request_log = request_log  # a line per request no shell logs (``Call.logged``)
        self.stats = stats
        self.runtimes = runtimes  # the core's, read as they are added
        self.known_model = known_model  # the model's config if it was looked up
        self.tier_of = tier_of
        self.spawn = spawn  # a correction the storage must be waited for
        self.now = now
        self.traces: Traces | None = None  # request traces, where configured (the core's)
        self.wall = wall
        self._limit_items: dict[tuple[str, str], list[RateLimitItem]] = {}

    def reload(self, config: Config) -> None:
        """Count by ``config``'s tenants and limits from now on."""
        self.config = config
        self._limit_items.clear()

    # ---- rate limits --------------------------------------------------------------------

    def _limits(self, req: CoreRequest) -> list[RateLimitItem]:
        return self._items(req.tenant, req.request.model)

    def _items(self, tenant: str, model: str) -> list[RateLimitItem]:
        key = (tenant, model)
        if tenant not in self.config.tenants:
            return []  # removed by a reload: admission refuses it, a charge-back is moot
        items = self._limit_items.get(key)
        if items is None:
            items = items_from_limits(self.config.limits_for(*key))
            self._limit_items[key] = items
        return items

    def check_now(self, req: CoreRequest) -> Decision | None:
        """The rate-limit decision, if the storage answers without waiting (memory)."""
        return self.check_group_now((req,))

    async def check(self, req: CoreRequest) -> Decision:
        """The rate-limit decision, once the storage answers (Redis)."""
        return await self.check_group((req,))

    def check_group_now(self, reqs: Sequence[CoreRequest]) -> Decision | None:
        """``check_now`` for the parts of one call (``records.Group``), all in one check:
        the call's request (the parts' ``requests``: 1 in all) and every part's tokens,
        so that the call fits its limits whole or is refused whole."""
        head = reqs[0]
        items = self._limits(head)
        if not items:
            return _NO_LIMITS
        now = self.wall()
        requests, tokens = _cost(reqs)
        decision = self.limiter.check_now(
            limit_key(head.tenant, head.request.model),
            items,
            requests=requests,
            tokens=tokens,
            now=now,
        )
        self._counted(reqs, decision, now)
        return decision

    async def check_group(self, reqs: Sequence[CoreRequest]) -> Decision:
        """``check_group_now`` once the storage answers (Redis)."""
        head = reqs[0]
        try:
            now = self.wall()
            requests, tokens = _cost(reqs)
            decision = await self.limiter.check(
                limit_key(head.tenant, head.request.model),
                self._limits(head),
                requests=requests,
                tokens=tokens,
                now=now,
            )
            self._counted(reqs, decision, now)
            return decision
        except StorageUnavailable as err:  # not answered, and the mode is fail_closed
            self.observer.rate_limit_degraded(
                tenant=head.tenant,
                model=head.request.model,
                mode="fail_closed",
                reason=err.reason,
            )
            raise

    def _counted(self, reqs: Sequence[CoreRequest], decision: Decision | None, now: float) -> None:
        """Remember when a request's tokens were counted against its limits (to correct
        them by what it produced); not when refused, or admitted unchecked (degraded).
        And its limits' state after the check, for its answer (``fair_frontend.quota``).
        Admitted, what a precharge counted beyond its tokens is given back."""
        if decision is None:
            return
        for req in reqs:
            req.quota = decision.quota
            if decision.allowed and not decision.degraded:
                req.limits_at = now
        if decision.allowed:
            self._settle_precharge(reqs, now)

    def _settle_precharge(self, reqs: Sequence[CoreRequest], now: float) -> None:
        """Give back what a precharge (``records.Precharge``) counted beyond the tokens the
        request turned out to have (a bound from its text's bytes that the tokens did not
        reach: a rerank's documents cut to the model's context), from the window it was
        counted in. What it counted up to them stands: admission counted only the rest."""
        head = reqs[0]
        precharged = sum(r.call.precharged for r in reqs)
        surplus = precharged - sum(r.call.tokens for r in reqs)
        at = head.call.precharged_at
        if surplus <= 0 or not at:
            return
        items = self._limits(head)
        key = limit_key(head.tenant, head.request.model)
        if not self.limiter.adjust_now(key, items, tokens=-surplus, admitted_at=at, now=now):
            self.spawn(self.limiter.adjust(key, items, tokens=-surplus, admitted_at=at, now=now))

    async def precharge(
        self, tenant: str, model: str, *, requests: int, tokens: int
    ) -> tuple[float | None, Quota | None]:
        """Count ``requests`` and ``tokens`` against the tenant's limits on ``model`` now,
        before its shell tokenises a request's text (``records.Precharge``): the wall
        time they were counted at, and the limits' state after (None, None: nothing was
        counted: no limits, or the storage did not answer and ``fail_open`` let it
        through). Raises the 429 where they do not fit (``StorageUnavailable`` where the
        storage did not answer and the mode is ``fail_closed``)."""
        items = self._items(tenant, model)
        if not items:
            return None, None
        key = limit_key(tenant, model)
        now = self.wall()
        decision = self.limiter.check_now(key, items, requests=requests, tokens=tokens, now=now)
        if decision is None:
            try:
                decision = await self.limiter.check(
                    key, items, requests=requests, tokens=tokens, now=now
                )
            except StorageUnavailable as err:
                self.observer.rate_limit_degraded(
                    tenant=tenant, model=model, mode="fail_closed", reason=err.reason
                )
                raise
        if decision.degraded:
            self.observer.rate_limit_degraded(
                tenant=tenant,
                model=model,
                mode="fail_open",
                reason=decision.storage_error or "error",
            )
            return None, None
        if not decision.allowed:
            assert decision.violated is not None
            self.observer.rate_limit_hit(tenant=tenant, model=model, limit=str(decision.violated))
            raise rate_limited_error(decision, tenant=tenant, endpoint=model)
        return now, decision.quota

    def apply(self, req: CoreRequest, decision: Decision) -> None:
        """Count a check the storage did not answer (fail_open admitted it); raise the 429
        of a refused one."""
        if decision.degraded:
            self.observer.rate_limit_degraded(
                tenant=req.tenant,
                model=req.request.model,
                mode="fail_open",
                reason=decision.storage_error or "error",
            )
        if not decision.allowed:
            assert decision.violated is not None
            model = req.request.model
            self.observer.rate_limit_hit(
                tenant=req.tenant, model=model, limit=str(decision.violated)
            )
            raise rate_limited_error(decision, tenant=req.tenant, endpoint=model)

    # ---- outcomes and charge-backs ------------------------------------------------------

    def first_token(self, req: CoreRequest, first_token_s: float) -> None:
        """``req``'s first output token came ``first_token_s`` after its arrival: the time
        from its slot to it is measured for its endpoint, and an interactive SLO class's
        attainment and the error of the TTFT its admission predicted are counted
        (``admission.slo``)."""
        runtime = req.runtime
        admission = runtime.admission if runtime is not None else None
        if admission is None:
            return
        ledger = admission.slo
        if req.dispatched_at is not None:
            ledger.observe_first_token(first_token_s - (req.dispatched_at - req.call.arrived))
        slo = req.slo
        if slo is None or not slo.interactive or req.slo_counted:
            return
        req.slo_counted = True
        ledger.record(req.tenant, slo.name, slo.met(first_token_s), self.now())
        if req.predicted_ttft_s is not None:
            error = prediction_error(req.predicted_ttft_s, first_token_s)
            if error is not None:
                model = req.call.request.model
                self.observer.ttft_predicted(model=model, slo_class=slo.name, error=error)

    def _slo_ended(self, req: CoreRequest, outcome: Outcome, now: float) -> None:
        """``req`` of an SLO class ended: served, its class's verdict on its whole time
        (a batch class's deadline; an interactive request that counted no first token, on
        its answer's time); expired, missed; otherwise (refused, cancelled, failed) not
        counted."""
        slo = req.slo
        if slo is None or req.slo_counted or req.runtime is None:
            return
        if outcome is Outcome.DISPATCHED:
            met = slo.met(now - req.call.arrived)
        elif outcome is Outcome.EXPIRED:
            met = False
        else:
            return
        req.slo_counted = True
        admission = req.runtime.admission
        if admission is not None:
            admission.slo.record(req.tenant, slo.name, met, now)

    def on_done(
        self, req: CoreRequest, outcome: Outcome, err: FrontendError | None, version: str
    ) -> None:
        """A queued request is answered (or its client went away): count it once."""
        now = self.now()
        if req.slo is not None:
            self._slo_ended(req, outcome, now)
        infer_s = None
        if req.dispatched_at is not None:
            infer_s = now - req.dispatched_at
        self.charge_back_limits(req)
        self.record(
            req.call,
            outcome,
            err,
            version,
            req.queued_s,
            infer_s,
            req.produced,
            req.batch_trace,
            now=now,
        )

    def on_served(self, reqs: Sequence[CoreRequest], version: str) -> None:
        """``on_done`` of each of ``reqs``, served (``Outcome.DISPATCHED``) at one moment
        of one model (the rows of a batch part its shell answered): counted as each would
        be, the statistics once for them all and the observers told together
        (``Observer.requests_finished``). The outcome's books per batch, not per request."""
        if not reqs:
            return
        now = self.now()
        model = reqs[0].call.request.model
        rows = 0
        total_s = queue_s = infer_s = 0.0
        finished: list[Finished] = []
        logged: list[Finished] = []
        traced: list[tuple[CoreRequest, float | None]] = []
        for req in reqs:
            if req.limits_at is not None:
                self.charge_back_limits(req)
            if req.slo is not None:
                self._slo_ended(req, Outcome.DISPATCHED, now)
            call = req.call
            queued_s = req.queued_s
            dispatched = req.dispatched_at
            served_s = None if dispatched is None else now - dispatched
            latency_s = now - call.arrived
            rows += call.rows
            total_s += latency_s
            queue_s += max(queued_s, 0.0)
            infer_s += served_s or 0.0
            end = _end(call, Outcome.DISPATCHED, None, queued_s, latency_s, served_s, req.produced)
            finished.append(end)
            if not call.logged:  # else its shell logs it (it answered it)
                logged.append(end)
            if call.traceparent:
                traced.append((req, served_s))
        self.stats.successes(model, version, rows, len(reqs), total_s, queue_s, infer_s)
        self.observer.requests_finished(finished)
        if logged:
            self.request_log.requests_finished(logged)
        if traced and self.traces is not None:
            for req, served_s in traced:
                self.traces.finished(
                    req.call, Outcome.DISPATCHED, None, req.queued_s, served_s, now, req.batch_trace
                )

    def on_tokens(self, req: CoreRequest, tokens: int) -> None:
        """Output tokens of a dispatched request, as they come: its tenant's fair share is
        charged for them (engine mode: as they stream; a batch endpoint in token cost: the
        difference to what was charged at enqueue), and its latency is observed."""
        runtime = req.runtime
        if runtime is None:
            return
        if runtime.plan.cost is CostUnit.TOKENS:
            cost = runtime.output_cost(req, tokens)
            runtime.scheduler.charge_back(req.tenant, cost, req.program, self.now())
        if req.ended is not None:
            return  # a granted stream: observed as its shell timed it (``produced``)
        now = self.now()
        first = req.produced == tokens
        self.observer.tokens_produced(  # an answer in one piece: its tokens at once
            tenant=req.tenant,
            model=req.request.model,
            tokens=tokens,
            first_token_s=now - req.call.arrived if first else None,
        )
        if first:
            self.first_token(req, now - req.call.arrived)

    def charge_back_limits(self, req: CoreRequest) -> None:
        """Token limits count what was produced where the endpoint counts its output
        (``token_output``; elsewhere what admission counted stands): admission counted the
        output tokens asked for (max_tokens), the difference to what came is corrected
        when the request ends, whether it ran or not (one cancelled, expired or refused
        after the check, before it was sent, produced nothing). Once: the mark goes."""
        admitted_at, req.limits_at = req.limits_at, None
        runtime = req.runtime
        if admitted_at is None or runtime is None or runtime.plan.token_output is None:
            return  # nothing was counted, or output is not counted here
        delta = req.produced - req.call.max_tokens
        if not delta:
            return
        items = self._limits(req)
        key = limit_key(req.tenant, req.request.model)
        now = self.wall()
        if not self.limiter.adjust_now(key, items, tokens=delta, admitted_at=admitted_at, now=now):
            self.spawn(
                self.limiter.adjust(key, items, tokens=delta, admitted_at=admitted_at, now=now)
            )

    def record(
        self,
        call: Call,
        outcome: Outcome,
        err: FrontendError | None,
        version: str,
        queued_s: float,
        infer_s: float | None,
        produced: int = 0,
        batch: SpanContext | None = None,
        *,
        now: float | None = None,
    ) -> None:
        """A request's outcome, once: in the statistics and to the observers, with its
        usage (``produced``: its output tokens, where the endpoint counts them); a traced
        one's time here as spans (``batch``: its batch's span, ``Traces.finished``). ``now``:
        the moment it was answered, where ``infer_s`` was measured to it (the spans' times
        are taken back from it: its dispatch is ``now - infer_s`` exactly)."""
        request = call.request
        if now is None:
            now = self.now()
        total_s = now - call.arrived
        if outcome is Outcome.DISPATCHED:
            self.stats.success(
                request.model, version, call.rows, total_s, max(queued_s, 0.0), infer_s or 0.0
            )
        elif err is not None and not isinstance(err, UnknownModel):
            failed = ModelInfo.version_for(request.version, self.known_model(request.model))
            self.stats.failure(request.model, failed, total_s)
        end = _end(call, outcome, err, queued_s, total_s, infer_s, produced)
        end.told(self.observer)
        if not call.logged:  # else its shell logs it (it answered it)
            end.told(self.request_log)
        if call.traceparent and self.traces is not None:
            self.traces.finished(call, outcome, err, queued_s, infer_s, now, batch)

    def on_batches(self, reports: Sequence[BatchReport]) -> None:
        """Batches came back (those of one loop turn): observed together, each in the
        statistics and in the throttle's estimates, in order."""
        self.observer.batches_finished(reports)
        now = self.now()
        for report in reports:
            runtime = self.runtimes.get(report.model)
            if runtime is None:
                continue
            if report.ok:
                self.stats.execution(
                    report.model, runtime.info.latest_version, report.rows, report.seconds
                )
            if runtime.admission is not None:
                runtime.admission.observe_batch(
                    rows=report.tenants,
                    tokens=report.tenant_tokens,
                    tier_of=self.tier_of,
                    ok=report.ok,
                    started=report.started,
                    finished=report.finished,
                    now=now,
                )
