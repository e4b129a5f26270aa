"""Fairness over time: two backlogged token-cost tenants at a 1:2 rate, window by window.

Issue 18 asks whether the shells/core split made fairness over time slip. The workload:
``embed`` (``cost: tokens``), one real Triton, the frontend as its own process
(``fair-frontend serve``, ``benchmarks.harness.frontend``) with the throttle and rate
limits off and queue caps nobody reaches, two tenants of equal weight in one tier. Each
tenant is a client process of its own sending 512-token requests (one row; 8 fill a batch
of ``max_batch_tokens`` 4,096) open loop on a Poisson schedule: ``a`` at 1x the capacity
measured first (``bench_overload``'s closed loop through the frontend), ``b`` at 2x. Both
offer more than their fair half, so both are backlogged for the whole run; a client holds
at most ``--max-outstanding`` calls (3,000; a send due beyond it is skipped and counted):
once a tenant's backlog reaches it, it sends as fast as it is served, hundreds of batches
behind, and stays under the frontend's 4,096 gRPC streams per connection, over which gRPC
refuses calls. After a warm-up, ``--seconds`` (50) are measured.

Served cost per tenant is recorded twice: at the frontend, ``fair_served_tokens_total``
scraped every ``SCRAPE_S`` (a batch is counted when its answers have gone out), and at
each client, the completion time of each answer x its 512 tokens.

The metric ("average service difference over cost throughput", the VTC paper's measure
normalised): cut the measured span into consecutive windows of W seconds (1 s, and 5 s),
keep the windows in which both tenants were backlogged, and per window take the service
difference d = |served_a - served_b| in tokens. Reported:

- ``avg_diff_over_throughput`` = mean(d) / mean(served_a + served_b), dimensionless;
- ``max_diff_over_throughput`` = max(d) / mean(served_a + served_b), and max(d) in tokens;
- the cumulative difference max_t |S_a(t) - S_b(t)| over the span (S counted from its
  start), in tokens and in seconds of the two tenants' joint throughput.

Backlogged: at the frontend, a tenant with queued work is in ``fair_drr_deficit`` (the DRR
active list; ``fifo`` has none); at the client, its calls outstanding (sent, not answered)
never fell below ``BACKLOG_ROWS`` (three full batches: more than Triton can hold at once)
in the window. The client's test is the one windows are kept by, for every target alike.

Targets, in one run against one Triton: this tree in ``fair`` mode with ``--workers 1``
and with 2 shell processes, the frontend before the shells/core split (``--ref``, default
``bench_throughput.BASELINE_REF``; run from a git worktree, one process, its own example
config without the padding its schema spelled differently), this tree with a DRR quantum
of one request (``quantum: 512``: each batch mixes both tenants, which shows what the
window metric measures), and ``fifo`` (one shared queue: the control, far off).

``--gauges`` checks the fairness gauges (issue 33) under that backlog: the frontend writes
its request log, each scrape also reads ``fair_jain_index`` and ``fair_service_gap`` (over
the last ``WINDOW_S`` whole seconds of the core's monotonic clock, this process's too),
and each target's gauges are set against the same figures computed from the log alone
(``gauge_check``): Jain's index, the largest service difference against the proven bound
(q + C), and their disagreement. Results then in ``fairness_time_gauges.json``.

    .venv/bin/python -m benchmarks.bench_fairness_time [--seconds 50] [--warmup-s 10]
        [--targets w1 w2 before quantum512 fifo] [--ref c309e4d] [--quick] [--gauges]

Results: ``benchmarks/results/fairness_time.json`` and ``fairness_time.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2_grpc

from benchmarks import bench_overload
from benchmarks.bench_throughput import BASELINE_REF
from benchmarks.harness import (
    RESULTS,
    ROOT,
    baseline_checkout,
    frontend,
    load_example_config,
    progress,
    triton,
    write_result,
)
from fair_frontend.kit import testing
from fair_frontend.observability.logs import REQUEST_LOGGER
from fair_frontend.scheduler.window import WINDOW_S, jain_index, service_gap

MODEL = "embed"
TOKENS = 512  # one row; max_batch_tokens 4,096: 8 rows a batch
# ``--sizes``: every request TOKENS long, or each of one of these, in turn (a row each; the
# mean 793, a batch of 4,096 tokens holds 2 to 32 of them): how the default quantum is
# chosen for requests of mixed sizes.
SIZES = {"512": (TOKENS,), "mixed": (128, 2048, 256, 512, 1024, 128, 256, 2048, 512, 1024, 64)}
TENANTS = ("a", "b")
TIER = "standard"  # both tenants' (and the capacity probe's)
RATES = {"a": 1.0, "b": 2.0}  # offered load, x the measured capacity
KEYS = {t: f"{t}-fairness-time-key" for t in TENANTS}
CAPACITY_TENANT = "std0"  # bench_overload's closed loop sends as this tenant
SCRAPE_S = 0.25
WINDOWS_S = (1.0, 5.0)
BACKLOG_ROWS = 24  # a client with fewer outstanding may have nothing queued at the frontend
# Calls a client holds at once: below the frontend's 4,096 streams on one connection
# (server.grpc_max_streams_per_connection), over which gRPC refuses part of the calls
# (REFUSED_STREAM, UNAVAILABLE), and hundreds of batches' worth: backlogged throughout.
DEFAULT_MAX_OUTSTANDING = 3000
CALL_DEADLINE_S = 600.0
BATCH_GAP_S = 0.015  # answers further apart than this at the clients: different batches
START_DELAY_S = 2.0  # the clients import grpc and connect before the common start

# name -> (label, scheduling mode, --workers (None: the flag does not exist), endpoint
# overrides, runs the --ref checkout)
TARGETS: dict[str, tuple[str, str, int | None, dict[str, Any], bool]] = {
    "w1": ("fair, 1 process", "fair", 1, {}, False),
    "w2": ("fair, 2 shells", "fair", 2, {}, False),
    "before": ("before the split, fair", "fair", None, {}, True),
    "quantum512": ("fair, quantum 512, 1 process", "fair", 1, {"quantum": TOKENS}, False),
    "quantum1024": ("fair, quantum 1,024, 1 process", "fair", 1, {"quantum": 1024}, False),
    "quantum2048": ("fair, quantum 2,048, 1 process", "fair", 1, {"quantum": 2048}, False),
    "fifo": ("fifo, 1 process", "fifo", 1, {}, False),
}


def bench_config(
    mode: str, overrides: dict[str, Any], source: Path | None = None, padded: bool = False
) -> dict[str, Any]:
    cfg = load_example_config(source)
    cfg.pop("tier_limits", None)  # rate limits off
    cfg["scheduling"] = mode
    embed = cfg["endpoints"][MODEL]
    embed["throttle"] = False  # backlogged on purpose: nothing is turned away
    if source is not None and not padded:
        # Every row here is 512 tokens wide: nothing to pad, and the earlier schema
        # named the lengths differently (bench_throughput does the same). Rows of mixed
        # sizes need the ref's own padding: a ref that reads this schema's.
        embed.pop("padding", None)
    embed.update(overrides)
    cfg["endpoints"] = {MODEL: embed}
    cfg["queues"] = {"max_queued": 100_000, "max_queued_bytes": 1 << 31}
    tenants = {
        t: {
            "tier": TIER,
            "weight": 1,
            "api_keys": [KEYS[t]],
            "max_queued": 50_000,
            "max_queued_bytes": 1 << 30,
        }
        for t in TENANTS
    }
    tenants[CAPACITY_TENANT] = {
        "tier": TIER,
        "api_keys": [bench_overload.key_of(CAPACITY_TENANT)],
    }
    cfg["tenants"] = tenants
    return cfg


# ---- one tenant's client (a process of its own) ----------------------------------------------


async def client_main(args: argparse.Namespace) -> None:
    """Send on a Poisson schedule from ``start_at`` (time.monotonic, shared by the
    processes of one machine) for ``send_s``; write sends and answers to ``out``."""
    channel = grpc.aio.insecure_channel(args.client)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    sizes = [int(x) for x in args.sizes.split(",")]
    requests = [bench_overload.infer_request(n, seed) for seed, n in enumerate(sizes * 2)]
    metadata = (("authorization", f"Bearer {args.key}"),)
    sent: list[float] = []
    done: list[float] = []  # answers OK
    done_tokens: list[int] = []  # and each one's tokens
    failed: list[str] = []
    skipped = 0
    outstanding = 0
    tasks: set[asyncio.Task[None]] = set()

    async def call(i: int) -> None:
        nonlocal outstanding
        try:
            request = requests[i % len(requests)]
            await stub.ModelInfer(request, metadata=metadata, timeout=CALL_DEADLINE_S)
            done.append(time.monotonic())
            done_tokens.append(request.inputs[0].shape[1])
        except grpc.aio.AioRpcError as err:
            failed.append(f"{err.code().name}: {err.details()}")
        finally:
            outstanding -= 1

    rng = random.Random(args.seed)
    await channel.channel_ready()
    now = time.monotonic()
    if args.start_at > now:
        await asyncio.sleep(args.start_at - now)
    start = args.start_at
    at = start + rng.expovariate(args.rate)
    end = start + args.send_s
    i = 0
    while at < end:
        now = time.monotonic()
        while at <= now and at < end:  # a late loop catches up in a burst
            if outstanding >= args.max_outstanding:
                skipped += 1
            else:
                outstanding += 1
                sent.append(time.monotonic())
                task = asyncio.ensure_future(call(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
            at += rng.expovariate(args.rate)
        wait = at - time.monotonic()
        await asyncio.sleep(wait if wait > 0.0005 else 0)
    Path(args.out).write_text(
        json.dumps(
            {
                "sent": sent,
                "done": done,
                "done_tokens": done_tokens,
                "failed": failed,
                "skipped": skipped,
            }
        )
    )
    for task in list(tasks):
        task.cancel()
    await channel.close(grace=0)


@contextlib.contextmanager
def clients(
    url: str,
    rates: dict[str, float],
    start_at: float,
    send_s: float,
    tmp: Path,
    max_outstanding: int,
    sizes: tuple[int, ...],
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for n, tenant in enumerate(TENANTS):
            cmd = [
                sys.executable, "-m", "benchmarks.bench_fairness_time",
                "--client", url, "--key", KEYS[tenant], "--rate", f"{rates[tenant]:.3f}",
                "--start-at", f"{start_at:.6f}", "--send-s", f"{send_s:.3f}",
                "--max-outstanding", str(max_outstanding), "--seed", str(n + 1),
                "--out", str(tmp / f"{tenant}.json"),
                "--sizes", ",".join(map(str, sizes)),
            ]  # fmt: skip
            log = (tmp / f"{tenant}.log").open("wb")
            procs[tenant] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


# ---- the run ---------------------------------------------------------------------------------


def scrape(url: str) -> dict[str, Any]:
    """Tokens served per tenant, the tenants with queued work (a DRR deficit), and the
    fairness gauges of the tenants' tier (None while they have no sample): the largest
    normalised service difference and Jain's index over the last ``WINDOW_S`` whole
    seconds, with the whole second that window ends at where the scrape did not straddle
    one (the core's clock is this process's ``time.monotonic``; None where it did)."""
    before = time.monotonic()
    page = testing.scrape(url, timeout=5)
    after = time.monotonic()
    return {
        "tokens": page.by_label("fair_served_tokens_total", "tenant", endpoint=MODEL),
        "backlogged": sorted(page.label_values("fair_drr_deficit", "tenant", endpoint=MODEL)),
        "gap": page.by_label("fair_service_gap", "tier", endpoint=MODEL).get(TIER),
        "jain": page.by_label("fair_jain_index", "tier", endpoint=MODEL).get(TIER),
        "window_end": math.floor(before) if math.floor(before) == math.floor(after) else None,
    }


# Per tenant, from the request log: its requests' dispatch times, sorted, and the running
# sum of their costs (from 0: the cost dispatched before the i-th is element i).
Dispatches = dict[str, tuple[np.ndarray, np.ndarray]]


def log_dispatches(lines: Iterable[str], wall_minus_mono: float) -> Dispatches:
    """Each ``embed`` request the request log says was served, per tenant: when it was
    dispatched, its arrival (the line's time less its latency, on the monotonic clock:
    ``wall_minus_mono`` is time.time() - time.monotonic()) plus its time in the core's
    queue, and its cost, its input tokens (a token-cost endpoint's row)."""
    rows: dict[str, list[tuple[float, float]]] = {}
    for line in lines:
        if REQUEST_LOGGER not in line:
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            continue  # another process's line, or one cut off at the end
        if (
            doc.get("logger") != REQUEST_LOGGER
            or doc.get("endpoint") != MODEL
            or doc.get("outcome") != "dispatched"
            or "queued_ms" not in doc
        ):
            continue
        arrived = doc["ts"] - wall_minus_mono - doc["latency_ms"] / 1e3
        rows.setdefault(doc["tenant"], []).append(
            (arrived + doc["queued_ms"] / 1e3, float(doc["tokens_in"]))
        )
    out: Dispatches = {}
    for tenant, served in rows.items():
        served.sort()
        when = np.asarray([w for w, _ in served])
        out[tenant] = (when, np.concatenate(([0.0], np.cumsum([c for _, c in served]))))
    return out


def served_between(dispatches: Dispatches, tenant: str, start: float, end: float) -> float:
    """The cost ``tenant`` was dispatched in [start, end) (``log_dispatches``)."""
    if tenant not in dispatches:
        return 0.0
    when, running = dispatches[tenant]
    first, last = np.searchsorted(when, [start, end], side="left")
    return float(running[last] - running[first])


def offline_window(
    dispatches: Dispatches, end: float, weights: dict[str, float]
) -> tuple[float, float]:
    """The gauges' figures for the window of ``WINDOW_S`` whole seconds ending at ``end``,
    from the request log (``log_dispatches``): the service difference and Jain's index
    of the tenants' cost dispatched in it, each over its weight."""
    normalised = [
        served_between(dispatches, t, end - WINDOW_S, end) / w for t, w in weights.items()
    ]
    return service_gap(normalised), jain_index(normalised)


def gauge_check(
    series: list[dict[str, Any]],
    dispatches: Dispatches,
    origin: float,
    span: tuple[float, float],
    bound: float | None,
) -> dict[str, Any]:
    """The gauges against the request log, for each scrape whose window lies in the
    measured ``span`` (seconds from ``origin``, the monotonic start) and has a sample:
    the gauge's and the log's service difference and Jain's index, their disagreement,
    and the difference against the proven bound (theorem A: q + C, in tokens; None for
    fifo, which has none)."""
    weights = dict.fromkeys(TENANTS, 1.0)
    rows = []
    for snap in series:
        end = snap.get("window_end")
        if end is None or snap.get("gap") is None or snap.get("jain") is None:
            continue
        if not (span[0] <= end - WINDOW_S - origin and end - origin <= span[1]):
            continue
        gap, jain = offline_window(dispatches, end, weights)
        rows.append((end - origin, snap["gap"], gap, snap["jain"], jain))
    if not rows:
        return {"windows": 0}
    arr = np.asarray(rows)
    served = sum(served_between(dispatches, t, origin + span[0], origin + span[1]) for t in TENANTS)
    per_window = served / max(1e-9, span[1] - span[0]) * WINDOW_S
    disagree = np.abs(arr[:, 1] - arr[:, 2])
    return {
        "windows": len(rows),
        "bound_tokens": bound,
        "gap_gauge_max": float(arr[:, 1].max()),
        "gap_gauge_mean": float(arr[:, 1].mean()),
        "gap_log_max": float(arr[:, 2].max()),
        "gap_log_mean": float(arr[:, 2].mean()),
        "jain_gauge_min": float(arr[:, 3].min()),
        "jain_log_min": float(arr[:, 4].min()),
        "gap_disagreement_tokens_median": float(np.median(disagree)),
        "gap_disagreement_tokens_max": float(disagree.max()),
        "gap_disagreement_over_window_service_max": float(disagree.max() / per_window),
        "jain_disagreement_max": float(np.abs(arr[:, 3] - arr[:, 4]).max()),
        "series": [[float(x) for x in row] for row in rows],
    }


def run_target(
    name: str,
    cfg: dict[str, Any],
    triton_url: str,
    workers: int | None,
    source: Path | None,
    rates: dict[str, float],
    warmup_s: float,
    seconds: float,
    max_outstanding: int,
    sizes: tuple[int, ...] = SIZES["512"],
    gauges: bool = False,
) -> dict[str, Any]:
    """One target's run (``summarise``); ``gauges``: the frontend writes its request log,
    and its fairness gauges are checked against it (``gauge_check``)."""
    series: list[dict[str, Any]] = []
    embed = cfg["endpoints"][MODEL]
    turn = None if cfg["scheduling"] == "fifo" else embed.get("quantum", embed["max_batch_tokens"])
    log_level = "INFO" if gauges else None
    with (
        frontend(cfg, triton_url, workers=workers, source=source, log_level=log_level) as fe,
        tempfile.TemporaryDirectory() as tmp_name,
    ):
        tmp = Path(tmp_name)
        metrics_url = f"http://127.0.0.1:{fe.metrics_port}/metrics"
        start_at = time.monotonic() + START_DELAY_S
        send_s = warmup_s + seconds + 1.0
        progress(
            f"{name}: a {rates['a']:.0f}/s, b {rates['b']:.0f}/s of requests of "
            f"{'/'.join(map(str, sorted(set(sizes))))} tokens, "
            f"{warmup_s:g} s warm-up + {seconds:g} s"
        )
        with clients(fe.grpc_url, rates, start_at, send_s, tmp, max_outstanding, sizes) as procs:
            next_scrape = start_at
            next_print = start_at + 10
            while (now := time.monotonic()) < start_at + warmup_s + seconds + SCRAPE_S:
                for tenant, proc in procs.items():
                    if proc.poll() is not None:
                        log = (tmp / f"{tenant}.log").read_text()[-3000:]
                        raise RuntimeError(f"client {tenant} exited early:\n{log}")
                if now >= start_at:
                    try:
                        snap = scrape(metrics_url)
                    except OSError as err:  # a scrape lost to a loaded machine: the next
                        progress(f"  scrape failed ({err}); going on")  # one counts it
                        next_scrape += SCRAPE_S
                        continue
                    series.append({"t": time.monotonic() - start_at, **snap})
                    if now >= next_print:
                        tok = snap["tokens"]
                        progress(
                            f"  t={now - start_at:5.1f} s  served tokens a "
                            f"{tok.get('a', 0):>11,.0f}  b {tok.get('b', 0):>11,.0f}  "
                            f"backlogged {snap['backlogged']}"
                        )
                        next_print += 10
                next_scrape += SCRAPE_S
                time.sleep(max(0.0, next_scrape - time.monotonic()))
            for tenant, proc in procs.items():
                proc.wait(60)
                if proc.returncode != 0:
                    log = (tmp / f"{tenant}.log").read_text()[-3000:]
                    raise RuntimeError(f"client {tenant} failed:\n{log}")
        logs = {t: json.loads((tmp / f"{t}.json").read_text()) for t in TENANTS}
        checked = None
        if gauges:
            wall_minus_mono = time.time() - time.monotonic()
            with fe.log_path.open() as lines:
                dispatches = log_dispatches(lines, wall_minus_mono)
            span = (warmup_s, warmup_s + seconds)
            bound = None if turn is None else turn + max(sizes)
            checked = gauge_check(series, dispatches, start_at, span, bound)
    for log in logs.values():
        log["sent"] = [x - start_at for x in log["sent"]]
        log["done"] = [x - start_at for x in log["done"]]
        order = np.argsort(log["done"], kind="stable")  # each answer's tokens, by time
        log["done_tokens"] = np.asarray(log["done_tokens"], dtype=float)[order]
    out = summarise(name, series, logs, warmup_s, seconds, turn)
    if checked is not None:
        out["gauges"] = checked
        progress(f"{name}: {gauge_line(checked)}")
    return out


def gauge_line(checked: dict[str, Any]) -> str:
    if not checked["windows"]:
        return "gauges: no window of theirs inside the measured span"
    return (
        f"gauges over {checked['windows']} scrapes of {WINDOW_S} s windows: Jain min "
        f"{checked['jain_gauge_min']:.5f} (log {checked['jain_log_min']:.5f}); service "
        f"difference max {checked['gap_gauge_max']:,.0f} tokens (log "
        f"{checked['gap_log_max']:,.0f}; bound {_tokens(checked['bound_tokens'])}); gauge - log "
        f"median {checked['gap_disagreement_tokens_median']:,.0f}, max "
        f"{checked['gap_disagreement_tokens_max']:,.0f} tokens "
        f"({checked['gap_disagreement_over_window_service_max']:.2%} of a window's service)"
    )


# ---- the metric ------------------------------------------------------------------------------


def _outstanding_min(log: dict[str, Any], edges: np.ndarray) -> np.ndarray:
    """Per window [edges[k], edges[k+1]): the fewest calls the client had outstanding."""
    sent = np.sort(np.asarray(log["sent"]))
    done = np.sort(np.asarray(log["done"]))
    times = np.concatenate([sent, done])
    steps = np.concatenate([np.ones(len(sent)), -np.ones(len(done))])
    order = np.argsort(times, kind="stable")
    times, level = times[order], np.cumsum(steps[order])
    out = np.empty(len(edges) - 1)
    for k in range(len(edges) - 1):
        lo, hi = np.searchsorted(times, [edges[k], edges[k + 1]])
        start_level = level[lo - 1] if lo > 0 else 0.0
        inside = level[lo:hi]
        out[k] = min(start_level, inside.min()) if len(inside) else start_level
    return out


def window_stats(
    served: dict[str, np.ndarray], keep: np.ndarray, seconds: float, turn: float | None
) -> dict:
    """The per-window figures of ``served`` (tokens per window per tenant), over the
    windows ``keep`` marks (both backlogged).

    ``one_turn_floor``: what the metric is when DRR alternates turns of ``turn`` tokens
    exactly: a window then holds as many of a's turns as of b's, or one more of one of
    them, about equally often, so mean(d) ~ turn / 2 and the ratio ~ turn / (2 x tokens
    per window). No scheduler that serves whole turns does better on average."""
    a, b = served["a"][keep], served["b"][keep]
    d = np.abs(a - b)
    total = a + b
    mean_total = float(total.mean()) if len(total) else float("nan")
    return {
        "windows": len(d),
        "windows_dropped": int((~keep).sum()),
        "avg_diff_over_throughput": float(d.mean() / mean_total) if len(d) else None,
        "max_diff_over_throughput": float(d.max() / mean_total) if len(d) else None,
        "avg_diff_tokens": float(d.mean()) if len(d) else None,
        "max_diff_tokens": float(d.max()) if len(d) else None,
        "mean_tokens_per_window": mean_total,
        "share_a": float(a.sum() / total.sum()) if total.sum() else None,
        # The signed difference summed over the windows: what is left of it at the end.
        "net_diff_over_throughput": float(abs((a - b).sum()) / total.sum())
        if total.sum()
        else None,
        "one_turn_floor": turn / 2 / mean_total if turn and len(d) else None,
        "diff_tokens": [float(x) for x in (served["a"] - served["b"])],
        "seconds": seconds,
    }


def batch_mix(done: dict[str, np.ndarray], origin: float, end: float) -> dict[str, Any]:
    """How each batch was shared: the answers of one batch reach both clients within a few
    ms, and batches are ``BATCH_GAP_S`` or more apart, so the completions split into
    batches at the gaps. Returns the most frequent compositions ("rows of a + rows of b":
    batches), and the fraction of batches served to one tenant alone."""
    times = np.concatenate([done[t] for t in TENANTS])
    who = np.concatenate([np.full(len(done[t]), i) for i, t in enumerate(TENANTS)])
    keep = (times >= origin) & (times <= end)
    times, who = times[keep], who[keep]
    order = np.argsort(times, kind="stable")
    times, who = times[order], who[order]
    if not len(times):
        return {"batches": 0}
    cuts = np.flatnonzero(np.diff(times) > BATCH_GAP_S) + 1
    mixes: dict[str, int] = {}
    alone = 0
    for group in np.split(who, cuts):
        n_b = int(group.sum())
        n_a = len(group) - n_b
        alone += n_a == 0 or n_b == 0
        key = f"{n_a}+{n_b}"
        mixes[key] = mixes.get(key, 0) + 1
    batches = len(cuts) + 1
    top = dict(sorted(mixes.items(), key=lambda kv: -kv[1])[:6])
    return {"batches": batches, "one_tenant_fraction": alone / batches, "top": top}


def cumulative_stats(t: np.ndarray, sa: np.ndarray, sb: np.ndarray, span: float) -> dict:
    """max |S_a - S_b| over the span (S from the span's start), and in seconds of the
    joint throughput."""
    diff = np.abs(sa - sb)
    rate = (sa[-1] + sb[-1]) / span if span > 0 else float("nan")
    worst = float(diff.max()) if len(diff) else float("nan")
    return {
        "max_cumulative_diff_tokens": worst,
        "max_cumulative_diff_s": worst / rate if rate > 0 else None,
        "final_diff_tokens": float(sa[-1] - sb[-1]) if len(sa) else None,
        "tokens_per_s": float(rate),
    }


def summarise(
    name: str,
    series: list[dict[str, Any]],
    logs: dict[str, dict[str, Any]],
    warmup_s: float,
    seconds: float,
    turn: float | None,
) -> dict[str, Any]:
    """The figures of one target; ``turn``: the tokens one DRR turn sends (None: fifo)."""
    origin, end = warmup_s, warmup_s + seconds
    out: dict[str, Any] = {
        "label": name,
        "served_tokens": {},
        "clients": {
            t: {
                "sent": len(log["sent"]),
                "answered": len(log["done"]),
                "failed": len(log["failed"]),
                "failures": sorted(set(log["failed"])),
                "skipped_at_cap": log["skipped"],
            }
            for t, log in logs.items()
        },
        "frontend": {},
        "client": {},
    }
    # Frontend: scrapes inside the span; windows between scrapes W apart (by index).
    ts = np.asarray([s["t"] for s in series])
    inside = np.flatnonzero((ts >= origin - SCRAPE_S / 2) & (ts <= end + SCRAPE_S / 2))
    tok = {t: np.asarray([series[i]["tokens"].get(t, 0.0) for i in inside]) for t in TENANTS}
    both = np.asarray([set(TENANTS) <= set(series[i]["backlogged"]) for i in inside])
    t_in = ts[inside]
    out["frontend"]["both_in_drr_fraction"] = float(both.mean()) if len(both) else None
    out["served_tokens"] = {t: float(tok[t][-1] - tok[t][0]) for t in TENANTS}
    for w in WINDOWS_S:
        step = max(1, round(w / SCRAPE_S))
        idx = np.arange(0, len(t_in), step)
        served = {t: np.diff(tok[t][idx]) for t in TENANTS}
        edges = t_in[idx]
        backlog = {t: _outstanding_min(logs[t], edges) for t in TENANTS}
        keep = (backlog["a"] >= BACKLOG_ROWS) & (backlog["b"] >= BACKLOG_ROWS)
        out["frontend"][f"w{w:g}"] = window_stats(served, keep, w, turn)
        out["frontend"][f"w{w:g}"]["edges"] = [float(x) for x in edges]
    out["frontend"].update(
        cumulative_stats(t_in, tok["a"] - tok["a"][0], tok["b"] - tok["b"][0], t_in[-1] - t_in[0])
    )
    # Clients: exact windows on a regular grid, from each answer's completion time.
    done = {t: np.sort(np.asarray(logs[t]["done"])) for t in TENANTS}
    # tokens answered to each tenant up to its i-th answer (0 before the first)
    upto = {t: np.concatenate([[0.0], np.cumsum(logs[t]["done_tokens"])]) for t in TENANTS}
    for w in WINDOWS_S:
        edges = origin + w * np.arange(int(seconds / w + 1e-9) + 1)
        served = {t: np.diff(upto[t][np.searchsorted(done[t], edges)]) for t in TENANTS}
        backlog = {t: _outstanding_min(logs[t], edges) for t in TENANTS}
        keep = (backlog["a"] >= BACKLOG_ROWS) & (backlog["b"] >= BACKLOG_ROWS)
        out["client"][f"w{w:g}"] = window_stats(served, keep, w, turn)
        out["client"][f"w{w:g}"]["min_outstanding"] = {t: float(backlog[t].min()) for t in TENANTS}
    out["client"]["batch_mix"] = batch_mix(done, origin, end)
    events = np.sort(np.concatenate([done[t] for t in TENANTS]))
    events = events[(events >= origin) & (events <= end)]
    if len(events):
        cum = {
            t: upto[t][np.searchsorted(done[t], events, side="right")]
            - upto[t][np.searchsorted(done[t], origin)]
            for t in TENANTS
        }
        out["client"].update(cumulative_stats(events, cum["a"], cum["b"], seconds))
    out["series"] = [
        {"t": round(s["t"], 4), "tokens": s["tokens"], "backlogged": s["backlogged"]}
        for s in series
    ]
    f1, c1 = out["frontend"]["w1"], out["client"]["w1"]
    progress(
        f"{name}: avg diff / throughput, 1 s windows: frontend "
        f"{_fmt(f1['avg_diff_over_throughput'])}, clients {_fmt(c1['avg_diff_over_throughput'])}"
        f" ({f1['windows']} / {c1['windows']} windows both backlogged); 5 s: "
        f"{_fmt(out['frontend']['w5']['avg_diff_over_throughput'])}, "
        f"{_fmt(out['client']['w5']['avg_diff_over_throughput'])}; cumulative max "
        f"{out['frontend']['max_cumulative_diff_tokens']:,.0f} tokens "
        f"({_num(out['frontend']['max_cumulative_diff_s'])} s); share of a "
        f"{_fmt(f1['share_a'])}; batches a+b rows {out['client']['batch_mix'].get('top')}"
    )
    return out


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _tokens(x: float | None) -> str:
    return "none" if x is None else f"{x:,.0f}"


def _num(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.3f}"


# ---- report ----------------------------------------------------------------------------------


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["targets"])
    fig, axes = plt.subplots(
        2, len(names), figsize=(4.3 * len(names), 7.2), squeeze=False, sharey="row"
    )
    warmup = results["warmup_s"]
    for col, name in enumerate(names):
        res = results["targets"][name]
        top, bottom = axes[0][col], axes[1][col]
        t = np.asarray([s["t"] for s in res["series"]])
        for tenant, color in (("a", "C0"), ("b", "C1")):
            y = np.asarray([s["tokens"].get(tenant, 0.0) for s in res["series"]]) / 1e6
            rate = results["rates_per_s"][tenant]
            top.plot(t, y, color=color, label=f"{tenant} (sends {rate:.0f}/s)")
        top.axvline(warmup, color="k", ls=":", lw=0.8, label="measured from here")
        top.set_title(res["label"], fontsize=10)
        top.set_xlabel("seconds")
        top.grid(alpha=0.3)
        top.legend(fontsize=7)
        for source, style in (("frontend", "-"), ("client", ":")):
            win = res[source]["w1"]
            diff = np.asarray(win["diff_tokens"]) / 1e3
            x = np.arange(len(diff)) + 0.5
            if source == "frontend":
                x = (np.asarray(win["edges"][:-1]) + np.asarray(win["edges"][1:])) / 2 - warmup
            bottom.step(
                x,
                diff,
                where="mid",
                ls=style,
                label=f"{source}: avg |d| / throughput {_fmt(win['avg_diff_over_throughput'])}",
            )
        bottom.axhline(0, color="k", lw=0.6)
        bottom.set_xlabel("seconds into the measured span")
        bottom.grid(alpha=0.3)
        bottom.legend(fontsize=7)
    axes[0][0].set_ylabel("cumulative served tokens (millions)")
    axes[1][0].set_ylabel("served a - served b per 1 s window (thousand tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    progress(f"plot written to {path.relative_to(ROOT)}")


def print_table(results: dict[str, Any]) -> None:
    print()
    print(
        f"{'target':<30} {'W':>3} {'frontend avg':>12} {'max':>7} {'clients avg':>11} "
        f"{'max':>7} {'1-turn floor':>12} {'cum. max tokens':>15} {'(s)':>6} {'share a':>7}"
    )
    for res in results["targets"].values():
        name = res["label"]
        for w in WINDOWS_S:
            f, c = res["frontend"][f"w{w:g}"], res["client"][f"w{w:g}"]
            cum = res["frontend"]
            print(
                f"{name:<30} {w:>3g} {_fmt(f['avg_diff_over_throughput']):>12} "
                f"{_fmt(f['max_diff_over_throughput']):>7} "
                f"{_fmt(c['avg_diff_over_throughput']):>11} "
                f"{_fmt(c['max_diff_over_throughput']):>7} {_fmt(f['one_turn_floor']):>12} "
                f"{cum['max_cumulative_diff_tokens']:>15,.0f} "
                f"{_num(cum['max_cumulative_diff_s']):>6} {_fmt(f['share_a']):>7}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=50.0, help="measured span")
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--targets", nargs="*", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--ref", default=BASELINE_REF, help="the frontend before the split")
    parser.add_argument("--max-outstanding", type=int, default=DEFAULT_MAX_OUTSTANDING)
    parser.add_argument("--quick", action="store_true", help="3 s warm-up, 10 s measured")
    parser.add_argument(
        "--sizes",
        default="512",
        help="the requests' tokens: 512 (each 512, the default: results in "
        "fairness_time.json) or mixed (64 to 2,048: results in fairness_time_mixed.json); "
        "as a client, the sizes it sends in turn",
    )
    parser.add_argument(
        "--gauges",
        action="store_true",
        help="the frontend writes its request log (INFO), and its fairness gauges "
        "(fair_jain_index, fair_service_gap) are checked against the same figures "
        "computed from it; results under each fair target's 'gauges'",
    )
    # Internal: run as one tenant's client.
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--send-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        asyncio.run(client_main(args))
        return
    sizes = SIZES[args.sizes]
    mean_tokens = sum(sizes) / len(sizes)
    suffix = ("" if args.sizes == "512" else f"_{args.sizes}") + ("_gauges" if args.gauges else "")
    warmup_s, seconds = (3.0, 10.0) if args.quick else (args.warmup_s, args.seconds)
    results: dict[str, Any] = {
        "warmup_s": warmup_s,
        "seconds": seconds,
        "tokens": TOKENS if len(sizes) == 1 else list(sizes),
        "rates_x_capacity": RATES,
        "ref": args.ref,
        "max_outstanding": args.max_outstanding,
        "scrape_s": SCRAPE_S,
        "backlog_rows": BACKLOG_ROWS,
        "targets": {},
    }
    with contextlib.ExitStack() as stack:
        needs_ref = any(TARGETS[n][4] for n in args.targets)
        baseline = stack.enter_context(baseline_checkout(args.ref)) if needs_ref else None
        tri = stack.enter_context(
            triton(extra_args=["--model-control-mode=explicit", f"--load-model={MODEL}"])
        )
        with frontend(bench_config("fair", {}), tri.grpc_url, workers=1) as fe:
            capacity = asyncio.run(
                bench_overload.measure_capacity(
                    fe.grpc_url, tri.metrics_url, TOKENS, 24, 3.0 if args.quick else 8.0,
                    warm_up=True,
                )
            )  # fmt: skip
        results["capacity"] = capacity
        # (the capacity in tokens/s, measured with TOKENS-token rows, sets the rates of
        # requests of the mean size: a little more than 1x and 2x with smaller rows)
        per_s = capacity["tokens_per_s"] / mean_tokens
        rates = {t: RATES[t] * per_s for t in TENANTS}
        results["rates_per_s"] = rates
        for name in args.targets:
            label, mode, workers, overrides, old = TARGETS[name]
            source = baseline if old else None
            if old and args.ref != BASELINE_REF:
                label = f"--ref {args.ref}, fair"
            results["targets"][name] = run_target(
                label,
                bench_config(mode, overrides, source, padded=len(sizes) > 1),
                tri.grpc_url,
                workers,
                source,
                rates,
                warmup_s,
                seconds,
                args.max_outstanding,
                sizes,
                gauges=args.gauges,
            )
    print_table(results)
    write_result(f"fairness_time{suffix}", results)
    plot(results, RESULTS / f"fairness_time{suffix}.png")


if __name__ == "__main__":
    main()
