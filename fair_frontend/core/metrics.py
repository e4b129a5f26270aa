"""The frontend's own Prometheus metrics, on the metrics port.

Every family uses one registry per frontend (several frontends can live in one process,
as in tests). Labels come from ``Outcome`` and the config, never from client input,
except the tenant, which is authenticated first.

Cardinality guard: the first ``observability.max_metric_tenants`` tenants seen get their
own ``tenant`` label; later ones are counted under ``tenant="other"``. Configured
tenants are few in most deployments; a platform with many thousands of tenants keeps
per-tenant detail for the busiest first-comers and still has exact totals per tier.

Per tick, not per event: what the core counts on its hot path (a request's outcome and
waits, a batch's or a granted stream's rows, a stream's reported tokens and each of its
inter-token gaps) is added to ``Pending`` (a dict entry, a list append) and reaches the
prometheus families in bulk: every gap of a report is binned at once, a counter is
incremented once by the sum. ``Pending`` is flushed by the first collector of the
registry, so whatever reads the registry (a scrape, ``get_sample_value``) reads every
event before it; and for one series whose observations pile up between scrapes, when
``PENDING_VALUES`` wait (memory stays bounded). The registry is read on the core's loop
(the metrics port is an aiohttp app of that loop), the thread that adds to it.

The ``endpoint`` label is the model name, which the client sends: a request for a model
that does not exist (or one rejected before its model was looked up: no key, a bad key)
must not mint a label. So an endpoint gets its own label once it is known to exist: it
is configured (``endpoints``), or a request for it got as far as the model's scheduler
(a batch, a throttle decision, a rate-limit hit, an admitted request). Until then it is
counted as ``endpoint="other"``: a model Triton serves that the config does not name is
``other`` only for the rejections that precede its first admitted request. What a shell
refused itself (its tally) proves nothing: a full queue refuses any name, and a shell
names the model only where it knows it exists and the tenant may call it (``Gateway``).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from fair_frontend.config import Config
from fair_frontend.observability.observe import BatchReport, Finished, Observer
from fair_frontend.outcomes import Outcome
from fair_frontend.scheduler.window import WINDOW_S, WindowFairness, jain_index, service_gap
from fair_frontend.usage import Usage
from fair_frontend.wire.records import INTER_TOKEN_BUCKETS, SIDE_DOOR_LOOKUP, Gaps

OTHER_TENANT = "other"
OTHER_ENDPOINT = "other"  # models not (yet) known to exist: see the module docstring
UNAUTHENTICATED = "-"  # the tenant label of requests rejected before identity was known

_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# The relative error of a predicted time to first token, (predicted - actual) / actual:
# the fraction within 20 % either way is the bucket at 0.2 less the one at -0.2.
_ERROR_BUCKETS = (-0.9, -0.5, -0.3, -0.2, -0.1, -0.05, 0, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5)
_BATCH_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)


# Observations of one series held before they are binned, whatever the scrapes do.
PENDING_VALUES = 4096
# Fewer values than this are binned one by one (bisect); more at once (numpy).
_BIN_AT_ONCE = 64


def observe_many(child: Any, values: Sequence[float]) -> None:
    """``child.observe(v)`` for each of ``values`` (a labelled ``Histogram``), in bulk: the
    values binned together, each bucket and the sum incremented once. The same counts and
    sum as one ``observe`` each (``tests/test_observability.py`` holds it to that)."""
    if not values:
        return
    bounds = child._upper_bounds  # what ``observe`` compares with, +Inf last
    if len(values) < _BIN_AT_ONCE:
        counts = [0] * len(bounds)
        for v in values:
            counts[bisect_left(bounds, v)] += 1  # the first bound >= v, as ``observe``
        total = sum(values)
    else:
        array = np.asarray(values, dtype=np.float64)
        where = np.searchsorted(np.asarray(bounds), array, side="left")
        counts = np.bincount(where, minlength=len(bounds)).tolist()
        total = float(array.sum())
    add_counts(child, counts, total)


def add_counts(child: Any, counts: Sequence[int], total: float) -> None:
    """Observations binned already into ``child``'s buckets (a labelled ``Histogram``):
    ``counts``, one per bucket (+Inf last), and ``total``, their sum: each bucket and the
    sum incremented once."""
    child._sum.inc(total)
    buckets = child._buckets  # one count per bucket (made cumulative at collect)
    for i, n in enumerate(counts):
        if n:
            buckets[i].inc(n)


class Pending:
    """Counter increments and histogram observations not yet in their families (the
    module docstring: per tick, not per event). Keys are labelled children (counters) and
    tuples of them (histograms observing the same values: each gets every value); the
    observations come as values, or binned already (``observe_binned``: counts per bucket
    and their sum)."""

    __slots__ = ("binned", "counts", "values")

    def __init__(self) -> None:
        self.counts: dict[Any, float] = {}
        self.values: dict[tuple[Any, ...], list[float]] = {}
        # children -> [the sum, a count per bucket (+Inf last)]
        self.binned: dict[tuple[Any, ...], list[Any]] = {}

    def inc(self, child: Any, amount: float = 1) -> None:
        counts = self.counts
        counts[child] = counts.get(child, 0) + amount

    def observe(self, children: tuple[Any, ...], value: float) -> None:
        values = self.values.get(children)
        if values is None:
            self.values[children] = [value]
        else:
            values.append(value)
            if len(values) >= PENDING_VALUES:
                self._bin(children)

    def observe_all(self, children: tuple[Any, ...], values: Iterable[float]) -> None:
        held = self.values.get(children)
        if held is None:
            held = self.values[children] = []
        held.extend(values)
        if len(held) >= PENDING_VALUES:
            self._bin(children)

    def observe_binned(self, children: tuple[Any, ...], gaps: Gaps) -> None:
        """Observations binned already at ``INTER_TOKEN_BUCKETS`` (``gaps``: their sum, and
        [bucket, count, ...]), held as counts: the same as ``observe`` of each value
        binned (``children``: histograms of those buckets)."""
        held = self.binned.get(children)
        if held is None:
            held = self.binned[children] = [0.0, [0] * (len(INTER_TOKEN_BUCKETS) + 1)]
        total, bins = gaps
        counts = held[1]
        size = len(counts)
        # A shell's record, taken as it holds up: a pair naming no bucket, a count below
        # one or a sum that is no time is left out (the histograms would raise at the
        # scrape, or count what never happened, for every series held with it).
        for i in range(0, len(bins) - 1, 2):
            bucket, count = bins[i], bins[i + 1]
            if 0 <= bucket < size and count > 0:
                counts[bucket] += count
        if 0.0 <= total < math.inf:
            held[0] += total

    def _bin(self, children: tuple[Any, ...]) -> None:
        values = self.values.pop(children)
        for child in children:
            observe_many(child, values)

    def flush(self) -> None:
        """Everything held, into its families."""
        counts, self.counts = self.counts, {}
        for child, amount in counts.items():
            child.inc(amount)
        for children in list(self.values):
            self._bin(children)
        binned, self.binned = self.binned, {}
        for children, (total, bins) in binned.items():
            for child in children:
                add_counts(child, bins, total)


class _FlushPending(Collector):
    """The registry's first collector: it collects nothing, it flushes ``Pending`` so that
    the families collected after it hold every event counted so far."""

    def __init__(self, pending: Pending) -> None:
        self.pending = pending

    def collect(self) -> Iterable[Any]:
        self.pending.flush()
        return ()


class TenantLabels:
    """Which label does this tenant get? (the cardinality guard)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._known: set[str] = set()

    def __call__(self, tenant: str | None) -> str:
        if tenant is None:
            return UNAUTHENTICATED
        if tenant in self._known:
            return tenant
        if len(self._known) < self.limit:
            self._known.add(tenant)
            return tenant
        return OTHER_TENANT


