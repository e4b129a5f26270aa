"""Memory bounded by what a request may use (issue 17): the frontend's peak memory, and
another tenant's latency, under the three requests the issue measured, before and after.

One Triton (``embed``, ``llm``); two versions of the frontend in the same run (``--ref``,
by default the commit before issue 17, and this working tree), each scenario on a fresh
``fair-frontend serve`` (2 shell processes by default), so that each starts from the same
memory; every client in a process of its own (an agent, as in ``bench_hostile``). A keyed
tenant, ``quiet``, runs ``bench_hostile``'s probe throughout (one 128-token ``embed``
request at a time, alternating gRPC and HTTP); its latency during the scenario is compared
with its solo window just before, on the same frontend.

Scenarios (each: the probe solo, a quiet moment, the scenario, a quiet moment):

- ``grpc_unkeyed``: 8 concurrent 64 MiB ``ModelInfer`` messages to ``embed`` without a
  key, each client sending the next as soon as one is answered;
- ``json_keyed``: 2 concurrent JSON bodies of the largest size ``embed`` allows here
  (``max_request_bytes`` 46 MiB: 93 MiB bodies, as in the issue), ``"data": [0,0,...]``,
  from keyed tenant ``hog`` (refused 400: the tensor is over the limit);
- ``prompt``: a 48 MiB prompt to ``llm``'s generate (``hog``), sent again once answered
  (at most one a second).

Figures per scenario: the frontend's RSS (core + shells, from /proc every 100 ms) before,
at its peak and after; every answer the scenario's requests got (also after the window);
the probe's p50 and worst (ms) beside its solo ones. Scenario ``grpc_unkeyed`` is the
door's (identity before the message): on this branch alone it shows the before behaviour.

    .venv/bin/python -m benchmarks.bench_bounds             # about 7 min: before, after
    .venv/bin/python -m benchmarks.bench_bounds --quick     # smoke run, about 3 min
        [--ref REF: the "before" commit, default f324058] [--workers 2] [--only after]

Results: ``results/bounds.json`` and ``results/bounds.png`` (``bounds_quick*`` for a
quick run, ``*_w1`` for ``--workers 1``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import uvloop
from tritonclient.grpc import service_pb2, service_pb2_grpc

from benchmarks.bench_hostile import (
    KEYS,
    MIB,
    Agent,
    AgentGroup,
    RssSampler,
    Tally,
    Urls,
    compare,
    grpc_outcome,
    latency_stats,
    read_status,
    say,
)
from benchmarks.harness import (
    baseline_checkout,
    frontend,
    load_example_config,
    progress,
    triton,
    write_result,
)

BEFORE_REF = "f324058"  # main before issue 17
SCENARIOS = ("grpc_unkeyed", "json_keyed", "prompt")
GRPC_MESSAGES = 8
GRPC_MESSAGE_BYTES = 64 * MIB
JSON_BODIES = 2
EMBED_REQUEST_BYTES = 46 * MIB  # embed's max_request_bytes here: 93 MiB bodies
PROMPT_BYTES = 48 * MIB
PROMPT_INTERVAL_S = 1.0
# A request of these scenarios that gets no answer within this long counts as "client
# timeout" (before issue 17, the 48 MiB prompt got none within a minute).
REQUEST_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 60.0
# After its window, a scenario's agent waits this long for the answers still to come.
DRAIN_TIMEOUT_S = 12.0  # (below bench_hostile.STOP_TIMEOUT_S, how long a stop is waited for)
STOPPING = asyncio.Event()  # (an agent's) set once its window is over
SEND_CHUNK = MIB


@dataclass(frozen=True)
class Timing:
    solo: float
    before: float
    during: float
    after: float


FULL = Timing(solo=6, before=2, during=12, after=3)
QUICK = Timing(solo=4, before=1, during=6, after=2)


def bench_config(source: Path | None = None) -> dict[str, Any]:
    """The example config, tenants of our own (``quiet``: the probe, ``hog``: the large
    requests), no rate limits, embed's requests at most 46 MiB of tensors."""
    cfg = load_example_config(source)
    cfg.pop("tier_limits", None)
    cfg["tenants"] = {name: {"tier": "standard", "api_keys": [key]} for name, key in KEYS.items()}
    cfg["endpoints"]["embed"]["max_request_bytes"] = EMBED_REQUEST_BYTES
    return cfg


