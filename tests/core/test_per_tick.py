"""The core per tick (issue 30, item 2): a tenant's calls of one intake slice judged by the
throttle as one request (``Core.judge_together``), not one decision per call; and each
model's batches decided once at the slice's end (``Core.tick``), not at each call.

A real ``Core`` on fake clocks, ``embed`` throttled against a target, its service model
trained on batches of a known cost, and a ``FakeTriton`` that never answers (the queue
only grows). The control is a twin core that judges the same calls one by one, as every
call was judged before: the calls each admits must be the same, and every call's decision
is recorded once either way; only the number of decisions taken differs.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, cast

import numpy as np
from dispatch_support import SETTLE_ROUNDS, WIDTH, FakeTriton, Shell, StepClock, embed_info
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fair_frontend.backends.protocol import BackendServer
from fair_frontend.config import Config, parse_config
from fair_frontend.core.service import Core
from fair_frontend.core.shells import Intake, ShellConnection
from fair_frontend.observability.observe import Observer
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.wire.records import Call

EMBED = "embed"
EPOCH = 1.7e9
# The trained batch cost: FIXED_S a batch plus PER_ROW_S a row (32 rows: 21 ms).
FIXED_S, PER_ROW_S = 0.005, 0.0005


def core_config(target_ms: float) -> Config:
    return parse_config(
        {
            "tiers": ["paid"],
            "tier_models": {"paid": ["*"]},
            "tenants": {
                name: {"tier": "paid", "api_keys": [f"{name}-test-key"], "max_queued": 10**6}
                for name in ("a", "b")
            },
            "queues": {"max_queued": 10**7},
            "endpoints": {EMBED: {"latency_target_ms": target_ms}},
        }
    )


class Triton(FakeTriton):
    async def server_ready(self) -> bool:
        return True


class Decisions(Observer):
    """Every throttle decision the core records: (reason, requests it stands for)."""

    def __init__(self) -> None:
        self.taken: list[tuple[str, int]] = []

    def throttle_decision(self, *, model: str, decision: Any, count: int = 1) -> None:
        self.taken.append((decision.reason, count))

    @property
    def requests(self) -> int:
        return sum(count for _, count in self.taken)


class Rig:
    """A ``Core`` with ``embed`` ready and trained, one shell (route) for every call."""

    def __init__(self, target_ms: float) -> None:
        self.clock = StepClock()
        self.decisions = Decisions()
        self.triton = Triton(self.clock)
        self.core = Core(
            core_config(target_ms),
            cast(BackendServer, self.triton),
            observers=[self.decisions],
            clock=self.clock,
            wall=lambda: EPOCH + self.clock.now(),
        )
        runtime = self.core._runtime(EMBED, embed_info())
        assert runtime.admission is not None and runtime.admission.throttles
        service = runtime.admission.service
        at = 0.0
        for i in range(64):  # batches of 1..32 rows, each at the trained cost
            rows = 1 + i % 32
            done = at + FIXED_S + PER_ROW_S * rows
            service.observe_batch(rows, rows * WIDTH, at, done, done)
            at = done
        assert service.has_data
        self.shell = Shell()
        self._ids = itertools.count(1)

    def call(self, tenant: str, *, deadline_ms: float | None = None, priority: int = 1) -> Call:
        n = next(self._ids)
        data = np.full((1, WIDTH), n, dtype=np.int32)
        request = InferRequest(
            model=EMBED,
            id=f"{tenant}:{n}",
            inputs=[Tensor("INPUT_IDS", "INT32", (1, WIDTH), data)],
            priority=priority,
            timeout_us=0 if deadline_ms is None else int(deadline_ms * 1000),
        )
        now = self.clock.now()
        return Call(
            id=n,
            tenant=tenant,
            priority=priority,
            arrived=now,
            arrived_wall=EPOCH + now,
            rows=1,
            tokens=WIDTH,
            nbytes=request.nbytes,
            lengths=[WIDTH],
            request=request,
        )

    async def close(self) -> None:
        """Serve every batch until the queue is empty: no task is left behind."""
        for _ in range(10_000):
            for _ in range(SETTLE_ROUNDS):
                await asyncio.sleep(0)
            if not self.triton.pending:
                return
            for sent in self.triton.pending:
                sent.ok()
        raise AssertionError("batches kept coming")

    def submit(self, calls: list[Call], *, together: bool) -> list[bool]:
        """Each call admitted (queued) or not, judged together or one by one."""
        judged = self.core.judge_together(calls) if together else [False] * len(calls)
        return [
            self.core.submit(call, self.shell, judged=passed) is not None
            for call, passed in zip(calls, judged, strict=True)
        ]


class Conn:
    """Stands in for a shell's connection to the intake: its calls into ``rig``'s core,
    each one queued."""

    closed = False

    def __init__(self, rig: Rig) -> None:
        self.rig = rig

    def admit(self, call: Call, *, judged: bool = False) -> None:
        assert self.rig.core.submit(call, self.rig.shell, judged=judged) is not None


def twins(target_ms: float, queued: dict[str, int]) -> list[Rig]:
    """Two identical cores, each with ``queued`` calls per tenant submitted first."""
    rigs = [Rig(target_ms), Rig(target_ms)]
    for rig in rigs:
        for tenant, n in queued.items():
            rig.submit([rig.call(tenant) for _ in range(n)], together=False)
        rig.decisions.taken.clear()
    return rigs


async def test_a_slice_that_fits_is_judged_once_and_every_call_admitted() -> None:
    alone, together = twins(1000, {"a": 40, "b": 40})
    slices = [[rig.call("a") for _ in range(20)] for rig in (alone, together)]
    assert alone.submit(slices[0], together=False) == [True] * 20
    assert together.submit(slices[1], together=True) == [True] * 20
    assert len(alone.decisions.taken) == 20
    assert together.decisions.taken == [("within target", 20)]
    for rig in (alone, together):
        await rig.close()


async def test_where_the_whole_slice_does_not_fit_each_call_is_judged_alone() -> None:
    """The target lets in about a few batches: the slice's first calls fit, its last do
    not. Judged together the whole is refused, then each call alone: the same calls go in
    as one by one, and the decisions are one per call (plus the refused whole, taken and
    not recorded)."""
    alone, together = twins(60, {"a": 30, "b": 30})
    slices = [[rig.call("a") for _ in range(40)] for rig in (alone, together)]
    got = alone.submit(slices[0], together=False)
    assert any(got) and not all(got), got
    assert together.submit(slices[1], together=True) == got
    assert [count for _, count in together.decisions.taken] == [1] * 40
    for rig in (alone, together):
        await rig.close()


async def test_calls_of_several_priorities_are_judged_one_by_one() -> None:
    alone, together = twins(1000, {"a": 10})
    for rig in (alone, together):
        calls = [rig.call("a", priority=1 + i % 2) for i in range(10)]
        assert rig.submit(calls, together=rig is together) == [True] * 10
    assert [count for _, count in together.decisions.taken] == [1] * 10
    for rig in (alone, together):
        await rig.close()


async def test_the_intake_judges_each_tenants_calls_of_a_slice_together() -> None:
    """Through the real intake: two tenants' calls pushed interleaved, one decision per
    tenant for the slice, every call queued."""
    rig = Rig(1000)
    intake, conn = Intake(rig.core), Conn(rig)
    for i in range(30):
        intake.push(rig.call("ab"[i % 2]), cast(ShellConnection, conn))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not len(intake)
    assert [count for _, count in rig.decisions.taken] == [15, 15]
    assert rig.core.runtimes[EMBED].scheduler.counters.admitted == 30
    await rig.close()


@settings(max_examples=150, deadline=None)
@given(
    target_ms=st.sampled_from([15, 30, 60, 120, 250, 1000]),
    own=st.integers(0, 100),
    other=st.integers(0, 100),
    deadlines=st.lists(st.one_of(st.none(), st.integers(1, 400)), min_size=2, max_size=48),
)
def test_calls_judged_together_are_admitted_as_each_alone_would_be(
    target_ms: int, own: int, other: int, deadlines: list[int | None]
) -> None:
    """Whatever the queues before the slice, the target and each call's deadline: the same
    calls are admitted together as one by one, and every call's decision is recorded once;
    where the whole fits, with one decision."""

    async def run() -> None:
        alone, together = twins(target_ms, {"a": own, "b": other})
        got = []
        for rig in (alone, together):
            calls = [rig.call("a", deadline_ms=d) for d in deadlines]
            got.append(rig.submit(calls, together=rig is together))
        assert got[0] == got[1]
        assert alone.decisions.requests == together.decisions.requests == len(deadlines)
        # One decision for the whole (admitted), or, the whole refused, one for each.
        counts = [count for _, count in together.decisions.taken]
        assert counts in ([len(deadlines)], [1] * len(deadlines)), counts
        assert counts != [len(deadlines)] or all(got[1])
        event(
            "whole admitted"
            if len(counts) == 1
            else "each alone: "
            + ("all admitted" if all(got[1]) else "none admitted" if not any(got[1]) else "some")
        )
        for rig in (alone, together):
            await rig.close()

    asyncio.run(run())


async def test_a_ticks_first_batch_is_full_and_fair_not_its_first_call_alone() -> None:
    """Triton idle, two tenants' calls read in one slice (a call of each in turn). At each
    call (the control: submitted outside a tick), the first call found the instance free
    and went alone, a batch of one row, while the others queued behind it. At the tick's
    end, the first batch is as full as the model takes, in fair order: both tenants."""
    sizes = []
    for in_tick in (False, True):
        rig = Rig(1000)
        calls = [rig.call("ab"[i % 2]) for i in range(40)]
        conn = Conn(rig)
        if in_tick:
            intake = Intake(rig.core)
            for call in calls:
                intake.push(call, cast(ShellConnection, conn))
        else:
            for call in calls:
                conn.admit(call)
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(0)
        first = rig.triton.batches()[0]
        sizes.append(len(first))
        if in_tick:
            assert {request_id.split(":")[0] for request_id in first} == {"a", "b"}, first
        await rig.close()
    assert sizes == [1, embed_info().max_batch_size], sizes
