"""FeedbackCost: plain cost without data; with data, what a request really occupies."""

from __future__ import annotations

import random
from typing import cast

import pytest
from feedback_support import Truth, feed, random_batches, serve_pipelined, trained

from fair_frontend.feedback import FeedbackCost, ServiceModel
from fair_frontend.scheduler import RequestCost, TokenCost
from fair_frontend.scheduler.cost import CostUnit

PROMPT = 32


def test_plain_cost_without_data() -> None:
    for unit, base in ((CostUnit.REQUESTS, RequestCost()), (CostUnit.TOKENS, TokenCost())):
        cost = FeedbackCost(base, ServiceModel("ep", cost_unit=unit, max_batch_size=8))
        assert cost.cost(1, 300) == base.cost(1, 300)
        assert cost.cost(3, 0) == base.cost(3, 0)


def generation_model() -> ServiceModel:
    """A request-cost generate endpoint: 3 ms per batch, 0.2 ms per token (prompt + new)."""
    rng = random.Random(5)
    model = ServiceModel("generate", cost_unit=CostUnit.REQUESTS, max_batch_size=8)
    batches = []
    for _ in range(300):
        rows = rng.randint(1, 8)
        tokens = sum(PROMPT + rng.choice((16, 64, 256)) for _ in range(rows))
        batches.append((rows, tokens))
    feed(model, serve_pipelined(batches, Truth(fixed_s=0.003, per_token_s=0.0002)))
    return model


def test_a_long_generation_costs_more_than_a_short_one() -> None:
    model = generation_model()
    cost = FeedbackCost(RequestCost(), model)
    short, long = cost.cost(1, PROMPT + 16), cost.cost(1, PROMPT + 256)
    assert long > 4 * short
    # Still in the endpoint's units: a typical request costs about one request.
    rows, tokens = model.typical_batch()
    assert cost.cost(1, round(tokens / rows)) == pytest.approx(1.0, rel=0.02)


def test_a_typical_batch_costs_its_plain_cost_in_total() -> None:
    # Whatever the split, the quantum keeps its meaning: sum of costs = sum of plain costs.
    rng = random.Random(11)
    model = trained(Truth(), batches=300)
    cost = FeedbackCost(TokenCost(), model)
    _, typical_tokens = model.typical_batch()
    rows = round(model.typical_batch()[0])
    requests = [rng.randint(4, 64) for _ in range(rows)]
    scale = typical_tokens / sum(requests)
    requests = [max(1, round(t * scale)) for t in requests]
    total = sum(cost.cost(1, t) for t in requests)
    assert total == pytest.approx(sum(requests), rel=0.03)


def test_a_one_token_request_is_not_nearly_free() -> None:
    # embed-like: 2 ms per batch + 20 us per token, batches of 32 rows x ~34 tokens.
    model = trained(Truth(), batches=300)
    cost = FeedbackCost(TokenCost(), model)
    assert TokenCost().cost(1, 1) == 1.0
    # Its share of the fixed cost (2 ms / ~16 rows) is worth several tokens.
    assert cost.cost(1, 1) > 4.0
    # A long request costs somewhat less than its tokens: the plain per-token price
    # includes every token's share of the fixed cost, which a long request mostly avoids.
    rows, tokens = model.typical_batch()
    per_token_price = (Truth().fixed_s + Truth().per_token_s * tokens) / tokens
    expected = (Truth().fixed_s / rows + Truth().per_token_s * 2048) / per_token_price
    assert cost.cost(1, 2048) == pytest.approx(expected, rel=1e-6)
    assert 0.7 * 2048 < cost.cost(1, 2048) < 2048


def test_a_broken_estimate_falls_back_to_the_plain_cost() -> None:
    class Broken:
        has_data = True

        def __init__(self, unit: float, seconds: float) -> None:
            self.unit, self.seconds = unit, seconds

        def unit_seconds(self) -> float:
            return self.unit

        def predict_request_seconds(self, rows: int, tokens: int) -> float:
            return self.seconds

    for unit, seconds in ((0.0, 0.01), (float("nan"), 0.01), (1e-3, float("inf")), (1e-3, 0.0)):
        cost = FeedbackCost(TokenCost(), cast(ServiceModel, Broken(unit, seconds)))
        assert cost.cost(1, 50) == 50.0


def test_costs_are_fixed_when_computed() -> None:
    # The scheduler stores the cost at enqueue; later data changes only later requests.
    rng = random.Random(2)
    model = trained(Truth(), batches=200)
    cost = FeedbackCost(TokenCost(), model)
    before = cost.cost(1, 1)
    feed(
        model,
        serve_pipelined(
            random_batches(rng, 2000), Truth(fixed_s=0.02), start=1e4
        ),  # fixed cost x10
    )
    assert cost.cost(1, 1) > 2 * before