def embed_wire_bytes() -> int:
    """embed's largest body here: twice its tensor limit and 1 MiB (both versions)."""
    return EMBED_REQUEST_BYTES * 2 + MIB


# ---- the agents' side ------------------------------------------------------------------------


async def send_request(
    urls: Urls, tally: Tally, path: str, head_lines: list[str], body: bytes
) -> None:
    """One HTTP request on its own connection, the whole body sent unless the server
    closes first; its status (or what the client saw) counted."""
    host, port = urls.http.rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError as err:
        tally.failed(f"connect {type(err).__name__}")
        return
    tally.sent += 1
    tally.started.set()
    answer = asyncio.ensure_future(read_status(reader))
    try:
        lines = [f"POST {path} HTTP/1.1", f"Host: {urls.http}", *head_lines]
        lines.append(f"Content-Length: {len(body)}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        view = memoryview(body)
        with contextlib.suppress(OSError):
            for lo in range(0, len(view), SEND_CHUNK):
                if answer.done():
                    break  # answered early: the rest would only be read to be discarded
                writer.write(view[lo : lo + SEND_CHUNK])
                await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
                tally.bytes_sent += min(SEND_CHUNK, len(view) - lo)
        try:
            status = await asyncio.wait_for(asyncio.shield(answer), REQUEST_TIMEOUT_S)
        except TimeoutError:
            tally.failed("timeout")
            return
        if status is None:
            tally.failed("closed before an answer")
        else:
            tally.answered(status)
    except TimeoutError:
        tally.failed("timeout (the server stopped reading)")
    finally:
        answer.cancel()
        writer.transport.abort()


def json_body(size: int) -> bytes:
    """An embed request of about ``size`` bytes: ``"data": [0,0,...]``, the shape honest."""
    head = b'{"inputs": [{"name": "INPUT_IDS", "datatype": "INT32", "shape": [1, %d], "data": ['
    count = (size - len(head) - 40) // 2
    return head % count + b",".join([b"0"] * count) + b"]}]}"


async def json_keyed(urls: Urls, tally: Tally) -> None:
    body = json_body(embed_wire_bytes() - 4096)
    head = ["Content-Type: application/json", f"Authorization: Bearer {KEYS['hog']}"]

    async def worker() -> None:
        while not STOPPING.is_set():
            await send_request(urls, tally, "/v2/models/embed/infer", head, body)

    await asyncio.gather(*(worker() for _ in range(JSON_BODIES)))


async def prompt(urls: Urls, tally: Tally) -> None:
    body = json.dumps({"text_input": "a" * PROMPT_BYTES}).encode()
    head = ["Content-Type: application/json", f"Authorization: Bearer {KEYS['hog']}"]
    while not STOPPING.is_set():
        sent = time.monotonic()
        await send_request(urls, tally, "/v2/models/llm/generate", head, body)
        # One prompt at a time, at most one a second: a large prompt, not a flood.
        await asyncio.sleep(max(0.0, PROMPT_INTERVAL_S - (time.monotonic() - sent)))


async def grpc_unkeyed(urls: Urls, tally: Tally) -> None:
    """64 MiB ModelInfer messages without a key, 8 in flight at a time."""
    n = GRPC_MESSAGE_BYTES // 4
    req = service_pb2.ModelInferRequest(model_name="embed")
    req.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, n])
    req.raw_input_contents.append(bytes(4 * n))
    options = [("grpc.max_send_message_length", 2**31 - 1)]
    async with grpc.aio.insecure_channel(urls.grpc, options=options) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def worker() -> None:
            while not STOPPING.is_set():
                tally.sent += 1
                tally.started.set()
                try:
                    await stub.ModelInfer(req, timeout=REQUEST_TIMEOUT_S)
                    tally.answered("OK")
                except grpc.aio.AioRpcError as err:
                    grpc_outcome(tally, err.code(), err.details())
                tally.bytes_sent += GRPC_MESSAGE_BYTES

        await asyncio.gather(*(worker() for _ in range(GRPC_MESSAGES)))


