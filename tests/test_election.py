"""Leader election (``fair_frontend.fleet.election``) and the shared secret
(``fair_frontend.wire.remote``).

Redis: a real ``redis-server`` of this module's. Kubernetes: no cluster runs here, so the
Lease API is served by ``FakeLeases`` below: the coordination.k8s.io/v1 paths, and the
one behaviour election relies on, an update carrying a stale ``resourceVersion`` refused
with 409, as the API server does. It is a stand-in for the API server, and only that.

Election runs on the loop's real clock, and so does every test here, in orderings: a
leader that renews is waited on for its renewals (counted), not for a time; a standby
leads only once the lease the leader last renewed has expired (its own record of when);
its polls are as far apart as a control task's sleeps of one poll on the same loop (a
loaded machine stretches both alike); a leader cut off from Redis stops leading before a
standby that still reaches Redis leads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import statistics
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from aiohttp import web

from fair_frontend.cli import build_parser
from fair_frontend.fleet.election import STEP_DOWN, KubernetesLease, RedisLease
from fair_frontend.fleet.run import lease_identity
from fair_frontend.kit.testing import aeventually
from fair_frontend.wire.remote import MIN_SECRET_BYTES, SecretError, load_secret, secret_matches
from tests.support import RedisProcess

# Long enough that a leader renewing on a loaded machine is not late for its own lease
# (it renews every LEASE_S / 3 and steps down after STEP_DOWN of it without a renewal).
LEASE_S = 1.2
POLL_S = LEASE_S / 6  # a standby's poll
RENEWALS = 3  # a leader renewing for this many renewals keeps its lease


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisProcess]:
    server = RedisProcess()
    server.start()
    try:
        yield server
    finally:
        server.stop()


_names = itertools.count()


class CountedLease(RedisLease):
    """A ``RedisLease`` that records its attempts to take the lease (when each began) and
    counts its renewals: a spy on the two calls that ask Redis."""

    def __init__(self, url: str, key: str, identity: str, lease_s: float) -> None:
        super().__init__(url, key, identity, lease_s)
        self.takes: list[float] = []
        self.renewals = 0

    async def _try_take(self) -> bool:
        self.takes.append(time.monotonic())
        return await super()._try_take()

    async def _try_renew(self) -> bool:
        held = await super()._try_renew()
        self.renewals += held
        return held


def leases(url: str, n: int = 2) -> list[CountedLease]:
    key = f"lease-{next(_names)}"
    return [CountedLease(url, key, f"core-{i}", LEASE_S) for i in range(n)]


class Ticks:
    """A control on the loop: a task that sleeps ``POLL_S`` again and again, recording
    when each sleep ended (a poll of the same loop, as late as the loop's load makes it)."""

    def __init__(self) -> None:
        self.at: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.at.append(time.monotonic())
            await asyncio.sleep(POLL_S)  # the control's own poll, not waiting for a server

    def __enter__(self) -> Ticks:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


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
    with Ticks() as ticks:
        winner, others = await race(elections)
        standby = next(e for e in elections if e is not winner)
        try:
            assert await standby.leader() == winner.identity
            # Several renewals: the leader renews, the standby keeps asking, and waiting.
            asked = len(standby.takes)
            await aeventually(
                lambda: winner.renewals >= RENEWALS, 10 * LEASE_S, what="the leader's renewals"
            )
            assert len(standby.takes) > asked
            assert not others[0].done() and not winner.lost.is_set()
            # The leader stops renewing (a killed process): the standby leads...
            assert winner._renewer is not None
            winner._renewer.cancel()
            await asyncio.wait_for(others[0], 10 * LEASE_S)  # never leading: a failure
            led = time.monotonic()
            # ...not before the lease the leader last renewed had expired (Redis counts
            # it from after the renewal began, in whole milliseconds)...
            assert led >= winner._renewed_at + LEASE_S - 0.002, led - winner._renewed_at
            assert await standby.leader() == standby.identity
        finally:
            await close(elections, others)
    # ...and at its next poll after: it asked as often as the control polled the loop
    # (each gap a poll, stretched as the control's are by the loop's load). A standby
    # polling once a lease would take over up to a lease late.
    assert statistics.median(gaps(standby.takes)) < 1.5 * statistics.median(gaps(ticks.at)), (
        gaps(standby.takes),
        gaps(ticks.at),
    )


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


async def test_a_leader_that_cannot_reach_redis_steps_down(tmp_path: Path) -> None:
    server = RedisProcess()
    server.start()
    election = RedisLease(server.url, "lease", "core-0", LEASE_S)
    try:
        await election.acquire()
        server.stop()  # Redis gone: no renewal can succeed
        # It stops leading (a leader that went on would be a failure here, a lease after
        # its last renewal; whether before a standby could lead: the next test).
        await asyncio.wait_for(election.lost.wait(), 10 * LEASE_S)
    finally:
        await election.release()
        await election.close()
        server.stop()


class SlowOnce(CountedLease):
    """A ``CountedLease`` whose first renewal answers a tenth of a second after the
    renewal interval (a third of the lease), well before the leader's step-down."""

    def __init__(self, url: str, key: str, identity: str, lease_s: float) -> None:
        super().__init__(url, key, identity, lease_s)
        self.slow_ended = 0.0

    async def _try_renew(self) -> bool:
        if not self.slow_ended:
            await asyncio.sleep(self.lease_s / 3 + 0.1)
            self.slow_ended = time.monotonic()
        return await super()._try_renew()


async def test_a_renewal_slower_than_its_interval_keeps_the_lead(
    redis_server: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """A loaded machine answers late: the leader keeps leading as long as a renewal
    comes before its step-down. (Before, an attempt was cut at the interval and the next
    came an interval later, past the step-down: one slow answer ended the lead.)"""
    lease_s = 5.0  # the step-down 0.32 s after the slow renewal's answer
    leader = SlowOnce(redis_server.url, f"lease-{next(_names)}", "core-0", lease_s)
    await leader.acquire()
    try:
        await aeventually(
            lambda: leader.renewals >= 2 or leader.lost.is_set(), 10 * lease_s, what="renewals"
        )
        assert leader.slow_ended and not leader.lost.is_set()
        assert "the lease's renewal took" in caplog.text  # an operator sees the lead at risk
    finally:
        await leader.release()
        await leader.close()


class Partition:
    """A relay between a client and Redis that the test cuts: from then on it passes
    nothing either way and keeps every connection open, as a network partition does (the
    client's calls wait out their timeouts), while Redis, and whoever reaches it
    directly, go on."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.cut = False
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if not self.cut:
                    writer.write(data)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += [writer, up_writer]
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        for writer in self._writers:
            writer.close()
        self._server.close()
        await self._server.wait_closed()


async def test_a_partitioned_leader_stops_leading_before_a_standby_leads(
    redis_server: RedisProcess,
) -> None:
    """The module's promise ("two leaders never serve at once"): a leader cut off from
    Redis (its calls hang) while a standby still reaches it stops leading before the
    standby leads: an ordering of the two, whatever the machine's speed."""
    key = f"lease-{next(_names)}"
    partition = Partition(redis_server.port)
    async with partition as through:
        leader = CountedLease(through, key, "core-0", LEASE_S)
        standby = CountedLease(redis_server.url, key, "core-1", LEASE_S)
        await leader.acquire()
        taking = asyncio.ensure_future(standby.acquire())
        lost = asyncio.ensure_future(leader.lost.wait())
        try:
            await aeventually(lambda: leader.renewals >= 1, 10 * LEASE_S, what="a renewal")
            partition.cut = True
            done, _ = await asyncio.wait(
                [taking, lost], timeout=10 * LEASE_S, return_when=asyncio.FIRST_COMPLETED
            )
            assert done == {lost}, "the standby led while the leader still led"
            await asyncio.wait_for(taking, 10 * LEASE_S)  # and then the standby leads
        finally:
            for task in (taking, lost):
                task.cancel()
            for election in (leader, standby):
                await election.release()
                await election.close()


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
        self.renewals: collections.Counter[str] = collections.Counter()  # by holder

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
        holder = body["spec"].get("holderIdentity")
        if holder and holder == held["spec"].get("holderIdentity"):
            self.renewals[holder] += 1
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
    server = cast(asyncio.Server, site._server)  # loop.create_server's, for a TCPSite
    port = server.sockets[0].getsockname()[1]
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
        # The leader renews (RENEWALS times, as the API server saw): nobody else takes it.
        await aeventually(
            lambda: fake.renewals[winner.identity] >= RENEWALS, 10, what="the renewals"
        )
        assert not any(t.done() for t in others)
        renewed = fake.leases["fair-frontend-core"]["spec"]["renewTime"]
        assert renewed != lease["spec"]["acquireTime"]
        assert winner._renewer is not None
        winner._renewer.cancel()  # the leader dies
        # A 1 s lease: a standby that never led would be a failure here.
        done, _ = await asyncio.wait(others, timeout=10, return_when=asyncio.FIRST_COMPLETED)
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


# ---- the identity: one per process ------------------------------------------------------


def default_identities(n: int = 2, *extra: str) -> list[str]:
    """The lease identities ``fair-frontend core`` takes for ``n`` cores started with the
    same flags: the same --listen (two hosts each on 127.0.0.1:P, or containers of one
    host name), no --identity."""
    args = ["core", "--config", "c.yaml", "--listen", "127.0.0.1:8010", "--election", "redis"]
    return [lease_identity(build_parser().parse_args([*args, *extra])) for _ in range(n)]


def test_cores_of_one_address_get_identities_of_their_own_unless_told() -> None:
    first, second = default_identities()
    assert first != second
    assert first.startswith("127.0.0.1:8010@")  # still says where the shells reach it
    assert default_identities(2, "--identity", "core-a") == ["core-a", "core-a"]


async def test_two_cores_of_one_address_on_a_kubernetes_lease_one_leads(
    api: tuple[str, FakeLeases],
) -> None:
    """A Lease is taken again by whoever carries the name it holds: two cores of one
    default name would both lead. With one identity each, the second waits while the
    first renews."""
    url, fake = api
    elections = [kube(url, identity) for identity in default_identities()]
    winner, others = await race(elections)
    try:
        await aeventually(
            lambda: fake.renewals[winner.identity] >= RENEWALS, 10, what="the renewals"
        )
        assert not others[0].done(), "both cores lead"
        assert fake.leases["fair-frontend-core"]["spec"]["holderIdentity"] == winner.identity
    finally:
        await close(elections, others)


async def test_a_stalled_leader_cannot_renew_the_lease_a_core_of_its_address_took(
    redis_server: RedisProcess,
) -> None:
    """Redis renews only for the name the key holds: a leader whose renewal comes late
    (stalled, its call delayed) must find the lease another core took in the meantime
    not its own, and step down, even when both listen on the same address."""
    key = f"lease-{next(_names)}"
    leader, standby = (
        RedisLease(redis_server.url, key, identity, LEASE_S) for identity in default_identities()
    )
    try:
        await leader.acquire()
        assert leader._renewer is not None
        leader._renewer.cancel()  # stalled: no renewal from here on
        await asyncio.wait_for(standby.acquire(), 10 * LEASE_S)
        assert not await leader._try_renew(), "the stalled leader renewed the other's lease"
        assert await standby.leader() == standby.identity
    finally:
        for election in (leader, standby):
            await election.release()
            await election.close()


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
