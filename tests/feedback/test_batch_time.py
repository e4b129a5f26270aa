"""The batch-time model on a fake clock: convergence, drift, identification, service time."""

from __future__ import annotations

import math
import random

import pytest
from feedback_support import (
    FIXED_S,
    PER_TOKEN_S,
    Truth,
    feed,
    random_batches,
    serve_pipelined,
    token_model,
)

from fair_frontend.feedback import BatchTime, DecayedStats, ServiceModel, Source
from fair_frontend.scheduler.cost import CostUnit

# Realistic timing noise: 2 % of the batch time plus 50 us of jitter, symmetric.
NOISE = 0.02
JITTER_S = 50e-6


def rel(value: float, truth: float) -> float:
    return abs(value / truth - 1.0)


@pytest.mark.parametrize("seed", range(3))
def test_converges_to_the_truth_within_5_percent(seed: int) -> None:
    rng = random.Random(seed)
    model = token_model()
    served = serve_pipelined(
        random_batches(rng, 600), Truth(), rng=rng, noise=NOISE, jitter_s=JITTER_S
    )
    worst = 0.0
    for i, s in enumerate(served):
        model.observe_batch(s.rows, s.tokens, s.sent, s.finished, s.finished)
        if i >= 300:  # after warm-up, every estimate along the way is within 5 %
            bt = model.batch_time()
            worst = max(worst, rel(bt.fixed_s, FIXED_S), rel(bt.per_token_s, PER_TOKEN_S))
    bt = model.batch_time()
    assert worst < 0.05, (worst, bt)
    # No per-row cost in the truth: none is invented (BIC keeps the zero term out).
    assert bt.per_row_s == 0.0
    assert bt.terms == ("fixed", "per_token")
    assert model.source is Source.FRONTEND


def reconvergence(seed: int) -> tuple[int, float, BatchTime]:
    """Double the per-token cost after 600 batches; batches and seconds until the fit is
    within 10 % of the new truth (both terms) for good."""
    rng = random.Random(seed)
    model = token_model()
    served = list(
        serve_pipelined(random_batches(rng, 600), Truth(), rng=rng, noise=NOISE, jitter_s=JITTER_S)
    )
    feed(model, served)
    changed_at = served[-1].finished
    new = Truth(per_token_s=2 * PER_TOKEN_S)
    after = list(
        serve_pipelined(
            random_batches(rng, 3000),
            new,
            start=changed_at,
            rng=rng,
            noise=NOISE,
            jitter_s=JITTER_S,
        )
    )
    last_outside = -1
    for i, s in enumerate(after):
        model.observe_batch(s.rows, s.tokens, s.sent, s.finished, s.finished)
        bt = model.batch_time()
        if rel(bt.fixed_s, new.fixed_s) > 0.1 or rel(bt.per_token_s, new.per_token_s) > 0.1:
            last_outside = i
    assert last_outside < len(after) - 1000, "never settled"
    n = last_outside + 1
    return n, after[n].finished - changed_at, model.batch_time()


@pytest.mark.parametrize("seed", range(3))
def test_reconverges_after_the_per_token_cost_doubles(seed: int) -> None:
    batches, seconds, bt = reconvergence(seed)
    # Memory: time constant 4.5 s (alpha 0.2 per 1 s interval), here ~80 batches/s.
    # Measured for seeds 0-2: 357, 389, 579 batches; 8.7, 9.4, 13.4 s of (fake) time.
    assert batches <= 1500 and seconds <= 40.0, (batches, seconds, bt)
    assert rel(bt.per_token_s, 2 * PER_TOKEN_S) < 0.05


def test_all_equal_batches_invent_no_slope() -> None:
    rng = random.Random(7)
    for cost_unit, term in ((CostUnit.TOKENS, "per_token"), (CostUnit.REQUESTS, "per_row")):
        model = ServiceModel("ep", cost_unit=cost_unit, max_batch_size=32)
        same = [(8, 512)] * 300
        feed(model, serve_pipelined(same, Truth(), rng=rng, noise=NOISE, jitter_s=JITTER_S))
        bt = model.batch_time()
        # Cannot tell fixed from variable cost: proportional to the cost unit, and said so.
        assert bt.terms == (term,)
        assert bt.fixed_s == 0.0
        mean = Truth().seconds(8, 512)
        assert rel(model.predict_batch_seconds(8, 512), mean) < 0.02
        assert model.status().batch_time.basis == term


def test_tokens_proportional_to_rows_give_fixed_plus_cost_unit_slope() -> None:
    # Every row 64 tokens: rows and tokens cannot be told apart, only fixed + one slope.
    rng = random.Random(3)
    model = token_model()
    batches = [(r, 64 * r) for r in (rng.randint(1, 32) for _ in range(400))]
    feed(model, serve_pipelined(batches, Truth(), rng=rng, noise=NOISE, jitter_s=JITTER_S))
    bt = model.batch_time()
    assert bt.terms == ("fixed", "per_token")
    assert bt.per_row_s == 0.0
    assert rel(bt.per_token_s, PER_TOKEN_S) < 0.05


