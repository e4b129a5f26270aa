"""Which core leads: a lease on a coordination service the deployment already has.

One core leads (schedules, dispatches, accepts shells); the others wait, warm, to take
over. Leadership is a lease of ``lease_s``: the leader renews it every ``lease_s / 3``; a
standby polls every ``lease_s / POLLS`` and takes it once it has expired,
so a leader that dies is replaced within ``lease_s + lease_s / POLLS`` (then the shells
reconnect): 0.9 s with the default lease of the Redis election (``DEFAULT_LEASE_S``,
0.8 s). A standby's poll is one Redis ``SET NX``: polling often costs little and only
shortens the takeover; the lease's length is what bounds it.

Two leaders never serve at once: a leader that has not renewed for ``STEP_DOWN`` of
``lease_s`` (its coordination service unreachable, its process stalled) steps down
(``lost`` is set and ``fair-frontend core`` exits), before the lease can have expired for
the others. A leader that stops cleanly releases the lease, so a standby takes over at
its next poll rather than after the lease.

* ``RedisLease``: a key set with NX and a TTL, renewed and released by scripts that act
  only while the key still names this core (the Redis of ``rate_limiting.storage``).
* ``KubernetesLease``: a ``coordination.k8s.io/v1`` Lease in the pod's namespace, taken and
  renewed by updates carrying the ``resourceVersion`` read (the API server refuses one
  written over by another core: 409), as client-go's leaderelection does.
* ``NoElection``: a single core, leading from the start (``--election none``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import ssl
import time
from typing import Any, Protocol

import aiohttp
import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

STEP_DOWN = 0.75  # of lease_s without a renewal, after which a leader stops leading
RETRY = 0.1  # of the renewal interval: the wait before a failed renewal is tried again
POLLS = 8  # polls of a standby per lease


class Election(Protocol):
    identity: str
    lost: asyncio.Event  # set when this core stops leading (never set before it leads)

    async def acquire(self) -> None:
        """Return once this core leads; keep the lease renewed from then on."""

    async def leader(self) -> str | None:
        """Who leads now, as the lease says (None: nobody)."""

    async def release(self) -> None:
        """Stop leading (a clean stop): the lease is freed for a standby at once."""

    def in_redis(self) -> RedisLease | None:
        """The lease, where it is kept in Redis (the fairness journal is kept beside it:
        ``fleet.debt``); None where it is not."""


class NoElection:
    def __init__(self, identity: str) -> None:
        self.identity = identity
        self.lost = asyncio.Event()

    async def acquire(self) -> None:
        return

    async def leader(self) -> str | None:
        return self.identity

    async def release(self) -> None:
        return

    def in_redis(self) -> RedisLease | None:
        return None


class _Lease:
    """The renewal loop and step-down rule both backends share."""

    def __init__(self, identity: str, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError(f"the lease must be positive, not {lease_s}")
        self.identity = identity
        self.lease_s = lease_s
        self.lost = asyncio.Event()
        self._renewer: asyncio.Task[None] | None = None
        self._renewed_at = 0.0  # time.monotonic() of the last renewal (or the take)
        self._announced: str | None = None

    async def _try_take(self) -> bool:
        raise NotImplementedError

    async def _try_renew(self) -> bool:
        raise NotImplementedError

    async def _free(self) -> None:
        raise NotImplementedError

    async def leader(self) -> str | None:
        raise NotImplementedError

    def in_redis(self) -> RedisLease | None:
        return None

    async def acquire(self) -> None:
        poll = self.lease_s / POLLS
        while True:
            started = time.monotonic()
            try:
                if await self._try_take():
                    break
                holder = await self.leader()
                if holder != self._announced:
                    self._announced = holder
                    log.info("standby: %s leads", holder or "nobody")
            except (RedisError, OSError, aiohttp.ClientError, TimeoutError) as err:
                log.warning("standby: cannot reach the lease (%s); retrying", err)
            await asyncio.sleep(max(0.0, poll - (time.monotonic() - started)))
        self._renewed_at = started
        log.info("leading (%s), lease %.1f s", self.identity, self.lease_s)
        self._renewer = asyncio.get_running_loop().create_task(self._renew())

    async def _renew(self) -> None:
        """Lead until a renewal finds the key another core's, or until STEP_DOWN of the
        lease has passed since the last renewal. The clock is watched on its own, not
        between attempts: an attempt that hangs (a partition) cannot delay the step-down
        past the key's expiry, when a standby may take it."""
        attempts = asyncio.get_running_loop().create_task(self._attempts(self.lease_s / 3))
        try:
            while not attempts.done():
                since = time.monotonic() - self._renewed_at
                if since >= STEP_DOWN * self.lease_s:
                    log.error(
                        "no renewal for %.1f s of a %.1f s lease: stepping down",
                        since,
                        self.lease_s,
                    )
                    break
                await asyncio.wait({attempts}, timeout=STEP_DOWN * self.lease_s - since)
            else:
                if not attempts.cancelled() and (err := attempts.exception()) is not None:
                    log.error("the lease's renewals failed: stepping down", exc_info=err)
        finally:
            attempts.cancel()
        self.lost.set()

    async def _attempts(self, interval: float) -> None:
        """Renew every ``interval``; return once the key is another core's.

        An attempt may take until the step-down (``_renew`` watches that clock on its
        own), and one that failed is tried again at once: a slow answer on a loaded
        machine, or one lost connection, does not end the lead while time is left. (With
        each attempt cut at ``interval`` and the next an interval later, one renewal
        slower than a third of the lease made the leader step down.)"""
        wait = interval
        while True:
            await asyncio.sleep(wait)
            started = time.monotonic()
            left = self._renewed_at + STEP_DOWN * self.lease_s - started
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel
                # that comes as the renewal completes, and a leader cancelled (stopping)
                # then went on renewing for ever (seen: a standby never took its lease).
                async with asyncio.timeout(max(interval, left)):
                    held = await self._try_renew()
            except (RedisError, OSError, aiohttp.ClientError, TimeoutError) as err:
                log.warning("cannot renew the lease: %s", err)
                wait = interval * RETRY
                continue
            if held:
                self._renewed_at = started
                took = time.monotonic() - started
                if took > interval:  # what a leader stepping down later is traced to
                    log.warning(
                        "the lease's renewal took %.2f s (one every %.2f s; stepping down "
                        "after %.2f s without one)",
                        took,
                        interval,
                        STEP_DOWN * self.lease_s,
                    )
                wait = max(0.0, interval - took)
            else:
                log.error("the lease is another core's now: stepping down")
                return

    async def release(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
        if self.lost.is_set():
            return
        self.lost.set()
        with contextlib.suppress(RedisError, OSError, aiohttp.ClientError, TimeoutError):
            await asyncio.wait_for(self._free(), self.lease_s / 3)


# Renew or free only while the key still names this core.
_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then "
_RENEW += "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end"
_FREE = "if redis.call('GET', KEYS[1]) == ARGV[1] then "
_FREE += "return redis.call('DEL', KEYS[1]) else return 0 end"


class RedisLease(_Lease):
    def __init__(self, url: str, key: str, identity: str, lease_s: float) -> None:
        super().__init__(identity, lease_s)
        self.key = key
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=lease_s / 3, socket_connect_timeout=lease_s / 3
        )
        self._ms = max(1, int(lease_s * 1000))

    @property
    def redis(self) -> aioredis.Redis:
        """The lease's Redis client (the fairness journal writes beside the lease)."""
        return self._redis

    def in_redis(self) -> RedisLease:
        return self

    async def _try_take(self) -> bool:
        return bool(await self._redis.set(self.key, self.identity, nx=True, px=self._ms))

    async def _try_renew(self) -> bool:
        return bool(await self._redis.eval(_RENEW, 1, self.key, self.identity, self._ms))

    async def _free(self) -> None:
        await self._redis.eval(_FREE, 1, self.key, self.identity)

    async def leader(self) -> str | None:
        value = await self._redis.get(self.key)
        return value.decode() if isinstance(value, bytes) else value

    async def close(self) -> None:
        await self._redis.aclose()


SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


class KubernetesLease(_Lease):
    """A ``coordination.k8s.io/v1`` Lease, through the API server's REST interface with
    the pod's service account (``SERVICE_ACCOUNT``), or ``api``/``token`` where given."""

    def __init__(
        self,
        name: str,
        identity: str,
        lease_s: float,
        *,
        namespace: str | None = None,
        api: str | None = None,
        token: str | None = None,
        ca_file: str | None = None,
    ) -> None:
        super().__init__(identity, lease_s)
        self.name = name
        if namespace is None:
            namespace = os.environ.get("POD_NAMESPACE") or _read(f"{SERVICE_ACCOUNT}/namespace")
        if api is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise RuntimeError(
                    "--election kubernetes outside a pod: KUBERNETES_SERVICE_HOST is not set"
                )
            api = f"https://{host}:{port}"
            token = token or _read(f"{SERVICE_ACCOUNT}/token")
            ca_file = ca_file or f"{SERVICE_ACCOUNT}/ca.crt"
        self.namespace = namespace
        self._url = f"{api}/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._ssl: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=ca_file) if ca_file else True
        )
        self._session: aiohttp.ClientSession | None = None
        self._version = ""  # the resourceVersion this core last wrote or read

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.lease_s / 3)
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=timeout)
        return self._session

    async def _get(self) -> dict[str, Any] | None:
        async with self._http().get(f"{self._url}/{self.name}", ssl=self._ssl) as resp:
            if resp.status == 404:
                return None
            resp.raise_for_status()
            lease: dict[str, Any] = await resp.json()
            return lease

    def _spec(self, acquired: str | None, transitions: int) -> dict[str, Any]:
        now = _micro_time()
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_s)),
            "acquireTime": acquired or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    async def _write(self, lease: dict[str, Any] | None, spec: dict[str, Any]) -> bool:
        """Create the Lease, or update the one read (409: another core wrote it first)."""
        body: dict[str, Any] = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": spec,
        }
        if lease is None:
            request = self._http().post(self._url, json=body, ssl=self._ssl)
        else:
            body["metadata"]["resourceVersion"] = lease["metadata"]["resourceVersion"]
            request = self._http().put(f"{self._url}/{self.name}", json=body, ssl=self._ssl)
        async with request as resp:
            if resp.status == 409:
                return False
            resp.raise_for_status()
            self._version = (await resp.json())["metadata"]["resourceVersion"]
            return True

    async def _try_take(self) -> bool:
        lease = await self._get()
        if lease is None:
            return await self._write(None, self._spec(None, 0))
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        if holder and holder != self.identity and not _expired(spec):
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (holder != self.identity)
        return await self._write(lease, self._spec(None, transitions))

    async def _try_renew(self) -> bool:
        lease = await self._get()
        if lease is None:
            return False
        spec = lease.get("spec") or {}
        if spec.get("holderIdentity") != self.identity:
            return False
        return await self._write(
            lease, self._spec(spec.get("acquireTime"), int(spec.get("leaseTransitions") or 0))
        )

    async def _free(self) -> None:
        lease = await self._get()
        if lease is not None and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
            spec = dict(lease["spec"])
            spec["holderIdentity"] = None
            spec["leaseDurationSeconds"] = 1
            await self._write(lease, spec)

    async def leader(self) -> str | None:
        lease = await self._get()
        spec = (lease or {}).get("spec") or {}
        holder = spec.get("holderIdentity")
        return holder if holder and not _expired(spec) else None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _micro_time(at: float | None = None) -> str:
    """Kubernetes' MicroTime: RFC 3339 in UTC with microseconds."""
    when = dt.datetime.fromtimestamp(time.time() if at is None else at, dt.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _expired(spec: dict[str, Any]) -> bool:
    renewed = spec.get("renewTime") or spec.get("acquireTime")
    if not renewed:
        return True
    text = str(renewed).replace("Z", "+00:00")
    at = dt.datetime.fromisoformat(text).timestamp()
    return time.time() > at + float(spec.get("leaseDurationSeconds") or 0)
