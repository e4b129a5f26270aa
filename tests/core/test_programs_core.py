"""Programs inside tenants, in the core (issue 33, item 1): a ``Call``'s program is its
scheduled request's, a flood of program ids from one tenant keeps at most
``queues.programs_per_tenant`` programs in its queue, and adds no metric series: the
metrics the core serves have the same series as for the same calls of one program, and
no label names a program.

A real ``Core`` in granted mode on a fake clock (the shells' facts only, ``Call.key``),
as ``test_outcome_books`` drives one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import Any, cast

import numpy as np
from dispatch_support import SETTLE_ROUNDS, WIDTH, FakeTriton, StepClock, embed_info

from fair_frontend.backends.protocol import BackendServer
from fair_frontend.batching import wire_key
from fair_frontend.config import parse_config
from fair_frontend.core.granted import GrantedDispatcher
from fair_frontend.core.service import Core
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.wire.records import Answer, Call, Rows, RowsDone

EMBED = "embed"
EPOCH = 1.7e9
BOUND = 8


class Route:
    def __init__(self) -> None:
        self.rows: list[Rows] = []
        self.answers: list[Answer] = []

    def answer(self, answer: Answer) -> None:
        self.answers.append(answer)

    def grant_rows(self, rows: Rows) -> None:
        self.rows.append(rows)


class Triton(FakeTriton):
    async def server_ready(self) -> bool:
        return True


class Rig:
    def __init__(self) -> None:
        self.clock = StepClock()
        data = {
            "tiers": ["paid"],
            "tier_models": {"paid": ["*"]},
            "tenants": {
                name: {"tier": "paid", "api_keys": [f"{name}-test-key"]} for name in ("a", "b")
            },
            "endpoints": {EMBED: {"throttle": False, "token_output": None}},
            "queues": {"programs_per_tenant": BOUND},
        }
        self.core = Core(
            parse_config(data),
            cast(BackendServer, Triton(self.clock)),
            clock=self.clock,
            wall=lambda: EPOCH + self.clock.now(),
        )
        runtime = self.core._runtime(EMBED, embed_info())
        assert isinstance(runtime, GrantedDispatcher)
        self.runtime = runtime
        self.route = Route()
        self._ids = itertools.count(1)

    def call(self, tenant: str, program: str) -> Call:
        n = next(self._ids)
        request = InferRequest(
            model=EMBED,
            id=f"{tenant}:{n}",
            inputs=[Tensor("INPUT_IDS", "INT32", (1, WIDTH), np.full((1, WIDTH), n, np.int32))],
        )
        key = wire_key(request, self.runtime.plan)
        now = self.clock.now()
        return Call(
            id=n,
            tenant=tenant,
            priority=1,
            arrived=now,
            arrived_wall=EPOCH + now,
            rows=1,
            tokens=WIDTH,
            nbytes=request.nbytes,
            lengths=[WIDTH],
            request=dataclasses.replace(request, inputs=[]),
            key=key,
            program=program,
        )


async def serve(programs: list[str]) -> tuple[Rig, int]:
    """Tenant ``a``'s calls, one per program id given (and one of ``b`` for every ten),
    in one tick, then every grant reported served: the rig, and the most programs ``a``'s
    queue kept at once."""
    rig = Rig()
    with rig.core.tick():
        for i, program in enumerate(programs):
            call = rig.call("a", program)
            req = rig.core.submit(call, cast(Any, rig.route))
            assert req is not None and req.program == program  # the call's, scheduled
            if i % 10 == 0:
                assert rig.core.submit(rig.call("b", ""), cast(Any, rig.route)) is not None
    most = rig.runtime.scheduler._queues["a"].programs
    reported = 0
    for _ in range(len(programs) + 10):
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(0)
        most = max(most, rig.runtime.scheduler._queues["a"].programs)
        fresh = rig.route.rows[reported:]
        if not fresh:
            break
        reported = len(rig.route.rows)
        rig.clock.advance(0.001)
        for rows in fresh:
            done = RowsDone(
                rows.model, rows.batch, [(c, 0) for c in rows.calls], [], None, "1", 0.0
            )
            rig.core.rows_done(done, cast(Any, rig.route))
    for _ in range(SETTLE_ROUNDS):
        await asyncio.sleep(0)
    return rig, most


def series(rig: Rig) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every series the core's registry serves: its name and labels (not its value)."""
    return {
        (s.name, tuple(sorted(s.labels.items())))
        for family in rig.core.registry.collect()
        for s in family.samples
    }


async def test_a_flood_of_program_ids_keeps_the_bound_and_adds_no_metric_series() -> None:
    """Mutations caught: a queue that keeps a program for every id (the bound), a program
    id used as a metric label (new series), a call whose program is not its scheduled
    request's."""
    flood, most = await serve([f"flood-{i}" for i in range(300)])
    assert 1 < most <= BOUND
    one, _ = await serve(["chat"] * 300)
    for rig in (flood, one):
        granted = sum(len(rows.calls) for rows in rig.route.rows)
        assert granted == rig.runtime.scheduler.counters.dispatched == 330
    assert series(flood) == series(one)
    labels = {value for _, pairs in series(flood) for _, value in pairs}
    assert "a" in labels and "b" in labels  # the tenants' series are there
    assert not any("flood" in value or value == "chat" for value in labels)
