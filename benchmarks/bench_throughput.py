"""Throughput and latency: perf_analyzer against Triton directly and through the frontend.

One run, one Triton (its dynamic batcher on, as a Triton user runs it), ``embed`` over
gRPC with 128-token requests: perf_analyzer's plain command (``--shape INPUT_IDS:128``,
random ids, no data file), as users run it:

1. concurrency 1 and 16, direct vs the frontend (fair mode): throughput ratio and p50
   latency difference;
2. work conservation: two tenants each driven by its own perf_analyzer (concurrency 8
   each) at the same time, through the frontend in ``fair`` and in ``fifo`` mode: total
   throughput of fair over fifo (target >= 0.97).

    .venv/bin/python -m benchmarks.bench_throughput [--interval-ms 5000]
"""

from __future__ import annotations

import argparse
import concurrent.futures
from typing import Any

from benchmarks.harness import (
    frontend,
    load_example_config,
    perf_analyzer,
    progress,
    triton,
    write_result,
)

MODEL = "embed"
WARMUP_MS = 1500
TOKENS = 128
KEYS = {"alpha": "alpha-bench-key", "beta": "beta-bench-key"}


def bench_config(mode: str) -> dict[str, Any]:
    cfg = load_example_config()
    cfg.pop("tier_limits", None)
    cfg["scheduling"] = mode
    cfg["tenants"] = {name: {"tier": "standard", "api_keys": [key]} for name, key in KEYS.items()}
    return cfg


def run_pa(url: str, concurrency: int, key: str | None, interval_ms: int) -> dict[str, float]:
    headers = [f"authorization: Bearer {key}"] if key else []
    return perf_analyzer(
        MODEL,
        url,
        concurrency=concurrency,
        shapes=[f"INPUT_IDS:{TOKENS}"],
        headers=headers,
        interval_ms=interval_ms,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interval-ms", type=int, default=5000)
    args = parser.parse_args()
    iv = args.interval_ms
    out: dict[str, Any] = {"model": MODEL, "tokens": TOKENS, "interval_ms": iv}
    with triton() as tri:
        progress("warm-up, direct")
        run_pa(tri.grpc_url, 16, None, WARMUP_MS)
        direct: dict[int, dict[str, float]] = {}
        for c in (1, 16):
            progress(f"perf_analyzer direct, concurrency {c}")
            direct[c] = run_pa(tri.grpc_url, c, None, iv)
            progress(f"  {direct[c]['throughput']:.1f} infer/s, p50 {direct[c]['p50_ms']:.1f} ms")
        with frontend(bench_config("fair"), tri.grpc_url) as fe:
            progress("warm-up, through the frontend")
            run_pa(fe.grpc_url, 16, KEYS["alpha"], WARMUP_MS)
            through: dict[int, dict[str, float]] = {}
            for c in (1, 16):
                progress(f"perf_analyzer through the frontend (fair), concurrency {c}")
                through[c] = run_pa(fe.grpc_url, c, KEYS["alpha"], iv)
                progress(
                    f"  {through[c]['throughput']:.1f} infer/s, p50 {through[c]['p50_ms']:.1f} ms"
                )
        # Work conservation: fair and fifo alternate (fifo first, then fair first), each
        # frontend warmed up first, so neither gains from going second.
        results: dict[str, Any] = {"fair": [], "fifo": []}
        for order in (("fifo", "fair"), ("fair", "fifo")):
            for mode in order:
                with frontend(bench_config(mode), tri.grpc_url) as fe:
                    run_pa(fe.grpc_url, 16, KEYS["alpha"], WARMUP_MS)
                    progress(f"two tenants at once through the frontend ({mode}), 8 + 8")
                    with concurrent.futures.ThreadPoolExecutor(2) as pool:
                        futs = {
                            t: pool.submit(run_pa, fe.grpc_url, 8, key, iv)
                            for t, key in KEYS.items()
                        }
                        per_tenant = {t: f.result() for t, f in futs.items()}
                    total = sum(r["throughput"] for r in per_tenant.values())
                    results[mode].append({"per_tenant": per_tenant, "total_throughput": total})
                    progress(f"  total {total:.1f} infer/s")
    out["direct"] = direct
    out["frontend"] = through
    out["two_tenants"] = results
    for c in (1, 16):
        out[f"ratio_c{c}"] = through[c]["throughput"] / direct[c]["throughput"]
        out[f"p50_diff_ms_c{c}"] = through[c]["p50_ms"] - direct[c]["p50_ms"]
    totals = {m: sum(r["total_throughput"] for r in runs) for m, runs in results.items()}
    out["fair_over_fifo"] = totals["fair"] / totals["fifo"]
    print()
    print(f"embed, gRPC, {TOKENS}-token requests, measurement windows of {iv} ms")
    print(
        f"{'':<6} {'direct':>12} {'frontend':>12} {'ratio':>7} {'p50 direct':>11} "
        f"{'p50 frontend':>13} {'p50 diff':>9}"
    )
    for c in (1, 16):
        d, f = direct[c], through[c]
        print(
            f"c={c:<4} {d['throughput']:>10.1f}/s {f['throughput']:>10.1f}/s "
            f"{out[f'ratio_c{c}']:>7.2f} {d['p50_ms']:>9.1f}ms {f['p50_ms']:>11.1f}ms "
            f"{out[f'p50_diff_ms_c{c}']:>+7.1f}ms"
        )
    print(
        f"work conservation (two tenants, 8+8, two rounds each): fair {totals['fair'] / 2:.1f}/s, "
        f"fifo {totals['fifo'] / 2:.1f}/s, fair/fifo {out['fair_over_fifo']:.3f}"
    )
    write_result("throughput", out)


if __name__ == "__main__":
    main()
