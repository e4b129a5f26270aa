"""Latency added at low load: perf_analyzer at concurrency 1, Triton direct and the frontend.

One run, one Triton (embedded, as bench_throughput starts it), ``embed`` with 128-token
requests, perf_analyzer's plain command (``--shape INPUT_IDS:128``, random ids) at
``--concurrency-range 1``, over gRPC and HTTP, against:

- Triton directly;
- with ``--echo``: a bare grpc.aio KServe server that answers at once
  (``benchmarks/echo_server.py``, gRPC only): what one grpc.aio hop costs at c=1 with no
  work behind it, the floor of any Python shell;
- with ``--relay``: a bare relay (``benchmarks/relay_floor.py grpc``, gRPC only): a
  grpc.aio server passing each call's bytes to Triton and the answer's bytes back, so its
  added p50 is what one Python hop in the data path adds at c=1 (a server and a client
  call, two more wake-ups), doing nothing else: the floor of the latency any relaying
  frontend adds;
- the frontend with ``--workers 1`` and ``--workers 2`` (batches to Triton over HTTP,
  ``triton.http_url``, as ``up`` sets it);
- with ``--ref REF``: the same two from that commit (a git worktree of it), in the same
  run, so before and after meet the same machine load.

For each: p50/p99 latency, infer/s, and the p50 the frontend adds over direct (same
protocol). Results: ``benchmarks/results/latency.json``.

    .venv/bin/python -m benchmarks.bench_latency [--interval-ms 3000] [--ref REF]
        [--protocols grpc,http] [--repeat 1] [--echo] [--relay]
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.bench_throughput import KEYS, MODEL, TOKENS, EchoProcess, bench_config, floor_server
from benchmarks.harness import (
    FrontendProcess,
    baseline_checkout,
    frontend,
    load_example_config,
    progress,
    triton,
    write_result,
)
from fair_frontend.kit.testing import perf_analyzer

WARMUP_MS = 1000


def run_pa(url: str, protocol: str, key: str | None, interval_ms: int) -> dict[str, float]:
    headers = [f"authorization: Bearer {key}"] if key else []
    return perf_analyzer(
        MODEL,
        url,
        protocol=protocol,
        concurrency=1,
        shapes=[f"INPUT_IDS:{TOKENS}"],
        headers=headers,
        interval_ms=interval_ms,
        timeout_s=300,
    )


def ref_config(source: Path) -> dict[str, Any]:
    """bench_config's tenants on the example config of an earlier checkout."""
    cfg = load_example_config(source)
    cfg.pop("tier_limits", None)
    cfg["scheduling"] = "fair"
    cfg["tenants"] = {name: {"tier": "standard", "api_keys": [key]} for name, key in KEYS.items()}
    return cfg


@contextlib.contextmanager
def target(
    name: str, tri: Any, source: Path | None
) -> Iterator[FrontendProcess | EchoProcess | None]:
    if name == "direct":
        yield None
        return
    if name == "echo floor":
        with floor_server() as echo:
            yield echo
        return
    if name == "relay floor":
        with floor_server(relay_to=tri.grpc_url) as relay:
            yield relay
        return
    workers = int(name.rsplit(" ", 1)[1])
    cfg = bench_config("fair") if source is None else ref_config(source)
    with frontend(cfg, tri.grpc_url, workers=workers, source=source, http_url=tri.http_url) as fe:
        yield fe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interval-ms", type=int, default=3000)
    parser.add_argument("--ref", default=None, help="also run this commit's frontend")
    parser.add_argument("--protocols", default="grpc,http")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over every target")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--echo", action="store_true", help="also the bare grpc.aio floor")
    parser.add_argument("--relay", action="store_true", help="also the bare relay's latency")
    args = parser.parse_args()
    iv = args.interval_ms
    protocols = args.protocols.split(",")
    floors = [*(["echo floor"] if args.echo else []), *(["relay floor"] if args.relay else [])]
    names = ["direct", *floors] + [f"workers {w}" for w in args.workers.split(",")]
    if args.ref:
        names += [f"{args.ref} workers {w}" for w in args.workers.split(",")]
    out: dict[str, Any] = {
        "model": MODEL,
        "tokens": TOKENS,
        "concurrency": 1,
        "interval_ms": iv,
        "ref": args.ref,
        "runs": {},
    }
    samples: dict[str, dict[str, list[dict[str, float]]]] = {}
    with contextlib.ExitStack() as stack:
        source = stack.enter_context(baseline_checkout(args.ref)) if args.ref else None
        tri = stack.enter_context(triton())
        for round_ in range(args.repeat):
            # Odd rounds run the targets in reverse order: neither version always goes first
            # (this machine's load drifts between minutes).
            for name in names if round_ % 2 == 0 else names[::-1]:
                src = source if args.ref and name.startswith(args.ref) else None
                with target(name, tri, src) as fe:
                    for proto in protocols:
                        if isinstance(fe, EchoProcess):
                            if proto != "grpc":
                                continue
                            url = fe.grpc_url
                        elif fe is None:
                            url = tri.grpc_url if proto == "grpc" else tri.http_url[7:]
                        else:
                            url = fe.grpc_url if proto == "grpc" else fe.http_url
                        key = KEYS["alpha"] if isinstance(fe, FrontendProcess) else None
                        run_pa(url, proto, key, WARMUP_MS)
                        r = run_pa(url, proto, key, iv)
                        samples.setdefault(name, {}).setdefault(proto, []).append(r)
                        progress(
                            f"{name} {proto}: p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms, "
                            f"{r['throughput']:.0f} infer/s"
                        )
    # Per target and protocol: the median over rounds of each figure.
    for name, per in samples.items():
        out["runs"][name] = {}
        for proto, rs in per.items():
            out["runs"][name][proto] = {
                k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]
            } | {"rounds": len(rs)}
    for _name, per in out["runs"].items():
        for proto, r in per.items():
            r["added_p50_ms"] = r["p50_ms"] - out["runs"]["direct"][proto]["p50_ms"]
    print()
    print(f"{MODEL}, perf_analyzer --shape INPUT_IDS:{TOKENS}, c=1, windows of {iv} ms")
    print(f"{'target':<20} {'proto':>5} {'p50':>8} {'p99':>8} {'infer/s':>8} {'added p50':>10}")
    for name, per in out["runs"].items():
        for proto, r in per.items():
            print(
                f"{name:<20} {proto:>5} {r['p50_ms']:>6.2f}ms {r['p99_ms']:>6.2f}ms "
                f"{r['throughput']:>8.0f} {r['added_p50_ms']:>8.2f}ms"
            )
    write_result("latency", out)


if __name__ == "__main__":
    main()
