"""Unit tests of a pool of Tritons (``core.pool``): which backend takes each batch or
stream, and what one backend's outage does to the rest.

On the fake clock and fake Tritons of ``dispatch_support`` (a ``Harness`` with
``backends=2``: each fake Triton answers only when the test says so, each has its own
readiness probe); the engine-mode tests grant slots to a fake shell, as
``test_engine_units`` does. No real Triton, no sleeps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import grpc
import numpy as np
import pytest
from dispatch_support import (
    MODEL,
    FakeTriton,
    FixedService,
    Harness,
    StepClock,
    embed_info,
    plan_of,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fair_frontend.backends.protocol import BackendServer, Forwarder
from fair_frontend.config import Endpoint, parse_config
from fair_frontend.core import Core
from fair_frontend.core.dispatch import Backend, CoreRequest
from fair_frontend.core.engine import EngineDispatcher
from fair_frontend.core.pool import BackendPool
from fair_frontend.core.sequences import OpenSequence
from fair_frontend.errors import FrontendError, Unavailable, UpstreamError
from fair_frontend.models import ModelInfo, TensorSpec
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.scheduler import (
    CostUnit,
    EndpointPolicy,
    GlobalCaps,
    Scheduler,
    TenantSpec,
    VirtualTokenCounter,
)
from fair_frontend.wire.records import Answer, Call, Grant

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


def lost() -> Unavailable:
    """The connection to a Triton dropped while the call was in it (it may have run)."""
    return Unavailable("Socket closed")


def refused() -> Unavailable:
    """A Triton that is not there: the call never reached it."""
    return Unavailable("failed to connect to all addresses", never_sent=True)


@pytest.fixture
async def make() -> AsyncIterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def build(*args: Any, **kwargs: Any) -> Harness:
        h = Harness(*args, backends=kwargs.pop("backends", 2), **kwargs)
        made.append(h)
        return h

    yield build
    for h in made:
        await h.close()


def sent_to(h: Harness) -> list[list[list[str]]]:
    """Each backend's batches so far, as request ids."""
    return [t.batches() for t in h.tritons]


def ids(*reqs: CoreRequest) -> list[str]:
    return [r.call.request.id for r in reqs]


def served(h: Harness, req: CoreRequest) -> bool:
    (answer,) = h.answers(req)
    return answer.fault is None and h.outcomes(req) == [Outcome.DISPATCHED]


def unavailable(h: Harness, req: CoreRequest) -> bool:
    (answer,) = h.answers(req)
    return answer.fault is not None and answer.fault.grpc_code == UNAVAILABLE


# ---- the choice ------------------------------------------------------------------------


def test_choose_takes_the_least_loaded_reachable_backend_ties_round_robin() -> None:
    clock = StepClock()
    backends = [Backend(clock) for _ in range(3)]
    pool = BackendPool(
        backends, cast(list[Forwarder], [object(), object(), object()])
    )  # never called
    assert pool.choose([0, 0, 0], 2) == 0
    pool.took(0)
    assert pool.choose([1, 0, 0], 2) == 1  # the fewest running
    pool.took(1)
    assert pool.choose([1, 1, 0], 2) == 2
    pool.took(2)
    assert pool.choose([1, 1, 1], 2) == 0  # a tie: after the last one chosen
    pool.took(0)
    assert pool.choose([2, 1, 1], 2) == 1
    assert pool.choose([2, 2, 2], 2) is None  # every slot taken
    backends[1].available = False
    assert pool.choose([1, 0, 1], 2) == 2  # 1 is down: it takes nothing, however idle
    assert pool.choose([1, 0, 2], 2) == 0
    assert pool.choose([0, 0, 0], 2, only=1) is None
    assert pool.choose([0, 0, 2], 2, only=2) is None
    assert pool.choose([0, 0, 1], 2, only=2) == 2
    assert pool.available and pool.up == 2 and not pool.gave_up


