"""What the project's tests and its benchmarks both need, in one place.

In the spirit of ``aiohttp.test_utils``: small helpers for driving a frontend and a real
Triton from the outside, shipped with the package so that ``tests/`` and ``benchmarks/``
import them from here instead of from each other. Nothing in the service imports this
module. It holds:

- reading a Prometheus page: ``scrape`` / ``ascrape`` (one scrape as ``Samples``, which
  sums samples by name or family, filtered by labels) and ``parse`` (the same, of a text);
- waiting with a deadline: ``eventually`` / ``aeventually`` poll a condition until it
  holds and fail, naming what was awaited, once the time is up;
- perf_analyzer: ``perf_analyzer_binary`` and ``perf_analyzer`` (one measurement);
- ``free_port``;
- a gate a test model holds its answers at until the test opens it: ``Gate`` (the test's
  side) and ``hold_at_gate`` (the model's, in its ``execute``), in place of a model that
  sleeps a time sized to the machine's speed (``fair_frontend.kit.gates``).

Helpers only one side uses stay there: ``tests/support.py`` (the tests'),
``benchmarks/harness.py`` (the benchmarks').
"""

from __future__ import annotations

import asyncio
import csv
import inspect
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, overload

from prometheus_client.parser import text_string_to_metric_families

from fair_frontend.backends.triton.embedded import free_port
from fair_frontend.kit.gates import GATE_FIRST_PARAMETER, GATE_PARAMETER, Gate, hold_at_gate

__all__ = [
    "GATE_FIRST_PARAMETER",
    "GATE_PARAMETER",
    "Gate",
    "Sample",
    "Samples",
    "aeventually",
    "ascrape",
    "eventually",
    "fetch",
    "free_port",
    "hold_at_gate",
    "parse",
    "perf_analyzer",
    "perf_analyzer_binary",
    "scrape",
]

T = TypeVar("T")

# Loopback pages: never through a proxy the environment may name.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# ---- reading a metrics page -----------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One line of a metrics page. ``family``: the family's name, as the parser gives it (a
    counter's without ``_total``: ``fair_requests``); ``name``: the sample's own
    (``fair_requests_total``, ``fair_requests_created``, ``..._bucket``)."""

    family: str
    name: str
    labels: dict[str, str]
    value: float

    def has(self, labels: dict[str, str]) -> bool:
        """Whether this sample's labels include ``labels``."""
        return all(self.labels.get(k) == v for k, v in labels.items())


