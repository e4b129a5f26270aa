"""From the config to the policy packages' own parameters: the one translation.

The scheduler, the admission (throttles, rate limits) and the feedback loop never read
the config: each takes its own parameters (``EndpointPolicy``, ``QueueLimits``, plain
constructor arguments). The core builds them here, from the config it runs, when it
starts, when it first serves an endpoint and when it reloads.
"""

from __future__ import annotations

from fair_frontend.admission import EngineThrottle, RateLimiter, Throttle, storage_from_uri
from fair_frontend.admission.storage import DEFAULT_BUCKETS
from fair_frontend.batching import one_hop
from fair_frontend.config import Config, Endpoint, Queues, RateLimiting
from fair_frontend.feedback import ServiceModel
from fair_frontend.models import ModelInfo
from fair_frontend.scheduler import EndpointPolicy, GlobalCaps, QueueLimits


def endpoint_policy(config: Config, endpoint: Endpoint, info: ModelInfo) -> EndpointPolicy:
    """The scheduler's view of an endpoint: config bounded by what the model accepts.

    Models that do not batch, and those whose requests must keep Triton's own semantics
    (sequence batching, decoupled), go one request per batch.
    """
    configured = info.max_batch_size if endpoint.max_batch_size is None else endpoint.max_batch_size
    engine = endpoint.max_inflight is not None  # the model batches inside: one at a time
    if not info.batching or info.passthrough or configured == 0 or engine:
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
        slots=endpoint.max_inflight,
        fairness=endpoint.fairness_policy(),
    )


def dispatch_mode(endpoint: Endpoint, info: ModelInfo) -> str:
    """The endpoint's dispatch mode, by name (``Core`` builds its dispatcher from it):
    ``engine`` for a model that batches inside itself (``max_inflight``), ``granted``
    where unary requests take one hop (``batching.one_hop``: the shells send the rows the
    core grants them), ``batches`` otherwise (the core sends the batches it forms)."""
    if endpoint.max_inflight is not None:
        return "engine"
    if one_hop(info, endpoint):
        return "granted"
    return "batches"


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


def batch_throttle(endpoint: Endpoint, max_batch_size: int, backends: int = 1) -> Throttle:
    """The throttle of a configured endpoint (``max_batch_size``: the effective one),
    served by a pool of ``backends`` Tritons."""
    return Throttle(
        max_batch_size=max_batch_size,
        max_batch_tokens=endpoint.max_batch_tokens,
        latency_target_s=endpoint.latency_target_ms / 1000.0,
        safety=endpoint.throttle_safety,
        servers=backends,
    )


def engine_throttle(endpoint: Endpoint, backends: int = 1) -> EngineThrottle:
    """The throttle of a configured engine endpoint (``max_inflight`` set), served by a
    pool of ``backends`` Tritons, each with ``max_inflight`` slots."""
    if endpoint.max_inflight is None:
        raise ValueError("EngineThrottle is for engine endpoints (max_inflight)")
    return EngineThrottle(
        slots=endpoint.max_inflight * backends,
        reserved_slots=endpoint.reserved_slots,
        latency_target_s=endpoint.latency_target_ms / 1000.0,
        safety=endpoint.throttle_safety,
    )


def service_model(
    name: str, endpoint: Endpoint, max_batch_size: int, config: Config
) -> ServiceModel:
    """The service model of a configured endpoint (``max_batch_size``: the effective one)."""
    return ServiceModel(
        name,
        cost_unit=endpoint.cost,
        max_batch_size=max_batch_size,
        max_batch_tokens=endpoint.max_batch_tokens,
        alpha=config.observability.ema_alpha,
        interval_s=config.triton.metrics_interval_s,
    )
