"""Triton's Prometheus metrics: parsed, turned into per-interval deltas, scraped on a timer.

Three layers, the first two pure:

- ``parse_metrics(text)``: one scrape's counters per model (summed over ``version`` and
  every other label but ``model``), the queue-depth gauge, and the per-tenant totals the
  Python-backend models export (``fair_model_rows_total`` / ``fair_model_tokens_total``,
  ``python_backend/metering.py``);
- ``CounterTracker.update(snapshot, at)``: the deltas since the previous scrape, per model.
  A counter that went down means Triton (or the model) restarted: the delta is then the
  new value itself (everything counted since the restart), flagged ``reset``, never a
  negative number. A model seen for the first time (or again after it was missing) only
  sets the baseline;
- ``TritonMetrics``: the asyncio shell. Polls ``metrics_url`` every ``interval_s`` with a
  short timeout, parses off the event loop, calls ``on_delta`` per model and ``on_scrape``
  after every attempt. Failures are counted and logged (once per streak), never raised:
  the loop outlives anything Triton or a callback does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fair_frontend.backends.protocol import ScrapeStatus
from fair_frontend.feedback.delta import DEFAULT_METRICS_INTERVAL_S, TritonDelta

log = logging.getLogger(__name__)

# Triton's per-model counters (cumulative) -> our field names. Names without "_total":
# prometheus_client's parser names a counter family without it (and adds it to samples).
COUNTERS: Mapping[str, str] = {
    "nv_inference_exec_count": "exec_count",
    "nv_inference_count": "inference_count",
    "nv_inference_request_success": "request_success",
    "nv_inference_request_failure": "request_failure",
    "nv_inference_compute_infer_duration_us": "compute_infer_us",
    "nv_inference_queue_duration_us": "queue_us",
    "nv_inference_request_duration_us": "request_us",
}
PENDING_GAUGE = "nv_inference_pending_request_count"
# The Python-backend models' own families (python_backend/metering.py, ROWS_FAMILY and
# TOKENS_FAMILY there), labels {model, tenant}; here without "_total", as parsed.
TENANT_ROWS = "fair_model_rows"
TENANT_TOKENS = "fair_model_tokens"

DEFAULT_SCRAPE_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """What Triton's model counted for one tenant, since the model started."""

    rows: float
    tokens: float


@dataclass(slots=True)
class ModelCounters:
    """One scrape of one model: cumulative counters, the queue gauge, tenant totals."""

    counters: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(COUNTERS.values(), 0.0)
    )
    pending: float = 0.0
    tenant_rows: dict[str, float] = field(default_factory=dict)
    tenant_tokens: dict[str, float] = field(default_factory=dict)
    has_tenants: bool = False

    def tenant_totals(self) -> dict[str, TenantUsage]:
        names = self.tenant_rows.keys() | self.tenant_tokens.keys()
        return {
            t: TenantUsage(self.tenant_rows.get(t, 0.0), self.tenant_tokens.get(t, 0.0))
            for t in sorted(names)
        }


def parse_metrics(text: str) -> dict[str, ModelCounters]:
    """Per-model counters of one scrape of Triton's ``/metrics``.

    Raises ``ValueError`` on text that is not the Prometheus exposition format.
    """
    models: dict[str, ModelCounters] = {}
    for family in text_string_to_metric_families(text):
        name = family.name
        key = COUNTERS.get(name)
        wanted = key is not None or name in (PENDING_GAUGE, TENANT_ROWS, TENANT_TOKENS)
        if not wanted:
            continue
        for sample in family.samples:
            if sample.name not in (name, name + "_total"):
                continue  # _created and the like
            model = sample.labels.get("model")
            if model is None or not math.isfinite(sample.value):
                continue
            entry = models.get(model)
            if entry is None:
                entry = models[model] = ModelCounters()
            if key is not None:
                entry.counters[key] += sample.value
            elif name == PENDING_GAUGE:
                entry.pending += sample.value
            else:
                tenant = sample.labels.get("tenant", "")
                totals = entry.tenant_rows if name == TENANT_ROWS else entry.tenant_tokens
                totals[tenant] = totals.get(tenant, 0.0) + sample.value
                entry.has_tenants = True
    return models


class CounterTracker:
    """What changed since the last scrape? (per model, counter resets handled)."""

    def __init__(self) -> None:
        self._previous: dict[str, ModelCounters] = {}
        self._previous_at: float | None = None

    def update(self, snapshot: Mapping[str, ModelCounters], at: float) -> list[TritonDelta]:
        """The deltas from the previous snapshot to this one, taken at ``at``."""
        deltas = []
        interval = at - self._previous_at if self._previous_at is not None else 0.0
        for model, now in snapshot.items():
            before = self._previous.get(model)
            if before is not None:
                deltas.append(_delta(model, before, now, at, interval))
        self._previous = dict(snapshot)
        self._previous_at = at
        return deltas