ATTACKS = {"grpc_unkeyed": grpc_unkeyed, "json_keyed": json_keyed, "prompt": prompt}


async def agent_main(kind: str, urls: Urls) -> None:
    """As ``bench_hostile``'s agents: start, say when begun, answer each ``mark`` line
    with the tally; when stdin closes, start no new request, wait for those in flight
    (at most ``DRAIN_TIMEOUT_S``: their answers are the figures), and stop."""
    tally = Tally()
    task = asyncio.ensure_future(ATTACKS[kind](urls, tally))
    begun = asyncio.ensure_future(tally.started.wait())
    await asyncio.wait({task, begun}, return_when=asyncio.FIRST_COMPLETED)
    say({"ready": tally.started.is_set(), **tally.snapshot()})
    loop = asyncio.get_running_loop()
    while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "mark":
        say(tally.snapshot())
    STOPPING.set()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), DRAIN_TIMEOUT_S)
    final = tally.snapshot()
    final["in_flight_at_stop"] = not task.done()
    if task.done() and not task.cancelled() and task.exception() is not None:
        final["error"] = repr(task.exception())
    say(final)
    os._exit(0)


# ---- the driver's side -----------------------------------------------------------------------


async def start_agent(kind: str, urls: Urls) -> Agent:
    """An agent process: ``probe`` is bench_hostile's, the scenarios are this module's."""
    module = "benchmarks.bench_hostile" if kind == "probe" else "benchmarks.bench_bounds"
    cmd = [sys.executable, "-m", module, "--agent", kind, "--http", urls.http]
    cmd += ["--grpc", urls.grpc]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=256 * MIB
    )
    return Agent(kind, proc)


async def scenario(
    kind: str, name: str, tri_urls: tuple[str, str], args: argparse.Namespace, source: Path | None
) -> dict[str, Any]:
    """A frontend of its own (so that each scenario starts from the same memory): the
    probe's solo window, a quiet moment, the scenario, a quiet moment. Its RSS, the
    answers the scenario's requests got, the probe's latency."""
    timing = QUICK if args.quick else FULL
    grpc_url, http_url = tri_urls
    with contextlib.ExitStack() as stack:
        for attempt in (1, 2):  # a port taken between its choice and its use: once more
            try:
                fe = stack.enter_context(
                    frontend(
                        bench_config(source),
                        grpc_url,
                        workers=args.workers,
                        http_url=http_url,
                        source=source,
                    )
                )
                break
            except RuntimeError as err:
                progress(f"{name} {kind}: the frontend did not start ({err}), attempt {attempt}")
                if attempt == 2:
                    raise
        urls = Urls(http=fe.http_url, grpc=fe.grpc_url)
        probe = await start_agent("probe", urls)
        samples: list[dict[str, Any]] = []
        with RssSampler(fe.process.pid) as rss:
            try:
                if not ((await probe.ready()) or {}).get("ready"):
                    progress(f"{name}: the probe did not start; its latencies will be missing")
                solo0 = time.monotonic()
                await asyncio.sleep(timing.solo)
                solo1 = time.monotonic()
                await asyncio.sleep(timing.before)
                before1 = time.monotonic()
                w = await attack(kind, urls, timing)
                stopped = time.monotonic()
                await asyncio.sleep(timing.after)
                after1 = time.monotonic()
            finally:
                final = await probe.stop()
                samples = (final or {}).get("samples", [])
        exited = fe.process.poll()
    before = rss.total_mib(solo1, before1)
    peak = rss.total_mib(before1, stopped)
    after = rss.total_mib((stopped + after1) / 2, after1)
    w["rss_before_mib"] = float(np.median(before)) if before else float("nan")
    w["rss_peak_mib"] = max(peak) if peak else float("nan")
    w["rss_after_mib"] = float(np.median(after)) if after else float("nan")
    w["rss_growth_mib"] = w["rss_peak_mib"] - w["rss_before_mib"]
    w["solo"] = probe_stats(samples, solo0, solo1)
    w["latency"] = probe_stats(samples, w["t0"], w["t1"])
    w["solo_by_protocol"] = latency_stats(samples, solo0, solo1)
    w["latency_by_protocol"] = latency_stats(samples, w["t0"], w["t1"])
    w["vs_solo"] = compare(w["latency_by_protocol"], w["solo_by_protocol"])
    w["frontend_exit"] = exited
    for key in ("t0", "t1"):
        w[key] -= solo0  # seconds from the solo window's start
    lat, solo = w["latency"], w["solo"]
    progress(
        f"{name} {kind}: RSS {w['rss_before_mib']:.0f} -> peak {w['rss_peak_mib']:.0f} -> "
        f"{w['rss_after_mib']:.0f} MiB (+{w['rss_growth_mib']:.0f}); answers {w['outcomes']}; "
        f"keyed tenant {lat['n']} requests (solo {solo['n']}), p50 {_ms(lat['p50_ms'])} "
        f"(solo {_ms(solo['p50_ms'])}), worst {_ms(lat['worst_ms'])} (solo "
        f"{_ms(solo['worst_ms'])}) ms, failures {lat['failures']}"
    )
    return w


