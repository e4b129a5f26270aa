"""perf_analyzer 2.46, unchanged, measures through the frontend on embed and generate.

The key travels as ``-H 'authorization: Bearer KEY'`` (perf_analyzer splits at the first
':' and does not trim, so the value arrives as ' Bearer KEY'). Runs are short: count
windows of 20 requests at concurrency 2. What perf_analyzer asks the server, recorded on a
private frontend: ServerMetadata (the extensions list), ModelMetadata and ModelConfig;
ModelStatistics around every measurement window, because ``statistics`` is listed.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from compat_support import TENANT, perf_analyzer_data

from benchmarks.harness import perf_analyzer, perf_analyzer_binary
from fair_frontend.embedded import EmbeddedTriton
from tests.support import KEYS, RunningFrontend, make_config, running_frontend

COUNTED = ("server_metadata", "model_metadata", "model_config", "statistics")
SHORT_RUN = ["--measurement-mode", "count_windows", "--measurement-request-count", "20"]


@pytest.fixture(scope="module")
def counted(triton: EmbeddedTriton) -> Iterator[tuple[RunningFrontend, Counter[str]]]:
    """A frontend of its own whose metadata calls are counted (wrapping, not replacing)."""
    calls: Counter[str] = Counter()
    with running_frontend(make_config(), triton.grpc_url) as running:
        service = running.gateway
        for name in COUNTED:
            original = getattr(service, name)

            async def count(*args: Any, _name: str = name, _call: Any = original) -> Any:
                calls[_name] += 1
                return await _call(*args)

            setattr(service, name, count)
        yield running, calls


def _url(running: RunningFrontend, protocol: str) -> str:
    return running.grpc_url if protocol == "grpc" else running.http_url


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("model", ["embed", "generate"])
def test_perf_analyzer_measures_through_the_frontend(
    counted: tuple[RunningFrontend, Counter[str]], tmp_path: Path, model: str, protocol: str
) -> None:
    running, calls = counted
    before = Counter(calls)
    batches_before = running.call(running.batch_count(model))
    data = perf_analyzer_data(tmp_path / "data.json", model, tokens=16)
    result = perf_analyzer(
        model,
        _url(running, protocol),
        protocol=protocol,
        concurrency=2,
        headers=[f"authorization: Bearer {KEYS[TENANT]}"],
        extra=["--input-data", str(data), *SHORT_RUN],
        timeout_s=120,
    )  # raises with perf_analyzer's output on any error (it exits non-zero then)
    assert result["throughput"] > 0
    assert result["p50_ms"] > 0
    assert running.call(running.batch_count(model)) > batches_before  # served by us
    made = Counter(calls)
    made.subtract(before)
    # Measured: one of each metadata call per run, on both protocols; statistics (listed
    # in the server's extensions) before and after every measurement window.
    metadata = ("server_metadata", "model_metadata", "model_config")
    assert {name: made[name] for name in metadata} == dict.fromkeys(metadata, 1), made
    assert made["statistics"] >= 2, made


def test_perf_analyzer_without_a_key_is_refused(
    counted: tuple[RunningFrontend, Counter[str]], tmp_path: Path
) -> None:
    """The negative control: the runs above pass because the -H key is honoured."""
    running, _ = counted
    data = perf_analyzer_data(tmp_path / "data.json", "embed", tokens=16)
    proc = subprocess.run(
        [
            perf_analyzer_binary(),
            "-m",
            "embed",
            "-u",
            running.grpc_url,
            "-i",
            "grpc",
            "--concurrency-range",
            "2:2",
            "--input-data",
            str(data),
            *SHORT_RUN,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "API key" in proc.stdout + proc.stderr
