"""Engine mode on the real stack: the streaming ``llm`` model behind the frontend.

``llm`` batches inside itself (continuous batching, as vLLM does); the frontend gives it
at most ``max_inflight`` requests at once and decides who gets the next free slot (tier,
then virtual token counters, then priority). Each client is a gRPC stream of its own, as
a tenant's client would be.

Who was served when is judged from the core's own record (``CoreSpy``: what it queued,
dispatched and ended, and the tokens each stream's shell reported, in the order its loop
did them), never from when the clients received their tokens: two clients on a loaded
machine see their streams in bursts, late and out of step with the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from fair_frontend.config import Config, CostUnit
from fair_frontend.kit.testing import aeventually, ascrape
from fair_frontend.tokens import count_text_tokens
from tests.support import (
    PROMPT,
    RunningFrontend,
    generate,
    generate_many,
    make_config,
    running_frontend,
)

SETTLE_S = 60.0  # bounds every wait on the core below (a hang fails; never a timing)
# Output tokens of a stream that must still be generating when the test is done with it
# (it is cancelled then): PROMPT and these fit the llm's max_model_len (512).
LONGEST = 480


def engine_config(max_inflight: int, **endpoint: Any) -> Config:
    base = make_config()
    update = {"max_inflight": max_inflight, "reserved_slots": 0, **endpoint}
    llm = base.endpoints["llm"].model_copy(update=update)
    return base.model_copy(update={"endpoints": {**base.endpoints, "llm": llm}})


# ---- the core's record --------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """One thing the core did for the model, in the order its loop did it."""

    what: str  # "queued", "dispatched", "produced" (``tokens`` more) or "ended" (``outcome``)
    request: Any  # the core's request (``CoreRequest``)
    tokens: int = 0
    outcome: str = ""
    # The requests in the engine (dispatched, not ended) once this was done, by id().
    engine: frozenset[int] = frozenset()
    # Queued requests per tenant as the core saw them: after a request was queued, before
    # a dispatch took it from its queue (the state the scheduler decided in).
    queued: dict[str, int] = field(default_factory=dict)
    # Output tokens each request in the engine had produced by then, by id().
    produced: dict[int, int] = field(default_factory=dict)

    @property
    def tenant(self) -> str:
        return str(self.request.tenant)


class CoreSpy:
    """What the core does for one model, as it does it: a spy on the model's runtime (its
    scheduler's ``enqueue`` and ``next_batch``, its ``count_report`` and ``on_done``), put in
    and taken out on the core's own loop. The core runs in this process (``running_frontend``,
    whatever the number of shells), so its record is readable here."""

    def __init__(self, fe: RunningFrontend, model: str) -> None:
        self.fe = fe
        self.model = model
        self.seen: list[Seen] = []
        self._engine: dict[int, Any] = {}
        self._restore: Callable[[], None] = lambda: None

    def _note(self, what: str, req: Any, queued: dict[str, int], **kw: Any) -> None:
        engine = self._engine
        produced = {key: int(r.produced) for key, r in engine.items()}
        self.seen.append(Seen(what, req, engine=frozenset(engine), queued=queued,
                              produced=produced, **kw))  # fmt: skip

    async def install(self) -> None:
        await self.fe.frontend.model_info(self.model)  # its runtime, made before any call
        runtime = self.fe.frontend.runtimes[self.model]
        scheduler = runtime.scheduler
        enqueue, next_batch = scheduler.enqueue, scheduler.next_batch
        # count_report: where every token report is counted (one by one in process, a
        # shell's Produced record at once over a socket: Core.produced_all).
        produced, on_done = runtime.count_report, runtime.on_done

        def spied_enqueue(req: Any, now: float) -> None:
            enqueue(req, now)
            self._note("queued", req, scheduler.depths())

        def spied_next_batch(now: float) -> list[Any]:
            depths = scheduler.depths()
            batch: list[Any] = next_batch(now)
            for req in batch:
                self._engine[id(req)] = req
                self._note("dispatched", req, depths)
            return batch

        def spied_produced(req: Any, tokens: int) -> float | None:
            cost: float | None = produced(req, tokens)  # asked of an unanswered one only
            self._note("produced", req, scheduler.depths(), tokens=tokens)
            return cost

        def spied_on_done(req: Any, outcome: Any, err: Any, version: str) -> None:
            on_done(req, outcome, err, version)
            self._engine.pop(id(req), None)
            self._note("ended", req, scheduler.depths(), outcome=outcome.value)

        scheduler.enqueue, scheduler.next_batch = spied_enqueue, spied_next_batch
        runtime.count_report, runtime.on_done = spied_produced, spied_on_done

        def restore() -> None:
            del scheduler.enqueue, scheduler.next_batch, runtime.count_report
            runtime.on_done = on_done

        self._restore = restore

    async def remove(self) -> None:
        self._restore()

    # -- reading it (from the test's thread: appends only, so a copy is consistent)

    def events(self, what: str, tenant: str | None = None) -> list[Seen]:
        return [s for s in list(self.seen) if s.what == what and tenant in (None, s.tenant)]

    def produced(self, tenant: str) -> int:
        return sum(s.tokens for s in self.events("produced", tenant))

    def in_engine(self, tenant: str) -> int:
        """``tenant``'s requests in the engine after the latest event."""
        seen = list(self.seen)
        if not seen:
            return 0
        last = seen[-1]
        tenants = {id(s.request): s.tenant for s in seen}
        return sum(1 for key in last.engine if tenants.get(key) == tenant)

    def request(self, tenant: str) -> Any:
        """``tenant``'s one request (the tests that call this send it one)."""
        (req,) = {id(s.request): s.request for s in self.events("queued", tenant)}.values()
        return req

    def index(self, what: str, req: Any) -> int:
        """Where in the record ``req`` was ``what`` (its first such event)."""
        return next(i for i, s in enumerate(self.seen) if s.what == what and s.request is req)


