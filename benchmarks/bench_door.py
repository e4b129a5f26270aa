"""The door (issue 17, item 2): what refused gRPC calls cost in memory, and what the door
costs a keyed call, before and after; and what an idle connection costs (the caps).

One Triton (``embed``), two ``fair-frontend serve --workers 2`` side by side: the code of
``--ref`` (default ``f324058``, before the door) and this working tree (after).

- **memory**: 8 concurrent 64 MiB ``ModelInfer`` calls without a key, from a client
  process of its own on one channel (``benchmarks/grpc_flood.py``), ``--rounds`` times per
  frontend. Figure: the growth of the peak resident memory of the frontend's processes
  (the serve process, its core, and its shells) during a round, from the kernel's own
  high-water mark (``VmHWM`` after writing 5 to ``/proc/PID/clear_refs``: the true peak,
  however brief, unsampled), and the answers the client got.
- **CPU per keyed call**: ``ModelInfer`` of 128 ``embed`` tokens with a key, through
  tritonclient's grpc.aio client at concurrency 16, in rounds of ``--calls`` calls that
  alternate between the two frontends (so both see the same machine). Figure: the
  frontend's CPU (user + system of the serve process and its shells, from /proc) per call,
  median over the rounds; the interceptor-free door runs on every call.
- **the door alone**: the same comparison without the frontend around it, a bare grpc.aio
  server (``--serve-echo``) whose one method answers its request's size, registered as
  gRPC makes a unary method (the message read before the handler) and as the door does
  (a stream-request handler that reads it itself, ``context.read()``); its CPU per call
  at concurrency 16, and the median ratio over pairs of rounds run back to back.
- **connections** (after only): resident memory per idle connection, 1,000 HTTP keep-alive
  connections each served a health check, and 1,000 gRPC (HTTP/2) connections past their
  handshake, held open at once (within ``server.http_max_connections_per_peer``: from
  loopback addresses of their own).

    .venv/bin/python -m benchmarks.bench_door            # about 3 minutes
        [--ref f324058] [--rounds 3] [--calls 2000]

Results: ``results/door.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcaio
import uvloop

from benchmarks.harness import (
    FrontendProcess,
    baseline_checkout,
    child_pids,
    frontend,
    load_example_config,
    process_tree_cpu_s,
    progress,
    triton,
    write_result,
)
from fair_frontend.backends.triton.embedded import free_port

MIB = 1 << 20
KEY = "door-bench-key"
FLOOD_CALLS = 8
FLOOD_BYTES = 64 * MIB
CONCURRENCY = 16
TOKENS = 128
IDLE_CONNECTIONS = 1000
PER_SOURCE = 250  # connections per loopback address, under the per-peer cap
CLIENT_TIMEOUT_S = 300.0
ROOT = Path(__file__).resolve().parent.parent


def bench_config(source: Path | None = None) -> dict[str, Any]:
    """The example config, one tenant of ours, no rate limits."""
    cfg = load_example_config(source)
    cfg.pop("tier_limits", None)
    cfg["tenants"] = {"bench": {"tier": "standard", "api_keys": [KEY]}}
    return cfg


# ---- measuring the frontend's processes ------------------------------------------------------


def tree(pid: int) -> list[int]:
    """The serve process and its children (the shells)."""
    return [pid, *child_pids(pid)]


def status_bytes(pid: int, field: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def peak_growth(pid: int) -> Iterator[dict[str, int]]:
    """``out["growth"]``: how far the peak RSS of the frontend's processes rose."""
    pids = tree(pid)
    for p in pids:
        Path(f"/proc/{p}/clear_refs").write_text("5")
    before = sum(status_bytes(p, "VmRSS") for p in pids)
    out: dict[str, int] = {}
    yield out
    out["growth"] = sum(status_bytes(p, "VmHWM") for p in pids) - before
    out["before"] = before


def cpu_s(pid: int) -> float:
    return sum(process_tree_cpu_s(pid).values())


# ---- memory: refused 64 MiB calls ------------------------------------------------------------


def flood_round(fe: FrontendProcess) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.grpc_flood", fe.grpc_url, "ModelInfer"]
    cmd += [str(FLOOD_CALLS), str(FLOOD_BYTES)]
    with peak_growth(fe.process.pid) as peak:
        done = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, check=True
        )
    answers = json.loads(done.stdout.splitlines()[-1])["answers"]
    return {
        "peak_growth_mib": round(peak["growth"] / MIB, 1),
        "rss_before_mib": round(peak["before"] / MIB, 1),
        "answers": sorted(set(answers)),
    }


# ---- CPU per keyed call ----------------------------------------------------------------------


