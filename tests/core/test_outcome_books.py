"""The outcome's books per batch (issue 30, item 2): the rows of a batch part its shell
answered are counted together (``Accounting.on_served``: the statistics once, the
observers told once, ``Observer.requests_finished``), not one request at a time.

A real ``Core`` in granted mode on a fake clock, the shells' facts only (``Call.key``),
against a twin core that counts each served request alone (``Accounting.on_done``, as
every request was counted before). The same calls, grants and reports go to both; every
book must read the same: each request's end as the observers hear it (its outcome, times,
usage), the request log (the calls no shell logs), Triton's statistics message and the
metrics the core serves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import Any, cast

import msgspec
import numpy as np
from dispatch_support import SETTLE_ROUNDS, WIDTH, FakeTriton, StepClock, embed_info

from fair_frontend.backends.protocol import BackendServer
from fair_frontend.batching import wire_key
from fair_frontend.config import parse_config
from fair_frontend.core.dispatch import CoreRequest
from fair_frontend.core.granted import GrantedDispatcher
from fair_frontend.core.service import Core
from fair_frontend.endpoint import plan
from fair_frontend.observability.logs import RequestLog
from fair_frontend.observability.observe import Observer
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.wire.records import Answer, Call, Rows, RowsDone

EMBED = "embed"
EPOCH = 1.7e9


class Ends(Observer):
    """Every request's end, as an observer hears it, one at a time."""

    def __init__(self) -> None:
        self.ends: list[dict[str, Any]] = []

    def request_finished(self, **end: Any) -> None:
        self.ends.append(end)


class Route:
    """A shell in front of the core: the grants of rows it must send, the core's answers."""

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
    def __init__(self, *, per_batch: bool) -> None:
        self.clock = StepClock()
        self.ends = Ends()
        self.logged = Ends()
        data = {
            "tiers": ["paid"],
            "tier_models": {"paid": ["*"]},
            "tenants": {
                name: {"tier": "paid", "api_keys": [f"{name}-test-key"]} for name in ("a", "b")
            },
            "endpoints": {EMBED: {"throttle": False, "token_output": None}},
        }
        self.core = Core(
            parse_config(data),
            cast(BackendServer, Triton(self.clock)),
            observers=[self.ends],
            clock=self.clock,
            wall=lambda: EPOCH + self.clock.now(),
        )
        # Ends, an Observer, where the core's request log was (the core calls only what
        # an Observer has)
        self.core.request_log = cast(RequestLog, self.logged)
        self.core.accounting.request_log = self.logged
        runtime = self.core._runtime(EMBED, embed_info())
        assert isinstance(runtime, GrantedDispatcher)
        self.runtime = runtime
        if not per_batch:  # the control: each served request counted alone
            runtime.on_served = runtime._each_done
        self.route = Route()
        self._ids = itertools.count(1)

    def call(self, tenant: str, *, logged: bool) -> Call:
        n = next(self._ids)
        info = embed_info()
        request = InferRequest(
            model=EMBED,
            id=f"{tenant}:{n}",
            inputs=[Tensor("INPUT_IDS", "INT32", (1, WIDTH), np.full((1, WIDTH), n, np.int32))],
        )
        key = wire_key(request, plan(self.core.config, EMBED, info))
        now = self.clock.now()
        return Call(
            id=n,
            tenant=tenant,
            priority=1,
            arrived=now - 0.001 * n,  # each its own latency
            arrived_wall=EPOCH + now,
            rows=1,
            tokens=WIDTH + 2,
            max_tokens=2,  # asked for: what its usage tells apart from its prompt
            nbytes=request.nbytes,
            lengths=[WIDTH],
            request=dataclasses.replace(request, inputs=[]),
            key=key,
            logged=logged,
        )


async def run(rig: Rig) -> dict[int, CoreRequest]:
    """Twelve calls of two tenants in one tick, every fourth not logged by its shell; the
    grants reported 7 ms later: each part served but one call whose client went away
    (its shell leaves it out: CANCELLED) and one cancelled at the core before."""
    reqs: dict[int, CoreRequest] = {}
    with rig.core.tick():
        for i in range(12):
            call = rig.call("ab"[i % 2], logged=i % 4 != 0)
            req = rig.core.submit(call, cast(Any, rig.route))
            assert req is not None
            reqs[call.id] = req
    for _ in range(SETTLE_ROUNDS):
        await asyncio.sleep(0)
    assert rig.route.rows, "no batch was granted"
    rig.clock.advance(0.002)
    rig.core.cancel(reqs[3])  # its client went away while its batch ran
    rig.clock.advance(0.005)
    for rows in rig.route.rows:
        served = [(c, 0) for c in rows.calls if c != 5]  # 5: gone from its shell
        done = RowsDone(rows.model, rows.batch, served, [], None, "1", 0.0)
        rig.core.rows_done(msgspec.msgpack.decode(msgspec.msgpack.encode(done), type=RowsDone),
                           cast(Any, rig.route))  # fmt: skip
    for _ in range(SETTLE_ROUNDS):
        await asyncio.sleep(0)
    return reqs


def samples(rig: Rig) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The metrics the core serves about finished requests."""
    out = {}
    for family in rig.core.registry.collect():
        for s in family.samples:
            if s.name.endswith("_created"):  # when the series was made, not what it counts
                continue
            if s.name.startswith(("fair_requests", "fair_queue_wait", "gen_ai_server_request")):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_a_parts_served_rows_are_counted_together_as_each_alone_would_be() -> None:
    together, alone = Rig(per_batch=True), Rig(per_batch=False)
    for rig in (together, alone):
        reqs = await run(rig)
        assert all(r.answered for r in reqs.values())
    assert len(together.ends.ends) == 12
    key = lambda end: end["request_id"]  # noqa: E731
    assert sorted(together.ends.ends, key=key) == sorted(alone.ends.ends, key=key)
    outcomes = {e["request_id"]: e["outcome"] for e in together.ends.ends}
    assert outcomes.pop("a:3") is Outcome.CANCELLED  # cancelled at the core
    assert outcomes.pop("a:5") is Outcome.CANCELLED  # gone from its shell
    assert set(outcomes.values()) == {Outcome.DISPATCHED}
    served = [e for e in together.ends.ends if e["outcome"] is Outcome.DISPATCHED]
    assert {round(e["service_s"], 9) for e in served} == {0.007}  # reported 7 ms on
    assert len({e["latency_s"] for e in served}) == 10  # each its own
    assert sorted(together.logged.ends, key=key) == sorted(alone.logged.ends, key=key)
    assert {e["request_id"] for e in together.logged.ends} == {"a:1", "a:5", "a:9"}
    got, want = together.core.stats.message(), alone.core.stats.message()
    for g, w in zip(got.model_stats, want.model_stats, strict=True):
        assert (g.inference_count, g.execution_count) == (w.inference_count, w.execution_count)
        for phase in ("success", "queue", "compute_infer", "fail"):
            gd, wd = getattr(g.inference_stats, phase), getattr(w.inference_stats, phase)
            assert gd.count == wd.count, phase
            assert abs(gd.ns - wd.ns) <= wd.count, phase  # each alone rounds its own ns
    assert got.model_stats[0].inference_stats.success.count == 10
    assert samples(together) == samples(alone)
    assert samples(together)
