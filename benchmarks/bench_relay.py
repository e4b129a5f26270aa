"""CPU per streamed token: the frontend against a bare relay of Triton's streams, both
measured in the same run (issue 18).

One Triton serving ``llm``; ``--streams`` streams x ``--tokens`` output tokens kept
outstanding (closed loop) by a client process of its own, for a warm-up and then a window.
Over the same window, for each target: tokens/s at the client and the user + system CPU
seconds of the target's processes (from /proc) per token streamed. Targets, per protocol:

- ``direct``: Triton itself (tokens/s only: the ceiling);
- ``relay``: a bare relay (``benchmarks/relay_floor.py``), a process that passes Triton's
  bytes through and decodes nothing: the floor of a relay in Python;
- ``frontend_w1``, ``frontend_w2``, ...: ``fair-frontend serve --workers N`` (one process;
  then a core and N shell processes, whose CPU is reported apart: the core's share);
- ``before_wN``: the same for the frontend of ``--ref REF`` (``baseline_checkout``).
  With a ref, each frontend is measured twice, in the order this tree, the ref, the ref,
  this tree, and each figure is the mean of its two windows: on this machine a window's
  place in the run moves it (Triton's ``llm`` drifts over a run; on 2026-12-07 the same
  code measured 119 µs a token in the last window against 93 in the first), so a ref
  always measured last would look slower than it is.

Protocols: ``grpc`` (tritonclient's grpc.aio ``stream_infer``, each client stream carrying
its requests one after another; the relay: grpc.aio with raw bytes) and ``http``
(``POST /v2/models/llm/generate_stream``, server-sent events read line by line with
aiohttp; the relay: aiohttp streaming the response's chunks back).

Reported: frontend CPU per token / the relay's (targets: 1.3x over HTTP, 1.2x over gRPC),
frontend tokens/s / direct's, and the core's CPU per token with separate shells (target:
at most 5 µs). Results in ``benchmarks/results/relay.json``, a plot in ``relay.png``.

``--stream-interval N``: ``llm`` sends up to N tokens per response (a copy of the model
with its ``stream_interval`` set, vLLM's); the clients ask each response for its token
count (``return_num_output_tokens``) and count tokens, not events; results in
``relay_intervalN.json``.

``--first-tokens N``: also each target's time to first token at c=1 (N requests of 4
tokens one after another, from a client process of its own, after 5 to warm up): p50 and
p90, and the frontends' p50 over direct's (issue 31's target: at most +1 ms).

``--pin``: the relay and the frontend (its shells too) run on a CPU of their own, Triton,
the client and this process on the others: does a frontend with a CPU to itself keep up
with Triton (issue 31's target: tokens/s at least 0.98x direct)? Results in
``relay_pinned.json`` (``relay_interval{N}_pinned.json``).

    .venv/bin/python -m benchmarks.bench_relay [--protocols grpc http] [--streams 64]
        [--tokens 256] [--workers 1 2] [--ref REF] [--warmup-s 10] [--window-s 30] [--quick]
        [--stream-interval N] [--first-tokens N] [--pin]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcaio

from benchmarks.bench_engine import KEYS, bench_config, llm_inputs
from benchmarks.harness import (
    RESULTS,
    baseline_checkout,
    frontend,
    pinned,
    process_tree_cpu_s,
    progress,
    triton,
    write_result,
)
from fair_frontend.backends.triton.embedded import free_port, llm_with_stream_interval

MODEL = "llm"
PROMPT = "a tenant asks the engine for a story about"
PROTOCOLS = ("grpc", "http")
# Frontend CPU per token / the bare relay's, per protocol; the core's own, separate shells.
TARGETS = {"grpc": 1.2, "http": 1.3}
CORE_TARGET_US = 5.0
KEY = KEYS["a"]


# ---- the client (a process of its own) -----------------------------------------------------


@dataclass
class Count:
    tokens: int = 0
    requests: int = 0
    errors: int = 0


def sampling(tokens: int) -> str:
    return json.dumps({"max_tokens": tokens, "temperature": 0, "ignore_eos": True})


def count_flag() -> Any:
    """``return_num_output_tokens``: each response says how many tokens it carries."""
    flag = grpcaio.InferInput("return_num_output_tokens", [1], "BOOL")
    flag.set_data_from_numpy(np.array([True]))
    return flag


COUNT_IN_EVENT = re.compile(rb'"num_output_tokens":\[?(\d+)')


async def grpc_stream(
    client: Any, headers: Any, tokens: int, count: Count, interval: int = 1
) -> None:
    """One ModelStreamInfer stream: a request, its ``tokens`` tokens, the next. With a
    stream interval above 1 each response says how many tokens it carries."""
    outbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    inputs = llm_inputs(PROMPT, tokens) + ([count_flag()] if interval > 1 else [])
    request = {"model_name": MODEL, "inputs": inputs}

    async def requests() -> AsyncIterator[dict[str, Any]]:
        while (item := await outbox.get()) is not None:
            yield item

    outbox.put_nowait(request)
    got = 0
    try:
        async for result, error in client.stream_infer(requests(), headers=headers):
            if error is not None:
                count.errors += 1
                raise RuntimeError(f"stream error: {error}")
            n = 1 if interval == 1 else int(result.as_numpy("num_output_tokens").sum())
            count.tokens += n
            got += n
            if got == tokens:  # the model sends exactly max_tokens tokens
                count.requests += 1
                got = 0
                outbox.put_nowait(request)
    finally:
        outbox.put_nowait(None)


async def http_stream(
    session: Any, url: str, headers: Any, tokens: int, count: Count, interval: int = 1
) -> None:
    """Requests to /generate_stream one after another; one token per ``data:`` event (with
    a stream interval above 1, the tokens each event says it carries)."""
    fields: dict[str, Any] = {
        "text_input": PROMPT,
        "stream": True,
        "sampling_parameters": sampling(tokens),
    }
    if interval > 1:
        fields["return_num_output_tokens"] = True
    body = json.dumps(fields)
    while True:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                count.errors += 1
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
            async for line in resp.content:
                if line.startswith(b"data:"):
                    if b'"error"' in line:
                        count.errors += 1
                        raise RuntimeError(f"stream error: {line[:200]!r}")
                    said = COUNT_IN_EVENT.search(line) if interval > 1 else None
                    count.tokens += int(said.group(1)) if said is not None else 1
        count.requests += 1


async def first_tokens(protocol: str, url: str, headers: Any, n: int) -> list[float]:
    """``n`` requests one after another (4 tokens each), each one's time from its send to
    its first token at this client, in seconds: time to first token at c=1."""
    times: list[float] = []
    if protocol == "grpc":
        client = grpcaio.InferenceServerClient(url)
        try:
            for _ in range(n):

                async def one() -> AsyncIterator[dict[str, Any]]:
                    yield {"model_name": MODEL, "inputs": llm_inputs(PROMPT, 4)}

                sent, first = time.monotonic(), None
                async for _result, error in client.stream_infer(one(), headers=headers):
                    if error is not None:
                        raise RuntimeError(f"stream error: {error}")
                    first = first or time.monotonic()
                assert first is not None
                times.append(first - sent)
        finally:
            await client.close()
        return times
    import aiohttp

    body = json.dumps({"text_input": PROMPT, "stream": True, "sampling_parameters": sampling(4)})
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            sent, first = time.monotonic(), None
            target = f"{url}/v2/models/{MODEL}/generate_stream"
            async with session.post(target, data=body, headers=headers) as resp:
                async for line in resp.content:
                    if line.startswith(b"data:"):
                        first = first or time.monotonic()
            assert first is not None, resp.status
            times.append(first - sent)
    return times


async def client_main(protocol: str, url: str, key: str | None, load: dict[str, Any]) -> None:
    """Keep ``streams`` streams busy; print ``{"event": "start"}`` when the window opens
    and the window's counts when it closes (the parent samples CPU at both lines)."""
    count = Count()
    headers = {"x-api-key": key} if key else None
    if load.get("ttft"):
        await first_tokens(protocol, url, headers, 5)  # warm: connections, the model
        times = await first_tokens(protocol, url, headers, load["ttft"])
        print(json.dumps({"event": "ttft", "ttft_s": times}), flush=True)
        return
    streams, tokens, every = load["streams"], load["tokens"], load.get("interval", 1)
    async with contextlib.AsyncExitStack() as stack:
        if protocol == "grpc":
            client = grpcaio.InferenceServerClient(url)
            stack.push_async_callback(client.close)
            work = [grpc_stream(client, headers, tokens, count, every) for _ in range(streams)]
        else:
            import aiohttp

            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None),
            )
            stack.push_async_callback(session.close)
            target = f"{url}/v2/models/{MODEL}/generate_stream"
            work = [
                http_stream(session, target, headers, tokens, count, every) for _ in range(streams)
            ]
        tasks = [asyncio.ensure_future(w) for w in work]

        async def wait(seconds: float) -> None:
            done, _ = await asyncio.wait(
                tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION
            )
            for task in done:
                task.result()  # a stream that failed fails the run
            if done:
                raise RuntimeError("a stream ended")

        await wait(load["warmup_s"])
        t0, n0, r0 = time.monotonic(), count.tokens, count.requests
        print(json.dumps({"event": "start"}), flush=True)
        await wait(load["window_s"])
        t1, n1, r1 = time.monotonic(), count.tokens, count.requests
        answer = {
            "event": "end",
            "tokens": n1 - n0,
            "requests": r1 - r0,
            "seconds": t1 - t0,
            "tokens_per_s": (n1 - n0) / (t1 - t0),
            "errors": count.errors,
        }
        print(json.dumps(answer), flush=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def read_line(proc: subprocess.Popen[str], pool: ThreadPoolExecutor, timeout_s: float) -> str:
    assert proc.stdout is not None
    try:
        line = pool.submit(proc.stdout.readline).result(timeout=timeout_s)
    except FutureTimeout:
        proc.kill()
        raise TimeoutError(f"no line from process {proc.pid} in {timeout_s:.0f} s") from None
    if not line:
        raise RuntimeError(f"process {proc.pid} exited with {proc.wait()}")
    return line


def run_window(
    protocol: str, url: str, key: str | None, load: dict[str, Any], cpu_pid: int | None
) -> dict[str, Any]:
    """The client over one warm-up and window; the CPU of ``cpu_pid`` (and its children)
    over the same window."""
    cmd = [sys.executable, "-m", "benchmarks.bench_relay", "--client", protocol, "--url", url]
    cmd += ["--load", json.dumps(load)] + (["--key", key] if key else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    limit = load["warmup_s"] + 60
    try:
        with ThreadPoolExecutor(1) as pool:
            started = json.loads(read_line(proc, pool, limit))
            assert started["event"] == "start", started
            cpu0 = process_tree_cpu_s(cpu_pid) if cpu_pid else None
            answer: dict[str, Any] = json.loads(read_line(proc, pool, load["window_s"] + 60))
            cpu1 = process_tree_cpu_s(cpu_pid) if cpu_pid else None
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    if cpu0 is not None and cpu1 is not None and answer["tokens"]:
        per = {k: (cpu1[k] - cpu0[k]) / answer["tokens"] * 1e6 for k in cpu0}
        answer["cpu_us_per_token"] = sum(per.values())
        answer["core_cpu_us_per_token"] = per["core"]
        answer["shells_cpu_us_per_token"] = per["shells"]
        answer["cpu_cores"] = sum(cpu1[k] - cpu0[k] for k in cpu0) / answer["seconds"]
    answer.pop("event", None)
    return answer


def run_ttft(protocol: str, url: str, key: str | None, n: int) -> dict[str, float]:
    """Time to first token at c=1 at a client process of its own: p50 and p90, ms."""
    cmd = [sys.executable, "-m", "benchmarks.bench_relay", "--client", protocol, "--url", url]
    cmd += ["--load", json.dumps({"ttft": n})] + (["--key", key] if key else [])
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=60 + n, check=True)
    times = sorted(json.loads(out.stdout.strip().splitlines()[-1])["ttft_s"])
    return {
        "ttft_p50_ms": 1e3 * times[len(times) // 2],
        "ttft_p90_ms": 1e3 * times[int(len(times) * 0.9)],
    }


# ---- the targets -----------------------------------------------------------------------------


@contextlib.contextmanager
def bare_relay(
    protocol: str, server: Any, cpus: set[int] | None = None
) -> Iterator[tuple[str, int]]:
    """``relay_floor`` as its own process (on ``cpus``): (its URL for the client, its pid)."""
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.relay_floor", protocol, "--port", str(port)]
    cmd += ["--triton-grpc", server.grpc_url, "--triton-http", server.http_url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=pinned(cpus))
    try:
        with ThreadPoolExecutor(1) as pool:
            line = read_line(proc, pool, 30)
        if line.strip() != "ready":
            raise RuntimeError(f"relay_floor said {line!r}")
        url = f"127.0.0.1:{port}" if protocol == "grpc" else f"http://127.0.0.1:{port}"
        yield url, proc.pid
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def report(name: str, protocol: str, r: dict[str, Any]) -> None:
    if "error" in r:
        progress(f"  {protocol} {name}: failed: {r['error']}")
        return
    line = f"  {protocol} {name}: {r['tokens_per_s']:.0f} tokens/s"
    if "tokens_per_s_vs_direct" in r:
        line += f" ({r['tokens_per_s_vs_direct']:.2f}x direct)"
    if "cpu_us_per_token" in r:
        line += f", CPU {r['cpu_us_per_token']:.1f} µs/token"
        if r.get("shells_cpu_us_per_token"):
            line += (
                f" (core {r['core_cpu_us_per_token']:.1f}, "
                f"shells {r['shells_cpu_us_per_token']:.1f})"
            )
    if "cpu_vs_relay" in r:
        line += f", {r['cpu_vs_relay']:.2f}x the relay's"
    if "ttft_p50_ms" in r:
        line += f"; TTFT at c=1 p50 {r['ttft_p50_ms']:.2f} ms"
        if "ttft_p50_over_direct_ms" in r:
            line += f" ({r['ttft_p50_over_direct_ms']:+.2f} over direct)"
    progress(line)


def compare(runs: dict[str, dict[str, Any]], name: str) -> None:
    """A target's tokens/s against Triton direct's, and its CPU per token against the bare
    relay's, both measured before it in the same run."""
    r = runs[name]
    if name == "direct" or "error" in r:
        return
    r["tokens_per_s_vs_direct"] = r["tokens_per_s"] / runs["direct"]["tokens_per_s"]
    if name != "relay":
        r["cpu_vs_relay"] = r["cpu_us_per_token"] / runs["relay"]["cpu_us_per_token"]
    if "ttft_p50_ms" in r:
        r["ttft_p50_over_direct_ms"] = r["ttft_p50_ms"] - runs["direct"]["ttft_p50_ms"]


def measure_all(
    server: Any,
    protocols: list[str],
    load: dict[str, Any],
    workers: list[int],
    baseline: Path | None,
    cpus: set[int] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every target over ``load``; the relay and the frontends on ``cpus`` (``--pin``)."""
    out: dict[str, dict[str, Any]] = {p: {} for p in protocols}
    what = f"{load['streams']} streams x {load['tokens']} tokens"
    direct_url = {"grpc": server.grpc_url, "http": server.http_url}
    for p in protocols:
        progress(f"{p}: Triton direct, {what}")
        out[p]["direct"] = run_window(p, direct_url[p], None, load, None)
        if load.get("first_tokens"):
            out[p]["direct"] |= run_ttft(p, direct_url[p], None, load["first_tokens"])
        compare(out[p], "direct")
        report("direct", p, out[p]["direct"])
    for p in protocols:
        progress(f"{p}: bare relay, {what}")
        with bare_relay(p, server, cpus) as (url, pid):
            out[p]["relay"] = run_window(p, url, None, load, pid)
        compare(out[p], "relay")
        report("relay", p, out[p]["relay"])
    runs: list[tuple[str, Path | None]] = [("frontend", None)]
    if baseline is not None:  # ABBA: neither is always the later one (the docstring)
        runs = [("frontend", None), ("before", baseline), ("before", baseline), ("frontend", None)]
    passes: dict[str, dict[str, list[dict[str, Any]]]] = {p: {} for p in protocols}
    for name, source in runs:
        for w in workers:
            key = f"{name}_w{w}"
            config = bench_config("fair", source=source)
            with frontend(
                config,
                server.grpc_url,
                http_url=server.http_url,
                workers=w,
                source=source,
                cpus=cpus,
            ) as fe:
                urls = {"grpc": fe.grpc_url, "http": f"http://{fe.http_url}"}
                for p in protocols:
                    progress(f"{p}: {name}, --workers {w}, {what}")
                    try:
                        got = run_window(p, urls[p], KEY, load, fe.process.pid)
                        if load.get("first_tokens"):
                            got |= run_ttft(p, urls[p], KEY, load["first_tokens"])
                    except (RuntimeError, TimeoutError) as err:  # an earlier ref may lack it
                        got = {"error": str(err)}
                    got["workers"] = w
                    windows = passes[p].setdefault(key, [])
                    windows.append(got)
                    out[p][key] = mean_of(windows)
                    compare(out[p], key)
                    if len(windows) == 1:
                        report(key, p, out[p][key])
                    else:  # this window's figures, then the mean of its windows
                        alone = {**out[p], key: dict(got)}
                        compare(alone, key)
                        report(f"{key} (window {len(windows)})", p, alone[key])
                        report(f"{key} (mean of {len(windows)})", p, out[p][key])
    return out


def mean_of(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's figures over its windows (one, or two with a ref): each number the
    mean of the windows', the windows themselves under ``passes`` where more than one."""
    if len(windows) == 1:
        return dict(windows[0])
    if any("error" in w for w in windows):
        return next(dict(w) for w in windows if "error" in w)
    out: dict[str, Any] = {}
    for k, v in windows[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "workers":
            out[k] = sum(w[k] for w in windows) / len(windows)
        else:
            out[k] = v
    out["passes"] = [dict(w) for w in windows]
    return out


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures, per protocol: each frontend's CPU per token / the relay's
    against its target, tokens/s / direct's, and the core's share with separate shells."""
    summary: dict[str, Any] = {}
    for p in PROTOCOLS:
        if p not in results:
            continue
        s: dict[str, Any] = {
            "target_cpu_vs_relay": TARGETS[p],
            "relay_cpu_us_per_token": results[p]["relay"]["cpu_us_per_token"],
            "relay_tokens_per_s_vs_direct": results[p]["relay"]["tokens_per_s_vs_direct"],
        }
        for name, r in results[p].items():
            if name in ("direct", "relay") or "error" in r:
                continue
            s[name] = {
                "cpu_us_per_token": r["cpu_us_per_token"],
                "cpu_vs_relay": r["cpu_vs_relay"],
                "cpu_target_met": r["cpu_vs_relay"] <= TARGETS[p],
                "tokens_per_s_vs_direct": r["tokens_per_s_vs_direct"],
            }
            if r["workers"] > 1:
                s[name]["core_cpu_us_per_token"] = r["core_cpu_us_per_token"]
                s[name]["core_target_us"] = CORE_TARGET_US
                s[name]["core_target_met"] = r["core_cpu_us_per_token"] <= CORE_TARGET_US
        summary[p] = s
    return summary


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    protocols = [p for p in PROTOCOLS if p in results]
    fig, axes = plt.subplots(2, len(protocols), figsize=(6.5 * len(protocols), 8), squeeze=False)
    for col, p in enumerate(protocols):
        # direct, relay, then the frontends (a kept protocol's JSON comes back sorted)
        fixed = ("direct", "relay")
        order = [*fixed, *sorted(n for n in results[p] if n not in fixed)]
        r = {n: results[p][n] for n in order if "error" not in results[p][n]}
        names = [n for n in r if n != "direct"]
        ax = axes[0][col]
        core = [r[n].get("core_cpu_us_per_token", 0.0) for n in names]
        shells = [r[n].get("shells_cpu_us_per_token", 0.0) for n in names]
        ax.bar(names, core, color="#4c72b0", label="process (core when shells apart)")
        ax.bar(names, shells, bottom=core, color="#dd8452", label="shell processes")
        ax.axhline(
            r["relay"]["cpu_us_per_token"] * TARGETS[p],
            ls="--",
            color="gray",
            label=f"target: {TARGETS[p]}x the bare relay",
        )
        ax.set_ylabel("CPU µs per streamed token (user + sys)")
        ax.set_title(f"{p}: CPU per token")
        ax.legend(fontsize=8)
        ax = axes[1][col]
        names = list(r)
        ax.bar(names, [r[n]["tokens_per_s"] for n in names], color="#55a868")
        ax.set_ylabel("tokens/s at the client")
        ax.set_title(f"{p}: throughput")
        for a in axes[:, col]:
            a.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    progress(f"plot written to {path.relative_to(RESULTS.parent.parent)}")


@contextlib.contextmanager
def interval_repository(interval: int) -> Iterator[Path | None]:
    """The shipped model repository (None) or, for a stream interval above 1, a copy of
    its ``llm`` with that ``stream_interval``."""
    if interval <= 1:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="fair-relay-") as tmp:
        yield llm_with_stream_interval(Path(tmp), interval)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams")
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="shell counts")
    parser.add_argument("--ref", help="also the frontend of this git ref, same run")
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--quick", action="store_true", help="short windows, for a smoke run")
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per response of llm (its stream_interval; a copy of the model so set)",
    )
    parser.add_argument(
        "--first-tokens",
        type=int,
        default=0,
        help="also time to first token at c=1 over this many requests, per target",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the relay and the frontend on a CPU of their own; Triton and the client not",
    )
    parser.add_argument("--client", choices=PROTOCOLS, help=argparse.SUPPRESS)  # internal
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        asyncio.run(client_main(args.client, args.url, args.key, json.loads(args.load)))
        return
    if args.quick:
        args.tokens, args.warmup_s, args.window_s = min(args.tokens, 32), 2.0, 4.0
    load = {
        "streams": args.streams,
        "tokens": args.tokens,
        "warmup_s": args.warmup_s,
        "window_s": args.window_s,
        "interval": args.stream_interval,
        "first_tokens": args.first_tokens,
    }
    cpus = None
    if args.pin:  # the last CPU for the relay and the frontend; the rest for all else
        mine = sorted(os.sched_getaffinity(0))
        if len(mine) < 2:
            parser.error("--pin needs two CPUs at least")
        cpus = {mine[-1]}
        os.sched_setaffinity(0, set(mine[:-1]))  # Triton and the clients start from here
        progress(f"pinned: the relay and the frontend on CPU {mine[-1]}, the rest on {mine[:-1]}")
    with contextlib.ExitStack() as stack:
        repo = stack.enter_context(interval_repository(args.stream_interval))
        server = stack.enter_context(triton(repo))
        baseline = stack.enter_context(baseline_checkout(args.ref)) if args.ref else None
        results: dict[str, Any] = measure_all(
            server, args.protocols, load, args.workers, baseline, cpus
        )
    stem = "relay" if args.stream_interval <= 1 else f"relay_interval{args.stream_interval}"
    stem += "_pinned" if args.pin else ""
    earlier = RESULTS / f"{stem}.json"
    if set(args.protocols) != set(PROTOCOLS) and earlier.exists():
        # A run of one protocol replaces its results and keeps the other's (each
        # protocol's ratios come from one run).
        kept = json.loads(earlier.read_text())
        results = {p: kept[p] for p in PROTOCOLS if p in kept and p not in results} | results
    results["summary"] = summarise(results)
    results["args"] = {
        k: v for k, v in vars(args).items() if k not in ("client", "url", "key", "load")
    }
    results["cpus"] = len(os.sched_getaffinity(0)) + (1 if args.pin else 0)
    for p, s in results["summary"].items():
        for name, f in s.items():
            if isinstance(f, dict):
                core = (
                    f"; core {f['core_cpu_us_per_token']:.1f} µs/token"
                    if "core_target_us" in f
                    else ""
                )
                progress(
                    f"{p} {name}: CPU {f['cpu_vs_relay']:.2f}x the relay's (target "
                    f"{TARGETS[p]}x), {f['tokens_per_s_vs_direct']:.2f}x direct's tokens/s{core}"
                )
    path = write_result(stem, results)
    plot(results, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
