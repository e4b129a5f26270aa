"""The feedback loop: what batches really cost, learned from the frontend and from Triton.

Pure core (``ServiceModel``, ``FeedbackCost``), fed ``TritonDelta``s by Triton's metrics
reader (``backends.triton.metrics``: its parser, ``CounterTracker`` and the asyncio
``TritonMetrics``). This docstring explains the estimates once; the code
points here.

Service time of a batch (the frontend's measurement)
====================================================
The frontend keeps up to ``max_inflight_batches`` (2) batches in Triton, so a batch's round
trip includes waiting behind the batch ahead of it inside Triton. With one model instance
a batch starts executing when it arrives or when the previous batch finishes, whichever
is later, so its service time is

    service = finished - max(sent, previous batch's finished).

Summed over batches that is exactly the time with something in flight (the union of the
batches' intervals), the busy time. Assumption: one instance, batches finishing in the
order they execute. With k instances running batches side by side, batches overlap and
the formula charges each only the time by which it extends the busy period: about 1/k of
a batch's latency when all k are busy. That underestimates how long *one* batch takes,
but the sum is still the busy time, so the throughput (units per busy second) and the
time to drain a backlog, which is what the throttle and the cost normalisation use, stay
right. The frontend's times include the network and (de)serialisation that the pipeline
does not hide; Triton's do not.

Triton's measurement
====================
Per scrape interval and model: executions (``nv_inference_exec_count``), items
(``nv_inference_count``), successful requests, and the cumulative compute time
(``nv_inference_compute_infer_duration_us``). Triton adds an execution's compute time to
every request in it, so the mean execution time is ``compute / requests``, not
``compute / executions`` (``TritonDelta.seconds_per_exec`` has the measurement). An
interval is one observation: mean rows per execution, mean seconds per execution,
weighted by the number of executions. Triton does not know tokens; the tokens per row are
those of the frontend's rows that Triton's counters have not shown yet, oldest first (Triton
counts an execution a moment after its answer leaves, so a scrape can miss a batch that
the frontend already saw finish; matching rows, not intervals, puts it in the next one),
else the model's own ``fair_model_tokens_total`` counter, else the long-run ratio, else
the interval is not learned from. Triton's numbers are preferred: they are pure execution
time, and they see traffic that bypasses the frontend.

The batch-time model
====================
    seconds ≈ fixed + per_row * rows + per_token * tokens,   all coefficients >= 0.

Fitted by weighted least squares over exponentially decayed sufficient statistics
(``fit.DecayedStats``: sums of w x x^T, w x y, w y^2 with x = [1, rows, tokens]). Before an
observation is added at time t the sums are multiplied by

    max((1 - alpha) ** ((t - t_prev) / interval),  (1 - 1/M) ** n)

with ``alpha`` = ``observability.ema_alpha`` (0.2), ``interval`` = the metrics interval
(1 s), ``n`` the batches the observation stands for and M = 100: a time-aware EMA with a
time constant of interval / -ln(1 - alpha) (4.5 s by default), that never forgets faster
than ~M batches, so at low load the fit does not rest on a handful of noisy batches. The
same sums, kept per source, give every other estimate, so they all share one memory.

Non-negativity: every subset of the three terms is fitted by ordinary least squares, and
only subsets whose coefficients are all >= 0 qualify (with three terms, the NNLS solution
is among them). Of those, the one with the best BIC,

    n ln(RSS / W) + k ln(n),   n = W^2 / sum(w^2), the effective number of batches,

wins, the simpler one on a tie: a term is kept only when it improves the fit by more
than noise would (without the penalty, a slope that is truly 0 comes out positive half the
time and steals from the others).

Identification. A subset is tried only if each of its features varies independently of
the others by at least ``fit.MIN_SPREAD`` (10 %) of its size; otherwise the data cannot
tell those terms apart and any slope would be noise. In particular:
- every batch alike (same rows, same tokens): only one-term models qualify, they fit
  equally well, and the preferred one is *proportional to the endpoint's cost unit*
  (``per_token`` on token-cost endpoints, ``per_row`` on request-cost ones, fixed = 0).
  Then ``FeedbackCost`` charges exactly the plain cost: no slope is invented, and the
  status says so (``basis`` = ``"per_token"``);
- rows varying but tokens always proportional to rows: fixed + the cost-unit slope.
Triton's interval means vary much less than single batches; when they identify fewer
terms than the frontend's batches do, the frontend's fit gives the shape and Triton's the
level (scaled to agree at Triton's mean batch).

Sources, staleness and defaults
===============================
``Source.TRITON`` while Triton's metrics are current and have data; otherwise
``Source.FRONTEND`` if the frontend has measured batches; otherwise stale Triton data if
any; otherwise ``Source.DEFAULT`` (10 ms per batch, ``DEFAULT_BATCH_SECONDS``). Triton's
metrics are stale when no scrape succeeded for 3 intervals, or when its counters did not
move in an interval in which at least 2 of the frontend's batches finished (a frozen or
wrong endpoint). Every change of source, and of staleness, is logged; ``status()`` exports
both (``ServiceStatus.samples()``).

Rates and the normalised service cost
=====================================
From the current source's sums: rows (tokens) per busy second = sum(w rows) / sum(w y);
seconds per cost unit (``unit_seconds``) = sum(w y) / sum(w units), units being tokens on
token-cost endpoints and rows on request-cost ones. Ratios of EMAs, not EMAs of ratios:
a batch weighs by its size, and the ratio is unbiased where a mean of per-batch ratios is
not. The typical batch is (sum(w rows), sum(w tokens)) / sum(w).

A request's marginal seconds inside a typical batch (``predict_request_seconds``):

    fixed * rows / typical_rows + per_row * rows + per_token * tokens.

Summed over the requests of a typical batch this is the predicted time of that batch,
which the least-squares fit (with its fixed term) makes equal to the mean batch time. So
``FeedbackCost`` = marginal seconds / unit_seconds charges a typical batch, in total,
exactly its plain cost: the quantum keeps its meaning, and only the split between
requests changes (by what each really occupies). Under load, when cost matters, the
typical batch is the full batch.

Effect on the DRR bound. Costs are computed once, at enqueue, and stored on the request;
the scheduler's bounds (theorems A and B in ``fair_frontend.scheduler``) assume nothing
about how a cost was computed, only that it is fixed, finite and >= 0. So they hold with
C = the largest *normalised* cost a tenant has queued. What changes: a request that costs
more than its plain cost (a long generation on a request-cost endpoint) may need several
DRR turns to be paid for, exactly as a multi-row request does; and the costs of requests
enqueued at different moments use the estimates of those moments, which is fair to
within the estimate's drift over a queue's lifetime.
"""

