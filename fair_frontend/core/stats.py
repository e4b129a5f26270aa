"""Triton's statistics extension, for what went through the frontend.

``ModelStatistics`` (gRPC) and ``/v2/models/{m}/stats`` (HTTP) answer in Triton's own
message, with the frontend's view of each phase, so perf_analyzer's server-side
breakdown reads right:

* ``success`` / ``fail``: requests answered, with their whole time in the frontend
  (arrival to answer);
* ``queue``: time waiting in the frontend's queues (admission to dispatch), where
  fairness is decided; Triton's own queue stays nearly empty by design;
* ``compute_infer``: dispatch to answer: the Triton round trip of the request's batch;
* ``compute_input`` / ``compute_output``: the same counts, 0 ns (packing is inside
  ``compute_infer``; perf_analyzer requires the three counts to agree);
* ``inference_count``: rows answered; ``execution_count``: batches sent to Triton;
* ``batch_stats``: per batch size (rows), the batches and their round trip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tritonclient.grpc import service_pb2


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)

    def into(self, msg: service_pb2.StatisticDuration) -> None:
        msg.count = self.count
        msg.ns = self.ns


@dataclass
class _ModelStats:
    last_inference_ms: int = 0
    inference_count: int = 0
    execution_count: int = 0
    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    batches: dict[int, _Duration] = field(default_factory=dict)


class Statistics:
    """Per model and version: what the frontend answered (Triton's statistics message)."""

    def __init__(self) -> None:
        self._models: dict[tuple[str, str], _ModelStats] = {}

    def _get(self, model: str, version: str) -> _ModelStats:
        key = (model, version)
        stats = self._models.get(key)
        if stats is None:
            stats = self._models[key] = _ModelStats()
        return stats

    def success(
        self, model: str, version: str, rows: int, total_s: float, queue_s: float, infer_s: float
    ) -> None:
        s = self._get(model, version)
        s.last_inference_ms = int(time.time() * 1000)
        s.inference_count += rows
        s.success.add(total_s)
        s.queue.add(queue_s)
        s.compute_infer.add(infer_s)

    def successes(
        self,
        model: str,
        version: str,
        rows: int,
        count: int,
        total_s: float,
        queue_s: float,
        infer_s: float,
    ) -> None:
        """``count`` requests of ``rows`` rows in all answered at once (a batch part), the
        times their sums: as ``success`` for each."""
        s = self._get(model, version)
        s.last_inference_ms = int(time.time() * 1000)
        s.inference_count += rows
        s.success.add(total_s, count)
        s.queue.add(queue_s, count)
        s.compute_infer.add(infer_s, count)

    def failure(self, model: str, version: str | None, total_s: float) -> None:
        """A failed request; ``version`` None: not counted (``ModelInfo.version_for``)."""
        self.failures(model, version, total_s, 1)

    def failures(self, model: str, version: str | None, total_s: float, count: int) -> None:
        """``count`` failures that took ``total_s`` together (a shell's tally). ``version``
        None: a version the model does not have (or a model not looked up), which gets
        no entry: the names of failed requests are the client's choice, and an entry per
        name would grow without bound."""
        if version is not None:
            self._get(model, version).fail.add(total_s, count)

    def execution(self, model: str, version: str, rows: int, seconds: float) -> None:
        s = self._get(model, version)
        s.execution_count += 1
        s.batches.setdefault(rows, _Duration()).add(seconds)

    def message(self, model: str = "", version: str = "") -> service_pb2.ModelStatisticsResponse:
        """Statistics of one model (and version), or of every model seen when ``model`` is ""."""
        out = service_pb2.ModelStatisticsResponse()
        for (name, ver), s in sorted(self._models.items()):
            if (model and name != model) or (version and ver != version):
                continue
            m = out.model_stats.add(
                name=name,
                version=ver,
                last_inference=s.last_inference_ms,
                inference_count=s.inference_count,
                execution_count=s.execution_count,
            )
            s.success.into(m.inference_stats.success)
            s.fail.into(m.inference_stats.fail)
            s.queue.into(m.inference_stats.queue)
            s.compute_infer.into(m.inference_stats.compute_infer)
            # Same counts for the three compute phases (perf_analyzer insists), 0 ns.
            m.inference_stats.compute_input.count = s.compute_infer.count
            m.inference_stats.compute_output.count = s.compute_infer.count
            for size, d in sorted(s.batches.items()):
                b = m.batch_stats.add(batch_size=size)
                d.into(b.compute_infer)
                b.compute_input.count = b.compute_output.count = d.count
        return out

    def empty(self, model: str, version: str) -> service_pb2.ModelStatisticsResponse:
        """A known model that has not been used yet: one entry of zeros, as Triton gives."""
        out = service_pb2.ModelStatisticsResponse()
        out.model_stats.add(name=model, version=version or "1")
        return out
