"""``ServiceModel``: how long does a batch take, and how fast is this endpoint serving?

Pure: every entry point takes the time; nothing here reads a clock or does I/O. The
estimates and their assumptions are derived once in the package docstring (``feedback``).
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from fair_frontend.feedback.delta import DEFAULT_METRICS_INTERVAL_S, TritonDelta
from fair_frontend.feedback.fit import BatchTime, DecayedStats
from fair_frontend.scheduler.cost import CostUnit

log = logging.getLogger(__name__)

DEFAULT_EMA_ALPHA = 0.2
"""Weight of the newest interval in the moving averages (``observability.ema_alpha``)."""

DEFAULT_BATCH_SECONDS = 0.010
"""With no data at all, a batch is assumed to take 10 ms whatever its size: a small model's
batch on a GPU. Only ``predict_*`` and ``status`` report it: the throttle never rejects and
``FeedbackCost`` charges the plain cost until there is data, so a wrong default cannot
refuse or mis-price work."""

DEFAULT_STALE_AFTER_INTERVALS = 3.0
"""Triton's metrics are stale after this many scrape intervals without a successful one."""

DEFAULT_MIN_MEMORY_BATCHES = 100.0
"""Forget no faster than about this many batches, however slowly they arrive."""

UNMATCHED_BATCHES = 4096
"""The frontend's batches remembered until Triton's counters show them (a bound, for when
Triton's metrics never answer)."""

FROZEN_MIN_BATCHES = 2
"""Triton's counters are frozen when an interval shows no execution although the frontend
saw at least this many of its batches finish in it. Two, not one: a batch that Triton
finished just before a scrape may reach the frontend just after it."""


REFIT_INTERVAL_S = 0.05
"""The batch-time model is refitted at most this often (of the learning clock)."""


class Source(str, enum.Enum):
    """Where the current estimates come from (exported as a label: keep values stable)."""

    TRITON = "triton"  # Triton's own execution counters (preferred while fresh)
    FRONTEND = "frontend"  # the frontend's timing of its own batches
    DEFAULT = "default"  # no data yet: the configured defaults


@dataclass(frozen=True, slots=True)
class ServiceRate:
    """Units served per busy second (seconds with a batch executing)."""

    rows_per_s: float
    tokens_per_s: float


@dataclass(frozen=True, slots=True)
class ServiceStatus:
    """Everything the metrics layer exports about one endpoint's service model."""

    endpoint: str
    source: Source
    triton_stale: bool
    stale_reason: str | None  # why Triton's metrics are not used; None while they are
    batch_time: BatchTime
    unit_seconds: float  # seconds per cost unit (the EMA of normalised service cost)
    rate: ServiceRate
    typical_rows: float
    typical_tokens: float
    frontend_batches: float  # decayed count of batches behind the frontend's estimates
    triton_batches: float  # decayed count of executions behind Triton's estimates
    last_triton_at: float | None
    triton_pending: float  # Triton's queue depth at the last scrape
    triton_queue_s: float | None  # mean time a request waited in Triton's queue, last interval

    def samples(self) -> Iterator[tuple[str, dict[str, str], float]]:
        """Gauges as ``(name, labels, value)``, the shape ``metrics.StateCollector`` reads."""
        ep = {"endpoint": self.endpoint}
        for source in Source:
            yield (
                "fair_service_source",
                {**ep, "source": source.value},
                float(source is self.source),
            )
        yield "fair_triton_metrics_stale", ep, float(self.triton_stale)
        yield "fair_service_rate", {**ep, "unit": "rows"}, self.rate.rows_per_s
        yield "fair_service_rate", {**ep, "unit": "tokens"}, self.rate.tokens_per_s
        yield "fair_service_unit_seconds", ep, self.unit_seconds
        bt = self.batch_time
        for term, value in (
            ("fixed", bt.fixed_s),
            ("per_row", bt.per_row_s),
            ("per_token", bt.per_token_s),
        ):
            yield "fair_batch_time_seconds", {**ep, "term": term}, value


