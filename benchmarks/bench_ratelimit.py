"""Rate limits under load: what a check costs, batched and one at a time, and whether a burst
keeps its limit, before and after (issue 17), all in one run.

**cost** (``--part cost``). One check = one request subject to two limits (requests per
second AND tokens per day), checked and counted atomically, admitted (limits set high: the
common path), keys spread over 100 tenants.

- ``RateLimiter.check`` with ``memory://`` and ``redis://``, 1 and 16 concurrent checkers
  on one event loop; baselines: a no-op through the same measuring loop, and a bare Redis
  ``PING`` (on a client of its own); and Redis's own time per check (``INFO
  commandstats``), which bounds the checks/s one Redis serves.
- **Batched against one at a time**: the storage's check (``acquire``) at 1, 16 and 300
  concurrent checkers, with this tree's ``RedisStorage`` (the checks of one loop turn share
  one pipelined round trip, on a thread and connection of its own) and the ``RedisStorage``
  of ``--ref`` (default f324058: one EVALSHA per check, on a pool of 64 connections, all
  on the event loop). Latency of a check (p50, p99), checks/s, round trips per check.
  A generous timeout (2 s): this measures the cost, not the failure mode.

**burst** (``--part burst``): 3,000 requests at concurrency 300 against a limit of 100 a
minute, on Redis, with the shipped settings (``fail_open``, ``timeout_ms: 50``):

- *in process*: the limiter alone (``--ref``'s limiter and storage, then this tree's),
  3,000 checks on one event loop;
- *through the frontend*: a real Triton (``embed``), one ``fair-frontend serve`` (the
  ``--ref`` checkout, then this tree; ``--workers`` shells), one tenant, a burst of 3,000
  gRPC ``ModelInfer`` at concurrency 300 from this process. Counted: admitted, 429, other;
  the frontend's ``fair_rate_limit_storage_errors_total``; Redis's own count for the key.

Each burst runs twice: *plain*, and with the event loop **stalled**: a CPU hog on the loop
(150 ms busy after each 50 ms of running: ``--stall-ms``, ``--stall-every-ms``; in the
frontend the core's loop, added by a wrapper that starts the same CLI with the hog on its
loop, for both versions alike). That is the loop lag the issue allows to make the old
failure show; Redis is healthy throughout and answers well within its timeout.

**quota** (``--part quota``, issue 20): what reading each limit's state after the check
(remaining, reset) and picking the binding windows (``Decision.quota``) costs, against
``--quota-ref`` (default eb4bdce, the commit before), in one run, reps interleaved:

- ``RateLimiter.check_now`` on ``memory://`` (the hot path: most requests are admitted
  without an await), the same two limits, admitted;
- Redis's own time per check (the script, ``INFO commandstats``), and a check's latency,
  at concurrency 16, each storage on its own keys;
- what a quota adds downstream: ``quota_headers`` per answer, and an ``Answer`` framed and
  read back with and without one.

    .venv/bin/python -m benchmarks.bench_ratelimit [--quick] [--part cost|burst|quota]
        [--ref f324058] [--quota-ref eb4bdce] [--workers 1,2]

Results: ``benchmarks/results/ratelimit.json`` (``ratelimit_quick.json`` for ``--quick``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import redis
import redis.asyncio as aioredis
import yaml
from tritonclient.grpc import service_pb2, service_pb2_grpc

from benchmarks.harness import (
    ROOT,
    baseline_checkout,
    progress,
    triton,
    wait_http_ready,
    write_result,
)
from fair_frontend.admission import (
    MemoryStorage,
    RateLimiter,
    RateLimitItem,
    RedisStorage,
    limit_key,
)
from fair_frontend.backends.triton.embedded import free_port
from fair_frontend.config import resolve_relative_paths
from fair_frontend.kit import testing
from fair_frontend.protocol import Tensor
from fair_frontend.quota import Quota, QuotaWindow, quota_headers
from fair_frontend.wire.framing import encode, to_shell
from fair_frontend.wire.records import Answer

DEFAULT_REF = "f324058"  # main before issue 17
QUOTA_REF = "eb4bdce"  # before the quota headers (issue 20, part 3)
QUOTA_REPS = 7
ITEMS = [
    RateLimitItem("requests", "second", 10**9, 1.0),
    RateLimitItem("tokens", "day", 10**15, 86400.0),
]
COSTS = [1, 64]
KEYS = [limit_key(f"tenant{i}", "embed") for i in range(100)]
CONCURRENCY = 16
STORAGE_CONCURRENCY = (1, 16, 300)

BURST = 3000
BURST_CONCURRENCY = 300
LIMIT = RateLimitItem("requests", "minute", 100, 60.0)
TIMEOUT_MS = 50.0  # the shipped docker / k8s setting, and the default
STALL_S = 0.15  # the loop stalls this long ...
STALL_EVERY_S = 0.05  # ... after running this long
TENANT = "bench"
TENANT_KEY = "bench-ratelimit-key"  # a benchmark fixture, not a secret

# Starts ``fair_frontend.cli`` (of whichever checkout is on the path) with a CPU hog on the
# event loop ``uvloop.run`` starts: the core's (shells are processes of their own).
STALLED_CLI = """
import asyncio, os, sys, time
import uvloop
stall_s, every_s = (float(x) for x in os.environ["FAIR_BENCH_STALL"].split(","))
_run = uvloop.run
def run(main, **kwargs):
    async def stalled():
        async def hog():
            while True:
                await asyncio.sleep(every_s)
                end = time.perf_counter() + stall_s
                while time.perf_counter() < end:
                    pass
        task = asyncio.get_running_loop().create_task(hog())
        try:
            return await main
        finally:
            task.cancel()
    return _run(stalled(), **kwargs)
