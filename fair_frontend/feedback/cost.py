"""``FeedbackCost``: a request's DRR cost, normalised by the observed service cost."""

from __future__ import annotations

import math

from fair_frontend.feedback.service import ServiceModel
from fair_frontend.scheduler.cost import CostModel


class FeedbackCost:
    """What does this request cost, in the endpoint's units, at the GPU time it takes?

    ``predict_request_seconds(rows, tokens) / unit_seconds()``: the request's marginal
    seconds in a typical batch, expressed in the endpoint's cost units (tokens or rows) by
    dividing by the observed seconds per unit. The units stay those of the quantum (a
    typical batch's requests cost, in sum, what the plain model charges them), but each
    request pays for what it really occupies: on a request-cost endpoint a generation
    asking 256 new tokens costs more than one asking 16; on a token-cost endpoint a
    1-token request pays its share of the batch's fixed cost and is not nearly free.

    The plain ``base`` cost while the service model has no data, or whenever the estimate
    is not a positive finite number. Costs are fixed at enqueue (``CostModel``), so the
    DRR bounds of ``fair_frontend.scheduler`` hold unchanged with C = the largest
    normalised cost a tenant has queued; see the ``feedback`` package docstring.
    """

    __slots__ = ("base", "service")

    def __init__(self, base: CostModel, service: ServiceModel) -> None:
        self.base = base
        self.service = service

    def cost(self, rows: int, tokens: int) -> float:
        if not self.service.has_data:
            return self.base.cost(rows, tokens)
        unit = self.service.unit_seconds()
        value = self.service.predict_request_seconds(rows, tokens) / unit if unit > 0 else 0.0
        if not (value > 0 and math.isfinite(value)):
            return self.base.cost(rows, tokens)
        return value
