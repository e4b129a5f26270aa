"""Builders for the feedback tests: a simulated single-instance endpoint on a fake clock.

Imported by the test modules beside it (pytest puts this directory on the path of a test
directory without ``__init__.py``). Everything is driven by explicit times; no clock, no
sleep.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from fair_frontend.feedback import ServiceModel, TritonDelta
from fair_frontend.scheduler.cost import CostUnit

FIXED_S = 0.002
PER_TOKEN_S = 20e-6


@dataclass(frozen=True)
class Truth:
    """The simulated model's cost: ``fixed + per_row * rows + per_token * tokens``."""

    fixed_s: float = FIXED_S
    per_token_s: float = PER_TOKEN_S
    per_row_s: float = 0.0

    def seconds(self, rows: float, tokens: float) -> float:
        return self.fixed_s + self.per_row_s * rows + self.per_token_s * tokens


@dataclass(frozen=True)
class Served:
    """One batch as the frontend saw it."""

    rows: int
    tokens: int
    sent: float
    finished: float
    executed_s: float  # its true execution time


def random_batches(
    rng: random.Random, count: int, *, max_rows: int = 32, tokens_per_row: tuple[int, int] = (4, 64)
) -> list[tuple[int, int]]:
    """``count`` batches of 1..max_rows rows, each row of a random token count."""
    out = []
    for _ in range(count):
        rows = rng.randint(1, max_rows)
        out.append((rows, sum(rng.randint(*tokens_per_row) for _ in range(rows))))
    return out


def serve_pipelined(
    batches: Iterable[tuple[int, int]],
    truth: Truth,
    *,
    start: float = 0.0,
    inflight: int = 2,
    rng: random.Random | None = None,
    noise: float = 0.0,
    jitter_s: float = 0.0,
) -> Iterator[Served]:
    """One model instance, a frontend that keeps ``inflight`` batches in it, back to back.

    Batch k is sent when batch k - inflight finishes (a slot frees), starts executing
    when it has arrived and batch k - 1 has finished, and takes the true time times
    ``N(1, noise)`` plus ``N(0, jitter_s)``. Yielded in finishing order.
    """
    finished: list[float] = []
    for rows, tokens in batches:
        k = len(finished)
        sent = finished[k - inflight] if k >= inflight else start
        begin = max(sent, finished[-1]) if finished else sent
        seconds = truth.seconds(rows, tokens)
        if rng is not None:
            seconds = max(1e-6, seconds * rng.gauss(1.0, noise) + rng.gauss(0.0, jitter_s))
        finished.append(begin + seconds)
        yield Served(rows, tokens, sent, begin + seconds, seconds)


def feed(model: ServiceModel, served: Iterable[Served]) -> list[Served]:
    """Report every batch to ``model`` as the shell would, when it finishes."""
    out = []
    for s in served:
        model.observe_batch(s.rows, s.tokens, s.sent, s.finished, s.finished)
        out.append(s)
    return out


def token_model(**kwargs: Any) -> ServiceModel:
    """A token-cost endpoint's model, max batch 32, default alpha and interval."""
    return ServiceModel("embed", cost_unit=CostUnit.TOKENS, max_batch_size=32, **kwargs)


def trained(
    truth: Truth,
    *,
    cost_unit: CostUnit = CostUnit.TOKENS,
    batches: int = 200,
    seed: int = 0,
    tokens_per_row: tuple[int, int] = (4, 64),
) -> ServiceModel:
    """A model that has seen ``batches`` exact (noise-free) varied batches of ``truth``."""
    rng = random.Random(seed)
    model = ServiceModel("ep", cost_unit=cost_unit, max_batch_size=32)
    feed(
        model,
        serve_pipelined(random_batches(rng, batches, tokens_per_row=tokens_per_row), truth),
    )
    return model


def delta(
    at: float,
    *,
    execs: int,
    rows_per_exec: float = 8.0,
    seconds_per_exec: float = 0.010,
    requests_per_exec: int = 1,
    model: str = "embed",
    interval_s: float = 1.0,
    rows: int | None = None,
    tokens: int | None = None,
    reset: bool = False,
) -> TritonDelta:
    """A Triton delta: ``execs`` executions of the given mean shape and time."""
    requests = execs * requests_per_exec
    return TritonDelta(
        model=model,
        at=at,
        interval_s=interval_s,
        exec_count=execs,
        inference_count=round(execs * rows_per_exec),
        request_success=requests,
        request_failure=0,
        # Triton adds an execution's time to each of its requests.
        compute_infer_us=seconds_per_exec * 1e6 * requests,
        queue_us=0.0,
        request_us=seconds_per_exec * 1e6 * requests,
        pending_requests=0.0,
        rows=rows,
        tokens=tokens,
        reset=reset,
    )
