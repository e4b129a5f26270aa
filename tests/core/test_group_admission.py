"""A call of several parts (``records.Group``: an embeddings' inputs, a rerank's
documents) admitted or refused whole by a real ``Core`` on fake clocks, and the precharge
(``records.Precharge``) that pays for a request's tokenising before it happens.

The core serves ``embed`` through a ``FakeTriton`` whose every batch waits for the test to
answer it; the rate limits count in memory (``MemoryStorage``), or in a storage that must
be awaited as Redis is (``AwaitedStorage``: the admission that waits for it), and the
test reads their windows. Each group's parts go to one ``Shell`` (the route), which keeps
every answer: a part is answered exactly once whatever became of its call.

The negative controls submit the same parts one by one (``Core.submit``), as the API
routes did before: a part that fits is queued, counted and sent before a later one is
refused, which is what admitting the call whole prevents.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pytest
from dispatch_support import SETTLE_ROUNDS, WIDTH, FakeTriton, Shell, StepClock, embed_info

from fair_frontend.admission import RateLimiter, RateLimitItem
from fair_frontend.admission.storage import Checked, MemoryStorage
from fair_frontend.backends.protocol import BackendServer
from fair_frontend.config import Config, parse_config
from fair_frontend.core.dispatch import PARTS_PER_SLICE
from fair_frontend.core.service import Core
from fair_frontend.errors import QueueFull, RateLimited, Unavailable
from fair_frontend.observability.observe import Observer
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.usage import Usage
from fair_frontend.wire.records import Answer, Call, Group

EMBED = "embed"
EPOCH = 1.7e9  # the fake wall clock: the fake monotonic time, shifted by this
TOKENS_PER_MINUTE = 60  # tenant a's on embed: 20 parts of WIDTH (3) tokens
REQUESTS_PER_MINUTE = 3  # tenant a's on embed: calls, whatever their parts
MAX_QUEUED = 6  # tenant b's queue on embed (no rate limits)
GLOBAL_MAX_QUEUED = 1000  # every tenant's, over every model (c: no caps of its own)


def core_config() -> Config:
    return parse_config(
        {
            "tiers": ["paid"],
            "tier_models": {"paid": ["*"]},
            "tenants": {
                "a": {
                    "tier": "paid",
                    "api_keys": ["a-test-key"],
                    "limits": {
                        EMBED: {
                            "tokens_per_minute": TOKENS_PER_MINUTE,
                            "requests_per_minute": REQUESTS_PER_MINUTE,
                        }
                    },
                },
                "b": {"tier": "paid", "api_keys": ["b-test-key"], "max_queued": MAX_QUEUED},
                "c": {"tier": "paid", "api_keys": ["c-test-key"]},
            },
            "queues": {"max_queued": GLOBAL_MAX_QUEUED},
            "default_endpoint": {"throttle": False},
            "endpoints": {EMBED: {"throttle": False, "cost": "tokens"}},
        }
    )


class Triton(FakeTriton):
    async def server_ready(self) -> bool:
        return True


class AwaitedStorage:
    """``MemoryStorage``'s counting, answered only after a loop iteration, as Redis's is:
    no ``acquire_now`` / ``adjust_now``, so the core's admission waits for the storage
    (``Core._admit_group_later``)."""

    def __init__(self, memory: MemoryStorage) -> None:
        self.memory = memory

    async def acquire(
        self, key: str, items: Sequence[RateLimitItem], costs: Sequence[int], now_us: int
    ) -> Checked:
        await asyncio.sleep(0)
        return self.memory.acquire_now(key, items, costs, now_us)

    async def adjust(self, *args: Any) -> None:
        await asyncio.sleep(0)
        self.memory.adjust_now(*args)

    async def close(self) -> None:
        pass


class Recorder(Observer):
    """(request id, outcome) of every request the core recorded, in order."""

    def __init__(self) -> None:
        self.finished: list[tuple[str, Outcome]] = []

    def request_finished(
        self,
        *,
        tenant: str | None,
        model: str,
        outcome: Outcome,
        queued_s: float | None,
        request_id: str = "",
        latency_s: float | None = None,
        error: str | None = None,
        usage: Usage | None = None,
        service_s: float | None = None,
    ) -> None:
        self.finished.append((request_id, outcome))


class Rig:
    """A ``Core`` on fake clocks with ``embed``'s runtime ready, one shell (route)."""

    def __init__(self, *, awaited: bool = False) -> None:
        self.clock = StepClock()
        self.triton = Triton(self.clock)
        self.memory = MemoryStorage()
        storage = AwaitedStorage(self.memory) if awaited else self.memory
        recorder = Recorder()
        self.finished = recorder.finished
        self.core = Core(
            core_config(),
            cast(BackendServer, self.triton),
            observers=[recorder],
            limiter=RateLimiter(storage),
            clock=self.clock,
            wall=lambda: EPOCH + self.clock.now(),
        )
        self.core._runtime(EMBED, embed_info())
        self.shell = Shell()
        self._ids = itertools.count(1)

    def call(self, tenant: str, *, requests: int = 1, first: int = 0) -> Call:
        """One part: a row of ``WIDTH`` tokens (``first``: its first token id, which the
        fake Triton answers with)."""
        n = next(self._ids)
        data = np.full((1, WIDTH), first or n, dtype=np.int32)
        request = InferRequest(
            model=EMBED,
            id=f"{tenant}:{n}",
            inputs=[Tensor("INPUT_IDS", "INT32", (1, WIDTH), data)],
            priority=1,
        )
        return Call(
            id=n,
            tenant=tenant,
            priority=1,
            arrived=self.clock.now(),
            arrived_wall=EPOCH + self.clock.now(),
            rows=1,
            tokens=WIDTH,
            nbytes=request.nbytes,
            lengths=[WIDTH],
            request=request,
            requests=requests,
        )

    def group(self, tenant: str, parts: int) -> list[Call]:
        """The parts of one call: the first counts the call's request, the others none."""
        return [self.call(tenant, requests=0 if i else 1) for i in range(parts)]

    def answers(self, calls: Sequence[Call]) -> list[list[Answer]]:
        """Each call's answers, in the calls' order."""
        return [[a for a in self.shell.answers if a.id == c.id] for c in calls]

    def counted(self, tenant: str, unit: str) -> int:
        """What ``tenant``'s per-minute ``unit`` window on embed counts now."""
        window = self.memory._windows.get((f"{tenant}:{EMBED}", unit, 60.0))
        if window is None:
            return 0
        window.prune(round((EPOCH + self.clock.now()) * 1e6))
        return window.total

    @property
    def admitted(self) -> int:
        return self.core.runtimes[EMBED].scheduler.counters.admitted

    async def settle(self) -> None:
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(0)

    async def serve(self) -> None:
        """Answer every batch until none is left."""
        await self.settle()
        while self.triton.pending:
            for batch in self.triton.pending:
                batch.ok()
            await self.settle()