# Outcomes that prove the model exists: the request reached its scheduler.
_MODEL_EXISTS = frozenset(
    {
        Outcome.DISPATCHED,
        Outcome.EXPIRED,
        Outcome.REJECTED_RATE,
        Outcome.REJECTED_OVERLOAD,
        Outcome.REJECTED_QUEUE_FULL,
    }
)


class EndpointLabels:
    """Which label does this model get? (the guard against client-chosen model names)."""

    def __init__(self, configured: Iterable[str]) -> None:
        self._known: set[str] = set(configured)

    def confirm(self, model: str) -> None:
        """``model`` exists: a request for it reached its scheduler."""
        self._known.add(model)

    def __call__(self, model: str) -> str:
        return model if model in self._known else OTHER_ENDPOINT


class FrontendMetrics(Observer):
    """Counts what happened to every request and batch (the service's ``Observer``)."""

    def __init__(self, config: Config, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.pending = Pending()
        self.registry.register(_FlushPending(self.pending))  # before the families it feeds
        self._token_sinks: dict[tuple[str, str], tuple[Any, ...]] = {}
        self._request_sinks: dict[tuple[str | None, str, Outcome], tuple[Any, ...]] = {}
        self.config = config
        self.tenant_label = TenantLabels(config.observability.max_metric_tenants)
        self.endpoint_label = EndpointLabels(config.endpoints)
        r = self.registry
        self.requests = Counter(
            "fair_requests",
            "Requests by how they ended (one outcome per request).",
            ["tenant", "tier", "endpoint", "outcome"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "fair_queue_wait_seconds",
            "Time from admission to dispatch in a batch.",
            ["tenant", "tier", "endpoint"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.served_rows = Counter(
            "fair_served_rows", "Batch rows served.", ["tenant", "endpoint"], registry=r
        )
        self.served_tokens = Counter(
            "fair_served_tokens", "Tokens served.", ["tenant", "endpoint"], registry=r
        )
        self.served_cost = Counter(
            "fair_served_cost",
            "DRR cost served, in the endpoint's cost unit.",
            ["tenant", "endpoint"],
            registry=r,
        )
        self.batches = Counter(
            "fair_batches", "Batches sent to Triton.", ["endpoint", "result"], registry=r
        )
        self.batch_seconds = Histogram(
            "fair_batch_seconds",
            "Triton round trip of one batch.",
            ["endpoint"],
            buckets=_BATCH_SECONDS,
            registry=r,
        )
        self.batch_rows = Histogram(
            "fair_batch_rows",
            "Rows per batch.",
            ["endpoint"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.rate_limit_hits = Counter(
            "fair_rate_limit_hits",
            "Requests refused by a rate limit, by the limit that refused them.",
            ["tenant", "endpoint", "limit"],
            registry=r,
        )
        self.rate_limit_storage_errors = Counter(
            "fair_rate_limit_storage_errors",
            "Rate-limit checks the storage did not answer, each decided by the mode "
            "(fail_open: admitted uncounted; fail_closed: 503); reason: timeout, error, or "
            "circuit_open (not asked: the storage has answered nothing for a while).",
            ["tenant", "endpoint", "mode", "reason"],
            registry=r,
        )
        self.throttle = Counter(
            "fair_throttle_decisions",
            "Throttle decisions.",
            ["endpoint", "decision"],
            registry=r,
        )
        self.predicted_wait = Histogram(
            "fair_predicted_wait_seconds",
            "The throttle's predicted queue wait at admission.",
            ["endpoint"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.ttft_prediction_error = Histogram(
            "fair_ttft_prediction_error",
            "Relative error of the time to first token the throttle predicted for an "
            "admitted request of an interactive SLO class: (predicted - actual) / actual, "
            "by its class.",
            ["endpoint", "slo_class"],
            buckets=_ERROR_BUCKETS,
            registry=r,
        )

        self.first_token = Histogram(
            "fair_time_to_first_token_seconds",
            "Time from a request's arrival to its first output token (engine endpoints).",
            ["tenant", "tier", "endpoint"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "fair_inter_token_seconds",
            "Time between a streamed request's consecutive output tokens.",
            ["tenant", "tier", "endpoint"],
            buckets=INTER_TOKEN_BUCKETS,  # the shells' bins (``records.Gaps``)
            registry=r,
        )
        self.output_tokens = Counter(
            "fair_output_tokens",
            "Output tokens produced (Endpoint.token_output), as they stream.",
            ["tenant", "tier", "endpoint"],
            registry=r,
        )

        # OpenTelemetry's GenAI semantic conventions, beside the fair_* families, for the
        # dashboards made for them: per model, the names Prometheus gives those metrics.
        self.genai_duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "GenAI server request duration: arrival to answer (gen_ai.server.request.duration).",
            ["gen_ai_request_model", "error_type"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.genai_first_token = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Time to generate the first token (gen_ai.server.time_to_first_token).",
            ["gen_ai_request_model"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.genai_per_token = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Time per output token after the first (gen_ai.server.time_per_output_token).",
            ["gen_ai_request_model"],
            buckets=INTER_TOKEN_BUCKETS,  # the shells' bins (``records.Gaps``)
            registry=r,
        )

        # Side doors: labels are the door and the answer (frontend constants, bounded) and
        # the tenant once authenticated (a configured one, under the guard): no model name.
        self.side_door_calls = Counter(
            "fair_side_door_calls",
            "Health, metadata, config, readiness and statistics calls, by door and answer "
            "(ok, or the error's gRPC code in lower case, e.g. unauthenticated).",
            ["tenant", "door", "outcome"],
            registry=r,
        )
        self.side_door_lookups = Counter(
            "fair_side_door_lookups",
            "Side-door calls that asked Triton; the others were answered from a shell's "
            "cache or joined a lookup already in flight.",
            ["door"],
            registry=r,
        )

        # The door's connection bounds (labels: frontend constants, bounded).
        self.connections_refused = Counter(
            "fair_connections_refused",
            "Connections a shell closed itself, by transport and reason: over "
            "server.http_max_connections (max_connections) or its per-peer cap "
            "(max_connections_per_peer), or a request's headers not in within "
            "server.header_timeout_s (header_timeout).",
            ["transport", "reason"],
            registry=r,
        )

        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: ``labels()`` locks and validates each call."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _series(self, metric: Any, *labels: str) -> tuple[Any]:
        """The labelled child of a histogram as ``Pending`` keys it (one series), cached."""
        key = (id(metric), "series", *labels)
        series = self._children.get(key)
        if series is None:
            series = self._children[key] = (self._child(metric, *labels),)
        return series

    def tier_of(self, tenant: str | None) -> str:
        if tenant is None or tenant not in self.config.tenants:
            return UNAUTHENTICATED
        return self.config.tenants[tenant].tier

    # ---- Observer -------------------------------------------------------------------------

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
        sink = self._request_sinks.get((tenant, model, outcome))
        if sink is None:
            sink = self._request_sink(tenant, model, outcome)
        pending = self.pending
        pending.inc(sink[0])
        if queued_s is not None:
            pending.observe(sink[1], queued_s)
        if latency_s is not None and sink[2] is not None:
            pending.observe(sink[2], latency_s)

    def requests_finished(self, finished: Sequence[Finished]) -> None:
        """``request_finished`` for each, with each (tenant, model, outcome)'s series
        looked up once per run of them (a batch part's rows: mostly one tenant's)."""
        pending = self.pending
        sinks = self._request_sinks
        key: tuple[str | None, str, Outcome] | None = None
        sink: tuple[Any, ...] = ()
        for end in finished:
            if key is None or key != (end.tenant, end.model, end.outcome):
                key = (end.tenant, end.model, end.outcome)
                got = sinks.get(key)
                sink = got if got is not None else self._request_sink(*key)
            pending.inc(sink[0])
            if end.queued_s is not None:
                pending.observe(sink[1], end.queued_s)
            if end.latency_s is not None and sink[2] is not None:
                pending.observe(sink[2], end.latency_s)

    def _request_sink(self, tenant: str | None, model: str, outcome: Outcome) -> tuple[Any, ...]:
        """A finished request's counter, queue-wait series and GenAI duration series (None
        for a cancelled one), by tenant, model and outcome: resolved once while the labels
        stand (a config's tiers, a model not yet confirmed: not kept)."""
        if outcome in _MODEL_EXISTS:
            self.endpoint_label.confirm(model)
        labels = (self.tenant_label(tenant), self.tier_of(tenant), self.endpoint_label(model))
        duration = None
        if outcome is not Outcome.CANCELLED:
            error_type = "" if outcome is Outcome.DISPATCHED else outcome.value
            duration = self._series(self.genai_duration, labels[2], error_type)
        sink = (
            self._child(self.requests, *labels, outcome.value),
            self._series(self.queue_wait, *labels),
            duration,
        )
        if labels[2] != OTHER_ENDPOINT:
            self._request_sinks[(tenant, model, outcome)] = sink
        return sink

    def requests_answered(
        self, tenant: str | None, model: str, outcome: Outcome, count: int
    ) -> None:
        """``count`` requests a shell answered itself, before the core (its tally): never
        proof that the model exists (a shell sheds any name while the global queue is
        full)."""
        self._count(tenant, model, outcome, count, confirms=False)

    def _count(
        self, tenant: str | None, model: str, outcome: Outcome, count: int, *, confirms: bool = True
    ) -> tuple[str, str, str]:
        """Count requests by outcome; returns their (tenant, tier, endpoint) labels. The
        core's own outcomes (``confirms``) that reached the model's scheduler confirm it."""
        if confirms and outcome in _MODEL_EXISTS:
            self.endpoint_label.confirm(model)
        labels = (self.tenant_label(tenant), self.tier_of(tenant), self.endpoint_label(model))
        self.pending.inc(self._child(self.requests, *labels, outcome.value), count)
        return labels

    def side_door(self, tenant: str | None, door: str, outcome: str, count: int) -> None:
        """``count`` side-door calls a shell answered (or lookups it sent to Triton)."""
        if outcome == SIDE_DOOR_LOOKUP:
            self._child(self.side_door_lookups, door).inc(count)
        else:
            self._child(self.side_door_calls, self.tenant_label(tenant), door, outcome).inc(count)

    def connection_refused(self, transport: str, reason: str, count: int) -> None:
        """``count`` connections a shell closed itself (``CONNECTION_DOOR`` tallies)."""
        self._child(self.connections_refused, transport, reason).inc(count)

    def batch_finished(self, report: BatchReport) -> None:
        model = report.model
        self.endpoint_label.confirm(model)
        pending = self.pending
        pending.inc(self._child(self.batches, model, "ok" if report.ok else "error"))
        pending.observe(self._series(self.batch_seconds, model), report.seconds)
        pending.observe(self._series(self.batch_rows, model), report.rows)
        if not report.ok:
            return
        for tenant, rows in report.tenants.items():
            label = self.tenant_label(tenant)
            pending.inc(self._child(self.served_rows, label, model), rows)
            pending.inc(self._child(self.served_tokens, label, model), report.tenant_tokens[tenant])
            pending.inc(self._child(self.served_cost, label, model), report.tenant_cost[tenant])

    def batches_finished(self, reports: Sequence[BatchReport]) -> None:
        """``batch_finished`` of each (one loop turn's batches, or granted streams), with
        each series looked up once and each counter increased once by the turn's sum."""
        counts: dict[tuple[str, str], int] = {}
        times: dict[str, tuple[list[float], list[float]]] = {}
        served: dict[tuple[str, str], list[float]] = {}  # (tenant, model): rows, tokens, cost
        for report in reports:
            model = report.model
            series = times.get(model)
            if series is None:
                self.endpoint_label.confirm(model)
                series = times[model] = ([], [])
            series[0].append(report.seconds)
            series[1].append(float(report.rows))
            key = (model, "ok" if report.ok else "error")
            counts[key] = counts.get(key, 0) + 1
            if not report.ok:
                continue
            tokens, cost = report.tenant_tokens, report.tenant_cost
            for tenant, rows in report.tenants.items():
                sums = served.get((tenant, model))
                if sums is None:
                    served[(tenant, model)] = [float(rows), float(tokens[tenant]), cost[tenant]]
                else:
                    sums[0] += rows
                    sums[1] += tokens[tenant]
                    sums[2] += cost[tenant]
        pending = self.pending
        for (model, ok), n in counts.items():
            pending.inc(self._child(self.batches, model, ok), n)
        for model, (seconds, sizes) in times.items():
            pending.observe_all(self._series(self.batch_seconds, model), seconds)
            pending.observe_all(self._series(self.batch_rows, model), sizes)
        for (tenant, model), sums in served.items():
            label = self.tenant_label(tenant)
            pending.inc(self._child(self.served_rows, label, model), sums[0])
            pending.inc(self._child(self.served_tokens, label, model), sums[1])
            pending.inc(self._child(self.served_cost, label, model), sums[2])

    def rate_limit_hit(self, *, tenant: str, model: str, limit: str) -> None:
        self.endpoint_label.confirm(model)
        self._child(self.rate_limit_hits, self.tenant_label(tenant), model, limit).inc()

    def rate_limit_degraded(self, *, tenant: str, model: str, mode: str, reason: str) -> None:
        self.endpoint_label.confirm(model)
        self._child(
            self.rate_limit_storage_errors, self.tenant_label(tenant), model, mode, reason
        ).inc()

    def tokens_produced(
        self,
        *,
        tenant: str,
        model: str,
        tokens: int,
        first_token_s: float | None,
        inter_token: Gaps | None = None,
    ) -> None:
        sink = self._token_sinks.get((tenant, model))
        if sink is None:
            sink = self._token_sink(tenant, model)
        pending = self.pending
        pending.inc(sink[0], tokens)
        if first_token_s is not None:
            pending.observe(sink[1], first_token_s)
        if inter_token is not None:
            pending.observe_binned(sink[2], inter_token)  # binned by the shells

    def _token_sink(self, tenant: str, model: str) -> tuple[Any, ...]:
        """The output-token counter of a tenant's model, then its first-token histogram
        with the model's GenAI one and its inter-token histogram with the model's GenAI
        one (``Pending`` keys: both of a pair get the same values), resolved once while
        the labels stand (a config's tiers, a model not yet confirmed: not kept)."""
        labels = (self.tenant_label(tenant), self.tier_of(tenant), self.endpoint_label(model))
        sink = (
            self._child(self.output_tokens, *labels),
            (
                self._child(self.first_token, *labels),
                self._child(self.genai_first_token, labels[2]),
            ),
            (self._child(self.inter_token, *labels), self._child(self.genai_per_token, labels[2])),
        )
        if labels[2] != OTHER_ENDPOINT:
            self._token_sinks[(tenant, model)] = sink
        return sink

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        """A (re)loaded config: tenants' tiers (labels) may have changed."""
        self._config = config
        self._token_sinks = {}
        self._request_sinks = {}

    def throttle_decision(self, *, model: str, decision: Any, count: int = 1) -> None:
        self.endpoint_label.confirm(model)
        reason = decision.reason.replace(" ", "_")
        self.pending.inc(self._child(self.throttle, model, reason), count)
        series = self._series(self.predicted_wait, model)
        if count == 1:
            self.pending.observe(series, decision.predicted_wait_s)
        else:  # each request's decision, the group's wait (its last request's)
            self.pending.observe_all(series, [decision.predicted_wait_s] * count)

    def ttft_predicted(self, *, model: str, slo_class: str, error: float) -> None:
        self.endpoint_label.confirm(model)
        series = self._series(self.ttft_prediction_error, model, slo_class)
        self.pending.observe(series, error)


_WINDOW = (
    f"the last {WINDOW_S} whole seconds, [floor(now) - {WINDOW_S} s, floor(now)]; service is "
    "the cost charged at dispatch plus output charged back as it streams"
)

# The gauges ``StateCollector`` exports: name -> help. Every one is exported, without
# samples while there is nothing to report (no endpoint used yet, no tenant backlogged),
# so a scrape always shows which families exist.
STATE_GAUGES: dict[str, str] = {
    "fair_queue_depth": "Requests queued, by endpoint and tier.",
    "fair_drr_deficit": "DRR deficit of tenants with queued work, in cost units (every "
    "endpoint but an engine endpoint in token cost, which has fair_vtc_counter instead).",
    "fair_vtc_counter": "Virtual token counter of tenants with queued work (engine "
    "endpoints in token cost): weighted tokens served, lifted on return from idle.",
    # fair_frontend.scheduler.window, over the window _WINDOW names:
    "fair_service_gap": "Largest difference of normalised service (cost units served in "
    f"the window / weight) between two tenants of the tier backlogged (work queued at every "
    f"moment) through the window: {_WINDOW}. Absent while fewer than two were.",
    "fair_jain_index": "Jain's fairness index, (sum x)^2 / (n sum x^2), over x = normalised "
    "service (as fair_service_gap) of the tier's n tenants backlogged through the window: "
    f"{_WINDOW}. 1: equal shares; 1/n: one got all (1 also when none was served). Absent "
    "while fewer than two were backlogged.",
    "fair_goodput": "Cost units served per second to the tenant over the window: "
    f"{_WINDOW}. Tenants served anything in it only.",
    # fair_frontend.admission.slo.SloLedger, over the same whole seconds:
    "fair_slo_attainment": "Fraction of the tenant's requests of an SLO class that met "
    "their class's target (interactive: first token within ttft_ms; batch: served within "
    f"deadline_s; expired counts as missed, refused not at all), over the last {WINDOW_S} "
    "whole seconds by when the verdict was known. Tenants with such a request only.",
    "fair_slo_class_attainment": "As fair_slo_attainment, over every tenant's requests of "
    "the class.",
    "fair_slo_goodput": "Requests of the class that met its target, per second over the "
    "window (as fair_slo_attainment).",
    "fair_inflight_batches": "Batches in Triton now, by endpoint.",
    "fair_backend_available": "1 while Triton (in a pool: any of its Tritons) is reachable.",
    "fair_triton_backend_available": "1 while this Triton of the pool is reachable, by backend.",
    "fair_triton_backend_inflight": "Batches (engine: requests) in this Triton now, by "
    "endpoint and backend.",
    # fair_frontend.feedback.ServiceStatus.samples():
    "fair_service_source": "1 for the source of the endpoint's service estimates "
    "(triton, frontend or default), 0 for the others.",
    "fair_triton_metrics_stale": "1 while Triton's metrics are stale or unread for the endpoint.",
    "fair_service_rate": "Units (rows, tokens) served per busy second.",
    "fair_service_unit_seconds": "Seconds of service per cost unit (EMA).",
    "fair_batch_time_seconds": "Batch-time model: fixed, per_row and per_token seconds.",
}


# The labels of each of ``STATE_GAUGES``' samples, as ``Core.state_samples`` and
# ``ServiceStatus.samples`` give them (the collector takes a family's labels from its
# samples; these are for the reference and its test).
STATE_GAUGE_LABELS: dict[str, tuple[str, ...]] = {
    "fair_queue_depth": ("endpoint", "tier"),
    "fair_drr_deficit": ("endpoint", "tenant"),
    "fair_vtc_counter": ("endpoint", "tenant"),
    "fair_service_gap": ("endpoint", "tier"),
    "fair_jain_index": ("endpoint", "tier"),
    "fair_goodput": ("endpoint", "tenant"),
    "fair_slo_attainment": ("endpoint", "tenant"),
    "fair_slo_class_attainment": ("endpoint", "slo_class"),
    "fair_slo_goodput": ("endpoint", "slo_class"),
    "fair_inflight_batches": ("endpoint",),
    "fair_backend_available": (),
    "fair_triton_backend_available": ("backend",),
    "fair_triton_backend_inflight": ("endpoint", "backend"),
    "fair_service_source": ("endpoint", "source"),
    "fair_triton_metrics_stale": ("endpoint",),
    "fair_service_rate": ("endpoint", "unit"),
    "fair_service_unit_seconds": ("endpoint",),
    "fair_batch_time_seconds": ("endpoint", "term"),
}


def exported_families() -> list[tuple[str, str, tuple[str, ...], str]]:
    """``(name, type, labels, help)`` of every family the frontend's ``/metrics`` exports,
    from the declarations: ``FrontendMetrics``' families, then ``STATE_GAUGES``. The name
    is the one a scrape shows: a counter's ``..._total``; a histogram's, with its
    ``_bucket``, ``_sum`` and ``_count`` series under it."""
    rows = []
    families = FrontendMetrics(Config(tiers=["any"]))
    for metric in vars(families).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        (described,) = metric.describe()
        name = described.name + ("_total" if described.type == "counter" else "")
        labels = tuple(metric._labelnames)  # prometheus_client keeps them here only
        rows.append((name, described.type, labels, described.documentation))
    for name, doc in STATE_GAUGES.items():
        rows.append((name, "gauge", STATE_GAUGE_LABELS[name], doc))
    return rows


def reference() -> str:
    """``exported_families`` as a Markdown table (``fair-frontend metrics-reference``; the
    README embeds it and a test keeps it current)."""
    out = ["| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for name, kind, labels, doc in exported_families():
        shown = ", ".join(f"`{label}`" for label in labels) or "none"
        doc = doc.replace("|", "\\|")
        out.append(f"| `{name}` | {kind} | {shown} | {doc} |")
    return "\n".join(out) + "\n"


def window_samples(
    endpoint: str, window: WindowFairness, tenant_label: Callable[[str], str]
) -> list[tuple[str, dict[str, str], float]]:
    """The fairness window's gauges of one endpoint (``StateCollector`` samples): the
    service gap and Jain's index of each tier with two tenants or more backlogged
    through the window, every served tenant's goodput (under its label: ``other``'s
    is the sum of the tenants folded into it)."""
    out: list[tuple[str, dict[str, str], float]] = []
    for tier, normalised in window.backlogged.items():
        if len(normalised) < 2:
            continue
        labels = {"endpoint": endpoint, "tier": tier}
        out.append(("fair_service_gap", labels, service_gap(normalised.values())))
        out.append(("fair_jain_index", labels, jain_index(normalised.values())))
    for tenant, rate in window.goodput().items():
        out.append(("fair_goodput", {"endpoint": endpoint, "tenant": tenant_label(tenant)}, rate))
    return out


def slo_samples(
    endpoint: str,
    window: Mapping[tuple[str, str], tuple[int, int]],
    tenant_label: Callable[[str], str],
) -> list[tuple[str, dict[str, str], float]]:
    """The SLO gauges of one endpoint from its ledger's window ((tenant, class) -> (met,
    total)): attainment per tenant (over its classes) and per class, and each class's
    goodput. Tenants folded into ``other`` (the label guard) are summed before dividing:
    ``other``'s attainment is over all their requests."""
    out: list[tuple[str, dict[str, str], float]] = []
    tenants: dict[str, list[int]] = {}
    classes: dict[str, list[int]] = {}
    for (tenant, slo), (met, total) in window.items():
        for key, sums in ((tenant_label(tenant), tenants), (slo, classes)):
            counts = sums.setdefault(key, [0, 0])
            counts[0] += met
            counts[1] += total
    for tenant, (met, total) in tenants.items():
        out.append(("fair_slo_attainment", {"endpoint": endpoint, "tenant": tenant}, met / total))
    for slo, (met, total) in classes.items():
        labels = {"endpoint": endpoint, "slo_class": slo}
        out.append(("fair_slo_class_attainment", labels, met / total))
        out.append(("fair_slo_goodput", dict(labels), met / WINDOW_S))
    return out


class StateCollector(Collector):
    """Gauges read from live scheduler state at scrape time (depths, deficits)."""

    def __init__(self, sample: Callable[[], Iterable[tuple[str, dict[str, str], float]]]) -> None:
        self.sample = sample

    def collect(self) -> Iterable[Any]:
        # Sum samples that share labels (tenants folded into "other" by the guard).
        values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for name, labels, value in self.sample():
            key = (name, tuple(labels.items()))
            values[key] = values.get(key, 0.0) + value
        families: dict[str, GaugeMetricFamily] = {}
        for (name, pairs), value in values.items():
            fam = families.get(name)
            if fam is None:
                fam = GaugeMetricFamily(
                    name, STATE_GAUGES.get(name, name), labels=[p[0] for p in pairs]
                )
                families[name] = fam
            fam.add_metric([p[1] for p in pairs], value)
        for name, doc in STATE_GAUGES.items():
            if name not in families:
                families[name] = GaugeMetricFamily(name, doc)
        yield from families.values()
