"""The frontend as a service, independent of transport: what both shells call.

One inference request goes through, in this fixed order: identity (API key) ->
validation against the model -> admission (rate limits, then the throttle) -> the
model's scheduler (tier, deficit round robin, priority) -> a batch to Triton -> its
share of the answer. Every request ends in exactly one ``Outcome``, reported to the
observer, whatever path it took.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

from fair_frontend.admission import (
    RateLimiter,
    RateLimitItem,
    Throttle,
    items_from_limits,
    limit_key,
    overloaded_error,
    rate_limited_error,
)
from fair_frontend.auth import Authenticator, KeyRing
from fair_frontend.batching import Item, batch_key
from fair_frontend.config import Config, ConfigError, Endpoint, Tenant
from fair_frontend.dispatch import Backend, BatchReport, EndpointRuntime, TierShares
from fair_frontend.errors import (
    FrontendError,
    Internal,
    InvalidArgument,
    Unavailable,
    UnknownModel,
    Unsupported,
    UpstreamError,
)
from fair_frontend.feedback import FeedbackCost, ServiceModel, TritonDelta, TritonMetrics
from fair_frontend.forwarder import TritonForwarder
from fair_frontend.models import ModelInfo, validate
from fair_frontend.observe import Observer, Observers
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import (
    FINAL_RESPONSE,
    InferRequest,
    InferResponse,
    ParamValue,
    Tensor,
)
from fair_frontend.scheduler import (
    EndpointPolicy,
    GlobalCaps,
    QueuedRequest,
    Scheduler,
    cost_model_for,
)
from fair_frontend.stats import Statistics

log = logging.getLogger(__name__)

# Server metadata extensions the frontend implements (a subset of Triton's: no shared
# memory, which cannot cross hosts; no repository control or tracing, which stay with
# the operator of Triton itself).
EXTENSIONS = (
    "classification",
    "statistics",
    "sequence",
    "schedule_policy",
    "model_configuration",
    "binary_tensor_data",
    "parameters",
)
SERVER_NAME = "fair_frontend"
# The throttle stretches a lower tier's predicted wait by 1 / (1 - higher tiers' share);
# capped so that a tier starved by strict order is still judged, not rejected outright.
MAX_HIGHER_TIER_SHARE = 0.9


def endpoint_policy(config: Config, endpoint: Endpoint, info: ModelInfo) -> EndpointPolicy:
    """The scheduler's view of an endpoint: config bounded by what the model accepts.

    Models that do not batch, and those whose requests must keep Triton's own semantics
    (sequence batching, decoupled), go one request per batch.
    """
    configured = info.max_batch_size if endpoint.max_batch_size is None else endpoint.max_batch_size
    if not info.batching or info.passthrough or configured == 0:
        max_batch = 0
    else:
        max_batch = min(configured, info.max_batch_size)
    return EndpointPolicy(
        cost=endpoint.cost,
        max_batch_size=max_batch,
        max_batch_tokens=endpoint.max_batch_tokens,
        quantum=endpoint.effective_quantum(max_batch),
        tiers=tuple(config.tiers),
        tier_min_share=dict(config.tier_guard.min_share),
    )


class ModelRegistry:
    """What is this model? Fetched from Triton once, shared by concurrent first callers."""

    def __init__(self, forwarder: TritonForwarder) -> None:
        self.forwarder = forwarder
        self._infos: dict[str, asyncio.Future[ModelInfo]] = {}

    async def get(self, model: str) -> ModelInfo:
        fut = self._infos.get(model)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._infos[model] = fut
            try:
                cfg = await self.forwarder.model_config(model)
                meta = await self.forwarder.call("get_model_metadata", model_name=model)
                fut.set_result(ModelInfo.from_config(cfg, tuple(meta.versions)))
            except BaseException as err:
                del self._infos[model]
                fut.set_exception(_unknown_model(model, err))
                fut.exception()  # the error is raised below; mark it retrieved
        return await asyncio.shield(fut)


def _unknown_model(model: str, err: BaseException) -> BaseException:
    if isinstance(err, UpstreamError) and "unknown model" in err.message:
        return UnknownModel(model)
    return err


class Frontend:
    """The protocol-independent service both shells call."""

    def __init__(
        self,
        config: Config,
        forwarder: TritonForwarder,
        *,
        keyring: KeyRing | None = None,
        observers: Sequence[Observer] | None = None,
        limiter: RateLimiter | None = None,
    ) -> None:
        self.config = config
        self.forwarder = forwarder
        self.models = ModelRegistry(forwarder)
        # The schedulers read tenants from this dict: a reload updates it in place.
        self.tenants: dict[str, Tenant] = dict(config.tenants)
        self.auth = Authenticator(
            keyring or KeyRing.from_config(config),
            set(config.tenants),
            trusted_gateway=config.auth.trusted_gateway,
        )
        from fair_frontend.logs import RequestLog
        from fair_frontend.metrics import FrontendMetrics, StateCollector

        self.metrics = FrontendMetrics(config)
        self.metrics.registry.register(StateCollector(self.state_samples))
        self.registry = self.metrics.registry
        self.observer = Observers([self.metrics, RequestLog(), *(observers or ())])
        self.backend = Backend(
            probe=self.forwarder.server_ready, max_outage_s=config.triton.max_outage_s
        )
        self.caps = GlobalCaps.from_config(config.queues)
        self.limiter = limiter or RateLimiter.from_config(config.rate_limiting)
        self._limit_items: dict[tuple[str, str], list[RateLimitItem]] = {}
        self.runtimes: dict[str, EndpointRuntime] = {}
        self.stats = Statistics()
        self.triton_metrics: TritonMetrics | None = None
        self.accepting = True

    # ---- inference ----------------------------------------------------------------------

    async def infer(self, req: InferRequest, headers: Mapping[str, str]) -> InferResponse:
        """One request, one response (ModelInfer, HTTP infer)."""
        replies = self._handle(req, headers, streaming=False)
        try:
            return await anext(replies)
        finally:
            await replies.aclose()

    def stream_infer(
        self, req: InferRequest, headers: Mapping[str, str]
    ) -> AsyncIterator[InferResponse]:
        """One request on a stream (ModelStreamInfer): its responses; several for a
        decoupled model, exactly one otherwise."""
        return self._handle(req, headers, streaming=True)

    async def _handle(
        self, req: InferRequest, headers: Mapping[str, str], *, streaming: bool
    ) -> AsyncGenerator[InferResponse, None]:
        arrived = time.monotonic()
        arrived_wall = time.time()
        tenant: str | None = None
        outcome = Outcome.FAILED
        queued_s: float | None = None
        error: str | None = None
        info: ModelInfo | None = None
        try:
            if not self.accepting:
                raise Unavailable("the frontend is shutting down")
            if self.backend.gave_up:
                raise Unavailable(f"Triton has been unavailable for {self.backend.outage_s:.0f} s")
            tenant = self.auth.identify(headers, req.tenant_claim)
            info = await self.models.get(req.model)
            if info.decoupled and not streaming:
                raise Unsupported(
                    "ModelInfer RPC doesn't support models with decoupled transaction policy"
                )
            runtime = self._runtime(req.model, info)
            endpoint = runtime.endpoint
            checked = validate(req, info, endpoint)
            priority = self._priority(req.priority, tenant, req.model)
            # The throttle first: a request the platform cannot serve in time costs the
            # tenant no quota (and, under overload, no rate-limit storage round trip).
            self._check_throttle(runtime, tenant, priority, checked.rows, checked.tokens, req)
            await self._check_rate_limits(tenant, req.model, checked.tokens)
            # Deadline = arrival + timeout (Triton's definition), on the dispatch clock.
            timeout_s = req.timeout_us / 1e6 if req.timeout_us else None
            deadline = None
            if timeout_s is not None:
                deadline = runtime.now() + timeout_s - (time.monotonic() - arrived)
            deadline_us = int((arrived_wall + timeout_s) * 1e6) if timeout_s else 0
            item = Item(req, checked.rows, checked.lengths, tenant, priority, deadline_us, deadline)
            qr = QueuedRequest(
                tenant=tenant,
                rows=checked.rows,
                tokens=checked.tokens,
                nbytes=req.nbytes,
                priority=priority,
                deadline=deadline,
                shape_key=batch_key(req, info, endpoint),
            )
            final: dict[str, ParamValue] = (
                {FINAL_RESPONSE: True} if streaming and req.empty_final_response else {}
            )
            if info.decoupled:
                version = req.version or info.latest_version
                async for reply in runtime.submit_stream(qr, item):
                    version = reply.version or version
                    if not reply.outputs and not (reply.final and final):
                        continue  # Triton's empty final: only for clients that asked
                    params: dict[str, ParamValue] = {FINAL_RESPONSE: reply.final} if final else {}
                    yield InferResponse(req.model, version, req.id, reply.outputs, params)
                outputs: list[Tensor] = []
            else:
                version, outputs = await runtime.submit(qr, item)
            queued_s = _queued_seconds(qr)
            outcome = Outcome.DISPATCHED
            total_s = time.monotonic() - arrived
            infer_s = time.monotonic() - qr.payload.dispatched_at
            self.stats.success(req.model, version, checked.rows, total_s, queued_s or 0.0, infer_s)
            if not info.decoupled:
                yield InferResponse(req.model, version, req.id, outputs, dict(final))
        except FrontendError as err:
            outcome = err.outcome
            error = err.message
            if tenant is not None and not isinstance(err, UnknownModel):
                version = req.version or (info.latest_version if info is not None else "1")
                self.stats.failure(req.model, version, time.monotonic() - arrived)
            raise
        except asyncio.CancelledError:
            outcome = Outcome.CANCELLED
            raise
        except GeneratorExit:
            if outcome is not Outcome.DISPATCHED:  # the caller stopped reading a stream
                outcome = Outcome.CANCELLED
            raise
        except Exception as err:
            log.exception("internal error serving %s", req.model)
            error = f"internal error: {type(err).__name__}"
            raise Internal(error) from err
        finally:
            self.observer.request_finished(
                tenant=tenant,
                model=req.model,
                outcome=outcome,
                queued_s=queued_s,
                request_id=req.id,
                latency_s=time.monotonic() - arrived,
                error=error,
            )

    def rejected(
        self, model: str, headers: Mapping[str, str], err: FrontendError, latency_s: float
    ) -> None:
        """A request the shell refused before ``infer`` (it could not be decoded)."""
        try:
            tenant: str | None = self.auth.identify(headers, None)
        except FrontendError:
            tenant = None
        self.observer.request_finished(
            tenant=tenant,
            model=model,
            outcome=err.outcome,
            queued_s=None,
            latency_s=latency_s,
            error=err.message,
        )

    def _tier(self, tenant: str) -> str:
        terms = self.tenants.get(tenant)
        return terms.tier if terms is not None else ""

    def _check_throttle(
        self,
        runtime: EndpointRuntime,
        tenant: str,
        priority: int,
        rows: int,
        tokens: int,
        req: InferRequest,
    ) -> None:
        """Reject at once (503 + Retry-After) what cannot be served within its target."""
        if not runtime.endpoint.throttle:
            return
        assert runtime.service is not None and runtime.throttle is not None
        backlog = runtime.scheduler.backlog_ahead(tenant, priority, rows, tokens)
        slowdown = 1.0
        if self.config.scheduling == "fair":
            above = runtime.tier_shares.above(self._tier(tenant), self.config.tiers)
            slowdown = 1.0 / (1.0 - min(above, MAX_HIGHER_TIER_SHARE))
        decision = runtime.throttle.check(
            backlog,
            runtime.inflight,
            runtime.service,
            remaining_s=req.timeout_us / 1e6 if req.timeout_us else None,
            slowdown=slowdown,
        )
        self.observer.throttle_decision(model=runtime.model, decision=decision)
        if not decision.admitted:
            raise overloaded_error(decision, runtime.model)

    async def _check_rate_limits(self, tenant: str, model: str, tokens: int) -> None:
        """Count the request against its tenant's limits, or raise the 429 (counting nothing)."""
        items = self._limit_items.get((tenant, model))
        if items is None:
            items = items_from_limits(self.config.limits_for(tenant, model))
            self._limit_items[(tenant, model)] = items
        if not items:
            return
        try:
            decision = await self.limiter.check(
                limit_key(tenant, model), items, requests=1, tokens=tokens, now=time.time()
            )
        except Unavailable:  # the storage failed and the mode is fail_closed
            self.observer.rate_limit_degraded(mode=self.config.rate_limiting.on_storage_error)
            raise
        if decision.degraded:
            self.observer.rate_limit_degraded(mode=self.config.rate_limiting.on_storage_error)
        if not decision.allowed:
            assert decision.violated is not None
            self.observer.rate_limit_hit(tenant=tenant, model=model, limit=str(decision.violated))
            raise rate_limited_error(decision, tenant=tenant, endpoint=model)

    def _priority(self, requested: int, tenant: str, model: str) -> int:
        levels = self.config.priority_levels
        if requested > levels:
            raise InvalidArgument(
                f"priority {requested} is out of range: 1 (highest) to {levels}, or 0 for "
                "the default level"
            )
        return requested or self.config.default_priority(tenant, model)

    def _runtime(self, model: str, info: ModelInfo) -> EndpointRuntime:
        runtime = self.runtimes.get(model)
        if runtime is None:
            endpoint = self.config.endpoint(model)
            policy = endpoint_policy(self.config, endpoint, info)
            batch = policy.max_batch_size or 1
            service = ServiceModel.for_endpoint(model, endpoint, batch, self.config)
            cost_model = None
            if endpoint.normalize_cost:
                cost_model = FeedbackCost(cost_model_for(endpoint.cost), service)
            runtime = EndpointRuntime(
                model=model,
                info=info,
                endpoint=endpoint,
                scheduler=Scheduler(
                    policy,
                    self.tenants,
                    self.caps,
                    mode=self.config.scheduling,
                    cost_model=cost_model,
                ),
                forwarder=self.forwarder,
                backend=self.backend,
                on_batch=self._on_batch,
                service=service,
                throttle=Throttle.for_endpoint(endpoint, batch),
                tier_shares=TierShares(batch_rows=batch, batch_tokens=endpoint.max_batch_tokens),
            )
            self.runtimes[model] = runtime
        return runtime

    def _on_batch(self, report: BatchReport) -> None:
        self.observer.batch_finished(report)
        runtime = self.runtimes.get(report.model)
        if runtime is not None and report.ok:
            rows_by_tier: dict[str, int] = {}
            tokens_by_tier: dict[str, int] = {}
            for t, rows in report.tenants.items():
                tier = self._tier(t)
                rows_by_tier[tier] = rows_by_tier.get(tier, 0) + rows
                tokens_by_tier[tier] = tokens_by_tier.get(tier, 0) + report.tenant_tokens[t]
            runtime.tier_shares.observe(rows_by_tier, tokens_by_tier)
            self.stats.execution(
                report.model, runtime.info.latest_version, report.rows, report.seconds
            )
        if runtime is not None and runtime.service is not None:
            runtime.service.observe_batch(
                report.rows,
                report.tokens,
                report.started,
                report.finished,
                time.monotonic(),
                ok=report.ok,
            )

    # ---- feedback from Triton's metrics -------------------------------------------------

    async def start(self) -> None:
        """Learn the configured endpoints' models (best effort: a model Triton does not
        serve yet is looked up on first use) and start reading Triton's metrics."""
        for model in self.config.endpoints:
            try:
                self._runtime(model, await self.models.get(model))
            except FrontendError as err:
                log.warning("endpoint %s: not served by Triton yet (%s)", model, err.message)
        url = self.config.triton.metrics_url
        if url:
            self.triton_metrics = TritonMetrics(
                url,
                interval_s=self.config.triton.metrics_interval_s,
                on_delta=self._on_triton_delta,
                on_scrape=self._on_scrape,
            )
            self.triton_metrics.start()

    def _on_triton_delta(self, delta: TritonDelta) -> None:
        runtime = self.runtimes.get(delta.model)
        if runtime is not None and runtime.service is not None:
            runtime.service.observe_triton(delta)

    def _on_scrape(self, at: float, ok: bool) -> None:
        for runtime in list(self.runtimes.values()):
            if runtime.service is not None:
                runtime.service.tick(at)

    def state_samples(self) -> list[tuple[str, dict[str, str], float]]:
        """Live gauges for the metrics port: queue depths, deficits, in-flight batches."""
        out: list[tuple[str, dict[str, str], float]] = [
            ("fair_backend_available", {}, 1.0 if self.backend.available.is_set() else 0.0)
        ]
        label = self.metrics.tenant_label
        for model, rt in list(self.runtimes.items()):
            sched = rt.scheduler
            out.append(("fair_inflight_batches", {"endpoint": model}, float(rt.inflight)))
            for tier, depth in sched.tier_depths().items():
                out.append(("fair_queue_depth", {"endpoint": model, "tier": tier}, float(depth)))
            for tenant, deficit in sched.deficits().items():
                name = label(tenant)
                out.append(("fair_drr_deficit", {"endpoint": model, "tenant": name}, deficit))
            if rt.service is not None:
                out.extend(rt.service.status().samples())
        return out

    # ---- health and metadata ------------------------------------------------------------

    async def ready(self) -> bool:
        return self.accepting and await self.forwarder.server_ready()

    async def model_ready(self, model: str, version: str = "") -> bool:
        try:
            return bool(
                await self.forwarder.call("is_model_ready", model_name=model, model_version=version)
            )
        except FrontendError:
            return False

    async def server_metadata(self) -> dict[str, Any]:
        from fair_frontend import __version__

        return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}

    async def model_metadata(self, model: str, version: str = "") -> Any:
        return await self.forwarder.call(
            "get_model_metadata", model_name=model, model_version=version
        )

    async def model_config(self, model: str, version: str = "") -> Any:
        return await self.forwarder.call(
            "get_model_config", model_name=model, model_version=version
        )

    def reload(self, config: Config) -> list[str]:
        """Apply a new config's tenants, API keys and limits without dropping a request.

        Keys (inline, files, environment) are read again; tenants can be added, and a
        tenant's weight, tier and caps apply once its queue has drained (the scheduler's
        snapshot rule). Changes that need a restart (tiers, endpoints, scheduling mode,
        listeners) are not applied: the returned notes say which. Raises ``ConfigError``
        (and changes nothing) if the new keys cannot be loaded or the tiers changed.
        """
        if list(config.tiers) != list(self.config.tiers):
            raise ConfigError("(reload)", ["tiers changed: restart the frontend to apply"])
        keyring = KeyRing.from_config(config)  # raises before anything changes
        notes = [
            f"{name} changed: restart the frontend to apply"
            for name in ("endpoints", "default_endpoint", "scheduling", "server", "triton")
            if getattr(config, name) != getattr(self.config, name)
        ]
        self.tenants.update(config.tenants)
        for gone in set(self.tenants) - set(config.tenants):
            del self.tenants[gone]
        self.auth = Authenticator(
            keyring, set(config.tenants), trusted_gateway=config.auth.trusted_gateway
        )
        self.config = config
        self.metrics.config = config  # tier labels of new or moved tenants
        self._limit_items.clear()
        log.info(
            "reloaded: %d tenants, %d API keys%s",
            len(config.tenants),
            keyring.size,
            "; " + "; ".join(notes) if notes else "",
        )
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
        what is still queued then with UNAVAILABLE; nothing is left unanswered."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while not all(rt.idle for rt in self.runtimes.values()):
            if time.monotonic() >= deadline or not self.backend.available.is_set():
                break
            await asyncio.sleep(0.02)
        left = sum(
            rt.fail_queued(Unavailable("the frontend is shutting down"))
            for rt in self.runtimes.values()
        )
        if left:
            log.warning("shutdown: answered %d still-queued requests with UNAVAILABLE", left)
        for runtime in self.runtimes.values():
            await runtime.drain()
        await self.backend.close()
        if self.triton_metrics is not None:
            await self.triton_metrics.stop()
        await self.limiter.close()


def _queued_seconds(qr: QueuedRequest) -> float | None:
    pending = qr.payload
    if pending is None or pending.dispatched_at is None:
        return None
    return float(pending.dispatched_at - pending.enqueued_at)