async def test_batches_spread_over_the_backends_fewest_in_flight_first(
    make: Callable[..., Harness],
) -> None:
    """Two backends of two slots each: one batch each in turn, four at once; the next one
    waits for a slot and goes where it frees."""
    h = make(instances=2)
    reqs = []
    for _ in range(4):
        reqs.append(h.submit("a"))
        await h.settle()
    assert sent_to(h) == [[ids(reqs[0]), ids(reqs[2])], [ids(reqs[1]), ids(reqs[3])]]
    assert h.runtime.running == [2, 2] and h.runtime.inflight == 4
    fifth = h.submit("b")
    await h.settle()
    assert sum(len(b) for b in sent_to(h)) == 4  # no slot: it waits here, not in a Triton
    h.tritons[1].sent[0].ok()
    await h.settle()
    assert sent_to(h)[1][-1] == ids(fifth)
    for t in h.tritons:
        for s in t.pending:
            s.ok()
    await h.settle()
    assert all(served(h, r) for r in [*reqs, fifth])
    assert h.runtime.running == [0, 0] and h.runtime.idle


async def test_the_early_send_goes_to_the_backend_predicted_to_free_first(
    make: Callable[..., Harness],
) -> None:
    """Every batch predicted 10 ms, lead 3 ms: the one sent later frees later, so the next
    batch goes early to the first backend, 3 ms before its batch is predicted to end."""
    h = make(service=FixedService(0.010))
    t0 = h.clock.now()
    r1 = h.submit("a")
    await h.settle()
    await h.advance_to(t0 + 0.002)
    r2 = h.submit("b")
    await h.settle()
    assert sent_to(h) == [[ids(r1)], [ids(r2)]]
    r3 = h.submit("c")
    await h.advance_to(t0 + 0.007 - 1e-6)
    assert sum(len(b) for b in sent_to(h)) == 2  # not earlier
    await h.advance_to(t0 + 0.007)
    assert sent_to(h) == [[ids(r1), ids(r3)], [ids(r2)]]
    assert h.tritons[0].sent[1].at == pytest.approx(t0 + 0.007, abs=1e-9)
    for t in h.tritons:
        for sent in t.pending:
            sent.ok()
    await h.settle()
    assert all(served(h, r) for r in (r1, r2, r3))


# ---- one backend goes away ---------------------------------------------------------------


async def test_a_backend_lost_takes_only_what_ran_on_it(make: Callable[..., Harness]) -> None:
    """A call whose connection drops fails its own requests UNAVAILABLE (they may have
    run) and marks that backend down; the queue goes on to the other, nothing is lost;
    the lost one rejoins when its probe says it is ready, and takes batches again."""
    h = make()
    on0, on1 = h.submit("a"), h.submit("b")
    await h.settle()
    assert sent_to(h) == [[ids(on0)], [ids(on1)]]
    queued = [h.submit(t) for t in ("a", "b", "c")]
    await h.settle()
    h.tritons[0].sent[0].fail(lost())
    await h.settle()
    assert unavailable(h, on0)
    assert not h.backends[0].available and h.backends[1].available and h.pool is not None
    assert h.pool.available and not h.pool.gave_up
    assert len(h.tritons[0].sent) == 1  # nothing more to the one that is down
    h.tritons[1].sent[0].ok()
    await h.settle()
    assert served(h, on1)
    assert sent_to(h)[1][1] == ids(*queued)  # the queue, on the backend that is there
    h.tritons[1].sent[1].ok()
    await h.settle()
    assert all(served(h, r) for r in queued)
    # It comes back: its probe says so, and it takes its share again.
    h.probes[0].ready = True
    await h.advance(h.backends[0].probe_interval_s)
    assert h.backends[0].available
    again = [h.submit("a"), h.submit("b")]
    await h.settle()
    assert [len(t.sent) for t in h.tritons] == [2, 3]
    for t in h.tritons:
        t.sent[-1].ok()
    await h.settle()
    assert all(served(h, r) for r in again)


