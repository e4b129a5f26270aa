"""``fair_frontend.testing``: the scraper and the waits the tests and benchmarks share."""

from __future__ import annotations

import asyncio
import time

import pytest

from fair_frontend.testing import aeventually, eventually, parse

PAGE = """\
# HELP fair_requests_total Requests by outcome.
# TYPE fair_requests_total counter
fair_requests_total{endpoint="embed",outcome="dispatched",tenant="acme"} 3.0
fair_requests_total{endpoint="embed",outcome="rejected_rate",tenant="acme"} 2.0
fair_requests_total{endpoint="llm",outcome="dispatched",tenant="globex"} 5.0
# HELP fair_requests_created Requests by outcome.
# TYPE fair_requests_created gauge
fair_requests_created{endpoint="embed",outcome="dispatched",tenant="acme"} 1.7e+09
# HELP fair_queue_depth Requests queued, by endpoint and tier.
# TYPE fair_queue_depth gauge
fair_queue_depth{endpoint="embed",tier="standard"} 4.0
fair_queue_depth{endpoint="llm",tier="standard"} 1.0
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="embed",version="1"} 7
"""


def test_sum_filters_by_name_and_labels() -> None:
    got = parse(PAGE)
    assert got.sum("fair_requests_total") == 10
    assert got.sum("fair_requests_total", tenant="acme") == 5
    assert got.sum("fair_requests_total", tenant="acme", outcome="dispatched") == 3
    assert got.sum("fair_requests_total", tenant="nobody") == 0
    assert got.sum("no_such_metric") == 0
    assert got.sum("fair_queue_depth", endpoint="embed") == 4
    # A counter without ``_total`` (Triton's): the parser names its sample ``..._total``.
    assert got.sum("nv_inference_count_total", model="embed") == 7


def test_family_sum_leaves_out_created() -> None:
    got = parse(PAGE)
    assert got.family_sum("fair_requests", endpoint="embed") == 5  # not the _created stamp
    assert got.family_sum("fair_queue_depth") == 5
    assert got.family_sum("nv_inference_count", model="embed") == 7


def test_per_label_sums_and_values() -> None:
    got = parse(PAGE)
    assert got.by_label("fair_requests_total", "tenant") == {"acme": 5, "globex": 5}
    assert got.by_label("fair_requests_total", "tenant", endpoint="embed") == {"acme": 5}
    assert got.label_values("fair_queue_depth", "endpoint") == {"embed", "llm"}
    assert got.label_values("fair_queue_depth", "tenant") == set()
    assert len(got) == 7 and {s.family for s in got} == {
        "fair_requests",
        "fair_requests_created",
        "fair_queue_depth",
        "nv_inference_count",
    }


def test_eventually_returns_the_first_truthy_value_at_once() -> None:
    calls = []

    def ready() -> str:
        calls.append(1)
        return "yes"

    start = time.monotonic()
    assert eventually(ready, timeout=5, interval=1) == "yes"
    assert calls == [1] and time.monotonic() - start < 0.5


def test_eventually_polls_until_true() -> None:
    values = iter([0, None, "", 42])
    assert eventually(lambda: next(values), timeout=5, interval=0.001) == 42


def test_eventually_fails_after_the_timeout_naming_what() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"not within 0\.2 s: the queue to drain"):
        eventually(lambda: False, timeout=0.2, interval=0.05, what="the queue to drain")
    took = time.monotonic() - start
    assert 0.2 <= took < 0.2 + 0.15  # the last look at the deadline, no sleep past it


def test_eventually_names_the_condition_by_default() -> None:
    def flood_queued() -> bool:
        return False

    with pytest.raises(AssertionError, match="flood_queued"):
        eventually(flood_queued, timeout=0.01, interval=0.005)


async def test_aeventually_takes_coroutines_and_plain_values() -> None:
    values = iter([False, False, True])

    async def check() -> bool:
        return next(values)

    assert await aeventually(check, timeout=5, interval=0.001) is True
    assert await aeventually(lambda: "plain", timeout=5) == "plain"


async def test_aeventually_fails_after_the_timeout_and_bounds_a_hung_condition() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"not within 0\.1 s: nothing"):
        await aeventually(lambda: 0, timeout=0.1, interval=0.02, what="nothing")
    assert time.monotonic() - start < 0.25

    async def hangs() -> bool:
        await asyncio.Event().wait()
        return True

    start = time.monotonic()
    with pytest.raises(AssertionError, match="did not answer"):
        await aeventually(hangs, timeout=0.1, interval=0.02)
    assert time.monotonic() - start < 0.25
