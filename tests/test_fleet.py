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
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
import yaml
from tritonclient.utils import InferenceServerException

from fair_frontend.embedded import EmbeddedTriton, default_model_repository
from fair_frontend.testing import aeventually, ascrape, eventually, free_port, scrape
from fair_frontend.tokens import count_text_tokens
from tests.support import (
    KEYS,
    Proc,
    RedisProcess,
    config_dict,
    generate_many,
    http_status,
    ids_input,
    make_config,
    repeat_stream,
    start,
)

TEST_MODELS = Path(__file__).resolve().parent / "model_repository"
SECRET = "fleet-test-secret-0123456789abcdef"
LEASE_S = 1.5
SLOTS = 4  # llm's engine slots per Triton


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

    def core(self, index: int, port: int = 0) -> Core:
        """A core; ``port``: a lost core's, which the shells know (as a Service's)."""
        port, metrics = port or free_port(), free_port()
        args = [
            "core",
            "--config", str(self.config),
            "--listen", f"127.0.0.1:{port}",
            "--secret-file", str(self.secret),
            "--election", "redis",
            "--lease-s", str(LEASE_S),
            "--lease-name", f"fleet-test-{os.getpid()}",
            "--metrics-port", str(metrics),
            "--metrics-host", "127.0.0.1",
        ]  # fmt: skip
        return Core(start(args, self.tmp / f"core{index}.log"), port, metrics)

    def shell(self, index: int, secret: Path | None = None) -> Shell:
        http, grpc = free_port(), free_port()
        args = ["shell", "--secret-file", str(secret or self.secret), "--host", "127.0.0.1"]
        args += ["--http-port", str(http), "--grpc-port", str(grpc), "--log-format", "text"]
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
    for name, weight in (("acme", 2.0), ("globex", 1.0)):
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
            eventually(lambda s=shell: s.ready, 60, what="the shells to be ready")
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


async def test_every_shell_feeds_the_one_core(fleet: Fleet) -> None:
    leader = fleet.leader()
    metrics = f"http://127.0.0.1:{leader.metrics}/metrics"
    before = scrape(metrics).sum("fair_requests_total", tenant="initech", outcome="dispatched")
    results = await asyncio.gather(*(_embed(s.url, "initech") for s in fleet.shells))
    assert not [r for r in results if isinstance(r, InferenceServerException)], results
    after = scrape(metrics).sum("fair_requests_total", tenant="initech", outcome="dispatched")
    assert after - before == 3  # counted by the leader: all three went through it
    standby = next(c for c in fleet.cores if c is not leader)
    assert not standby.ready


async def test_weights_hold_across_shells_and_no_triton_exceeds_its_slots(fleet: Fleet) -> None:
    leader = fleet.leader()
    metrics = f"http://127.0.0.1:{leader.metrics}/metrics"
    peak = {0: 0.0, 1: 0.0}
    log: list[tuple[float, str]] = []

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
        by_tenant = await asyncio.gather(
            generate_many(fleet.shells[0].url, "acme", BACKLOG, 16, log),
            generate_many(fleet.shells[1].url, "globex", BACKLOG, 16, log),
        )
    finally:
        watcher.cancel()
    streams = [s for streams in by_tenant for s in streams.values()]
    # While both were backlogged, after the first fill of the slots (which both get
    # alike, whatever their weights): from the moment each has had two rounds of the
    # fleet's slots started, up to the moment the first one's last stream started.
    starts = {t: sorted(s.first_token_at for s in streams if s.tenant == t) for t in KEYS_AB}
    since = max(times[4 * SLOTS] for times in starts.values())
    until = min(times[-1] for times in starts.values())
    served = {"acme": 0, "globex": 0}
    for at, tenant in log:
        if since < at <= until:
            served[tenant] += 1
    tokenizer = fleet_tokenizer()
    for s in streams:
        if since < s.first_token_at <= until:
            served[s.tenant] += count_text_tokens(tokenizer, [s.prompt])[0]
    share = served["acme"] / sum(served.values())
    assert abs(share - 2 / 3) <= 0.05 * 2 / 3, served
    assert max(peak.values()) > 0 and all(p <= SLOTS for p in peak.values()), peak


KEYS_AB = ("acme", "globex")
BACKLOG = 200  # generations each tenant queues: the window is long beside VTC's bound


