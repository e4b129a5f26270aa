"""From the config to the policy packages' own parameters: the one translation.

The scheduler, the admission (throttles, rate limits) and the feedback loop never read
the config: each takes its own parameters (``EndpointPolicy``, ``QueueLimits``, plain
constructor arguments). The core builds them here, from the config it runs, when it
starts, when it first serves an endpoint and when it reloads. What an endpoint is (its
rows, mode, slots, the scheduler's ``EndpointPolicy``: the config with the model's
description) is its plan's (``fair_frontend.endpoint.plan``).
"""

from __future__ import annotations

from fair_frontend.admission import EngineThrottle, RateLimiter, Throttle, storage_from_uri
from fair_frontend.admission.storage import DEFAULT_BUCKETS
from fair_frontend.config import Config, Queues, RateLimiting
from fair_frontend.endpoint import EndpointPlan
from fair_frontend.feedback import ServiceModel
from fair_frontend.scheduler import GlobalCaps, QueueLimits


def queue_limits(queues: Queues) -> QueueLimits:
    """The global caps of the ``queues`` section (``GlobalCaps.of``, ``.configure``)."""
    return QueueLimits(
        max_queued=queues.max_queued,
        max_queued_bytes=queues.max_queued_bytes,
        tenant_bytes_share=queues.tenant_bytes_share,
        engine_queue_slots=queues.engine_queue_slots,
        programs_per_tenant=queues.programs_per_tenant,
    )


def global_caps(queues: Queues) -> GlobalCaps:
    """The process's caps, as the ``queues`` section sets them."""
    return GlobalCaps.of(queue_limits(queues))


def rate_limiter(config: RateLimiting, *, buckets: int = DEFAULT_BUCKETS) -> RateLimiter:
    """The limiter ``rate_limiting:`` describes: storage URI (with its password, from
    ``storage_password_env`` / ``_file``: ``RateLimiting.storage_url``), timeout,
    failure mode."""
    storage = storage_from_uri(
        config.storage_url(), timeout_s=config.timeout_ms / 1000.0, buckets=buckets
    )
    return RateLimiter(storage, on_storage_error=config.on_storage_error)


def batch_throttle(plan: EndpointPlan, backends: int = 1) -> Throttle:
    """The throttle of a planned endpoint (its rows per batch, at least one), served by a
    pool of ``backends`` Tritons."""
    endpoint = plan.endpoint
    return Throttle(
        max_batch_size=plan.max_batch_size or 1,
        max_batch_tokens=endpoint.max_batch_tokens,
        latency_target_s=endpoint.latency_target_ms / 1000.0,
        safety=endpoint.throttle_safety,
        servers=backends,
    )


def engine_throttle(plan: EndpointPlan, backends: int = 1) -> EngineThrottle:
    """The throttle of a planned engine endpoint (``max_inflight`` set), served by a pool
    of ``backends`` Tritons, each with the plan's slots."""
    if not plan.engine:
        raise ValueError("EngineThrottle is for engine endpoints (max_inflight)")
    endpoint = plan.endpoint
    return EngineThrottle(
        slots=plan.slots * backends,
        reserved_slots=endpoint.reserved_slots,
        latency_target_s=endpoint.latency_target_ms / 1000.0,
        safety=endpoint.throttle_safety,
        light_slots=endpoint.light_slots,
    )


def service_model(plan: EndpointPlan, config: Config) -> ServiceModel:
    """The service model of a planned endpoint (its rows per batch, at least one)."""
    return ServiceModel(
        plan.model,
        cost_unit=plan.cost,
        max_batch_size=plan.max_batch_size or 1,
        max_batch_tokens=plan.endpoint.max_batch_tokens,
        alpha=config.observability.ema_alpha,
        interval_s=config.triton.metrics_interval_s,
    )
