"""Hostile clients: what a flood of refused requests and a memory attack cost the frontend,
and what they do to another tenant's latency.

One Triton (``embed``), one ``fair-frontend serve`` per part (``--workers`` shell processes,
2 by default, so the shells and the core are separate processes), every client in a
process of its own (an *agent*: ``--agent KIND``, driven over its stdin). A keyed tenant,
``quiet``, runs a closed loop of one 128-token request at a time through tritonclient,
alternating gRPC and HTTP, throughout each part; its latency is compared between its solo
window and the attack windows of the same run.

**Flood** (issue 11: "an unauthenticated flood at the highest rate the load generator can
send"): each flood kind alone, then all together, each as fast as its process can send:

- ``http_badkey``: small valid infer bodies, a fresh random bad key on every request,
  keep-alive (aiohttp, 16 at a time);
- ``http_nokey``: the same without any key;
- ``http_large``: a bad key and a large body (8, 16, 32, 64 MiB in turn, declared in
  Content-Length and really sent unless the server closes the connection), raw sockets;
- ``grpc_badkey``: ``ModelInfer`` with a fresh bad key (grpc.aio, 32 calls at a time).

Figures per window: the keyed tenant's p50/p99 beside its solo ones (ratio), the refusals
the flood clients counted and their rate, and the frontend's CPU (user + sys of the core
and its shells, from /proc) per refusal: gross, and net of the keyed tenant's requests
(their count in the window times the CPU one cost in the solo window).

**Memory** (issue 11: "a client sending a 100 MiB body and a client that never reads its
stream"): RSS of the frontend's processes sampled every 100 ms before, during and after:

- ``big_valid`` / ``big_badkey``: 2 connections each sending 100 MiB infer bodies back to
  back, with tenant ``hog``'s valid key and with a bad one;
- ``trickle``: 8 connections declaring 100 MiB and sending 64 KiB every 100 ms (valid key);
- ``stream_noread``: 2 ``ModelStreamInfer`` streams (valid key) writing requests as fast as
  flow control lets them, never reading a reply.

Whatever the server does (answers, closes, times out, or never answers) is counted as an
outcome, never an error of the benchmark: it runs against the frontend before and after the
fixes of issue 11 alike.

    .venv/bin/python -m benchmarks.bench_hostile            # about 3.5 min
    .venv/bin/python -m benchmarks.bench_hostile --quick    # smoke run, about 1.5 min
        [--workers 2] [--ref REF: the frontend of that commit, e.g. before a fix]

Results: ``results/hostile.json`` (windows in seconds from each part's start, RSS series),
``results/hostile_flood.png`` (the keyed tenant's latency per window; CPU per refusal),
``results/hostile_memory.png`` (RSS and the keyed tenant's latency over time); a quick run
writes ``hostile_quick*`` instead, and a run with ``--ref REF`` ``hostile[_quick]_REF*``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import tritonclient.grpc.aio as grpcaio
import tritonclient.http.aio as httpaio
import uvloop
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from benchmarks.harness import (
    baseline_checkout,
    frontend,
    load_example_config,
    process_tree_cpu_s,
    process_tree_rss_bytes,
    progress,
    triton,
    write_result,
)

MODEL = "embed"
TOKENS = 128
MIB = 1 << 20
KEYS = {"quiet": "quiet-hostile-key", "hog": "hog-hostile-key"}
FLOOD_KINDS = ("http_badkey", "http_nokey", "http_large", "grpc_badkey")
MEMORY_KINDS = ("big_valid", "big_badkey", "trickle", "stream_noread")
HTTP_FLOOD_CONCURRENCY = 16
GRPC_FLOOD_CONCURRENCY = 32
LARGE_SIZES_MIB = (8, 16, 32, 64)
LARGE_CONNECTIONS = 4
BIG_BODY_BYTES = 100 * MIB
BIG_CONNECTIONS = 2
TRICKLE_CONNECTIONS = 8
TRICKLE_CHUNK = 64 * 1024
TRICKLE_PAUSE_S = 0.1
NOREAD_STREAMS = 2
SEND_CHUNK = MIB
# A client gives up on one request after this long: a server that never answers shows
# up as "client timeout", not as a benchmark that hangs.
REQUEST_TIMEOUT_S = 20.0
READY_TIMEOUT_S = 60.0  # an agent's start (imports, first answer) on a loaded machine
STOP_TIMEOUT_S = 15.0
RSS_INTERVAL_S = 0.1
OK_STATUSES = frozenset({"200", "OK"})


@dataclass(frozen=True)
class Timing:
    """Window lengths in seconds."""

    flood_solo: float
    flood_kind: float  # each flood kind alone
    flood_all: float  # all kinds together
    memory_solo: float
    before: float  # each memory scenario: before, during, after
    during: float
    after: float


FULL = Timing(
    flood_solo=15, flood_kind=8, flood_all=20, memory_solo=10, before=2, during=10, after=5
)
QUICK = Timing(flood_solo=4, flood_kind=3, flood_all=4, memory_solo=3, before=1, during=3, after=2)


@dataclass(frozen=True)
class Urls:
    http: str  # host:port
    grpc: str


# ---- the agents' side: one hostile (or measuring) client per process ---------------------


@dataclass
class Tally:
    """What one agent saw. ``answered <status>``: the server's answer (HTTP status, gRPC
    code); ``client <what>``: no answer (timeout, connection closed or refused)."""

    outcomes: Counter[str] = field(default_factory=Counter)
    sent: int = 0  # requests (or stream messages) started
    open: int = 0  # connections open now (raw-socket agents): a trickle the server keeps
    bytes_sent: int = 0  # body bytes the server took (raw-socket agents)
    started: asyncio.Event = field(default_factory=asyncio.Event)

    def answered(self, status: str) -> None:
        self.outcomes[f"answered {status}"] += 1
        self.started.set()

    def failed(self, what: str) -> None:
        self.outcomes[f"client {what}"] += 1
        self.started.set()

    def snapshot(self) -> dict[str, Any]:
        return {
            "t": time.monotonic(),
            "outcomes": dict(self.outcomes),
            "sent": self.sent,
            "bytes_sent": self.bytes_sent,
            "open": self.open,
        }


def bad_key() -> str:
    """A fresh key nobody holds: no cache can answer it."""
    return f"bad-{random.getrandbits(64):016x}"


def token_ids(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 4000, size=(1, TOKENS), dtype=np.int32)


def small_infer_body() -> bytes:
    """A small, valid KServe v2 JSON infer request: refused for its key, not its body."""
    doc = {
        "inputs": [
            {
                "name": "INPUT_IDS",
                "shape": [1, TOKENS],
                "datatype": "INT32",
                "data": token_ids().ravel().tolist(),
            }
        ]
    }
    return json.dumps(doc).encode()


def grpc_infer_request() -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name=MODEL)
    req.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, TOKENS])
    req.raw_input_contents.append(token_ids().tobytes())
    return req


def binary_request_head(urls: Urls, tensor_bytes: int, key: str | None) -> tuple[bytes, int]:
    """HTTP headers and JSON header of an infer request whose INT32 tensor of
    ``tensor_bytes`` follows as raw bytes (the binary tensor extension, as tritonclient
    sends); returns (bytes to send first, body bytes still to follow)."""
    n = tensor_bytes // 4
    doc = {
        "inputs": [
            {
                "name": "INPUT_IDS",
                "shape": [1, n],
                "datatype": "INT32",
                "parameters": {"binary_data_size": 4 * n},
            }
        ]
    }
    json_part = json.dumps(doc).encode()
    lines = [
        f"POST /v2/models/{MODEL}/infer HTTP/1.1",
        f"Host: {urls.http}",
        "Content-Type: application/octet-stream",
        f"Inference-Header-Content-Length: {len(json_part)}",
        f"Content-Length: {len(json_part) + 4 * n}",
    ]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode() + json_part
    return head, 4 * n


async def read_status(reader: asyncio.StreamReader) -> str | None:
    """The status code of the server's answer; None if it closed without one."""
    with contextlib.suppress(OSError, asyncio.IncompleteReadError, ValueError):
        line = await reader.readline()
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith(b"HTTP/"):
            return parts[1].decode()
    return None


