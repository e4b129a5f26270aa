"""perf_analyzer 2.46, unchanged, measures embed and generate, directly and through us.

The command is the plain one users start with, ``-m embed --shape INPUT_IDS:<n>``, no data
file: perf_analyzer then fills every input the model declares (optional ones too) with
random data, which works because ``INPUT_IDS`` is the models' only input (random ids are
taken modulo the vocabulary; row lengths and ``max_tokens`` are request parameters).
The same command runs against Triton directly and through the frontend, where the key
travels as ``-H 'authorization: Bearer KEY'`` (perf_analyzer splits at the first ':' and
does not trim, so the value arrives as ' Bearer KEY'). Runs are short: count windows of
20 requests at concurrency 2. What perf_analyzer asks the server, recorded on a private
frontend: ServerMetadata (the extensions list), ModelMetadata and ModelConfig;
ModelStatistics around every measurement window, because ``statistics`` is listed.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from compat_support import TENANT

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.kit.testing import perf_analyzer, perf_analyzer_binary
from tests.support import (
    KEYS,
    PERF_ANALYZER_SHORT_RUN,
    RunningFrontend,
    make_config,
    running_frontend,
)

COUNTED = ("server_metadata", "model_metadata", "model_config", "statistics")
SHORT_RUN = PERF_ANALYZER_SHORT_RUN
# The widths users start with (README): a 128-token embedding, a 32-token prompt.
SHAPES = {"embed": "INPUT_IDS:128", "generate": "INPUT_IDS:32"}


@pytest.fixture(scope="module")
def counted(triton: EmbeddedTriton) -> Iterator[tuple[RunningFrontend, Counter[str]]]:
    """A frontend of its own whose metadata calls are counted (wrapping, not replacing)."""
    calls: Counter[str] = Counter()
    with running_frontend(make_config(), triton) as running:
        service = running.gateway.side  # the side doors (``SideDoorAnswers``)
        for name in COUNTED:
            original = getattr(service, name)

            async def count(*args: Any, _name: str = name, _call: Any = original) -> Any:
                calls[_name] += 1
                return await _call(*args)

            setattr(service, name, count)
        yield running, calls


def _url(running: RunningFrontend | EmbeddedTriton, protocol: str) -> str:
    if protocol == "grpc":
        return running.grpc_url
    return running.http_url.removeprefix("http://")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("model", ["embed", "generate"])
def test_perf_analyzer_plain_command_measures_triton_directly(
    triton: EmbeddedTriton, model: str, protocol: str
) -> None:
    """The reference: what users run first, against Triton itself, succeeds."""
    result = perf_analyzer(
        model,
        _url(triton, protocol),
        protocol=protocol,
        concurrency=2,
        shapes=[SHAPES[model]],
        extra=SHORT_RUN,
        timeout_s=120,
    )  # raises with perf_analyzer's output on any error (it exits non-zero then)
    assert result["throughput"] > 0
    assert result["p50_ms"] > 0


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("model", ["embed", "generate"])
def test_perf_analyzer_plain_command_measures_through_the_frontend(
    counted: tuple[RunningFrontend, Counter[str]], model: str, protocol: str
) -> None:
    running, calls = counted
    before = Counter(calls)
    batches_before = running.call(running.batch_count(model))
    result = perf_analyzer(
        model,
        _url(running, protocol),
        protocol=protocol,
        concurrency=2,
        shapes=[SHAPES[model]],
        headers=[f"authorization: Bearer {KEYS[TENANT]}"],
        extra=SHORT_RUN,
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
    counted: tuple[RunningFrontend, Counter[str]],
) -> None:
    """The negative control: the runs above pass because the -H key is honoured."""
    running, _ = counted
    proc = subprocess.run(
        [
            perf_analyzer_binary(),
            "-m",
            "embed",
            "--shape",
            SHAPES["embed"],
            "-u",
            running.grpc_url,
            "-i",
            "grpc",
            "--concurrency-range",
            "2:2",
            *SHORT_RUN,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "API key" in proc.stdout + proc.stderr