def test_coefficients_are_never_negative() -> None:
    # A truth the linear model cannot hold: time falls with tokens. The fit clamps.
    stats = DecayedStats()
    for rows, tokens in [(1, 10), (1, 100), (2, 10), (2, 100), (4, 50)] * 20:
        stats.add(rows, tokens, 0.010 + 0.001 * rows - 0.00005 * tokens)
    bt = stats.fit(unit=2)
    assert bt is not None
    assert min(bt.fixed_s, bt.per_row_s, bt.per_token_s) >= 0.0
    assert bt.per_token_s == 0.0


def test_service_time_excludes_the_wait_behind_the_batch_ahead() -> None:
    # Two in flight, one instance: a batch's round trip is about two execution times.
    model = token_model()
    served = feed(model, serve_pipelined([(32, 2048)] * 50, Truth()))
    assert served[10].finished - served[10].sent == pytest.approx(2 * Truth().seconds(32, 2048))
    assert model.predict_batch_seconds(32, 2048) == pytest.approx(Truth().seconds(32, 2048))
    # Busy time is the sum of execution times: the rate is rows per execution second.
    rate = model.service_rate()
    assert rate.rows_per_s == pytest.approx(32 / Truth().seconds(32, 2048))
    assert rate.tokens_per_s == pytest.approx(2048 / Truth().seconds(32, 2048))


def test_service_time_of_a_batch_sent_to_an_idle_instance_is_its_round_trip() -> None:
    model = token_model()
    t = 0.0
    for _ in range(20):
        model.observe_batch(4, 100, t, t + 0.004, t + 0.004)
        t += 1.0  # idle in between
    assert model.predict_batch_seconds(4, 100) == pytest.approx(0.004)


def test_failed_and_out_of_order_batches() -> None:
    model = token_model(refit_interval_s=0.0)  # every batch refits: the accounting shows
    model.observe_batch(4, 100, 0.0, 0.010, 0.010)
    # A failed batch is not learned from, but the next batch waited behind it.
    model.observe_batch(4, 100, 0.001, 0.011, 0.011, ok=False)
    model.observe_batch(4, 100, 0.002, 0.021, 0.021)
    assert model.status().frontend_batches == pytest.approx(2.0, rel=0.05)
    assert model.predict_batch_seconds(4, 100) == pytest.approx(0.010, rel=0.01)
    # Reported late (finished before the latest one): charged its own round trip.
    model.observe_batch(4, 100, 0.015, 0.020, 0.022)
    assert model.status().frontend_batches == pytest.approx(3.0, rel=0.05)
    assert model.predict_batch_seconds(4, 100) < 0.010


def test_the_model_is_refitted_at_most_every_refit_interval() -> None:
    """Small batches come back hundreds of times a second; refitting after each cost more
    than the requests themselves. The fit may lag the data by one interval, no more."""
    model = token_model(refit_interval_s=0.05)
    t = 0.0
    for _ in range(50):
        model.observe_batch(4, 100, t, t + 0.004, t + 0.004)
        t += 0.004
    assert model.predict_batch_seconds(4, 100) == pytest.approx(0.004, rel=0.01)
    slower = t
    for _ in range(5):  # 40 ms of batches twice as slow: within one interval of the fit
        model.observe_batch(4, 100, t, t + 0.008, t + 0.008)
        t += 0.008
    assert model.predict_batch_seconds(4, 100) == pytest.approx(0.004, rel=0.01)
    while t < slower + 0.06:
        model.observe_batch(4, 100, t, t + 0.008, t + 0.008)
        t += 0.008
    assert model.predict_batch_seconds(4, 100) > 0.0045  # refitted: it learns the change


def test_memory_floor_keeps_slow_traffic_from_forgetting_everything() -> None:
    model = token_model()
    for i in range(300):  # one batch a minute: time alone would forget all but the last
        t = 60.0 * i
        model.observe_batch(4, 100, t, t + 0.004, t + 0.004)
    assert 50 < model.status().frontend_batches <= 100.5
    fast = token_model()
    for i in range(3000):  # 200 batches a second: the 4.5 s time constant rules
        t = 0.005 * i
        fast.observe_batch(4, 100, t, t + 0.004, t + 0.004)
    assert fast.status().frontend_batches == pytest.approx(0.005**-1 * 4.48, rel=0.05)


def test_defaults_without_data() -> None:
    model = token_model()
    assert model.source is Source.DEFAULT
    assert not model.has_data
    assert model.predict_batch_seconds(32, 4096) == 0.010
    assert model.batch_time().basis == "default"
    assert model.service_rate().rows_per_s == 0.0
    assert math.isfinite(model.unit_seconds()) and model.unit_seconds() > 0