class ServiceModel:
    """How long does a batch take, and how fast is this endpoint serving?

    One per endpoint. Feed it ``observe_batch`` for every batch the frontend sends (when it
    finishes, in finishing order), ``observe_triton`` for every delta of Triton's counters
    for this model, and ``tick`` after every scrape attempt (so staleness is noticed even
    when nothing else happens). Ask ``predict_batch_seconds``, ``predict_request_seconds``,
    ``unit_seconds``, ``service_rate``; ``status`` for the metrics.
    """

    def __init__(
        self,
        name: str,
        *,
        cost_unit: CostUnit = CostUnit.REQUESTS,
        max_batch_size: int = 1,
        max_batch_tokens: int | None = None,
        alpha: float = DEFAULT_EMA_ALPHA,
        interval_s: float = DEFAULT_METRICS_INTERVAL_S,
        default_batch_seconds: float = DEFAULT_BATCH_SECONDS,
        stale_after_intervals: float = DEFAULT_STALE_AFTER_INTERVALS,
        min_memory_batches: float = DEFAULT_MIN_MEMORY_BATCHES,
        refit_interval_s: float = REFIT_INTERVAL_S,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha {alpha} is not in (0, 1]")
        if not (interval_s > 0 and default_batch_seconds > 0 and min_memory_batches >= 1):
            raise ValueError("interval_s and default_batch_seconds must be > 0, memory >= 1")
        self.name = name
        self.cost_unit = cost_unit
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.alpha = alpha
        self.interval_s = interval_s
        self.stale_after_s = stale_after_intervals * interval_s
        self.defaults = BatchTime(default_batch_seconds, 0.0, 0.0)
        self._unit = 2 if cost_unit is CostUnit.TOKENS else 1  # index of the cost unit in x
        self._keep_per_batch = 1.0 - 1.0 / min_memory_batches
        self._frontend = DecayedStats()
        self._triton = DecayedStats()
        self._last_finished: float | None = None  # latest finish among the frontend's batches
        # The frontend's rows and tokens that Triton's counters have not shown yet (their
        # tokens per row is the token count of Triton's next executions), and its batches
        # since the last Triton delta (frozen counters).
        self._unmatched: deque[tuple[float, float]] = deque(maxlen=UNMATCHED_BATCHES)
        self._since_batches = 0
        self._last_triton_at: float | None = None
        self._frozen = False
        self._pending = 0.0
        self._queue_s: float | None = None
        self._source = Source.DEFAULT
        self._stale_reason: str | None = "no scrape of Triton's metrics yet"
        self._fit: BatchTime | None = None  # cache for the current source; None = stale cache
        self.refit_interval_s = refit_interval_s
        self._fit_at: float | None = None  # the learning time the cached fit includes
        self._learned_at: float | None = None

    # ---- inputs ----------------------------------------------------------------------------

    def observe_batch(
        self,
        rows: int,
        tokens: int,
        sent_at: float,
        finished_at: float,
        now: float,
        *,
        ok: bool = True,
    ) -> None:
        """A batch of the frontend's finished (``BatchReport.started`` / ``.finished``).

        Its service time is ``finished_at - max(sent_at, previous batch's finish)``: with
        one model instance a batch starts executing when it arrives or when the batch
        ahead of it finishes, whichever is later. A failed batch still moves that timeline
        but is not learned from (an error returns early and says nothing about cost).
        """
        previous = self._last_finished
        if previous is None or finished_at >= previous:
            start = sent_at if previous is None else max(sent_at, previous)
            self._last_finished = finished_at
        else:
            start = sent_at  # reported out of finishing order: its own round trip
        if not ok:
            self._refresh(now)
            return
        self._since_batches += 1
        if rows > 0:
            self._unmatched.append((float(rows), float(tokens)))
        service = finished_at - start
        if rows > 0 and service > 0 and math.isfinite(service):
            self._learn(self._frontend, now, rows, tokens, service, 1.0)
        self._refresh(now)

    def observe_triton(self, delta: TritonDelta) -> None:
        """One interval of Triton's counters for this model (``TritonMetrics``'s callback).

        Per execution: rows = items / executions; seconds = compute time per request,
        which is the execution's time (see ``TritonDelta.seconds_per_exec``); tokens at
        the tokens per row of the frontend's rows that Triton has not counted yet, oldest
        first, else the model's own token counter, else the long-run tokens per row.
        Matching rows rather than intervals matters: Triton counts an execution a moment
        after its answer leaves, so a scrape right after a batch finished can miss it and
        the next interval holds it (measured with ``sleeper``, scraping right after each
        group of 5 batches: about one group in six showed its last execution a scrape
        late). An interval without executions only says that Triton's metrics are alive
        (or frozen, when the frontend's batches did finish).
        """
        now = delta.at
        self._last_triton_at = now
        self._pending = delta.pending_requests
        self._queue_s = (
            delta.queue_us / 1e6 / delta.request_success if delta.request_success > 0 else None
        )
        if delta.reset:
            log.warning("%s: Triton's counters went back (Triton restarted)", self.name)
        if delta.exec_count == 0:
            if self._since_batches >= FROZEN_MIN_BATCHES and not self._frozen:
                log.warning(
                    "%s: Triton's counters did not move while %d batches finished",
                    self.name,
                    self._since_batches,
                )
            self._frozen = self._since_batches >= FROZEN_MIN_BATCHES
        else:
            self._frozen = False
            seconds = delta.seconds_per_exec
            rows = delta.inference_count / delta.exec_count
            per_row = self._tokens_per_row(delta)
            if seconds is not None and seconds > 0 and rows > 0 and per_row is not None:
                self._learn(self._triton, now, rows, rows * per_row, seconds, delta.exec_count)
        if delta.reset:  # what the frontend sent before the restart will never be counted
            self._unmatched.clear()
        self._since_batches = 0
        self._refresh(now)

    def tick(self, now: float) -> None:
        """Re-evaluate staleness (call after every scrape attempt, failed ones too)."""
        self._refresh(now)

    # ---- answers ---------------------------------------------------------------------------

    @property
    def source(self) -> Source:
        return self._source

    @property
    def has_data(self) -> bool:
        """Whether any measurement backs the estimates (``source`` is not ``DEFAULT``)."""
        return self._source is not Source.DEFAULT

    def batch_time(self) -> BatchTime:
        """The current batch-time model (the defaults without data)."""
        if self._fit is None:
            self._fit = self._current_fit()
            self._fit_at = self._learned_at
        return self._fit

    def predict_batch_seconds(self, rows: int | float, tokens: int | float) -> float:
        """Seconds one batch of ``rows`` rows and ``tokens`` tokens takes to execute."""
        return self.batch_time().seconds(rows, tokens)

    def predict_request_seconds(self, rows: int | float, tokens: int | float) -> float:
        """Marginal seconds of one request inside a typical batch (fixed cost amortised).

        ``fixed * rows / typical_rows + per_row * rows + per_token * tokens``: summed over
        the requests of a typical batch it is that batch's predicted time.
        """
        bt = self.batch_time()
        typical_rows = max(1.0, self.typical_batch()[0])
        return bt.fixed_s * rows / typical_rows + bt.per_row_s * rows + bt.per_token_s * tokens

    def unit_seconds(self) -> float:
        """Seconds per cost unit (token or row): the EMA of normalised service cost.

        ``EMA(busy seconds) / EMA(cost units served)``, both over the current source's
        batches (a ratio of EMAs, not an EMA of ratios, so large and small batches count by
        their size). Without data: the default batch time over a full batch's units.
        """
        stats = self._stats()
        if stats is not None and stats.sxx[0][self._unit] > 0:
            return stats.sxy[0] / stats.sxx[0][self._unit]
        rows, tokens = self._full_batch()
        units = tokens if self._unit == 2 else rows
        return self.defaults.fixed_s / max(1.0, units)

    def service_rate(self) -> ServiceRate:
        """Rows and tokens served per busy second (0 without data)."""
        stats = self._stats()
        if stats is None or stats.sxy[0] <= 0:
            return ServiceRate(0.0, 0.0)
        return ServiceRate(stats.sxx[0][1] / stats.sxy[0], stats.sxx[0][2] / stats.sxy[0])

    def typical_batch(self) -> tuple[float, float]:
        """Mean ``(rows, tokens)`` per batch lately; without data, a full batch."""
        stats = self._stats()
        if stats is None:
            return self._full_batch()
        rows, tokens, _ = stats.mean()
        return rows, tokens

    def status(self) -> ServiceStatus:
        typical_rows, typical_tokens = self.typical_batch()
        return ServiceStatus(
            endpoint=self.name,
            source=self._source,
            triton_stale=self._stale_reason is not None,
            stale_reason=self._stale_reason,
            batch_time=self.batch_time(),
            unit_seconds=self.unit_seconds(),
            rate=self.service_rate(),
            typical_rows=typical_rows,
            typical_tokens=typical_tokens,
            frontend_batches=self._frontend.weight,
            triton_batches=self._triton.weight,
            last_triton_at=self._last_triton_at,
            triton_pending=self._pending,
            triton_queue_s=self._queue_s,
        )

    # ---- internals -------------------------------------------------------------------------

    def _learn(
        self,
        stats: DecayedStats,
        now: float,
        rows: float,
        tokens: float,
        seconds: float,
        weight: float,
    ) -> None:
        """Decay ``stats`` to ``now``, then add the observation (``weight`` batches).

        The decay is ``(1 - alpha) ** (elapsed / interval)``, a time-aware EMA, but never
        faster than ``keep ** weight``: at low load the memory stays at least about
        ``min_memory_batches`` batches instead of a handful of noisy ones.
        """
        if stats.updated_at is not None:
            elapsed = max(0.0, now - stats.updated_at)
            by_time = (1.0 - self.alpha) ** (elapsed / self.interval_s)
            stats.decay(max(by_time, self._keep_per_batch**weight))
        stats.add(rows, tokens, seconds, weight)
        stats.updated_at = now if stats.updated_at is None else max(now, stats.updated_at)
        self._learned_at = now
        # Refit at most every REFIT_INTERVAL_S (the fit moves over many batches; small
        # batches come back hundreds of times a second and refitting each costs more than
        # the request); the first observations are always fitted at once.
        if self._fit_at is None or not 0 <= now - self._fit_at < self.refit_interval_s:
            self._fit = None

    def _tokens_per_row(self, delta: TritonDelta) -> float | None:
        """Tokens per row of the delta's items; consumes the frontend's unmatched rows."""
        if self._unmatched:
            # Oldest first: the delta's items are the frontend's oldest uncounted rows.
            want, rows, tokens = float(delta.inference_count), 0.0, 0.0
            while self._unmatched and rows < want:
                r, t = self._unmatched.popleft()
                take = min(r, want - rows)
                rows += take
                tokens += t * take / r
                if take < r:  # part of a batch: the rest is counted next time
                    self._unmatched.appendleft((r - take, t * (r - take) / r))
            if sum(r for r, _ in self._unmatched) > want:
                self._unmatched.clear()  # more than an interval behind: a mismatch, not a lag
            if rows > 0:
                return tokens / rows
        if delta.rows and delta.tokens is not None:
            return delta.tokens / delta.rows
        for stats in (self._frontend, self._triton):
            if stats.sxx[0][1] > 0:
                return stats.sxx[0][2] / stats.sxx[0][1]
        return None

    def _refresh(self, now: float) -> None:
        """Decide the source; log every change of it and of Triton's staleness."""
        if self._last_triton_at is None:
            reason: str | None = "no scrape of Triton's metrics yet"
        elif now - self._last_triton_at > self.stale_after_s:
            reason = (
                f"no successful scrape for {now - self._last_triton_at:.1f} s "
                f"(stale after {self.stale_after_s:.1f} s)"
            )
        elif self._frozen:
            reason = "Triton's counters did not move while the frontend's batches finished"
        else:
            reason = None
        if reason is None and self._triton.weight > 0:
            source = Source.TRITON
        elif self._frontend.weight > 0:
            source = Source.FRONTEND
        elif self._triton.weight > 0:
            source = Source.TRITON  # stale, but measured: better than the defaults
        else:
            source = Source.DEFAULT
        if (reason is None) != (self._stale_reason is None):
            if reason is None:
                log.info("%s: Triton's metrics are current again", self.name)
            else:
                log.warning("%s: Triton's metrics are stale: %s", self.name, reason)
        self._stale_reason = reason
        if source is not self._source:
            # A fallback is a warning; learning (from the defaults) or recovering is news.
            fallback = source is not Source.TRITON and self._source is not Source.DEFAULT
            level = logging.WARNING if fallback else logging.INFO
            log.log(
                level,
                "%s: service estimates now from %s (were from %s); Triton's metrics: %s",
                self.name,
                source.value,
                self._source.value,
                reason or "current",
            )
            self._source = source
            self._fit = None

    def _stats(self) -> DecayedStats | None:
        if self._source is Source.TRITON:
            return self._triton
        if self._source is Source.FRONTEND:
            return self._frontend
        return None

    def _current_fit(self) -> BatchTime:
        stats = self._stats()
        fit = stats.fit(self._unit) if stats is not None else None
        if fit is None:
            return self.defaults
        if stats is self._triton:
            # Triton's per-interval means vary less than single batches: when they pin
            # down fewer terms than the frontend's batches do, take the frontend's shape
            # and Triton's level (scaled to agree at Triton's mean batch).
            shape = self._frontend.fit(self._unit)
            if shape is not None and len(shape.terms) > len(fit.terms):
                rows, tokens, seconds = stats.mean()
                predicted = shape.seconds(rows, tokens)
                if predicted > 0 and seconds > 0:
                    return shape.scaled(seconds / predicted)
        return fit

    def _full_batch(self) -> tuple[float, float]:
        rows = float(max(1, self.max_batch_size))
        tokens = float(self.max_batch_tokens) if self.max_batch_tokens is not None else rows
        return rows, tokens