def _faults(answers: list[list[Answer]]) -> set[str]:
    kinds = set()
    for one in answers:
        assert len(one) == 1, "every part is answered exactly once"
        assert one[0].fault is not None
        kinds.add(one[0].fault.kind)
    return kinds


# ---- admitted whole ----------------------------------------------------------------------


async def test_a_call_that_fits_queues_whole_and_counts_one_request() -> None:
    rig = Rig()
    calls = rig.group("a", 5)
    reqs = rig.core.submit_group(Group(calls), rig.shell)
    assert reqs is not None and len(reqs) == 5
    assert rig.admitted == 5
    assert rig.counted("a", "requests") == 1  # one call
    assert rig.counted("a", "tokens") == 5 * WIDTH  # every part's tokens
    await rig.serve()
    answers = rig.answers(calls)
    assert all(len(one) == 1 and one[0].fault is None for one in answers)
    # All five were queued before the dispatch looked: they went in one batch.
    assert rig.triton.batches() == [[c.request.id for c in calls]]
    # Each answer carries the call's quota: one request used of three.
    quota = answers[-1][0].quota
    assert quota is not None and quota.requests is not None
    assert quota.requests.remaining == REQUESTS_PER_MINUTE - 1


async def test_a_call_over_the_tokens_left_is_refused_whole() -> None:
    """15 tokens left, a call of 6 parts of 3: each part would fit, the call does not.
    Every part is answered 429 once, none queued, nothing counted, nothing sent."""
    rig = Rig()
    fitting = rig.group("a", 15)  # 45 of 60 tokens
    assert rig.core.submit_group(Group(fitting), rig.shell) is not None
    await rig.serve()
    before = (rig.admitted, rig.counted("a", "tokens"), rig.counted("a", "requests"))
    sent = len(rig.triton.sent)
    calls = rig.group("a", 6)  # 18 tokens
    assert rig.core.submit_group(Group(calls), rig.shell) is None
    assert _faults(rig.answers(calls)) == {"RateLimited"}
    assert (rig.admitted, rig.counted("a", "tokens"), rig.counted("a", "requests")) == before
    assert len(rig.triton.sent) == sent
    refused = {c.request.id for c in calls}
    assert [o for rid, o in rig.finished if rid in refused] == [Outcome.REJECTED_RATE] * 6