def fleet_tokenizer() -> Any:
    tokenizer = make_config().endpoints["llm"].tokenizer
    assert tokenizer is not None
    return tokenizer


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
    leader had granted run on with their slots held by the new one."""
    leader = fleet.leader()
    standby = next(c for c in fleet.cores if c is not leader)
    wide = np.full((1, 1024), 3, dtype=np.int32)
    answered: list[float] = []

    async def one(url: str) -> Any:
        client = grpcaio.InferenceServerClient(url)
        try:
            result = await client.infer(
                "embed", [ids_input(grpcaio, wide)], headers={"x-api-key": KEYS["initech"]}
            )
            answered.append(time.monotonic())
            return result
        except InferenceServerException as err:
            return err
        finally:
            await client.close()

    # Streams granted by the leader, relayed by shell 0 across the failover.
    started: list[int] = []
    streams = asyncio.gather(
        *(
            repeat_stream(fleet.shells[0].url, STREAM_DELAYS_MS, on_first=lambda: started.append(1))
            for _ in range(STREAMS)
        )
    )
    await aeventually(lambda: len(started) == STREAMS, 60, 0.005, what="the streams to run")
    flood = [asyncio.ensure_future(one(fleet.shells[i % 3].url)) for i in range(FLOOD)]
    await aeventually(lambda: len(answered) >= 10, 60, 0.005, what="the flood to be served")
    assert len(answered) < FLOOD // 2, "the flood ended before the kill"
    killed_at = time.monotonic()
    leader.proc.popen.kill()
    # The new leader holds the running streams' slots: its engine count says so while
    # they still stream (granted by the old one, told by the shell on reconnecting).
    metrics = f"http://127.0.0.1:{standby.metrics}/metrics"
    await aeventually(lambda: standby.ready, 30, 0.01, what="the standby to lead")

    def held() -> float:
        return scrape(metrics).sum("fair_triton_backend_inflight", endpoint="repeat_int32")

    await aeventually(lambda: held() == STREAMS, 30, 0.01, what="the streams' slots held")
    assert not streams.done()
    ended = await asyncio.wait_for(streams, 120)
    assert ended == [(len(STREAM_DELAYS_MS), None)] * STREAMS
    await aeventually(lambda: held() == 0, 30, 0.01, what="the slots to be freed at their end")
    results = await asyncio.wait_for(asyncio.gather(*flood), 120)
    failed = [r for r in results if isinstance(r, InferenceServerException)]
    assert not failed, failed[:3]
    after = [t for t in answered if t > killed_at]
    assert after, "nothing was left to serve after the kill"
    gap = min(after) - killed_at
    print(f"failover gap: {gap:.2f} s (lease {LEASE_S} s)")
    assert standby.ready
    assert all(s.ready for s in fleet.shells)
    resent = sum(s.proc.output().count("sending") for s in fleet.shells)
    assert resent >= 1  # the shells said they sent what they held again
    fleet.cores.remove(leader)
    fleet.killed.append(leader.port)


FLOOD = 240
STREAMS = 2  # one on each Triton (repeat_int32 runs one request at a time)
STREAM_DELAYS_MS = [250] * 32  # 8 s a stream: it outlasts the failover


async def test_a_leader_stopped_cleanly_hands_over_without_failing_a_call(fleet: Fleet) -> None:
    """After the kill (this module's order): a new standby joins; the leader gets SIGTERM
    under a flood. It drains what it holds, frees the lease, and the standby takes the
    shells at its next poll; every call is answered OK."""
    leader = fleet.leader()
    standby = fleet.core(2, port=fleet.killed[0])  # the killed core's address, anew
    fleet.cores.append(standby)
    await aeventually(
        lambda: "waiting for the lease" in standby.proc.output(), 60, 0.01, what="a standby"
    )
    flood = [asyncio.ensure_future(_embed(fleet.shells[i % 3].url)) for i in range(120)]
    await aeventually(lambda: sum(f.done() for f in flood) >= 5, 60, 0.005, what="the flood")
    leader.proc.popen.send_signal(signal.SIGTERM)
    results = await asyncio.wait_for(asyncio.gather(*flood), 120)
    failed = [r for r in results if isinstance(r, InferenceServerException)]
    assert not failed, failed[:3]
    assert leader.proc.popen.wait(30) == 0  # a clean stop
    await aeventually(lambda: standby.ready, 30, 0.01, what="the standby to lead")
    assert "freeing the lease" in leader.proc.output()
    fleet.cores.remove(leader)
    after = await asyncio.gather(*(_embed(s.url) for s in fleet.shells))
    assert not [r for r in after if isinstance(r, InferenceServerException)]