async def send_zeros(
    writer: asyncio.StreamWriter,
    tally: Tally,
    left: int,
    chunk: int,
    pause_s: float,
    answer: asyncio.Future[str | None],
) -> bool:
    """Write ``left`` zero bytes in chunks (``pause_s`` between them: a trickle, which
    stops once answered) until sent or the server closes the connection; True if the
    server stopped reading for longer than a request's timeout."""
    zeros = memoryview(bytes(chunk))
    try:
        while left > 0 and not (pause_s and answer.done()):
            n = min(chunk, left)
            writer.write(zeros[:n])
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
            left -= n
            tally.bytes_sent += n
            if pause_s:
                await asyncio.sleep(pause_s)
    except OSError:
        pass  # closed by the server: its answer, if any, is already on its way
    except TimeoutError:
        return True
    return False


async def send_body(
    urls: Urls,
    tally: Tally,
    key: str | None,
    tensor_bytes: int,
    *,
    chunk: int = SEND_CHUNK,
    pause_s: float = 0.0,
) -> None:
    """One request on its own connection: headers, then the whole declared body (a
    hostile client keeps sending after an early answer), until it is sent or the server
    closes the connection; then the answer, if any. Zeros: the bytes do not matter."""
    host, port = urls.http.rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError as err:
        tally.failed(f"connect {type(err).__name__}")
        return
    tally.sent += 1
    tally.open += 1
    answer = asyncio.ensure_future(read_status(reader))
    try:
        head, left = binary_request_head(urls, tensor_bytes, key)
        writer.write(head)
        tally.started.set()
        stalled = await send_zeros(writer, tally, left, chunk, pause_s, answer)
        try:
            wait_s = 0.5 if stalled else REQUEST_TIMEOUT_S
            status = await asyncio.wait_for(asyncio.shield(answer), wait_s)
        except TimeoutError:
            tally.failed("stalled: the server stopped reading" if stalled else "timeout")
            return
        if status is None:
            tally.failed("closed before an answer")
        else:
            tally.answered(status)
    finally:
        tally.open -= 1
        answer.cancel()
        # Never wait for a flush: a server that stopped reading would hold us forever.
        if writer.transport.get_write_buffer_size():
            writer.transport.abort()
        else:
            writer.close()


