"""Builders for the dispatch tests: one model's runtime on a fake clock, a fake Triton.

Imported by the test modules beside it (pytest puts this directory on the path of a
test directory without ``__init__.py``). ``Harness`` wires a ``BatchDispatcher`` the
way ``Core._runtime`` and ``Core._new_request`` do, without the ``Core``: a
``Scheduler`` over a few paid tenants, a ``Backend`` whose readiness probe the test
answers (``Probe``), a ``FakeTriton`` forwarder whose every call waits for the test to
answer it (``Sent.ok`` / ``Sent.fail``), and a ``StepClock``.

Time moves only through ``Harness.advance``; the tasks the runtime creates run on the
test's event loop whenever the test lets it (``Harness.settle``), never during a sleep.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from fair_frontend.batching import ROWS_PARAMETER, batch_key
from fair_frontend.config import Config, Endpoint
from fair_frontend.core.admission import EndpointAdmission
from fair_frontend.core.batches import BatchDispatcher
from fair_frontend.core.clock import FakeClock, Timer
from fair_frontend.core.dispatch import Backend, BatchReport, CoreRequest
from fair_frontend.core.pool import BackendPool
from fair_frontend.endpoint import EndpointPlan, plan
from fair_frontend.errors import FrontendError
from fair_frontend.feedback import ServiceModel
from fair_frontend.models import ModelInfo, TensorSpec
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import Batch, InferRequest, ParamValue, Tensor
from fair_frontend.scheduler import EndpointPolicy, GlobalCaps, Scheduler, TenantSpec
from fair_frontend.wire.records import Answer, Call, Grant

MODEL = "embed"
WIDTH = 3  # tokens per row of INPUT_IDS
TIERS = ("paid", "trial")
TENANTS: Mapping[str, TenantSpec] = {name: TenantSpec("paid") for name in ("a", "b", "c")}
SETTLE_ROUNDS = 20  # loop iterations that let every runnable task reach its next await


def embed_info(*, instances: int = 1, sequence_batching: bool = False) -> ModelInfo:
    """The ``embed`` model: INT32 token ids in, a 4-float embedding per row out (with
    ``sequence_batching``: as a stateful model, its requests in sequences)."""
    return ModelInfo(
        name=MODEL,
        max_batch_size=32,
        inputs={"INPUT_IDS": TensorSpec("INPUT_IDS", "INT32", (-1,))},
        outputs={"EMBEDDING": TensorSpec("EMBEDDING", "FP32", (4,))},
        instances=instances,
        takes_rows=True,  # as model_repository/embed asks (the fake reads ids from fair_rows)
        sequence_batching=sequence_batching,
    )


LLM = "llm"
LLM_INFO = ModelInfo(
    name=LLM,
    max_batch_size=0,
    inputs={"text_input": TensorSpec("text_input", "BYTES", (1,))},
    outputs={"text_output": TensorSpec("text_output", "BYTES", (-1,))},
    decoupled=True,
)
"""The decoupled ``llm`` of the engine-mode tests: a prompt in, text out, streamed."""


def plan_of(endpoint: Endpoint, info: ModelInfo, model: str = MODEL) -> EndpointPlan:
    """``model``'s plan (``fair_frontend.endpoint.plan``) under a config of the tests'
    tiers whose entry for it is ``endpoint``: what a dispatcher is built from."""
    return plan(Config(tiers=list(TIERS), endpoints={model: endpoint}), model, info)


def endpoint_policy(endpoint: Endpoint, info: ModelInfo) -> EndpointPolicy:
    """``core.plan.endpoint_policy`` for a batching model, without a ``Config``."""
    configured = info.max_batch_size if endpoint.max_batch_size is None else endpoint.max_batch_size
    max_batch = min(configured, info.max_batch_size)
    return EndpointPolicy(
        cost=endpoint.cost,
        max_batch_size=max_batch,
        max_batch_tokens=endpoint.max_batch_tokens,
        quantum=endpoint.effective_quantum(max_batch),
        tiers=TIERS,
    )


# ---- the clock ----------------------------------------------------------------------------


class TimerStorm(AssertionError):
    """Timers kept firing without the fake time moving on: a busy loop on a real clock."""


class StepClock(FakeClock):
    """A ``FakeClock`` that fails a test instead of hanging it when timers re-arm at an
    instant that never moves on (``advance`` would loop for ever), and that can move to
    exactly the next timer's time."""

    MAX_FIRES_PER_INSTANT = 1000

    def __init__(self, start: float = 1000.0) -> None:
        super().__init__(start)
        self._instant = start
        self._fired = 0  # timers fired at the fake time ``_instant``

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        def counted() -> None:
            if self.now() != self._instant:
                self._instant, self._fired = self.now(), 0
            self._fired += 1
            if self._fired > self.MAX_FIRES_PER_INSTANT:
                raise TimerStorm(f"{self._fired} timers fired at t={self.now()}")
            callback()

        return super().call_at(when, counted)

    def advance_to(self, when: float) -> None:
        """Move to ``when`` (not before), running every timer due by then."""
        step = when - self.now()
        if step <= 0:
            self.advance(0.0)
            return
        while self.now() + step < when:  # rounding: never stop one ulp short of a timer
            step = math.nextafter(step, math.inf)
        self.advance(step)