async def test_a_batch_that_never_reached_a_backend_goes_to_another(
    make: Callable[..., Harness],
) -> None:
    """Refused by a backend that is not there (never sent): the batch is held and goes
    at once to the other backend, which serves it; its clients see no error."""
    h = make(instances=2)
    first = h.submit("a")
    await h.settle()
    assert sent_to(h) == [[ids(first)], []]
    h.tritons[0].sent[0].fail(refused())
    await h.settle()
    assert not h.backends[0].available
    assert sent_to(h)[1] == [ids(first)]  # the same batch, on the other backend
    h.tritons[1].sent[0].ok()
    await h.settle()
    assert served(h, first)
    assert h.runtime.running == [0, 0] and h.runtime.idle


async def test_the_endpoint_gives_up_only_when_every_backend_has(
    make: Callable[..., Harness],
) -> None:
    """max_outage_s counts from when the last backend went down: one down for longer
    changes nothing while another serves; all down, what waits is held (its deadline
    still runs), and answered UNAVAILABLE once the whole pool has been down that long."""
    h = make(max_outage_s=10.0)
    assert h.pool is not None
    a = h.submit("a")
    await h.settle()
    h.tritons[0].sent[0].fail(refused())  # backend 0 goes down; a goes to backend 1
    await h.settle()
    await h.advance(8.0)
    h.tritons[1].sent[0].fail(refused())  # now both are down: a is held
    await h.settle()
    assert not h.pool.available and not unavailable_yet(h, a)
    await h.advance(5.0)  # backend 0 down 13 s, the pool 5 s
    assert h.backends[0].gave_up and not h.pool.gave_up
    assert h.answers(a) == []
    await h.advance(6.0)  # the pool 11 s: given up
    assert h.pool.gave_up
    assert unavailable(h, a)
    assert "unavailable for 1" in (h.answers(a)[0].fault.message or "")


def unavailable_yet(h: Harness, req: CoreRequest) -> bool:
    return bool(h.answers(req))


# ---- engine mode: grants name their backend ------------------------------------------------

LLM = ModelInfo(
    name="llm",
    max_batch_size=0,
    inputs={"text_input": TensorSpec("text_input", "BYTES", (1,))},
    outputs={"text_output": TensorSpec("text_output", "BYTES", (-1,))},
    decoupled=True,
)


class Shell:
    """Where grants go: kept, with each granted request."""

    def __init__(self) -> None:
        self.grants: list[Grant] = []
        self.answers: list[Answer] = []

    def answer(self, answer: Answer | Grant) -> None:
        if isinstance(answer, Grant):
            self.grants.append(answer)
        else:
            self.answers.append(answer)


class NoTriton:
    async def infer(self, *args: object, **kwargs: object) -> tuple[str, list[Tensor]]:
        raise AssertionError("llm is decoupled: its shell streams it")


def engine(slots: int) -> tuple[EngineDispatcher, Shell, BackendPool, list[Any]]:
    clock = StepClock()
    pool = BackendPool([Backend(clock), Backend(clock)], [NoTriton(), NoTriton()])
    done: list[Any] = []
    runtime = EngineDispatcher(
        plan=plan_of(
            Endpoint(cost=CostUnit.TOKENS, max_inflight=slots, token_output="text_output"),
            LLM,
            "llm",
        ),
        scheduler=Scheduler(
            EndpointPolicy(CostUnit.TOKENS, 0, None, None, ("paid",)),
            {t: TenantSpec("paid") for t in ("a", "b")},
            GlobalCaps(),
            fairness=VirtualTokenCounter(),
        ),
        pool=pool,
        clock=clock,
        on_done=lambda req, outcome, err, version: done.append((req.call.id, outcome)),
    )
    return runtime, Shell(), pool, done


