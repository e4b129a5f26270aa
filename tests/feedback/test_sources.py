"""Triton's metrics as the preferred source: staleness, fallback, and back, all visible."""

from __future__ import annotations

import logging

import pytest
from feedback_support import Truth, delta, feed, serve_pipelined, token_model

from fair_frontend.feedback import ServiceModel, Source

# The frontend sees Triton's execution time plus 1 ms of its own overhead per batch, so
# the two sources are told apart by their answers.
FRONTEND_OVERHEAD_S = 0.001
TRITON_TRUTH = Truth(fixed_s=0.004, per_token_s=20e-6)


def frontend_batches(model: ServiceModel, start: float, count: int = 20) -> float:
    """``count`` batches of 8 rows x 64 tokens, back to back; returns the last finish."""
    seen = Truth(fixed_s=TRITON_TRUTH.fixed_s + FRONTEND_OVERHEAD_S)
    served = feed(model, serve_pipelined([(8, 512)] * count, seen, start=start))
    return served[-1].finished


def triton_interval(model: ServiceModel, at: float, execs: int = 20) -> None:
    model.observe_triton(
        delta(at, execs=execs, rows_per_exec=8, seconds_per_exec=TRITON_TRUTH.seconds(8, 512))
    )


def sources_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if "service estimates now from" in r.getMessage()
    ]


def test_stale_metrics_fall_back_to_the_frontend_and_come_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="fair_frontend.feedback")
    model = token_model()
    status = model.status()
    assert status.source is Source.DEFAULT and status.triton_stale
    assert "no scrape" in (status.stale_reason or "")

    t = frontend_batches(model, 0.0)
    assert model.source is Source.FRONTEND
    frontend_guess = model.predict_batch_seconds(8, 512)
    assert frontend_guess == pytest.approx(TRITON_TRUTH.seconds(8, 512) + FRONTEND_OVERHEAD_S)

    # Triton's metrics arrive (the frontend keeps sending): Triton's numbers are used.
    for i in range(1, 4):
        t = frontend_batches(model, float(i))
        triton_interval(model, float(i) + 0.9)
    status = model.status()
    assert status.source is Source.TRITON and not status.triton_stale
    assert status.stale_reason is None
    assert model.predict_batch_seconds(8, 512) == pytest.approx(TRITON_TRUTH.seconds(8, 512))

    # Scrapes stop: after 3 intervals without one, back to the frontend's numbers.
    model.tick(3.9 + 2.9)
    assert model.source is Source.TRITON
    model.tick(3.9 + 3.1)
    status = model.status()
    assert status.source is Source.FRONTEND and status.triton_stale
    assert "no successful scrape" in (status.stale_reason or "")
    assert model.predict_batch_seconds(8, 512) == pytest.approx(frontend_guess)

    # A scrape succeeds again: Triton's numbers again.
    triton_interval(model, 8.0)
    assert model.source is Source.TRITON and not model.status().triton_stale

    assert sources_logged(caplog) == [
        "embed: service estimates now from frontend (were from default); "
        "Triton's metrics: no scrape of Triton's metrics yet",
        "embed: service estimates now from triton (were from frontend); Triton's metrics: current",
        "embed: service estimates now from frontend (were from triton); Triton's metrics: "
        "no successful scrape for 3.1 s (stale after 3.0 s)",
        "embed: service estimates now from triton (were from frontend); Triton's metrics: current",
    ]
    del t


