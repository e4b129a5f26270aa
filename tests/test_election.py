"""Leader election (``fair_frontend.fleet.election``) and the shared secret
(``fair_frontend.wire.remote``).

Redis: a real ``redis-server`` of this module's. Kubernetes: no cluster runs here, so the
Lease API is served by ``FakeLeases`` below: the coordination.k8s.io/v1 paths, and the
one behaviour election relies on, an update carrying a stale ``resourceVersion`` refused
with 409, as the API server does. It is a stand-in for the API server, and only that.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from fair_frontend.fleet.election import STEP_DOWN, KubernetesLease, RedisLease
from fair_frontend.wire.remote import MIN_SECRET_BYTES, SecretError, load_secret, secret_matches
from tests.support import RedisProcess

LEASE_S = 0.6


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisProcess]:
    server = RedisProcess()
    server.start()
    try:
        yield server
    finally:
        server.stop()


_names = itertools.count()


def leases(url: str, n: int = 2) -> list[RedisLease]:
    key = f"lease-{next(_names)}"
    return [RedisLease(url, key, f"core-{i}", LEASE_S) for i in range(n)]


async def race(elections: list[Any]) -> tuple[Any, list[asyncio.Future[None]]]:
    """Every election tries at once: the first to lead, and the others' attempts."""
    tries = [asyncio.ensure_future(e.acquire()) for e in elections]
    done, _ = await asyncio.wait(tries, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1
    winner = elections[tries.index(done.pop())]
    return winner, [t for t, e in zip(tries, elections, strict=True) if e is not winner]


async def close(elections: list[Any], tries: list[asyncio.Future[None]]) -> None:
    for t in tries:
        t.cancel()
    for e in elections:
        await e.release()
        await e.close()


async def test_one_core_leads_and_the_standby_takes_over_once_its_renewals_stop(
    redis_server: RedisProcess,
) -> None:
    elections = leases(redis_server.url)
    winner, others = await race(elections)
    standby = next(e for e in elections if e is not winner)
    try:
        assert await standby.leader() == winner.identity
        # Several leases long: the leader renews, the standby keeps waiting.
        await asyncio.sleep(3 * LEASE_S)
        assert not others[0].done() and not winner.lost.is_set()
        # The leader stops renewing (a killed process): the standby leads within a lease
        # and its poll.
        assert winner._renewer is not None
        winner._renewer.cancel()
        stopped = time.monotonic()
        await asyncio.wait_for(others[0], 5)
        took = time.monotonic() - stopped
        assert took <= LEASE_S + LEASE_S / 6 + 0.3, took
        assert await standby.leader() == standby.identity
    finally:
        await close(elections, others)


async def test_a_clean_stop_hands_over_at_the_next_poll_not_after_the_lease(
    redis_server: RedisProcess,
) -> None:
    key = f"lease-{next(_names)}"
    elections = [RedisLease(redis_server.url, key, f"core-{i}", 30.0) for i in (0, 1)]
    winner, others = await race(elections)
    try:
        await winner.release()
        await asyncio.wait_for(others[0], 30.0 / 6 + 2)  # a 30 s lease: the poll, not it
    finally:
        await close(elections, others)


async def test_a_leader_that_cannot_reach_redis_steps_down_before_its_lease_ends(
    tmp_path: Path,
) -> None:
    server = RedisProcess()
    server.start()
    election = RedisLease(server.url, "lease", "core-0", LEASE_S)
    try:
        await election.acquire()
        server.stop()  # Redis gone: no renewal can succeed
        gone = time.monotonic()
        await asyncio.wait_for(election.lost.wait(), 5)
        # It stopped leading before the key could have expired for a standby.
        assert time.monotonic() - gone <= LEASE_S, time.monotonic() - gone
    finally:
        await election.release()
        await election.close()
        server.stop()


async def test_a_leader_whose_key_another_took_steps_down(redis_server: RedisProcess) -> None:
    (election,) = leases(redis_server.url, 1)
    await election.acquire()
    try:
        client = redis_server.client()
        client.set(election.key, "someone-else")
        client.close()
        await asyncio.wait_for(election.lost.wait(), 5)
        assert STEP_DOWN < 1
    finally:
        await election.release()
        await election.close()
    client = redis_server.client()
    assert client.get(election.key) == b"someone-else"  # release freed only its own
    client.close()


# ---- Kubernetes: a Lease through the API server's REST paths ----------------------------


class FakeLeases:
    """The coordination.k8s.io/v1 Lease paths of one namespace (see the module's doc)."""

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.versions = itertools.count(1)
        self.conflicts = 0
        self.tokens: list[str] = []

    def app(self) -> web.Application:
        base = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
        app = web.Application()
        app.router.add_get(base + "/{name}", self.get)
        app.router.add_post(base, self.create)
        app.router.add_put(base + "/{name}", self.update)
        return app

    async def get(self, request: web.Request) -> web.Response:
        self.tokens.append(request.headers.get("Authorization", ""))
        lease = self.leases.get(request.match_info["name"])
        if lease is None:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        return web.json_response(lease)

    async def create(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body["metadata"]["name"]
        if name in self.leases:
            return web.json_response({"kind": "Status", "code": 409}, status=409)
        body["metadata"]["resourceVersion"] = str(next(self.versions))
        self.leases[name] = body
        return web.json_response(body, status=201)

    async def update(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = request.match_info["name"]
        held = self.leases.get(name)
        if held is None:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        if body["metadata"].get("resourceVersion") != held["metadata"]["resourceVersion"]:
            self.conflicts += 1
            return web.json_response({"kind": "Status", "code": 409}, status=409)
        body["metadata"]["resourceVersion"] = str(next(self.versions))
        self.leases[name] = body
        return web.json_response(body)


@pytest.fixture
async def api() -> AsyncIterator[tuple[str, FakeLeases]]:
    fake = FakeLeases()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", fake
    finally:
        await runner.cleanup()


def kube(url: str, identity: str, lease_s: float = 1.0) -> KubernetesLease:
    return KubernetesLease(
        "fair-frontend-core", identity, lease_s, namespace="fleet", api=url, token="t0ken"
    )


async def test_a_kubernetes_lease_elects_one_and_fails_over(
    api: tuple[str, FakeLeases],
) -> None:
    url, fake = api
    elections = [kube(url, f"pod-{i}") for i in range(3)]
    winner, others = await race(elections)
    try:
        lease = fake.leases["fair-frontend-core"]
        assert lease["spec"]["holderIdentity"] == winner.identity
        assert all(t == "Bearer t0ken" for t in fake.tokens)
        await asyncio.sleep(2.5)  # the leader renews: nobody else takes it
        assert not any(t.done() for t in others)
        renewed = fake.leases["fair-frontend-core"]["spec"]["renewTime"]
        assert renewed != lease["spec"]["acquireTime"]
        assert winner._renewer is not None
        winner._renewer.cancel()  # the leader dies
        done, _ = await asyncio.wait(others, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        spec = fake.leases["fair-frontend-core"]["spec"]
        assert spec["holderIdentity"] != winner.identity
        assert spec["leaseTransitions"] == 1
    finally:
        await close(elections, others)


async def test_a_kubernetes_lease_written_over_by_another_is_not_taken(
    api: tuple[str, FakeLeases],
) -> None:
    """Two standbys seeing the same expired Lease both write; the API server keeps the
    first and refuses the second (409): one leader."""
    url, fake = api
    fake.leases["fair-frontend-core"] = {
        "metadata": {"name": "fair-frontend-core", "resourceVersion": "0"},
        "spec": {"holderIdentity": "gone", "leaseDurationSeconds": 1,
                 "renewTime": "2020-01-01T00:00:00.000000Z"},
    }  # fmt: skip
    a, b = kube(url, "a"), kube(url, "b")
    try:
        lease = await a._get()
        assert await a._write(lease, a._spec(None, 1))
        assert not await b._write(lease, b._spec(None, 1))  # the same version read
        assert fake.conflicts == 1
        assert await b.leader() == "a"
    finally:
        await a.close()
        await b.close()


# ---- the shared secret ------------------------------------------------------------------


def test_the_secret_comes_from_its_file_or_variable_and_must_be_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "secret"
    path.write_text("x" * MIN_SECRET_BYTES + "\n")
    assert load_secret(str(path), "UNSET_VARIABLE") == b"x" * MIN_SECRET_BYTES
    monkeypatch.setenv("FLEET_SECRET", " " + "y" * 40 + " ")
    assert load_secret(None, "FLEET_SECRET") == b"y" * 40
    path.write_text("short")
    with pytest.raises(SecretError, match="at least 16"):
        load_secret(str(path), "FLEET_SECRET")
    with pytest.raises(SecretError, match="cannot read"):
        load_secret(str(tmp_path / "missing"), "FLEET_SECRET")
    monkeypatch.delenv("FLEET_SECRET")
    with pytest.raises(SecretError, match="--secret-file"):
        load_secret(None, "FLEET_SECRET")


def test_only_the_secret_itself_matches() -> None:
    secret = b"s" * 32
    assert secret_matches("s" * 32, secret)
    assert secret_matches(secret, secret)
    for wrong in (None, "", "s" * 31, "s" * 33, "S" * 32, "s" * 31 + "t"):
        assert not secret_matches(wrong, secret)