async def test_negative_control_parts_one_by_one_are_admitted_in_part() -> None:
    """The same call as parts submitted one by one (the routes' way before a call was
    admitted whole): the parts that fit are queued, counted and sent before the rest is
    refused."""
    rig = Rig()
    for call in rig.group("a", 15):
        rig.core.submit(call, rig.shell)
    await rig.serve()
    before = rig.counted("a", "tokens")
    sent = len(rig.triton.sent)
    calls = rig.group("a", 6)
    reqs = [rig.core.submit(c, rig.shell) for c in calls]
    assert sum(r is not None for r in reqs) == 5  # 15 tokens left: five parts of 3
    assert rig.counted("a", "tokens") == before + 15
    await rig.settle()
    assert len(rig.triton.sent) > sent  # some of a refused call reached Triton
    await rig.serve()


async def test_a_call_counts_one_request_whatever_its_parts() -> None:
    rig = Rig()
    for _ in range(REQUESTS_PER_MINUTE):
        assert rig.core.submit_group(Group(rig.group("a", 2)), rig.shell) is not None
        await rig.serve()
    assert rig.counted("a", "requests") == REQUESTS_PER_MINUTE
    calls = rig.group("a", 1)
    assert rig.core.submit_group(Group(calls), rig.shell) is None
    assert _faults(rig.answers(calls)) == {"RateLimited"}


async def test_a_call_over_the_queue_cap_is_refused_whole_and_one_that_fits_queues() -> None:
    """b may queue 6: with 3 queued behind a batch in Triton, a call of 4 is refused
    whole (QueueFull for every part, none queued), a call of 3 queues whole."""
    rig = Rig()
    busy = rig.group("b", 1)
    rig.core.submit_group(Group(busy), rig.shell)  # in Triton: the slot taken
    waiting = rig.group("b", 3)
    rig.core.submit_group(Group(waiting), rig.shell)
    scheduler = rig.core.runtimes[EMBED].scheduler
    assert scheduler.depth("b") == 3
    over = rig.group("b", 4)
    assert rig.core.submit_group(Group(over), rig.shell) is None
    assert _faults(rig.answers(over)) == {QueueFull.__name__}
    assert scheduler.depth("b") == 3
    fits = rig.group("b", 3)
    assert rig.core.submit_group(Group(fits), rig.shell) is not None
    assert scheduler.depth("b") == 6
    await rig.serve()
    answered = rig.answers([*busy, *waiting, *fits])
    assert all(len(one) == 1 and one[0].fault is None for one in answered)


async def test_a_group_is_one_tenants_and_one_models() -> None:
    rig = Rig()
    calls = [*rig.group("a", 1), rig.call("b", requests=0)]
    assert rig.core.submit_group(Group(calls), rig.shell) is None
    assert _faults(rig.answers(calls)) == {"Internal"}
    assert rig.admitted == 0


# ---- a storage that must be awaited ---------------------------------------------------------