@contextlib.asynccontextmanager
async def spying(fe: RunningFrontend, model: str = "llm") -> AsyncIterator[CoreSpy]:
    spy = CoreSpy(fe, model)
    await fe.acall(spy.install())
    try:
        yield spy
    finally:
        await fe.acall(spy.remove())


async def cancelled(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel clients' streams (the frontend cancels their requests) and wait for them."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def until_idle(spy: CoreSpy) -> None:
    """Until every request the core queued has ended (the record is complete). Only where
    no client cancels: a request cancelled in the very loop iteration that dispatched it
    is never recorded as ended (its dispatch task, cancelled before it first ran, skips
    its ``finally``)."""

    def idle() -> bool:
        return len(spy.events("ended")) == len(spy.events("queued"))

    await aeventually(idle, SETTLE_S, 0.01, what="every request's end recorded by the core")


# ---- the tests ----------------------------------------------------------------------------


async def test_grpc_stream_gives_the_same_tokens_as_triton_direct(triton, frontend) -> None:
    direct = await generate(triton.grpc_url, None, PROMPT, 12)
    through = await generate(frontend.grpc_url, "acme", PROMPT, 12)
    assert direct.error is None and through.error is None
    assert len(through.tokens) == 12
    assert through.tokens == direct.tokens


SHORT = 40  # globex's stream in the interleaving test


async def test_streams_interleave_tenants_token_by_token(frontend) -> None:
    """One decode step serves both tenants' streams, token by token, not stream after
    stream: globex's stream, sent while acme's is generating, goes into the engine beside
    it (every one of its tokens is produced while acme's stream is in the engine), and
    acme's stream goes on producing all the while (at least half as many tokens as
    globex's while globex's is served). A frontend that served one stream after the other
    (``max_inflight: 1``) dispatches globex's only once acme's ended."""
    async with spying(frontend) as spy:
        acme = asyncio.ensure_future(generate(frontend.grpc_url, "acme", PROMPT, LONGEST))
        try:
            producing = "acme's stream producing in the engine"
            await aeventually(lambda: spy.produced("acme") > 0, SETTLE_S, 0.005, what=producing)
            globex = await generate(frontend.grpc_url, "globex", PROMPT, SHORT)
        finally:
            await cancelled([acme])  # done with: it was generating its LONGEST tokens
        # globex's end reaches the core just after its client got the last token.
        await aeventually(lambda: spy.events("ended", "globex"), SETTLE_S, what="globex's end")
    assert globex.error is None and len(globex.tokens) == SHORT
    a, g = spy.request("acme"), spy.request("globex")
    tokens = spy.events("produced", "globex")
    assert sum(s.tokens for s in tokens) == SHORT
    # Both in the engine at once while globex's tokens were produced.
    assert all(id(a) in s.engine for s in tokens), "globex's stream waited for acme's to end"
    # Token by token: acme's stream produced all the while globex's was in the engine.
    served = spy.seen[spy.index("dispatched", g) : spy.index("ended", g)]
    during = sum(s.tokens for s in served if s.what == "produced" and s.request is a)
    assert during >= SHORT // 2, f"acme produced {during} tokens while globex's {SHORT} were"


@pytest.mark.parametrize("scheduling", ["fair", "fifo"])
async def test_long_streams_cannot_hold_every_slot_against_a_newcomer(
    triton, scheduling: str
) -> None:
    """acme queues 12 long generations on 4 slots; globex's one short request gets the
    next slot that frees (the documented bound): no request of acme's queued ahead of it
    is dispatched between its arrival and its own dispatch. fifo, the negative control,
    dispatches every one of them first. Order as the core dispatched."""
    config = engine_config(4).model_copy(update={"scheduling": scheduling})
    with running_frontend(config, triton) as fe:
        async with spying(fe) as spy:
            hogs = [
                asyncio.ensure_future(generate(fe.grpc_url, "acme", f"{PROMPT} {i}", 60))
                for i in range(12)
            ]
            try:
                await aeventually(
                    lambda: len(spy.events("queued", "acme")) == 12 and spy.produced("acme") > 0,
                    SETTLE_S,
                    0.005,
                    what="acme's 12 queued, its first 4 streaming",
                )
                newcomer = await generate(fe.grpc_url, "globex", PROMPT, 4)
            finally:
                await cancelled(hogs)  # done with: the order is decided
    assert newcomer.error is None and len(newcomer.tokens) == 4
    g = spy.request("globex")
    arrived = spy.index("queued", g)
    waiting = spy.seen[arrived].queued.get("acme", 0)  # acme's queued ahead of it
    assert waiting > 0, "acme's queue drained before globex's request arrived"
    ahead = [
        s
        for s in spy.seen[arrived : spy.index("dispatched", g)]
        if s.what == "dispatched" and s.tenant == "acme"
    ]
    if scheduling == "fair":
        assert ahead == [], f"{len(ahead)} of acme's {waiting} queued requests went first"
    else:
        assert len(ahead) == waiting, f"fifo: {len(ahead)} of {waiting} went first"


async def test_reserved_slots_serve_a_newcomer_without_waiting_for_a_turnover(triton) -> None:
    """4 slots, 2 reserved: acme's 12 long generations never hold more than 2; globex's
    two requests take the other two as they arrive: none of acme's generations ends
    between a request of globex's being queued and its dispatch (without the reservation
    acme holds all 4 and each of globex's waits for one of acme's to end: the test above).
    Order as the core did it, whatever the machine's speed."""
    with running_frontend(engine_config(4, reserved_slots=2), triton) as fe:
        async with spying(fe) as spy:
            hogs = [
                asyncio.ensure_future(generate(fe.grpc_url, "acme", f"{PROMPT} {i}", 200))
                for i in range(12)
            ]
            try:
                await aeventually(
                    lambda: spy.in_engine("acme") == 2 and spy.produced("acme") > 0,
                    SETTLE_S,
                    0.005,
                    what="acme streaming in its 2 slots",
                )
                newcomers = await asyncio.gather(
                    generate(fe.grpc_url, "globex", PROMPT, 4),
                    generate(fe.grpc_url, "globex", PROMPT, 4),
                )
            finally:
                await cancelled(hogs)
    assert all(n.error is None and len(n.times) == 4 for n in newcomers)
    tenant = {id(s.request): s.tenant for s in spy.seen}
    held = max(sum(1 for key in s.engine if tenant[key] == "acme") for s in spy.seen)
    assert held == 2, f"acme held {held} slots"  # the reserved ones stayed free for another
    for req in {id(s.request): s.request for s in spy.events("queued", "globex")}.values():
        waited = spy.seen[spy.index("queued", req) : spy.index("dispatched", req)]
        ends = [s for s in waited if s.what == "ended" and s.tenant == "acme"]
        assert ends == [], "a newcomer waited for one of acme's generations to end"


async def test_a_cancelled_stream_frees_its_slot(triton) -> None:
    """A long stream cancelled by its client gives its slot back at once, not when its
    generation would have ended. Two slots: initech's long stream holds one and is the
    clock (its tokens count the engine's steps), acme's long stream the other; globex's
    short request waits in the queue. acme's client cancels: globex's request is
    dispatched before initech's stream produced even half the tokens acme's generation
    had left (had the slot stayed taken until then, it would have produced all of them)."""
    long = 400
    with running_frontend(engine_config(2), triton) as fe:
        async with spying(fe) as spy:
            clock = asyncio.ensure_future(generate(fe.grpc_url, "initech", PROMPT, LONGEST))
            doomed: asyncio.Future[Any] | None = None
            short: asyncio.Future[Any] | None = None
            try:
                await aeventually(
                    lambda: spy.produced("initech") > 0, SETTLE_S, 0.005, what="the clock"
                )
                doomed = asyncio.ensure_future(generate(fe.grpc_url, "acme", PROMPT, long))
                await aeventually(
                    lambda: spy.produced("acme") >= 10, SETTLE_S, 0.005, what="acme streaming"
                )
                short = asyncio.ensure_future(generate(fe.grpc_url, "globex", PROMPT, 2))
                await aeventually(
                    lambda: spy.events("queued", "globex"), SETTLE_S, 0.005, what="globex queued"
                )
                a, c = spy.request("acme"), spy.request("initech")
                at_cancel = (int(a.produced), int(c.produced))
                await cancelled([doomed])
                answer = await asyncio.wait_for(short, SETTLE_S)
            finally:
                await cancelled([t for t in (clock, doomed, short) if t is not None])
        ended = {s.request.tenant: s.outcome for s in spy.events("ended")}
        what = "acme's cancellation in the metrics"
        counted = await aeventually(lambda: _cancelled_count(fe, "acme"), SETTLE_S, what=what)
    assert answer.error is None and len(answer.tokens) == 2
    assert ended["acme"] == "cancelled"
    left = long - at_cancel[0]  # acme's generation still to come when its client cancelled
    g = spy.request("globex")
    clock_at = spy.seen[spy.index("dispatched", g)].produced.get(id(c), LONGEST)  # ended: all
    ticked = clock_at - at_cancel[1]
    assert ticked < left // 2, f"globex got the slot {ticked} clock tokens after the cancel"
    assert counted == 1


async def _cancelled_count(fe: RunningFrontend, tenant: str) -> float:
    page = await ascrape(fe.metrics_url)
    return page.sum("fair_requests_total", tenant=tenant, outcome="cancelled")


async def backlogged_shares(
    triton: Any, cost: CostUnit, weights: tuple[float, float]
) -> dict[str, int]:
    """acme asks 8 output tokens per request, globex 64 (1:8); both keep 4 slots' worth
    of requests queued. Tokens each got while both were backlogged (both had requests
    queued in the core), as the core served them: output tokens as their shells reported
    them, input tokens when a request got its slot (VTC's measure). (acme queues 80 on 4
    slots: above an engine's default per-tenant cap, 4 x its slots, so its own max_queued
    says so.)"""
    base = engine_config(4, cost=cost)
    tenants = dict(base.tenants)
    for name, w in zip(("acme", "globex"), weights, strict=True):
        tenants[name] = tenants[name].model_copy(update={"weight": w, "max_queued": 1000})
    config = base.model_copy(update={"tenants": tenants})
    with running_frontend(config, triton) as fe:
        async with spying(fe) as spy:
            by_tenant = await asyncio.gather(
                generate_many(fe.grpc_url, "acme", 80, 8, []),
                generate_many(fe.grpc_url, "globex", 20, 64, []),
            )
            await until_idle(spy)
    assert all(s.error is None for streams in by_tenant for s in streams.values())
    tokenizer = config.endpoints["llm"].tokenizer
    assert tokenizer is not None
    served = {"acme": 0, "globex": 0}
    for s in spy.seen:
        if not all(s.queued.get(tenant, 0) for tenant in served):
            continue  # one of them had nothing queued
        if s.what == "produced":
            served[s.tenant] += s.tokens
        elif s.what == "dispatched":  # generate_many's prompts: PROMPT and the request's id
            prompt = f"{PROMPT} {s.request.request.id}"
            served[s.tenant] += count_text_tokens(tokenizer, [prompt])[0]
    return served


async def test_charge_back_gives_equal_tokens_to_outputs_1_to_8(triton) -> None:
    served = await backlogged_shares(triton, CostUnit.TOKENS, (1.0, 1.0))
    share = served["acme"] / sum(served.values())
    assert abs(share - 0.5) < 0.1, served


async def test_negative_control_request_cost_gives_the_long_outputs_most_tokens(triton) -> None:
    served = await backlogged_shares(triton, CostUnit.REQUESTS, (1.0, 1.0))
    # Equal requests, 8x the output each: several times the tokens (the prompts, equal
    # for both, dilute the 8). Token cost holds the two within 0.4-0.6 of the total (1.5x
    # at most): 2x tells them apart.
    assert served["globex"] > 2 * served["acme"], served


async def test_tokens_and_latency_per_tenant_are_in_the_metrics(frontend) -> None:
    """A stream's tokens, its time to first token and its 8 inter-token times, per tenant.
    The core records them as the stream's shell reports them, which may be just after the
    client has its last token (two shells): read until they are there."""
    names = (
        "fair_output_tokens_total",
        "fair_time_to_first_token_seconds_count",
        "fair_inter_token_seconds_count",
    )

    async def counts() -> list[float]:
        page = await ascrape(frontend.metrics_url)
        return [page.sum(name, tenant="hooli") for name in names]

    before = await counts()
    out = await generate(frontend.grpc_url, "hooli", PROMPT, 9)
    assert out.error is None
    expected = [9, 1, 8]

    async def recorded() -> list[float] | None:
        now = [n - b for n, b in zip(await counts(), before, strict=True)]
        return now if all(n >= e for n, e in zip(now, expected, strict=True)) else None

    got = await aeventually(recorded, SETTLE_S, what="hooli's stream in the metrics")
    assert got == expected
