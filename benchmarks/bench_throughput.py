"""Throughput, latency and CPU per request: perf_analyzer against Triton and the frontend.

One run, one Triton (its dynamic batcher on, as a Triton user runs it), ``embed`` over
gRPC with 128-token requests, perf_analyzer's plain command (``--shape INPUT_IDS:128``,
random ids, no data file), as users run it, at concurrency 16 and 128, against:

- Triton directly;
- a bare grpc.aio KServe server that answers without doing anything
  (``benchmarks/echo_server.py``): the CPU one call costs in grpc.aio itself, the floor
  of any shell;
- a bare relay (``benchmarks/relay_floor.py grpc``): a grpc.aio server that passes each
  call's bytes to Triton over grpc.aio and its answer's bytes back, decoding nothing: the
  floor of a process that relays each call (a server and a client call per request),
  below which no frontend that stays in the data path can go;
- the frontend as it was before the transport split (``--baseline-ref``, one process,
  run from a git worktree of that commit), unless ``--no-baseline``;
- the frontend with ``--workers 1`` (one process) and with shell processes (``--shells``,
  2 by default: the cores of these machines).

For each: throughput (ratio to direct), p50 latency, the CPU the frontend's processes
(core and shells) spent per request, from /proc over the run, per request counted by the
frontend's own metrics, and the rows per Triton execution over the run (Triton's own
statistics: how full the batches it ran were), beside the rows per batch the core formed
and Triton's executions per such batch (above 1: the parts of a one-hop batch ran
apart). Then work conservation: two tenants,
each driven by its own perf_analyzer (concurrency 8 each) at once, through the frontend
in ``fair`` and in ``fifo`` mode, alternating which goes first: total throughput fair /
fifo (target >= 0.97).

    .venv/bin/python -m benchmarks.bench_throughput [--interval-ms 5000] [--shells 2]
        [--baseline-ref REF | --no-baseline] [--model-config-name gpu]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import (
    FrontendProcess,
    baseline_checkout,
    frontend,
    load_example_config,
    process_tree_cpu_s,
    progress,
    triton,
    write_result,
)
from fair_frontend.backends.triton.embedded import free_port
from fair_frontend.kit import testing
from fair_frontend.kit.testing import perf_analyzer

MODEL = "embed"
WARMUP_MS = 1500
TOKENS = 128
CONCURRENCY = (16, 128)
KEYS = {"alpha": "alpha-bench-key", "beta": "beta-bench-key"}
# The last commit with the frontend in one process only (before the shells/core split).
BASELINE_REF = "c309e4d"


def bench_config(mode: str, *, padding: bool = True) -> dict[str, Any]:
    cfg = load_example_config()
    cfg.pop("tier_limits", None)
    cfg["scheduling"] = mode
    cfg["tenants"] = {name: {"tier": "standard", "api_keys": [key]} for name, key in KEYS.items()}
    if not padding:
        # The baseline's config schema differs (lengths travelled as a model input then);
        # every request here is 128 tokens wide, so no endpoint needs to pad.
        for endpoint in cfg["endpoints"].values():
            endpoint.pop("padding", None)
            endpoint.pop("max_tokens_parameter", None)
            endpoint.pop("max_tokens_default", None)
            endpoint.pop("max_tokens_limit", None)
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
        timeout_s=600,
    )


def warm_up(url: str, key: str | None) -> None:
    """A short perf_analyzer run whose figures are not kept: one that cannot settle (a
    busy machine) has still warmed the target up."""
    try:
        run_pa(url, 16, key, WARMUP_MS)
    except RuntimeError as err:
        progress(f"  warm-up did not settle ({str(err).strip().splitlines()[-1]}); going on")


def triton_counts(tri: Any) -> tuple[int, int]:
    """Triton's own count of ``MODEL``'s rows (inferences) and executions, every version
    (its statistics extension): over a run, its rows per execution."""
    with urllib.request.urlopen(f"{tri.http_url}/v2/models/{MODEL}/stats", timeout=10) as r:
        stats = json.load(r)["model_stats"]
    return (
        sum(int(s["inference_count"]) for s in stats),
        sum(int(s["execution_count"]) for s in stats),
    )


def requests_total(metrics_url: str) -> float:
    """Requests the frontend has counted, every tenant and outcome."""
    return testing.scrape(metrics_url).sum("fair_requests_total")


def measure(
    run: Callable[[], dict[str, float]], fe: FrontendProcess | EchoProcess | None
) -> dict[str, float]:
    """One perf_analyzer run (``run``); with ``fe``, its server's CPU per request over it."""
    if fe is None:
        return run()
    pid = fe.process.pid
    if isinstance(fe, EchoProcess):  # no metrics: count by perf_analyzer's own figures
        cpu0, t0 = process_tree_cpu_s(pid), time.time()
        result = run()
        cpu1, t1 = process_tree_cpu_s(pid), time.time()
        spent = sum(cpu1.values()) - sum(cpu0.values())
        result["cpu_us_per_request"] = spent / (t1 - t0) / result["throughput"] * 1e6
        result["cores"] = spent / (t1 - t0)
        return result
    metrics = f"http://127.0.0.1:{fe.metrics_port}/metrics"
    cpu0, m0, t0 = process_tree_cpu_s(pid), testing.scrape(metrics), time.time()
    result = run()
    cpu1, m1, t1 = process_tree_cpu_s(pid), testing.scrape(metrics), time.time()
    requests = max(1.0, m1.sum("fair_requests_total") - m0.sum("fair_requests_total"))
    # The batches the core formed (rows per batch), to set beside Triton's executions.
    batches = m1.sum("fair_batch_rows_count") - m0.sum("fair_batch_rows_count")
    rows = m1.sum("fair_batch_rows_sum") - m0.sum("fair_batch_rows_sum")
    result["core_batches"] = batches
    result["core_rows_per_batch"] = rows / max(1.0, batches)
    for part in ("core", "shells"):
        result[f"{part}_cpu_us_per_request"] = (cpu1[part] - cpu0[part]) / requests * 1e6
    spent = sum(cpu1.values()) - sum(cpu0.values())
    result["cpu_us_per_request"] = spent / requests * 1e6
    result["cores"] = spent / (t1 - t0)
    return result