async def http_small(urls: Urls, tally: Tally, keyed: bool) -> None:
    """Small requests as fast as the process can send them, keep-alive."""
    body = small_infer_body()
    url = f"http://{urls.http}/v2/models/{MODEL}/infer"
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=HTTP_FLOOD_CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while True:
                headers = {"Content-Type": "application/json"}
                if keyed:
                    headers["Authorization"] = f"Bearer {bad_key()}"
                tally.sent += 1
                try:
                    async with session.post(url, data=body, headers=headers) as resp:
                        await resp.read()
                        tally.answered(str(resp.status))
                except TimeoutError:
                    tally.failed("timeout")
                except (aiohttp.ClientError, OSError) as err:
                    tally.failed(type(err).__name__)

        await asyncio.gather(*(worker() for _ in range(HTTP_FLOOD_CONCURRENCY)))


async def http_badkey(urls: Urls, tally: Tally) -> None:
    await http_small(urls, tally, keyed=True)


async def http_nokey(urls: Urls, tally: Tally) -> None:
    await http_small(urls, tally, keyed=False)


async def http_large(urls: Urls, tally: Tally) -> None:
    """Bad keys with large bodies, each connection going round the sizes."""

    async def worker(offset: int) -> None:
        for i in itertools.count(offset):
            size = LARGE_SIZES_MIB[i % len(LARGE_SIZES_MIB)] * MIB
            await send_body(urls, tally, bad_key(), size)

    await asyncio.gather(*(worker(i) for i in range(LARGE_CONNECTIONS)))