def _delta(
    model: str, before: ModelCounters, now: ModelCounters, at: float, interval: float
) -> TritonDelta:
    reset = any(now.counters[k] < before.counters[k] for k in now.counters)
    d = {k: v if reset else v - before.counters[k] for k, v in now.counters.items()}
    rows = tokens = None
    if now.has_tenants:
        r_now, t_now = sum(now.tenant_rows.values()), sum(now.tenant_tokens.values())
        r_before = sum(before.tenant_rows.values())
        t_before = sum(before.tenant_tokens.values())
        if reset or r_now < r_before or t_now < t_before:
            rows, tokens = round(r_now), round(t_now)
        else:
            rows, tokens = round(r_now - r_before), round(t_now - t_before)
    return TritonDelta(
        model=model,
        at=at,
        interval_s=interval,
        exec_count=round(d["exec_count"]),
        inference_count=round(d["inference_count"]),
        request_success=round(d["request_success"]),
        request_failure=round(d["request_failure"]),
        compute_infer_us=d["compute_infer_us"],
        queue_us=d["queue_us"],
        request_us=d["request_us"],
        pending_requests=now.pending,
        rows=rows,
        tokens=tokens,
        reset=reset,
    )


class TritonMetrics:
    """Reads Triton's metrics endpoint every ``interval_s`` and reports per-model deltas.

    ``on_delta(delta)`` is called for every model with a previous scrape to compare with;
    ``on_scrape(at, ok)`` after every attempt (feed it to ``ServiceModel.tick``). Times
    are the event loop's clock (``loop.time()``, the frontend's monotonic clock).
    """

    def __init__(
        self,
        url: str,
        *,
        interval_s: float = DEFAULT_METRICS_INTERVAL_S,
        timeout_s: float | None = None,
        on_delta: Callable[[TritonDelta], None] | None = None,
        on_scrape: Callable[[float, bool], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s {interval_s} must be > 0")
        self.url = url
        self.interval_s = interval_s
        self.timeout_s = (
            timeout_s if timeout_s is not None else min(DEFAULT_SCRAPE_TIMEOUT_S, interval_s)
        )
        self.on_delta = on_delta
        self.on_scrape = on_scrape
        self._tracker = CounterTracker()
        self._snapshot: dict[str, ModelCounters] = {}
        self._session: aiohttp.ClientSession | None = None  # created on first use
        self._task: asyncio.Task[None] | None = None
        self._scrapes = 0
        self._failures = 0
        self._streak = 0
        self._last_success_at: float | None = None
        self._last_error: str | None = None

    # ---- answers ---------------------------------------------------------------------------

    def tenant_totals(self, model: str) -> dict[str, TenantUsage]:
        """Per-tenant rows and tokens Triton's ``model`` counted, as of the last scrape."""
        entry = self._snapshot.get(model)
        return entry.tenant_totals() if entry is not None else {}

    def models(self) -> list[str]:
        """Models seen in the last successful scrape."""
        return sorted(self._snapshot)

    def status(self) -> ScrapeStatus:
        return ScrapeStatus(
            url=self.url,
            scrapes=self._scrapes,
            failures=self._failures,
            consecutive_failures=self._streak,
            last_success_at=self._last_success_at,
            last_error=self._last_error,
        )

    # ---- the shell -------------------------------------------------------------------------

    async def scrape_once(self) -> bool:
        """One scrape: fetch, parse, report deltas. ``True`` on success; never raises."""
        loop = asyncio.get_running_loop()
        try:
            text = await self._fetch()
            snapshot = await asyncio.to_thread(parse_metrics, text)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a scrape must never take the loop down
            self._failed(loop.time(), err)
            return False
        at = loop.time()
        if self._streak:
            log.info("Triton metrics at %s answer again after %d failures", self.url, self._streak)
        self._scrapes += 1
        self._streak = 0
        self._last_success_at = at
        self._last_error = None
        deltas = self._tracker.update(snapshot, at)
        self._snapshot = snapshot
        for delta in deltas:
            self._call(self.on_delta, delta)
        self._call(self.on_scrape, at, True)
        return True

    async def run(self) -> None:
        """Scrape every ``interval_s`` until cancelled (missed ticks are skipped)."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            await self.scrape_once()
            next_at += self.interval_s
            now = loop.time()
            if next_at <= now:  # fell behind (slow scrape, busy loop): skip, do not burst
                next_at += math.ceil((now - next_at) / self.interval_s) * self.interval_s
            await asyncio.sleep(next_at - now)

    def start(self) -> asyncio.Task[None]:
        """Run the loop as a task of the running event loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name="triton-metrics")
        return self._task

    async def stop(self) -> None:
        """Stop the loop and close the HTTP session."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> TritonMetrics:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _fetch(self) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        async with self._session.get(self.url) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}")
            text: str = await response.text()
            return text

    def _failed(self, at: float, err: BaseException) -> None:
        self._failures += 1
        self._streak += 1
        self._last_error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        if self._streak == 1:
            log.warning("Triton metrics at %s: scrape failed: %s", self.url, self._last_error)
        self._call(self.on_scrape, at, False)

    @staticmethod
    def _call(callback: Callable[..., None] | None, *args: Any) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:  # a listener's bug must not stop the scraping
            log.exception("Triton metrics listener failed")