def stream_request(n: int, tenant: str, shell: Shell) -> CoreRequest:
    text = Tensor("text_input", "BYTES", (1,), np.array([b"hi"], dtype=object))
    call = Call(
        n, tenant, 1, time.monotonic(), time.time(), 1, 1, 2, None,
        InferRequest("llm", id=f"r{n}", inputs=[text]), True, 0,
    )  # fmt: skip
    return CoreRequest(tenant, 1, 1, 2, 1, None, None, call=call, route=shell)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_grants_name_the_backend_and_a_lost_stream_frees_only_its_own() -> None:
    """Two backends of two slots: four grants, two per backend, each naming its backend;
    a stream that ends UNAVAILABLE marks its backend down: the next grant goes to the
    other one's freed slot only, and the endpoint is still served."""
    runtime, shell, pool, done = engine(slots=2)
    reqs = [stream_request(i, "ab"[i % 2], shell) for i in range(1, 7)]
    for r in reqs:
        runtime.submit(r)
    await settle()
    assert [g.backend for g in shell.grants] == [0, 1, 0, 1]
    assert runtime.running == [2, 2]
    failed: FrontendError = Unavailable("Socket closed")
    runtime.ended(reqs[0], "", failed, False)  # on backend 0
    await settle()
    assert not pool.backends[0].available
    assert len(shell.grants) == 4  # backend 0 is down: its freed slot takes nothing
    runtime.ended(reqs[1], "1", None, False)  # on backend 1
    await settle()
    assert [g.backend for g in shell.grants[4:]] == [1]
    assert (reqs[0].call.id, Outcome.FAILED) in done  # Triton's failure: its own alone
    assert (reqs[1].call.id, Outcome.DISPATCHED) in done
    for task in list(runtime._tasks):
        task.cancel()
    await settle()


async def test_a_stream_granted_to_a_triton_that_is_gone_is_granted_to_the_other() -> None:
    """Two backends of two slots: four streams granted, two queued. The shells of both
    streams granted to backend 1 could not reach it (nothing of them reached a client:
    never sent): backend 1 is marked down, and each is held with its slot and granted
    again, ahead of the queue, to the next slot that frees on backend 0, and served
    there. Each request is counted once, served; the slots stay exact throughout."""
    runtime, shell, pool, done = engine(slots=2)
    reqs = [stream_request(i, "ab"[i % 2], shell) for i in range(1, 7)]
    for r in reqs:
        runtime.submit(r)
    await settle()
    assert [(g.id, g.backend) for g in shell.grants] == [(1, 0), (2, 1), (3, 0), (4, 1)]
    runtime.ended(reqs[1], "", refused(), False)  # call 2, on backend 1
    await settle()
    assert not pool.backends[1].available and pool.backends[0].available
    assert runtime.running == [2, 1] and runtime.inflight == 4  # its slot held, off backend 1
    runtime.ended(reqs[3], "", refused(), False)  # call 4, on backend 1
    await settle()
    assert runtime.running == [2, 0] and runtime.inflight == 4
    assert len(shell.grants) == 4 and not shell.answers and not done  # held: not answered
    for served, regranted, held in ((0, 2, 1), (2, 4, 0)):  # a slot on 0 frees: a held takes it
        runtime.ended(reqs[served], "1", None, False)
        await settle()
        assert (shell.grants[-1].id, shell.grants[-1].backend) == (regranted, 0)
        assert runtime.running == [2, 0] and runtime.inflight == 2 + held
    for r in (reqs[1], reqs[3]):  # then the queue, on backend 0 alone
        runtime.ended(r, "1", None, False)
        await settle()
    assert [(g.id, g.backend) for g in shell.grants[4:]] == [(2, 0), (4, 0), (5, 0), (6, 0)]
    assert runtime.running == [2, 0] and runtime.scheduler.queued_requests == 0
    for r in reqs[4:]:
        runtime.ended(r, "1", None, False)
    await settle()
    assert sorted(done) == [(i, Outcome.DISPATCHED) for i in range(1, 7)]  # each once
    assert not shell.answers and runtime.running == [0, 0] and runtime.inflight == 0
    assert not runtime._tasks and not runtime._held


# ---- sequences stay where their state is ---------------------------------------------


