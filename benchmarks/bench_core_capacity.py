"""How far one core goes (issue 30, item 5): one ``fair-frontend core`` on one CPU.

One real core process (``fair-frontend core --election none``) is pinned to CPU 0. On CPU 1
one driver process plays 16-64 shells: each its own gRPC connection to the core's link,
the shared secret in its metadata (``--link tcp``: the raw TCP link of
``fair_frontend.wire.tcp``, the secret in each connection's preamble), speaking the public
records (``Hello``, ``Ready``, ``Call``, ``Produced``, ``Ended``; ``fair_frontend.wire``)
exactly as a shell process
frames them. Beside it on CPU 1, a Triton stand-in (a grpc.aio server with tritonclient's
generated servicer, the real ``embed`` and ``llm`` configs of ``model_repository/``)
answers every call at once: the core's CPU is then all that limits it.

Unary requests go either way a shell sends them (``--unary``, the endpoint's ``unary``
in the core's config): ``one_hop`` (the default, as a shell process does): the shell
sends the call's facts (``Call`` without inputs, outputs or parameters, with the batch key
``batching.wire_key`` gives), the core forms the batch and grants each shell its rows
(``Rows``), and the shell, which would send them to Triton itself, reports them served at
once (``RowsDone``, as the gateway does when Triton answered) and answers its clients: the
simulated shell skips that Triton call (the stand-in would answer it at once; what the
core does and carries is the same). ``relay``: the whole call (its tensor) to the core,
which sends the batch to the stand-in and answers with an ``Answer``. ``both``: the
relay, then one hop, each with a core of its own, in one run; the streams and tokens
workloads run once, with one hop.

Three workloads, each ramped in open-loop steps of offered load until the core saturates
(its CPU at >= 95 % of its one CPU, or its answers falling below 90 % of what was
offered):

* ``unary``: ``embed`` calls of 128 tokens (one hop: facts in, grants out; relay: tensors
  in the call, batches to the stand-in's ``ModelInfer``, outputs back in the answer): CPU
  per request, and the bytes on the core's sockets per request (the kernel's TCP counts,
  ``ss``, on the link and on the Triton side);
* ``streams``: new streams on ``llm`` (decoupled, engine mode, 64 slots): the core grants
  each a slot; the simulated shell reports its one token (``Produced``) and its end
  (``Ended``) at once. CPU per new stream;
* ``tokens``: 256-token streams on ``llm``, always more waiting than slots; the shells
  report the tokens of their running streams once per ``PRODUCED_TICK_S`` (one
  ``Produced`` per shell per tick, as a shell does), at the offered rate in all. CPU per
  reported token (raw, and less what the streams' starts cost at the streams rate).

Then, at saturation, the shares of two backlogged tenants of weights 2:1 (``acme`` on the
even shells, ``globex`` on the odd ones: shares across shells) from what the core
answered (unary) or granted (streams) or from the tokens of the streams it granted
(tokens), and the VTC bound there: the largest difference of weight-normalised service
between the two over the window, in tokens. CPU per unit comes from the core's own
``/proc/<pid>/stat`` (utime + stime, all its threads); how loaded the machine was (each
CPU's busy share from ``/proc/stat``, less the core's and the driver's own) goes with
every step.

The driver's shell is one small class (``SimShell``): its unary call is one method
(``unary``) and what the core sends back is taken in one (``received``).

    .venv/bin/python -m benchmarks.bench_core_capacity [--quick] [--shells 32]
        [--unary one_hop|relay|both] [--link grpc|tcp|both]
        [--request-log off|shells|core]

``--link both``: everything measured over gRPC, then again over TCP (a core of its own
each, one after the other in the same run); TCP's results go under ``<workload>_tcp``, and
``tcp_vs_grpc`` holds the ratio of the core's CPU per unit, TCP's over gRPC's, per
workload: at saturation, and over the steps both ran at the same offered rate.

``--quick``: shorter steps and a coarser ramp (under about a minute), written to
``core_capacity_quick.json``; the default run takes a few minutes and writes
``benchmarks/results/core_capacity.json`` and ``core_capacity.png``. The unary results go
under ``unary`` (one hop where it ran, else the relay) and, with ``both``, the relay's
under ``unary_relay``. With ``FAIR_BENCH_PROFILE=FILE`` in its environment the core runs
under cProfile and writes its profile to FILE when it exits (where its CPU goes; that
run's figures are not its own).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from benchmarks.harness import (
    RESULTS,
    ROOT,
    load_example_config,
    progress,
    wait_http_ready,
    write_config,
)
from fair_frontend.backends.triton.embedded import free_port
from fair_frontend.backends.triton.model_config import model_info
from fair_frontend.batching import wire_key
from fair_frontend.config import parse_config
from fair_frontend.endpoint import plan
from fair_frontend.models import ModelInfo
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.wire.framing import Framed, to_shell
from fair_frontend.wire.records import (
    LINK_VERSION,
    PRODUCED_TICK_S,
    Answer,
    Call,
    Ended,
    Grant,
    Hello,
    Produced,
    QueueView,
    Ready,
    Rows,
    RowsDone,
    Settings,
    bin_gaps,
    gaps_of,
)
from fair_frontend.wire.remote import METHOD, SECRET_HEADER, StreamTransport
from fair_frontend.wire.tcp import ACCEPTED, HEARTBEAT_S, LINKS, SILENT_S, preamble, tune

SECRET = "bench-core-capacity-secret-0123456789"
TENANTS = {"acme": 2.0, "globex": 1.0}  # weights
EMBED_TOKENS = 128
PROMPT_TOKENS = 16
STREAM_TOKENS = 256  # output tokens of each stream of the tokens workload
ENGINE_SLOTS = 64  # llm's max_inflight in the example config
# Streams per tenant in the tokens workload, running or waiting: acme (weight 2) holds up
# to 56 of the 64 slots (the example's reserved_slots: 8) and still has some waiting.
WAITING_STREAMS = 96
CORE_CPU, DRIVER_CPU = 0, 1
# Whether there are two CPUs to pin to, read before the driver pins itself to one: the
# processes of a second core (``--unary both``) are started from the pinned driver.
PINNING = len(os.sched_getaffinity(0)) > 1
BUSY_SATURATED = 0.95
KEEPING_UP = 0.90
DISTURBED_BUSY = 0.5  # a step behind with the core less busy than this is measured again
DISTURBED_TRIES = 3

# Reference rates of one GPU (issue 30): one H200 answered 3,638 embed requests/s straight
# from Triton; an H100 emits about 5,000-5,800 tokens/s on an 8B model (MLPerf v5.1).
H200_EMBED_PER_S = 3638.0
H100_8B_TOKENS_PER_S = (5000.0, 5800.0)
# Issue 30's targets for the core: CPU per unit (µs) and socket bytes per unary request.
TARGETS = {"unary": 10.0, "streams": 20.0, "tokens": 0.5, "bytes_per_request": 300}
UNITS = {"unary": "request", "streams": "new stream", "tokens": "token"}
UNARY_MODES = ("one_hop", "relay")


# ---- the Triton stand-in (a process of its own, on the driver's CPU) ------------------------


def serve_standin(port: int) -> None:
    """KServe v2 over gRPC with the real ``embed`` and ``llm`` configs; every call
    answered at once (``ModelInfer``: the outputs' right shapes, zeros)."""
    import uvloop
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

    configs = {}
    for name in ("embed", "llm"):
        text = (ROOT / "model_repository" / name / "config.pbtxt").read_text()
        configs[name] = text_format.Parse(text, model_config_pb2.ModelConfig())
    width = 128  # embed's EMBEDDING dims
    row = bytes(4 * width)
    dtypes = {v: k for k, v in model_config_pb2.DataType.items()}

    class StandIn(service_pb2_grpc.GRPCInferenceServiceServicer):
        async def ServerLive(self, request: Any, context: Any) -> Any:
            return service_pb2.ServerLiveResponse(live=True)

        async def ServerReady(self, request: Any, context: Any) -> Any:
            return service_pb2.ServerReadyResponse(ready=True)

        async def ModelReady(self, request: Any, context: Any) -> Any:
            return service_pb2.ModelReadyResponse(ready=request.name in configs)

        async def ServerMetadata(self, request: Any, context: Any) -> Any:
            return service_pb2.ServerMetadataResponse(name="stand-in", version="2.51.0")

        async def ModelMetadata(self, request: Any, context: Any) -> Any:
            if request.name not in configs:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model: '{request.name}'")
            cfg = configs[request.name]
            meta = service_pb2.ModelMetadataResponse(
                name=cfg.name, versions=["1"], platform="python"
            )
            batch = [-1] if cfg.max_batch_size else []
            for spec, out in ((cfg.input, meta.inputs), (cfg.output, meta.outputs)):
                for t in spec:
                    out.add(
                        name=t.name,
                        datatype=dtypes[t.data_type]
                        .removeprefix("TYPE_")
                        .replace("STRING", "BYTES"),
                        shape=[*batch, *t.dims],
                    )
            return meta

        async def ModelConfig(self, request: Any, context: Any) -> Any:
            if request.name not in configs:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model: '{request.name}'")
            cfg = configs[request.name]
            return service_pb2.ModelConfigResponse(config=cfg)

        async def ModelInfer(self, request: Any, context: Any) -> Any:
            rows = request.inputs[0].shape[0] if request.inputs else 1
            reply = service_pb2.ModelInferResponse(
                model_name=request.model_name, model_version="1", id=request.id
            )
            reply.outputs.add(name="EMBEDDING", datatype="FP32", shape=[rows, width])
            reply.raw_output_contents.append(row * rows)
            return reply

        async def ModelStatistics(self, request: Any, context: Any) -> Any:
            return service_pb2.ModelStatisticsResponse()

    async def main() -> None:
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(StandIn(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    uvloop.run(main())


# ---- what the machine says --------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """The process's CPU seconds (user + system, every thread), from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def cpu_times() -> dict[int, tuple[float, float]]:
    """Per CPU: (busy, total) seconds since boot, from ``/proc/stat``."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name != "cpu":
            v = [int(x) / _TICK for x in values]
            idle = v[3] + v[4]  # idle + iowait
            out[int(name[3:])] = (sum(v[:8]) - idle, sum(v[:8]))
    return out


def socket_bytes(link_port: int, triton_port: int) -> dict[str, int]:
    """TCP payload bytes (sent + received, the kernel's counts) on the core's sockets: the
    link's (local port ``link_port``) and its connections to Triton (peer
    ``triton_port``)."""
    text = subprocess.run(
        ["ss", "-tinH", "state", "established"], capture_output=True, text=True, check=True
    ).stdout
    totals = {"link": 0, "triton": 0}
    kind: str | None = None
    for line in text.splitlines():
        if not line[:1].isspace():
            ends = [t for t in line.split() if ":" in t]
            local, peer = (int(e.rsplit(":", 1)[1]) for e in ends[-2:])
            kind = "link" if local == link_port else "triton" if peer == triton_port else None
            continue
        if kind is None:
            continue
        for item in line.split():
            key, _, value = item.partition(":")
            if key in ("bytes_sent", "bytes_received"):
                totals[kind] += int(value)
    return totals


@dataclass
class Snapshot:
    """Everything a step's window is measured between."""

    at: float
    core_cpu: float
    driver_cpu: float
    standin_cpu: float
    cpus: dict[int, tuple[float, float]]
    sockets: dict[str, int]
    books: dict[str, dict[str, float]]
    outstanding: int  # calls sent and not yet answered or granted
    produced_records: int


# ---- the simulated shells ---------------------------------------------------------------------


@dataclass
class Books:
    """What the core did for one tenant, as the driver saw it (cumulative)."""

    sent: int = 0
    answered: int = 0  # unary: answers with outputs; streams: grants
    faults: int = 0
    served: float = 0.0  # cost served: tokens (answered requests', granted prompts, output)
    tokens: int = 0  # output tokens reported
    latencies: list[float] = field(default_factory=list)  # call -> answer or grant, s

    def copy(self) -> dict[str, float]:
        return {
            "sent": self.sent,
            "answered": self.answered,
            "faults": self.faults,
            "served": self.served,
            "tokens": self.tokens,
        }


@dataclass
class Stream:
    """A granted stream a simulated shell relays: its tokens so far."""

    call: Call
    tokens: int = 0


class SimShell(Framed):
    """One shell process, as the core sees it: one gRPC stream with the secret (or, with
    ``--link tcp``, one TCP connection, the secret in its preamble), ``Hello`` first,
    ``Ready`` after the ``Settings``; then calls, and for each granted stream its tokens
    and its end. What a shell does for its clients (decode, identify, validate) is
    done once: the calls are built as a shell builds them after that.

    ``unary`` is the one place a unary request is made and ``received`` the one place
    its answer (relay) or its grant (one hop: ``Rows``) is taken."""

    decoder = to_shell

    def __init__(self, index: int, driver: Driver) -> None:
        super().__init__()
        self.index = index
        self.driver = driver
        self.settings: Settings | None = None
        self.got_settings = asyncio.Event()
        self.pending: dict[int, tuple[str, float]] = {}  # call id -> (tenant, sent at)
        self.streams: dict[int, Stream] = {}  # granted, not ended
        self.streams_asked: dict[int, Call] = {}  # stream calls not yet granted
        self._ids = iter(range(1, 1 << 62))
        self.faults: list[str] = []
        self.channel: grpc.aio.Channel | None = None  # gRPC's
        self.reader: asyncio.Task[None] | None = None
        self.verdict: bytes | None = None  # TCP's: the core's answer to the preamble

    async def connect(self, address: str) -> None:
        if self.driver.link == "tcp":
            await self._connect_tcp(address)
            return
        channel = grpc.aio.insecure_channel(
            address,
            options=[("grpc.use_local_subchannel_pool", 1)],  # a connection of its own
        )
        call = channel.stream_stream(METHOD)(metadata=((SECRET_HEADER, SECRET),))
        self.reattach(StreamTransport(call.write, self, done_writing=call.done_writing))
        self.channel = channel
        self.send(Hello(self.index, os.getpid(), LINK_VERSION))
        self.reader = asyncio.get_running_loop().create_task(self._read(call))
        await asyncio.wait_for(self.got_settings.wait(), 30)
        self.send(Ready(0, 0))

    async def _connect_tcp(self, address: str) -> None:
        """Over the raw TCP link (``fair_frontend.wire.tcp``), as a shell's ``RemoteLink``
        connects: the preamble, ``Hello``; the core's verdict, its ``Settings``; ``Ready``.
        Heartbeats both ways, as a shell's."""
        host, port = address.rsplit(":", 1)
        transport, _ = await asyncio.get_running_loop().create_connection(
            lambda: self, host, int(port)
        )
        tune(transport)
        transport.write(preamble(SECRET.encode()))
        self.send(Hello(self.index, os.getpid(), LINK_VERSION))
        await asyncio.wait_for(self.got_settings.wait(), 30)
        self.start_heartbeat(HEARTBEAT_S, SILENT_S)
        self.send(Ready(0, 0))

    def data_received(self, data: bytes) -> None:
        if self.driver.link == "tcp" and self.verdict is None:
            self.verdict, data = data[:1], data[1:]
            if self.verdict != ACCEPTED:
                self.faults.append(f"the core refused the connection ({self.verdict!r})")
                return
        if data:
            super().data_received(data)

    async def _read(self, call: Any) -> None:
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            while True:
                data = await call.read()
                if data is grpc.aio.EOF:
                    return
                self.data_received(data)

    async def disconnect(self) -> None:
        self.close()
        if self.reader is not None:
            self.reader.cancel()
        if self.channel is not None:
            await self.channel.close()

    # calls

    def unary(self, tenant: str) -> None:
        """An ``embed`` request of 128 tokens: one hop, its facts (the gateway's
        ``_facts``: the request without inputs, outputs or parameters, and its batch key);
        relay, its tensor in the call."""
        driver = self.driver
        if driver.unary == "one_hop":
            self._call(tenant, driver.embed_facts, EMBED_TOKENS, [EMBED_TOKENS], False, 0,
                       nbytes=driver.embed_nbytes, key=driver.embed_key)  # fmt: skip
        else:
            self._call(tenant, driver.embed_request, EMBED_TOKENS, [EMBED_TOKENS], False, 0)

    def stream(self, tenant: str, max_tokens: int) -> None:
        """An ``llm`` stream asking for ``max_tokens``."""
        tokens = PROMPT_TOKENS + max_tokens
        self._call(
            tenant,
            self.driver.llm_facts,
            tokens,
            None,
            True,
            max_tokens,
            nbytes=self.driver.llm_nbytes,
        )

    def _call(
        self,
        tenant: str,
        request: InferRequest,
        tokens: int,
        lengths: list[int] | None,
        stream: bool,
        max_tokens: int,
        nbytes: int | None = None,
        key: bytes = b"",
    ) -> None:
        call_id = next(self._ids)
        now = time.monotonic()
        if nbytes is None:
            nbytes = sum(t.nbytes for t in request.inputs)
        call = Call(
            call_id,
            tenant,
            self.driver.priority,
            now,
            time.time(),
            1,
            tokens,
            nbytes,
            lengths,
            request,
            stream,
            max_tokens,
            key=key,
            # One hop (a unary call's rows, a stream's slot): as a shell's config says.
            logged=(bool(key) or stream) and LOGGED_BY_SHELLS,
        )
        self.pending[call_id] = (tenant, now)
        self.driver.books[tenant].sent += 1
        self.send(call)
        if stream:
            self.streams_asked[call_id] = call

    def books_token(self, stream: Stream, n: int) -> None:
        stream.tokens += n
        self.driver.books[stream.call.tenant].tokens += n

    def produced(
        self, entries: list[tuple[int, int, float]], gaps: dict[str, tuple[float, dict[int, int]]]
    ) -> None:
        if entries:
            self.driver.produced_records += 1
            times = [(tenant, "llm", *gaps_of(*binned)) for tenant, binned in gaps.items()]
            self.send(Produced(entries, times))

    def ended(self, call_id: int) -> None:
        self.streams.pop(call_id, None)
        self.send(Ended(call_id))

    # from the core

    def received(self, record: Any) -> None:
        if isinstance(record, Rows):
            self.rows(record)
        elif isinstance(record, Answer):
            sent = self.pending.pop(record.id, None)
            if sent is None:
                return
            self.streams_asked.pop(record.id, None)
            books = self.driver.books[sent[0]]
            if record.fault is not None:
                books.faults += 1
                if len(self.faults) < 5:
                    self.faults.append(record.fault.message)
            else:
                books.answered += 1
                books.served += EMBED_TOKENS
                books.latencies.append(time.monotonic() - sent[1])
            self.driver.answered(self, sent[0])
        elif isinstance(record, Grant):
            sent = self.pending.pop(record.id, None)
            call = self.streams_asked.pop(record.id, None)
            if sent is None or call is None:
                return
            books = self.driver.books[sent[0]]
            books.answered += 1
            books.served += PROMPT_TOKENS
            books.latencies.append(time.monotonic() - sent[1])
            self.streams[record.id] = Stream(call)
            self.driver.granted(self, record.id)
        elif isinstance(record, Settings):
            self.settings = record
            self.got_settings.set()
        elif isinstance(record, QueueView):
            pass
        else:  # Draining, Stop, FlushTally...: not expected in a run
            self.faults.append(f"unexpected {type(record).__name__}")

    def rows(self, rows: Rows) -> None:
        """The core granted these calls rows of a batch. A shell would pack them into one
        Triton request; this one takes them as served by a Triton that answers at once
        (no call: the core's work and bytes are the same), reports them in one
        ``RowsDone`` (``embed`` has no token output: 0 tokens each) before answering its
        clients, as the gateway's ``_send_rows`` does."""
        served: list[tuple[int, int]] = []
        gone: list[int] = []
        tenants: list[str] = []
        now = time.monotonic()
        for call_id in rows.calls:
            sent = self.pending.pop(call_id, None)
            if sent is None:
                gone.append(call_id)
                continue
            served.append((call_id, 0))
            tenants.append(sent[0])
            books = self.driver.books[sent[0]]
            books.answered += 1
            books.served += EMBED_TOKENS
            books.latencies.append(now - sent[1])
        self.send(RowsDone(rows.model, rows.batch, served, gone, None, "1", 0.0))
        for tenant in tenants:
            self.driver.answered(self, tenant)


class Driver:
    """The simulated shells and the load they put on the core."""

    def __init__(self, shells: int, unary: str = "one_hop", link: str = "grpc") -> None:
        self.unary = unary
        self.link = link
        self.shells = [SimShell(i, self) for i in range(shells)]
        self.books = {t: Books() for t in TENANTS}
        self.priority = 0
        self.produced_records = 0  # Produced records sent, all shells
        ids = np.arange(EMBED_TOKENS, dtype=np.int32).reshape(1, EMBED_TOKENS) % 1000 + 1
        self.embed_request = InferRequest(
            "embed", inputs=[Tensor("INPUT_IDS", "INT32", (1, EMBED_TOKENS), ids)]
        )
        self.llm_request = InferRequest(
            "llm",
            inputs=[
                Tensor(
                    "text_input",
                    "BYTES",
                    (1,),
                    np.array([b"a tenant asks the shared model a question"], dtype=object),
                ),
                Tensor("stream", "BOOL", (1,), np.array([True])),
            ],
        )
        # One hop: what the core is told of that request (the gateway's ``_facts``); its
        # key is computed once (``connect``), not per call as a shell does: all are alike.
        self.embed_nbytes = sum(t.nbytes for t in self.embed_request.inputs)
        self.embed_facts = dataclasses.replace(
            self.embed_request, inputs=[], outputs=[], parameters={}
        )
        self.embed_key = b""
        # A stream's facts, as a shell process sends them (``_facts`` without a key): the
        # core grants its slot on them; its tensors go from the shell to Triton.
        self.llm_nbytes = sum(t.nbytes for t in self.llm_request.inputs)
        self.llm_facts = dataclasses.replace(self.llm_request, inputs=[], outputs=[], parameters={})
        self.on_answer: Callable[[SimShell, str], None] = lambda shell, tenant: None
        self.on_grant: Callable[[SimShell, int], None] = lambda shell, call_id: None

    async def connect(self, address: str) -> None:
        await asyncio.gather(*(s.connect(address) for s in self.shells))
        settings = self.shells[0].settings
        assert settings is not None
        self.priority = (int(settings.config["priority_levels"]) + 1) // 2  # the default level
        embed = plan(parse_config(settings.config), "embed", embed_info())
        self.embed_key = wire_key(self.embed_request, embed)

    async def close(self) -> None:
        await asyncio.gather(*(s.disconnect() for s in self.shells), return_exceptions=True)

    def shell_of(self, tenant: str, n: int) -> SimShell:
        """The ``n``-th shell of ``tenant``: acme's are the even ones, globex's the odd."""
        offset = list(TENANTS).index(tenant)
        half = len(self.shells) // 2
        return self.shells[2 * (n % half) + offset]

    def answered(self, shell: SimShell, tenant: str) -> None:
        self.on_answer(shell, tenant)

    def granted(self, shell: SimShell, call_id: int) -> None:
        self.on_grant(shell, call_id)

    @property
    def outstanding(self) -> int:
        return sum(len(s.pending) for s in self.shells)

    @property
    def running(self) -> int:
        return sum(len(s.streams) for s in self.shells)

    def faults(self) -> list[str]:
        return sorted({f for s in self.shells for f in s.faults})[:5]


def embed_info() -> ModelInfo:
    """``embed``'s model info, from its config in ``model_repository/``, as a shell has
    it from Triton."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    text = (ROOT / "model_repository" / "embed" / "config.pbtxt").read_text()
    return model_info(text_format.Parse(text, model_config_pb2.ModelConfig()))


# ---- a step of load ---------------------------------------------------------------------------


@dataclass
class Core:
    pid: int
    link_port: int
    standin_pid: int
    standin_port: int


def snapshot(core: Core, driver: Driver) -> Snapshot:
    return Snapshot(
        time.monotonic(),
        cpu_s(core.pid),
        cpu_s(os.getpid()),
        cpu_s(core.standin_pid),
        cpu_times(),
        socket_bytes(core.link_port, core.standin_port),
        {t: b.copy() for t, b in driver.books.items()},
        driver.outstanding,
        driver.produced_records,
    )


def measured(
    workload: str,
    offered: float,
    a: Snapshot,
    b: Snapshot,
    lat: list[float],
    series: list[tuple[float, dict[str, float]]],
    running: list[tuple[float, int]],
) -> dict[str, Any]:
    """A step's figures between snapshots ``a`` and ``b``."""
    wall = b.at - a.at
    served = {t: b.books[t]["served"] - a.books[t]["served"] for t in TENANTS}
    answered = {t: b.books[t]["answered"] - a.books[t]["answered"] for t in TENANTS}
    tokens = {t: b.books[t]["tokens"] - a.books[t]["tokens"] for t in TENANTS}
    faults = sum(b.books[t]["faults"] - a.books[t]["faults"] for t in TENANTS)
    sent = sum(b.books[t]["sent"] - a.books[t]["sent"] for t in TENANTS)
    units = sum(tokens.values()) if workload == "tokens" else sum(answered.values())
    core = b.core_cpu - a.core_cpu
    busy = {
        c: (b.cpus[c][0] - a.cpus[c][0]) / max(1e-9, b.cpus[c][1] - a.cpus[c][1]) for c in b.cpus
    }
    driver, standin = b.driver_cpu - a.driver_cpu, b.standin_cpu - a.standin_cpu
    out: dict[str, Any] = {
        "offered_per_s": offered,
        "done_per_s": units / wall,
        "calls_sent_per_s": sent / wall,
        "unanswered_growth": b.outstanding - a.outstanding,
        "core_busy": core / wall,
        "core_cpu_us": core / units * 1e6 if units else None,
        "faults": faults,
        "driver_busy": driver / wall,
        "standin_busy": standin / wall,
        "machine": {f"cpu{c}_busy": round(busy[c], 3) for c in sorted(busy)}
        | {
            f"cpu{CORE_CPU}_others": round(busy.get(CORE_CPU, 0.0) - core / wall, 3),
            f"cpu{DRIVER_CPU}_others": round(
                busy.get(DRIVER_CPU, 0.0) - (driver + standin) / wall, 3
            ),
            "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        },
        "window_s": wall,
    }
    if workload == "unary" and units:
        link = b.sockets["link"] - a.sockets["link"]
        triton = b.sockets["triton"] - a.sockets["triton"]
        out["socket_bytes_per_request"] = (link + triton) / units
        out["socket_bytes_split"] = {"link": link / units, "triton": triton / units}
    if workload == "tokens":
        out["streams_started_per_s"] = sum(answered.values()) / wall
        out["produced_records_per_s"] = (b.produced_records - a.produced_records) / wall
        out["running_streams"] = float(np.mean([r for _, r in running])) if running else 0.0
    elif lat:
        q = np.percentile(np.array(lat) * 1e3, [50, 99])
        out["latency_ms"] = {"p50": float(q[0]), "p99": float(q[1])}
    total = sum(served.values()) if workload != "tokens" else sum(tokens.values())
    if total:
        share = (tokens if workload == "tokens" else served)["acme"] / total
        out["acme_share"] = share
    out["vtc_max_diff_tokens"] = vtc_bound(series, workload)
    return out


def vtc_bound(series: list[tuple[float, dict[str, float]]], workload: str) -> float | None:
    """The largest |service_acme / 2 - service_globex / 1| over the window (tokens served
    since its start), sampled every few milliseconds."""
    if len(series) < 2:
        return None
    key = "tokens" if workload == "tokens" else "served"
    start = series[0][1]
    worst = 0.0
    for _, books in series[1:]:
        norm = [(books[f"{t}.{key}"] - start[f"{t}.{key}"]) / w for t, w in TENANTS.items()]
        worst = max(worst, abs(norm[0] - norm[1]))
    return worst


async def window(
    core: Core, driver: Driver, warm_s: float, measure_s: float, workload: str, offered: float
) -> dict[str, Any]:
    """Wait ``warm_s``, then measure ``measure_s`` of whatever load runs."""
    await asyncio.sleep(warm_s)
    for books in driver.books.values():
        books.latencies.clear()
    a = snapshot(core, driver)
    series: list[tuple[float, dict[str, float]]] = []
    running: list[tuple[float, int]] = []
    end = a.at + measure_s
    while time.monotonic() < end:
        series.append((time.monotonic(), flat_books(driver)))
        running.append((time.monotonic(), driver.running))
        await asyncio.sleep(0.01)
    series.append((time.monotonic(), flat_books(driver)))
    b = snapshot(core, driver)
    lat = [x for bk in driver.books.values() for x in bk.latencies]
    return measured(workload, offered, a, b, lat, series, running)


def flat_books(driver: Driver) -> dict[str, float]:
    return {
        f"{t}.{k}": float(v)
        for t, b in driver.books.items()
        for k, v in (("served", b.served), ("tokens", b.tokens))
    }


async def drain(driver: Driver, timeout_s: float = 15.0) -> None:
    """Until every call sent is answered (or granted and ended)."""
    deadline = time.monotonic() + timeout_s
    while driver.outstanding or driver.running:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{driver.outstanding} calls unanswered, {driver.running} streams running "
                f"{timeout_s:g} s after the load stopped; faults: {driver.faults()}"
            )
        await asyncio.sleep(0.02)


class Pacer:
    """Open-loop load: ``rate`` calls a second, due ones sent every 2 ms, round robin over
    the tenants and their shells; none while ``cap`` are unanswered (the core is behind)."""

    def __init__(
        self, driver: Driver, rate: float, send: Callable[[SimShell, str], None], cap: int
    ) -> None:
        self.driver, self.rate, self.send, self.cap = driver, rate, send, cap
        self.sent = 0
        self.capped = 0
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        tenants = list(TENANTS)
        start = time.monotonic()
        n = 0
        while True:
            due = int(self.rate * (time.monotonic() - start)) - self.sent
            for _ in range(due):
                if self.driver.outstanding >= self.cap:
                    self.capped += 1
                    break
                tenant = tenants[n % 2]
                self.send(self.driver.shell_of(tenant, n // 2), tenant)
                n += 1
            self.sent += due  # what was not sent for the cap is not owed later
            await asyncio.sleep(0.002)

    def stop(self) -> None:
        self.task.cancel()


def instant_stream(driver: Driver) -> None:
    """Each granted stream reports its one token and its end at once."""

    def granted(shell: SimShell, call_id: int) -> None:
        stream = shell.streams[call_id]
        first = time.monotonic() - stream.call.arrived
        shell.produced([(call_id, 1, first)], {})
        shell.books_token(stream, 1)
        shell.ended(call_id)

    driver.on_grant = granted


def sender(driver: Driver, workload: str) -> Callable[[SimShell, str], None]:
    """How one call of ``workload`` (unary or streams) is sent by a shell."""
    if workload == "unary":
        return SimShell.unary
    instant_stream(driver)

    def stream(shell: SimShell, tenant: str) -> None:
        shell.stream(tenant, 1)

    return stream


async def unary_step(
    core: Core, driver: Driver, rate: float, args: argparse.Namespace, workload: str
) -> dict[str, Any]:
    """Open-loop ``rate`` calls a second of ``workload`` (unary or streams)."""
    send = sender(driver, workload)
    pacer = Pacer(driver, rate, send, cap=max(2000, int(rate)))
    try:
        out = await window(core, driver, args.warm_s, args.measure_s, workload, rate)
    finally:
        pacer.stop()
    out["capped"] = pacer.capped > 0
    await drain(driver)
    return out


async def backlog_step(
    core: Core, driver: Driver, depth: int, args: argparse.Namespace, workload: str
) -> dict[str, Any]:
    """Both tenants backlogged: ``depth`` calls each always unanswered (closed loop)."""
    send = sender(driver, workload)
    counter = [0]
    running = [True]

    def again(shell: SimShell, tenant: str) -> None:
        if running[0]:
            counter[0] += 1
            send(driver.shell_of(tenant, counter[0]), tenant)

    driver.on_answer = again
    if workload == "streams":
        previous = driver.on_grant

        def granted(shell: SimShell, call_id: int) -> None:
            tenant = shell.streams[call_id].call.tenant
            previous(shell, call_id)
            again(shell, tenant)

        driver.on_grant = granted
    for tenant in TENANTS:
        for _ in range(depth):
            again(driver.shells[0], tenant)
    try:
        out = await window(core, driver, args.warm_s, args.measure_s * 1.5, workload, 0.0)
    finally:
        running[0] = False
        driver.on_answer = lambda shell, tenant: None
    await drain(driver)
    out["backlog_per_tenant"] = depth
    return out


async def tokens_step(
    core: Core, driver: Driver, rate: float, args: argparse.Namespace, streams: int
) -> dict[str, Any]:
    """``rate`` output tokens a second over the running streams, ``streams`` waiting or
    running per tenant, each ``STREAM_TOKENS`` long: one ``Produced`` per shell per tick."""
    running = [True]
    counter = [0]

    def start(tenant: str) -> None:
        counter[0] += 1
        driver.shell_of(tenant, counter[0]).stream(tenant, STREAM_TOKENS)

    driver.on_grant = lambda shell, call_id: None
    for tenant in TENANTS:
        for _ in range(streams):
            start(tenant)

    async def tick() -> None:
        owed = 0.0
        last = time.monotonic()
        while running[0]:
            await asyncio.sleep(PRODUCED_TICK_S)
            now = time.monotonic()
            owed += rate * (now - last)
            last = now
            live = [(s, cid) for s in driver.shells for cid in s.streams]
            if not live:
                continue
            each, extra = divmod(int(owed), len(live))
            owed -= each * len(live) + extra
            entries: dict[SimShell, list[tuple[int, int, float]]] = {}
            # Per shell and tenant: the tick's inter-token times, binned as a shell bins them.
            times: dict[SimShell, dict[str, tuple[float, dict[int, int]]]] = {}
            done: list[tuple[SimShell, int]] = []
            for i, (shell, cid) in enumerate(live):
                stream = shell.streams[cid]
                n = min(each + (1 if i < extra else 0), STREAM_TOKENS - stream.tokens)
                if n <= 0:
                    continue
                first = now - stream.call.arrived if stream.tokens == 0 else -1.0
                timed = n - 1 if stream.tokens == 0 else n
                if timed:
                    tenant = stream.call.tenant
                    total, bins = times.setdefault(shell, {}).get(tenant, (0.0, {}))
                    total += bin_gaps(bins, timed, PRODUCED_TICK_S / n * timed)
                    times[shell][tenant] = (total, bins)
                entries.setdefault(shell, []).append((cid, n, first))
                shell.books_token(stream, n)
                if stream.tokens >= STREAM_TOKENS:
                    done.append((shell, cid))
            for shell, batch in entries.items():
                shell.produced(batch, times.get(shell, {}))
            for shell, cid in done:
                tenant = shell.streams[cid].call.tenant
                shell.ended(cid)
                if running[0]:
                    start(tenant)

    ticker = asyncio.get_running_loop().create_task(tick())
    try:
        out = await window(core, driver, args.warm_s, args.measure_s, "tokens", rate)
    finally:
        running[0] = False
    await ticker
    # The rest end unfinished, as streams whose clients went away; so do those granted
    # from now on.
    driver.on_grant = lambda shell, call_id: shell.ended(call_id)
    for shell in driver.shells:
        for cid in list(shell.streams):
            shell.ended(cid)
    await drain(driver)
    return out


def saturated(step: dict[str, Any]) -> str | None:
    """Why this step saturated the core, or None: its CPU full, or its answers behind
    (fewer than offered, unanswered calls piling up, engine slots left idle)."""
    if step["core_busy"] >= BUSY_SATURATED:
        return f"core CPU {step['core_busy']:.0%}"
    if step["done_per_s"] < KEEPING_UP * step["offered_per_s"]:
        return f"done {step['done_per_s']:,.0f}/s of {step['offered_per_s']:,.0f}/s offered"
    if step["unanswered_growth"] > (1 - KEEPING_UP) * step["offered_per_s"] * step["window_s"]:
        return f"{step['unanswered_growth']:,} more calls unanswered at the end than at the start"
    if step.get("running_streams", ENGINE_SLOTS) < KEEPING_UP * ENGINE_SLOTS:
        return f"{step['running_streams']:.1f} of {ENGINE_SLOTS} engine slots busy on average"
    return None


def disturbed(step: dict[str, Any]) -> bool:
    """A step that fell behind while the core had less than half its CPU: the machine's
    other processes took it (a shared machine), not the load."""
    return saturated(step) is not None and step["core_busy"] < DISTURBED_BUSY


def show(workload: str, step: dict[str, Any]) -> None:
    us = step["core_cpu_us"]
    extra = ""
    if "socket_bytes_per_request" in step:
        extra += f", {step['socket_bytes_per_request']:,.0f} B/request on its sockets"
    if "latency_ms" in step:
        extra += f", p50 {step['latency_ms']['p50']:.1f} ms p99 {step['latency_ms']['p99']:.1f}"
    if "running_streams" in step:
        extra += (
            f", {step['running_streams']:.1f} slots busy, "
            f"{step['streams_started_per_s']:,.0f} streams started/s, "
            f"{step['produced_records_per_s']:,.0f} Produced records/s"
        )
    if step.get("acme_share") is not None:
        extra += f", acme's share {step['acme_share']:.3f}"
    m = step["machine"]
    progress(
        f"{workload}: offered {step['offered_per_s']:>9,.0f}/s done {step['done_per_s']:>9,.0f}/s"
        f", core {step['core_busy']:4.0%} busy, "
        + (f"{us:,.2f} µs/{UNITS[workload]}" if us else "nothing done")
        + f"{extra}; driver {step['driver_busy']:.0%}, cpu0 others "
        f"{m[f'cpu{CORE_CPU}_others']:.0%}, cpu1 others {m[f'cpu{DRIVER_CPU}_others']:.0%}"
        + (f"; {step['faults']} faults" if step["faults"] else "")
    )


async def ramp(
    core: Core, driver: Driver, workload: str, args: argparse.Namespace
) -> dict[str, Any]:
    start, factor = {
        "unary": (args.start_unary, args.factor),
        "streams": (args.start_streams, args.factor),
        "tokens": (args.start_tokens, args.factor),
    }[workload]
    steps: list[dict[str, Any]] = []
    rate = start
    why = None
    for _ in range(args.max_steps):
        for attempt in range(1, DISTURBED_TRIES + 1):
            if workload == "tokens":
                step = await tokens_step(core, driver, rate, args, WAITING_STREAMS)
            else:
                step = await unary_step(core, driver, rate, args, workload)
            show(workload, step)
            step["attempt"] = attempt
            if not disturbed(step):
                break
            progress(
                f"{workload}: behind with the core {step['core_busy']:.0%} busy: other "
                f"processes had its CPU (cpu0 others {step['machine']['cpu0_others']:.0%}); "
                "that step again"
            )
        steps.append(step)
        why = saturated(step)
        if why:
            break
        rate *= factor
    out: dict[str, Any] = {"steps": steps, "ramp_stopped": why}
    if workload == "tokens":
        # Always backlogged for slots: the last step is the core at saturation (where it
        # saturated at all), and the shares are those of its window.
        at = steps[-1]
    else:
        # Saturation proper: both tenants backlogged, the core fed as fast as it answers
        # (an open-loop step past saturation only measures a queue that grows).
        depth = args.backlog
        progress(f"{workload}: both tenants backlogged ({depth} calls each), weights 2:1")
        at = await backlog_step(core, driver, depth, args, workload)
        show(workload, at)
        out["backlogged"] = at
    kept_up = [s["done_per_s"] for s in steps if not saturated(s)]
    us = at["core_cpu_us"]
    out.update(
        saturation_per_s=max([at["done_per_s"], *kept_up]),
        core_cpu_us_at_saturation=us,
        core_busy_at_saturation=at["core_busy"],
        one_core_per_s_by_cpu=1e6 / us if us else None,
        acme_share=at.get("acme_share"),
        vtc_max_diff_tokens=at.get("vtc_max_diff_tokens"),
    )
    progress(
        f"{workload}: saturates at {out['saturation_per_s']:,.0f} {UNITS[workload]}s/s "
        f"(ramp: {why or 'not saturated'}); acme's share there {out['acme_share'] or 0:.3f} "
        f"(weights 2:1: 0.667), VTC bound {out['vtc_max_diff_tokens'] or 0:,.0f} tokens"
    )
    return out


# ---- the processes ----------------------------------------------------------------------------


def config_data(standin: str, unary: str = "one_hop") -> dict[str, Any]:
    data = load_example_config()
    data.pop("tier_limits", None)
    for endpoint in data["endpoints"].values():
        endpoint["throttle"] = False  # the stand-in's batch times would teach it nothing
        endpoint["unary"] = unary
    data["default_endpoint"] = {"throttle": False, "unary": unary}
    for tenant, weight in TENANTS.items():
        data["tenants"][tenant].update(weight=weight, max_queued=1_000_000)
        data["tenants"][tenant].pop("limits", None)
    data["tenants"]["globex"]["tier"] = "enterprise"
    data["triton"] = {"backends": [{"grpc_url": standin}]}
    return data


# The core's log level: WARNING leaves its request log out (a line per finished request,
# at INFO: the deployed default, ``--request-log``), as the figures before it did.
CORE_LOG_LEVEL = "WARNING"
# Whether a one-hop call's line is its shell's (``Call.logged``: the default config,
# ``observability.request_log: shell``), or the core's (``--request-log core``).
LOGGED_BY_SHELLS = True


@contextlib.contextmanager
def processes(
    tmp: Path, unary: str, link: str = "grpc"
) -> Iterator[tuple[Core, subprocess.Popen[bytes]]]:
    standin_port, link_port, metrics = free_port(), free_port(), free_port()
    pin = ["taskset", "-c"] if PINNING else None
    standin_cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_core_capacity",
        "standin",
        str(standin_port),
    ]
    standin = subprocess.Popen(
        [*pin, str(DRIVER_CPU), *standin_cmd] if pin else standin_cmd,
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    core: subprocess.Popen[bytes] | None = None
    try:
        assert standin.stdout is not None
        if standin.stdout.readline().strip() != b"ready":
            raise RuntimeError("the Triton stand-in did not start")
        (tmp / "secret").write_text(SECRET)
        config = write_config(config_data(f"127.0.0.1:{standin_port}", unary), tmp)
        # FAIR_BENCH_PROFILE=FILE: the core runs under cProfile, its stats written to FILE
        # when it exits (a profile of where its CPU goes; the figures are then not its own).
        profile = os.environ.get("FAIR_BENCH_PROFILE")
        core_cmd = [
            sys.executable,
            *(["-m", "cProfile", "-o", profile] if profile else []),
            "-m",
            "fair_frontend.cli",
            "core",
            "--config",
            str(config),
            "--listen",
            f"127.0.0.1:{link_port}",
            "--link",
            link,
            "--secret-file",
            str(tmp / "secret"),
            "--election",
            "none",
            "--metrics-port",
            str(metrics),
            "--metrics-host",
            "127.0.0.1",
            "--log-level",
            CORE_LOG_LEVEL,
        ]
        log = (tmp / "core.log").open("wb")
        core = subprocess.Popen(
            [*pin, str(CORE_CPU), *core_cmd] if pin else core_cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        wait_http_ready(f"http://127.0.0.1:{metrics}/v2/health/ready", core)
        yield Core(core.pid, link_port, standin.pid, standin_port), core
    finally:
        for proc in (core, standin):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


# ---- GPUs one core serves ---------------------------------------------------------------------


def net_of_streams(results: dict[str, Any], link: str = "") -> None:
    """Per token less what its streams' starts cost: each tokens step's streams started
    a second times the CPU per new stream of the streams step offered the nearest rate
    (``link``: as ``gpus_served``'s)."""
    streams = [s for s in results.get(f"streams{link}", {}).get("steps", []) if s["core_cpu_us"]]
    tokens = results.get(f"tokens{link}")
    if not streams or not tokens:
        return
    for step in tokens["steps"]:
        if not step["core_cpu_us"] or not step["done_per_s"]:
            continue
        started = step["streams_started_per_s"]
        near = min(streams, key=lambda s: abs(s["offered_per_s"] - started))
        left = step["core_cpu_us"] * step["done_per_s"] - started * near["core_cpu_us"]
        step["core_cpu_us_less_stream_starts"] = left / step["done_per_s"]


def gpus_served(results: dict[str, Any], link: str = "") -> dict[str, Any]:
    """From the measured rates: how many GPUs' worth of work one core decides. Two ways:
    the saturation rate measured here (the core had what CPU 0 gave it on this shared
    machine), and one whole CPU over the CPU per unit at saturation. ``link``: "_tcp" for
    the figures over TCP (``--link both``), "" for the first link's."""
    out: dict[str, Any] = {
        "method": "rate one core decides / one GPU's rate; 'measured': the saturation rate "
        "measured here; 'one_cpu': 1 s of CPU / the core's CPU per unit at saturation"
    }
    unary = results.get(f"unary{link}")
    if unary:
        rates = {"measured": unary["saturation_per_s"], "one_cpu": unary["one_core_per_s_by_cpu"]}
        out["embed_h200"] = {
            "gpu_per_s": H200_EMBED_PER_S,
            "core_per_s": rates,
            "gpus": {k: v / H200_EMBED_PER_S for k, v in rates.items() if v},
        }
    tokens = results.get(f"tokens{link}")
    if tokens:
        lo, hi = H100_8B_TOKENS_PER_S
        rates = {"measured": tokens["saturation_per_s"], "one_cpu": tokens["one_core_per_s_by_cpu"]}
        out["llm_8b_h100"] = {
            "gpu_tokens_per_s": [lo, hi],
            "core_tokens_per_s": rates,
            "stream_tokens": STREAM_TOKENS,
            "gpus": {k: [v / hi, v / lo] for k, v in rates.items() if v},
        }
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        progress("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [w for w in ("unary", "streams", "tokens") if w in results]
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.6), squeeze=False)
    for ax, workload in zip(axes[0], kinds, strict=True):
        steps = [s for s in results[workload]["steps"] if s["core_cpu_us"]]
        x = [s["offered_per_s"] for s in steps]
        mode = results[workload].get("mode")
        ax.plot(x, [s["core_cpu_us"] for s in steps], "o-",
                label="core CPU, open-loop steps" + (f" ({mode})" if mode else ""))  # fmt: skip
        relay = results.get(f"{workload}_relay")
        if relay:
            rs = [s for s in relay["steps"] if s["core_cpu_us"]]
            ax.plot([s["offered_per_s"] for s in rs], [s["core_cpu_us"] for s in rs], "^--",
                    color="C3", label="core CPU, open-loop steps (relay)")  # fmt: skip
            rfed = relay.get("backlogged")
            if rfed and rfed["core_cpu_us"]:
                ax.plot([rfed["done_per_s"]], [rfed["core_cpu_us"]], "*", ms=12, color="C3")
        fed = results[workload].get("backlogged")
        if fed and fed["core_cpu_us"]:
            ax.plot([fed["done_per_s"]], [fed["core_cpu_us"]], "*", ms=12, color="C1",
                    label="both tenants backlogged (x: done/s)")  # fmt: skip
        ax.axhline(TARGETS[workload], color="g", ls="--", lw=1, label="issue 30's target")
        ax2 = ax.twinx()
        ax2.plot(x, [s["core_busy"] * 100 for s in steps], "s:", color="grey", label="core busy")
        ax2.set_ylim(0, 110)
        ax2.set_ylabel("core busy, % of one CPU", color="grey")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel(f"offered {UNITS[workload]}s/s")
        ax.set_ylabel(f"core CPU µs per {UNITS[workload]}")
        ax.set_title(workload)
        ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    progress(f"plot written to {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


# ---- main -------------------------------------------------------------------------------------


def pin_threads(cpu: int) -> None:
    """Every thread of this process onto ``cpu`` (where there are two CPUs to choose)."""
    if not PINNING:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), {cpu})


def phases(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(link, unary mode, workloads) per core started: with both modes, the relay's core
    measures unary only, the one-hop core (the default) everything; with both links, all
    of that over gRPC, then all of it again over TCP."""
    workloads = args.workloads.split(",")
    modes = list(UNARY_MODES[::-1]) if args.unary == "both" else [args.unary]
    last = modes[-1]
    links = list(LINKS) if args.link == "both" else [args.link]
    return [
        (link, m, workloads if m == last else [w for w in workloads if w == "unary"])
        for link in links
        for m in modes
    ]


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    primary = "one_hop" if args.unary in ("one_hop", "both") else "relay"
    # With both links, gRPC's results go under the workloads' names and TCP's under the
    # same with "_tcp" (each link alone: its results under the plain names).
    primary_link = "grpc" if args.link == "both" else args.link
    for link, mode, workloads in phases(args):
        if not workloads:
            continue
        folder = tmp / f"{link}_{mode}"
        folder.mkdir()
        with processes(folder, mode, link) as (core, popen):
            pin_threads(DRIVER_CPU)
            driver = Driver(args.shells, mode, link)
            await driver.connect(f"127.0.0.1:{core.link_port}")
            pin_threads(DRIVER_CPU)  # gRPC's threads too, started by the connections
            progress(
                f"link {link}, unary {mode}: core pid {core.pid} on CPU {CORE_CPU}; "
                f"{args.shells} shells "
                f"and the Triton stand-in on CPU {DRIVER_CPU}; load average "
                f"{Path('/proc/loadavg').read_text()[:15]}"
            )
            try:
                for workload in workloads:
                    out = await ramp(core, driver, workload, args)
                    out["link"] = link
                    if workload == "unary":
                        out["mode"] = mode
                        workload = "unary" if mode == primary else f"unary_{mode}"
                    results[workload if link == primary_link else f"{workload}_tcp"] = out
            finally:
                await driver.close()
            if popen.poll() is not None:
                raise RuntimeError(f"the core exited ({popen.returncode}): {folder / 'core.log'}")
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "standin":
        serve_standin(int(argv[1]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_core_capacity")
    parser.add_argument("--quick", action="store_true", help="a smoke run, under a minute")
    parser.add_argument("--shells", type=int, default=None, help="simulated shells (16-64)")
    parser.add_argument("--workloads", default="unary,streams,tokens")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--json", default=None, help="where the results go")
    parser.add_argument(
        "--unary",
        choices=[*UNARY_MODES, "both"],
        default="one_hop",
        help="how the simulated shells send unary requests: their facts (one_hop, a shell "
        "process's default), whole through the core (relay), or both, one after the other",
    )
    parser.add_argument(
        "--link",
        choices=[*LINKS, "both"],
        default="grpc",
        help="the simulated shells' link to the core: gRPC streams (the default), raw TCP "
        "(fair_frontend.wire.tcp), or both, one after the other (each with a core of its "
        "own; TCP's results under '<workload>_tcp', and their ratio to gRPC's)",
    )
    parser.add_argument(
        "--request-log",
        choices=("off", "shells", "core"),
        default="off",
        help="the request log (a line per finished request): off (the core logs warnings "
        "only, as the figures before it), shells (as deployed: INFO, each one-hop call's "
        "line written by the shell that answered it, the rest by the core, to a file), or "
        "core (INFO, every line by the core: observability.request_log: core)",
    )
    args = parser.parse_args(argv)
    global CORE_LOG_LEVEL, LOGGED_BY_SHELLS
    CORE_LOG_LEVEL = "WARNING" if args.request_log == "off" else "INFO"
    LOGGED_BY_SHELLS = args.request_log != "core"
    quick = args.quick
    args.shells = args.shells or (16 if quick else 32)
    args.max_steps = args.max_steps or (4 if quick else 12)
    args.warm_s, args.measure_s = (0.5, 1.5) if quick else (1.0, 4.0)
    args.factor = 2.0 if quick else 1.5
    args.start_unary = 1000.0 if quick else 500.0
    args.start_streams = 1000.0 if quick else 500.0
    args.start_tokens = 16000.0 if quick else 8000.0
    args.backlog = 256 if quick else 512
    name = "core_capacity_quick" if quick else "core_capacity"
    path = Path(args.json) if args.json else RESULTS / f"{name}.json"
    tmp = Path(tempfile.mkdtemp(prefix="bench-core-capacity-"))
    started = time.monotonic()
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    try:
        import uvloop

        results = uvloop.run(run(args, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    net_of_streams(results)
    net_of_streams(results, "_tcp")
    results["gpus_served"] = gpus_served(results)
    if args.link == "both":
        results["gpus_served_tcp"] = gpus_served(results, "_tcp")
    results["run"] = {
        "shells": args.shells,
        "quick": quick,
        "seconds": time.monotonic() - started,
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        "triton": "stand-in answering at once (gRPC ModelInfer); one hop: the shells' "
        "Triton calls skipped, their rows reported served at once",
        "unary": args.unary,
        "link": args.link,
        "request_log": args.request_log,
        "targets": TARGETS,
    }
    if args.link == "both":
        results["tcp_vs_grpc"] = link_ratios(results)
    for line in summary(results):
        progress(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    progress(f"results written to {path}")
    if not args.json:
        plot(results, RESULTS / f"{name}.png")
    return 0


def link_ratios(results: dict[str, Any]) -> dict[str, Any]:
    """The core's CPU per unit over TCP / over gRPC, per workload measured both ways: at
    saturation (both tenants backlogged; tokens: the last step), and over the open-loop
    steps both links ran at the same offered rate and kept up with (the mean of the
    per-step ratios: the same load, neither core saturated)."""
    out: dict[str, Any] = {}
    for workload in ("unary_relay", "unary", "streams", "tokens"):
        grpc_r, tcp_r = results.get(workload), results.get(f"{workload}_tcp")
        if not grpc_r or not tcp_r:
            continue
        g, t = grpc_r["core_cpu_us_at_saturation"], tcp_r["core_cpu_us_at_saturation"]
        kept = {
            s["offered_per_s"]: s["core_cpu_us"]
            for s in grpc_r["steps"]
            if s["core_cpu_us"] and not saturated(s)
        }
        same = [
            (kept[s["offered_per_s"]], s["core_cpu_us"])
            for s in tcp_r["steps"]
            if s["core_cpu_us"] and not saturated(s) and s["offered_per_s"] in kept
        ]
        out[workload] = {
            "grpc_cpu_us_at_saturation": g,
            "tcp_cpu_us_at_saturation": t,
            "ratio_at_saturation": t / g if g and t else None,
            "grpc_saturation_per_s": grpc_r["saturation_per_s"],
            "tcp_saturation_per_s": tcp_r["saturation_per_s"],
            "same_offered_steps": len(same),
            "ratio_same_offered": sum(b / a for a, b in same) / len(same) if same else None,
        }
    return out


def summary(results: dict[str, Any]) -> list[str]:
    lines = []
    names = ("unary_relay", "unary", "streams", "tokens")
    for workload in [*names, *(f"{n}_tcp" for n in names)]:
        r = results.get(workload)
        if not r:
            continue
        unit = UNITS[workload.split("_")[0]]
        target = TARGETS[workload.split("_")[0]]
        label = f"unary ({r['mode']})" if "mode" in r else workload.removesuffix("_tcp")
        if "link" in r:
            label += f" over {r['link']}"
        bytes_at = r.get("backlogged", {}).get("socket_bytes_per_request")
        lines.append(
            f"{label}: saturates at {r['saturation_per_s']:,.0f} {unit}s/s "
            f"(core {r['core_busy_at_saturation']:.0%} busy); core CPU there "
            f"{r['core_cpu_us_at_saturation'] or 0:,.2f} µs/{unit} (target <= "
            f"{target:g}): one whole CPU {r['one_core_per_s_by_cpu'] or 0:,.0f}/s"
            + (f"; {bytes_at:,.0f} socket bytes/request there" if bytes_at else "")
        )
    for workload, r in results.get("tcp_vs_grpc", {}).items():
        unit = UNITS[workload.split("_")[0]]
        same = r["ratio_same_offered"]
        lines.append(
            f"{workload}: core CPU per {unit} tcp/grpc {r['ratio_at_saturation'] or 0:.2f} at "
            f"saturation ({r['tcp_cpu_us_at_saturation'] or 0:,.2f} vs "
            f"{r['grpc_cpu_us_at_saturation'] or 0:,.2f} µs; saturates at "
            f"{r['tcp_saturation_per_s']:,.0f} vs {r['grpc_saturation_per_s']:,.0f}/s)"
            + (
                f", {same:.2f} at the same offered rate ({r['same_offered_steps']} steps)"
                if same
                else ""
            )
        )
    gpus = results["gpus_served"]
    if "embed_h200" in gpus:
        g = gpus["embed_h200"]["gpus"]
        lines.append(
            f"embed: one core decides for {g['measured']:.2f} H200s (measured), "
            f"{g.get('one_cpu', 0):.2f} (one whole CPU)"
        )
    if "llm_8b_h100" in gpus:
        g = gpus["llm_8b_h100"]["gpus"]
        lines.append(
            f"8B LLM: one core decides for {g['measured'][0]:.1f}-{g['measured'][1]:.1f} "
            f"H100s (measured), {g['one_cpu'][0]:.1f}-{g['one_cpu'][1]:.1f} (one whole CPU)"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
