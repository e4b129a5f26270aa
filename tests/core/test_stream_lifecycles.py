"""Every call's life, however its client and its stream end: a real ``Core`` behind the
in-process link (``LocalLink``, the intake, each call's ``Inbox``) on a fake clock, with
small queues (caps reached often), driven by programs hypothesis draws: calls submitted
(some with a deadline), the loop let run a few turns at a time (so a client may go away at any point
of its call: in the intake, queued, between its answer's arrival and its read, while its
stream is relayed), time moved on (deadlines pass, a Triton marked down comes back).

* Streams: the decoupled ``llm`` in engine mode with three slots (one reserved from any
  one tenant, one light: kept for a program that holds none), calls naming programs or
  not; granted streams served, failed by the model, given back (their Triton gone
  before their first token) or lost after it.
* Batches: ``embed`` batched by the core (at most 4 rows, two instances), single calls
  and API calls of several parts (queued a part per loop turn here), relayed to a Triton
  stand-in whose calls the program answers: served, failed by the model (the batch then
  bisected), not reached (held for Triton's return) or lost after they were sent.

What must hold whatever the order (the brief: every admitted request gets exactly one
answer, and no request may stop a model for others):

* each call that reached the core is finished there exactly once (its one outcome), and
  none that did not (gone while still in the intake);
* once every client is done, no slot is held and nothing is queued;
* a call sent after all that is granted a slot.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast
from unittest import mock

import grpc
import numpy as np
from dispatch_support import LLM, LLM_INFO, FakeTriton, StepClock, embed_info
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fair_frontend.backends.protocol import BackendServer
from fair_frontend.config import parse_config
from fair_frontend.core import dispatch
from fair_frontend.core.service import Core
from fair_frontend.core.shells import Intake
from fair_frontend.errors import Unavailable, UpstreamError
from fair_frontend.models import ModelInfo
from fair_frontend.observability.observe import Observer
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.shell.link import Inbox, LocalLink
from fair_frontend.wire.records import Answer, Call, Grant

EMBED = "embed"
TENANTS = ("a", "b")
SLOTS = 3
MAX_QUEUED = 3
TIMEOUTS_US = (None, 50_000, 500_000)  # a call's timeout: none, 50 ms, 500 ms


def config() -> Any:
    return parse_config(
        {
            "tiers": ["paid"],
            "tier_models": {"paid": ["*"]},
            "tenants": {
                t: {"tier": "paid", "api_keys": [f"{t}-test-key"], "max_queued": MAX_QUEUED}
                for t in TENANTS
            },
            "default_endpoint": {"throttle": False},
            "endpoints": {
                LLM: {
                    "cost": "tokens",
                    "max_inflight": SLOTS,
                    "reserved_slots": 1,  # no tenant holds more than two
                    "light_slots": 1,  # the last free one: for a program holding none
                    "token_output": "text_output",
                    "throttle": False,
                },
            },
        }
    )


class Triton:
    """The core never calls Triton for a decoupled model (its shells do); its probe of a
    Triton marked down finds it ready."""

    async def server_ready(self) -> bool:
        return True


class Finishes(Observer):
    """Each request's ends, by request id."""

    def __init__(self) -> None:
        self.ends: Counter[str] = Counter()

    def request_finished(self, *, request_id: str = "", **_: Any) -> None:
        self.ends[request_id] += 1