if stall_s > 0:
    uvloop.run = run
from fair_frontend.cli import main
sys.exit(main())
"""


# ---- Redis and measuring -------------------------------------------------------------------


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


def summary(samples_ns: list[int], wall_s: float) -> dict[str, Any]:
    us = sorted(s / 1000 for s in samples_ns)
    return {
        "checks": len(us),
        "mean_us": round(statistics.fmean(us), 2),
        "p50_us": round(us[len(us) // 2], 2),
        "p99_us": round(us[min(len(us) - 1, int(len(us) * 0.99))], 2),
        "checks_per_s": round(len(us) / wall_s),
    }


async def measure(
    op: Callable[[int], Awaitable[object]],
    n: int,
    concurrency: int,
    warmed: Callable[[], object] | None = None,
) -> dict[str, Any]:
    """Latency of ``op`` over ``n`` calls made by ``concurrency`` tasks on one loop
    (``warmed``: called after the warm-up)."""
    for i in range(min(n // 10, 2000)):  # warm-up: connections, script cache, windows
        await op(i)
    if warmed is not None:
        warmed()
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


def acquire_op(storage: Any, failed: Counter[str]) -> Callable[[int], Awaitable[object]]:
    """The storage's check; a storage error is counted in ``failed``, by its type."""

    async def op(i: int) -> object:
        try:
            rejection = await storage.acquire(
                KEYS[i % len(KEYS)], ITEMS, COSTS, round(time.time() * 1_000_000)
            )
        except Exception as err:  # the old storage's StorageError is a class of its own
            failed[str(err)[:60]] += 1
            return err
        # This tree's storage answers (rejection, states); the one of ``--ref`` a rejection.
        assert (rejection[0] if isinstance(rejection, tuple) else rejection) is None, rejection
        return rejection

    return op


@dataclass(frozen=True)
class Stall:
    """A CPU hog on an event loop: ``busy_s`` of work after each ``every_s`` of running."""

    busy_s: float
    every_s: float


NO_STALL = Stall(0.0, 0.0)


@contextlib.contextmanager
def loop_stalls(stall: Stall) -> Iterator[None]:
    """``stall`` on the running loop (none for ``NO_STALL``)."""

    async def hog() -> None:
        while True:
            await asyncio.sleep(stall.every_s)
            end = time.perf_counter() + stall.busy_s
            while time.perf_counter() < end:
                pass

    task = asyncio.get_running_loop().create_task(hog()) if stall.busy_s else None
    try:
        yield
    finally:
        if task is not None:
            task.cancel()


