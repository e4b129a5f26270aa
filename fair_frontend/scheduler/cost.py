"""What a request costs in DRR units: computed once at enqueue, stored on the request."""

from __future__ import annotations

import enum
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


def cost_model_for(unit: CostUnit) -> CostModel:
    """The plain cost model of a cost unit."""
    return TokenCost() if unit is CostUnit.TOKENS else RequestCost()