def grpc_outcome(tally: Tally, code: grpc.StatusCode, details: str | None) -> None:
    """A call's status: the server's answer, unless the client gave up or never
    connected."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        tally.failed("timeout")
    elif code == grpc.StatusCode.UNAVAILABLE and "connect" in (details or "").lower():
        tally.failed("connect")
    else:
        tally.answered(code.name)


async def grpc_badkey(urls: Urls, tally: Tally) -> None:
    """``ModelInfer`` with fresh bad keys, many calls at a time on one channel."""
    req = grpc_infer_request()
    async with grpc.aio.insecure_channel(urls.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def worker() -> None:
            while True:
                metadata = (("authorization", f"Bearer {bad_key()}"),)
                tally.sent += 1
                try:
                    await stub.ModelInfer(req, metadata=metadata, timeout=REQUEST_TIMEOUT_S)
                    tally.answered("OK")
                except grpc.aio.AioRpcError as err:
                    grpc_outcome(tally, err.code(), err.details())

        await asyncio.gather(*(worker() for _ in range(GRPC_FLOOD_CONCURRENCY)))


async def big_bodies(urls: Urls, tally: Tally, key: str | None) -> None:
    async def worker() -> None:
        while True:
            await send_body(urls, tally, key, BIG_BODY_BYTES)

    await asyncio.gather(*(worker() for _ in range(BIG_CONNECTIONS)))


async def big_valid(urls: Urls, tally: Tally) -> None:
    await big_bodies(urls, tally, KEYS["hog"])


async def big_badkey(urls: Urls, tally: Tally) -> None:
    await big_bodies(urls, tally, bad_key())


async def trickle(urls: Urls, tally: Tally) -> None:
    """Slow bodies: 64 KiB every 100 ms of a declared 100 MiB, on several connections;
    a connection the server ends is opened again."""

    async def worker() -> None:
        while True:
            await send_body(
                urls,
                tally,
                KEYS["hog"],
                BIG_BODY_BYTES,
                chunk=TRICKLE_CHUNK,
                pause_s=TRICKLE_PAUSE_S,
            )

    await asyncio.gather(*(worker() for _ in range(TRICKLE_CONNECTIONS)))


async def stream_noread(urls: Urls, tally: Tally) -> None:
    """``ModelStreamInfer`` streams that write requests as fast as flow control lets
    them and never read a reply: whatever the server queues for them stays queued. A
    stream the server ends (its status is counted) is opened again."""
    req = grpc_infer_request()
    metadata = (("authorization", f"Bearer {KEYS['hog']}"),)

    async def one_stream() -> None:
        async with grpc.aio.insecure_channel(urls.grpc) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            while True:
                call = stub.ModelStreamInfer(metadata=metadata)
                try:
                    while True:
                        await call.write(req)
                        tally.sent += 1
                        tally.started.set()
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    grpc_outcome(tally, await call.code(), await call.details())
                finally:
                    call.cancel()

    await asyncio.gather(*(one_stream() for _ in range(NOREAD_STREAMS)))


@dataclass
class Sample:
    """One of the keyed tenant's requests: when it was sent (CLOCK_MONOTONIC, the same
    clock in every process here), its latency, its transport, its outcome."""

    t: float
    latency_s: float
    protocol: str
    outcome: str


class Probe:
    """The keyed tenant ``quiet``: one request at a time, alternating gRPC and HTTP
    (tritonclient, as users send), each sample kept."""

    def __init__(self, urls: Urls) -> None:
        self.urls = urls
        self.samples: list[Sample] = []
        self.headers = {"authorization": f"Bearer {KEYS['quiet']}"}
        ids = token_ids(seed=7)
        self.grpc_input = grpcaio.InferInput("INPUT_IDS", list(ids.shape), "INT32")
        self.grpc_input.set_data_from_numpy(ids)
        self.http_input = httpaio.InferInput("INPUT_IDS", list(ids.shape), "INT32")
        self.http_input.set_data_from_numpy(ids, binary_data=True)

    async def one(self, protocol: str, call: Callable[[], Awaitable[Any]]) -> str:
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(call(), REQUEST_TIMEOUT_S)
            outcome = "ok"
        except InferenceServerException as err:
            outcome = f"{err.status()}: {(err.message() or '')[:80]}"
        except TimeoutError:
            outcome = "timeout"
        except Exception as err:  # whatever the client raises is an outcome to report
            outcome = f"{type(err).__name__}: {str(err)[:80]}"
        self.samples.append(Sample(t0, time.monotonic() - t0, protocol, outcome))
        return outcome

    async def run(self, tally: Tally) -> None:
        grpc_client = grpcaio.InferenceServerClient(self.urls.grpc)
        http_client = httpaio.InferenceServerClient(self.urls.http)
        # A fresh headers dict per call: the HTTP client adds its own to the one it is given.
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "grpc": lambda: grpc_client.infer(MODEL, [self.grpc_input], headers=dict(self.headers)),
            "http": lambda: http_client.infer(MODEL, [self.http_input], headers=dict(self.headers)),
        }
        try:
            for _ in range(10):  # warm-up: connections, both transports
                for protocol, call in calls.items():
                    await self.one(protocol, call)
            self.samples.clear()
            tally.started.set()
            while True:
                for protocol, call in calls.items():
                    tally.sent += 1
                    await self.one(protocol, call)
        finally:
            await grpc_client.close()
            await http_client.close()


AttackFn = Callable[[Urls, Tally], Awaitable[None]]
ATTACKS: dict[str, AttackFn] = {
    "http_badkey": http_badkey,
    "http_nokey": http_nokey,
    "http_large": http_large,
    "grpc_badkey": grpc_badkey,
    "big_valid": big_valid,
    "big_badkey": big_badkey,
    "trickle": trickle,
    "stream_noread": stream_noread,
}


def say(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


async def agent_main(kind: str, urls: Urls) -> None:
    """An agent's life: start the attack (or probe), say when it has begun, answer each
    ``mark`` line with its tally, and stop when stdin closes (final tally, with the
    probe's samples)."""
    tally = Tally()
    probe = Probe(urls) if kind == "probe" else None
    work = probe.run(tally) if probe is not None else ATTACKS[kind](urls, tally)
    task = asyncio.ensure_future(work)
    begun = asyncio.ensure_future(tally.started.wait())
    await asyncio.wait({task, begun}, return_when=asyncio.FIRST_COMPLETED)
    say({"ready": tally.started.is_set(), **tally.snapshot()})
    loop = asyncio.get_running_loop()
    while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "mark":
        say(tally.snapshot())
    final = tally.snapshot()
    if task.done() and not task.cancelled() and task.exception() is not None:
        final["error"] = repr(task.exception())
    if probe is not None:
        final["samples"] = [asdict(s) for s in probe.samples]
    say(final)
    # No clean-up: an agent is disposable, and closing what a hostile client holds (a
    # stream the server no longer reads) may wait for ever.
    os._exit(0)


# ---- the driver's side --------------------------------------------------------------------


class Agent:
    """An agent process, driven over its stdin; every answer is one JSON line. A reply
    that does not come (an agent stuck or dead) is None, never an exception."""

    def __init__(self, kind: str, proc: asyncio.subprocess.Process) -> None:
        self.kind = kind
        self.proc = proc

    @classmethod
    async def start(cls, kind: str, urls: Urls) -> Agent:
        cmd = [sys.executable, "-m", "benchmarks.bench_hostile", "--agent", kind]
        cmd += ["--http", urls.http, "--grpc", urls.grpc]
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=256 * MIB,  # the probe's samples come back as one line
        )
        return cls(kind, proc)

    async def _line(self, timeout_s: float) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        except TimeoutError:
            return None
        if not line:
            return None
        doc: dict[str, Any] = json.loads(line)
        return doc

    async def ready(self) -> dict[str, Any] | None:
        return await self._line(READY_TIMEOUT_S)

    async def mark(self) -> dict[str, Any] | None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(b"mark\n")
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            return None
        return await self._line(STOP_TIMEOUT_S)

    async def stop(self) -> dict[str, Any] | None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.proc.stdin.close()
        final = await self._line(STOP_TIMEOUT_S)
        try:
            await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        return final


@dataclass
class AgentGroup:
    """Agents of one window, marked together."""

    members: list[Agent]
    finals: list[dict[str, Any] | None] = field(default_factory=list)

    async def mark(self) -> list[dict[str, Any] | None]:
        return list(await asyncio.gather(*(a.mark() for a in self.members)))


