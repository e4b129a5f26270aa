"""The core's metrics per tick (``fair_frontend.core.metrics.Pending``): held events reach the
families in bulk, exactly as one ``inc`` / ``observe`` each would have, and always before
the registry is read.

Unit tests on the metrics alone (no frontend): what would break is a scrape that misses
events counted before it, or a bulk observation that bins a value into another bucket
than ``Histogram.observe`` (a bound itself, below the first, above the last).
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from fair_frontend.config import parse_config
from fair_frontend.core.metrics import PENDING_VALUES, FrontendMetrics, observe_many
from fair_frontend.observability.observe import BatchReport, Finished
from fair_frontend.outcomes import Outcome
from fair_frontend.wire.records import INTER_TOKEN_BUCKETS, bin_gaps, gaps_from, gaps_of

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_bulk_observations_bin_as_one_observe_each() -> None:
    rng = random.Random(30)
    edges = [0.0, *BUCKETS, 1e-9, 5.0, 1e9]  # on a bound, below the first, above the last
    for n in (1, 7, 63, 64, 65, 1000):  # one by one (bisect), and at once (numpy)
        values = [rng.choice(edges) if rng.random() < 0.3 else rng.random() for _ in range(n)]
        one, bulk = CollectorRegistry(), CollectorRegistry()
        each = Histogram("h", "h", ["x"], buckets=BUCKETS, registry=one).labels("a")
        for v in values:
            each.observe(v)
        observe_many(Histogram("h", "h", ["x"], buckets=BUCKETS, registry=bulk).labels("a"), values)
        a, b = samples(one), samples(bulk)
        assert a.keys() == b.keys()
        for key, value in a.items():
            assert abs(value - b[key]) <= 1e-9 * max(1.0, abs(value)), (n, key)


def config():
    return parse_config(
        {
            "tenants": {"acme": {"api_keys": ["k" * 32], "tier": "standard"}},
            "tiers": ["standard"],
            "endpoints": {"llm": {"max_inflight": 4, "cost": "tokens"}},
        },
        "(test)",
    )


def test_everything_counted_before_a_scrape_is_in_it() -> None:
    metrics = FrontendMetrics(config())
    for _ in range(3):
        metrics.request_finished(
            tenant="acme", model="llm", outcome=Outcome.DISPATCHED, queued_s=0.002, latency_s=0.5
        )
    metrics.tokens_produced(
        tenant="acme", model="llm", tokens=5, first_token_s=0.2, inter_token=gaps_from([0.02] * 4)
    )
    metrics.batch_finished(
        BatchReport("llm", 1, 9, 1, {"acme": 1}, {"acme": 9}, {"acme": 9.0}, 0.0, 0.25, True)
    )
    got = samples(metrics.registry)
    acme = (("endpoint", "llm"), ("tenant", "acme"), ("tier", "standard"))
    assert got[("fair_requests_total", (acme[0], ("outcome", "dispatched"), *acme[1:]))] == 3
    assert got[("fair_queue_wait_seconds_count", acme)] == 3
    assert got[("fair_output_tokens_total", acme)] == 5
    assert got[("fair_time_to_first_token_seconds_count", acme)] == 1
    assert got[("fair_inter_token_seconds_count", acme)] == 4
    model = (("gen_ai_request_model", "llm"),)
    assert got[("gen_ai_server_time_per_output_token_seconds_count", model)] == 4
    assert got[("gen_ai_server_time_to_first_token_seconds_count", model)] == 1
    assert got[("fair_served_tokens_total", (("endpoint", "llm"), ("tenant", "acme")))] == 9
    assert got[("fair_batches_total", (("endpoint", "llm"), ("result", "ok")))] == 1
    # A second scrape counts nothing twice; new events add to it.
    metrics.tokens_produced(tenant="acme", model="llm", tokens=2, first_token_s=None)
    again = samples(metrics.registry)
    assert again[("fair_output_tokens_total", acme)] == 7
    assert again[("fair_inter_token_seconds_count", acme)] == 4


def test_observations_held_between_scrapes_stay_bounded() -> None:
    """A stream's inter-token times come binned (``records.Gaps``): what is held for a
    series between scrapes is its buckets, however many times they count."""
    metrics = FrontendMetrics(config())
    gaps = gaps_from([0.01] * 1000)
    for _ in range(3 * PENDING_VALUES // 1000 * 2):
        metrics.tokens_produced(
            tenant="acme", model="llm", tokens=1001, first_token_s=None, inter_token=gaps
        )
        assert all(len(v) < PENDING_VALUES for v in metrics.pending.values.values())
        ((_, bins),) = metrics.pending.binned.values()
        assert len(bins) == len(INTER_TOKEN_BUCKETS) + 1
    got = samples(metrics.registry)
    acme = (("endpoint", "llm"), ("tenant", "acme"), ("tier", "standard"))
    assert got[("fair_inter_token_seconds_count", acme)] == 3 * PENDING_VALUES // 1000 * 2000
    assert not metrics.pending.binned  # the scrape took them


TIMES = st.floats(0.0, 10.0, allow_nan=False) | st.sampled_from([0.0, *INTER_TOKEN_BUCKETS])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(1, 16), TIMES), max_size=8), max_size=6))
def test_times_binned_by_the_shells_read_as_each_observed(
    streams: list[list[tuple[int, float]]],
) -> None:
    """Streams' responses (tokens, the gap before them) binned as a shell bins them
    (``bin_gaps``: the gap shared evenly by the response's tokens) and held by the core
    (``Pending.observe_binned``) leave both histograms as ``observe`` of each token's time
    would: every bucket, the sum and the count (a bound itself, 0, past the last)."""
    one, binned = FrontendMetrics(config()), FrontendMetrics(config())
    for metrics in (one, binned):  # its series, whatever is observed
        metrics.tokens_produced(tenant="acme", model="llm", tokens=0, first_token_s=None)
    sink = one._token_sinks[("acme", "llm")][2]
    sent = []
    for responses in streams:
        bins: dict[int, int] = {}
        total = 0.0
        for tokens, gap_s in responses:
            total += bin_gaps(bins, tokens, gap_s)
            for child in sink:
                for _ in range(tokens):
                    child.observe(gap_s / tokens)
        sent.append(gaps_of(total, bins))
    for gaps in sent:  # each stream's, as the core observes each tenant's and model's
        binned.tokens_produced(
            tenant="acme", model="llm", tokens=0, first_token_s=None, inter_token=gaps
        )
    assert close(samples(binned.registry), samples(one.registry))


@given(
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=12),
    st.floats(allow_nan=True, allow_infinity=True),
)
def test_a_shells_binned_times_count_only_what_names_a_bucket(
    bins: list[int], total: float
) -> None:
    """A shell's ``Gaps`` as the link may deliver them, whatever their values (msgspec
    checks only their types): a pair naming no bucket (negative, past +Inf, huge), a count
    below one, a dangling index, a sum that is no time (negative, NaN, infinite) is left
    out; what is left counts as it says, and the scrape still reads every series."""
    size = len(INTER_TOKEN_BUCKETS) + 1
    metrics = FrontendMetrics(config())
    metrics.tokens_produced(tenant="acme", model="llm", tokens=0, first_token_s=None)
    metrics.tokens_produced(
        tenant="acme", model="llm", tokens=0, first_token_s=None, inter_token=(total, bins)
    )
    got = samples(metrics.registry)  # a scrape: held counts go into the families here
    counted = [0] * size
    for bucket, count in zip(bins[::2], bins[1::2], strict=False):
        if 0 <= bucket < size and count > 0:
            counted[bucket] += count
    name = "fair_inter_token_seconds"
    labels = (("endpoint", "llm"), ("tenant", "acme"), ("tier", "standard"))
    assert got[(f"{name}_count", labels)] == sum(counted)
    assert got[(f"{name}_sum", labels)] == (total if 0 <= total < float("inf") else 0.0)
    cumulative = 0
    for bound, count in zip((*INTER_TOKEN_BUCKETS, float("inf")), counted, strict=True):
        cumulative += count
        le = (labels[0], ("le", floatToGoString(bound)), *labels[1:])
        assert got[(f"{name}_bucket", le)] == cumulative


def many_config():
    return parse_config(
        {
            "tenants": {
                name: {"api_keys": [name[0] * 32], "tier": "standard"}
                for name in ("acme", "globex", "initech")
            },
            "tiers": ["standard"],
            "endpoints": {"llm": {"max_inflight": 4, "cost": "tokens"}},
        },
        "(test)",
    )


TENANT = st.sampled_from(["acme", "globex", "initech", "gone"])  # gone: not configured
MODEL = st.sampled_from(["llm", "embed"])
SECONDS = st.floats(0.0, 10.0, allow_nan=False)


@st.composite
def batch_reports(draw: st.DrawFn) -> BatchReport:
    rows = draw(st.dictionaries(TENANT, st.integers(1, 64), min_size=1, max_size=3))
    tokens = {t: n * draw(st.integers(1, 512)) for t, n in rows.items()}
    cost = {t: draw(st.floats(0.0, 1e4, allow_nan=False)) for t in rows}
    started = draw(SECONDS)
    return BatchReport(
        draw(MODEL), sum(rows.values()), sum(tokens.values()), len(rows), rows, tokens, cost,
        started, started + draw(SECONDS), draw(st.booleans()),
    )  # fmt: skip


@st.composite
def ends(draw: st.DrawFn) -> Finished:
    return Finished(
        draw(TENANT | st.none()),
        draw(MODEL),
        draw(st.sampled_from(list(Outcome))),
        draw(SECONDS | st.none()),
        latency_s=draw(SECONDS | st.none()),
    )


def close(a: dict[Any, float], b: dict[Any, float]) -> bool:
    return a.keys() == b.keys() and all(
        abs(v - b[k]) <= 1e-9 * max(1.0, abs(v)) for k, v in a.items()
    )


@settings(max_examples=150, deadline=None)
@given(st.lists(batch_reports(), max_size=20), st.lists(ends(), max_size=40))
def test_a_turns_events_counted_together_read_as_each_counted_alone(
    reports: list[BatchReport], finished: list[Finished]
) -> None:
    """``batches_finished`` (a loop turn's batch reports, per turn: ``Dispatcher``) and
    ``requests_finished`` (a batch part's served rows: ``Accounting.on_served``) leave the
    metrics as ``batch_finished`` and ``request_finished`` of each would."""
    alone, together = FrontendMetrics(many_config()), FrontendMetrics(many_config())
    for report in reports:
        alone.batch_finished(report)
    for end in finished:
        end.told(alone)
    together.batches_finished(reports)
    together.requests_finished(finished)
    assert close(samples(together.registry), samples(alone.registry))