def in_sequence(h: Harness, tenant: str, sequence_id: int, *, start: bool = False) -> CoreRequest:
    """A request of a stateful model's sequence (under the id Triton sees: the core's)."""
    call = h.call(tenant)
    call.request.sequence = {"sequence_id": sequence_id, "sequence_start": start}
    req = h.request(call)
    h.runtime.submit(req)
    return req


async def test_a_sequence_stays_on_the_backend_that_holds_its_state(
    make: Callable[..., Harness],
) -> None:
    """Each sequence's requests go where its first one went, waiting for a slot there (the
    next in line waits, as at a tenant's cap); when that backend is lost, the sequence's
    requests fail UNAVAILABLE (its state went with it) and the other sequences go on."""
    h = make(endpoint=Endpoint(max_batch_size=1), sequence_batching=True)
    s7 = in_sequence(h, "a", 7, start=True)
    s8 = in_sequence(h, "b", 8, start=True)
    await h.settle()
    assert sent_to(h) == [[ids(s7)], [ids(s8)]]
    s7b = in_sequence(h, "a", 7)
    s8b = in_sequence(h, "b", 8)
    await h.settle()
    h.tritons[1].sent[0].ok()  # backend 1 is free, but the next in line is 7's: backend 0's
    await h.settle()
    assert sent_to(h) == [[ids(s7)], [ids(s8)]]
    h.tritons[0].sent[0].ok()
    await h.settle()
    assert sent_to(h) == [[ids(s7), ids(s7b)], [ids(s8), ids(s8b)]]
    s7c = in_sequence(h, "a", 7)
    s8c = in_sequence(h, "b", 8)
    await h.settle()
    h.tritons[0].sent[1].fail(lost())  # backend 0 goes away with sequence 7's state
    await h.settle()
    assert unavailable(h, s7b) and unavailable(h, s7c)
    assert "holds this request's sequence" in (h.answers(s7c)[0].fault.message or "")
    h.tritons[1].sent[1].ok()
    await h.settle()
    assert sent_to(h)[1][-1] == ids(s8c)  # sequence 8 goes on where it was
    h.tritons[1].sent[2].ok()
    await h.settle()
    assert all(served(h, r) for r in (s7, s8, s8b, s8c))
    assert len(h.tritons[0].sent) == 2


async def test_a_new_leader_sends_each_sequence_to_the_backend_that_holds_its_state(
    make: Callable[..., Harness],
) -> None:
    """The pins a failed leader exported (``Pins.export``, carried by the
    fairness journal) are the new leader's: sequence 8, whose state is in backend 1, goes
    there though backend 0 is free and first in the round robin, where a leader without
    them (the control) sends it."""
    old = make(endpoint=Endpoint(max_batch_size=1), sequence_batching=True)
    s7 = in_sequence(old, "a", 7, start=True)
    s8 = in_sequence(old, "b", 8, start=True)
    await old.settle()
    assert sent_to(old) == [[ids(s7)], [ids(s8)]]
    pins = old.runtime.pins.export()
    assert pins == {7: 0, 8: 1}
    for resumed in (True, False):
        new = make(endpoint=Endpoint(max_batch_size=1), sequence_batching=True)
        if resumed:
            new.runtime.pins.resume(pins, new.clock.now())
        s8b = in_sequence(new, "b", 8)
        await new.settle()
        assert sent_to(new) == ([[], [ids(s8b)]] if resumed else [[ids(s8b)], []])
        s7b = in_sequence(new, "a", 7)
        await new.settle()
        if resumed:
            assert sent_to(new) == [[ids(s7b)], [ids(s8b)]]


# ---- the core: one pool for every endpoint --------------------------------------------------


class ReadyTriton(FakeTriton):
    """A fake Triton with an address, ready whenever asked."""

    def __init__(self, clock: StepClock, url: str) -> None:
        super().__init__(clock)
        self.url = url

    async def server_ready(self) -> bool:
        return True