async def test_an_awaited_check_admits_or_refuses_the_call_whole() -> None:
    rig = Rig(awaited=True)
    fits = rig.group("a", 15)
    reqs = rig.core.submit_group(Group(fits), rig.shell)
    assert reqs is not None and rig.admitted == 0  # the check is still out
    await rig.serve()
    assert rig.admitted == 15
    over = rig.group("a", 6)  # 18 > 15 left
    rig.core.submit_group(Group(over), rig.shell)
    await rig.serve()
    assert _faults(rig.answers(over)) == {"RateLimited"}
    assert rig.admitted == 15 and rig.counted("a", "tokens") == 45
    assert all(len(one) == 1 and one[0].fault is None for one in rig.answers(fits))


async def test_parts_cancelled_during_an_awaited_check_end_there() -> None:
    rig = Rig(awaited=True)
    calls = rig.group("a", 4)
    reqs = rig.core.submit_group(Group(calls), rig.shell)
    assert reqs is not None
    for req in reqs:
        rig.core.cancel(req)  # the client went away: the shell cancels every part
    await rig.serve()
    assert rig.admitted == 0 and not rig.triton.sent
    assert not any(rig.answers(calls)[i] for i in range(4))  # no answer to a gone client
    ids = {c.request.id for c in calls}
    assert [o for rid, o in rig.finished if rid in ids] == [Outcome.CANCELLED] * 4


# ---- the precharge ------------------------------------------------------------------------


async def test_a_precharge_counts_before_and_the_call_counts_only_the_rest() -> None:
    """A precharge of 9 tokens counts the call's request and 9 tokens; its call of 5
    parts (15 tokens) then counts no request and 6 tokens: 15 in all, one request."""
    rig = Rig()
    at, quota = await rig.core.precharge("a", EMBED, requests=1, tokens=9)
    assert at is not None and at == EPOCH + rig.clock.now()
    assert quota is not None and quota.tokens is not None
    assert quota.tokens.remaining == TOKENS_PER_MINUTE - 9
    assert (rig.counted("a", "requests"), rig.counted("a", "tokens")) == (1, 9)
    calls = rig.group("a", 5)
    calls[0].requests, calls[0].precharged, calls[0].precharged_at = 0, 9, at
    assert rig.core.submit_group(Group(calls), rig.shell) is not None
    assert (rig.counted("a", "requests"), rig.counted("a", "tokens")) == (1, 15)
    await rig.serve()


async def test_what_a_precharge_counted_beyond_the_tokens_is_given_back() -> None:
    rig = Rig()
    at, _ = await rig.core.precharge("a", EMBED, requests=1, tokens=20)
    calls = rig.group("a", 2)  # 6 tokens: 14 fewer than the precharge counted
    calls[0].requests, calls[0].precharged, calls[0].precharged_at = 0, 20, at or 0.0
    assert rig.core.submit_group(Group(calls), rig.shell) is not None
    assert (rig.counted("a", "requests"), rig.counted("a", "tokens")) == (1, 6)
    await rig.serve()


async def test_a_call_refused_after_its_precharge_keeps_it_counted() -> None:
    """The precharge paid for the tokenising; the call's own tokens do not fit what is
    left: it is refused whole, and the precharge stays counted (it was not free)."""
    rig = Rig()
    at, _ = await rig.core.precharge("a", EMBED, requests=1, tokens=50)
    calls = rig.group("a", 20)  # 60 tokens: 10 more than the precharge, 10 left: fits
    calls[0].requests, calls[0].precharged, calls[0].precharged_at = 0, 50, at or 0.0
    calls.append(rig.call("a", requests=0))  # 63: 13 more, 10 left
    assert rig.core.submit_group(Group(calls), rig.shell) is None
    assert _faults(rig.answers(calls)) == {"RateLimited"}
    assert (rig.counted("a", "requests"), rig.counted("a", "tokens")) == (1, 50)


async def test_a_precharge_that_does_not_fit_is_refused_and_counts_nothing() -> None:
    rig = Rig()
    with pytest.raises(RateLimited) as refused:
        await rig.core.precharge("a", EMBED, requests=1, tokens=TOKENS_PER_MINUTE + 1)
    assert refused.value.quota is not None
    assert (rig.counted("a", "requests"), rig.counted("a", "tokens")) == (0, 0)
    # A tenant without limits on the model: nothing to count, nothing counted.
    assert await rig.core.precharge("b", EMBED, requests=1, tokens=10**9) == (None, None)