async def attack(kind: str, urls: Urls, timing: Timing) -> dict[str, Any]:
    """The scenario's agent for ``timing.during``; what it sent, and every answer it got
    (those that came after the window too: a slow one is the point)."""
    agent = await start_agent(kind, urls)
    group = AgentGroup([agent])
    try:
        ready = await asyncio.wait_for(agent.ready(), READY_TIMEOUT_S)
        if not (ready or {}).get("ready"):
            progress(f"  agent {kind} did not start: {ready}")
        t0 = time.monotonic()
        await asyncio.sleep(timing.during)
        t1 = time.monotonic()
    finally:
        group.finals = [await agent.stop()]
    final = group.finals[0] or {}
    return {
        "t0": t0,
        "t1": t1,
        "sent": final.get("sent", 0),
        "bytes_sent": final.get("bytes_sent", 0),
        "outcomes": final.get("outcomes", {}),
    }


async def one_frontend(
    name: str, tri_urls: tuple[str, str], args: argparse.Namespace, source: Path | None
) -> dict[str, Any]:
    """One version of the frontend, each scenario on a fresh one."""
    return {kind: await scenario(kind, name, tri_urls, args, source) for kind in SCENARIOS}


# ---- one decode's memory, per body byte (tracemalloc), before and after ------------------

DECODE_CASES = ("json INT32", "json BYTES", "grpc raw BYTES", "grpc typed BYTES")
DECODE_BYTES = 16 * MIB
# Run in a process of its own with PYTHONPATH at the version measured: builds one body of
# about DECODE_BYTES per case, decodes it under tracemalloc, prints the peak per body byte.
DECODE_SCRIPT = """
import json, struct, sys, time, tracemalloc
from fair_frontend import grpc_codec
from fair_frontend.shell import http_codec
from tritonclient.grpc import service_pb2
size = int(sys.argv[1])

def json_body(datatype, element):
    count = size // (len(element) + 1)
    head = ('{"inputs": [{"name": "X", "datatype": "%s", "shape": [1, %d], "data": ['
            % (datatype, count)).encode()
    return head + b",".join([element] * count) + b"]}]}"

def grpc_message(typed):
    count = size // 6
    msg = service_pb2.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="X", datatype="BYTES", shape=[1, count])
    if typed:
        t.contents.bytes_contents.extend([b"ab"] * count)
    else:
        msg.raw_input_contents.append(b"".join([struct.pack("<I", 2) + b"ab"] * count))
    return msg.SerializeToString()

def http(body):
    return http_codec.decode_infer("m", "", body, None)

def grpc(body):
    return grpc_codec.decode_infer(grpc_codec.parse_infer_request(body))

cases = {
    "json INT32": (json_body("INT32", b"0"), http),
    "json BYTES": (json_body("BYTES", b'"ab"'), http),
    "grpc raw BYTES": (grpc_message(False), grpc),
    "grpc typed BYTES": (grpc_message(True), grpc),
}
out = {}
for name, (body, decode) in cases.items():
    tracemalloc.start()
    t0 = time.perf_counter()
    decode(body)
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out[name] = {
        "body_bytes": len(body),
        "peak_bytes": peak,
        "per_body_byte": peak / len(body),
        "seconds": seconds,
    }
print(json.dumps(out))
"""


