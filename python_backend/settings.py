"""Per-model settings read from ``parameters`` in the model's ``config.pbtxt``.

Triton hands a Python model its configuration as JSON in which every parameter is
``{"key": {"string_value": "..."}}``; this module turns those strings into typed values
once, in ``initialize``, so a bad value fails the model load with a message naming it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# One intra-op thread per model instance. Measured through Triton on the 2-core machines
# (model_repository/README.md): with 2 threads each, the two stub processes, Triton and the
# client oversubscribe the cores and batch times turn erratic (a full embed batch 28-154 ms,
# a full generate batch 177-479 ms, vs 36-41 and 22-34 ms on one thread); the frontend
# shares the same cores too.
DEFAULT_TORCH_THREADS = 1
DEFAULT_MAX_METRIC_TENANTS = 1000


@dataclass(frozen=True)
class ModelSettings:
    torch_threads: int = DEFAULT_TORCH_THREADS
    seed: int | None = None  # None: the network's own fixed seed
    max_metric_tenants: int = DEFAULT_MAX_METRIC_TENANTS  # beyond: label "other"
    device: str = "cpu"  # "cuda:N" for a KIND_GPU instance (configs/gpu.pbtxt)

    @classmethod
    def from_triton_args(cls, args: Mapping[str, str]) -> ModelSettings:
        """From the ``args`` of ``initialize``: config parameters plus the instance's device."""
        settings = cls.from_model_config(json.loads(args["model_config"]))
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args.get('model_instance_device_id', '0')}"
            settings = dataclasses.replace(settings, device=device)
        return settings

    @classmethod
    def from_model_config(cls, model_config: Mapping[str, Any]) -> ModelSettings:
        """Read ``torch_threads``, ``seed``, ``max_metric_tenants``; ignore other keys."""
        raw = {
            key: value.get("string_value", "") if isinstance(value, Mapping) else str(value)
            for key, value in (model_config.get("parameters") or {}).items()
        }
        values: dict[str, int] = {}
        problems = []
        for name, minimum in (("torch_threads", 1), ("seed", 0), ("max_metric_tenants", 1)):
            if name not in raw:
                continue
            try:
                values[name] = int(raw[name])
            except ValueError:
                problems.append(f"{name}={raw[name]!r} is not an integer")
                continue
            if values[name] < minimum:
                problems.append(f"{name}={values[name]} must be >= {minimum}")
        if problems:
            raise ValueError("invalid model config parameters: " + "; ".join(problems))
        return cls(
            torch_threads=values.get("torch_threads", DEFAULT_TORCH_THREADS),
            seed=values.get("seed"),
            max_metric_tenants=values.get("max_metric_tenants", DEFAULT_MAX_METRIC_TENANTS),
        )
