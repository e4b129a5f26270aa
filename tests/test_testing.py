"""``fair_frontend.kit.testing``: the scraper and the waits the tests and benchmarks share.

``eventually`` runs on a clock of the test's own (``FakeTime``: its sleeps move it on and
are recorded), so what it waits is asserted exactly. ``aeventually`` runs on the loop's
real clock: each wait there is given an interval far longer than its timeout, so that a
bug (sleeping a whole interval past the deadline, or awaiting a condition unbounded) would
take many times longer than the bound the test allows, and the bound many times longer
than the wait a loaded machine can stretch.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from fair_frontend.kit import testing
from fair_frontend.kit.testing import aeventually, eventually, parse

# aeventually's bound on a wait of 0.1 s: far above what a loaded machine adds to it, far
# below the interval a bug would sleep (LONG_INTERVAL_S), or a hang.
BOUND_S = 10.0
LONG_INTERVAL_S = 60.0

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


class FakeTime:
    """``fair_frontend.kit.testing``'s ``time`` module, on a clock of the test's own: ``sleep``
    moves it on at once and records how long; ``monotonic`` reads it. (The times the tests
    use are binary fractions: sums of them are exact.)"""

    def __init__(self) -> None:
        self.now = 1024.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(testing, "time", fake)
    return fake


def test_eventually_returns_the_first_truthy_value_at_once(fake_time: FakeTime) -> None:
    calls = []

    def ready() -> str:
        calls.append(fake_time.now)
        return "yes"

    assert eventually(ready, timeout=5, interval=1) == "yes"
    assert calls == [1024.0] and fake_time.sleeps == []  # one look, no sleep


def test_eventually_polls_until_true(fake_time: FakeTime) -> None:
    values = iter([0, None, "", 42])
    assert eventually(lambda: next(values), timeout=5, interval=0.125) == 42
    assert fake_time.sleeps == [0.125] * 3  # one interval between looks


def test_eventually_fails_after_the_timeout_naming_what(fake_time: FakeTime) -> None:
    looks: list[float] = []

    def drained() -> bool:
        looks.append(fake_time.now - 1024.0)
        return False

    with pytest.raises(AssertionError, match=r"not within 0\.25 s: the queue to drain"):
        eventually(drained, timeout=0.25, interval=0.1875, what="the queue to drain")
    # An interval, then only the time left: the last look at the deadline, no sleep past
    # it, and no failure before it.
    assert fake_time.sleeps == [0.1875, 0.0625]
    assert looks == [0.0, 0.1875, 0.25]


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
    # An interval far longer than the timeout: it sleeps only the time left, and fails at
    # the deadline (not before it; a whole interval would be LONG_INTERVAL_S).
    looks = 0

    def nothing() -> int:
        nonlocal looks
        looks += 1
        return 0

    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"not within 0\.1 s: nothing"):
        await asyncio.wait_for(
            aeventually(nothing, timeout=0.1, interval=LONG_INTERVAL_S, what="nothing"), BOUND_S
        )
    took = time.monotonic() - start
    assert 0.1 - 1e-3 <= took < BOUND_S, took
    assert looks == 2  # at once, and at the deadline

    async def hangs() -> bool:
        await asyncio.Event().wait()
        return True

    # A condition that never answers fails the wait at its deadline (unbounded, it would
    # hang: wait_for turns that into a TimeoutError, not the AssertionError expected).
    start = time.monotonic()
    with pytest.raises(AssertionError, match="did not answer"):
        await asyncio.wait_for(aeventually(hangs, timeout=0.1, interval=0.02), BOUND_S)
    took = time.monotonic() - start
    assert 0.1 - 1e-3 <= took < BOUND_S, took