def decode_costs(source: Path | None) -> dict[str, Any]:
    """One decode of each case in a process running ``source``'s package (this working
    tree where None): tracemalloc's peak (Python and numpy allocations; not protobuf's
    own arena) per body byte, and its time."""
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = str(source)
    proc = subprocess.run(
        [sys.executable, "-c", DECODE_SCRIPT, str(DECODE_BYTES)],
        capture_output=True,
        text=True,
        env=env,
        cwd=source or None,
        timeout=900,
    )
    if proc.returncode != 0:
        progress(f"decode costs failed: {proc.stderr[-2000:]}")
        return {}
    costs: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return costs


def probe_stats(samples: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """The keyed tenant's requests sent in [t0, t1): how many, p50 and worst latency (ms)
    of all of them, a failure (a timeout: no answer in 20 s) at the time it took, and the
    failures by outcome. (``bench_hostile.latency_stats`` leaves failures out of the
    latencies: here they are the point.)"""
    window = [s for s in samples if t0 <= s["t"] < t1]
    ms = [s["latency_s"] * 1e3 for s in window]
    failures = Counter(s["outcome"] for s in window if s["outcome"] != "ok")
    return {
        "n": len(window),
        "p50_ms": float(np.percentile(ms, 50)) if ms else None,
        "worst_ms": max(ms) if ms else None,
        "failures": dict(failures),
    }


def report(results: dict[str, Any]) -> None:
    print()
    print(
        "Frontend peak RSS growth (MiB); the keyed tenant's requests, p50 / worst (ms) during, "
        "and solo"
    )
    for kind in SCENARIOS:
        for version, scenarios in results["versions"].items():
            w = scenarios[kind]
            lat, solo = w["latency"], w["solo"]
            print(
                f"{kind:<13} {version:<18} RSS +{w['rss_growth_mib']:>6,.0f}   "
                f"n {lat['n']:>4} ({solo['n']:>4})   "
                f"p50 {_ms(lat['p50_ms']):>8} ({_ms(solo['p50_ms']):>6})   "
                f"worst {_ms(lat['worst_ms']):>9} ({_ms(solo['worst_ms']):>6})   "
                f"{lat['failures'] or ''} {w['outcomes'] or 'no answer'}"
            )


def report_decode(decode: dict[str, Any]) -> None:
    print()
    print("One decode: peak memory (tracemalloc) per body byte, and seconds")
    for case in DECODE_CASES:
        row = f"{case:<18}"
        for version, costs in decode.items():
            c = costs.get(case)
            row += f"  {version}: " + (
                "-" if c is None else f"{c['per_body_byte']:5.2f} x, {c['seconds']:5.2f} s"
            )
        print(row)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    versions = list(results["versions"])
    fig, (ax_rss, ax_lat) = plt.subplots(1, 2, figsize=(13, 4.8))
    x = np.arange(len(SCENARIOS))
    width = 0.8 / len(versions)
    for i, version in enumerate(versions):
        scenarios = results["versions"][version]
        at = x + (i - (len(versions) - 1) / 2) * width
        growth = [scenarios[k]["rss_growth_mib"] for k in SCENARIOS]
        bars = ax_rss.bar(at, growth, width, color=f"C{i}", label=version)
        for bar, value in zip(bars, growth, strict=True):
            where = (bar.get_x() + bar.get_width() / 2, bar.get_height())
            ax_rss.annotate(f"{value:,.0f}", where, ha="center", va="bottom", fontsize=8)
        worst = [scenarios[k]["latency"]["worst_ms"] or np.nan for k in SCENARIOS]
        p50 = [scenarios[k]["latency"]["p50_ms"] or np.nan for k in SCENARIOS]
        solo = [scenarios[k]["solo"]["worst_ms"] or np.nan for k in SCENARIOS]
        ax_lat.bar(at, worst, width, color=f"C{i}", alpha=0.55, label=f"{version} worst")
        ax_lat.scatter(at, p50, color=f"C{i}", marker="_", s=300, zorder=3, label=f"{version} p50")
        ax_lat.scatter(at, solo, color=f"C{i}", marker=".", zorder=3, label=f"{version} solo worst")
    ax_rss.set_xticks(x, [k.replace("_", "\n") for k in SCENARIOS])
    ax_rss.set_ylabel("frontend peak RSS growth (MiB)")
    ax_rss.set_title("memory: core + shells, peak over the moment before")
    ax_rss.legend(fontsize=8)
    ax_lat.set_xticks(x, [k.replace("_", "\n") for k in SCENARIOS])
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("keyed tenant latency (ms, log)")
    ax_lat.set_title("another tenant's embed requests meanwhile")
    ax_lat.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    progress(f"plot written to {path}")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "quick": args.quick,
        "workers": args.workers,
        "timing": asdict(QUICK if args.quick else FULL),
        "ref_before": args.ref,
        "versions": {},
    }
    with contextlib.ExitStack() as stack:
        tri_urls = ("", "")
        if "serve" in args.parts:
            tri = stack.enter_context(triton())
            tri_urls = (tri.grpc_url, tri.http_url)
        plan: list[tuple[str, Path | None]] = []
        if args.only in (None, "before"):
            plan.append((f"before ({args.ref})", stack.enter_context(baseline_checkout(args.ref))))
        if args.only in (None, "after"):
            plan.append(("after", None))
        for name, source in plan:
            if "decode" in args.parts:
                progress(f"{name}: one decode of each case, {DECODE_BYTES >> 20} MiB bodies")
                out.setdefault("decode", {})[name] = decode_costs(source)
            if "serve" in args.parts:
                out["versions"][name] = await one_frontend(name, tri_urls, args, source)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows: a smoke run")
    parser.add_argument("--workers", type=int, default=2, help="the frontend's shell processes")
    parser.add_argument("--ref", default=BEFORE_REF, help="the commit measured as 'before'")
    parser.add_argument("--only", choices=["before", "after"], help="measure one version only")
    parser.add_argument(
        "--parts",
        default="serve,decode",
        help="serve (the scenarios against a frontend), decode (one decode's memory per "
        "body byte, in a process), or both (the default)",
    )
    parser.add_argument("--agent", choices=list(ATTACKS), help=argparse.SUPPRESS)
    parser.add_argument("--http", help=argparse.SUPPRESS)
    parser.add_argument("--grpc", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        uvloop.run(agent_main(args.agent, Urls(http=args.http, grpc=args.grpc)))
        return
    results = asyncio.run(main_async(args))
    name = "bounds_quick" if args.quick else "bounds"
    if args.workers != 2:
        name += f"_w{args.workers}"
    if "serve" not in args.parts:
        name += "_decode"
    if results["versions"]:
        report(results)
    if results.get("decode"):
        report_decode(results["decode"])
    path = write_result(name, results)
    if results["versions"]:
        plot(results, path.with_name(f"{name}.png"))


if __name__ == "__main__":
    main()
