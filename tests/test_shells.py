"""Shell processes in front of one core: a shell that dies, and the order of the intake.

A shell killed mid-load: its clients' calls end (UNAVAILABLE, their connection dropped),
the other shell's go on, the core drops the dead shell's queued work and answers nothing
twice, its books balance, and the pool starts the shell again.

The intake: calls a core has read but not admitted yet are admitted per tenant in turn,
so another tenant's call waits behind at most one call of each tenant with calls waiting,
not behind a burst.

The link (issue 17, item 6): a shell is cut off only when it stops reading, not for a
large burst. A burst of answers larger than the old fixed bound (256 MiB unsent) to a
shell that pauses (stopped a few seconds, then continued) is delivered whole; a shell
stopped for good is cut after ``queues.stalled_shell_s`` without progress, and its work
is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import parse_config
from fair_frontend.core import Core
from fair_frontend.core.shells import INTAKE_SLICE, Intake, ShellConnection
from fair_frontend.kit.testing import GATE_PARAMETER, Gate, aeventually
from fair_frontend.observability.observe import Observer
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import InferRequest
from fair_frontend.server import BackgroundServer, FrontendServer, Listen, ShellPool
from fair_frontend.wire.records import Call
from tests.support import KEYS, RunningFrontend, ids_input, make_config

IDS = np.full((1, 256), 5, dtype=np.int32)
# An intake of 20,000 calls drains in well under a second; a stuck one fails the test.
INTAKE_DRAINED_S = 30.0


class Outcomes(Observer):
    """Every outcome the core reports, by request id (the clients give unique ids)."""

    def __init__(self) -> None:
        self.by_id: Counter[str] = Counter()
        self.outcome: dict[str, Outcome] = {}

    def request_finished(self, *, request_id: str = "", outcome: Outcome, **kw: Any) -> None:
        self.by_id[request_id] += 1
        self.outcome[request_id] = outcome


async def _send(client: grpcaio.InferenceServerClient, request_id: str) -> Any:
    try:
        return await client.infer(
            "embed",
            [ids_input(grpcaio, IDS)],
            headers={"x-api-key": KEYS["initech"]},
            request_id=request_id,
            client_timeout=60,
        )
    except InferenceServerException as err:
        return err


@pytest.mark.parametrize("unary", ["relay", "one_hop"])
async def test_a_shell_killed_mid_load_loses_nothing_else(
    triton: EmbeddedTriton, unary: str
) -> None:
    """In both unary modes: relayed, and one hop (the dead shell's rows in batches beside
    the other shell's: those batches free their slots, the other shell's rows are served)."""
    outcomes = Outcomes()
    data = make_config().model_dump(mode="json")
    data["endpoints"]["embed"]["unary"] = unary
    server = FrontendServer(
        parse_config(data),
        triton.grpc_url,
        Listen(),
        workers=2,
        core_factory=lambda c, f: Core(c, f, observers=[outcomes]),
    )
    with BackgroundServer(server):
        fe = RunningFrontend(server, None)  # type: ignore[arg-type]  # no BackgroundServer: its URLs
        assert isinstance(server.shells, ShellPool)
        victim = server.shells.processes[0]
        # Many connections: the kernel spreads them over both shells (SO_REUSEPORT). gRPC
        # shares one connection between identical channels unless told not to.
        own = [("grpc.use_local_subchannel_pool", 1)]
        clients = [grpcaio.InferenceServerClient(fe.grpc_url, channel_args=own) for _ in range(16)]
        try:
            calls = [
                asyncio.ensure_future(_send(clients[i % len(clients)], f"r{i}")) for i in range(600)
            ]
            # Both shells have calls in the core before one of them dies.
            deadline = time.monotonic() + 30
            while not all(conn.calls for conn in list(server.shells.server.connections)):
                assert time.monotonic() < deadline, "the load did not reach both shells"
                await asyncio.sleep(0.01)
            os.kill(victim.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*calls), 90)
        finally:
            for c in clients:
                await c.close()

        ok = {f"r{i}" for i, r in enumerate(results) if not isinstance(r, Exception)}
        failed = [r for r in results if isinstance(r, InferenceServerException)]
        assert ok and failed, (len(ok), len(failed))
        # The dead shell's clients see their calls end, as a dropped connection does.
        assert {f.status() for f in failed} <= {"StatusCode.UNAVAILABLE"}, failed[:3]
        # The core idle: with one hop a shell answers its clients once it has reported
        # their part, and the core records them when the report arrives (a moment later).
        assert server.core is not None
        runtime = server.core.runtimes["embed"]
        assert (type(runtime).__name__ == "GrantedDispatcher") == (unary == "one_hop")
        deadline = time.monotonic() + 30
        while not runtime.idle:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        # Nothing answered twice; everything a client got was dispatched by the core.
        assert max(outcomes.by_id.values()) == 1
        assert all(outcomes.outcome[i] is Outcome.DISPATCHED for i in ok)
        # The core's books balance: nothing left queued or held for the dead shell.
        c = runtime.scheduler.counters
        assert c.admitted == c.dispatched + c.expired + c.cancelled
        # The pool started the shell again, and it serves.
        while server.shells.restarts < 1 or len(server.shells.server.connections) < 2:
            assert time.monotonic() < deadline, "the dead shell was not restarted"
            await asyncio.sleep(0.05)
        assert server.shells.processes[0].pid != victim.pid
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        try:
            again = await asyncio.gather(*(_send(client, f"after{i}") for i in range(20)))
        finally:
            await client.close()
        assert not [r for r in again if isinstance(r, Exception)]


@pytest.mark.parametrize("crashes", [1, 2])
async def test_a_shell_killed_by_a_signal_before_it_is_ready_is_started_once_more(
    triton: EmbeddedTriton, monkeypatch: pytest.MonkeyPatch, crashes: int
) -> None:
    """A shell that dies of a signal while it starts (a fresh clone on a loaded machine saw
    one die of SIGSEGV at spawn, and the frontend's start failed) is started again, once:
    the frontend starts and serves, and the retry is not counted as a restart. A shell that
    dies again fails the start, naming the shell and the signal. The signal is sent the
    moment the process exists, before this loop could have read its handshake."""
    spawn = ShellPool._spawn
    killed: list[int] = []

    async def crashing(self: ShellPool, index: int) -> None:
        await spawn(self, index)
        if index == 0 and len(killed) < crashes:
            proc = self.processes[index]
            proc.send_signal(signal.SIGSEGV)
            killed.append(proc.pid)

    monkeypatch.setattr(ShellPool, "_spawn", crashing)
    server = FrontendServer(make_config(), triton.grpc_url, Listen(), workers=2)
    if crashes > 1:
        with (
            pytest.raises(RuntimeError, match="shell 0 exited with -11 at start"),
            BackgroundServer(server),
        ):
            pass
        assert len(killed) == 2
        return
    with BackgroundServer(server):
        shells = server.shells
        assert isinstance(shells, ShellPool)
        assert shells.start_retries == {0: 1} and shells.restarts == 0
        assert len(killed) == 1 and shells.processes[0].pid != killed[0]
        assert len(shells.server.connections) == 2
        client = grpcaio.InferenceServerClient(RunningFrontend(server, None).grpc_url)  # type: ignore[arg-type]  # URL only
        try:
            answers = await asyncio.gather(*(_send(client, f"s{i}") for i in range(8)))
        finally:
            await client.close()
        assert not [a for a in answers if isinstance(a, Exception)]


# ---- the intake ---------------------------------------------------------------------------


class AdmitsInOrder:
    """Stands in for the core: records which calls it was given, in order."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def submit(self, call: Call, route: Any) -> None:
        self.order.append(call.tenant)

    def judge_together(self, calls: list[Call]) -> list[bool]:
        return [False] * len(calls)

    def tick(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class Conn:
    """Stands in for a shell connection: hands calls to the stand-in core."""

    closed = False

    def __init__(self, core: AdmitsInOrder) -> None:
        self.core = core

    def admit(self, call: Call, *, judged: bool = False) -> None:
        self.core.submit(call, self)


def _call(i: int, tenant: str) -> Call:
    request = InferRequest("embed")
    return Call(i, tenant, 5, time.monotonic(), time.time(), 1, 1, 0, None, request)


@pytest.mark.parametrize("burst", [10, 1000, 20_000])
async def test_the_intake_admits_another_tenant_after_at_most_one_call_per_tenant(
    burst: int,
) -> None:
    core = AdmitsInOrder()
    intake = Intake(cast(Core, core))  # stand-ins: what the intake calls of a core
    conn = cast(ShellConnection, Conn(core))
    for i in range(burst):
        intake.push(_call(i, "noisy"), conn)
    intake.push(_call(burst, "quiet"), conn)
    intake.push(_call(burst + 1, "other"), conn)
    await aeventually(lambda: not len(intake), INTAKE_DRAINED_S, 0, what="the intake drained")
    # Read after the whole burst, admitted after at most one call of each other tenant.
    assert core.order.index("quiet") <= 2
    assert core.order.index("other") <= 2
    assert core.order.count("noisy") == burst


async def test_a_slice_the_throttle_cannot_judge_together_is_still_admitted() -> None:
    """``Core.judge_together`` failing (a bug) costs the slice its shared decision, not
    its calls: each is submitted, to be judged alone."""

    class Failing(AdmitsInOrder):
        def judge_together(self, calls: list[Call]) -> list[bool]:
            raise RuntimeError("a bug")

    core = Failing()
    intake = Intake(cast(Core, core))  # stand-ins: what the intake calls of a core
    conn = cast(ShellConnection, Conn(core))
    for i in range(10):
        intake.push(_call(i, f"t{i % 2}"), conn)
    await aeventually(lambda: not len(intake), INTAKE_DRAINED_S, 0, what="the intake drained")
    assert len(core.order) == 10


async def test_a_call_whose_admission_fails_costs_its_slice_nothing_else() -> None:
    """One call's admission raising (a bug) is logged; the slice's other calls, taken from
    the waiting line with it, are admitted all the same."""

    class Raising(Conn):
        def admit(self, call: Call, *, judged: bool = False) -> None:
            if call.id == 3:
                raise RuntimeError("a bug")
            super().admit(call, judged=judged)

    core = AdmitsInOrder()
    intake = Intake(cast(Core, core))  # stand-ins: what the intake calls of a core
    conn = cast(ShellConnection, Raising(core))
    for i in range(10):
        intake.push(_call(i, f"t{i % 2}"), conn)
    await aeventually(lambda: not len(intake), INTAKE_DRAINED_S, 0, what="the intake drained")
    assert len(core.order) == 9


async def test_the_intake_lets_the_loop_run_between_slices() -> None:
    core = AdmitsInOrder()
    intake = Intake(cast(Core, core))  # stand-ins: what the intake calls of a core
    conn = cast(ShellConnection, Conn(core))
    for i in range(10 * INTAKE_SLICE):
        intake.push(_call(i, f"t{i % 3}"), conn)
    await asyncio.sleep(0)
    # One slice per loop iteration: answers and batches interleave with a large intake.
    assert len(core.order) == INTAKE_SLICE
    await aeventually(lambda: not len(intake), INTAKE_DRAINED_S, 0, what="the intake drained")
    assert len(core.order) == 10 * INTAKE_SLICE


# ---- refused before the body is read ------------------------------------------------------


async def _raw_http(port: int, head: str, wait_s: float) -> str:
    """Send an HTTP request head announcing a body that never comes; the answer, or "" if
    none came within ``wait_s`` (the server is waiting for the body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.encode())
        await writer.drain()
        try:
            return (await asyncio.wait_for(reader.read(4096), wait_s)).decode()
        except TimeoutError:
            return ""
    finally:
        writer.close()


def _head(model: str, key: str) -> str:
    return (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: x\r\nx-api-key: {key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n"
    )


async def test_http_refuses_unknown_keys_and_full_queues_before_reading_the_body(
    triton: EmbeddedTriton, workers: int, tmp_path: Path
) -> None:
    data = make_config().model_dump(mode="json")
    data["tenants"]["hooli"]["max_queued"] = 5
    from fair_frontend.config import parse_config

    with BackgroundServer(
        FrontendServer(parse_config(data), triton.grpc_url, Listen(), workers=workers)
    ) as server:
        fe = RunningFrontend(server, None)  # type: ignore[arg-type]  # no BackgroundServer: its URLs
        port = server.http_port
        # A key nobody has: 401 at once, the 50 MB body never read.
        refused = await _raw_http(port, _head("sleeper", "no-such-key"), 5.0)
        assert refused.startswith("HTTP/1.1 401"), refused
        # A good key and a queue with room: the server waits for the body (the control).
        assert await _raw_http(port, _head("sleeper", KEYS["hooli"]), 0.5) == ""
        # Fill hooli's queue behind one request held in Triton at a gate until the test
        # opens it (a slow request sized to outlast the test drained the queue first on a
        # loaded machine), then 5 small ones queued behind it.
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        gate = Gate(tmp_path)

        async def send(tokens: int, parameters: dict[str, Any] | None = None) -> Any:
            ids = np.ones((1, tokens), dtype=np.int32)
            try:
                return await client.infer(
                    "sleeper",
                    [ids_input(grpcaio, ids)],
                    headers={"x-api-key": KEYS["hooli"]},
                    parameters=parameters,
                )
            except InferenceServerException as err:
                return err

        core = server.core
        assert core is not None
        # (10,000 tokens: the core predicts it busy for 0.2 s, far beyond its early send's
        # lead, so the 5 wait in its queue, not in Triton's.)
        flood = [asyncio.ensure_future(send(10_000, {GATE_PARAMETER: gate.parameter}))]
        try:
            deadline = time.monotonic() + 30
            while (runtime := core.runtimes.get("sleeper")) is None or runtime.inflight < 1:
                assert time.monotonic() < deadline, "the gated request never reached Triton"
                await asyncio.sleep(0.005)
            flood += [asyncio.ensure_future(send(10)) for _ in range(5)]
            while runtime.scheduler.depth("hooli") < 5:
                assert time.monotonic() < deadline, "hooli's queue did not fill"
                await asyncio.sleep(0.005)
            # Full: shed at once (a shell learns it within QUEUE_VIEW_INTERVAL_S).
            shed = ""
            while not shed.startswith("HTTP/1.1 503"):
                assert time.monotonic() < deadline, "hooli was never shed"
                assert runtime.scheduler.depth("hooli") == 5, "the queue drained first"
                shed = await _raw_http(port, _head("sleeper", KEYS["hooli"]), 0.2)
            assert "Exceeds maximum queue size: tenant 'hooli' max_queued=5" in shed, shed
        finally:
            gate.open()
            results = await asyncio.wait_for(asyncio.gather(*flood), 120)
            await client.close()
        assert not [r for r in results if isinstance(r, Exception)], results


# ---- the link: cut for not reading, never for a burst -------------------------------------

PART = 1 << 20  # one string of flood's answers: 1 MiB
PARTS = 8  # per request
OLD_BOUND = 256 << 20  # the fixed unsent bound that cut a shell's link before
BURST = OLD_BOUND // (PARTS * PART) + 2  # requests: 272 MiB of answers in all
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
LARGE = [("grpc.max_receive_message_length", -1)]  # answers of 8 and 16 MiB


def _link_config(stalled_shell_s: float) -> Any:
    data = make_config().model_dump(mode="json")
    # Relayed: the answers this link must carry cross the core (one hop, they would not).
    data["endpoints"]["flood"] = {"throttle": False, "unary": "relay"}
    data["queues"]["stalled_shell_s"] = stalled_shell_s
    return parse_config(data)


def _flood(
    request_id: str, count: int, size: int, delay_ms: int, gate: Gate | None = None
) -> bytes:
    msg = service_pb2.ModelInferRequest(model_name="flood", id=request_id)
    for name, value in (("COUNT", count), ("SIZE", size), ("DELAY_MS", delay_ms)):
        msg.inputs.add(name=name, datatype="INT32", shape=[1, 1])
        msg.raw_input_contents.append(np.array([value], dtype="<i4").tobytes())
    if gate is not None:
        msg.parameters[GATE_PARAMETER].string_param = gate.parameter
    return msg.SerializeToString()


def _infer(channel: grpc.aio.Channel) -> Any:
    return channel.unary_unary(
        MODEL_INFER,
        request_serializer=None,
        response_deserializer=service_pb2.ModelInferResponse.FromString,
    )


async def _until(condition: Any, what: str, deadline_s: float = 60.0) -> None:
    await aeventually(condition, deadline_s, 0.01, what=what)


def _unsent(connections: set[ShellConnection]) -> int:
    return sum(c.transport.get_write_buffer_size() for c in connections if c.transport)


def _in_core(runtime: Any) -> int:
    """Requests the core holds for a model: queued, or in batches sent to Triton."""
    return int(runtime.scheduler.queued_requests) + sum(len(b) for b in runtime._tasks.values())


async def test_a_burst_larger_than_the_old_bound_reaches_a_shell_that_paused(
    triton: EmbeddedTriton, tmp_path: Path
) -> None:
    """272 MiB of answers become due while both shells are stopped (SIGSTOP: a pause, not
    a hang): the core holds them unsent, more than the old fixed bound, and delivers every
    one once the shells go on. Before: the link was cut at 256 MiB, the shell restarted
    and its client's stream failed. The answers wait at a gate the test opens once the
    shells are stopped, and the shells are continued once the core holds them all."""
    outcomes = Outcomes()
    server = FrontendServer(
        _link_config(stalled_shell_s=600.0),  # stopped as long as the core takes to fill
        triton.grpc_url,
        Listen(),
        workers=2,
        core_factory=lambda c, f: Core(c, f, observers=[outcomes]),
    )
    gate = Gate(tmp_path)
    with BackgroundServer(server):
        assert isinstance(server.shells, ShellPool)
        shells = server.shells
        links = set(shells.server.connections)
        pids = [p.pid for p in shells.processes.values()]
        metadata = (("x-api-key", KEYS["initech"]),)
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{server.grpc_port}", options=LARGE
        ) as channel:
            infer = _infer(channel)  # one connection: every answer goes to one shell
            await infer(_flood("warm", 1, 1, 0), metadata=metadata, timeout=60)
            calls = [
                asyncio.ensure_future(
                    infer(_flood(f"burst{i}", PARTS, PART, 0, gate), metadata=metadata)
                )
                for i in range(BURST)
            ]
            core = server.core
            assert core is not None
            await _until(
                lambda: (
                    (runtime := core.runtimes.get("flood")) is not None
                    and runtime.inflight >= 1
                    and _in_core(runtime) == BURST
                ),
                "the whole burst in the core, its first batch held at the gate",
            )
            try:
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                gate.open()
                # Every answer comes back from Triton and waits, unsent, for the shell.
                await _until(
                    lambda: _unsent(shells.server.connections) > OLD_BOUND,
                    "more than the old bound unsent to the stopped shell",
                    300.0,
                )
                assert not any(c.cut_off for c in links)
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            replies = await asyncio.wait_for(asyncio.gather(*calls), 300)
        assert [r.outputs[0].shape for r in replies] == [[1, PARTS]] * BURST
        assert shells.restarts == 0 and set(shells.server.connections) == links
        assert not any(c.cut_off for c in links)
        burst = [f"burst{i}" for i in range(BURST)]
        assert [outcomes.outcome[r] for r in burst] == [Outcome.DISPATCHED] * BURST
        assert max(outcomes.by_id[r] for r in burst) == 1


async def test_a_stopped_shell_is_cut_off_after_the_bound_and_its_work_dropped(
    triton: EmbeddedTriton, tmp_path: Path
) -> None:
    """A shell stopped for good (SIGSTOP) while the core has a 16 MiB answer for it:
    after queues.stalled_shell_s without a byte taken, the core cuts its link (the answer
    unsent is dropped: its request counted once), and the shell, continued, is replaced.
    Before: 16 MiB was below the fixed 256 MiB bound, and the link stayed held."""
    outcomes = Outcomes()
    gate = Gate(tmp_path)
    stall_s = 2.0
    server = FrontendServer(
        _link_config(stalled_shell_s=stall_s),
        triton.grpc_url,
        Listen(),
        workers=2,
        core_factory=lambda c, f: Core(c, f, observers=[outcomes]),
    )
    with BackgroundServer(server):
        assert isinstance(server.shells, ShellPool) and server.core is not None
        shells, core = server.shells, server.core
        metadata = (("x-api-key", KEYS["initech"]),)
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{server.grpc_port}", options=LARGE
        ) as channel:
            infer = _infer(channel)
            await infer(_flood("warm", 1, 1, 0), metadata=metadata, timeout=60)
            call = infer(_flood("stuck", 16, PART, 0, gate), metadata=metadata, timeout=120)
            await _until(
                lambda: any(c.calls for c in shells.server.connections), "the call in the core"
            )
            (link,) = [c for c in shells.server.connections if c.calls]
            victim = link.pid
            os.kill(victim, signal.SIGSTOP)
            try:
                gate.open()  # its answer comes once the shell is stopped
                started = time.monotonic()
                await _until(lambda: link.closed, "the stopped shell's link cut", 60.0)
                assert link.cut_off and time.monotonic() - started >= stall_s
                await _until(lambda: core.runtimes["flood"].idle, "its work dropped")
                assert outcomes.by_id["stuck"] == 1
                # Answered by the core before the link was cut: the answer is lost with it.
                assert outcomes.outcome["stuck"] is Outcome.DISPATCHED
            finally:
                os.kill(victim, signal.SIGCONT)
                call.cancel()
            # The continued shell finds its link gone and exits; the pool starts another.
            await _until(lambda: shells.restarts >= 1, "the cut shell replaced", 60.0)
            await _until(lambda: len(shells.server.connections) == 2, "two shells again", 60.0)
            again = await infer(_flood("again", 2, 10, 0), metadata=metadata, timeout=60)
            assert again.outputs[0].shape == [1, 2]
