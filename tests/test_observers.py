"""``Observers``: every event reaches each observer that listens to it, with its
arguments as told (the per-request events take a path of their own, without the generic
one's keywords), and an observer that raises is logged and stops none of the others."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from fair_frontend.admission.throttle import ThrottleDecision
from fair_frontend.observability.observe import BatchReport, Finished, Observer, Observers
from fair_frontend.outcomes import Outcome

DECISION = ThrottleDecision(True, 0.1, 1.0, 1, "within target")
REPORT = BatchReport("embed", 2, 10, 2, {"acme": 2}, {"acme": 10}, {"acme": 10.0}, 0.0, 0.5, True)
FINISHED = Finished("acme", "embed", Outcome.DISPATCHED, 0.01, "r1", 0.02)

# Each event with arguments as a caller tells them, and as an observer must get them
# (defaults filled in: the observer's own signature has them too).
EVENTS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "request_finished",
        {"tenant": "acme", "model": "embed", "outcome": Outcome.DISPATCHED, "queued_s": 0.5,
         "latency_s": 0.7},
        {"tenant": "acme", "model": "embed", "outcome": Outcome.DISPATCHED, "queued_s": 0.5,
         "request_id": "", "latency_s": 0.7, "error": None, "usage": None, "service_s": None},
    ),
    (
        "tokens_produced",
        {"tenant": "acme", "model": "llm", "tokens": 3, "first_token_s": 0.2},
        {"tenant": "acme", "model": "llm", "tokens": 3, "first_token_s": 0.2,
         "inter_token": None},
    ),
    (
        "tokens_produced",
        {"tenant": "acme", "model": "llm", "tokens": 0, "first_token_s": None,
         "inter_token": (0.5, [3, 2])},
        {"tenant": "acme", "model": "llm", "tokens": 0, "first_token_s": None,
         "inter_token": (0.5, [3, 2])},
    ),
    (
        "throttle_decision",
        {"model": "embed", "decision": DECISION},
        {"model": "embed", "decision": DECISION, "count": 1},
    ),
    (
        "throttle_decision",
        {"model": "embed", "decision": DECISION, "count": 4},
        {"model": "embed", "decision": DECISION, "count": 4},
    ),
    ("batch_finished", {"report": REPORT}, {"report": REPORT}),
    (
        "rate_limit_hit",
        {"tenant": "acme", "model": "embed", "limit": "requests_per_second"},
        {"tenant": "acme", "model": "embed", "limit": "requests_per_second"},
    ),
    (
        "rate_limit_degraded",
        {"tenant": "acme", "model": "embed", "mode": "fail_open", "reason": "timeout"},
        {"tenant": "acme", "model": "embed", "mode": "fail_open", "reason": "timeout"},
    ),
    (
        "ttft_predicted",
        {"model": "llm", "slo_class": "chat", "error": 0.25},
        {"model": "llm", "slo_class": "chat", "error": 0.25},
    ),
]  # fmt: skip


class Records(Observer):
    """Keeps every event it hears, with the arguments it got."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, dict[str, Any]]] = []

    def _heard(self, event: str, **kwargs: Any) -> None:
        self.heard.append((event, kwargs))

    def request_finished(self, **kwargs: Any) -> None:
        self._heard("request_finished", **kwargs)

    def tokens_produced(self, **kwargs: Any) -> None:
        self._heard("tokens_produced", **kwargs)

    def throttle_decision(self, **kwargs: Any) -> None:
        self._heard("throttle_decision", **kwargs)

    def batch_finished(self, report: BatchReport) -> None:
        self._heard("batch_finished", report=report)

    def rate_limit_hit(self, **kwargs: Any) -> None:
        self._heard("rate_limit_hit", **kwargs)

    def rate_limit_degraded(self, **kwargs: Any) -> None:
        self._heard("rate_limit_degraded", **kwargs)

    def ttft_predicted(self, **kwargs: Any) -> None:
        self._heard("ttft_predicted", **kwargs)


class Raises(Records):
    """Hears every event, and raises at each."""

    def _heard(self, event: str, **kwargs: Any) -> None:
        super()._heard(event, **kwargs)
        raise RuntimeError(f"a broken observer at {event}")


@pytest.mark.parametrize(("event", "told", "got"), EVENTS)
def test_each_event_reaches_every_listener_as_told_past_one_that_raises(
    event: str, told: dict[str, Any], got: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    broken, first, second = Raises(), Records(), Records()
    silent = Observer()  # listens to nothing: told nothing, raises nothing
    observers = Observers([first, broken, silent, second])
    with caplog.at_level(logging.ERROR, logger="fair_frontend"):
        getattr(observers, event)(**told)
    assert first.heard == broken.heard == second.heard == [(event, got)]
    assert f"observer Raises failed in {event}" in caplog.text


def test_ends_told_together_reach_each_listener_as_each_alone() -> None:
    """``requests_finished``: to an observer of single ends, each in order, as
    ``request_finished``; one that raises at one end loses the rest of its own batch
    only (``Observer``'s default tells them one by one), not another observer's."""
    broken, records = Raises(), Records()
    other = Finished("globex", "embed", Outcome.FAILED, None, "r2", error="boom")
    Observers([broken, records]).requests_finished([FINISHED, other])
    assert [kwargs["request_id"] for _, kwargs in records.heard] == ["r1", "r2"]
    assert records.heard[1][1]["error"] == "boom"
    assert len(broken.heard) == 1
