"""Triton's model config read into the frontend's description of a model (``ModelInfo``).

The one place that reads Triton's model-config schema (``model_config_pb2``): the core
when it looks a model up. Everything past this reads ``ModelInfo``, the shells too (the
core sends them its fields, ``wire.records.ModelDescribed``); a client that asks for the
config itself is answered by Triton (the shells' side doors).
"""

from __future__ import annotations

from typing import Any

from tritonclient.grpc import model_config_pb2

from fair_frontend.models import (
    CONTEXT_CONFIG_PARAMETER,
    ROWS_CONFIG_PARAMETER,
    ModelInfo,
    TensorSpec,
)

# Triton's default max_sequence_idle_microseconds (model_config.proto): 1 s.
TRITON_SEQUENCE_IDLE_US = 1_000_000


def model_info(cfg: model_config_pb2.ModelConfig, versions: tuple[str, ...] = ("1",)) -> ModelInfo:
    """``cfg`` (Triton's config of one model) as the frontend describes a model;
    ``versions``: its ready versions, from the model's metadata."""

    def spec(t: Any, optional: bool = False) -> TensorSpec:
        return TensorSpec(t.name, triton_datatype(t.data_type), tuple(t.dims), optional)

    idle_us = 0
    if cfg.HasField("sequence_batching"):
        idle_us = cfg.sequence_batching.max_sequence_idle_microseconds
    return ModelInfo(
        name=cfg.name,
        max_batch_size=cfg.max_batch_size,
        inputs={t.name: spec(t, t.optional) for t in cfg.input},
        outputs={t.name: spec(t) for t in cfg.output},
        decoupled=cfg.model_transaction_policy.decoupled,
        sequence_batching=cfg.HasField("sequence_batching"),
        platform=cfg.platform or cfg.backend,
        instances=max(1, sum(max(1, g.count) for g in cfg.instance_group)),
        versions=versions or ("1",),
        takes_rows=_config_flag(cfg, ROWS_CONFIG_PARAMETER),
        max_model_len=_config_count(cfg, CONTEXT_CONFIG_PARAMETER),
        sequence_idle_s=(idle_us or TRITON_SEQUENCE_IDLE_US) / 1e6,
    )


def triton_datatype(config_type: int) -> str:
    """``TYPE_INT32`` -> ``INT32``; ``TYPE_STRING`` -> ``BYTES`` (Triton's mapping)."""
    name: str = model_config_pb2.DataType.Name(config_type)
    name = name.removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def _config_flag(cfg: model_config_pb2.ModelConfig, key: str) -> bool:
    """A boolean model-config parameter (a string, as Triton's config keeps them all):
    "true" in any case, surrounding blanks ignored; anything else, or absent, is false."""
    param = cfg.parameters.get(key)
    return param is not None and param.string_value.strip().lower() == "true"


def _config_count(cfg: model_config_pb2.ModelConfig, key: str) -> int | None:
    """A positive integer model-config parameter; None where absent or not one."""
    param = cfg.parameters.get(key)
    if param is None:
        return None
    text = param.string_value.strip()
    return int(text) if text.isdigit() and int(text) > 0 else None
