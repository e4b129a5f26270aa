"""Token fairness on ``embed``: a tenant of 2,048-token requests against one of 32-token ones.

Both tenants are kept continuously backlogged by perf_analyzer (one process per tenant,
``--concurrency`` requests outstanding each: several batches' worth queued in the
frontend at all times). One Triton serves ``embed``; one frontend process per config
(``fair-frontend serve``, ``benchmarks.harness.frontend``), run one after the other:

- ``tokens``: cost = tokens, equal weights. Target: served tokens big / small = 1 +- 0.1.
- ``tokens_2to1``: cost = tokens, weights big 2 : small 1. Target: 2 +- 0.2.
- ``requests``: cost = requests (one unit per request) on the same traffic, equal
  weights: each tenant gets the same number of requests, so big gets about 64 times the
  tokens. The negative control: far from 1.

Served tokens come from the frontend's ``fair_served_tokens_total{tenant}``, scraped every
0.5 s; the ratio is taken over a window after a warm-up. Whether both tenants really were
backlogged is checked on the same scrapes: a tenant with queued work is in
``fair_drr_deficit`` (the DRR active list).

    .venv/bin/python -m benchmarks.bench_token_fairness [--warmup-s 10] [--window-s 30] [--quick]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    RESULTS,
    ROOT,
    frontend,
    load_example_config,
    load_generators,
    progress,
    triton,
    write_result,
)
from fair_frontend.kit import testing
from fair_frontend.kit.testing import perf_analyzer_binary

MODEL = "embed"
BIG, SMALL = "big", "small"
TOKENS = {BIG: 2048, SMALL: 32}
KEYS = {BIG: "big-fairness-key", SMALL: "small-fairness-key"}
# Outstanding requests per tenant: 8 x 2048 tokens = 4 full batches (max_batch_tokens
# 4096); 160 x 32-token rows = 5 full batches (max_batch_size 32).
CONCURRENCY = {BIG: 8, SMALL: 160}
SCRAPE_S = 0.5

CONFIGS: dict[str, dict[str, Any]] = {
    "tokens": {"cost": "tokens", "weights": {BIG: 1, SMALL: 1}, "target": (1.0, 0.1)},
    "tokens_2to1": {"cost": "tokens", "weights": {BIG: 2, SMALL: 1}, "target": (2.0, 0.2)},
    "requests": {"cost": "requests", "weights": {BIG: 1, SMALL: 1}, "target": None},
}


def bench_config(cost: str, weights: dict[str, float]) -> dict[str, Any]:
    cfg = load_example_config()
    cfg.pop("tier_limits", None)
    embed = cfg["endpoints"][MODEL]
    embed["cost"] = cost
    embed["throttle"] = False  # backlogged on purpose: nothing is turned away
    cfg["endpoints"] = {MODEL: embed}
    cfg["tenants"] = {
        t: {"tier": "standard", "weight": weights[t], "api_keys": [KEYS[t]]} for t in (BIG, SMALL)
    }
    return cfg


def scrape(url: str) -> dict[str, Any]:
    """Tokens served per tenant, and the tenants with queued work (a DRR deficit)."""
    page = testing.scrape(url, timeout=5)
    return {
        "tokens": page.by_label("fair_served_tokens_total", "tenant", endpoint=MODEL),
        "backlogged": sorted(page.label_values("fair_drr_deficit", "tenant", endpoint=MODEL)),
    }


def commands(grpc_url: str) -> dict[str, list[str]]:
    """One perf_analyzer per tenant, running until stopped (one long measurement window)."""
    return {
        tenant: [
            perf_analyzer_binary(),
            *("-m", MODEL, "--shape", f"INPUT_IDS:{TOKENS[tenant]}"),
            *("-u", grpc_url, "-i", "grpc"),
            *("--concurrency-range", f"{CONCURRENCY[tenant]}:{CONCURRENCY[tenant]}"),
            *("-H", f"authorization: Bearer {KEYS[tenant]}"),
            *("--measurement-interval", "600000", "--max-trials", "10"),
        ]
        for tenant in (BIG, SMALL)
    }


def run_config(
    name: str, spec: dict[str, Any], triton_url: str, warmup_s: float, window_s: float
) -> dict[str, Any]:
    cfg = bench_config(spec["cost"], spec["weights"])
    series: list[dict[str, Any]] = []
    with frontend(cfg, triton_url) as fe, tempfile.TemporaryDirectory() as tmp:
        metrics_url = f"http://127.0.0.1:{fe.metrics_port}/metrics"
        progress(
            f"{name}: cost={spec['cost']}, weights big:small = "
            f"{spec['weights'][BIG]}:{spec['weights'][SMALL]}"
        )
        with load_generators(commands(fe.grpc_url), Path(tmp)) as procs:
            start = time.monotonic()
            next_print = start + 5
            while (now := time.monotonic()) < start + warmup_s + window_s:
                for tenant, proc in procs.items():
                    if proc.poll() is not None:
                        log = Path(tmp) / f"{tenant}.log"
                        raise RuntimeError(
                            f"perf_analyzer exited early:\n{log.read_text()[-3000:]}"
                        )
                snap = scrape(metrics_url)
                series.append({"t": now - start, **snap})
                if now >= next_print:
                    tok = snap["tokens"]
                    progress(
                        f"  t={now - start:5.1f} s  served tokens big {tok.get(BIG, 0):>10,.0f}  "
                        f"small {tok.get(SMALL, 0):>10,.0f}  backlogged {snap['backlogged']}"
                    )
                    next_print += 5
                time.sleep(SCRAPE_S)
    return summarise(name, spec, series, warmup_s)


def summarise(
    name: str, spec: dict[str, Any], series: list[dict[str, Any]], warmup_s: float
) -> dict[str, Any]:
    window = [s for s in series if s["t"] >= warmup_s]
    first, last = window[0], window[-1]
    served = {t: last["tokens"].get(t, 0.0) - first["tokens"].get(t, 0.0) for t in (BIG, SMALL)}
    seconds = last["t"] - first["t"]
    ratio = served[BIG] / served[SMALL] if served[SMALL] else float("inf")
    both = sum(1 for s in window if {BIG, SMALL} <= set(s["backlogged"])) / len(window)
    target = spec["target"]
    verdict = None
    if target is not None:
        verdict = abs(ratio - target[0]) <= target[1]
    # Ratio over consecutive 5 s slices of the window: how steady fairness is.
    slices = []
    i = 0
    while i < len(window):
        j = i
        while j < len(window) and window[j]["t"] - window[i]["t"] < 5.0:
            j += 1
        if j >= len(window):
            break
        a, b = window[i]["tokens"], window[j]["tokens"]
        small = b.get(SMALL, 0) - a.get(SMALL, 0)
        if small > 0:
            slices.append((b.get(BIG, 0) - a.get(BIG, 0)) / small)
        i = j
    out = {
        "cost": spec["cost"],
        "weights": spec["weights"],
        "target": target,
        "window_s": seconds,
        "served_tokens": served,
        "tokens_per_s": {t: v / seconds for t, v in served.items()},
        "ratio_big_to_small": ratio,
        "within_target": verdict,
        "both_backlogged_fraction": both,
        "ratio_5s_slices": slices,
        "series": series,
    }
    progress(
        f"{name}: served tokens big/small = {ratio:.3f} over {seconds:.0f} s "
        f"(big {served[BIG]:,.0f}, small {served[SMALL]:,.0f}); both backlogged in "
        f"{both:.0%} of scrapes"
        + (
            ""
            if target is None
            else f"; target {target[0]} +- {target[1]}: {'met' if verdict else 'MISSED'}"
        )
    )
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["configs"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        res = results["configs"][name]
        t = [s["t"] for s in res["series"]]
        for tenant, color in ((BIG, "C0"), (SMALL, "C1")):
            y = [s["tokens"].get(tenant, 0.0) / 1e6 for s in res["series"]]
            label = f"{tenant} ({TOKENS[tenant]}-token requests, weight {res['weights'][tenant]})"
            ax.plot(t, y, color=color, label=label)
        ax.axvline(results["warmup_s"], color="k", ls=":", lw=0.8, label="window starts")
        ax.set_title(
            f"cost={res['cost']}, weights {res['weights'][BIG]}:{res['weights'][SMALL]}"
            f"\nserved tokens big/small = {res['ratio_big_to_small']:.2f}",
            fontsize=10,
        )
        ax.set_xlabel("seconds")
        ax.set_ylabel("cumulative served tokens (millions)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    progress(f"plot written to {path.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--quick", action="store_true", help="5 s warm-up, 10 s window")
    args = parser.parse_args()
    warmup_s, window_s = (5.0, 10.0) if args.quick else (args.warmup_s, args.window_s)
    results: dict[str, Any] = {
        "warmup_s": warmup_s,
        "window_s": window_s,
        "concurrency": CONCURRENCY,
        "tokens": TOKENS,
        "configs": {},
    }
    with triton(extra_args=["--model-control-mode=explicit", f"--load-model={MODEL}"]) as server:
        for name in args.configs:
            results["configs"][name] = run_config(
                name, CONFIGS[name], server.grpc_url, warmup_s, window_s
            )
    write_result("token_fairness", results)
    plot(results, RESULTS / "token_fairness.png")


if __name__ == "__main__":
    main()
