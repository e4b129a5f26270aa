"""The scheduling core's cost per request and memory per queued request.

Decision cost: one request's ``enqueue`` plus its share of ``next_batch`` (batches of 32
rows, request cost), with 10, 1,000 and 10,000 tenants in one tier, every tenant
backlogged (4 requests each) throughout: each step enqueues 32 requests, continuing round
the tenants in the order DRR serves them, and dispatches one batch of 32. Request objects
are built before the clock starts (the shell builds them); ``now`` is a plain float. A run
is 300 steps (9,600 requests), timed with ``time.perf_counter`` (wall clock) and, beside
it, ``time.thread_time`` (this thread's CPU time: what other processes on a shared
machine cannot inflate). Each configuration runs ``--repeats`` times (25), the repeats
going round the tenant counts so that load from neighbours falls on all of them alike;
best and median microseconds per request are reported, and the ratios 10,000 / 10
tenants from the same run. Variants: fair mode with a deadline on every request (the
deadline heap), and fifo mode (the baseline).

Memory: tracemalloc growth while 100,000 requests (bare QueuedRequests, 1,000 tenants) are built
and queued, divided by 100,000; and the resident set size growth of the same, from
``/proc/self/statm``. With and without deadlines.

    .venv/bin/python -m benchmarks.bench_scheduler [--quick]

Results: ``benchmarks/results/scheduler.json``; figures in ``benchmarks/README.md``.
Targets: <= 10 us per request at 10,000 tenants, 10k/10 ratio <= 1.5, <= 2 KB per request.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

from fair_frontend.scheduler import (
    EndpointPolicy,
    GlobalCaps,
    Mode,
    QueuedRequest,
    Scheduler,
    TenantSpec,
)
from fair_frontend.scheduler.cost import CostUnit

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "scheduler.json"
TENANT_COUNTS = (10, 1_000, 10_000)
BATCH = 32
BACKLOG = 4  # queued requests per tenant, kept constant
MEMORY_REQUESTS = 100_000
MEMORY_TENANTS = 1_000


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def build(tenants: int, mode: Mode) -> tuple[Scheduler, list[str]]:
    policy = EndpointPolicy(CostUnit.REQUESTS, BATCH, None, 1.0, ("paid", "trial"))
    names = [f"tenant{i:05d}" for i in range(tenants)]
    directory = {name: TenantSpec("paid", max_queued=10**6) for name in names}
    s = Scheduler(policy, directory, GlobalCaps(10**9, 1 << 50), mode=mode)
    return s, names


def request(tenant: str, deadline: float | None) -> QueuedRequest:
    return QueuedRequest(tenant, 1, 16, 256, 1, deadline)


def decision_cost(tenants: int, mode: Mode, deadlines: bool, steps: int) -> tuple[float, float]:
    """Seconds per request (enqueue + dispatch) over ``steps`` steps of one batch each:
    wall-clock (``perf_counter``) and this thread's CPU time (``thread_time``)."""
    s, names = build(tenants, mode)
    far = 1e12 if deadlines else None
    for _ in range(BACKLOG):
        for name in names:
            s.enqueue(request(name, far), 0.0)
    # Warm-up: one full rotation, so every tenant has had a turn (steady state).
    cursor = 0
    for _ in range(max(1, tenants // BATCH)):
        for _ in range(BATCH):
            s.enqueue(request(names[cursor], far), 0.0)
            cursor = (cursor + 1) % tenants
        s.next_batch(0.0)
    todo = []
    for _ in range(steps * BATCH):
        todo.append(request(names[cursor], far))
        cursor = (cursor + 1) % tenants
    enqueue = s.enqueue
    next_batch = s.next_batch
    gc.collect()
    i = 0
    start = time.perf_counter()
    cpu_start = time.thread_time()
    for step in range(steps):
        now = float(step)
        for j in range(i, i + BATCH):
            enqueue(todo[j], now)
        i += BATCH
        if len(next_batch(now)) != BATCH:
            raise AssertionError("a batch was not full: some tenant ran dry")
    cpu = time.thread_time() - cpu_start
    elapsed = time.perf_counter() - start
    if s.queued_requests != tenants * BACKLOG:
        raise AssertionError("the backlog changed during the run")
    return elapsed / (steps * BATCH), cpu / (steps * BATCH)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_per_request(deadlines: bool) -> dict[str, float]:
    s, names = build(MEMORY_TENANTS, "fair")
    # Create every tenant's queue first: per-tenant structures are not per-request cost.
    for name in names:
        s.enqueue(request(name, None), 0.0)
    gc.collect()
    rss_before = rss_bytes()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    kept = []  # the shell holds its requests too; keep them alive either way
    for i in range(MEMORY_REQUESTS):
        r = request(names[i % MEMORY_TENANTS], 1e12 + i if deadlines else None)
        s.enqueue(r, float(i))
        kept.append(r)
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # The list that keeps the requests alive is the benchmark's, not the scheduler's.
    traced = current - base - sys.getsizeof(kept)
    gc.collect()
    rss = rss_bytes() - rss_before - sys.getsizeof(kept)
    return {
        "tracemalloc_bytes_per_request": traced / MEMORY_REQUESTS,
        "rss_bytes_per_request": rss / MEMORY_REQUESTS,
        "request_object_bytes": float(sys.getsizeof(kept[0])),
    }


def summarise(runs: list[float]) -> dict[str, float]:
    return {"best": min(runs), "median": statistics.median(runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    steps = 300  # about 10,000 requests per run: short runs find the machine's quiet moments
    repeats = args.repeats or (5 if args.quick else 25)

    variants: list[tuple[Mode, bool]] = [("fair", False), ("fair", True), ("fifo", False)]
    rows: list[dict[str, Any]] = []
    for mode, deadlines in variants:
        label = f"{mode}{' +deadlines' if deadlines else ''}"
        progress(f"decision cost: {label}, {repeats} x {steps * BATCH} requests per tenant count")
        # Repeats go round the tenant counts, so that load from other processes on the
        # machine spreads over all of them alike and the ratio stays meaningful.
        wall: dict[int, list[float]] = {n: [] for n in TENANT_COUNTS}
        cpu: dict[int, list[float]] = {n: [] for n in TENANT_COUNTS}
        for _ in range(repeats):
            for tenants in TENANT_COUNTS:
                w, c = decision_cost(tenants, mode, deadlines, steps)
                wall[tenants].append(w * 1e6)
                cpu[tenants].append(c * 1e6)
        for tenants in TENANT_COUNTS:
            rows.append(
                {
                    "mode": mode,
                    "deadlines": deadlines,
                    "tenants": tenants,
                    "wall_us": summarise(wall[tenants]),
                    "cpu_us": summarise(cpu[tenants]),
                    "wall_runs_us": wall[tenants],
                }
            )
            progress(
                f"  {tenants:>6} tenants: wall best {min(wall[tenants]):.2f} us, "
                f"median {statistics.median(wall[tenants]):.2f} us; "
                f"cpu best {min(cpu[tenants]):.2f} us"
            )

    def cell(mode: str, deadlines: bool, tenants: int, clock: str, stat: str) -> float:
        for row in rows:
            if (row["mode"], row["deadlines"], row["tenants"]) == (mode, deadlines, tenants):
                return float(row[clock][stat])
        raise KeyError((mode, deadlines, tenants))

    ratios = {
        f"{mode}{'+deadlines' if deadlines else ''} {clock} {stat}": (
            cell(mode, deadlines, 10_000, clock, stat) / cell(mode, deadlines, 10, clock, stat)
        )
        for mode, deadlines in variants
        for clock in ("wall_us", "cpu_us")
        for stat in ("best", "median")
    }

    memory = {}
    for deadlines in (False, True):
        progress(f"memory: {MEMORY_REQUESTS} queued requests, deadlines={deadlines}")
        memory["with_deadline" if deadlines else "no_deadline"] = memory_per_request(deadlines)

    print()
    print("us per request (enqueue + dispatch), batches of 32, every tenant backlogged")
    print(
        f"{'variant':<16}{'tenants':>8}{'wall best':>11}{'wall median':>13}"
        f"{'cpu best':>10}{'cpu median':>12}"
    )
    for row in rows:
        variant = row["mode"] + (" +deadlines" if row["deadlines"] else "")
        print(
            f"{variant:<16}{row['tenants']:>8}"
            f"{row['wall_us']['best']:>11.2f}{row['wall_us']['median']:>13.2f}"
            f"{row['cpu_us']['best']:>10.2f}{row['cpu_us']['median']:>12.2f}"
        )
    print()
    for name, ratio in ratios.items():
        print(f"ratio 10,000 / 10 tenants, {name}: {ratio:.2f}")
    for name, m in memory.items():
        print(
            f"memory per queued request, {name}: {m['tracemalloc_bytes_per_request']:.0f} B "
            f"(tracemalloc), {m['rss_bytes_per_request']:.0f} B (RSS); "
            f"the request object itself: {m['request_object_bytes']:.0f} B"
        )

    result = {
        "benchmark": "scheduler",
        "command": ".venv/bin/python -m benchmarks.bench_scheduler"
        + (" --quick" if args.quick else ""),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
        },
        "setup": {
            "batch_rows": BATCH,
            "backlog_per_tenant": BACKLOG,
            "steps_per_run": steps,
            "requests_per_run": steps * BATCH,
            "repeats": repeats,
            "cost": "requests",
            "memory_requests": MEMORY_REQUESTS,
            "memory_tenants": MEMORY_TENANTS,
        },
        "decision_cost": rows,
        "ratio_10k_over_10": ratios,
        "memory": memory,
        "targets": {
            "us_per_request_at_10k": {
                "target": 10.0,
                "wall_best": cell("fair", False, 10_000, "wall_us", "best"),
                "wall_median": cell("fair", False, 10_000, "wall_us", "median"),
            },
            "ratio_10k_over_10": {
                "target": 1.5,
                "wall_best": ratios["fair wall_us best"],
                "cpu_best": ratios["fair cpu_us best"],
            },
            "bytes_per_request": {
                "target": 2048,
                "tracemalloc_with_deadline": memory["with_deadline"][
                    "tracemalloc_bytes_per_request"
                ],
            },
        },
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    progress(f"results written to {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