async def test_the_core_serves_every_endpoint_from_its_pool_and_says_so_in_its_gauges() -> None:
    """``Core`` with two Tritons: each endpoint's batches go to both; the gauges name each
    backend; one down leaves the core accepting (the pool is there) and its batch goes to
    the other; back after its probe."""
    clock = StepClock()
    tritons = [ReadyTriton(clock, "t0:8001"), ReadyTriton(clock, "t1:8001")]
    config = parse_config(
        {
            "tiers": ["paid"],
            "tier_models": {"paid": ["*"]},
            "tenants": {"a": {"tier": "paid", "api_keys": ["a-test-key"]}},
            "default_endpoint": {"throttle": False},
        }
    )
    core = Core(config, cast(list[BackendServer], tritons), clock=clock, wall=lambda: 1.7e9)
    core._runtime(MODEL, embed_info())
    shell = Shell()

    def submit(n: int) -> None:
        data = np.full((1, 3), n, dtype=np.int32)
        request = InferRequest(
            model=MODEL, id=f"r{n}", inputs=[Tensor("INPUT_IDS", "INT32", (1, 3), data)]
        )
        call = Call(n, "a", 1, clock.now(), 1.7e9, 1, 3, request.nbytes, None, request)
        assert core.submit(call, shell) is not None

    def gauge(name: str, backend: str) -> float:
        return sum(
            v
            for n, labels, v in core.state_samples()
            if n == name and labels.get("backend") == backend
        )

    try:
        submit(1)
        await settle()
        submit(2)
        await settle()
        assert [t.batches() for t in tritons] == [[["r1"]], [["r2"]]]
        assert gauge("fair_triton_backend_inflight", "t0:8001") == 1.0
        assert gauge("fair_triton_backend_inflight", "t1:8001") == 1.0
        tritons[0].sent[0].fail(refused())  # never reached it: to the other one
        await settle()
        assert not core.pool.backends[0].available and core.pool.available
        assert gauge("fair_triton_backend_available", "t0:8001") == 0.0
        assert gauge("fair_triton_backend_available", "t1:8001") == 1.0
        submit(3)  # still accepted: the pool is there
        tritons[1].sent[0].ok()
        await settle()
        assert tritons[1].batches()[1] == ["r1"]  # the held batch goes first, alone
        tritons[1].sent[1].ok()
        await settle()
        assert tritons[1].batches()[2] == ["r3"]
        tritons[1].sent[2].ok()
        await settle()
        assert sorted(a.id for a in shell.answers if a.fault is None) == [1, 2, 3]
        clock.advance(1.0)  # its probe: ready
        await settle()
        assert core.pool.backends[0].available
    finally:
        await core.shutdown(grace_s=0.1)


async def test_a_cores_open_sequences_carry_their_backends_to_the_next_leader() -> None:
    """``Carried.export_sequences``: each open sequence with the Triton of the pool that holds
    its state; ``resume_sequences`` on a core that has not set the endpoint up yet: the
    pins wait for it, and its dispatcher starts with them."""
    clock = StepClock()
    config = parse_config(
        {
            "tiers": ["paid"],
            "tier_models": {"paid": ["*"]},
            "tenants": {"a": {"tier": "paid", "api_keys": ["a-test-key"]}},
            "default_endpoint": {"throttle": False, "max_batch_size": 1},
        }
    )
    info = embed_info(sequence_batching=True)
    urls = ("t0:8001", "t1:8001")
    cores = [
        Core(
            config,
            cast(list[BackendServer], [ReadyTriton(clock, url) for url in urls]),
            clock=clock,
            wall=lambda: 1.7e9,
        )
        for _ in range(2)
    ]
    old, new = cores
    old._runtime(MODEL, info)
    try:
        for n in (7, 8):
            data = np.full((1, 3), n, dtype=np.int32)
            request = InferRequest(
                model=MODEL, id=f"r{n}", inputs=[Tensor("INPUT_IDS", "INT32", (1, 3), data)]
            )
            request.sequence = {"sequence_id": n, "sequence_start": True}
            call = Call(n, "a", 1, clock.now(), 1.7e9, 1, 3, request.nbytes, None, request)
            assert old.submit(call, Shell()) is not None
            await settle()
        carried = old.carried.export_sequences()
        assert carried == {
            MODEL: [OpenSequence("a", 7, 7, backend=0), OpenSequence("a", 8, 8, backend=1)]
        }
        new.carried.resume_sequences(carried)
        assert new.sequences.open_sequences(MODEL, "a") == 2
        new._runtime(MODEL, info)
        pins = new.runtimes[MODEL].pins
        assert pins is not None and pins.export() == {7: 0, 8: 1}
    finally:
        for core in cores:
            await core.shutdown(grace_s=0.1)