@dataclass
class EchoProcess:
    """Quacks like ``FrontendProcess`` for ``measure``: a floor's process (the echo
    server's, the bare relay's)."""

    process: subprocess.Popen[bytes]
    grpc_port: int

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


@contextlib.contextmanager
def floor_server(relay_to: str | None = None) -> Iterator[EchoProcess]:
    """A floor's process: the echo server, or with ``relay_to`` (a Triton's gRPC address)
    the bare relay."""
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.echo_server", str(port)]
    if relay_to is not None:
        cmd = [sys.executable, "-m", "benchmarks.relay_floor", "grpc", "--port", str(port)]
        cmd += ["--triton-grpc", relay_to]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{cmd[2]} did not start")
            time.sleep(0.05)
        yield EchoProcess(proc, port)
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def target(name: str, tri: Any, shells: int, ref: str | None) -> Iterator[Any]:
    tri_url = tri.grpc_url
    if name == "direct":
        yield None
    elif name == "echo floor":
        with floor_server() as echo:
            yield echo
    elif name == "relay floor":
        with floor_server(relay_to=tri_url) as relay:
            yield relay
    elif name == "before":
        assert ref is not None
        with (
            baseline_checkout(ref) as source,
            frontend(
                bench_config("fair", padding=False), tri_url, workers=None, source=source
            ) as fe,
        ):
            yield fe
    else:
        workers = 1 if name == "workers 1" else shells
        with frontend(bench_config("fair"), tri_url, workers=workers, http_url=tri.http_url) as fe:
            yield fe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interval-ms", type=int, default=5000)
    parser.add_argument("--shells", type=int, default=2)
    parser.add_argument("--baseline-ref", default=BASELINE_REF)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--model-config-name", default=None, help="e.g. gpu (on a GPU host)")
    args = parser.parse_args()
    iv = args.interval_ms
    names = ["direct", "echo floor", "relay floor", *([] if args.no_baseline else ["before"])]
    names.append("workers 1")
    names.append(f"workers {args.shells}")
    out: dict[str, Any] = {"model": MODEL, "tokens": TOKENS, "interval_ms": iv, "runs": {}}
    out["baseline_ref"] = None if args.no_baseline else args.baseline_ref
    kwargs = {"model_config_name": args.model_config_name} if args.model_config_name else {}
    with triton(**kwargs) as tri:
        for name in names:
            with target(name, tri, args.shells, args.baseline_ref) as fe:
                url = tri.grpc_url if fe is None else fe.grpc_url
                key = KEYS["alpha"] if isinstance(fe, FrontendProcess) else None
                progress(f"{name}: warm-up")
                warm_up(url, key)
                out["runs"][name] = {}
                for c in CONCURRENCY:
                    progress(f"{name}: perf_analyzer, concurrency {c}")
                    rows0, runs0 = triton_counts(tri)
                    r = measure(lambda: run_pa(url, c, key, iv), fe)  # noqa: B023
                    rows1, runs1 = triton_counts(tri)
                    # What Triton executed over the run (its answers to the last calls
                    # may be counted a moment late: a ratio over the whole run).
                    r["rows_per_execution"] = (rows1 - rows0) / max(1, runs1 - runs0)
                    if r.get("core_batches"):  # Triton's executions per batch formed
                        r["executions_per_batch"] = (runs1 - runs0) / r["core_batches"]
                    out["runs"][name][str(c)] = r
                    cpu = f", {r['cpu_us_per_request']:.0f} us CPU/request" if fe else ""
                    progress(f"  {r['throughput']:.1f} infer/s, p50 {r['p50_ms']:.1f} ms{cpu}")
        # Work conservation: fair and fifo alternate (fifo first, then fair first), each
        # frontend warmed up first, so neither gains from going second.
        two: dict[str, Any] = {"fair": [], "fifo": []}
        for order in (("fifo", "fair"), ("fair", "fifo")):
            for mode in order:
                with frontend(bench_config(mode), tri.grpc_url, http_url=tri.http_url) as fe:
                    warm_up(fe.grpc_url, KEYS["alpha"])
                    progress(f"two tenants at once through the frontend ({mode}), 8 + 8")
                    with concurrent.futures.ThreadPoolExecutor(2) as pool:
                        futs = {
                            t: pool.submit(run_pa, fe.grpc_url, 8, key, iv)
                            for t, key in KEYS.items()
                        }
                        per_tenant = {t: f.result() for t, f in futs.items()}
                    total = sum(r["throughput"] for r in per_tenant.values())
                    two[mode].append({"per_tenant": per_tenant, "total_throughput": total})
                    progress(f"  total {total:.1f} infer/s")
    out["two_tenants"] = two
    totals = {m: sum(r["total_throughput"] for r in runs) for m, runs in two.items()}
    out["fair_over_fifo"] = totals["fair"] / totals["fifo"]
    direct = out["runs"]["direct"]
    for runs in out["runs"].values():
        for c, r in runs.items():
            r["ratio_to_direct"] = r["throughput"] / direct[c]["throughput"]
    print()
    print(f"embed, gRPC, perf_analyzer --shape INPUT_IDS:{TOKENS}, windows of {iv} ms")
    print(
        f"{'target':<12} {'c':>4} {'infer/s':>9} {'/ direct':>9} {'p50':>8} {'CPU/request':>12}"
        f" {'rows/exec':>10} {'rows/batch':>10} {'exec/batch':>10}"
    )
    for name, runs in out["runs"].items():
        for c, r in runs.items():
            cpu = f"{r['cpu_us_per_request']:>10.0f}us" if "cpu_us_per_request" in r else ""
            formed = (
                f" {r['core_rows_per_batch']:>10.1f} {r['executions_per_batch']:>10.2f}"
                if "executions_per_batch" in r
                else ""
            )
            print(
                f"{name:<12} {c:>4} {r['throughput']:>9.1f} {r['ratio_to_direct']:>9.3f} "
                f"{r['p50_ms']:>6.1f}ms {cpu:>12} {r['rows_per_execution']:>10.1f}{formed}"
            )
    if "before" in out["runs"]:
        for cs in map(str, CONCURRENCY):
            before = out["runs"]["before"][cs]["cpu_us_per_request"]
            for name in names[4:]:
                now = out["runs"][name][cs]["cpu_us_per_request"]
                print(f"CPU per request, before / {name}, c={cs}: {before / now:.2f}x")
    # Each frontend's CPU per request over the two floors', at each concurrency.
    floors = {"echo": out["runs"]["echo floor"], "relay": out["runs"]["relay floor"]}
    out["over_floors"] = {}
    for name, runs in out["runs"].items():
        if name in ("direct", "echo floor", "relay floor"):
            continue
        for c, r in runs.items():
            ratios = {
                f"over_{floor}": r["cpu_us_per_request"] / f[c]["cpu_us_per_request"]
                for floor, f in floors.items()
            }
            out["over_floors"].setdefault(name, {})[c] = ratios
            print(
                f"CPU per request, {name} / echo floor, c={c}: {ratios['over_echo']:.2f}x; "
                f"/ relay floor: {ratios['over_relay']:.2f}x"
            )
    relay = floors["relay"]
    for cs in map(str, CONCURRENCY):
        echo = floors["echo"][cs]["cpu_us_per_request"]
        print(f"relay floor / echo floor, c={cs}: {relay[cs]['cpu_us_per_request'] / echo:.2f}x")
    print(f"work conservation (two tenants, 8+8): fair/fifo {out['fair_over_fifo']:.3f}")
    write_result("throughput", out)


if __name__ == "__main__":
    main()
