"""Streams as NVIDIA's AIPerf sees them: the time to first token, the inter-token latency and
the output tokens/s through the frontend, against Triton direct (issue 31).

One Triton (``llm``) and the frontend as its own process in front of it (``fair-frontend
serve``, one process, Triton's HTTP address given as ``up`` gives it, rate limits off),
each measured by AIPerf (``make setup`` installs it in ``.venv-aiperf``) as a user would
run it, in alternating rounds of one run:

- ``direct``: Triton's own ``/v2/models/llm/generate_stream`` (AIPerf's template
  endpoint: the text as ``text_input``, ``max_tokens`` and ``stream`` as parameters, the
  events' ``text_output`` read back);
- ``generate``: the same requests to the frontend's ``generate_stream`` (a tenant's key);
- ``chat``: the frontend's ``/v1/chat/completions`` with ``stream`` (AIPerf's chat
  endpoint), the same prompts and lengths.

Each at concurrency 1 and 32, 128 input tokens, 32 output tokens (``llm`` has no EOS: it
generates what is asked), tokens counted by AIPerf's tokenizer (``llm``'s own) for all
three alike. Reported per target and concurrency: TTFT, inter-token latency and request
latency (p50, p99) and output tokens/s (the medians over the rounds), and against
``direct``: TTFT and ITL added (ms, p50) and tokens/s as a ratio. The targets (issue 31):
TTFT added <= 1 ms p50, ITL added <= 0.2 ms p50, output tokens/s >= 0.98x. On these 2
CPUs AIPerf, the frontend and Triton share the cores (the issue's "frontend pinned to its
own CPU" needs more of them).

    .venv/bin/python -m benchmarks.bench_aiperf [--rounds 2] [--requests 40]

Results: ``benchmarks/results/aiperf.json`` and ``aiperf.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    RESULTS,
    ROOT,
    frontend,
    load_example_config,
    progress,
    triton,
    write_result,
)

AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
MODEL = "llm"
INPUT_TOKENS = 128
OUTPUT_TOKENS = 32
CONCURRENCIES = (1, 32)
TARGETS = ("direct", "generate", "chat")
KEY = "acme-demo-key"  # the example config's enterprise tenant
TEMPLATE = (
    '{"text_input": {{ text|tojson }}, "parameters": {"stream": true, '
    '"max_tokens": {{ max_tokens }}, "temperature": 0}}'
)
# AIPerf's metric tags, and the name each has here.
METRICS = {
    "time_to_first_token": "ttft_ms",
    "inter_token_latency": "itl_ms",
    "request_latency": "latency_ms",
}
RUN_TIMEOUT_S = 600


def hf_tokenizer(folder: Path) -> Path:
    """``llm``'s tokenizer as a Hugging Face folder (AIPerf loads one with transformers)."""
    folder.mkdir(parents=True, exist_ok=True)
    source = ROOT / "model_repository" / MODEL / "tokenizer.json"
    (folder / "tokenizer.json").write_bytes(source.read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def aiperf_command(
    target: str, url: str, tmp: Path, out: Path, concurrency: int, requests: int
) -> list[str]:
    cmd = [
        str(AIPERF), "profile",
        "--model", MODEL,
        "--tokenizer", str(tmp / "tokenizer"),
        "--streaming",
        "--concurrency", str(concurrency),
        "--request-count", str(requests),
        "--warmup-request-count", str(max(2, concurrency)),
        "--prompt-input-tokens-mean", str(INPUT_TOKENS),
        "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(OUTPUT_TOKENS),
        "--prompt-output-tokens-stddev", "0",
        "--random-seed", "1",
        "--output-artifact-dir", str(out),
        "--no-auto-plot",
    ]  # fmt: skip
    if target == "chat":
        return [*cmd, "--url", url, "--endpoint-type", "chat", "--api-key", KEY]
    path = f"/v2/models/{MODEL}/generate_stream"
    cmd += ["--url", url, "--endpoint-type", "template", "--custom-endpoint", path]
    # (a file: AIPerf's key:value form splits an inline template at its commas)
    cmd += ["--extra-inputs", f"payload_template:{tmp / 'template.json'}"]
    cmd += ["--extra-inputs", "response_field:text_output"]
    return [*cmd, "--api-key", KEY] if target != "direct" else cmd


def run_one(target: str, url: str, tmp: Path, concurrency: int, requests: int) -> dict[str, Any]:
    runs = tmp / "runs"
    out = runs / f"{target}-c{concurrency}-{len(list(runs.iterdir()))}"
    cmd = aiperf_command(target, url, tmp, out, concurrency, requests)
    done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed ({target}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    result = json.loads((out / "profile_export_aiperf.json").read_text())
    if result.get("error_summary"):
        raise RuntimeError(f"aiperf saw errors ({target}): {result['error_summary']}")
    got: dict[str, Any] = {
        "requests": result["request_count"]["avg"],
        "output_tokens_per_s": result["output_token_throughput"]["avg"],
        "output_tokens_mean": result["output_sequence_length"]["avg"],
    }
    for tag, name in METRICS.items():
        got[f"{name}_p50"] = result[tag]["p50"]
        got[f"{name}_p99"] = result[tag]["p99"]
    return got


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over the rounds, and the rounds themselves."""
    keys = rounds[0].keys()
    return {
        **{k: statistics.median(r[k] for r in rounds) for k in keys},
        "rounds": rounds,
    }


def compare(results: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Each frontend target against ``direct`` at the same concurrency."""
    out: dict[str, Any] = {}
    for c, by_target in results.items():
        direct = by_target["direct"]
        for target in TARGETS[1:]:
            got = by_target[target]
            out[f"{target}_c{c}"] = {
                "ttft_added_ms_p50": got["ttft_ms_p50"] - direct["ttft_ms_p50"],
                "itl_added_ms_p50": got["itl_ms_p50"] - direct["itl_ms_p50"],
                "tokens_per_s_ratio": got["output_tokens_per_s"] / direct["output_tokens_per_s"],
            }
    return out


def plot(results: dict[int, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = (("ttft_ms_p50", "TTFT p50 (ms)"), ("itl_ms_p50", "inter-token p50 (ms)"),
               ("output_tokens_per_s", "output tokens/s"))  # fmt: skip
    fig, axes = plt.subplots(1, len(figures), figsize=(13, 3.8))
    width = 0.8 / len(TARGETS)
    concurrencies = list(results)
    for ax, (key, label) in zip(axes, figures, strict=True):
        for i, target in enumerate(TARGETS):
            x = [k + (i - 1) * width for k in range(len(concurrencies))]
            ax.bar(x, [results[c][target][key] for c in concurrencies], width, label=target)
        ax.set_xticks(range(len(concurrencies)), [f"c={c}" for c in concurrencies])
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"AIPerf, {INPUT_TOKENS} tokens in, {OUTPUT_TOKENS} out: through the "
                 "frontend and Triton direct", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    progress(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds")
    parser.add_argument("--requests", type=int, default=40, help="per run at c=1 (x8 at c=32)")
    parser.add_argument("--json", default=str(RESULTS / "aiperf.json"))
    args = parser.parse_args()
    if not AIPERF.exists():
        raise SystemExit(f"{AIPERF} is missing: run `make setup`")
    data = load_example_config()
    data.pop("tier_limits", None)
    for tenant in data["tenants"].values():
        tenant.pop("limits", None)
    data["endpoints"] = {MODEL: data["endpoints"][MODEL]}
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {
        c: {t: [] for t in TARGETS} for c in CONCURRENCIES
    }
    extra = ["--model-control-mode=explicit", f"--load-model={MODEL}"]
    with (
        tempfile.TemporaryDirectory() as tmp_name,
        triton(extra_args=extra) as server,
        frontend(data, server.grpc_url, http_url=server.http_url) as fe,
    ):
        tmp = Path(tmp_name)
        hf_tokenizer(tmp / "tokenizer")
        (tmp / "template.json").write_text(TEMPLATE)
        direct = server.http_url if "://" in server.http_url else f"http://{server.http_url}"
        urls = {
            "direct": direct,
            "generate": f"http://{fe.http_url}",
            "chat": f"http://{fe.http_url}",
        }
        (tmp / "runs").mkdir()
        for r in range(args.rounds):
            for c in CONCURRENCIES:
                requests = args.requests * (8 if c > 1 else 1)
                order = TARGETS if r % 2 == 0 else tuple(reversed(TARGETS))
                for target in order:
                    got = run_one(target, urls[target], tmp, c, requests)
                    runs[c][target].append(got)
                    progress(
                        f"round {r + 1}, c={c}, {target:>8}: TTFT p50 {got['ttft_ms_p50']:7.2f} ms"
                        f", ITL p50 {got['itl_ms_p50']:6.3f} ms, "
                        f"{got['output_tokens_per_s']:8.1f} output tokens/s"
                    )
    results = {c: {t: summarise(runs[c][t]) for t in TARGETS} for c in CONCURRENCIES}
    verdict = compare(results)
    for name, v in verdict.items():
        progress(
            f"{name}: TTFT added {v['ttft_added_ms_p50']:+.2f} ms (target <= 1), ITL added "
            f"{v['itl_added_ms_p50']:+.3f} ms (<= 0.2), tokens/s {v['tokens_per_s_ratio']:.3f}x"
            " direct (>= 0.98)"
        )
    out = {
        "input_tokens": INPUT_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
        "rounds": args.rounds,
        "requests_c1": args.requests,
        "results": {str(c): v for c, v in results.items()},
        "against_direct": verdict,
    }
    path = Path(args.json)
    if path.parent == RESULTS:
        write_result(path.stem, out)
    else:
        path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    plot(results, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