# ---- the fake Triton ---------------------------------------------------------------------


@dataclass(eq=False)
class Sent:
    """One call to the fake Triton: the batch it was given, and its pending answer."""

    ids: list[str]  # the requests' ids, in batch order (from the fair_rows parameter)
    tenants: list[str]  # each request's tenant
    rows: int
    request_id: str  # Triton's request id: the request's own when it goes alone
    at: float  # the fake clock's time when it was sent
    inputs: list[Tensor]
    reply: asyncio.Future[tuple[str, list[Tensor]]]

    @property
    def answered(self) -> bool:
        return self.reply.done()

    def ok(self, version: str = "1") -> None:
        """Answer as the embed model: each row's embedding is its first token id, 4 times."""
        ids = self.inputs[0].data[:, 0].astype(np.float32)
        data = np.repeat(ids[:, None], 4, axis=1)
        self.reply.set_result((version, [Tensor("EMBEDDING", "FP32", tuple(data.shape), data)]))

    def fail(self, err: FrontendError) -> None:
        self.reply.set_exception(err)


class FakeTriton:
    """A ``Forwarder`` whose every ``infer`` waits until the test answers it."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.sent: list[Sent] = []

    @property
    def pending(self) -> list[Sent]:
        return [s for s in self.sent if not s.answered]

    def batches(self) -> list[list[str]]:
        """Every batch sent so far, as request ids."""
        return [s.ids for s in self.sent]

    async def infer(self, batch: Batch) -> tuple[str, list[Tensor]]:
        return await self.record(
            batch.model, batch.inputs, dict(batch.parameters), batch.request_id
        ).reply

    def record(
        self,
        model: str,
        inputs: Sequence[Tensor],
        parameters: dict[str, ParamValue],
        request_id: str,
    ) -> Sent:
        """A call as it reaches Triton: kept in ``sent``, its answer pending."""
        assert model == MODEL
        rows = json.loads(str(parameters[ROWS_PARAMETER]))
        ids: list[str] = []
        tenants: list[str] = []
        for rid, tenant in zip(rows["id"], rows["tenant"], strict=True):
            if not ids or ids[-1] != rid:  # a request's rows are consecutive
                ids.append(rid)
                tenants.append(tenant)
        assert inputs[0].shape[0] == len(rows["id"])
        reply: asyncio.Future[tuple[str, list[Tensor]]] = asyncio.get_running_loop().create_future()
        sent = Sent(
            ids, tenants, len(rows["id"]), request_id, self.clock.now(), list(inputs), reply
        )
        self.sent.append(sent)
        return sent


class MergingTriton(FakeTriton):
    """A Triton stand-in that batches as Triton's dynamic batcher does, for the bisection.

    Calls wait in its queue (``sent``, each ``Sent`` pending) until the test starts an
    execution on a free instance (``start``): the execution takes every call waiting then,
    in arrival order, up to ``max_rows`` rows (at least one call), as Triton merges the
    requests queued for a free instance into one ``execute``. ``finish`` ends one: a call
    whose token ids are in ``poisoned`` makes the model raise, which fails every call of
    that execution (the Python backend's behaviour); otherwise each call gets its own rows'
    embeddings. Calls that arrive while an execution runs wait for the next one."""

    def __init__(
        self, clock: FakeClock, *, instances: int = 1, max_rows: int = 32, error: Any = None
    ) -> None:
        super().__init__(clock)
        self.instances = instances
        self.max_rows = max_rows
        self.poisoned: set[int] = set()
        self.error = error  # what a failed execution raises (made per execution)
        self.waiting: list[Sent] = []
        self.running: list[list[Sent]] = []
        self.executions: list[list[str]] = []  # each execution's requests, by id

    def record(
        self,
        model: str,
        inputs: Sequence[Tensor],
        parameters: dict[str, ParamValue],
        request_id: str,
    ) -> Sent:
        sent = super().record(model, inputs, parameters, request_id)
        self.waiting.append(sent)
        return sent

    def start(self) -> bool:
        """Start an execution of what waits, if an instance is free; whether one started."""
        self.waiting = [s for s in self.waiting if not s.reply.cancelled()]
        if not self.waiting or len(self.running) >= self.instances:
            return False
        taken = [self.waiting.pop(0)]
        rows = taken[0].rows
        while self.waiting and rows + self.waiting[0].rows <= self.max_rows:
            rows += self.waiting[0].rows
            taken.append(self.waiting.pop(0))
        self.running.append(taken)
        self.executions.append([i for s in taken for i in s.ids])
        return True

    def finish(self, index: int = 0) -> None:
        """End the ``index``-th running execution: all its calls fail if one is poisoned."""
        calls = self.running.pop(index)
        bad = any(int(i) in self.poisoned for s in calls for i in s.inputs[0].data[:, 0])
        for s in calls:
            if s.reply.done():
                continue
            if bad:
                s.fail(self.error())
            else:
                s.ok()


class Probe:
    """Triton's readiness, as the test says it is; records when it was asked."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.ready = False
        self.calls: list[float] = []

    async def __call__(self) -> bool:
        self.calls.append(self.clock.now())
        return self.ready


class FixedService:
    """A stand-in for ``ServiceModel`` that has data: every batch takes ``seconds``."""

    has_data = True

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def predict_batch_seconds(self, rows: int | float, tokens: int | float) -> float:
        return self.seconds


# ---- the runtime under test --------------------------------------------------------------


@dataclass
class RecordingRoute:
    """Where answers go: kept in order of arrival."""

    name: str = "route"
    answers: list[Answer] = field(default_factory=list)

    def answer(self, answer: Answer | Grant) -> None:
        assert not isinstance(answer, Grant), "a grant: these models are not decoupled"
        self.answers.append(answer)


@dataclass(eq=False)
class Shell:
    """A shell's ``Route`` in front of a ``Core``: its answers and grants, kept in order."""

    name: str = "shell"
    answers: list[Answer] = field(default_factory=list)
    grants: list[Grant] = field(default_factory=list)

    def answer(self, answer: Answer | Grant) -> None:
        if isinstance(answer, Grant):
            self.grants.append(answer)
        else:
            self.answers.append(answer)


@dataclass(frozen=True)
class Finished:
    """One ``on_done`` call."""

    req: CoreRequest
    outcome: Outcome
    err: FrontendError | None
    version: str


class Harness:
    """One ``BatchDispatcher`` for ``embed``, wired as ``Core._runtime`` wires it."""

    def __init__(
        self,
        endpoint: Endpoint | None = None,
        *,
        instances: int = 1,
        service: FixedService | ServiceModel | None = None,
        probe_interval_s: float = 0.25,
        max_outage_s: float = 60.0,
        tenants: Mapping[str, TenantSpec] = TENANTS,
        backends: int = 1,
        sequence_batching: bool = False,
        triton: Callable[[FakeClock], FakeTriton] | None = None,
        dispatcher: type[BatchDispatcher] = BatchDispatcher,
    ) -> None:
        self.clock = StepClock()
        # ``backends`` Tritons in a pool (``core.pool``), each a fake with its own probe
        # (``triton``: what makes one; a ``FakeTriton`` by default);
        # ``triton``, ``probe``, ``backend``: the first one's (one: the only one's).
        self.tritons = [(triton or FakeTriton)(self.clock) for _ in range(backends)]
        self.probes = [Probe(self.clock) for _ in range(backends)]
        self.triton = self.tritons[0]
        self.probe = self.probes[0]
        self.info = embed_info(instances=instances, sequence_batching=sequence_batching)
        self.endpoint = endpoint or Endpoint()
        self.scheduler = Scheduler(endpoint_policy(self.endpoint, self.info), tenants, GlobalCaps())
        self.backends = [
            Backend(
                self.clock,
                probe=probe,
                probe_interval_s=probe_interval_s,
                max_outage_s=max_outage_s,
                name=f"triton{i}" if backends > 1 else "",
            )
            for i, probe in enumerate(self.probes)
        ]
        self.backend = self.backends[0]
        # One Triton: the dispatcher makes its pool of one itself (as before pools).
        self.pool = (
            BackendPool(self.backends, self.tritons, [b.name for b in self.backends])
            if backends > 1
            else None
        )
        admission = None
        if service is not None:
            admission = EndpointAdmission(
                service=cast(ServiceModel, service), throttle=None, tiers=TIERS
            )
        self.finished: list[Finished] = []
        self.reports: list[BatchReport] = []
        self.route = RecordingRoute()
        self.plan = plan_of(self.endpoint, self.info)
        self.runtime = dispatcher(
            plan=self.plan,
            scheduler=self.scheduler,
            forwarder=self.triton if self.pool is None else None,
            backend=self.backend if self.pool is None else None,
            pool=self.pool,
            clock=self.clock,
            admission=admission,
            on_batches=self.reports.extend,
            on_done=lambda req, outcome, err, v: self.finished.append(
                Finished(req, outcome, err, v)
            ),
        )
        self._ids = 0

    # ---- requests -----------------------------------------------------------------------

    def call(
        self, tenant: str = "a", *, rows: int = 1, timeout_s: float | None = None, priority: int = 1
    ) -> Call:
        """A validated call of ``rows`` rows; its token ids are all its call id."""
        self._ids += 1
        n = self._ids
        data = np.full((rows, WIDTH), n, dtype=np.int32)
        request = InferRequest(
            model=MODEL,
            id=f"r{n}",
            inputs=[Tensor("INPUT_IDS", "INT32", (rows, WIDTH), data)],
            priority=priority,
            timeout_us=round(timeout_s * 1e6) if timeout_s is not None else None,
        )
        return Call(
            id=n,
            tenant=tenant,
            priority=priority,
            arrived=self.clock.now(),
            arrived_wall=1.7e9 + self.clock.now(),
            rows=rows,
            tokens=rows * WIDTH,
            nbytes=request.nbytes,
            lengths=None,
            request=request,
        )

    def request(self, call: Call, route: RecordingRoute | None = None) -> CoreRequest:
        """``Core._new_request``: the core's record of a call."""
        return CoreRequest(
            call.tenant,
            call.rows,
            call.tokens,
            call.nbytes,
            call.priority,
            call.deadline,
            batch_key(call.request, self.plan),
            call=call,
            route=route or self.route,
        )

    def submit(
        self,
        tenant: str = "a",
        *,
        rows: int = 1,
        timeout_s: float | None = None,
        route: RecordingRoute | None = None,
    ) -> CoreRequest:
        req = self.request(self.call(tenant, rows=rows, timeout_s=timeout_s), route)
        self.runtime.submit(req)
        return req

    # ---- what happened to a request -----------------------------------------------------

    def answers(self, req: CoreRequest) -> list[Answer]:
        route = cast(RecordingRoute, req.route)
        return [a for a in route.answers if a.id == req.call.id]

    def outcomes(self, req: CoreRequest) -> list[Outcome]:
        return [f.outcome for f in self.finished if f.req is req]

    # ---- time and the event loop --------------------------------------------------------

    async def settle(self) -> None:
        """Let every task the runtime started run until it waits again."""
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        """Move the fake time on by ``seconds``, timer by timer, letting the tasks run
        after each (as a real loop would between two timers)."""
        await self.advance_to(self.clock.now() + seconds)

    async def advance_to(self, until: float) -> None:
        await self.settle()
        while (due := self.clock.next_timer) is not None and due <= until:
            self.clock.advance_to(due)
            await self.settle()
        self.clock.advance_to(until)
        await self.settle()

    async def close(self) -> None:
        """Stop what is still running (a test that left batches unanswered)."""
        tasks = list(self.runtime._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for backend in self.backends:
            await backend.close()
