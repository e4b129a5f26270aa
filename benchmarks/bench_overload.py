"""Overload on the real stack: does the throttle hold the latency target and the goodput?

Real Triton (``embed``), the frontend as its own process (``fair-frontend serve``), the
example's ``embed`` policy: ``throttle: true``, ``latency_target_ms: 1000``. Rate limits
are off (they are not what is measured here; their cost per check is, below).

1. Capacity: ``embed``'s requests/s at a fixed request size (``--tokens``, one row; 512 by
   default, see ``DEFAULT_TOKENS``), through the frontend, with a deep closed loop
   (``--depth`` requests always in flight, three full batches: enough to keep Triton busy,
   too few for the throttle to refuse). Measured again at the end: the machine is shared
   and its speed moves.
2. Overload: an open-loop Poisson load of ``--overload`` x capacity (3x) for ``--seconds``
   (60) from four tenants of one tier; then (``--runs one,two``) two tenants of each of
   two tiers, the higher tier offering 0.5x capacity and the lower 2.5x.
3. The cost of one rate-limit check, ``memory://`` and ``redis://`` (``bench_ratelimit``'s
   measurement, fewer checks), in the same run.

Reported per run: p50/p99 latency of admitted requests against the target (p99 must stay
within it), goodput (successful answers/s, completed inside the window) against capacity
(target >= 0.9x), the fraction rejected, and how fast rejections are answered (p99 of the
503's latency, target <= 5 ms); per tenant and tier. Beside them, to tell the stack from
the machine: a ``ServerLive`` call every 20 ms on the same channel (no work in the
frontend: the floor any answer has at that moment), and from Triton's own counters the
compute time per batch, rows per batch and the fraction of the run Triton computed, which
give the capacity the model's speed allowed during the run itself. The frontend's CPU per
process (core and shells, ``--workers``): per admitted call in the capacity loop, and per
refusal estimated from the overload runs (their CPU less the admitted calls' at that price):
a refusal the throttle's verdict sheds in the shell should cost a fraction of an admitted
call.

The load generator is Python on the same 2 cores as the frontend and Triton, so it competes
with them for CPU. It is kept lean (grpc.aio with the generated stub, request protos built
once, no tritonclient objects per call) and measures itself: its lag (actual minus
scheduled send time) and its CPU time are reported, with the frontend's CPU time, so the
reader can judge how much of a figure is the generator's.

    .venv/bin/python -m benchmarks.bench_overload [--seconds 60] [--tokens 512] [--runs one,two]
        [--workers N]

Results: ``benchmarks/results/overload.json`` and ``overload.png`` (latency over time with
the target line; admitted and rejected per second).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from benchmarks import bench_ratelimit
from benchmarks.harness import (
    RESULTS,
    frontend,
    load_example_config,
    process_tree_cpu_s,
    progress,
    triton,
    write_result,
)
from fair_frontend.admission import MemoryStorage, RateLimiter, RedisStorage
from fair_frontend.kit import testing

MODEL = "embed"
# 512 tokens: 8 rows fill a batch (max_batch_tokens 4096), so 3x capacity is a few hundred
# requests/s, which a Python generator and the frontend serve on 2 cores beside Triton. At
# 128 tokens (32 rows a batch) 3x capacity is over 1,000/s: the frontend and the generator
# then compete with the model for CPU, and that, not the throttle, is what gets measured.
DEFAULT_TOKENS = 512
TIERS = ("enterprise", "standard")
# run name -> (tenant, tier, share of the offered load)
RUNS: dict[str, list[tuple[str, str, float]]] = {
    "one": [(f"std{i}", "standard", 1 / 4) for i in range(4)],
    "two": [
        ("ent0", "enterprise", 0.5 / 6),
        ("ent1", "enterprise", 0.5 / 6),
        ("std0", "standard", 2.5 / 6),
        ("std1", "standard", 2.5 / 6),
    ],
}
TARGETS = {"p99_within_target": True, "goodput_vs_capacity": 0.9, "reject_p99_ms": 5.0}
BIN_S = 1.0  # width of the time bins of the rates and the plot
PROBE_INTERVAL_S = 0.02  # ServerLive probe alongside the load (50/s)
CALL_DEADLINE_S = 30.0  # no call waits longer (the frontend holds queued work while Triton
# is down, and Triton 2.51's Python backend can die under load: see the README)


def key_of(tenant: str) -> str:
    return f"{tenant}-bench-key"


def bench_config() -> dict[str, Any]:
    cfg = load_example_config()
    cfg.pop("tier_limits", None)
    embed = cfg["endpoints"][MODEL]
    assert embed.get("throttle", True) and embed["latency_target_ms"] == 1000
    tiers = {name: tier for run in RUNS.values() for name, tier, _ in run}
    cfg["tenants"] = {
        name: {"tier": tier, "api_keys": [key_of(name)]} for name, tier in tiers.items()
    }
    return cfg


def infer_request(tokens: int, seed: int) -> service_pb2.ModelInferRequest:
    """One row of ``tokens`` token ids, as the raw bytes the generated stub sends."""
    ids = np.random.default_rng(seed).integers(0, 4096, size=(1, tokens), dtype=np.int32)
    req = service_pb2.ModelInferRequest(model_name=MODEL)
    req.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, tokens])
    req.raw_input_contents.append(ids.tobytes())
    return req


@dataclass
class Log:
    """Per request, in send order: columns, not objects (cheap to append)."""

    tenant: list[int] = field(default_factory=list)
    scheduled: list[float] = field(default_factory=list)  # loop time it was due
    sent: list[float] = field(default_factory=list)
    done: list[float] = field(default_factory=list)
    code: list[str] = field(default_factory=list)


class Generator:
    """Sends ``ModelInfer`` calls over a few grpc.aio channels and logs each answer."""

    def __init__(self, url: str, tenants: list[str], tokens: int) -> None:
        self.channels = [grpc.aio.insecure_channel(url) for _ in tenants]
        self.stubs = [service_pb2_grpc.GRPCInferenceServiceStub(c) for c in self.channels]
        self.metadata = [(("authorization", f"Bearer {key_of(t)}"),) for t in tenants]
        self.requests = [infer_request(tokens, seed) for seed in range(16)]
        self.log = Log()
        self.pending: set[asyncio.Task[None]] = set()

    async def call(self, index: int, tenant: int) -> None:
        log = self.log
        try:
            await self.stubs[tenant].ModelInfer(
                self.requests[index % 16], metadata=self.metadata[tenant], timeout=CALL_DEADLINE_S
            )
            code = "OK"
        except grpc.aio.AioRpcError as err:
            code = err.code().name
        log.done[index] = time.perf_counter()
        log.code[index] = code

    def send(self, tenant: int, scheduled: float) -> int:
        log = self.log
        index = len(log.sent)
        log.tenant.append(tenant)
        log.scheduled.append(scheduled)
        log.sent.append(time.perf_counter())
        log.done.append(float("nan"))
        log.code.append("")
        task = asyncio.ensure_future(self.call(index, tenant))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        return index

    async def drain(self) -> None:
        while self.pending:
            await asyncio.gather(*list(self.pending))

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


async def closed_loop(gen: Generator, depth: int, seconds: float) -> tuple[int, float]:
    """``depth`` requests always in flight for ``seconds``: (answers OK, seconds)."""
    stop = time.perf_counter() + seconds
    count = 0
    errors: list[str] = []

    async def worker(w: int) -> None:
        nonlocal count
        while time.perf_counter() < stop:
            try:
                await gen.stubs[w % len(gen.stubs)].ModelInfer(
                    gen.requests[count % 16],
                    metadata=gen.metadata[w % len(gen.stubs)],
                    timeout=CALL_DEADLINE_S,
                )
                count += 1
            except grpc.aio.AioRpcError as err:
                errors.append(err.code().name)

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(depth)))
    if errors:
        raise RuntimeError(f"capacity run had {len(errors)} errors, e.g. {errors[:3]}")
    return count, time.perf_counter() - start


async def measure_capacity(
    url: str,
    triton_metrics: str,
    tokens: int,
    depth: int,
    seconds: float,
    *,
    warm_up: bool,
    frontend_pid: int | None = None,
) -> dict[str, Any]:
    gen = Generator(url, ["std0"], tokens)
    try:
        if warm_up:
            progress(f"capacity: warm-up, {depth} in flight")
            await closed_loop(gen, depth, 3.0)
        progress(f"capacity: {seconds:g} s closed loop, {depth} in flight, {tokens} tokens")
        cpu0, t0 = time.process_time(), triton_counters(triton_metrics)
        fe0 = process_tree_cpu_s(frontend_pid) if frontend_pid else None
        count, wall = await closed_loop(gen, depth, seconds)
        cpu, t1 = time.process_time() - cpu0, triton_counters(triton_metrics)
        fe1 = process_tree_cpu_s(frontend_pid) if frontend_pid else None
    finally:
        await gen.close()
    rate = count / wall
    progress(f"capacity: {rate:.1f} requests/s ({count} in {wall:.1f} s)")
    admitted_cpu: dict[str, float] = {}
    if fe0 is not None and fe1 is not None:
        # Every call of a closed loop at capacity is admitted: what one admitted call costs.
        admitted_cpu = {k: round((fe1[k] - fe0[k]) / max(1, count) * 1e6) for k in fe0}
        admitted_cpu["all"] = sum(admitted_cpu.values())
    return {
        "frontend_cpu_us_per_admitted": admitted_cpu,
        "requests_per_s": round(rate, 1),
        "tokens_per_s": round(rate * tokens),
        "depth": depth,
        "seconds": round(wall, 1),
        "generator_cpu_fraction": round(cpu / wall, 2),
        "triton": triton_phase(t0, t1, wall, full_batch_rows(tokens)),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def full_batch_rows(tokens: int) -> int:
    """Rows of ``tokens`` tokens in a full ``embed`` batch under the example's caps."""
    embed = load_example_config()["endpoints"][MODEL]
    return max(1, min(embed["max_batch_size"], embed["max_batch_tokens"] // tokens))


def poisson_arrivals(
    tenants: list[tuple[str, str, float]], rate: float, seconds: float, seed: int
) -> list[tuple[float, int]]:
    """(offset in seconds, tenant index), merged and sorted; each tenant its own process."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, int]] = []
    for index, (_, _, share) in enumerate(tenants):
        at = rng.expovariate(rate * share)
        while at < seconds:
            arrivals.append((at, index))
            at += rng.expovariate(rate * share)
    arrivals.sort()
    return arrivals


async def live_probe(stub: service_pb2_grpc.GRPCInferenceServiceStub, stop: float) -> list[float]:
    """Latencies of ``ServerLive`` calls (no work in the frontend) every ``PROBE_INTERVAL_S``
    until ``stop``: the floor a 503 can be answered in on this machine at this moment, the
    generator's own delays included."""
    request = service_pb2.ServerLiveRequest()
    latencies: list[float] = []
    while time.perf_counter() < stop:
        sent = time.perf_counter()
        try:
            await stub.ServerLive(request, timeout=CALL_DEADLINE_S)
        except grpc.aio.AioRpcError:
            latencies.append(math.inf)  # refused too (the channel's streams all taken)
        else:
            latencies.append(time.perf_counter() - sent)
        await asyncio.sleep(PROBE_INTERVAL_S)
    return latencies


async def open_loop(
    url: str, tenants: list[tuple[str, str, float]], rate: float, seconds: float, tokens: int
) -> tuple[Log, float, list[float]]:
    """Send on the Poisson schedule; returns the log, the start (perf_counter) and the
    latencies of the ``ServerLive`` probe that ran alongside."""
    gen = Generator(url, [t for t, _, _ in tenants], tokens)
    arrivals = poisson_arrivals(tenants, rate, seconds, seed=int(rate * 1000) + len(tenants))
    progress(f"  {len(arrivals)} arrivals scheduled over {seconds:g} s ({rate:.0f}/s)")
    clock = time.perf_counter
    start = clock() + 0.05
    next_report = start + 10
    probe = asyncio.ensure_future(live_probe(gen.stubs[0], start + seconds))
    try:
        i, n = 0, len(arrivals)
        while i < n:
            now = clock()
            # Everything due is sent now (a late generator catches up in a burst, and
            # its lag is on the record); then sleep until the next one is due.
            while i < n and start + arrivals[i][0] <= now:
                gen.send(arrivals[i][1], start + arrivals[i][0])
                i += 1
            if now >= next_report:
                ok = gen.log.code.count("OK")
                progress(f"  t={now - start:4.0f} s: sent {i}, answered OK {ok}")
                next_report += 10
            if i < n:
                wait = start + arrivals[i][0] - clock()
                await asyncio.sleep(wait if wait > 0.0005 else 0)
        await gen.drain()
        live = await probe
    finally:
        probe.cancel()
        await gen.close()
    return gen.log, start, live


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(value: float) -> float:
    return round(value * 1000, 2)


def summarize(
    log: Log,
    start: float,
    seconds: float,
    tenants: list[tuple[str, str, float]],
    capacity: float,
    target_s: float,
) -> dict[str, Any]:
    n = len(log.sent)
    latency = [log.done[i] - log.sent[i] for i in range(n)]
    ok = [i for i in range(n) if log.code[i] == "OK"]
    rejected = [i for i in range(n) if log.code[i] == "UNAVAILABLE"]
    other: dict[str, int] = {}
    for c in log.code:
        if c not in ("OK", "UNAVAILABLE"):
            other[c] = other.get(c, 0) + 1
    lag = [log.sent[i] - log.scheduled[i] for i in range(n)]
    ok_lat = [latency[i] for i in ok]
    rej_lat = [latency[i] for i in rejected]
    in_window = [i for i in ok if log.done[i] - start <= seconds]
    goodput = len(in_window) / seconds
    result: dict[str, Any] = {
        "offered_per_s": round(n / seconds, 1),
        "offered_vs_capacity": round(n / seconds / capacity, 2),
        "requests": n,
        "admitted": len(ok),
        "rejected_503": len(rejected),
        "other_errors": other,
        "rejected_fraction": round(len(rejected) / n, 3),
        "admitted_latency_ms": {
            "p50": ms(percentile(ok_lat, 0.5)),
            "p90": ms(percentile(ok_lat, 0.9)),
            "p99": ms(percentile(ok_lat, 0.99)),
            "max": ms(max(ok_lat, default=float("nan"))),
            "within_target": round(sum(x <= target_s for x in ok_lat) / max(1, len(ok_lat)), 4),
        },
        "goodput_per_s": round(goodput, 1),
        "goodput_vs_capacity": round(goodput / capacity, 3),
        "reject_latency_ms": {
            "p50": ms(percentile(rej_lat, 0.5)),
            "p99": ms(percentile(rej_lat, 0.99)),
            "max": ms(max(rej_lat, default=float("nan"))),
        },
        "generator_lag_ms": {
            "p50": ms(percentile(lag, 0.5)),
            "p99": ms(percentile(lag, 0.99)),
            "max": ms(max(lag, default=float("nan"))),
        },
    }
    per_tenant: dict[str, Any] = {}
    per_tier: dict[str, Any] = {}
    for index, (name, tier, _) in enumerate(tenants):
        mine = [i for i in range(n) if log.tenant[i] == index]
        mine_ok = [i for i in mine if log.code[i] == "OK"]
        good = sum(1 for i in mine_ok if log.done[i] - start <= seconds) / seconds
        per_tenant[name] = {
            "tier": tier,
            "offered_per_s": round(len(mine) / seconds, 1),
            "goodput_per_s": round(good, 1),
            "admitted_fraction": round(len(mine_ok) / max(1, len(mine)), 3),
            "admitted_p99_ms": ms(percentile([latency[i] for i in mine_ok], 0.99)),
        }
        t = per_tier.setdefault(tier, {"offered_per_s": 0.0, "goodput_per_s": 0.0})
        t["offered_per_s"] = round(t["offered_per_s"] + len(mine) / seconds, 1)
        t["goodput_per_s"] = round(t["goodput_per_s"] + good, 1)
    result["tenants"] = per_tenant
    result["tiers"] = per_tier
    result["checks"] = {
        "p99_within_target": result["admitted_latency_ms"]["p99"] <= target_s * 1000,
        "goodput_vs_capacity_ok": result["goodput_vs_capacity"] >= TARGETS["goodput_vs_capacity"],
        "reject_p99_ok": result["reject_latency_ms"]["p99"] <= TARGETS["reject_p99_ms"],
    }
    return result


def series(log: Log, start: float, seconds: float) -> dict[str, list[float]]:
    """Per request (for the plot): send offset, latency, admitted; and per-bin rates."""
    n = len(log.sent)
    bins = int(seconds / BIN_S) + 1
    admitted = [0] * bins
    rejected = [0] * bins
    for i in range(n):
        b = min(bins - 1, int((log.sent[i] - start) / BIN_S))
        if log.code[i] == "OK":
            admitted[b] += 1
        elif log.code[i] == "UNAVAILABLE":
            rejected[b] += 1
    return {
        "t": [log.sent[i] - start for i in range(n)],
        "latency_ms": [(log.done[i] - log.sent[i]) * 1000 for i in range(n)],
        "ok": [float(log.code[i] == "OK") for i in range(n)],
        "admitted_per_s": [a / BIN_S for a in admitted],
        "rejected_per_s": [r / BIN_S for r in rejected],
    }


def refusal_cost(
    spent_s: dict[str, float], summary: dict[str, Any], admitted_cpu_us: dict[str, float]
) -> dict[str, Any]:
    """What one refusal (503) cost the frontend, per process (core, shells): its CPU over
    the run less what the admitted calls cost at the capacity measurement's price, over
    the refusals. An estimate (the price of an admitted call under overload may differ);
    its ratio to an admitted call is the figure the throttle's verdict in the shells aims
    at."""
    refused, admitted = summary["rejected_503"], summary["admitted"]
    if not refused or not admitted_cpu_us:
        return {}
    per = {
        k: round(max(0.0, v * 1e6 - admitted * admitted_cpu_us[k]) / refused)
        for k, v in spent_s.items()
    }
    per["all"] = sum(per.values())
    return {
        "cpu_us_per_admitted": admitted_cpu_us,
        "cpu_us_per_refusal_estimate": per,
        "refusal_over_admitted": round(per["all"] / max(1, admitted_cpu_us["all"]), 2),
    }


TRITON_COUNTERS = {
    "nv_inference_request_success": "requests",  # one per frontend batch
    "nv_inference_count": "rows",
    "nv_inference_request_duration_us": "request_us",
    "nv_inference_compute_input_duration_us": "input_us",
    "nv_inference_compute_infer_duration_us": "infer_us",
    "nv_inference_compute_output_duration_us": "output_us",
}


def triton_counters(metrics_url: str) -> dict[str, float]:
    """Triton's cumulative counters for ``embed`` (the frontend sends one request a batch)."""
    try:
        page = testing.scrape(metrics_url, timeout=5)
    except OSError as err:
        raise SystemExit(f"Triton's metrics do not answer ({err}): did Triton die?") from err
    out = dict.fromkeys(TRITON_COUNTERS.values(), 0.0)
    for family, name in TRITON_COUNTERS.items():
        out[name] += page.family_sum(family, model=MODEL)
    return out


def triton_phase(
    before: dict[str, float], after: dict[str, float], wall: float, full_rows: int
) -> dict[str, float]:
    """What Triton did in a phase: batches, rows per batch, compute time per batch (input,
    execution, output: what one model instance does back to back), the fraction of the
    phase it computed, and the requests/s full batches at that compute time would serve:
    the speed the shared machine gave the model at that time, to compare goodput with.
    (``request_ms`` also counts the time a batch sent early waited in Triton's queue.)"""
    d = {k: after[k] - before[k] for k in before}
    batches = max(1.0, d["requests"])
    compute_s = (d["input_us"] + d["infer_us"] + d["output_us"]) / batches / 1e6
    return {
        "batches": int(d["requests"]),
        "rows_per_batch": round(d["rows"] / batches, 2),
        "compute_ms": round(compute_s * 1000, 1),
        "request_ms": round(d["request_us"] / batches / 1000, 1),
        "busy_fraction": round(compute_s * batches / wall, 3),
        "full_batch_capacity_per_s": round(full_rows / compute_s, 1) if compute_s > 0 else 0.0,
    }


def scrape_throttle(metrics_url: str) -> dict[str, float]:
    """The frontend's throttle decisions for ``embed``, by decision."""
    page = testing.scrape(metrics_url, timeout=5)
    return page.by_label("fair_throttle_decisions_total", "decision", endpoint=MODEL)


async def ratelimit_cost() -> dict[str, Any]:
    """``bench_ratelimit``'s measurement, sequential checks, fewer of them."""
    out: dict[str, Any] = {}
    memory = RateLimiter(MemoryStorage(), on_storage_error="fail_closed")
    out["memory"] = await bench_ratelimit.measure(bench_ratelimit.check_op(memory), 20_000, 1)
    proc, port = bench_ratelimit.start_redis()
    try:
        storage = RedisStorage(f"redis://127.0.0.1:{port}/0", timeout_s=2.0)
        limiter = RateLimiter(storage, on_storage_error="fail_closed")
        out["redis"] = await bench_ratelimit.measure(bench_ratelimit.check_op(limiter), 3_000, 1)
        await limiter.close()
    finally:
        proc.terminate()
        proc.wait(10)
    out["ratio_redis_to_memory"] = round(out["redis"]["mean_us"] / out["memory"]["mean_us"], 1)
    for name in ("memory", "redis"):
        r = out[name]
        progress(f"limit check, {name}://: mean {r['mean_us']} us, p99 {r['p99_us']} us")
    return out


def plot(runs: dict[str, Any], target_ms: float, capacity: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    fig, axes = plt.subplots(2, len(names), figsize=(7 * len(names), 8), squeeze=False)
    for col, name in enumerate(names):
        s = runs[name]["series"]
        top, bottom = axes[0][col], axes[1][col]
        ok_t = [t for t, ok in zip(s["t"], s["ok"], strict=True) if ok]
        ok_l = [x for x, ok in zip(s["latency_ms"], s["ok"], strict=True) if ok]
        rej_t = [t for t, ok in zip(s["t"], s["ok"], strict=True) if not ok]
        rej_l = [x for x, ok in zip(s["latency_ms"], s["ok"], strict=True) if not ok]
        top.scatter(ok_t, ok_l, s=2, alpha=0.4, label="admitted", color="tab:blue")
        top.scatter(rej_t, rej_l, s=2, alpha=0.4, label="rejected (503)", color="tab:red")
        top.axhline(target_ms, color="black", linestyle="--", label=f"target {target_ms:g} ms")
        top.set_yscale("log")
        top.set_ylabel("latency (ms)")
        top.set_title(f"run '{name}': {runs[name]['summary']['offered_vs_capacity']}x capacity")
        top.legend(loc="lower right", markerscale=4)
        xs = [i * BIN_S for i in range(len(s["admitted_per_s"]))]
        bottom.plot(xs, s["admitted_per_s"], label="admitted/s", color="tab:blue")
        bottom.plot(xs, s["rejected_per_s"], label="rejected/s", color="tab:red")
        bottom.axhline(capacity, color="black", linestyle="--", label="capacity")
        bottom.set_xlabel("time since start (s)")
        bottom.set_ylabel("requests/s (by send time)")
        bottom.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    progress(f"plot written to {path.relative_to(RESULTS.parent.parent)}")


async def overload_run(
    name: str,
    fe: Any,
    triton_metrics: str,
    capacity: float,
    args: argparse.Namespace,
    target_s: float,
    admitted_cpu_us: dict[str, float],
) -> dict[str, Any]:
    tenants = RUNS[name]
    rate = args.overload * capacity
    progress(f"run '{name}': {rate:.0f} requests/s offered for {args.seconds:g} s: {tenants}")
    throttle0 = scrape_throttle(f"http://127.0.0.1:{fe.metrics_port}/metrics")
    triton0 = triton_counters(triton_metrics)
    fe_cpu0, gen_cpu0 = process_tree_cpu_s(fe.process.pid), time.process_time()
    load0 = os.getloadavg()[0]
    log, start, live = await open_loop(fe.grpc_url, tenants, rate, args.seconds, args.tokens)
    wall = time.perf_counter() - start
    fe_cpu1, gen_cpu = process_tree_cpu_s(fe.process.pid), time.process_time() - gen_cpu0
    fe_parts = {k: fe_cpu1[k] - fe_cpu0[k] for k in fe_cpu0}
    fe_cpu = sum(fe_parts.values())
    throttle1 = scrape_throttle(f"http://127.0.0.1:{fe.metrics_port}/metrics")
    triton = triton_phase(
        triton0, triton_counters(triton_metrics), wall, full_batch_rows(args.tokens)
    )
    summary = summarize(log, start, args.seconds, tenants, capacity, target_s)
    summary["triton"] = triton
    summary["goodput_vs_batch_speed_capacity"] = round(
        summary["goodput_per_s"] / max(1e-9, triton["full_batch_capacity_per_s"]), 3
    )
    summary["server_live_latency_ms"] = {
        "p50": ms(percentile(live, 0.5)),
        "p99": ms(percentile(live, 0.99)),
        "max": ms(max(live, default=float("nan"))),
        "calls": len(live),
    }
    summary["throttle_decisions"] = {
        k: int(v - throttle0.get(k, 0.0)) for k, v in throttle1.items() if v > throttle0.get(k, 0)
    }
    summary["cpu"] = {
        "frontend_cores": round(fe_cpu / wall, 2),
        "frontend_cores_by_process": {k: round(v / wall, 2) for k, v in fe_parts.items()},
        "frontend_cpu_us_per_request": round(fe_cpu / max(1, len(log.sent)) * 1e6),
        **refusal_cost(fe_parts, summary, admitted_cpu_us),
        "generator_cores": round(gen_cpu / wall, 2),
        "load_average_1m_before": round(load0, 2),
        "load_average_1m_after": round(os.getloadavg()[0], 2),
    }
    lat, rej, lag = (
        summary["admitted_latency_ms"],
        summary["reject_latency_ms"],
        summary["generator_lag_ms"],
    )
    progress(
        f"run '{name}': admitted p50 {lat['p50']} ms, p99 {lat['p99']} ms (target "
        f"{target_s * 1000:g}); goodput {summary['goodput_per_s']}/s = "
        f"{summary['goodput_vs_capacity']}x capacity; rejected {summary['rejected_fraction']:.1%}"
        f", 503 p99 {rej['p99']} ms (ServerLive p99 {summary['server_live_latency_ms']['p99']} ms)"
        f"; generator lag p99 {lag['p99']} ms; errors "
        f"{summary['other_errors']}; CPU frontend {summary['cpu']['frontend_cores']} cores, "
        f"generator {summary['cpu']['generator_cores']}; Triton busy "
        f"{triton['busy_fraction']:.0%}, {triton['rows_per_batch']} rows/batch, "
        f"{triton['compute_ms']} ms compute/batch (goodput "
        f"{summary['goodput_vs_batch_speed_capacity']}x what that allows)"
    )
    return {"summary": summary, "series": series(log, start, args.seconds)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = bench_config()
    target_s = cfg["endpoints"][MODEL]["latency_target_ms"] / 1000
    out: dict[str, Any] = {"target_ms": target_s * 1000}
    with (
        triton() as server,
        frontend(cfg, server.grpc_url, workers=args.workers, http_url=server.http_url) as fe,
    ):
        progress(f"frontend on {fe.grpc_url} (log: {fe.log_path})")
        out["capacity"] = await measure_capacity(
            fe.grpc_url, server.metrics_url, args.tokens, args.depth, args.capacity_seconds,
            warm_up=True, frontend_pid=fe.process.pid,
        )  # fmt: skip
        capacity = out["capacity"]["requests_per_s"]
        admitted_cpu = out["capacity"]["frontend_cpu_us_per_admitted"]
        runs = {}
        for name in args.runs:
            runs[name] = await overload_run(
                name, fe, server.metrics_url, capacity, args, target_s, admitted_cpu
            )
        # The machine is shared: measure again, to bracket how its speed moved meanwhile.
        out["capacity_after"] = await measure_capacity(
            fe.grpc_url, server.metrics_url, args.tokens, args.depth, args.capacity_seconds,
            warm_up=False,
        )  # fmt: skip
    out["runs"] = {name: r["summary"] for name, r in runs.items()}
    progress("rate-limit check cost, memory:// and redis://")
    out["ratelimit_check_us"] = await ratelimit_cost()
    plot(runs, target_s * 1000, capacity, RESULTS / f"{result_name(args.tokens)}.png")
    return out


def result_name(tokens: int) -> str:
    """``overload`` at the default request size; other sizes get their own files."""
    return "overload" if tokens == DEFAULT_TOKENS else f"overload_tokens{tokens}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="each overload run")
    parser.add_argument(
        "--tokens", type=int, default=DEFAULT_TOKENS, help="tokens per request (one row)"
    )
    parser.add_argument("--overload", type=float, default=3.0, help="offered / capacity")
    parser.add_argument("--depth", type=int, default=0, help="capacity: requests in flight "
                        "(default: three full batches)")  # fmt: skip
    parser.add_argument("--capacity-seconds", type=float, default=15.0)
    parser.add_argument("--workers", type=int, default=1, help="the frontend's shell processes")
    parser.add_argument("--runs", default="one,two", help="comma-separated: one, two")
    args = parser.parse_args()
    args.runs = [r for r in args.runs.split(",") if r]
    for r in args.runs:
        if r not in RUNS:
            parser.error(f"unknown run {r!r}: choose from {sorted(RUNS)}")
    if not args.depth:
        args.depth = 3 * full_batch_rows(args.tokens)
    started = time.time()
    result = asyncio.run(run(args))
    command = ".venv/bin/python -m benchmarks.bench_overload"
    defaults = {
        "seconds": 60.0,
        "tokens": DEFAULT_TOKENS,
        "overload": 3.0,
        "capacity_seconds": 15.0,
    }
    for name, default in defaults.items():
        if getattr(args, name) != default:
            command += f" --{name.replace('_', '-')} {getattr(args, name):g}"
    if args.runs != ["one", "two"]:
        command += f" --runs {','.join(args.runs)}"
    result.update(
        benchmark="overload",
        command=command,
        tokens_per_request=args.tokens,
        overload=args.overload,
        seconds=args.seconds,
        targets=TARGETS,
        machine={"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version()},
        wall_s=round(time.time() - started, 1),
    )  # fmt: skip
    write_result(result_name(args.tokens), result)


if __name__ == "__main__":
    main()