def test_frozen_counters_while_the_frontend_sends_mean_stale(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = token_model()
    frontend_batches(model, 0.0)
    triton_interval(model, 0.9)
    assert model.source is Source.TRITON
    # Batches keep finishing, but Triton's counters stop moving (wrong server, frozen).
    frontend_batches(model, 1.0)
    model.observe_triton(delta(1.9, execs=0))
    status = model.status()
    assert status.source is Source.FRONTEND and status.triton_stale
    assert "did not move" in (status.stale_reason or "")
    # Counters moving again: Triton is current again.
    frontend_batches(model, 2.0)
    triton_interval(model, 2.9)
    assert model.source is Source.TRITON


def test_idle_counters_without_frontend_traffic_are_not_stale() -> None:
    model = token_model()
    frontend_batches(model, 0.0)
    triton_interval(model, 0.9)
    for i in range(1, 10):  # nothing sent, nothing executed: all quiet, all current
        model.observe_triton(delta(i + 0.9, execs=0))
    assert model.source is Source.TRITON and not model.status().triton_stale


def test_one_batch_across_a_scrape_boundary_is_not_frozen() -> None:
    model = token_model()
    frontend_batches(model, 0.0)
    triton_interval(model, 0.9)
    # Triton counted this batch before the scrape; the frontend got the answer after it.
    model.observe_batch(8, 512, 0.95, 0.96, 0.96)
    model.observe_triton(delta(1.9, execs=0))
    assert model.source is Source.TRITON


def test_stale_triton_data_beats_the_defaults() -> None:
    model = token_model()
    # Triton traffic only (tokens from the model's own counter), then scrapes stop.
    model.observe_triton(
        delta(
            1.0,
            execs=20,
            rows_per_exec=8,
            seconds_per_exec=TRITON_TRUTH.seconds(8, 512),
            rows=160,
            tokens=160 * 64,
        )
    )
    model.tick(100.0)
    status = model.status()
    assert status.source is Source.TRITON and status.triton_stale
    assert model.predict_batch_seconds(8, 512) == pytest.approx(TRITON_TRUTH.seconds(8, 512))


def test_triton_execution_time_is_compute_per_request_not_per_execution() -> None:
    # Triton merged 4 requests per execution: compute grew 4x the execution's time.
    model = token_model()
    model.observe_batch(8, 512, 0.0, 0.02, 0.02)
    model.observe_triton(delta(1.0, execs=10, seconds_per_exec=0.010, requests_per_exec=4))
    assert model.source is Source.TRITON
    assert model.predict_batch_seconds(8, 512) == pytest.approx(0.010)


def test_triton_tokens_come_from_the_frontend_then_the_models_counter() -> None:
    model = token_model()
    # Frontend batches of 8 rows x 64 tokens in the interval: tokens per row 64.
    frontend_batches(model, 0.0)
    model.observe_triton(delta(0.9, execs=5, rows_per_exec=16, seconds_per_exec=0.02))
    assert model.status().typical_tokens == pytest.approx(16 * 64)
    # Nothing from the frontend this interval: the model's own counter (10 tokens a row).
    other = token_model()
    other.observe_triton(
        delta(1.0, execs=5, rows_per_exec=16, seconds_per_exec=0.02, rows=80, tokens=800)
    )
    assert other.status().typical_tokens == pytest.approx(16 * 10)
    # No token information at all: the interval keeps the metrics current, learns nothing.
    blind = token_model()
    blind.observe_triton(delta(1.0, execs=5))
    assert blind.source is Source.DEFAULT and not blind.status().triton_stale


def test_a_counter_reset_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    model = token_model()
    frontend_batches(model, 0.0)
    model.observe_triton(delta(1.0, execs=3, rows_per_exec=8, seconds_per_exec=0.014, reset=True))
    assert any("restarted" in r.getMessage() for r in caplog.records)
    assert model.source is Source.TRITON


def test_status_samples_for_the_metrics_layer() -> None:
    model = token_model()
    frontend_batches(model, 0.0)
    samples = {
        (name, tuple(sorted(labels.items()))): v for name, labels, v in model.status().samples()
    }
    ep = ("endpoint", "embed")
    assert samples[("fair_service_source", (ep, ("source", "frontend")))] == 1.0
    assert samples[("fair_service_source", (ep, ("source", "triton")))] == 0.0
    assert samples[("fair_triton_metrics_stale", (ep,))] == 1.0
    rows_per_s = samples[("fair_service_rate", (ep, ("unit", "rows")))]
    assert rows_per_s == pytest.approx(8 / (TRITON_TRUTH.seconds(8, 512) + FRONTEND_OVERHEAD_S))
    assert samples[("fair_service_unit_seconds", (ep,))] == pytest.approx(
        (TRITON_TRUTH.seconds(8, 512) + FRONTEND_OVERHEAD_S) / 512
    )


def test_a_batch_triton_counts_one_scrape_late_is_matched_to_its_own_tokens() -> None:
    # Measured on the real Triton: an execution is counted just after its answer leaves,
    # so a scrape can miss the group's last batch. Rows are matched oldest first.
    model = token_model()
    group_a = Truth().seconds(32, 32 * 16)
    group_b = Truth().seconds(4, 4 * 256)
    t = 0.0
    for _ in range(5):
        model.observe_batch(32, 32 * 16, t, t + group_a, t + group_a)
        t += group_a
    model.observe_triton(delta(t, execs=4, rows_per_exec=32, seconds_per_exec=group_a))
    for _ in range(5):
        model.observe_batch(4, 4 * 256, t, t + group_b, t + group_b)
        t += group_b
    # The late one of group A plus all of group B: 52 rows, 512 + 5 * 1024 tokens.
    late = delta(t, execs=6, rows_per_exec=52 / 6, seconds_per_exec=(group_a + 5 * group_b) / 6)
    model.observe_triton(late)
    assert model.source is Source.TRITON
    rows, tokens = model.typical_batch()  # (the older interval has decayed a little)
    assert rows == pytest.approx((4 * 32 + 52) / 10, rel=0.02)
    assert tokens / rows == pytest.approx((4 * 512 + 512 + 5 * 1024) / (4 * 32 + 52), rel=0.02)
    # Linear model, exact means: the fit is the truth.
    assert model.predict_batch_seconds(32, 512) == pytest.approx(group_a)
    assert model.predict_batch_seconds(4, 1024) == pytest.approx(group_b)
