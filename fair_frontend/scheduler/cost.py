"""What a request costs in DRR units: computed once at enqueue, stored on the request."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Protocol


class CostUnit(str, enum.Enum):
    """What one unit of DRR cost is on an endpoint."""

    REQUESTS = "requests"  # 1 per request row (generate, streaming endpoints)
    TOKENS = "tokens"  # the row's token count (embedding and rerank batch endpoints)


class CostModel(Protocol):
    """What does this request cost?

    The answer is in the endpoint's DRR cost units, the units of the quantum. It must be
    finite and >= 0; it is computed once, when the request is enqueued, so a later change
    of the model (a new feedback factor) never re-prices queued work, which keeps the
    per-tier cost aggregates exact.
    """

    def cost(self, rows: int, tokens: int) -> float: ...


class RequestCost:
    """``requests`` endpoints: one unit per batch row."""

    __slots__ = ()

    def cost(self, rows: int, tokens: int) -> float:
        return float(rows)


class TokenCost:
    """``tokens`` endpoints: the request's token count, at least 1.

    The floor keeps a token-less request from being free: a free request would let one
    tenant fill every batch's rows within a single DRR turn.
    """

    __slots__ = ()

    def cost(self, rows: int, tokens: int) -> float:
        return float(tokens) if tokens > 1 else 1.0


class NormalizedCost:
    """A base cost times a factor read at enqueue: the seam for service-cost feedback.

    ``factor`` is injected (the feedback module's EMA of observed service cost per unit, or
    its reciprocal to divide by it). A factor that is not a positive finite number (no
    observation yet, a broken estimate) counts as 1, so a bad estimate can neither make a
    request free nor stall DRR on an infinite cost.
    """

    __slots__ = ("base", "factor")

    def __init__(self, base: CostModel, factor: Callable[[], float]) -> None:
        self.base = base
        self.factor = factor

    def cost(self, rows: int, tokens: int) -> float:
        f = self.factor()
        if not (f > 0 and math.isfinite(f)):
            f = 1.0
        return self.base.cost(rows, tokens) * f


def cost_model_for(unit: CostUnit) -> CostModel:
    """The plain cost model of a cost unit."""
    return TokenCost() if unit is CostUnit.TOKENS else RequestCost()
