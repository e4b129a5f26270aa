"""How the transport scales with shell processes, when the frontend is the limit.

A trivial model (``simple`` from ``tests/model_repository``: sum and difference of two
INT32 [16] inputs, Triton's hello world, in the Python backend) makes the frontend, not
the model, the bottleneck. perf_analyzer's plain command (``-m simple``, concurrency 64 by
default, over several connections) against Triton directly and through the frontend with
1, 2 and 4 shell processes; throughput relative to one process, and the CPU of the core
and of the shells per request.

Where the machine has cores to spare (the target: >= 3x at 4 shells, on a host of 16
cores), the shells add throughput until the one core process or Triton is the limit. On a
machine of 2 cores, where perf_analyzer, Triton and the frontend share those 2, no number
of processes can add CPU: the figures there show the cost of the split, not its scaling.

    .venv/bin/python -m benchmarks.bench_scaling [--shells 1,2,4] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from benchmarks.bench_throughput import measure
from benchmarks.harness import (
    ROOT,
    frontend,
    load_example_config,
    progress,
    triton,
    write_result,
)
from fair_frontend.backends.triton.embedded import default_model_repository
from fair_frontend.kit.testing import perf_analyzer

MODEL = "simple"
KEY = "scaling-bench-key"
TEST_REPOSITORY = ROOT / "tests" / "model_repository"


def bench_config() -> dict[str, Any]:
    cfg = load_example_config()
    cfg.pop("tier_limits", None)
    cfg["default_endpoint"] = {"throttle": False}
    cfg["tenants"] = {"scaler": {"tier": "standard", "api_keys": [KEY], "max_queued": 100_000}}
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shells", default="1,2,4")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--interval-ms", type=int, default=5000)
    args = parser.parse_args()
    counts = [int(n) for n in args.shells.split(",")]
    c, iv = args.concurrency, args.interval_ms
    out: dict[str, Any] = {
        "model": MODEL,
        "concurrency": c,
        "cpus": len(os.sched_getaffinity(0)),
        "runs": {},
    }
    repos: list[Path] = [default_model_repository(), TEST_REPOSITORY]
    with triton(repos) as tri:
        progress("Triton directly")
        perf_analyzer(MODEL, tri.grpc_url, concurrency=c, interval_ms=1500)
        out["direct"] = perf_analyzer(MODEL, tri.grpc_url, concurrency=c, interval_ms=iv)
        progress(f"  {out['direct']['throughput']:.0f} infer/s")
        for n in counts:
            with frontend(bench_config(), tri.grpc_url, workers=n, http_url=tri.http_url) as fe:
                headers = [f"authorization: Bearer {KEY}"]
                perf_analyzer(MODEL, fe.grpc_url, concurrency=c, headers=headers, interval_ms=1500)
                progress(f"{n} shell(s): perf_analyzer, concurrency {c}")
                url = fe.grpc_url
                r = measure(
                    lambda: perf_analyzer(
                        MODEL,
                        url,  # noqa: B023 (called at once, in this iteration)
                        concurrency=c,
                        headers=headers,  # noqa: B023
                        interval_ms=iv,
                    ),
                    fe,
                )
                out["runs"][str(n)] = r
                progress(
                    f"  {r['throughput']:.0f} infer/s; CPU per request: core "
                    f"{r['core_cpu_us_per_request']:.0f} us, shells "
                    f"{r['shells_cpu_us_per_request']:.0f} us"
                )
    one = out["runs"][str(counts[0])]["throughput"]
    print()
    direct = out["direct"]["throughput"]
    print(f"{MODEL}, perf_analyzer c={c}, {out['cpus']} CPUs; Triton direct {direct:.0f}/s")
    print(f"{'shells':>6} {'infer/s':>9} {'vs 1':>6} {'core us/req':>12} {'shells us/req':>14}")
    for n, r in out["runs"].items():
        r["speedup"] = r["throughput"] / one
        print(
            f"{n:>6} {r['throughput']:>9.0f} {r['speedup']:>6.2f} "
            f"{r['core_cpu_us_per_request']:>12.0f} {r['shells_cpu_us_per_request']:>14.0f}"
        )
    write_result("scaling", out)


if __name__ == "__main__":
    main()