@contextlib.asynccontextmanager
async def agents(kinds: Sequence[str], urls: Urls) -> AsyncIterator[AgentGroup]:
    """Agents started together and ready (or given up on) before the body runs; stopped
    afterwards, their final tallies in ``finals``."""
    started = [await Agent.start(k, urls) for k in kinds]
    group = AgentGroup(started)
    try:
        readies = await asyncio.gather(*(a.ready() for a in started))
        for agent, ready in zip(started, readies, strict=True):
            if not (ready or {}).get("ready"):
                progress(f"  agent {agent.kind} did not start: {ready}")
        yield group
    finally:
        group.finals = list(await asyncio.gather(*(a.stop() for a in started)))
        for agent, final in zip(started, group.finals, strict=True):
            if final is None or "error" in final:
                progress(f"  agent {agent.kind} ended badly: {(final or {}).get('error')}")


class RssSampler:
    """The frontend's RSS (core, shells) every 100 ms, in a thread of the driver, so that
    peaks between the driver's own steps are seen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.t: list[float] = []
        self.core: list[int] = []
        self.shells: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = process_tree_rss_bytes(self.pid)
            self.t.append(time.monotonic())
            self.core.append(rss["core"])
            self.shells.append(rss["shells"])
            self._stop.wait(RSS_INTERVAL_S)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def total_mib(self, t0: float, t1: float) -> list[float]:
        return [
            (c + s) / MIB
            for t, c, s in zip(self.t, self.core, self.shells, strict=True)
            if t0 <= t <= t1
        ]


def latency_stats(samples: Sequence[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """Per transport and together: how many were sent in [t0, t1), p50/p99/max of the
    successful ones (ms), and the failures by outcome."""
    out: dict[str, Any] = {}
    for protocol in ("grpc", "http", "all"):
        window = [s for s in samples if t0 <= s["t"] < t1 and protocol in ("all", s["protocol"])]
        ok = [s["latency_s"] * 1e3 for s in window if s["outcome"] == "ok"]
        failures = Counter(s["outcome"] for s in window if s["outcome"] != "ok")
        out[protocol] = {
            "n": len(window),
            "p50_ms": float(np.percentile(ok, 50)) if ok else None,
            "p99_ms": float(np.percentile(ok, 99)) if ok else None,
            "max_ms": max(ok) if ok else None,
            "failures": dict(failures),
        }
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(during: dict[str, Any], solo: dict[str, Any]) -> dict[str, Any]:
    """The keyed tenant's p50/p99 during an attack over its solo ones, per transport."""
    return {
        p: {
            "p50_ratio": ratio(during[p]["p50_ms"], solo[p]["p50_ms"]),
            "p99_ratio": ratio(during[p]["p99_ms"], solo[p]["p99_ms"]),
        }
        for p in during
    }


def tally_delta(
    first: Sequence[dict[str, Any] | None], last: Sequence[dict[str, Any] | None]
) -> dict[str, Any]:
    """Outcomes, sends and bytes counted by a group of agents between two marks."""
    outcomes: Counter[str] = Counter()
    sent = bytes_sent = 0
    for a, b in zip(first, last, strict=True):
        if a is None or b is None:
            continue
        outcomes.update(b["outcomes"])
        outcomes.subtract(a["outcomes"])
        sent += b["sent"] - a["sent"]
        bytes_sent += b["bytes_sent"] - a["bytes_sent"]
    refused = sum(
        n
        for name, n in outcomes.items()
        if name.startswith("answered ") and name.split()[1] not in OK_STATUSES
    )
    accepted = sum(n for name, n in outcomes.items() if name.split()[-1] in OK_STATUSES)
    return {
        "open_at_end": sum(b["open"] for b in last if b is not None),
        "outcomes": {k: v for k, v in outcomes.items() if v},
        "sent": sent,
        "bytes_sent": bytes_sent,
        "refused": refused,
        "accepted": accepted,
    }


def cpu_total(pid: int) -> float:
    return sum(process_tree_cpu_s(pid).values())


def bench_config(source: Path | None = None) -> dict[str, Any]:
    """The example config, two tenants of our own, no rate limits: what a refusal costs
    is the subject, not a limiter's 429s."""
    cfg = load_example_config(source)
    cfg.pop("tier_limits", None)
    cfg["tenants"] = {name: {"tier": "standard", "api_keys": [key]} for name, key in KEYS.items()}
    return cfg


async def run_flood(urls: Urls, pid: int, timing: Timing) -> dict[str, Any]:
    """Solo window, then each flood kind alone, then all together; the probe runs on."""
    windows: dict[str, Any] = {}
    cpu0, t0 = cpu_total(pid), time.monotonic()
    progress(f"flood: keyed tenant solo for {timing.flood_solo:g} s")
    await asyncio.sleep(timing.flood_solo)
    windows["solo"] = {"t0": t0, "t1": time.monotonic(), "cpu_s": cpu_total(pid) - cpu0}
    phases: list[tuple[str, tuple[str, ...], float]] = [
        (k, (k,), timing.flood_kind) for k in FLOOD_KINDS
    ]
    phases.append(("all", FLOOD_KINDS, timing.flood_all))
    for name, kinds, seconds in phases:
        async with agents(kinds, urls) as group:
            first = await group.mark()
            cpu0, t0 = cpu_total(pid), time.monotonic()
            await asyncio.sleep(seconds)
            last = await group.mark()
            t1, cpu1 = time.monotonic(), cpu_total(pid)
        delta = tally_delta(first, last)
        windows[name] = {"t0": t0, "t1": t1, "cpu_s": cpu1 - cpu0, **delta}
        progress(
            f"flood {name}: {delta['refused'] / (t1 - t0):,.0f} refusals/s, "
            f"{(cpu1 - cpu0) / max(delta['refused'], 1) * 1e6:,.0f} µs CPU each (gross), "
            f"{delta['bytes_sent'] / MIB / max(delta['refused'], 1):,.1f} MiB sent each; "
            f"{delta['accepted']} accepted; {dict(delta['outcomes'])}"
        )
    return windows


