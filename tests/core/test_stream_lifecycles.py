"""Every call's life, however its client and its stream end: a real ``Core`` behind the
in-process link (``LocalLink``, the intake, each call's ``Inbox``) on a fake clock, the
decoupled ``llm`` in engine mode with two slots and queues of three a tenant, driven by
programs hypothesis draws: calls submitted (some with a deadline), the loop let run a few
turns at a time (so a client may go away at any point of its call: in the intake, queued,
between its grant's arrival and its read, while relaying), streams served, failed by the
model or given back (their Triton gone), time moved on (deadlines pass, a Triton marked
down comes back).

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

import grpc
import numpy as np
from dispatch_support import StepClock
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fair_frontend.backends.protocol import BackendServer
from fair_frontend.config import parse_config
from fair_frontend.core.service import Core
from fair_frontend.core.shells import Intake
from fair_frontend.errors import Unavailable, UpstreamError
from fair_frontend.models import ModelInfo, TensorSpec
from fair_frontend.observability.observe import Observer
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.shell.link import Inbox, LocalLink
from fair_frontend.wire.records import Answer, Call, Grant

LLM = "llm"
LLM_INFO = ModelInfo(
    name=LLM,
    max_batch_size=0,
    inputs={"text_input": TensorSpec("text_input", "BYTES", (1,))},
    outputs={"text_output": TensorSpec("text_output", "BYTES", (-1,))},
    decoupled=True,
)
TENANTS = ("a", "b")
SLOTS = 2
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
                else:
                    inbox.end("", UpstreamError("the model's error", grpc.StatusCode.INTERNAL, 500))
                self.ended = command
                return
            self.answers.append(answer)
        finally:
            inbox.cancel()  # the client went away: a no-op once answered or ended


class World:
    def __init__(self) -> None:
        self.clock = StepClock()
        self.finishes = Finishes()
        self.core = Core(
            config(),
            cast(BackendServer, Triton()),
            clock=self.clock,
            wall=lambda: 1.7e9 + self.clock.now(),
            observers=[self.finishes],
        )
        self.core._runtime(LLM, LLM_INFO)
        self.runtime = self.core.runtimes[LLM]
        self.link = LocalLink(self.core, Intake(self.core))
        self.reached: set[str] = set()  # request ids of the calls the core took
        submit = self.core.submit

        def recorded(call: Call, route: Any, *, judged: bool = False) -> Any:
            self.reached.add(call.request.id)
            return submit(call, route, judged=judged)

        self.core.submit = recorded  # type: ignore[method-assign]
        self.clients: list[Client] = []
        self._ids = itertools.count(1)

    def submit(self, tenant: str, timeout_us: int | None) -> Client:
        i = next(self._ids)
        text = Tensor("text_input", "BYTES", (1,), np.array([b"hi"], dtype=object))
        request = InferRequest(LLM, id=f"{tenant}:{i}", inputs=[text], timeout_us=timeout_us)
        call = Call(
            i, tenant, 1, self.clock.now(), 1.7e9 + self.clock.now(), 1, 6, 2, None, request,
            True, 4,
        )  # fmt: skip
        client = Client(call)
        client.task = asyncio.get_running_loop().create_task(client.run(self.link))
        self.clients.append(client)
        return client

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


SUBMIT = st.tuples(st.just("submit"), st.sampled_from(TENANTS), st.sampled_from(TIMEOUTS_US))
ACTIONS = st.one_of(
    SUBMIT,
    SUBMIT,  # twice as likely: queues fill to their caps
    st.tuples(st.just("turns"), st.integers(0, 3)),
    st.tuples(st.sampled_from(["serve", "fail", "again", "gone"]), st.integers(0, 15)),
    st.tuples(st.just("advance"), st.sampled_from([0.01, 0.1, 1.0])),
)


async def play(program: list[tuple[Any, ...]]) -> World:
    world = World()
    for action in program:
        kind = action[0]
        if kind == "submit":
            world.submit(action[1], action[2])
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
        else:  # a granted stream: served, failed by the model, or its Triton gone
            relaying = world.relaying()
            if relaying:
                relaying[action[1] % len(relaying)].commands.put_nowait(kind)
    # Then every stream is served, and time moves on, until every client is done.
    for _ in range(200):
        if not world.live():
            break
        for client in world.relaying():
            client.commands.put_nowait("serve")
        await world.advance(1.0)
    return world


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(ACTIONS, max_size=80))
def test_every_call_ends_once_and_no_slot_outlives_its_stream(
    program: list[tuple[Any, ...]],
) -> None:
    async def main() -> None:
        world = await play(program)
        assert not world.live(), "clients still waiting after every stream was served"
        for client in world.clients:
            told = world.finishes.ends[client.rid]
            if client.rid in world.reached:
                assert told == 1, (client.rid, told, client)
            else:
                assert told == 0, (client.rid, told)
            assert len(client.answers) <= 1
        runtime = world.runtime
        assert runtime.inflight == 0 and not runtime._tasks, (runtime.inflight, runtime._tasks)
        assert runtime.scheduler.queued_requests == 0
        # The model is not stopped for anyone: a new call gets a slot.
        fresh = world.submit("a", None)
        await world.advance(0.1)
        assert fresh.grants == 1 and fresh.waiting, fresh
        fresh.commands.put_nowait("serve")
        await world.advance(0.1)
        assert fresh.ended == "serve"

    asyncio.run(main())