@dataclass(eq=False)
class Client:
    """One call and what its client saw; its shell's side runs as ``run`` does (the
    gateway's ``_handle`` and the relay, reduced to the inbox's protocol)."""

    call: Call
    commands: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    inbox: Inbox | None = None
    task: asyncio.Task[None] | None = None
    answers: list[Answer] = field(default_factory=list)
    grants: int = 0
    waiting: bool = False  # relaying a granted stream: waits for the test's command
    ended: str = ""  # served, failed

    @property
    def rid(self) -> str:
        return self.call.request.id

    async def run(self, link: LocalLink) -> None:
        inbox = self.inbox = link.submit(self.call)
        try:
            answer = await inbox.get()
            while isinstance(answer, Grant):
                self.grants += 1
                self.waiting = True
                command = await self.commands.get()
                self.waiting = False
                if command == "again":  # its Triton gone before any token: given back
                    inbox.again(Unavailable("Triton is gone", never_sent=True))
                    answer = await inbox.get()
                    continue
                if command == "serve":
                    inbox.produced(2, 0.01, -1.0)
                    inbox.end("1")
                elif command == "lost":  # its Triton gone after a token had reached the client
                    inbox.produced(1, 0.01, -1.0)
                    inbox.end("", Unavailable("Triton is unavailable: the connection closed"))
                else:
                    inbox.end("", UpstreamError("the model's error", grpc.StatusCode.INTERNAL, 500))
                self.ended = command
                return
            self.answers.append(answer)
        finally:
            inbox.cancel()  # the client went away: a no-op once answered or ended


class World:
    """A ``Core`` serving ``model`` on a fake clock, its calls from ``Client`` tasks
    through a ``LocalLink``; which calls reached the core, and each request's ends."""

    clock: StepClock  # set by the subclass first (its Triton reads it)

    def __init__(self, cfg: Any, model: str, info: ModelInfo, triton: Any) -> None:
        self.finishes = Finishes()
        self.core = Core(
            cfg,
            cast(BackendServer, triton),
            clock=self.clock,
            wall=lambda: 1.7e9 + self.clock.now(),
            observers=[self.finishes],
        )
        self.core._runtime(model, info)
        self.runtime = self.core.runtimes[model]
        self.link = LocalLink(self.core, Intake(self.core))
        self.reached: set[str] = set()  # request ids of the calls the core took
        submit = self.core.submit

        def recorded(call: Call, route: Any, *, judged: bool = False) -> Any:
            self.reached.add(call.request.id)
            return submit(call, route, judged=judged)

        self.core.submit = recorded  # type: ignore[method-assign]
        submit_group = self.core.submit_group

        def recorded_group(group: Any, route: Any) -> Any:
            self.reached.update(call.request.id for call in group.calls)
            return submit_group(group, route)

        self.core.submit_group = recorded_group  # type: ignore[method-assign]
        self.clients: list[Client] = []
        self._ids = itertools.count(1)

    def new_client(self, call: Call) -> Client:
        raise NotImplementedError

    def request(self, tenant: str, i: int, timeout_us: int | None) -> InferRequest:
        raise NotImplementedError

    def answer(self, how: str, k: int) -> None:
        """Triton's side of one call or stream: served, failed by the model, gone
        before it was reached (``again``), or lost after it was sent."""
        raise NotImplementedError

    def serve_all(self) -> None:
        """Everything Triton holds, served."""
        raise NotImplementedError

    def submit(self, tenant: str, timeout_us: int | None, program: str = "") -> Client:
        i = next(self._ids)
        request = self.request(tenant, i, timeout_us)
        call = Call(
            i, tenant, 1, self.clock.now(), 1.7e9 + self.clock.now(), 1, 6, 2, None, request,
            self.streams, 4 if self.streams else 0, program=program,
        )  # fmt: skip
        client = self.new_client(call)
        client.task = asyncio.get_running_loop().create_task(client.run(self.link))
        self.clients.append(client)
        return client

    @property
    def streams(self) -> bool:
        return bool(self.runtime.info.decoupled)

    def live(self) -> list[Client]:
        return [c for c in self.clients if c.task is not None and not c.task.done()]

    def relaying(self) -> list[Client]:
        return [c for c in self.live() if c.waiting and c.commands.empty()]

    async def turns(self, n: int) -> None:
        for _ in range(n):
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        until = self.clock.now() + seconds
        await self.turns(20)
        while (due := self.clock.next_timer) is not None and due <= until:
            self.clock.advance_to(due)
            await self.turns(20)
        self.clock.advance_to(until)
        await self.turns(20)


