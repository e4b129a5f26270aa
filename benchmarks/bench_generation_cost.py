"""Normalised cost on batched generation: should it be the default for ``generate``?

``generate`` is a request-cost endpoint whose batches the frontend builds: plain request
cost charges a request asking 128 new tokens what it charges one asking 16.
``normalize_cost`` charges each request its predicted service seconds instead (the
batch-time model's marginal seconds of a request over the EMA of seconds per row).

Two tenants kept backlogged by perf_analyzer's plain command (one process each, 32-token
prompts, ``--request-parameter max_tokens:N:int``): ``long`` asks 128 tokens, ``short``
16. One Triton; one frontend process per config, one after the other:
``normalized`` (``normalize_cost: true``) and ``plain`` (``false``, the default).

Measured over a window after a warm-up: requests served per tenant (the frontend's
``fair_served_rows_total``) and the tokens the decoder produced for each (the model's
own ``fair_model_tokens_total{model="generate"}``: prompt + generated). What decides:
whether normalisation changes who is served. (Finding, see benchmarks/README.md: it does
not: a batch runs as many decode steps as its longest row, so in the mixed batches DRR
builds a short row occupies the decoder as long as a long one, the learned per-token
cost is ~0 and both configs serve equal requests. Engine mode, where rows leave when
done, is where output length is charged: by the tokens actually produced.)

    .venv/bin/python -m benchmarks.bench_generation_cost [--warmup-s 15] [--window-s 30]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    frontend,
    load_example_config,
    load_generators,
    progress,
    triton,
    write_result,
)
from fair_frontend.kit import testing
from fair_frontend.kit.testing import perf_analyzer_binary

MODEL = "generate"
LONG, SHORT = "long", "short"
MAX_TOKENS = {LONG: 128, SHORT: 16}
KEYS = {LONG: "long-generation-key", SHORT: "short-generation-key"}
CONCURRENCY = 16  # per tenant: two full batches of 8 outstanding
CONFIGS = {"normalized": True, "plain": False}


def bench_config(normalize: bool) -> dict[str, Any]:
    cfg = load_example_config()
    cfg.pop("tier_limits", None)
    gen = cfg["endpoints"][MODEL]
    gen["throttle"] = False  # backlogged on purpose
    gen["normalize_cost"] = normalize
    cfg["endpoints"] = {MODEL: gen}
    cfg["tenants"] = {t: {"tier": "standard", "api_keys": [KEYS[t]]} for t in (LONG, SHORT)}
    return cfg


def scrape(url: str, name: str, label: str, model: str) -> dict[str, float]:
    """``name`` per tenant, of the samples whose ``label`` is ``model``."""
    return testing.scrape(url, timeout=5).by_label(name, "tenant", **{label: model})


def commands(grpc_url: str) -> dict[str, list[str]]:
    """perf_analyzer's plain command per tenant (its own max_tokens as a parameter)."""
    return {
        tenant: [
            perf_analyzer_binary(),
            *("-m", MODEL, "--shape", "INPUT_IDS:32"),
            *("-u", grpc_url, "-i", "grpc"),
            *("--request-parameter", f"max_tokens:{MAX_TOKENS[tenant]}:int"),
            *("--concurrency-range", f"{CONCURRENCY}:{CONCURRENCY}"),
            *("-H", f"authorization: Bearer {KEYS[tenant]}"),
            *("--measurement-interval", "600000", "--max-trials", "10"),
        ]
        for tenant in (LONG, SHORT)
    }


def run_config(
    name: str, normalize: bool, server: Any, warmup_s: float, window_s: float
) -> dict[str, Any]:
    progress(f"{name}: normalize_cost={normalize}")
    with (
        frontend(bench_config(normalize), server.grpc_url, http_url=server.http_url) as fe,
        tempfile.TemporaryDirectory() as tmp,
        load_generators(commands(fe.grpc_url), Path(tmp)) as procs,
    ):
        fe_metrics = f"http://127.0.0.1:{fe.metrics_port}/metrics"
        time.sleep(warmup_s)
        for proc in procs.values():
            if proc.poll() is not None:
                raise RuntimeError(f"perf_analyzer exited early: see {tmp}")
        t0 = scrape(server.metrics_url, "fair_model_tokens_total", "model", MODEL)
        r0 = scrape(fe_metrics, "fair_served_rows_total", "endpoint", MODEL)
        for i in range(int(window_s // 5)):
            time.sleep(5)
            progress(f"  {5 * (i + 1)} s of {window_s:.0f}")
        t1 = scrape(server.metrics_url, "fair_model_tokens_total", "model", MODEL)
        r1 = scrape(fe_metrics, "fair_served_rows_total", "endpoint", MODEL)
    tokens = {t: t1.get(t, 0.0) - t0.get(t, 0.0) for t in (LONG, SHORT)}
    requests = {t: r1.get(t, 0.0) - r0.get(t, 0.0) for t in (LONG, SHORT)}
    share = tokens[LONG] / sum(tokens.values())
    progress(
        f"  tokens computed long/short = {tokens[LONG]:,.0f} / {tokens[SHORT]:,.0f} "
        f"(long's share {share:.3f}); requests {requests[LONG]:,.0f} / {requests[SHORT]:,.0f}"
    )
    return {"tokens": tokens, "requests": requests, "long_share_of_tokens": share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--window-s", type=float, default=30.0)
    args = parser.parse_args()
    results: dict[str, Any] = {"warmup_s": args.warmup_s, "window_s": args.window_s}
    with triton() as server:
        for name, normalize in CONFIGS.items():
            results[name] = run_config(name, normalize, server, args.warmup_s, args.window_s)
    write_result("generation_cost", results)


if __name__ == "__main__":
    main()