def flood_figures(windows: dict[str, Any], samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The keyed tenant's latency per window beside solo; CPU per refusal, net of the
    keyed tenant's own requests at their solo cost."""
    solo = windows["solo"]
    solo["latency"] = latency_stats(samples, solo["t0"], solo["t1"])
    keyed_solo = solo["latency"]["all"]["n"]
    cpu_per_keyed = solo["cpu_s"] / keyed_solo if keyed_solo else 0.0
    solo["cpu_us_per_keyed_request"] = cpu_per_keyed * 1e6
    for name, w in windows.items():
        if name == "solo":
            continue
        w["latency"] = latency_stats(samples, w["t0"], w["t1"])
        w["vs_solo"] = compare(w["latency"], solo["latency"])
        seconds = w["t1"] - w["t0"]
        w["refused_per_s"] = w["refused"] / seconds
        w["sent_per_s"] = w["sent"] / seconds
        refused = w["refused"] or None
        net = w["cpu_s"] - w["latency"]["all"]["n"] * cpu_per_keyed
        w["cpu_us_per_refusal"] = w["cpu_s"] / refused * 1e6 if refused else None
        w["cpu_us_per_refusal_net"] = net / refused * 1e6 if refused else None
        w["frontend_cores"] = w["cpu_s"] / seconds
        w["mib_sent_per_refusal"] = w["bytes_sent"] / MIB / refused if refused else None
    return windows


async def run_memory(urls: Urls, rss: RssSampler, timing: Timing) -> dict[str, Any]:
    """Solo window, then per scenario: before, the attack, after."""
    windows: dict[str, Any] = {}
    t0 = time.monotonic()
    progress(f"memory: keyed tenant solo for {timing.memory_solo:g} s")
    await asyncio.sleep(timing.memory_solo)
    windows["solo"] = {"t0": t0, "t1": time.monotonic()}
    for kind in MEMORY_KINDS:
        before0 = time.monotonic()
        await asyncio.sleep(timing.before)
        before1 = time.monotonic()
        async with agents((kind,), urls) as group:
            first = await group.mark()
            t0 = time.monotonic()
            await asyncio.sleep(timing.during)
            last = await group.mark()
            t1 = time.monotonic()
        stopped = time.monotonic()
        await asyncio.sleep(timing.after)
        after1 = time.monotonic()
        w = {
            "before": [before0, before1],
            "t0": t0,
            "t1": t1,
            "stopped": stopped,
            "after": [stopped, after1],
            **tally_delta(first, last),
        }
        w.update(rss_figures(rss, w))
        windows[kind] = w
        progress(
            f"memory {kind}: RSS {w['rss_before_mib']:.0f} -> peak {w['rss_peak_mib']:.0f} -> "
            f"{w['rss_after_mib']:.0f} MiB; sent {w['sent']}, "
            f"{w['bytes_sent'] / MIB:,.0f} MiB, {w['open_at_end']} connections open at the "
            f"end; {w['outcomes']}"
        )
    return windows


def rss_figures(rss: RssSampler, w: dict[str, Any]) -> dict[str, Any]:
    """RSS before (median of the before window), peak (from the attack's start until its
    client stopped), after (median of the after window's second half), in MiB."""
    before = rss.total_mib(*w["before"])
    peak = rss.total_mib(w["before"][1], w["stopped"])
    a0, a1 = w["after"]
    after = rss.total_mib((a0 + a1) / 2, a1)
    return {
        "rss_before_mib": float(np.median(before)) if before else float("nan"),
        "rss_peak_mib": max(peak) if peak else float("nan"),
        "rss_after_mib": float(np.median(after)) if after else float("nan"),
    }


def memory_figures(windows: dict[str, Any], samples: list[dict[str, Any]]) -> dict[str, Any]:
    solo = windows["solo"]
    solo["latency"] = latency_stats(samples, solo["t0"], solo["t1"])
    for name, w in windows.items():
        if name != "solo":
            w["latency"] = latency_stats(samples, w["t0"], w["t1"])
            w["vs_solo"] = compare(w["latency"], solo["latency"])
    return windows


def rebase(windows: dict[str, Any], origin: float) -> None:
    """Window times as seconds from the part's start (the JSON and plots' time axis)."""
    for w in windows.values():
        for key in ("t0", "t1", "stopped"):
            if key in w:
                w[key] -= origin
        for key in ("before", "after"):
            if key in w:
                w[key] = [x - origin for x in w[key]]


@dataclass
class Part:
    """One part's figures: its windows, the keyed tenant's samples, its start (the
    time axis's origin), and the frontend's exit code if an attack killed it."""

    windows: dict[str, Any]
    samples: list[dict[str, Any]]
    origin: float
    frontend_exit: int | None


async def part(
    name: str,
    tri_urls: tuple[str, str],
    args: argparse.Namespace,
    body: Callable[[Urls, int], Awaitable[dict[str, Any]]],
) -> Part:
    """One frontend and the keyed tenant's probe around ``body``."""
    grpc_url, http_url = tri_urls
    workers = args.workers
    with frontend(
        bench_config(args.source), grpc_url, workers=workers, http_url=http_url, source=args.source
    ) as fe:
        urls = Urls(http=fe.http_url, grpc=fe.grpc_url)
        progress(f"{name}: frontend up (pid {fe.process.pid}, {workers} shell(s)); probe starts")
        probe = await Agent.start("probe", urls)
        origin = time.monotonic()
        samples: list[dict[str, Any]] = []
        try:
            if not ((await probe.ready()) or {}).get("ready"):
                progress(f"{name}: the probe did not start; its latencies will be missing")
            origin = time.monotonic()
            windows = await body(urls, fe.process.pid)
        finally:
            final = await probe.stop()
            samples = (final or {}).get("samples", [])
            if final is None or "error" in final:
                progress(f"{name}: the probe ended badly: {(final or {}).get('error')}")
        # An attack that kills the frontend is a finding, not a crash of the benchmark.
        code = fe.process.poll()
        if code is not None:
            progress(f"{name}: THE FRONTEND EXITED ({code}) during the attacks")
    return Part(windows, samples, origin, code)


def log_scale(ax: Any) -> None:
    """A log y axis where there is something to show on it (a run whose probe failed
    has no latencies)."""
    if ax.has_data() and ax.dataLim.y1 > 0:
        ax.set_yscale("log")


def plot_flood(flood: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(flood)
    fig, (ax_lat, ax_cpu) = plt.subplots(1, 2, figsize=(13, 4.8))
    x = np.arange(len(names))
    for i, protocol in enumerate(("grpc", "http")):
        p50 = [flood[n]["latency"][protocol]["p50_ms"] or np.nan for n in names]
        p99 = [flood[n]["latency"][protocol]["p99_ms"] or np.nan for n in names]
        at = x + (i - 0.5) * 0.38
        ax_lat.bar(at, p99, 0.38, color=f"C{i}", alpha=0.55, label=f"{protocol} p99")
        ax_lat.scatter(at, p50, color=f"C{i}", marker="_", s=300, zorder=3, label=f"{protocol} p50")
    log_scale(ax_lat)
    ax_lat.set_xticks(x, [n.replace("_", "\n") for n in names], fontsize=8)
    ax_lat.set_ylabel("keyed tenant latency (ms, log)")
    ax_lat.set_title("keyed tenant, solo and under each flood")
    ax_lat.legend(fontsize=8)
    floods = [n for n in names if n != "solo"]
    cpu = [flood[n]["cpu_us_per_refusal_net"] or np.nan for n in floods]
    bars = ax_cpu.bar(range(len(floods)), cpu, color="C3")
    for bar, n in zip(bars, floods, strict=True):
        label = f"{flood[n]['refused_per_s']:,.0f}/s"
        where = (bar.get_x() + bar.get_width() / 2, bar.get_height())
        ax_cpu.annotate(label, where, ha="center", va="bottom", fontsize=8)
    log_scale(ax_cpu)
    ax_cpu.set_xticks(range(len(floods)), [n.replace("_", "\n") for n in floods], fontsize=8)
    ax_cpu.set_ylabel("frontend CPU per refusal (µs, net, log)")
    ax_cpu.set_title("cost of a refusal (label: refusals/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    progress(f"plot written to {path}")


def plot_memory(
    memory: dict[str, Any], rss: dict[str, list[float]], samples: list[dict[str, Any]], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_lat) = plt.subplots(2, 1, figsize=(13, 7), sharex=True)
    ax_rss.plot(rss["t"], rss["total_mib"], color="k", label="core + shells")
    ax_rss.plot(rss["t"], rss["core_mib"], color="C0", lw=0.8, label="core")
    ax_rss.plot(rss["t"], rss["shells_mib"], color="C1", lw=0.8, label="shells")
    ax_rss.set_ylabel("frontend RSS (MiB)")
    for i, kind in enumerate(MEMORY_KINDS):
        w = memory[kind]
        for ax in (ax_rss, ax_lat):
            ax.axvspan(w["t0"], w["t1"], color=f"C{i + 2}", alpha=0.15)
        middle = ((w["t0"] + w["t1"]) / 2, 1.0)
        coords = ("data", "axes fraction")
        ax_rss.annotate(kind, middle, xycoords=coords, ha="center", va="top", fontsize=8)
    ax_rss.legend(loc="upper left", fontsize=8)
    for i, protocol in enumerate(("grpc", "http")):
        pts = [s for s in samples if s["protocol"] == protocol and s["outcome"] == "ok"]
        t = [s["t"] for s in pts]
        ms = [s["latency_s"] * 1e3 for s in pts]
        ax_lat.scatter(t, ms, s=2, color=f"C{i}", label=protocol)
    log_scale(ax_lat)
    ax_lat.set_ylabel("keyed tenant latency (ms, log)")
    ax_lat.set_xlabel("seconds")
    ax_lat.legend(loc="upper left", fontsize=8)
    fig.suptitle("frontend memory and another tenant's latency under memory attacks (shaded)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    progress(f"plot written to {path}")


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def report(results: dict[str, Any]) -> None:
    print()
    print("Flood: keyed tenant (gRPC / HTTP) p99 ms and ratio to solo; refusals; frontend CPU")
    print(
        f"{'window':<12} {'gRPC p50':>9} {'gRPC p99':>9} {'x solo':>7} {'HTTP p99':>9} "
        f"{'x solo':>7} {'refused/s':>10} {'µs/refusal':>11} {'net':>8} {'cores':>6}"
    )
    for name, w in results["flood"].items():
        lat, vs = w["latency"], w.get("vs_solo", {})
        print(
            f"{name:<12} {fmt(lat['grpc']['p50_ms']):>9} {fmt(lat['grpc']['p99_ms']):>9} "
            f"{fmt(vs.get('grpc', {}).get('p99_ratio'), '.2f'):>7} "
            f"{fmt(lat['http']['p99_ms']):>9} "
            f"{fmt(vs.get('http', {}).get('p99_ratio'), '.2f'):>7} "
            f"{fmt(w.get('refused_per_s'), ',.0f'):>10} "
            f"{fmt(w.get('cpu_us_per_refusal'), ',.0f'):>11} "
            f"{fmt(w.get('cpu_us_per_refusal_net'), ',.0f'):>8} "
            f"{fmt(w.get('frontend_cores'), '.2f'):>6}"
        )
    print()
    print("Memory: frontend RSS (MiB) before / peak / after; keyed tenant p99 ms, ratio to solo")
    for name, w in results["memory"].items():
        lat, vs = w["latency"], w.get("vs_solo", {})
        rss = (
            f"{w['rss_before_mib']:.0f} / {w['rss_peak_mib']:.0f} / {w['rss_after_mib']:.0f}"
            if "rss_before_mib" in w
            else "-"
        )
        print(
            f"{name:<14} RSS {rss:<18} gRPC p99 {fmt(lat['grpc']['p99_ms']):>7} "
            f"(x{fmt(vs.get('grpc', {}).get('p99_ratio'), '.2f')}) "
            f"HTTP p99 {fmt(lat['http']['p99_ms']):>7} "
            f"(x{fmt(vs.get('http', {}).get('p99_ratio'), '.2f')}) "
            f"{w.get('outcomes', '')}"
        )


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    timing = QUICK if args.quick else FULL
    out: dict[str, Any] = {"quick": args.quick, "workers": args.workers, "timing": asdict(timing)}
    out["ref"] = args.ref or "working tree"
    with contextlib.ExitStack() as stack, triton() as tri:
        args.source = stack.enter_context(baseline_checkout(args.ref)) if args.ref else None
        tri_urls = (tri.grpc_url, tri.http_url)

        async def flood_body(urls: Urls, pid: int) -> dict[str, Any]:
            return await run_flood(urls, pid, timing)

        flood = await part("flood", tri_urls, args, flood_body)
        out["flood"] = flood_figures(flood.windows, flood.samples)
        out["flood_frontend_exit"] = flood.frontend_exit
        rebase(out["flood"], flood.origin)

        samplers: list[RssSampler] = []

        async def memory_body(urls: Urls, pid: int) -> dict[str, Any]:
            with RssSampler(pid) as rss:
                samplers.append(rss)
                return await run_memory(urls, rss, timing)

        memory = await part("memory", tri_urls, args, memory_body)
    out["memory"] = memory_figures(memory.windows, memory.samples)
    out["memory_frontend_exit"] = memory.frontend_exit
    origin = memory.origin
    samples = memory.samples
    rebase(out["memory"], origin)
    rss = samplers[0]
    out["rss_series"] = {
        "t": [round(t - origin, 3) for t in rss.t],
        "core_mib": [round(c / MIB, 2) for c in rss.core],
        "shells_mib": [round(x / MIB, 2) for x in rss.shells],
        "total_mib": [round((c + x) / MIB, 2) for c, x in zip(rss.core, rss.shells, strict=True)],
    }
    for sample in samples:
        sample["t"] -= origin
    out["_memory_samples"] = samples  # for the plot; not written
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows: a smoke run")
    parser.add_argument("--workers", type=int, default=2, help="the frontend's shell processes")
    parser.add_argument(
        "--ref",
        help="run the frontend of this git commit (a temporary worktree), e.g. to compare "
        "the code before and after a fix; default: this working tree",
    )
    parser.add_argument("--agent", choices=[*ATTACKS, "probe"], help=argparse.SUPPRESS)
    parser.add_argument("--http", help=argparse.SUPPRESS)
    parser.add_argument("--grpc", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        uvloop.run(agent_main(args.agent, Urls(http=args.http, grpc=args.grpc)))
        return
    results = asyncio.run(main_async(args))
    samples = results.pop("_memory_samples")
    report(results)
    name = "hostile_quick" if args.quick else "hostile"
    if args.ref:  # a baseline beside the working tree's figures, not over them
        name += "_" + "".join(c if c.isalnum() else "_" for c in args.ref)
    path = write_result(name, results)
    plot_flood(results["flood"], path.with_name(f"{name}_flood.png"))
    plot_memory(
        results["memory"], results["rss_series"], samples, path.with_name(f"{name}_memory.png")
    )


if __name__ == "__main__":
    main()