SUBMIT = st.tuples(
    st.just("submit"),
    st.sampled_from(TENANTS),
    st.sampled_from(TIMEOUTS_US),
    st.sampled_from(["", "chat", "agent"]),  # the program it names (none: its tenant's)
)


class StreamWorld(World):
    def __init__(self) -> None:
        self.clock = StepClock()
        super().__init__(config(), LLM, LLM_INFO, Triton())

    def new_client(self, call: Call) -> Client:
        return Client(call)

    def request(self, tenant: str, i: int, timeout_us: int | None) -> InferRequest:
        text = Tensor("text_input", "BYTES", (1,), np.array([b"hi"], dtype=object))
        return InferRequest(LLM, id=f"{tenant}:{i}", inputs=[text], timeout_us=timeout_us)

    def answer(self, how: str, k: int) -> None:
        relaying = self.relaying()
        if relaying:
            relaying[k % len(relaying)].commands.put_nowait(how)

    def serve_all(self) -> None:
        for client in self.relaying():
            client.commands.put_nowait("serve")


class BatchTriton(FakeTriton):
    """``embed``'s Triton for the core: each call waits for the program's answer; its
    readiness probe finds it ready."""

    url = "http://triton"
    request_timeout_s = 60.0

    async def server_ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass


def batch_config() -> Any:
    return parse_config(
        {
            "tiers": ["paid"],
            "tier_models": {"paid": ["*"]},
            "tenants": {
                t: {"tier": "paid", "api_keys": [f"{t}-test-key"], "max_queued": 2 * MAX_QUEUED}
                for t in TENANTS
            },
            "default_endpoint": {"throttle": False},
            "endpoints": {EMBED: {"max_batch_size": 4, "throttle": False}},
        }
    )


class BatchClient(Client):
    async def run(self, link: LocalLink) -> None:
        inbox = self.inbox = link.submit(self.call)
        try:
            self.answers.append(cast(Answer, await inbox.get()))
        finally:
            inbox.cancel()


@dataclass(eq=False)
class GroupClient(Client):
    """An API call of several parts (an embeddings call's inputs, a rerank's documents):
    admitted all or none, each part answered; its client waits for them all."""

    parts: list[Call] = field(default_factory=list)

    async def run(self, link: LocalLink) -> None:
        inboxes = link.submit_group(self.parts)
        try:
            for inbox in inboxes:
                self.answers.append(cast(Answer, await inbox.get()))
        finally:
            for inbox in inboxes:
                inbox.cancel()


class BatchWorld(World):
    def __init__(self) -> None:
        self.clock = StepClock()
        self.triton = BatchTriton(self.clock)
        super().__init__(batch_config(), EMBED, embed_info(instances=2), self.triton)

    def new_client(self, call: Call) -> Client:
        return BatchClient(call)

    def request(self, tenant: str, i: int, timeout_us: int | None) -> InferRequest:
        ids = Tensor("INPUT_IDS", "INT32", (1, 3), np.array([[i, 1, 2]], dtype=np.int32))
        return InferRequest(EMBED, id=f"{tenant}:{i}", inputs=[ids], timeout_us=timeout_us)

    def answer(self, how: str, k: int) -> None:
        pending = self.triton.pending
        if not pending:
            return
        sent = pending[k % len(pending)]
        if how == "serve":
            sent.ok()
        elif how == "fail":  # the model's error: the batch is bisected
            sent.fail(UpstreamError("the model's error", grpc.StatusCode.INTERNAL, 500))
        elif how == "again":  # never reached Triton: held until it is back
            sent.fail(Unavailable("Triton is unavailable: not connected", never_sent=True))
        else:  # lost after it was sent
            sent.fail(Unavailable("Triton is unavailable: the connection closed"))

    def serve_all(self) -> None:
        for sent in self.triton.pending:
            sent.ok()

    def submit_group(self, tenant: str, parts: int) -> None:
        calls = []
        for _ in range(parts):
            i = next(self._ids)
            request = self.request(tenant, i, None)
            now = self.clock.now()
            calls.append(Call(i, tenant, 1, now, 1.7e9 + now, 1, 6, 2, None, request, requests=0))
        client = GroupClient(calls[0], parts=calls)
        client.task = asyncio.get_running_loop().create_task(client.run(self.link))
        self.clients.append(client)