async def test_a_new_leader_starts_with_the_tritons_the_old_one_found_down() -> None:
    """``Carried.export_down`` / ``resume_down``: a Triton the old leader could not reach
    starts down at the new one: no batch goes to it (where the round robin would send
    every other one) until the new leader's own probe finds it back."""
    clock = StepClock()
    config = parse_config(
        {
            "tiers": ["paid"],
            "tier_models": {"paid": ["*"]},
            "tenants": {"a": {"tier": "paid", "api_keys": ["a-test-key"]}},
            "default_endpoint": {"throttle": False},
        }
    )
    urls = ("t0:8001", "t1:8001")
    fakes = [[ReadyTriton(clock, url) for url in urls] for _ in range(2)]
    old, new = (
        Core(config, cast(list[BackendServer], t), clock=clock, wall=lambda: 1.7e9) for t in fakes
    )
    try:
        assert old.carried.export_down() == []
        old.pool.backends[1].mark_down()
        assert old.carried.export_down() == ["t1:8001"]
        new.carried.resume_down(old.carried.export_down())
        new._runtime(MODEL, embed_info())
        shell = Shell()
        for n in (1, 2):
            data = np.full((1, 3), n, dtype=np.int32)
            request = InferRequest(
                model=MODEL, id=f"r{n}", inputs=[Tensor("INPUT_IDS", "INT32", (1, 3), data)]
            )
            call = Call(n, "a", 1, clock.now(), 1.7e9, 1, 3, request.nbytes, None, request)
            assert new.submit(call, shell) is not None
            await settle()
        assert [t.batches() for t in fakes[1]] == [[["r1"]], []]  # r2 waits for t0
        assert not new.pool.backends[1].available
        clock.advance(1.0)  # the new leader's probe: t1 answers
        await settle()
        assert new.pool.backends[1].available
    finally:
        for core in (old, new):
            await core.shutdown(grace_s=0.1)


# ---- what crosses to the shells -----------------------------------------------------------


def test_a_grant_names_its_backend_and_the_shells_learn_the_pool_over_the_socket() -> None:
    """A shell process streams a grant from the Triton it names: the index crosses the
    socket, as does the pool's list of addresses in its settings (and settings of a core
    from before pools, without the list, still decode: the one Triton)."""
    from fair_frontend.wire.framing import encode, to_shell
    from fair_frontend.wire.records import Settings

    grant = to_shell.decode(encode(Grant(5, {"sequence_id": 3}, 0.25, backend=1))[4:])
    assert isinstance(grant, Grant) and grant.backend == 1 and grant.sequence == {"sequence_id": 3}
    settings = to_shell.decode(encode(Settings({}, {}, "a:8001", ["a:8001", "b:8001"]))[4:])
    assert isinstance(settings, Settings) and settings.triton_urls == ["a:8001", "b:8001"]
    grant = to_shell.decode(encode(Grant(6))[4:])
    assert isinstance(grant, Grant) and grant.backend == 0
    settings = to_shell.decode(encode(Settings({}, {}, "a:8001"))[4:])
    assert isinstance(settings, Settings) and settings.triton_urls == []


# ---- every request answered exactly once, whatever the backends do -----------------------