from __future__ import annotations

from fair_frontend.feedback.cost import FeedbackCost
from fair_frontend.feedback.delta import DEFAULT_METRICS_INTERVAL_S, TritonDelta
from fair_frontend.feedback.fit import MIN_SPREAD, TERMS, BatchTime, DecayedStats
from fair_frontend.feedback.service import (
    DEFAULT_BATCH_SECONDS,
    DEFAULT_EMA_ALPHA,
    DEFAULT_MIN_MEMORY_BATCHES,
    DEFAULT_STALE_AFTER_INTERVALS,
    FROZEN_MIN_BATCHES,
    ServiceModel,
    ServiceRate,
    ServiceStatus,
    Source,
)
from fair_frontend.feedback.slots import SlotTimes

__all__ = [
    "DEFAULT_BATCH_SECONDS",
    "DEFAULT_EMA_ALPHA",
    "DEFAULT_METRICS_INTERVAL_S",
    "DEFAULT_MIN_MEMORY_BATCHES",
    "DEFAULT_STALE_AFTER_INTERVALS",
    "FROZEN_MIN_BATCHES",
    "MIN_SPREAD",
    "TERMS",
    "BatchTime",
    "DecayedStats",
    "FeedbackCost",
    "ServiceModel",
    "ServiceRate",
    "ServiceStatus",
    "SlotTimes",
    "Source",
    "TritonDelta",
]