ACTIONS = st.one_of(
    SUBMIT,
    SUBMIT,  # twice as likely: queues fill to their caps
    st.tuples(st.just("turns"), st.integers(0, 3)),
    st.tuples(st.sampled_from(["serve", "fail", "again", "lost", "gone"]), st.integers(0, 15)),
    st.tuples(st.just("advance"), st.sampled_from([0.01, 0.1, 1.0])),
    st.tuples(st.just("group"), st.sampled_from(TENANTS), st.integers(1, 5)),
)


async def play(world: World, program: list[tuple[Any, ...]]) -> World:
    for action in program:
        kind = action[0]
        if kind == "submit":
            world.submit(*action[1:])
        elif kind == "group":  # an API call of several parts, where the endpoint batches
            if isinstance(world, BatchWorld):
                world.submit_group(action[1], action[2])
        elif kind == "turns":
            await world.turns(action[1])
        elif kind == "advance":
            await world.advance(action[1])
        elif kind == "gone":  # a client goes away, wherever its call is
            live = world.live()
            if live:
                task = live[action[1] % len(live)].task
                assert task is not None
                task.cancel()
        else:
            world.answer(kind, action[1])
    # Then Triton serves everything, and time moves on, until every client is done and
    # nothing is left in Triton.
    for _ in range(200):
        if not world.live() and not world.runtime.inflight:
            break
        world.serve_all()
        await world.advance(1.0)
    return world


async def check(world: World) -> None:
    """Every call that reached the core ended there once, none that did not; no slot is
    held and nothing queued; a new call is served."""
    assert not world.live(), "clients still waiting after Triton served everything"
    for client in world.clients:
        parts = client.parts if isinstance(client, GroupClient) else [client.call]
        for call in parts:
            told = world.finishes.ends[call.request.id]
            if call.request.id in world.reached:
                assert told == 1, (call.request.id, told, client)
            else:
                assert told == 0, (call.request.id, told)
        assert len(client.answers) <= len(parts)
    runtime = world.runtime
    assert runtime.inflight == 0 and not runtime._tasks, (runtime.inflight, runtime._tasks)
    assert runtime.scheduler.queued_requests == 0
    # The model is not stopped for anyone: a new call is served.
    fresh = world.submit("a", None)
    for _ in range(3):
        await world.advance(0.1)
        world.serve_all()
    await world.advance(0.1)
    assert fresh.task is not None and fresh.task.done(), fresh
    assert fresh.ended == "serve" or (
        fresh.answers and fresh.answers[0].fault is None and not world.streams
    ), fresh


@settings(max_examples=300, deadline=None)
@given(st.lists(ACTIONS, max_size=80))
# Its client gone in the turn between the slot's grant and the grant's send.
@example([("submit", "a", None, ""), ("turns", 1), ("gone", 0)])
def test_every_stream_ends_once_and_no_slot_outlives_it(program: list[tuple[Any, ...]]) -> None:
    async def main() -> None:
        await check(await play(StreamWorld(), program))

    asyncio.run(main())


@settings(max_examples=300, deadline=None)
@given(st.lists(ACTIONS, max_size=80))
@example([("submit", "a", None, ""), ("turns", 1), ("gone", 0)])
# Its client gone while a part of its call still waits for its slice.
@example([("group", "a", 3), ("turns", 2), ("gone", 0)])
def test_every_batched_call_is_answered_once_and_no_batch_outlives_it(
    program: list[tuple[Any, ...]],
) -> None:
    async def main() -> None:
        await check(await play(BatchWorld(), program))

    # A call's parts are queued a slice per loop turn: one here, so that a client may go
    # away while some of its parts still wait for their turn.
    with mock.patch.object(dispatch, "PARTS_PER_SLICE", 1):
        asyncio.run(main())
