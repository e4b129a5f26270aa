"""The fairness journal (``fair_frontend.fleet.debt``) on a real Redis: the leader's state
beside its lease, written only while the lease is the writer's, read back by the core
that takes the lease over."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import cast

import pytest

from fair_frontend.core.sequences import OpenSequence
from fair_frontend.core.service import Core
from fair_frontend.fleet.debt import FairnessJournal
from fair_frontend.fleet.election import RedisLease
from fair_frontend.scheduler import SchedulerFairness, TierFairness
from tests.support import RedisProcess

LEASE_S = 5.0  # never expires in these tests: who holds it is set by hand

_names = itertools.count()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisProcess]:
    server = RedisProcess()
    server.start()
    try:
        yield server
    finally:
        server.stop()


class FakeCore:
    """What the journal reads and writes of a ``Core``: its fairness state and its open
    sequences."""

    def __init__(
        self,
        counters: dict[str, float] | None = None,
        sequences: dict[str, list[OpenSequence]] | None = None,
    ) -> None:
        tier = TierFairness(counters or {}, dict.fromkeys(counters or {}, 1.0), 0.0, [])
        self.state = {"llm": SchedulerFairness({"paid": tier})}
        self.sequences = sequences or {}
        self.resumed: dict[str, SchedulerFairness] | None = None
        self.resumed_sequences: dict[str, list[OpenSequence]] | None = None
        self.down: list[str] = []
        self.resumed_down: list[str] | None = None
        self.carried = self  # the fake plays the core's failover state (``Core.carried``) too

    def export_fairness(self) -> dict[str, SchedulerFairness]:
        return self.state

    def resume_fairness(self, saved: dict[str, SchedulerFairness], keep_s: float) -> None:
        self.resumed = saved

    def export_sequences(self) -> dict[str, list[OpenSequence]]:
        return self.sequences

    def resume_sequences(self, saved: dict[str, list[OpenSequence]]) -> None:
        self.resumed_sequences = saved

    def export_down(self) -> list[str]:
        return self.down

    def resume_down(self, down: list[str]) -> None:
        self.resumed_down = down


async def test_a_standby_resumes_what_the_leader_published_and_a_deposed_one_cannot_overwrite(
    redis_server: RedisProcess,
) -> None:
    key = f"journal-{next(_names)}"
    old, new = (RedisLease(redis_server.url, key, name, LEASE_S) for name in ("old", "new"))
    try:
        assert await old._try_take()
        open_sequences = {
            "sequence_sum": [OpenSequence("acme", 7, 7), OpenSequence("globex", 7, 99, 1)]
        }
        leader = FakeCore({"acme": 900.0, "globex": 100.0}, open_sequences)
        leader.down = ["127.0.0.1:8003"]
        journal = FairnessJournal(old)
        assert await journal.publish(cast(Core, leader))
        # The old leader is deposed (its lease gone, another's now) ...
        await old.redis.delete(key)
        assert await new._try_take()
        # ... and whatever it still tries to publish is refused: the state stays its last.
        leader.state = FakeCore({"acme": 0.0, "globex": 0.0}).state
        assert not await journal.publish(cast(Core, leader), force=True)
        standby = FakeCore()
        assert await FairnessJournal(new).resume(cast(Core, standby))
        assert standby.resumed == FakeCore({"acme": 900.0, "globex": 100.0}).state
        assert standby.resumed_sequences == open_sequences  # ids of both types, and the pin
        assert standby.resumed_down == ["127.0.0.1:8003"]
    finally:
        for lease in (old, new):
            await lease.close()


async def test_nothing_published_starts_even(redis_server: RedisProcess) -> None:
    lease = RedisLease(redis_server.url, f"journal-{next(_names)}", "core", LEASE_S)
    try:
        core = FakeCore()
        assert not await FairnessJournal(lease).resume(cast(Core, core))
        assert core.resumed is None
    finally:
        await lease.close()
