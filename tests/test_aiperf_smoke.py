"""A real load generator for OpenAI endpoints against the frontend: NVIDIA's AIPerf
(``make setup`` installs it in ``.venv-aiperf``: its pinned dependencies differ from the
project's), streamed chat and embeddings, short runs. Every request must be answered, the
output lengths are what was asked (the shipped ``llm`` has no EOS: it always generates
``max_tokens``, and AIPerf reads the counts from the usage chunk), and the frontend counted
the requests under the tenant of the key AIPerf sent.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fair_frontend.config import parse_config
from tests.support import (
    KEYS,
    ROOT,
    RunningFrontend,
    config_dict,
    metric_sum,
    running_frontend,
)

AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
REQUESTS = 24
OUTPUT_TOKENS = 12


@pytest.fixture(scope="module")
def served(triton: Any) -> Iterator[RunningFrontend]:
    data = config_dict()
    data["endpoints"]["embed"]["tokenizer"] = data["endpoints"]["llm"]["tokenizer"]
    with running_frontend(parse_config(data), triton, workers=2) as running:
        yield running


def hf_tokenizer(served: RunningFrontend, folder: Path) -> Path:
    """The llm's tokenizer as a Hugging Face folder (AIPerf loads one with transformers)."""
    folder.mkdir()
    source = Path(served.server.config.endpoints["llm"].tokenizer or "")
    (folder / "tokenizer.json").write_bytes(source.read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def aiperf(served: RunningFrontend, tmp: Path, *args: str) -> dict[str, Any]:
    assert AIPERF.exists(), f"{AIPERF} is missing: run `make setup`"
    out = tmp / "out"
    cmd = [
        str(AIPERF), "profile",
        "--url", f"http://{served.http_url}",
        "--api-key", KEYS["globex"],
        "--tokenizer", str(hf_tokenizer(served, tmp / "tokenizer")),
        "--request-count", str(REQUESTS),
        "--concurrency", "4",
        "--prompt-input-tokens-mean", "24",
        "--output-artifact-dir", str(out),
        "--no-auto-plot",
        *args,
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads((out / "profile_export_aiperf.json").read_text())
    return result


def requests_counted(served: RunningFrontend, model: str) -> float:
    return metric_sum(
        served, "fair_requests_total", tenant="globex", endpoint=model, outcome="dispatched"
    )


def test_aiperf_streamed_chat(served: RunningFrontend, tmp_path: Path) -> None:
    before = requests_counted(served, "llm")
    result = aiperf(
        served, tmp_path,
        "--model", "llm", "--endpoint-type", "chat", "--streaming",
        "--prompt-output-tokens-mean", str(OUTPUT_TOKENS), "--use-server-token-count",
    )  # fmt: skip
    assert result["error_summary"] == []
    assert result["request_count"]["avg"] == REQUESTS
    assert result["output_sequence_length"]["min"] == OUTPUT_TOKENS
    assert result["output_sequence_length"]["max"] == OUTPUT_TOKENS
    assert result["time_to_first_token"]["count"] == REQUESTS
    assert requests_counted(served, "llm") - before == REQUESTS


def test_aiperf_embeddings(served: RunningFrontend, tmp_path: Path) -> None:
    before = requests_counted(served, "embed")
    result = aiperf(served, tmp_path, "--model", "embed", "--endpoint-type", "embeddings")
    assert result["error_summary"] == []
    assert result["request_count"]["avg"] == REQUESTS
    # One KServe request per input: AIPerf sends one input per call here.
    assert requests_counted(served, "embed") - before == REQUESTS
