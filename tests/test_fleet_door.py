"""The fleet's own door and the operator's: what a shell is sent, and SIGHUP on a core.

Real processes on loopback, as in test_fleet: two ``fair-frontend core --election redis``
(one leads, one stands by) on the session's Triton, one ``fair-frontend shell`` that
knows both, Redis for the lease. The config holds plain inline keys and a plain trusted
gateway secret, as an operator may write them.

* A shell is sent the keys' digests and the gateway secret's digest, never the keys or
  the secret (before: the whole config, ``model_dump()``); auth through it still works,
  by key and by the gateway's proof.
* SIGHUP to the leading core reloads its config file as ``serve`` does: a key rotated in
  the file works through the shell at once and the old one is refused, and the core
  lives on (before: SIGHUP's default action killed it). A standby reads the file again as
  it takes the lease, so a reload signalled to the leader alone survives a failover.
"""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from fair_frontend.auth import hash_key
from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.kit.testing import aeventually, eventually, free_port
from fair_frontend.shell.remote import RemoteLink
from fair_frontend.wire.framing import encode
from fair_frontend.wire.records import LINK_VERSION, Hello, Settings
from tests.support import (
    KEYS,
    KServe,
    Proc,
    RedisProcess,
    config_dict,
    embed_body,
    http_status,
    request,
    start,
)

SECRET = "fleet-door-secret-0123456789abcdef"
GATEWAY_SECRET = "the-gateways-own-secret-0123456789"
LEASE_S = 1.5
START_S = 90.0  # a process's start on a loaded machine: far above what it takes
APPLY_S = 30.0  # a reload reaching the shell, a failover: far above what they take


@dataclass
class Core:
    proc: Proc
    port: int
    metrics: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ready(self) -> bool:
        return http_status(f"http://127.0.0.1:{self.metrics}/v2/health/ready") == 200


@dataclass
class Fleet:
    config: Path
    data: dict[str, Any]
    cores: list[Core]
    shell: Proc
    http: int
    grpc: int

    def write(self, data: dict[str, Any]) -> None:
        """The config file replaced whole (a reader never sees half of it)."""
        staged = self.config.with_suffix(".new")
        staged.write_text(yaml.safe_dump(data))
        os.replace(staged, self.config)
        self.data = data

    def leader(self) -> Core:
        (leader,) = [c for c in self.cores if c.proc.popen.poll() is None and c.ready]
        return leader


def door_config(triton: EmbeddedTriton, redis_url: str) -> dict[str, Any]:
    data = config_dict()
    data["triton"] = {"backends": [{"grpc_url": triton.grpc_url}]}
    data["rate_limiting"] = {"storage": redis_url}
    data["auth"] = {"trusted_gateway": True, "trusted_gateway_secret": GATEWAY_SECRET}
    return data