POOL_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"),
            st.sampled_from(("a", "b", "c")),
            st.integers(1, 12),
            st.sampled_from([None, None, 0.05, 0.3]),  # timeout (s)
        ),
        st.tuples(st.just("cancel"), st.integers(0, 63)),
        st.tuples(st.just("ok"), st.integers(0, 7)),
        st.tuples(st.just("model_error"), st.integers(0, 7)),
        st.tuples(st.just("down"), st.integers(0, 7)),  # never reached its Triton
        st.tuples(st.just("down"), st.integers(0, 7)),
        st.tuples(st.just("lost"), st.integers(0, 7)),  # Unavailable after it was sent
        st.tuples(st.just("advance"), st.sampled_from([0.001, 0.01, 0.1, 0.25, 0.6, 1.5])),
        st.tuples(st.just("ready"), st.integers(0, 2), st.sampled_from([True, False, False])),
    ),
    min_size=20,
    max_size=60,
)


async def play(
    backends: int, instances: int, ops: list[tuple[Any, ...]]
) -> tuple[Harness, list[CoreRequest], set[int]]:
    h = Harness(max_outage_s=0.5, backends=backends, instances=instances)
    reqs: list[CoreRequest] = []
    gone: set[int] = set()
    cap = h.runtime.max_inflight
    try:
        for op, *args in ops:
            pending = [s for t in h.tritons for s in t.pending]
            if op == "submit":
                tenant, rows, timeout_s = args
                reqs.append(h.submit(tenant, rows=rows, timeout_s=timeout_s))
            elif op == "cancel" and reqs:
                req = reqs[args[0] % len(reqs)]
                if not req.answered:
                    gone.add(req.call.id)
                h.runtime.cancel(req)
            elif op in ("ok", "model_error", "down", "lost") and pending:
                sent = pending[args[0] % len(pending)]
                if op == "ok":
                    sent.ok()
                elif op == "model_error":
                    sent.fail(UpstreamError("model failed", grpc.StatusCode.INTERNAL, 500))
                elif op == "down":
                    sent.fail(refused())
                else:
                    sent.fail(lost())
            elif op == "advance":
                await h.advance(args[0])
            elif op == "ready":
                h.probes[args[0] % backends].ready = args[1]
            await h.settle()
            # Each Triton has at most its own slots' batches (no service data: no early
            # send); a batch being bisected holds its slot between its calls.
            for t, running in zip(h.tritons, h.runtime.running, strict=True):
                assert len(t.pending) <= running <= cap
        for probe in h.probes:
            probe.ready = True
        for _ in range(1000):
            for t in h.tritons:
                for sent in t.pending:
                    sent.ok()
            await h.advance(h.backend.probe_interval_s)
            if h.runtime.idle and not h.runtime._held and not any(t.pending for t in h.tritons):
                break
        await h.advance(10.0)
        return h, reqs, gone
    finally:
        await h.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(backends=st.sampled_from([2, 3]), instances=st.sampled_from([1, 2]), ops=POOL_OPS)
def test_every_request_is_answered_exactly_once_over_a_pool(
    backends: int, instances: int, ops: list[tuple[Any, ...]]
) -> None:
    """Random submits, cancels, answers, failures (model errors, Tritons refusing or
    dropping calls), probes and time over a pool: every request ends exactly once, served
    with its own rows or with an error whose outcome it is; no Triton ever holds more
    than its slots; the counters add up."""
    h, reqs, gone = asyncio.run(play(backends, instances, ops))
    assert h.runtime.idle and h.runtime.inflight == 0 and h.runtime.running == [0] * backends
    for req in reqs:
        answers = h.answers(req)
        done = [f for f in h.finished if f.req is req]
        assert len(done) == 1, f"on_done called {len(done)} times for {req.call.request.id}"
        if req.call.id in gone:
            assert answers == [] and done[0].outcome is Outcome.CANCELLED
            continue
        (answer,) = answers
        if answer.fault is None:
            assert done[0].outcome is Outcome.DISPATCHED
            assert np.all(answer.outputs[0].data == req.call.id)
        else:
            assert Outcome(answer.fault.outcome) is done[0].outcome is not Outcome.CANCELLED
    c = h.scheduler.counters
    assert c.admitted == len(reqs) == c.dispatched + c.expired + c.cancelled