def marker(trips: Any, into: list[int]) -> Callable[[], None]:
    """Notes a ``RoundTrips``' counters in ``into`` when called."""
    return lambda: into.extend((trips.round_trips, trips.commands))


# ---- the storage and limiter of another commit, beside this tree's -------------------------


def _module(name: str, source: str, filename: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


def baseline_admission(ref: str) -> tuple[types.ModuleType, types.ModuleType]:
    """``storage`` and ``ratelimit`` of ``ref`` (from git), importable beside this tree's."""

    def show(path: str) -> str:
        return subprocess.run(
            ["git", "show", f"{ref}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout

    tag = "".join(c if c.isalnum() else "_" for c in ref)
    storage = _module(
        f"_baseline_{tag}_storage",
        show("fair_frontend/admission/storage.py"),
        f"{ref}:fair_frontend/admission/storage.py",
    )
    ratelimit = _module(
        f"_baseline_{tag}_ratelimit",
        show("fair_frontend/admission/ratelimit.py").replace(
            "from fair_frontend.admission.storage import", f"from {storage.__name__} import"
        ),
        f"{ref}:fair_frontend/admission/ratelimit.py",
    )
    return storage, ratelimit


# ---- part 1: what a check costs --------------------------------------------------------------


async def run_cost(quick: bool, ref: str) -> dict[str, Any]:
    n_memory = 20_000 if quick else 200_000
    n_redis = 2_000 if quick else 20_000
    results: dict[str, Any] = {}

    async def noop(i: int) -> object:
        return time.time()

    for conc in (1, CONCURRENCY):
        progress(f"harness overhead (no-op op), concurrency {conc:>3}: {n_memory}")
        results[f"noop_c{conc}"] = r = await measure(noop, n_memory, conc)
        progress(f"  mean {r['mean_us']} us, p99 {r['p99_us']} us")

    memory = RateLimiter(MemoryStorage(), on_storage_error="fail_closed")
    for conc in (1, CONCURRENCY):
        progress(f"memory://  concurrency {conc:>3}: {n_memory} checks")
        results[f"memory_c{conc}"] = r = await measure(check_op(memory), n_memory, conc)
        progress(f"  mean {r['mean_us']} us, p99 {r['p99_us']} us, {r['checks_per_s']}/s")

    old_storage, _ = baseline_admission(ref)
    proc, port = start_redis()
    url = f"redis://127.0.0.1:{port}/0"
    progress(f"redis-server on 127.0.0.1:{port}")
    try:
        storage = RedisStorage(url, timeout_s=2.0)  # measure the cost, not the failure mode
        limiter = RateLimiter(storage, on_storage_error="fail_closed")
        client = aioredis.Redis.from_url(url)

        async def ping(i: int) -> object:
            return await client.ping()

        await client.config_resetstat()
        for conc in (1, CONCURRENCY):
            progress(f"redis://   PING baseline, concurrency {conc:>3}: {n_redis}")
            results[f"redis_ping_c{conc}"] = r = await measure(ping, n_redis, conc)
            progress(f"  mean {r['mean_us']} us, p99 {r['p99_us']} us, {r['checks_per_s']}/s")
            progress(f"redis://   concurrency {conc:>3}: {n_redis} checks")
            results[f"redis_c{conc}"] = r = await measure(check_op(limiter), n_redis, conc)
            progress(f"  mean {r['mean_us']} us, p99 {r['p99_us']} us, {r['checks_per_s']}/s")
        # Redis's own time per check (the script), which bounds what one Redis serves
        # for all replicas together: 1e6 / this = checks per second.
        stats = await client.info("commandstats")
        results["redis_server_us_per_check"] = stats["cmdstat_evalsha"]["usec_per_call"]
        results["redis_server_us_per_ping"] = stats["cmdstat_ping"]["usec_per_call"]
        progress(f"redis-server time per check (EVALSHA): {stats['cmdstat_evalsha']}")
        await limiter.close()

        # Batched (this tree) against one at a time (``ref``): the storage's check alone,
        # with a timeout no check reaches here (10 s): the cost, not the failure mode.
        for conc in STORAGE_CONCURRENCY:
            n = max(n_redis, 10 * conc)
            failed: Counter[str] = Counter()
            old = old_storage.RedisStorage(url, timeout_s=10.0)
            progress(f"one at a time ({ref}), concurrency {conc:>3}: {n} checks")
            results[f"one_at_a_time_c{conc}"] = r = await measure(acquire_op(old, failed), n, conc)
            r["failed"] = dict(failed)
            progress(f"  p50 {r['p50_us']} us, p99 {r['p99_us']} us, {r['checks_per_s']}/s")
            await old.close()
            failed = Counter()
            new = RedisStorage(url, timeout_s=10.0)
            trips = new.round_trips
            before: list[int] = []  # round trips and commands after the warm-up
            progress(f"batched (this tree), concurrency {conc:>3}: {n} checks")
            results[f"batched_c{conc}"] = r = await measure(
                acquire_op(new, failed), n, conc, warmed=marker(trips, before)
            )
            r["failed"] = dict(failed)
            r["checks_per_round_trip"] = round(
                (trips.commands - before[1]) / max(trips.round_trips - before[0], 1), 1
            )
            progress(
                f"  p50 {r['p50_us']} us, p99 {r['p99_us']} us, {r['checks_per_s']}/s, "
                f"{r['checks_per_round_trip']} checks per round trip"
            )
            await new.close()
            results[f"ratio_p99_one_at_a_time_to_batched_c{conc}"] = round(
                results[f"one_at_a_time_c{conc}"]["p99_us"] / r["p99_us"], 2
            )
        await client.aclose()
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


# ---- part 3: what the quota costs -------------------------------------------------------------


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def check_now_ns(limiter: Any, n: int) -> float:
    """Mean ns of ``check_now`` over ``n`` admitted checks, keys and time moving on."""
    now = time.time()
    clock = time.perf_counter_ns
    start = clock()
    for i in range(n):
        limiter.check_now(KEYS[i % len(KEYS)], ITEMS, requests=1, tokens=64, now=now + i * 1e-5)
    return (clock() - start) / n


async def redis_check(storage: Any, client: Any, n: int, prefix: str) -> dict[str, float]:
    """Redis's µs per check (EVALSHA) and the mean latency of ``n`` checks at 16."""
    keys = [f"{prefix}{k}" for k in KEYS]

    async def op(i: int) -> object:
        checked = await storage.acquire(
            keys[i % len(keys)], ITEMS, COSTS, round(time.time() * 1_000_000)
        )
        return checked

    await client.config_resetstat()
    result = await measure(op, n, CONCURRENCY)
    stats = await client.info("commandstats")
    return {"server_us": stats["cmdstat_evalsha"]["usec_per_call"], "mean_us": result["mean_us"]}


async def run_quota(quick: bool, ref: str) -> dict[str, Any]:
    n_memory = 20_000 if quick else 200_000
    n_redis = 2_000 if quick else 20_000
    old_storage, old_ratelimit = baseline_admission(ref)
    results: dict[str, Any] = {"ref": ref}

    old = old_ratelimit.RateLimiter(old_storage.MemoryStorage())
    new = RateLimiter(MemoryStorage())
    times: dict[str, list[float]] = {"ref": [], "tree": []}
    progress(f"check_now, memory://: {QUOTA_REPS} x {n_memory} checks each, interleaved")
    for _ in range(QUOTA_REPS):
        times["ref"].append(check_now_ns(old, n_memory))
        times["tree"].append(check_now_ns(new, n_memory))
    checked = new.check_now(KEYS[0], ITEMS, requests=1, tokens=64, now=time.time())
    assert checked is not None and checked.quota
    results["check_now_ns"] = {k: sorted(round(v) for v in vs) for k, vs in times.items()}
    results["check_now_ratio_tree_to_ref"] = round(
        statistics.median(times["tree"]) / statistics.median(times["ref"]), 3
    )
    results["check_now_added_ns"] = round(
        statistics.median(times["tree"]) - statistics.median(times["ref"])
    )
    progress(
        f"  ref {_median(times['ref'])} ns, tree {_median(times['tree'])} ns: "
        f"{results['check_now_ratio_tree_to_ref']}x"
    )

    proc, port = start_redis()
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = aioredis.Redis.from_url(url)
        runs: dict[str, list[dict[str, float]]] = {"ref": [], "tree": []}
        progress(f"redis://: {3} x {n_redis} checks each at concurrency {CONCURRENCY}")
        for rep in range(3):
            for name, make in (("ref", old_storage.RedisStorage), ("tree", RedisStorage)):
                storage = make(url, timeout_s=10.0)
                await redis_check(storage, client, n_redis // 10, f"{name}{rep}warm")
                runs[name].append(await redis_check(storage, client, n_redis, f"{name}{rep}:"))
                await storage.close()
        await client.aclose()
    finally:
        proc.terminate()
        proc.wait(10)
    for name, got in runs.items():
        results[f"redis_{name}"] = {
            "server_us_per_check": _median([g["server_us"] for g in got]),
            "mean_us": _median([g["mean_us"] for g in got]),
        }
    results["redis_server_ratio_tree_to_ref"] = round(
        results["redis_tree"]["server_us_per_check"] / results["redis_ref"]["server_us_per_check"],
        3,
    )
    progress(f"  {results['redis_ref']} -> {results['redis_tree']}")

    quota = Quota(
        QuotaWindow(10**9, 10**9 - 1, 1_020, "second"),
        QuotaWindow(10**15, 10**15 - 64, 86_401_700, "day"),
    )
    n = n_memory
    start = time.perf_counter_ns()
    for _ in range(n):
        quota_headers(quota)
    results["quota_headers_ns"] = round((time.perf_counter_ns() - start) / n)
    out = Tensor("EMBEDDING", "FP32", (1, 128), np.zeros((1, 128), dtype=np.float32))
    for name, answer in (
        ("without", Answer(1, "1", [out], queued_s=0.01)),
        ("with", Answer(1, "1", [out], queued_s=0.01, quota=quota)),
    ):
        start = time.perf_counter_ns()
        for _ in range(n):
            to_shell.decode(encode(answer)[4:])
        results[f"answer_frame_ns_{name}_quota"] = round((time.perf_counter_ns() - start) / n)
        results[f"answer_frame_bytes_{name}_quota"] = len(encode(answer))
    progress(
        f"  quota_headers {results['quota_headers_ns']} ns; an Answer's frame "
        f"{results['answer_frame_ns_without_quota']} -> {results['answer_frame_ns_with_quota']} "
        f"ns, {results['answer_frame_bytes_without_quota']} -> "
        f"{results['answer_frame_bytes_with_quota']} bytes"
    )
    return results


# ---- part 2: the burst -------------------------------------------------------------------------


async def burst_in_process(
    limiter_class: Any, storage_class: Any, url: str, stall: Stall, total: int
) -> dict[str, Any]:
    """``total`` checks at concurrency 300 against 100 a minute, the shipped settings."""
    storage = storage_class(url, timeout_s=TIMEOUT_MS / 1000)
    limiter = limiter_class(storage, on_storage_error="fail_open")
    gate = asyncio.Semaphore(BURST_CONCURRENCY)
    key = limit_key(TENANT, "embed")

    async def one() -> Any:
        async with gate:
            return await limiter.check(key, [LIMIT], requests=1, tokens=0, now=time.time())

    started = time.perf_counter()
    with loop_stalls(stall):
        decisions = await asyncio.gather(*(one() for _ in range(total)))
    wall = time.perf_counter() - started
    await limiter.close()
    return {
        "admitted": sum(d.allowed for d in decisions),
        "degraded": sum(d.degraded for d in decisions),
        "refused": sum(not d.allowed for d in decisions),
        "wall_s": round(wall, 2),
    }


def burst_config(source: Path, redis_url: str) -> dict[str, Any]:
    """The example config of ``source`` (so an older checkout reads its own), one tenant,
    100 requests a minute on ``embed``, the shipped rate-limiting settings."""
    path = source / "examples" / "config.yaml"
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    resolve_relative_paths(data, path.parent)
    data["tiers"] = ["standard"]
    data["tier_limits"] = {"standard": {"embed": {"requests_per_minute": LIMIT.amount}}}
    data["tenants"] = {TENANT: {"tier": "standard", "api_keys": [TENANT_KEY]}}
    if "tier_models" in data:  # model access (issue 17); an older checkout has none
        data["tier_models"] = {"standard": ["embed"]}
    data["endpoints"]["embed"]["throttle"] = False  # the rate limit alone decides
    data["rate_limiting"] = {
        "storage": redis_url,
        "on_storage_error": "fail_open",
        "timeout_ms": TIMEOUT_MS,
    }
    return data


@contextlib.contextmanager
def serve(
    config: dict[str, Any], triton_url: str, source: Path, workers: int, stall: Stall
) -> Iterator[tuple[str, str]]:
    """``fair-frontend serve`` of ``source`` as its own process (through ``STALLED_CLI``),
    yielding its gRPC address and metrics URL."""
    tmp = Path(tempfile.mkdtemp(prefix="fair-bench-rl-"))
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    http, grpc_port, metrics = (free_port() for _ in range(3))
    cmd = [
        sys.executable, "-c", STALLED_CLI, "serve", "--config", str(path),
        "--triton-url", triton_url, "--host", "127.0.0.1", "--http-port", str(http),
        "--grpc-port", str(grpc_port), "--metrics-port", str(metrics),
        "--log-level", os.environ.get("FAIR_BENCH_LOG_LEVEL", "WARNING"),
        "--workers", str(workers),
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(source),
        "FAIR_BENCH_STALL": f"{stall.busy_s},{stall.every_s}",
    }
    log_path = tmp / "frontend.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=source, env=env)
    try:
        wait_http_ready(f"http://127.0.0.1:{http}/v2/health/ready", proc)
        yield f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{metrics}/metrics"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


async def fire(grpc_url: str, total: int, concurrency: int) -> dict[str, Any]:
    """``total`` embed requests of the tenant, ``concurrency`` in flight, over 4 channels."""
    channels = [grpc.aio.insecure_channel(grpc_url) for _ in range(4)]
    stubs = [service_pb2_grpc.GRPCInferenceServiceStub(c) for c in channels]
    request = service_pb2.ModelInferRequest(model_name="embed")
    request.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, 8])
    request.raw_input_contents.append(np.full((1, 8), 7, np.int32).tobytes())
    metadata = (("authorization", f"Bearer {TENANT_KEY}"),)
    codes: Counter[str] = Counter()
    seconds: list[float] = []
    numbers = itertools.count()

    async def worker(w: int) -> None:
        stub = stubs[w % len(stubs)]
        while next(numbers) < total:
            t = time.perf_counter()
            try:
                await stub.ModelInfer(request, metadata=metadata, timeout=120)
                code = "OK"
            except grpc.aio.AioRpcError as err:
                code = err.code().name
            codes[code] += 1
            seconds.append(time.perf_counter() - t)

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    wall = time.perf_counter() - started
    for channel in channels:
        await channel.close()
    seconds.sort()
    return {
        "codes": dict(codes),
        "admitted": codes["OK"],
        "rate_limited": codes["RESOURCE_EXHAUSTED"],
        "other": sum(n for c, n in codes.items() if c not in ("OK", "RESOURCE_EXHAUSTED")),
        "wall_s": round(wall, 2),
        "p50_ms": round(seconds[len(seconds) // 2] * 1000, 1),
        "p99_ms": round(seconds[int(len(seconds) * 0.99)] * 1000, 1),
    }


async def run_burst(quick: bool, ref: str, workers: list[int], stall: Stall) -> dict[str, Any]:
    total = 1000 if quick else BURST
    results: dict[str, Any] = {"requests": total, "concurrency": BURST_CONCURRENCY}
    conditions = {"plain": NO_STALL, "stalled": stall}
    old_storage, old_ratelimit = baseline_admission(ref)
    proc, port = start_redis()
    url = f"redis://127.0.0.1:{port}/0"
    flush = redis.Redis(host="127.0.0.1", port=port)
    key_name = RedisStorage(url).key_name(limit_key(TENANT, "embed"), LIMIT)

    def counted() -> int:
        return int(flush.hget(key_name, "t") or 0)

    try:
        in_process: dict[str, Any] = {}
        for condition, how in conditions.items():
            for version, (limiter_class, storage_class) in {
                ref: (old_ratelimit.RateLimiter, old_storage.RedisStorage),
                "after": (RateLimiter, RedisStorage),
            }.items():
                flush.flushall()
                progress(f"in process, {condition}, {version}: {total} checks at c300")
                r = await burst_in_process(limiter_class, storage_class, url, how, total)
                r["counted_in_redis"] = counted()
                in_process[f"{condition}_{version}"] = r
                progress(f"  admitted {r['admitted']} (degraded {r['degraded']}), {r}")
        results["in_process"] = in_process

        with contextlib.ExitStack() as stack:
            before_tree = stack.enter_context(baseline_checkout(ref))
            server = stack.enter_context(triton())
            frontend: dict[str, Any] = {}
            for n_workers in workers:
                for condition, how in conditions.items():
                    for version, source in {ref: before_tree, "after": ROOT}.items():
                        name = f"workers{n_workers}_{condition}_{version}"
                        flush.flushall()
                        config = burst_config(source, url)
                        with serve(config, server.grpc_url, source, n_workers, how) as (
                            grpc_url,
                            metrics_url,
                        ):
                            # Warm: the model known, Redis connected (counted: 1 of 100).
                            warm = await fire(grpc_url, 1, 1)
                            assert warm["admitted"] == 1, warm
                            errors_before = testing.scrape(metrics_url).family_sum(
                                "fair_rate_limit_storage_errors"
                            )
                            progress(f"frontend, {name}: {total} requests at c300")
                            r = await fire(grpc_url, total, BURST_CONCURRENCY)
                            r["admitted_with_warm_up"] = r["admitted"] + 1
                            r["storage_errors"] = (
                                testing.scrape(metrics_url).family_sum(
                                    "fair_rate_limit_storage_errors"
                                )
                                - errors_before
                            )
                            r["counted_in_redis"] = counted()
                        frontend[name] = r
                        progress(
                            f"  admitted {r['admitted_with_warm_up']} of limit {LIMIT.amount} "
                            f"(storage errors {r['storage_errors']:.0f}, counted in Redis "
                            f"{r['counted_in_redis']}), {r['codes']}, {r['wall_s']} s"
                        )
            results["frontend"] = frontend
    finally:
        flush.close()
        proc.terminate()
        proc.wait(10)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer checks (a smoke run)")
    parser.add_argument("--part", choices=["cost", "burst", "quota"], help="one part only")
    parser.add_argument("--ref", default=DEFAULT_REF, help="the commit to compare with")
    parser.add_argument("--quota-ref", default=QUOTA_REF, help="the quota part's baseline")
    parser.add_argument("--workers", default="1,2", help="shell processes, comma-separated")
    parser.add_argument("--stall-ms", type=float, default=STALL_S * 1000, help="loop stall")
    parser.add_argument(
        "--stall-every-ms", type=float, default=STALL_EVERY_S * 1000, help="between stalls"
    )
    args = parser.parse_args()
    stall = Stall(args.stall_ms / 1000, args.stall_every_ms / 1000)
    workers = [int(w) for w in args.workers.split(",")]
    out: dict[str, Any] = {
        "benchmark": "ratelimit",
        "command": " ".join([".venv/bin/python -m benchmarks.bench_ratelimit", *sys.argv[1:]]),
        "ref": args.ref,
        "limits_cost": [f"{it}" for it in ITEMS],
        "limit_burst": str(LIMIT),
        "timeout_ms": TIMEOUT_MS,
        "stall": {"busy_s": stall.busy_s, "every_s": stall.every_s},
        "tenants": len(KEYS),
        "machine": {
            "python": platform.python_version(),
            "cpus": len(os.sched_getaffinity(0)),
            "redis": subprocess.run(
                ["redis-server", "--version"], capture_output=True, text=True
            ).stdout.split()[2],
        },
    }
    if args.part in (None, "cost"):
        out["cost"] = asyncio.run(run_cost(args.quick, args.ref))
    if args.part in (None, "burst"):
        out["burst"] = asyncio.run(run_burst(args.quick, args.ref, workers, stall))
    if args.part in (None, "quota"):
        out["quota"] = asyncio.run(run_quota(args.quick, args.quota_ref))
    name = "ratelimit" + ("_quick" if args.quick else "") + (f"_{args.part}" if args.part else "")
    write_result(name, out)


if __name__ == "__main__":
    main()
