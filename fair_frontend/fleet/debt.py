"""Failover keeps the debt: the leader's fairness state, followed by its standbys.

The leader publishes what its schedulers owe each tenant (``Carried.export_fairness``: the
DRR deficits and virtual token counters of every endpoint, and the attained service of
its backlogged tenants' programs, ``fair_frontend.scheduler.snapshot``) every
``TICK_S`` to a key beside its lease in Redis; a standby that takes the lease reads it
back before it accepts a shell and resumes from it (``Carried.resume_fairness``). A tenant
that had taken more than its share before the leader died is then served less than its
share after, until even, instead of starting level with the tenant it took from.

Why Redis, and not a follower link to the leader over the core link
(``fair_frontend.wire.remote``):

* the lease is already there: the state is read from the store the standby just took
  the lease from, in the same moment, with no peer to find or connect to (a link to the
  leader dies exactly when its content is needed, and a standby would have to learn
  where the leader listens);
* it is fenced by the lease: the write is one script that sets the state only while the
  lease names the writer, so a leader that has lost its lease (stalled, partitioned)
  cannot overwrite its successor's state, and two states never mix;
* it costs the leader one ``EVAL`` of a few kilobytes per tick (skipped while nothing
  changed, refreshed every ``REFRESH_S``), and a standby nothing until it leads.

What the new leader resumes is at most one tick (plus Redis's round trip) older than the
old leader's last decision: the service of that tick is the only debt a kill can lose.
The key expires ``TTL_S`` after the last write: a fleet that was down for longer starts
even. The same record carries the open sequences of stateful models (``Core.
export_sequences``: each tenant's sequence id, the id Triton holds its state under, and in
a pool the Triton that holds it), so that a sequence goes on across a failover on the same
state; and the Tritons the leader could not reach (``Carried.export_down``): the new leader
starts them down, probed until they answer, instead of granting each work that fails
first. Engine slot holders need no carrying (the shells tell the new leader of the
streams they relay, ``Running``, with what their rate-limit correction needs); rate
limits live in Redis already. With ``--election kubernetes`` no state is carried (the new
leader starts even, as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
from redis.exceptions import RedisError

from fair_frontend.core.sequences import OpenSequence
from fair_frontend.core.service import Core
from fair_frontend.fleet.election import Election, RedisLease
from fair_frontend.scheduler import SchedulerFairness

log = logging.getLogger(__name__)

TICK_S = 0.05  # how often the leader publishes its fairness state (if it changed)
REFRESH_S = 5.0  # published at least this often, changed or not (the key's TTL)
TTL_S = 60.0  # a state not refreshed for this long is gone: a new fleet starts even
# How long after a takeover the carried backlog may join again with the state it had:
# the shells find the new leader within a retry (``shell.remote.RETRY_S``) and send
# what they hold at once; a tenant whose calls come later joins as from idle.
KEEP_S = 5.0


class FairnessState(msgspec.Struct, array_like=True, frozen=True):
    """What the leader ``leader`` owed each tenant, per endpoint, at ``at`` (its wall
    clock, for the logs only)."""

    leader: str
    at: float
    endpoints: dict[str, SchedulerFairness]
    sequences: dict[str, list[OpenSequence]] = {}  # per model (``Carried.export_sequences``)
    down: list[str] = []  # the Tritons it could not reach (``Carried.export_down``)


# Set the state only while the lease (KEYS[1]) names this core (ARGV[1]).
_PUBLISH = "if redis.call('GET', KEYS[1]) == ARGV[1] then "
_PUBLISH += "return redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3]) else return 0 end"

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(FairnessState)


class FairnessJournal:
    """The leader's fairness state in the Redis of its lease (the module's doc)."""

    def __init__(self, lease: RedisLease) -> None:
        self.lease = lease
        self.key = f"{lease.key}:fairness"
        self._last = b""  # the endpoints' state and sequences as last published
        self._published_at = 0.0  # time.monotonic() of the last write
        self.published = 0  # writes made (for tests and logs)

    @classmethod
    def of(cls, election: Election) -> FairnessJournal | None:
        """The journal of ``election``'s Redis; None where the lease is not in Redis."""
        lease = election.in_redis()
        return cls(lease) if lease is not None else None

    async def resume(self, core: Core, keep_s: float = KEEP_S) -> bool:
        """On taking the lease, before any shell connects: resume the last leader's
        state into ``core`` (False: none was there, or Redis failed: start even)."""
        try:
            data = await self.lease.redis.get(self.key)
        except (RedisError, OSError, TimeoutError) as err:
            log.warning("cannot read the last leader's fairness state (%s): starting even", err)
            return False
        if not isinstance(data, bytes) or not data:
            log.info("no fairness state from a previous leader: starting even")
            return False
        try:
            state = _DECODER.decode(data)
        except msgspec.DecodeError as err:
            log.warning("the last leader's fairness state is unreadable (%s): starting even", err)
            return False
        core.carried.resume_fairness(state.endpoints, keep_s)
        core.carried.resume_sequences(state.sequences)
        core.carried.resume_down(state.down)
        log.info(
            "resumed the fairness state of %s, %.2f s old, for %d endpoints",
            state.leader,
            max(0.0, time.time() - state.at),
            len(state.endpoints),
        )
        return True

    async def publish(self, core: Core, *, force: bool = False) -> bool:
        """Publish ``core``'s state now if it changed (or ``force``, or every
        ``REFRESH_S``); False where the lease is not this core's any more."""
        exported, sequences, down = (
            core.carried.export_fairness(),
            core.carried.export_sequences(),
            core.carried.export_down(),
        )
        endpoints = _ENCODER.encode((exported, sequences, down))
        now = time.monotonic()
        if not force and endpoints == self._last and now - self._published_at < REFRESH_S:
            return True
        state = _ENCODER.encode(
            FairnessState(self.lease.identity, time.time(), exported, sequences, down)
        )
        done = await self.lease.redis.eval(
            _PUBLISH, 2, self.lease.key, self.key, self.lease.identity, state, int(TTL_S * 1000)
        )
        if not done:
            return False
        self._last, self._published_at = endpoints, now
        self.published += 1
        return True

    async def follow(self, core: Core, tick_s: float = TICK_S) -> None:
        """While leading: publish every ``tick_s`` (until cancelled)."""
        warned = 0.0
        while True:
            started = time.monotonic()
            try:
                await self.publish(core)
            except (RedisError, OSError, TimeoutError) as err:
                if started - warned > REFRESH_S:  # once in a while, not every tick
                    warned = started
                    log.warning("cannot publish the fairness state: %s", err)
            await asyncio.sleep(max(0.0, tick_s - (time.monotonic() - started)))

    async def last(self, core: Core) -> None:
        """A clean stop, still holding the lease: the state after the drain, for the next."""
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self.publish(core, force=True), self.lease.lease_s / 3)