async def keyed_client(url: str, calls: int) -> None:
    """The agent: warms up, says "ready", waits for a line, runs ``calls`` calls at
    CONCURRENCY, says "done" with the elapsed seconds."""
    client = grpcaio.InferenceServerClient(url)
    ids = np.arange(TOKENS, dtype=np.int32).reshape(1, TOKENS) % 4096
    inp = grpcaio.InferInput("INPUT_IDS", [1, TOKENS], "INT32")
    inp.set_data_from_numpy(ids)
    headers = {"authorization": f"Bearer {KEY}"}

    async def worker(n: int) -> None:
        for _ in range(n):
            await client.infer("embed", [inp], headers=headers)

    await asyncio.gather(*(worker(10) for _ in range(CONCURRENCY)))
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    started = time.monotonic()
    await asyncio.gather(*(worker(calls // CONCURRENCY) for _ in range(CONCURRENCY)))
    print(f"done {time.monotonic() - started}", flush=True)
    await client.close()


def cpu_round(fe: FrontendProcess, calls: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "benchmarks.bench_door", "--agent", fe.grpc_url]
    cmd += ["--calls", str(calls)]
    with subprocess.Popen(
        cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as agent:
        assert agent.stdin is not None and agent.stdout is not None
        line = agent.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the client did not start: {line!r}")
        before = cpu_s(fe.process.pid)
        agent.stdin.write("go\n")
        agent.stdin.flush()
        line = agent.stdout.readline()
        after = cpu_s(fe.process.pid)
        agent.wait(CLIENT_TIMEOUT_S)
    if not line.startswith("done"):
        raise RuntimeError(f"the client failed: {line!r}")
    done = calls // CONCURRENCY * CONCURRENCY
    return {
        "cpu_us_per_call": (after - before) / done * 1e6,
        "calls_per_s": done / float(line.split()[1]),
    }


# ---- the door alone: unary against stream-request handlers -------------------------------------

ECHO_SERVICE = "door.Echo"


def serve_echo(port: int) -> None:
    """A bare grpc.aio server: ``Unary`` as gRPC registers a unary method, ``Door`` as the
    frontend's door registers it (reads its one message itself)."""

    async def unary(request: bytes, context: Any) -> bytes:
        return str(len(request)).encode()

    async def door(requests: Any, context: Any) -> bytes:
        request = await context.read()  # as the door reads it (grpc_server._only_message)
        return str(len(request)).encode()

    async def main() -> None:
        server = grpc.aio.server()
        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Door": grpc.stream_unary_rpc_method_handler(door),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(ECHO_SERVICE, handlers),)
        )
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    uvloop.run(main())


async def echo_calls(port: int, method: str, calls: int) -> None:
    body = bytes(TOKENS * 4 + 64)  # about an embed request's size
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(f"/{ECHO_SERVICE}/{method}")

        async def worker(n: int) -> None:
            for _ in range(n):
                await call(body)

        await asyncio.gather(*(worker(calls // CONCURRENCY) for _ in range(CONCURRENCY)))


def door_alone(rounds: int, calls: int) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.bench_door", "--serve-echo", str(port)]
    per_call: dict[str, list[float]] = {"Unary": [], "Door": []}
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError("the echo server did not start")
            for method in per_call:
                asyncio.run(echo_calls(port, method, 200))  # warm
            for r in range(rounds):
                # Back to back, in turns first: each pair sees the same machine.
                for method in list(per_call)[:: 1 if r % 2 == 0 else -1]:
                    before = cpu_s(server.pid)
                    asyncio.run(echo_calls(port, method, calls))
                    per_call[method].append((cpu_s(server.pid) - before) / calls * 1e6)
        finally:
            server.terminate()
    medians = {m: round(statistics.median(f), 1) for m, f in per_call.items()}
    return {
        "server_cpu_us_per_call": per_call,
        "median_us": medians,
        "door_over_unary": paired_ratio(per_call["Door"], per_call["Unary"]),
    }


def paired_ratio(after: list[float], before: list[float]) -> dict[str, float]:
    """The median (and quartiles) of the rounds' ratios, each of two rounds run back to
    back: steadier on a shared machine than a ratio of medians."""
    ratios = sorted(a / b for a, b in zip(after, before, strict=True))
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"median": round(median, 3), "q1": round(q1, 3), "q3": round(q3, 3)}


# ---- connections: what an idle one costs -----------------------------------------------------


def idle_http(fe: FrontendProcess, count: int) -> list[socket.socket]:
    held = []
    for i in range(count):
        sock = socket.create_connection(
            ("127.0.0.1", fe.http_port), timeout=30, source_address=(source(i), 0)
        )
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: bench\r\n\r\n")
        reply = sock.recv(4096)
        if not reply.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"health check not served on connection {i}: {reply[:60]!r}")
        held.append(sock)
    return held


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"


def idle_grpc(fe: FrontendProcess, count: int) -> list[socket.socket]:
    """HTTP/2 connections past their handshake: preface and SETTINGS sent, the server's
    SETTINGS acknowledged, no stream."""
    held = []
    for i in range(count):
        sock = socket.create_connection(
            ("127.0.0.1", fe.grpc_port), timeout=30, source_address=(source(i), 0)
        )
        sock.sendall(PREFACE + SETTINGS)
        if not sock.recv(4096):
            raise RuntimeError(f"gRPC connection {i} closed at once")
        sock.sendall(SETTINGS_ACK)
        held.append(sock)
    return held


def source(i: int) -> str:
    return f"127.0.1.{1 + i // PER_SOURCE}"


def per_connection(fe: FrontendProcess, open_them: Any) -> float:
    """KiB of the frontend's resident memory per idle connection, ``IDLE_CONNECTIONS``
    of them open at once."""
    pids = tree(fe.process.pid)
    before = sum(status_bytes(p, "VmRSS") for p in pids)
    held = open_them(fe, IDLE_CONNECTIONS)
    try:
        time.sleep(1.0)  # let the server settle each connection's buffers
        after = sum(status_bytes(p, "VmRSS") for p in pids)
    finally:
        for sock in held:
            sock.close()
    return (after - before) / IDLE_CONNECTIONS / 1024


# ---- the run -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"ref": args.ref, "rounds": args.rounds, "calls": args.calls}
    with contextlib.ExitStack() as stack:
        tri = stack.enter_context(triton())
        base = stack.enter_context(baseline_checkout(args.ref))
        fes = {
            "before": stack.enter_context(
                frontend(
                    bench_config(base), tri.grpc_url, workers=2, source=base, http_url=tri.http_url
                )
            ),
            "after": stack.enter_context(
                frontend(bench_config(), tri.grpc_url, workers=2, http_url=tri.http_url)
            ),
        }
        memory: dict[str, list[dict[str, Any]]] = {name: [] for name in fes}
        cpu: dict[str, list[dict[str, float]]] = {name: [] for name in fes}
        for r in range(args.rounds):
            for name, fe in fes.items():
                memory[name].append(flood_round(fe))
                progress(f"memory round {r + 1} {name}: {memory[name][-1]}")
            for name, fe in list(fes.items())[:: 1 if r % 2 == 0 else -1]:
                cpu[name].append(cpu_round(fe, args.calls))
                progress(f"cpu round {r + 1} {name}: {cpu[name][-1]}")
        out["memory"] = memory
        out["cpu"] = cpu
        summary: dict[str, Any] = {}
        for name in fes:
            summary[name] = {
                "peak_growth_mib_max": max(m["peak_growth_mib"] for m in memory[name]),
                "peak_growth_mib_median": round(
                    statistics.median(m["peak_growth_mib"] for m in memory[name]), 1
                ),
                "cpu_us_per_call_median": round(
                    statistics.median(c["cpu_us_per_call"] for c in cpu[name]), 1
                ),
                "cpu_us_per_call_min": round(min(c["cpu_us_per_call"] for c in cpu[name]), 1),
            }
        summary["memory_ratio_before_over_after"] = round(
            summary["before"]["peak_growth_mib_median"]
            / max(summary["after"]["peak_growth_mib_median"], 0.1),
            1,
        )
        summary["cpu_after_over_before"] = paired_ratio(
            [c["cpu_us_per_call"] for c in cpu["after"]],
            [c["cpu_us_per_call"] for c in cpu["before"]],
        )
        out["door_alone"] = door_alone(args.rounds * 4, args.calls * 2)
        alone = out["door_alone"]
        progress(f"the door alone: {alone['median_us']} us a call; {alone['door_over_unary']}")
        after = fes["after"]
        out["idle_connection_kib"] = {
            "http": round(per_connection(after, idle_http), 1),
            "grpc": round(per_connection(after, idle_grpc), 1),
        }
        out["summary"] = summary
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ref", default="f324058", help="the code before (a git commit)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000, help="keyed calls per CPU round")
    parser.add_argument("--agent", help=argparse.SUPPRESS)
    parser.add_argument("--serve-echo", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        asyncio.run(keyed_client(args.agent, args.calls))
        return
    if args.serve_echo:
        serve_echo(args.serve_echo)
        return
    out = run(args)
    path = write_result("door", out)
    progress(f"summary: {json.dumps(out['summary'])}")
    progress(f"idle connection: {out['idle_connection_kib']} KiB")
    progress(f"written to {path}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
