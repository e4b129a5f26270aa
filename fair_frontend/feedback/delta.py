"""What the feedback loop is told of a model's work: one ``TritonDelta`` per model per read
of the backend's metrics (Triton's Prometheus counters, read by
``backends.triton.metrics``). The type is the feedback loop's own, as its other
parameters are: the backend's reader produces it, the loop consumes it, and neither
package reaches into the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_METRICS_INTERVAL_S = 1.0
"""How often Triton's metrics are read (``triton.metrics_interval_s``)."""


@dataclass(frozen=True, slots=True)
class TritonDelta:
    """What one model did between two scrapes (``at - interval_s`` .. ``at``).

    Counts are differences of Triton's cumulative counters, except ``pending_requests``
    (the queue depth at ``at``). ``rows`` / ``tokens``: the model's own per-tenant
    counters summed over tenants, ``None`` when it exports none.
    """

    model: str
    at: float  # when the scrape answered, on the caller's monotonic clock
    interval_s: float
    exec_count: int  # executions (batches Triton ran)
    inference_count: int  # items (batch rows) inferred
    request_success: int
    request_failure: int
    compute_infer_us: float  # summed per request: see seconds_per_exec
    queue_us: float
    request_us: float
    pending_requests: float
    rows: int | None = None
    tokens: int | None = None
    reset: bool = False  # a counter went down: these are the counts since the restart

    @property
    def seconds_per_exec(self) -> float | None:
        """Mean execution time: ``compute_infer / requests``, not ``/ executions``.

        Triton adds an execution's compute time to *every request* in it, so when its
        dynamic batcher merges k requests into one execution ``compute_infer`` grows by k
        times the execution's duration while ``exec_count`` grows by 1 (measured on the
        Python backend: 8 concurrent requests ran as 2 executions of about 10 ms; the
        compute counter grew by 123 ms: 61 ms per execution, 15 ms per request). Dividing
        by requests gives the request-weighted mean execution time: exact when every
        execution holds one request (the frontend sends one request per batch), close
        when merges are rare.
        """
        if self.request_success <= 0:
            return None
        return self.compute_infer_us / 1e6 / self.request_success