async def test_an_awaited_precharge_counts_as_the_memory_one_does() -> None:
    rig = Rig(awaited=True)
    at, _ = await rig.core.precharge("a", EMBED, requests=1, tokens=30)
    assert at is not None
    assert (rig.counted("a", "requests"), rig.counted("a", "tokens")) == (1, 30)
    with pytest.raises(RateLimited):
        await rig.core.precharge("a", EMBED, requests=1, tokens=31)


# ---- a large call queued in slices, its room held --------------------------------------------


async def test_a_large_call_is_queued_in_slices_with_its_room_held_from_the_start() -> None:
    """600 parts: the first slice is queued at once (its first batch goes to Triton),
    the rest one slice per loop iteration; their room in the caps is held from the
    start, so a call one part larger than the room left (1,000 queued at most) that
    arrives meanwhile is refused, and one that fits queues."""
    rig = Rig()
    big = rig.group("c", 600)
    assert rig.core.submit_group(Group(big), rig.shell) is not None
    caps = rig.core.caps
    assert rig.admitted == PARTS_PER_SLICE  # one slice in this step
    sent = rig.core.runtimes[EMBED].scheduler.counters.dispatched  # left the queue
    assert caps.queued == 600 - sent  # the rest held, queued or not yet
    room = GLOBAL_MAX_QUEUED - caps.queued
    over = rig.group("c", room + 1)
    assert rig.core.submit_group(Group(over), rig.shell) is None
    assert _faults(rig.answers(over)) == {QueueFull.__name__}
    fits = rig.group("c", room)
    assert rig.core.submit_group(Group(fits), rig.shell) is not None
    assert caps.queued == GLOBAL_MAX_QUEUED
    await rig.serve()
    assert rig.admitted == 600 + room and caps.queued == 0
    assert all(len(one) == 1 and one[0].fault is None for one in rig.answers([*big, *fits]))


async def test_parts_cancelled_before_their_slice_end_there_and_give_their_room_back() -> None:
    rig = Rig()
    calls = rig.group("c", 600)
    reqs = rig.core.submit_group(Group(calls), rig.shell)
    assert reqs is not None
    for req in reqs:
        rig.core.cancel(req)  # the client went away: every part, queued or not yet
    await rig.serve()
    assert rig.core.caps.queued == 0 and rig.core.runtimes[EMBED].incoming == 0
    ids = {c.request.id for c in calls}
    outcomes = [o for rid, o in rig.finished if rid in ids]
    assert len(outcomes) == 600 and set(outcomes) <= {Outcome.CANCELLED, Outcome.DISPATCHED}
    assert Outcome.CANCELLED in outcomes


async def test_a_shutdown_answers_the_parts_still_waiting_for_their_slice() -> None:
    rig = Rig()
    calls = rig.group("c", 600)
    assert rig.core.submit_group(Group(calls), rig.shell) is not None
    runtime = rig.core.runtimes[EMBED]
    assert not runtime.idle
    sent = runtime.scheduler.counters.dispatched  # its first batch, in Triton
    failed = runtime.fail_queued(Unavailable("shutting down"))
    assert failed == 600 - sent
    await rig.serve()
    answers = rig.answers(calls)
    assert all(len(one) == 1 for one in answers)  # exactly one answer each
    assert rig.core.caps.queued == 0 and runtime.idle


async def test_a_shell_gone_drops_its_parts_still_waiting_for_their_slice() -> None:
    rig = Rig()
    calls = rig.group("c", 600)
    assert rig.core.submit_group(Group(calls), rig.shell) is not None
    dropped = rig.core.drop_route(rig.shell)
    assert dropped == 600  # the first batch's too (in Triton: its answers dropped)
    await rig.serve()
    assert rig.core.caps.queued == 0
    ids = {c.request.id for c in calls}
    assert len([rid for rid, _ in rig.finished if rid in ids]) == 600  # each recorded once
