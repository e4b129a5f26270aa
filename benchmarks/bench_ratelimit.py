"""The cost of one rate-limit check, ``memory://`` against ``redis://``, in the same run.

One check = one request subject to two limits (requests per second AND tokens per day),
checked and counted atomically, as the frontend does on every request. Limits are set high
so every check is admitted and counted (the common path). Keys are spread over 100 tenants.

Measured per storage: sequential checks (one at a time) and 16 concurrent checkers on one
event loop; mean, p50 and p99 latency of a check in microseconds, and checks per second.
Baselines in the same run: a no-op through the same measuring loop (its overhead), and a
bare Redis PING on the same client (what the Lua script adds to a round trip). And Redis's
own time per check (``INFO commandstats``), which bounds the checks/s one Redis can serve.
Redis is a ``redis-server`` of this benchmark's own, on a free port, stopped at the end.

    .venv/bin/python -m benchmarks.bench_ratelimit [--quick]

Results: ``benchmarks/results/ratelimit.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis

from fair_frontend.admission import (
    MemoryStorage,
    RateLimiter,
    RateLimitItem,
    RedisStorage,
    limit_key,
)

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "ratelimit.json"
ITEMS = [
    RateLimitItem("requests", "second", 10**9, 1.0),
    RateLimitItem("tokens", "day", 10**15, 86400.0),
]
KEYS = [limit_key(f"tenant{i}", "embed") for i in range(100)]
CONCURRENCY = 16


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis() -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 10
    while True:  # poll PING: ready when it answers
        try:
            if client.ping():
                break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("redis-server did not start") from None
            time.sleep(0.01)
    client.close()
    return proc, port


def summary(samples_ns: list[int], wall_s: float) -> dict[str, float]:
    us = sorted(s / 1000 for s in samples_ns)
    return {
        "checks": len(us),
        "mean_us": round(statistics.fmean(us), 2),
        "p50_us": round(us[len(us) // 2], 2),
        "p99_us": round(us[min(len(us) - 1, int(len(us) * 0.99))], 2),
        "checks_per_s": round(len(us) / wall_s),
    }


async def measure(
    op: Callable[[int], Awaitable[object]], n: int, concurrency: int
) -> dict[str, float]:
    """Latency of ``op`` over ``n`` calls made by ``concurrency`` tasks on one loop."""
    for i in range(min(n // 10, 2000)):  # warm-up: connections, script cache, windows
        await op(i)
    samples: list[int] = []
    clock = time.perf_counter_ns

    async def worker(start: int) -> None:
        for i in range(start, n, concurrency):
            t = clock()
            await op(i)
            samples.append(clock() - t)

    wall = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return summary(samples, time.perf_counter() - wall)


def check_op(limiter: RateLimiter) -> Callable[[int], Awaitable[object]]:
    async def op(i: int) -> object:
        d = await limiter.check(KEYS[i % len(KEYS)], ITEMS, requests=1, tokens=64, now=time.time())
        assert d.allowed and not d.degraded, d
        return d

    return op


async def run(quick: bool) -> dict[str, Any]:
    n_memory = 20_000 if quick else 200_000
    n_redis = 2_000 if quick else 20_000
    results: dict[str, Any] = {}

    async def noop(i: int) -> object:
        return time.time()

    for conc in (1, CONCURRENCY):
        progress(f"harness overhead (no-op op), concurrency {conc:>2}: {n_memory}")
        results[f"noop_c{conc}"] = r = await measure(noop, n_memory, conc)
        progress(f"  mean {r['mean_us']} us, p99 {r['p99_us']} us")

    memory = RateLimiter(MemoryStorage(), on_storage_error="fail_closed")
    for conc in (1, CONCURRENCY):
        progress(f"memory://  concurrency {conc:>2}: {n_memory} checks")
        results[f"memory_c{conc}"] = r = await measure(check_op(memory), n_memory, conc)
        progress(f"  mean {r['mean_us']} us, p99 {r['p99_us']} us, {r['checks_per_s']}/s")

    proc, port = start_redis()
    progress(f"redis-server on 127.0.0.1:{port}")
    try:
        # Generous timeout: measure the cost, not the failure mode.
        storage = RedisStorage(f"redis://127.0.0.1:{port}/0", timeout_s=2.0)
        limiter = RateLimiter(storage, on_storage_error="fail_closed")
        client = storage._client

        async def ping(i: int) -> object:
            return await client.ping()

        await client.config_resetstat()
        for conc in (1, CONCURRENCY):
            progress(f"redis://   PING baseline, concurrency {conc:>2}: {n_redis}")
            results[f"redis_ping_c{conc}"] = r = await measure(ping, n_redis, conc)
            progress(f"  mean {r['mean_us']} us, p99 {r['p99_us']} us, {r['checks_per_s']}/s")
            progress(f"redis://   concurrency {conc:>2}: {n_redis} checks")
            results[f"redis_c{conc}"] = r = await measure(check_op(limiter), n_redis, conc)
            progress(f"  mean {r['mean_us']} us, p99 {r['p99_us']} us, {r['checks_per_s']}/s")
        # Redis's own time per check (the script), which bounds what one Redis serves
        # for all replicas together: 1e6 / this = checks per second.
        stats = await client.info("commandstats")
        server_us = stats["cmdstat_evalsha"]["usec_per_call"]
        results["redis_server_us_per_check"] = server_us
        results["redis_server_us_per_ping"] = stats["cmdstat_ping"]["usec_per_call"]
        progress(f"redis-server time per check (EVALSHA): {server_us} us")
        await limiter.close()
    finally:
        proc.terminate()
        proc.wait(10)

    for conc in (1, CONCURRENCY):
        results[f"ratio_redis_to_memory_c{conc}"] = round(
            results[f"redis_c{conc}"]["mean_us"] / results[f"memory_c{conc}"]["mean_us"], 1
        )
        results[f"ratio_check_to_ping_c{conc}"] = round(
            results[f"redis_c{conc}"]["mean_us"] / results[f"redis_ping_c{conc}"]["mean_us"], 2
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10x fewer checks (a smoke run)")
    args = parser.parse_args()
    results = asyncio.run(run(args.quick))
    out = {
        "benchmark": "ratelimit",
        "command": ".venv/bin/python -m benchmarks.bench_ratelimit"
        + (" --quick" if args.quick else ""),
        "limits": [f"{it}" for it in ITEMS],
        "tenants": len(KEYS),
        "machine": {
            "python": platform.python_version(),
            "cpus": len(__import__("os").sched_getaffinity(0)),
            "redis": subprocess.run(
                ["redis-server", "--version"], capture_output=True, text=True
            ).stdout.split()[2],
        },
        "results": results,
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(out, indent=2) + "\n")
    progress(f"results written to {RESULT.relative_to(ROOT)}")
    for key in sorted(k for k in results if k.startswith("ratio")):
        progress(f"{key}: {results[key]}")


if __name__ == "__main__":
    main()
