"""The frontend as a fleet, with real processes on loopback: two Tritons, two cores
(``fair-frontend core --election redis``: one leads, one stands by), three shells
(``fair-frontend shell``, each its own process on its own ports, as on three hosts), and
Redis. What users see:

* a request through any shell is scheduled by the one core: weights hold across shells
  (tenant A only through shell 1, B only through shell 2, 2:1 on ``llm``), and the
  engine load at each Triton never exceeds its slots;
* a shell with a wrong secret is refused, and says why;
* the leader SIGKILLed under a flood: the standby leads within the measured gap, the
  shells reconnect and send what they held again, and every call is answered OK.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
import yaml
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton, default_model_repository
from fair_frontend.kit.testing import (
    GATE_PARAMETER,
    Gate,
    aeventually,
    ascrape,
    eventually,
    free_port,
)
from fair_frontend.observability.logs import REQUEST_LOGGER
from tests.support import (
    KEYS,
    Proc,
    RedisProcess,
    config_dict,
    generate_many,
    http_status,
    ids_input,
    start,
)

TEST_MODELS = Path(__file__).resolve().parent / "model_repository"
SECRET = "fleet-test-secret-0123456789abcdef"
LEASE_S = 1.5
SLOTS = 4  # llm's engine slots per Triton
WEIGHTS = {"acme": 2.0, "globex": 1.0}


@dataclass
class Core:
    proc: Proc
    port: int
    metrics: int

    @property
    def ready(self) -> bool:
        return http_status(f"http://127.0.0.1:{self.metrics}/v2/health/ready") == 200


@dataclass
class Shell:
    proc: Proc
    http: int
    grpc: int

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    @property
    def ready(self) -> bool:
        return http_status(f"http://127.0.0.1:{self.http}/v2/health/ready") == 200


@dataclass
class Fleet:
    tritons: list[EmbeddedTriton]
    redis: RedisProcess
    config: Path
    secret: Path
    cores: list[Core]
    shells: list[Shell]
    tmp: Path
    killed: list[int] = field(default_factory=list)  # ports of cores gone
    lease_s: float = LEASE_S

    def core(self, index: int, port: int = 0) -> Core:
        """A core; ``port``: a lost core's, which the shells know (as a Service's)."""
        port, metrics = port or free_port(), free_port()
        args = [
            "core",
            "--config", str(self.config),
            "--listen", f"127.0.0.1:{port}",
            "--secret-file", str(self.secret),
            "--election", "redis",
            "--lease-s", str(self.lease_s),
            "--lease-name", f"fleet-test-{os.getpid()}",
            "--metrics-port", str(metrics),
            "--metrics-host", "127.0.0.1",
        ]  # fmt: skip
        return Core(start(args, self.tmp / f"core{index}.log"), port, metrics)

    def shell(self, index: int, secret: Path | None = None) -> Shell:
        http, grpc = free_port(), free_port()
        args = ["shell", "--secret-file", str(secret or self.secret), "--host", "127.0.0.1"]
        args += ["--http-port", str(http), "--grpc-port", str(grpc), "--log-format", "json"]
        for core in self.cores:
            args += ["--core", f"127.0.0.1:{core.port}"]
        return Shell(start(args, self.tmp / f"shell{index}.log"), http, grpc)

    def leader(self) -> Core:
        leaders = [c for c in self.cores if c.ready]
        assert len(leaders) == 1, [c.proc.output()[-2000:] for c in self.cores]
        return leaders[0]


def fleet_config(tritons: list[EmbeddedTriton], redis_url: str) -> dict[str, Any]:
    data = config_dict()
    data["triton"] = {
        "backends": [{"grpc_url": t.grpc_url, "http_url": t.http_url} for t in tritons],
        "max_outage_s": 120.0,
    }
    data["rate_limiting"] = {"storage": redis_url}
    data["endpoints"]["llm"].update(max_inflight=SLOTS, reserved_slots=0)
    for name, weight in WEIGHTS.items():
        data["tenants"][name].update(weight=weight, max_queued=1000)
    return data


@pytest.fixture(scope="module")
def fleet(triton: EmbeddedTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    second = EmbeddedTriton(
        [default_model_repository(), TEST_MODELS],
        extra_args=[
            "--model-control-mode=explicit",
            "--load-model=embed",
            "--load-model=llm",
            "--load-model=repeat_int32",
            "--load-model=flood",
        ],
    )
    redis = RedisProcess()
    redis.start()
    second.start()
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(fleet_config([triton, second], redis.url)))
    secret = tmp / "secret"
    secret.write_text(SECRET + "\n")
    fleet = Fleet([triton, second], redis, config, secret, [], [], tmp)
    try:
        fleet.cores.append(fleet.core(0))
        eventually(lambda: fleet.cores[0].ready, 60, what="the first core to lead")
        fleet.cores.append(fleet.core(1))
        fleet.shells.extend(fleet.shell(i) for i in range(3))
        for shell in fleet.shells:

            def ready(s: Shell = shell) -> bool:
                return s.ready

            eventually(ready, 60, what="the shells to be ready")
        eventually(
            lambda: "waiting for the lease" in fleet.cores[1].proc.output(),
            60,
            what="the second core to stand by",
        )
        yield fleet
    finally:
        for proc in [s.proc for s in fleet.shells] + [c.proc for c in fleet.cores]:
            proc.stop()
        second.stop()
        redis.stop()


async def _embed(url: str, tenant: str = "acme") -> Any:
    client = grpcaio.InferenceServerClient(url)
    try:
        ids = np.full((1, 64), 3, dtype=np.int32)
        return await client.infer(
            "embed", [ids_input(grpcaio, ids)], headers={"x-api-key": KEYS[tenant]}
        )
    except InferenceServerException as err:
        return err
    finally:
        await client.close()


async def _flood(
    client: grpcaio.InferenceServerClient, gate: Gate, answered: list[float] | None = None
) -> Any:
    """One row of ``flood`` (a one-byte answer) through ``client``'s shell, held in Triton
    at ``gate`` until the test opens it; ``answered`` gets the time of an OK answer."""
    inputs = []
    for name in ("COUNT", "SIZE", "DELAY_MS"):
        tensor = grpcaio.InferInput(name, [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[0 if name == "DELAY_MS" else 1]], dtype=np.int32))
        inputs.append(tensor)
    try:
        result = await client.infer(
            "flood",
            inputs,
            headers={"x-api-key": KEYS["initech"]},
            parameters={GATE_PARAMETER: gate.parameter},
        )
    except InferenceServerException as err:
        return err
    if answered is not None:
        answered.append(time.monotonic())
    return result


async def gated_stream(
    url: str, values: int, gate: Gate, *, on_first: Callable[[], None]
) -> tuple[int, Any]:
    """One repeat_int32 stream through the shell at ``url``, held after its first response
    at ``gate`` (``repeat_int32``'s model) until the test opens it, then its other values
    20 ms apart, read to its end: (responses with a value, the error that ended it or None).
    ``on_first`` runs at the first response."""
    client = grpcaio.InferenceServerClient(url)
    tensors = []
    for name, dtype, data in (
        ("IN", "INT32", np.arange(values, dtype=np.int32)),
        ("DELAY", "UINT32", np.array([0] + [20] * (values - 1), dtype=np.uint32)),
        ("WAIT", "UINT32", np.array([0], dtype=np.uint32)),
    ):
        tensor = grpcaio.InferInput(name, list(data.shape), dtype)
        tensor.set_data_from_numpy(data)
        tensors.append(tensor)

    async def one() -> AsyncIterator[dict[str, Any]]:
        yield {
            "model_name": "repeat_int32",
            "inputs": tensors,
            "parameters": {GATE_PARAMETER: gate.parameter},
        }

    got = 0
    try:
        async for result, error in client.stream_infer(one(), headers={"x-api-key": KEYS["acme"]}):
            if error is not None:
                return got, error
            if result.as_numpy("OUT") is None:
                continue
            got += 1
            if got == 1:
                on_first()
    finally:
        await client.close()
    return got, None


async def _sum(core: Core, name: str, **labels: str) -> float:
    page = await ascrape(f"http://127.0.0.1:{core.metrics}/metrics")
    return page.sum(name, **labels)


async def holds_flood(core: Core, tritons: list[EmbeddedTriton]) -> bool:
    """Has ``core`` ``flood`` in every Triton (a batch held at its gate there) and more
    of it queued?"""
    page = await ascrape(f"http://127.0.0.1:{core.metrics}/metrics")
    each = [
        page.sum("fair_triton_backend_inflight", endpoint="flood", backend=t.grpc_url)
        for t in tritons
    ]
    return all(each) and page.sum("fair_queue_depth", endpoint="flood") > 0


async def test_every_shell_feeds_the_one_core(fleet: Fleet) -> None:
    leader = fleet.leader()

    async def dispatched() -> float:
        return await _sum(leader, "fair_requests_total", tenant="initech", outcome="dispatched")

    before = await dispatched()
    results = await asyncio.gather(*(_embed(s.url, "initech") for s in fleet.shells))
    assert not [r for r in results if isinstance(r, InferenceServerException)], results
    # Counted by the leader (all three went through it) as it records each one's end, a
    # moment after its client had the answer: 3, and never more.
    await aeventually(
        lambda: _reached(dispatched(), before + 3), 30, what="the leader to count all three"
    )
    standby = next(c for c in fleet.cores if c is not leader)
    assert not standby.ready


async def _reached(count: Awaitable[float], expected: float) -> bool:
    """Has a count that only grows reached ``expected``? Beyond it fails at once."""
    got = await count
    assert got <= expected, (got, expected)
    return got == expected


async def _is(value: Awaitable[float], expected: float) -> bool:
    return await value == expected


@dataclass(frozen=True)
class Logged:
    """One request served to its end, as its request-log line says
    (``fair_frontend.observability.logs.RequestLog``; a stream's is its shell's), on the
    wall clock: when it joined the core's queue, left it for an engine slot (its dispatch:
    its grant, as its shell read it), and ended; its tokens in and out."""

    tenant: str
    queued: float
    dispatched: float
    ended: float
    tokens_in: int
    tokens_out: int

    @classmethod
    def of(cls, line: dict[str, Any]) -> Logged:
        assert line["outcome"] == "dispatched", line
        ended = float(line["ts"])
        dispatched = ended - line["service_ms"] / 1e3
        queued = dispatched - line["queued_ms"] / 1e3
        return cls(line["tenant"], queued, dispatched, ended, line["tokens_in"], line["tokens_out"])


def request_log(process: Core | Shell, endpoint: str, offset: int = 0) -> list[dict[str, Any]]:
    """The request lines of ``endpoint`` that a core or a shell logged after byte
    ``offset`` of its log (a line still being written is left for the next read)."""
    out = []
    for line in process.proc.log.read_bytes()[offset:].decode(errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue  # not a JSON record: the core's other output, or a line half written
        if isinstance(doc, dict) and (doc.get("logger"), doc.get("endpoint")) == (
            REQUEST_LOGGER,
            endpoint,
        ):
            out.append(doc)
    return out


def backlog_end(log: list[Logged], tenant: str, at: float) -> float:
    """Until when ``tenant`` had requests queued in the core without a break, from ``at``
    on (``at`` itself: none queued then)."""
    end = at
    for r in sorted((r for r in log if r.tenant == tenant), key=lambda r: r.queued):
        if r.queued > end:
            break
        end = max(end, r.dispatched)
    return end


def backlogged_service(
    log: list[Logged], tenants: tuple[str, ...], skip: int
) -> tuple[dict[str, float], float, float]:
    """Tokens the core served each of ``tenants`` while every one of them had requests
    queued (VTC's bound holds over such a window), from the moment each had had ``skip``
    requests dispatched: (tenant -> tokens, the window's start, its end). As VTC charges
    them: a request's input tokens at its dispatch, its output tokens as they stream
    (spread evenly over its service)."""
    since = max(sorted(r.dispatched for r in log if r.tenant == t)[skip] for t in tenants)
    until = min(backlog_end(log, t, since) for t in tenants)
    served = dict.fromkeys(tenants, 0.0)
    for r in log:
        if r.tenant not in served:
            continue
        if since < r.dispatched <= until:
            served[r.tenant] += r.tokens_in
        overlap = min(r.ended, until) - max(r.dispatched, since)
        if overlap > 0:
            served[r.tenant] += r.tokens_out * overlap / (r.ended - r.dispatched)
    return served, since, until


async def test_weights_hold_across_shells_and_no_triton_exceeds_its_slots(fleet: Fleet) -> None:
    """acme (weight 2) only through shell 0, globex (weight 1) only through shell 1, each
    with a backlog of generations: while both are backlogged, the core serves acme two
    thirds of the tokens. Judged from the request log (when each request queued, as the
    core timed it, went to its slot and ended, and its tokens: each stream's line, written
    by its shell), not from when the clients received their tokens."""
    leader = fleet.leader()
    metrics = f"http://127.0.0.1:{leader.metrics}/metrics"
    peak = {0: 0.0, 1: 0.0}
    # This test's requests are logged after these offsets, each by the shell that relayed
    # its stream (``observability.request_log: shell``, the default).
    offsets = [shell.proc.log.stat().st_size for shell in fleet.shells]

    def lines() -> list[dict[str, Any]]:
        return [
            line
            for shell, offset in zip(fleet.shells, offsets, strict=True)
            for line in request_log(shell, "llm", offset)
        ]

    async def watch_slots() -> None:
        while True:
            page = await ascrape(metrics)
            for index, triton in enumerate(fleet.tritons):
                running = page.sum(
                    "fair_triton_backend_inflight", endpoint="llm", backend=triton.grpc_url
                )
                peak[index] = max(peak[index], running)
            await asyncio.sleep(0.02)

    watcher = asyncio.ensure_future(watch_slots())
    try:
        await asyncio.gather(
            generate_many(fleet.shells[0].url, "acme", BACKLOG, 16, []),
            generate_many(fleet.shells[1].url, "globex", BACKLOG, 16, []),
        )
    finally:
        watcher.cancel()
    # A shell logs each stream as it tells the core of its end: about when its client
    # has its last token.
    await aeventually(lambda: len(lines()) >= 2 * BACKLOG, 30, what="every generation logged")
    log = [Logged.of(line) for line in lines()]
    assert sorted(r.tenant for r in log) == sorted(KEYS_AB * BACKLOG)
    # After the first fills of the slots (which both get alike, whatever their weights):
    # from the moment each has had two rounds of the fleet's slots.
    skip = 2 * SLOTS * len(fleet.tritons)
    served, since, until = backlogged_service(log, KEYS_AB, skip)
    window = f"{served} over {until - since:.2f} s"
    # VTC's bound (fair_frontend.scheduler.vtc, (B)): while both are backlogged, their
    # weighted service differs by at most U_acme + U_globex, U = (I + O * S) / weight (I
    # and O a request's most tokens in and out, S the fleet's slots), so acme's share is
    # 2/3 within (2/3)(U_acme + U_globex) / total: the window must be long enough that
    # this is within the 5 % asked.
    most_in, most_out = max(r.tokens_in for r in log), max(r.tokens_out for r in log)
    bound = sum((most_in + most_out * SLOTS * len(fleet.tritons)) / w for w in WEIGHTS.values())
    total = sum(served.values())
    assert total * 0.05 >= bound, f"a window too short for VTC's bound ({bound:.0f}): {window}"
    share = served["acme"] / total
    print(f"acme's share {share:.3f}: {window}")
    assert abs(share - 2 / 3) <= 0.05 * 2 / 3, window
    assert max(peak.values()) > 0 and all(p <= SLOTS for p in peak.values()), peak


KEYS_AB = ("acme", "globex")
BACKLOG = 200  # generations each tenant queues: the window is long beside VTC's bound


def test_a_shell_with_a_wrong_secret_is_refused(fleet: Fleet, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-fleet-secret-at-all-0000\n")
    shell = fleet.shell(9, secret=wrong)
    try:
        code = shell.proc.popen.wait(60)
    finally:
        shell.proc.stop()
    assert code == 2, shell.proc.output()
    assert "refused this shell's secret" in shell.proc.output()
    assert "wrong core secret" in fleet.leader().proc.output()


async def test_the_leader_killed_under_a_flood_loses_nothing(fleet: Fleet) -> None:
    """Last in this module: it leaves the fleet with one core (the new leader). Every
    queued call is answered OK (the shells send them again), and the streams the old
    leader had granted run on with their slots held by the new one. The flood and the
    streams are held at gates (in Triton) until the new leader has them: none of it can
    end before the kill, however fast or slow this machine is."""
    leader = fleet.leader()
    standby = next(c for c in fleet.cores if c is not leader)
    flood_gate, streams_gate = Gate(fleet.tmp), Gate(fleet.tmp)
    answered: list[float] = []
    started: list[int] = []
    clients = [grpcaio.InferenceServerClient(s.url) for s in fleet.shells]
    try:
        # Streams granted by the leader, relayed by shell 0 across the failover.
        streams = asyncio.gather(
            *(
                gated_stream(
                    fleet.shells[0].url,
                    STREAM_VALUES,
                    streams_gate,
                    on_first=lambda: started.append(1),
                )
                for _ in range(STREAMS)
            )
        )
        await aeventually(lambda: len(started) == STREAMS, 60, 0.005, what="the streams to run")
        flood = [
            asyncio.ensure_future(_flood(clients[i % 3], flood_gate, answered))
            for i in range(FLOOD)
        ]
        await aeventually(
            lambda: holds_flood(leader, fleet.tritons),
            60,
            0.01,
            what="the leader to hold the flood: in both Tritons, and queued",
        )
        assert not answered and not streams.done()
        killed_at = time.monotonic()
        leader.proc.popen.kill()
        await aeventually(lambda: standby.ready, 30, 0.01, what="the standby to lead")
        print(f"failover: the standby led {time.monotonic() - killed_at:.2f} s after the kill")

        # The new leader holds the running streams' slots: its engine count says so while
        # they still stream (granted by the old one, told by the shell on reconnecting);
        # and the flood, which the shells sent it again.
        async def held() -> float:
            return await _sum(standby, "fair_triton_backend_inflight", endpoint="repeat_int32")

        await aeventually(lambda: _is(held(), STREAMS), 30, 0.01, what="the streams' slots held")
        await aeventually(
            lambda: holds_flood(standby, fleet.tritons),
            60,
            0.01,
            what="the new leader to hold the flood the shells sent again",
        )
        assert not answered and not streams.done()
        flood_gate.open()
        streams_gate.open()
        ended = await asyncio.wait_for(streams, 120)
        assert ended == [(STREAM_VALUES, None)] * STREAMS
        await aeventually(
            lambda: _is(held(), 0), 30, 0.01, what="the slots to be freed at their end"
        )
        results = await asyncio.wait_for(asyncio.gather(*flood), 120)
    finally:
        flood_gate.open()  # never left shut: Triton's instances would wait for it
        streams_gate.open()
        for client in clients:
            await client.close()
    failed = [r for r in results if isinstance(r, InferenceServerException)]
    assert not failed, failed[:3]
    assert len(answered) == FLOOD and min(answered) > killed_at
    assert standby.ready
    assert all(s.ready for s in fleet.shells)
    resent = sum(s.proc.output().count("sending") for s in fleet.shells)
    assert resent >= 1  # the shells said they sent what they held again
    fleet.cores.remove(leader)
    fleet.killed.append(leader.port)


FLOOD = 300  # rows of flood: more than the Tritons' batches in flight hold (64 rows each)
STREAMS = 2  # one on each Triton (repeat_int32 runs one request at a time)
STREAM_VALUES = 8  # the first before the gate, the others once the test opens it


async def test_a_leader_stopped_cleanly_hands_over_without_failing_a_call(fleet: Fleet) -> None:
    """After the kill (this module's order): a new standby joins; the leader gets SIGTERM
    under a flood (held at a gate in Triton until the leader has begun to stop). It
    drains what it holds, frees the lease, and the standby takes the shells at its next
    poll; every call is answered OK."""
    leader = fleet.leader()
    standby = fleet.core(2, port=fleet.killed[0])  # the killed core's address, anew
    fleet.cores.append(standby)
    await aeventually(
        lambda: "waiting for the lease" in standby.proc.output(), 60, 0.01, what="a standby"
    )
    gate = Gate(fleet.tmp)
    clients = [grpcaio.InferenceServerClient(s.url) for s in fleet.shells]
    try:
        flood = [asyncio.ensure_future(_flood(clients[i % 3], gate)) for i in range(FLOOD)]
        await aeventually(
            lambda: holds_flood(leader, fleet.tritons),
            60,
            0.01,
            what="the leader to hold the flood: in both Tritons, and queued",
        )
        assert not any(f.done() for f in flood)
        leader.proc.popen.send_signal(signal.SIGTERM)
        await aeventually(
            lambda: "stopping: finishing queued" in leader.proc.output(),
            30,
            0.01,
            what="the leader to begin its drain",
        )
        gate.open()
        results = await asyncio.wait_for(asyncio.gather(*flood), 120)
    finally:
        gate.open()
        for client in clients:
            await client.close()
    failed = [r for r in results if isinstance(r, InferenceServerException)]
    assert not failed, failed[:3]
    assert leader.proc.popen.wait(30) == 0  # a clean stop
    await aeventually(lambda: standby.ready, 30, 0.01, what="the standby to lead")
    assert "freeing the lease" in leader.proc.output()
    fleet.cores.remove(leader)
    after = await asyncio.gather(*(_embed(s.url) for s in fleet.shells))
    assert not [r for r in after if isinstance(r, InferenceServerException)]
