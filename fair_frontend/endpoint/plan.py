"""What an endpoint is: the config and the model's description, resolved once.

``plan(config, model, info)`` is the one place that combines a ``Config`` with a
``ModelInfo``: how many rows a batch takes, whether the model batches inside itself
(engine mode) and with how many slots, whether a unary request takes one hop, the
scheduler's parameters, what one request may carry. The core builds each model's
dispatcher from its plan (``Core._runtime``); a shell keeps one per model for its
requests (``Gateway.plan``), made again when its config or the model's description
changes. Nothing else derives these facts.
"""

from __future__ import annotations

from dataclasses import dataclass

from fair_frontend.config import Config, Endpoint
from fair_frontend.models import ModelInfo, RequestBounds
from fair_frontend.scheduler import EndpointPolicy
from fair_frontend.scheduler.cost import CostUnit


@dataclass(frozen=True, slots=True, eq=False)
class EndpointPlan:
    """One model's endpoint under one config (``plan``)."""

    model: str
    endpoint: Endpoint  # its config section (``Config.endpoint``)
    info: ModelInfo  # the backend's description of the model
    # The dispatch mode, by its name in ``core.dispatch.DISPATCH_MODES``: ``engine`` (the
    # model batches inside: ``max_inflight``), ``granted`` (one hop), ``batches``.
    mode: str
    engine: bool  # the model batches inside itself (``max_inflight`` set)
    # Batches (engine: requests) in one backend at once: ``max_inflight`` in engine mode,
    # else ``max_inflight_batches``, else the model's instances.
    slots: int
    one_hop: bool  # unary requests' tensors go from their shell (``_one_hop``)
    # Rows per batch as the scheduler takes them; 0: one request per batch (the model does
    # not batch, keeps Triton's own semantics, or is an engine).
    max_batch_size: int
    quantum: float | None  # the DRR quantum (``Endpoint.effective_quantum``)
    cost: CostUnit
    fairness: str  # the fairness policy's name (``Endpoint.fairness_policy``)
    policy: EndpointPolicy  # the scheduler's parameters, of the facts above
    bounds: RequestBounds  # what one request may carry (``ModelInfo.bounds``)
    token_input: str
    token_output: str | None
    tokenizer: str | None
    # The batch key's parts (``batching.batch_key``): the padded inputs whose rows of
    # different widths may share a batch, the rows a batch may have (at least 1), and the
    # parameter that travels per row (not in the key), if any.
    padded: frozenset[str]
    key_rows: int
    per_row_parameter: str | None


def plan(config: Config, model: str, info: ModelInfo) -> EndpointPlan:
    """``model``'s endpoint under ``config``, described by ``info``."""
    endpoint = config.endpoint(model)
    engine = endpoint.max_inflight is not None
    hop = _one_hop(info, endpoint)
    rows = _rows(endpoint, info, engine)
    fairness = endpoint.fairness_policy()
    quantum = endpoint.effective_quantum(rows)
    policy = EndpointPolicy(
        cost=endpoint.cost,
        max_batch_size=rows,
        max_batch_tokens=endpoint.max_batch_tokens,
        quantum=quantum,
        tiers=tuple(config.tiers),
        tier_min_share=dict(config.tier_guard.min_share),
        slots=endpoint.max_inflight,
        fairness=fairness,
        debt_carried=endpoint.debt_carried,
    )
    if endpoint.max_inflight is not None:
        slots = endpoint.max_inflight
    elif endpoint.max_inflight_batches is not None:
        slots = endpoint.max_inflight_batches
    else:
        slots = info.instances
    return EndpointPlan(
        model=model,
        endpoint=endpoint,
        info=info,
        mode="engine" if engine else "granted" if hop else "batches",
        engine=engine,
        slots=slots,
        one_hop=hop,
        max_batch_size=rows,
        quantum=quantum,
        cost=endpoint.cost,
        fairness=fairness,
        policy=policy,
        bounds=info.bounds(endpoint),
        token_input=endpoint.token_input,
        token_output=endpoint.token_output,
        tokenizer=endpoint.tokenizer,
        padded=_mergeable_padding(info, endpoint),
        key_rows=_key_rows(info, endpoint),
        per_row_parameter=(
            endpoint.max_tokens_parameter if info.batching and info.takes_rows else None
        ),
    )


def _rows(endpoint: Endpoint, info: ModelInfo, engine: bool) -> int:
    """The rows of a batch: the config's, bounded by what the model accepts. Models that
    do not batch, those whose requests must keep Triton's own semantics (sequence
    batching, decoupled) and engines (one request at a time) take one per batch: 0."""
    configured = info.max_batch_size if endpoint.max_batch_size is None else endpoint.max_batch_size
    if not info.batching or info.passthrough or configured == 0 or engine:
        return 0
    return min(configured, info.max_batch_size)


def _one_hop(info: ModelInfo, endpoint: Endpoint) -> bool:
    """Whether a unary request to this endpoint takes one hop where its shell is a process
    of its own (``Endpoint.unary``): its shell keeps its tensors and sends its rows to
    Triton when the core grants them (``fair_frontend.core.granted``). Not for the
    requests that keep Triton's own semantics one at a time (decoupled: streamed, one hop
    already; sequence batching: the core maps their ids), nor for engine endpoints
    (``max_inflight``). The core and every shell read it from their plans."""
    return endpoint.unary == "one_hop" and not info.passthrough and endpoint.max_inflight is None


def _mergeable_padding(info: ModelInfo, endpoint: Endpoint) -> frozenset[str]:
    """The padded inputs whose rows of different widths may share a batch: all of them for
    a model that takes ``fair_rows``; for one that does not, those without a
    ``lengths_field`` only (the operator chose that the model sees the padding). A row
    padded beyond its real length, the model not told so, would be read as longer."""
    return frozenset(
        name
        for name, pad in endpoint.padding.inputs.items()
        if info.takes_rows or pad.lengths_field is None
    )


def _key_rows(info: ModelInfo, endpoint: Endpoint) -> int:
    """Rows a batch of this endpoint may have, as the batch key's width classes count them
    (the smaller of the two configs, at least 1)."""
    configured = endpoint.max_batch_size
    if configured is None or configured == 0:
        return max(1, info.max_batch_size)
    return max(1, min(configured, info.max_batch_size or configured))