class Samples:
    """One scrape: every sample of the page, in page order (iterate for anything else)."""

    def __init__(self, samples: Sequence[Sample] = ()) -> None:
        self.samples = list(samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def sum(self, name: str, **labels: str) -> float:
        """The sum of the samples named ``name`` whose labels include ``labels``; 0 when none."""
        return sum(s.value for s in self.samples if s.name == name and s.has(labels))

    def family_sum(self, family: str, **labels: str) -> float:
        """The sum of family ``family``'s samples whose labels include ``labels``, leaving
        out ``_created`` (a counter's: its ``_total``); 0 when none."""
        return sum(
            s.value
            for s in self.samples
            if s.family == family and not s.name.endswith("_created") and s.has(labels)
        )

    def by_label(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """``{value of label: sum}`` of the samples named ``name`` whose labels include
        ``labels`` (e.g. per tenant); samples without ``label`` are left out."""
        out: dict[str, float] = {}
        for s in self.samples:
            if s.name == name and label in s.labels and s.has(labels):
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
        return out

    def label_values(self, name: str, label: str, **labels: str) -> set[str]:
        """The values ``label`` takes on the samples named ``name`` that include ``labels``."""
        return {
            s.labels[label]
            for s in self.samples
            if s.name == name and label in s.labels and s.has(labels)
        }


def parse(text: str) -> Samples:
    """A metrics page's text (Prometheus exposition format) as ``Samples``."""
    return Samples(
        [
            Sample(family.name, s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]
    )


def fetch(url: str, timeout: float = 10.0) -> str:
    """The text at ``url`` (a metrics page), without a proxy; raises ``OSError`` (an
    ``HTTPError`` for a status other than 2xx) as urllib does."""
    with _OPENER.open(url, timeout=timeout) as response:
        text: str = response.read().decode()
        return text


def scrape(url: str, timeout: float = 10.0) -> Samples:
    """One scrape of the metrics page at ``url``."""
    return parse(fetch(url, timeout))


async def ascrape(url: str, timeout: float = 10.0) -> Samples:
    """``scrape`` for async code: the blocking read runs in a thread, not on the loop."""
    return await asyncio.to_thread(scrape, url, timeout)


# ---- waiting with a deadline ----------------------------------------------------------------


def _describe(condition: Callable[..., Any], what: str | None) -> str:
    return what or getattr(condition, "__qualname__", None) or repr(condition)


def eventually(
    condition: Callable[[], T | None],
    timeout: float,
    interval: float = 0.05,
    *,
    what: str | None = None,
) -> T:
    """Call ``condition()`` every ``interval`` s until it returns something truthy, and return
    that. After ``timeout`` s without, raise ``AssertionError`` naming ``what`` (default:
    the condition's name). An exception ``condition`` raises goes through at once.

    The condition is looked at once more at the deadline: never a sleep past it."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"not within {timeout:g} s: {_describe(condition, what)}")
        time.sleep(min(interval, left))


@overload
async def aeventually(
    condition: Callable[[], Awaitable[T | None]],
    timeout: float,
    interval: float = ...,
    *,
    what: str | None = ...,
) -> T: ...


@overload
async def aeventually(
    condition: Callable[[], T | None],
    timeout: float,
    interval: float = ...,
    *,
    what: str | None = ...,
) -> T: ...


async def aeventually(
    condition: Callable[[], Any], timeout: float, interval: float = 0.05, *, what: str | None = None
) -> Any:
    """``eventually`` for async tests: ``condition`` may return a value or an awaitable (a
    coroutine), and the sleeps between looks let the loop run.

    An awaited condition is itself bounded by the time left (at least ``interval``): one
    that never answers fails the wait as the deadline does, instead of hanging it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            try:
                value = await asyncio.wait_for(value, max(deadline - loop.time(), interval))
            except TimeoutError:
                raise AssertionError(
                    f"not within {timeout:g} s (the condition did not answer): "
                    f"{_describe(condition, what)}"
                ) from None
        if value:
            return value
        left = deadline - loop.time()
        if left <= 0:
            raise AssertionError(f"not within {timeout:g} s: {_describe(condition, what)}")
        await asyncio.sleep(min(interval, left))


# ---- perf_analyzer --------------------------------------------------------------------------


def perf_analyzer_binary() -> str:
    """The perf_analyzer ``make setup`` unpacks beside this Python (``.venv/bin``), else
    one on ``PATH``."""
    exe = Path(sys.executable).parent / "perf_analyzer"
    if exe.exists():
        return str(exe)
    found = shutil.which("perf_analyzer")
    if found is None:
        raise RuntimeError("perf_analyzer not found: run `make setup`")
    return found


def perf_analyzer(
    model: str,
    url: str,
    *,
    protocol: str = "grpc",
    concurrency: int = 1,
    shapes: Sequence[str] = (),
    headers: Sequence[str] = (),
    interval_ms: int = 5000,
    extra: Sequence[str] = (),
    timeout_s: float = 300,
) -> dict[str, float]:
    """Run perf_analyzer once; returns throughput (infer/s) and latencies (ms)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.csv"
        cmd = [
            perf_analyzer_binary(),
            "-m",
            model,
            "-u",
            url,
            "-i",
            protocol,
            "--concurrency-range",
            f"{concurrency}:{concurrency}",
            "--measurement-interval",
            str(interval_ms),
            "-f",
            str(report),
            # These machines are shared: accept +-30% between windows, try longer.
            "--stability-percentage",
            "30",
            "--max-trials",
            "20",
        ]
        for s in shapes:
            cmd += ["--shape", s]
        for h in headers:
            cmd += ["-H", h]
        cmd += list(extra)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            raise RuntimeError(f"perf_analyzer failed ({proc.returncode}):\n{tail}")
        with report.open() as f:
            row = next(csv.DictReader(f))
    us = 1e-3
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50_ms": float(row["p50 latency"]) * us,
        "p90_ms": float(row["p90 latency"]) * us,
        "p99_ms": float(row["p99 latency"]) * us,
    }
