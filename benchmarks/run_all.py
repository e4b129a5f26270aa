"""Every benchmark, one after another (`make bench`), each in its own process.

They share these 2 cores with nothing else this way: run them when the machine is quiet.
Each writes its own ``benchmarks/results/<name>.json`` (and plots); this prints progress
and the wall time of each.

    .venv/bin/python -m benchmarks.run_all [--only NAME ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

BENCHMARKS = [
    "bench_scheduler",
    "bench_core",
    "bench_ratelimit",
    "bench_noisy_neighbour",
    "bench_token_fairness",
    "bench_fairness_time",
    "bench_throughput",
    "bench_scaling",
    "bench_streams",
    "bench_overload",
    "bench_feedback",
    "bench_engine",
    "bench_relay",
    "bench_generation_cost",
    "bench_hostile",
    "bench_door",
    "bench_core_capacity",
    "bench_slo",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", choices=BENCHMARKS, default=BENCHMARKS)
    args = parser.parse_args()
    failed = []
    for i, name in enumerate(args.only, 1):
        print(f"==> [{i}/{len(args.only)}] {name}", flush=True)
        started = time.monotonic()
        code = subprocess.call([sys.executable, "-m", f"benchmarks.{name}"])
        print(f"==> {name}: exit {code} after {time.monotonic() - started:.0f} s", flush=True)
        if code != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
