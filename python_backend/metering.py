"""Per-tenant accounting inside Triton, exported on Triton's own metrics port.

Two counter families, shared by both models and told apart by the ``model`` label:

- ``fair_model_rows_total{model, tenant}``: rows served;
- ``fair_model_tokens_total{model, tenant}``: tokens served (embed: real input tokens;
  generate: real input tokens + generated tokens). Padding is never counted.

They let an operator check, from Triton's side, what the frontend claims to have
dispatched per tenant. Only rows answered successfully are counted.

Label cardinality is bounded: the first ``max_tenants`` tenants seen get their own label,
later ones share ``"other"`` (a tenant id is client-influenced; an unbounded label set would
grow Triton's metrics page without limit).

``pb_utils`` is passed in rather than imported: it exists only inside Triton's stub, and this
module is also imported by tests. Each ``increment`` is an IPC round trip to the Triton
process, so usage is summed per tenant first: two increments per tenant per ``execute``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

ROWS_FAMILY = "fair_model_rows_total"
TOKENS_FAMILY = "fair_model_tokens_total"
OTHER_TENANT = "other"


class TenantMeters:
    """The two counter families of one model, with per-tenant metrics created on first use."""

    def __init__(self, pb_utils: Any, model: str, max_tenants: int) -> None:
        counter = pb_utils.MetricFamily.COUNTER
        self._rows = pb_utils.MetricFamily(
            name=ROWS_FAMILY, description="Rows served, per model and tenant", kind=counter
        )
        self._tokens = pb_utils.MetricFamily(
            name=TOKENS_FAMILY,
            description="Tokens served (input tokens, plus generated tokens on generate), "
            "per model and tenant",
            kind=counter,
        )
        self._model = model
        self._max_tenants = max_tenants
        self._metrics: dict[str, tuple[Any, Any]] = {}

    def label(self, tenant: str) -> str:
        """The tenant's label value: itself while under the cap, else ``"other"``."""
        if tenant in self._metrics or len(self._metrics) < self._max_tenants:
            return tenant
        return OTHER_TENANT

    def record(self, usage: Iterable[tuple[str, int]]) -> None:
        """Count ``(tenant, tokens)`` rows: one row and ``tokens`` tokens each."""
        totals: dict[str, list[int]] = {}
        for tenant, tokens in usage:
            t = totals.setdefault(self.label(tenant), [0, 0])
            t[0] += 1
            t[1] += tokens
        for label, (rows, tokens) in totals.items():
            rows_metric, tokens_metric = self._metric(label)
            rows_metric.increment(float(rows))
            tokens_metric.increment(float(tokens))

    def _metric(self, label: str) -> tuple[Any, Any]:
        pair = self._metrics.get(label)
        if pair is None:
            labels = {"model": self._model, "tenant": label}
            pair = (self._rows.Metric(labels=labels), self._tokens.Metric(labels=labels))
            self._metrics[label] = pair
        return pair

    def close(self) -> None:
        """Release the metrics, then the families (Triton requires that order)."""
        self._metrics.clear()
        self._rows = self._tokens = None
