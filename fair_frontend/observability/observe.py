"""Who hears what happened: metrics, logs, the statistics and tests.

``Observer`` answers "what happened?" with one method per event, each a no-op here:
an observer overrides the events it cares about. ``Observers`` tells several, and keeps a
failing observer from failing the request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fair_frontend.outcomes import Outcome
from fair_frontend.usage import Usage

if TYPE_CHECKING:
    from fair_frontend.admission import ThrottleDecision
    from fair_frontend.wire.records import Gaps

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BatchReport:
    """A finished batch, for metrics and the feedback loop."""

    model: str
    rows: int
    tokens: int
    items: int
    tenants: dict[str, int]  # rows per tenant
    tenant_tokens: dict[str, int]
    tenant_cost: dict[str, float]
    started: float
    finished: float
    ok: bool

    @property
    def seconds(self) -> float:
        return self.finished - self.started


@dataclass(slots=True)
class Finished:
    """One request's end, as ``Observer.request_finished`` takes it: an item of
    ``Observer.requests_finished`` (the rows of one batch part, recorded together)."""

    tenant: str | None
    model: str
    outcome: Outcome
    queued_s: float | None
    request_id: str = ""
    latency_s: float | None = None
    error: str | None = None
    usage: Usage | None = None
    service_s: float | None = None

    def told(self, observer: Observer) -> None:
        """``observer.request_finished`` of this end."""
        observer.request_finished(
            tenant=self.tenant,
            model=self.model,
            outcome=self.outcome,
            queued_s=self.queued_s,
            request_id=self.request_id,
            latency_s=self.latency_s,
            error=self.error,
            usage=self.usage,
            service_s=self.service_s,
        )


class Observer:
    """What happened? (every event a no-op; subclasses override what they listen to)."""

    def request_finished(
        self,
        *,
        tenant: str | None,
        model: str,
        outcome: Outcome,
        queued_s: float | None,
        request_id: str = "",
        latency_s: float | None = None,
        error: str | None = None,
        usage: Usage | None = None,
        service_s: float | None = None,
    ) -> None:
        """A request ended (exactly once per request), with its one outcome; ``usage``:
        what it used, where the core counted it (its billing record); ``service_s``: from
        its dispatch to Triton to its end, where it was dispatched."""

    def requests_finished(self, finished: Sequence[Finished]) -> None:
        """Several requests ended at once (the rows of one batch part its shell answered,
        ``Accounting.on_served``): each exactly as ``request_finished`` would be told, in
        order. Here, that: an observer that counts many at a time overrides this too."""
        for end in finished:
            end.told(self)

    def batch_finished(self, report: BatchReport) -> None:
        """A batch came back from Triton (or failed)."""

    def batches_finished(self, reports: Sequence[BatchReport]) -> None:
        """Batches that came back in one loop turn (``Dispatcher``: their reports go out
        once per turn): each as ``batch_finished`` would be told, in order. Here, that."""
        for report in reports:
            self.batch_finished(report)

    def rate_limit_hit(self, *, tenant: str, model: str, limit: str) -> None:
        """A rate limit refused a request."""

    def rate_limit_degraded(self, *, tenant: str, model: str, mode: str, reason: str) -> None:
        """The rate-limit storage did not answer one check of ``tenant`` on ``model``:
        ``mode`` decided it (``on_storage_error``); ``reason``: timeout, error or
        circuit_open (``StorageErrorReason``)."""

    def throttle_decision(self, *, model: str, decision: ThrottleDecision, count: int = 1) -> None:
        """The throttle admitted or rejected a request (``count`` requests: a tenant's calls
        of one intake slice judged together, ``Core.judge_together``)."""

    def ttft_predicted(self, *, model: str, slo_class: str, error: float) -> None:
        """An admitted request of interactive SLO class ``slo_class`` had its first token:
        the throttle's predicted time to it was off by ``error`` ((predicted - actual) /
        actual)."""

    def tokens_produced(
        self,
        *,
        tenant: str,
        model: str,
        tokens: int,
        first_token_s: float | None,
        inter_token: Gaps | None = None,
    ) -> None:
        """A request's output produced ``tokens`` tokens (streamed responses, or a whole
        answer): ``first_token_s`` from its arrival, if its first is among them;
        ``inter_token``, the time between each two consecutive streamed tokens, binned at
        ``records.INTER_TOKEN_BUCKETS`` by the shell that wrote them to the clients
        (``records.Gaps``: a tick's of the tenant's streams of this model)."""


class Observers(Observer):
    """Tells every observer; one that raises is logged and does not stop the others.

    Per event, the observers that listen to it (override it) are looked up once: an event
    goes only to them. The observers are fixed at construction. The events told per
    request or per stream (a request's end, a report of tokens, the throttle's decision)
    have methods of their own that pass their arguments on as they came: the generic
    path's packing and unpacking of keywords cost 1.5 µs an event, a sixth of what the
    core spends on a stream's end."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = list(observers)
        self._listeners: dict[str, list[Any]] = {}
        self._finished = self._of("request_finished")
        self._tokens = self._of("tokens_produced")
        self._decisions = self._of("throttle_decision")

    def _of(self, method: str) -> list[Any]:
        listeners = self._listeners.get(method)
        if listeners is None:
            base = getattr(Observer, method)
            listeners = self._listeners[method] = [
                getattr(o, method)
                for o in self.observers
                if getattr(type(o), method, base) is not base  # the base's: a no-op
            ]
        return listeners

    @staticmethod
    def _failed(listener: Any, method: str) -> None:
        log.exception("observer %s failed in %s", type(listener.__self__).__name__, method)

    def _each(self, method: str, **kwargs: Any) -> None:
        for listener in self._of(method):
            try:
                listener(**kwargs)
            except Exception:
                self._failed(listener, method)

    def request_finished(
        self,
        *,
        tenant: str | None,
        model: str,
        outcome: Outcome,
        queued_s: float | None,
        request_id: str = "",
        latency_s: float | None = None,
        error: str | None = None,
        usage: Usage | None = None,
        service_s: float | None = None,
    ) -> None:
        for listener in self._finished:
            try:
                listener(
                    tenant=tenant,
                    model=model,
                    outcome=outcome,
                    queued_s=queued_s,
                    request_id=request_id,
                    latency_s=latency_s,
                    error=error,
                    usage=usage,
                    service_s=service_s,
                )
            except Exception:
                self._failed(listener, "request_finished")

    def requests_finished(self, finished: Sequence[Finished]) -> None:
        """To every observer that hears of ends: its own ``requests_finished`` where it
        overrides it, else its ``request_finished`` for each (``Observer``'s default)."""
        self._many("requests_finished", "request_finished", finished)

    def batches_finished(self, reports: Sequence[BatchReport]) -> None:
        """As ``requests_finished``, of ``batches_finished`` and ``batch_finished``."""
        self._many("batches_finished", "batch_finished", reports)

    def _many(self, method: str, each: str, items: Sequence[Any]) -> None:
        """Several events at once (``method``) to the observers that override it or the
        event of one (``each``; ``Observer``'s ``method`` then tells them one by one)."""
        listeners = self._listeners.get(method)
        if listeners is None:
            base_each, base_many = getattr(Observer, each), getattr(Observer, method)
            listeners = self._listeners[method] = [
                getattr(o, method)
                for o in self.observers
                if getattr(type(o), each, base_each) is not base_each
                or getattr(type(o), method, base_many) is not base_many
            ]
        for listener in listeners:
            try:
                listener(items)
            except Exception:
                self._failed(listener, method)

    def batch_finished(self, report: BatchReport) -> None:
        self._each("batch_finished", report=report)

    def rate_limit_hit(self, **kwargs: Any) -> None:
        self._each("rate_limit_hit", **kwargs)

    def rate_limit_degraded(self, **kwargs: Any) -> None:
        self._each("rate_limit_degraded", **kwargs)

    def throttle_decision(self, *, model: str, decision: ThrottleDecision, count: int = 1) -> None:
        for listener in self._decisions:
            try:
                listener(model=model, decision=decision, count=count)
            except Exception:
                self._failed(listener, "throttle_decision")

    def tokens_produced(
        self,
        *,
        tenant: str,
        model: str,
        tokens: int,
        first_token_s: float | None,
        inter_token: Gaps | None = None,
    ) -> None:
        for listener in self._tokens:
            try:
                listener(
                    tenant=tenant,
                    model=model,
                    tokens=tokens,
                    first_token_s=first_token_s,
                    inter_token=inter_token,
                )
            except Exception:
                self._failed(listener, "tokens_produced")

    def ttft_predicted(self, **kwargs: Any) -> None:
        self._each("ttft_predicted", **kwargs)