@pytest.fixture(scope="module")
def fleet(triton: EmbeddedTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet-door")
    redis = RedisProcess()
    redis.start()
    config = tmp / "config.yaml"
    data = door_config(triton, redis.url)
    config.write_text(yaml.safe_dump(data))
    secret = tmp / "secret"
    secret.write_text(SECRET + "\n")
    procs: list[Proc] = []

    def core(index: int) -> Core:
        port, metrics = free_port(), free_port()
        args = [
            "core", "--config", str(config), "--listen", f"127.0.0.1:{port}",
            "--secret-file", str(secret), "--election", "redis", "--lease-s", str(LEASE_S),
            "--lease-name", f"fleet-door-{os.getpid()}", "--metrics-port", str(metrics),
            "--metrics-host", "127.0.0.1",
        ]  # fmt: skip
        proc = start(args, tmp / f"core{index}.log")
        procs.append(proc)
        return Core(proc, port, metrics)

    try:
        first = core(0)
        eventually(lambda: first.ready, START_S, what="the first core to lead")
        second = core(1)
        eventually(
            lambda: "waiting for the lease" in second.proc.output(),
            START_S,
            what="the second core to stand by",
        )
        http, grpc = free_port(), free_port()
        args = ["shell", "--secret-file", str(secret), "--host", "127.0.0.1", "--log-format"]
        args += ["text", "--http-port", str(http), "--grpc-port", str(grpc)]
        args += ["--core", first.address, "--core", second.address]
        shell = start(args, tmp / "shell.log")
        procs.append(shell)
        eventually(
            lambda: http_status(f"http://127.0.0.1:{http}/v2/health/ready") == 200,
            START_S,
            what="the shell to be ready",
        )
        yield Fleet(config, data, [first, second], shell, http, grpc)
    finally:
        for proc in reversed(procs):
            proc.stop()
        redis.stop()


async def through_shell(fleet: Fleet, key: str) -> str:
    """An embed call through the shell with ``key``: its gRPC status name."""
    kserve = KServe()
    try:
        urls = (f"127.0.0.1:{fleet.grpc}", f"127.0.0.1:{fleet.http}")
        return (await kserve.infer("grpc", urls, key, "embed", 1, 16)).code
    finally:
        await kserve.close()


def as_gateway(fleet: Fleet, secret: str) -> int:
    """An embed call through the shell naming its tenant, with the gateway's proof."""
    headers = {"content-type": "application/json", "x-tenant-id": "acme"}
    answer = request(
        f"127.0.0.1:{fleet.http}",
        "/v2/models/embed/infer",
        embed_body(8),
        {**headers, "x-gateway-secret": secret},
    )
    return answer.status


async def test_a_shell_is_sent_digests_never_keys_or_the_gateway_secret(fleet: Fleet) -> None:
    leader = fleet.leader()
    sent: list[Settings] = []
    link = RemoteLink([leader.address], SECRET.encode(), Hello(7, 0, LINK_VERSION), sent.append,
                      lambda: None, lambda: None)  # fmt: skip
    await link._open(leader.address)
    await link.aclose()
    (settings,) = sent
    wire = encode(settings)  # what crossed the link, as it crossed it
    for secret in (*KEYS.values(), GATEWAY_SECRET):
        assert secret.encode() not in wire, f"a shell was sent {secret!r}"
    assert settings.keys == {hashlib.sha256(k.encode()).hexdigest(): t for t, k in KEYS.items()}
    tenants = settings.config["tenants"]
    assert all(t["api_keys"] == [] and t["api_keys_file"] is None for t in tenants.values())
    assert settings.config["auth"]["trusted_gateway_secret"] == hash_key(GATEWAY_SECRET)
    # Auth through the shell, from what it was sent: a key, the gateway's proof.
    assert await through_shell(fleet, KEYS["acme"]) == "OK"
    assert await through_shell(fleet, "not-a-key") == "UNAUTHENTICATED"
    assert as_gateway(fleet, GATEWAY_SECRET) == 200
    assert as_gateway(fleet, hash_key(GATEWAY_SECRET)) == 401  # the digest is no proof
    assert as_gateway(fleet, "a-wrong-secret") == 401


def rotated(data: dict[str, Any], key: str) -> dict[str, Any]:
    """``data`` with acme's key replaced by ``key`` (the old one revoked)."""
    new = yaml.safe_load(yaml.safe_dump(data))
    new["tenants"]["acme"]["api_keys"] = [key]
    return new


async def test_sighup_reloads_the_leading_core_and_its_shells(fleet: Fleet) -> None:
    leader = fleet.leader()
    old, new = KEYS["acme"], "acme-rotated-by-sighup"
    assert await through_shell(fleet, old) == "OK"
    fleet.write(rotated(fleet.data, new))
    leader.proc.popen.send_signal(signal.SIGHUP)

    async def applied() -> bool:
        return await through_shell(fleet, new) == "OK"

    await aeventually(applied, APPLY_S, what="the rotated key to work through the shell")
    assert await through_shell(fleet, old) == "UNAUTHENTICATED"
    assert leader.proc.popen.poll() is None, leader.proc.output()[-3000:]
    assert fleet.leader() is leader
    assert "reloaded:" in leader.proc.output()


async def test_a_standby_takes_the_reloaded_config_as_it_leads(fleet: Fleet) -> None:
    """The leader alone is signalled; it stops; the standby, which never was, leads with
    the file as it is now: the rotated key works through the shell, the revoked ones do
    not (the standby started with the first key)."""
    leader = fleet.leader()
    (standby,) = [c for c in fleet.cores if c is not leader]
    revoked = fleet.data["tenants"]["acme"]["api_keys"][0]
    new = "acme-rotated-again"
    fleet.write(rotated(fleet.data, new))
    leader.proc.popen.send_signal(signal.SIGHUP)

    async def works(key: str) -> bool:
        return await through_shell(fleet, key) == "OK"

    await aeventually(lambda: works(new), APPLY_S, what="the leader's reload")
    leader.proc.stop()  # SIGTERM: it drains, frees the lease; the standby leads
    eventually(lambda: standby.ready, APPLY_S, what="the standby to lead")
    eventually(
        lambda: f"connected to the core at {standby.address}" in fleet.shell.output(),
        APPLY_S,
        what="the shell on the new leader",
    )
    await aeventually(lambda: works(new), APPLY_S, what="the new leader's config")
    for key in (revoked, KEYS["acme"]):
        assert await through_shell(fleet, key) == "UNAUTHENTICATED", key
    assert standby.proc.popen.poll() is None
