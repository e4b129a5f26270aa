"""Granted mode (``core.granted``) on the fake clock: the core forms the batches from the
calls' facts, the shells send their rows.

``FakeShell`` is a shell process as ``RowsSender.send`` is one: it keeps each call's
tensors, sends the rows the core grants it to the (fake) Triton as one request, answers
its clients when Triton does and reports each part (``records.RowsDone``). What is proved
here: the batches are the ones batch mode forms, in the same fair order, across two shells;
a failing row among two shells' rows is found by bisection and only it fails (against a
Triton that merges the shells' parts into one execution, as its dynamic batcher does); a
shell gone mid-batch frees the batch's slot and the other shell's rows are answered; a
part that never reached Triton is granted again to the other Triton of a pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc
import msgspec
import pytest
from dispatch_support import (
    MODEL,
    FakeClock,
    FakeTriton,
    FixedService,
    Harness,
    MergingTriton,
    Sent,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fair_frontend.batching import pack, unpack, wire_key
from fair_frontend.core.batches import BatchDispatcher
from fair_frontend.core.dispatch import CoreRequest
from fair_frontend.core.granted import REPORT_MARGIN_S, GrantedDispatcher
from fair_frontend.errors import FrontendError, Unavailable, UpstreamError
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import Batch, Tensor
from fair_frontend.wire.records import Answer, Call, Fault, Grant, Rows, RowsDone

CULPRIT = "raiser: refusing the value 13"


def model_error() -> UpstreamError:
    return UpstreamError(CULPRIT, grpc.StatusCode.INTERNAL, 500)


@dataclass(eq=False)
class FakeShell:
    """A shell process that keeps its calls' tensors (``RowsSender.send``)."""

    h: Harness
    name: str
    held: dict[int, Call] = field(default_factory=dict)  # tensors kept, not answered yet
    grants: list[Rows] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)  # the core's (errors)
    served: dict[int, list[list[Tensor]]] = field(default_factory=dict)  # answered here
    alive: bool = True
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    exec_s: float = 0.0  # the time in Triton it reports for a part (0: not timed)

    @property
    def core(self) -> GrantedDispatcher:
        runtime = self.h.runtime
        assert isinstance(runtime, GrantedDispatcher)
        return runtime

    def submit(self, tenant: str, rows: int = 1, timeout_s: float | None = None) -> CoreRequest:
        """A call whose facts alone reach the core (``Call.key``)."""
        call = self.h.call(tenant, rows=rows, timeout_s=timeout_s)
        self.held[call.id] = call
        bare = dataclasses.replace(call.request, inputs=[])
        facts = msgspec.structs.replace(call, request=bare, key=wire_key(call.request, self.h.plan))
        req = CoreRequest(
            facts.tenant,
            facts.rows,
            facts.tokens,
            facts.nbytes,
            facts.priority,
            facts.deadline,
            facts.key,
            call=facts,
            route=self,
        )
        self.h.runtime.submit(req)
        return req

    def answer(self, answer: Answer | Grant) -> None:
        assert not isinstance(answer, Grant), "a grant: granted mode sends rows (grant_rows)"
        if self.alive:
            self.answers.append(answer)
            self.held.pop(answer.id, None)

    def grant_rows(self, rows: Rows) -> None:
        if not self.alive:
            return
        self.grants.append(rows)
        task = asyncio.get_running_loop().create_task(self._send(rows))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _send(self, rows: Rows) -> None:
        h = self.h
        calls = [self.held[i] for i in rows.calls if i in self.held]
        gone = [i for i in rows.calls if i not in self.held]
        if not calls:  # every client gone: nothing to send (``RowsSender``)
            self.core.rows_done(self, RowsDone(MODEL, rows.batch, [], gone))
            return
        packed = pack(calls, h.plan)
        triton = h.tritons[rows.backend]
        try:
            version, outputs = await triton.infer(
                Batch(MODEL, "", packed.inputs, packed.outputs, packed.parameters)
            )
        except FrontendError as err:
            if self.alive:
                sent = [(c.id, 0) for c in calls]
                self.core.rows_done(self, RowsDone(MODEL, rows.batch, sent, gone, Fault.of(err)))
            return
        if not self.alive:
            return
        outs = unpack(outputs, calls, h.plan, packed.stripped)
        for c, out in zip(calls, outs, strict=True):
            self.served.setdefault(c.id, []).append(out)
            self.held.pop(c.id, None)  # (its client may have gone meanwhile)
        served = [(c.id, 0) for c in calls]
        done = RowsDone(MODEL, rows.batch, served, gone, None, version, self.exec_s)
        self.core.rows_done(self, done)


@pytest.fixture
async def make() -> AsyncIterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def build(*args: Any, **kwargs: Any) -> Harness:
        h = Harness(*args, **kwargs)
        made.append(h)
        return h

    yield build
    for h in made:
        await h.close()


def batches_of(shells: list[FakeShell]) -> list[list[str]]:
    """The core's batches, as request ids: each batch's rows over every shell, by id."""
    by_batch: dict[int, list[str]] = {}
    for shell in shells:
        for rows in shell.grants:
            by_batch.setdefault(rows.batch, []).extend(f"r{i}" for i in rows.calls)
    return [sorted(ids, key=lambda i: int(i[1:])) for _, ids in sorted(by_batch.items())]


async def answer_all(h: Harness, rounds: int = 200) -> None:
    """Triton answers every call it holds, round after round, until none is left."""
    for _ in range(rounds):
        await h.settle()
        pending = [s for t in h.tritons for s in t.pending]
        if not pending:
            return
        for sent in pending:
            sent.ok()
    raise AssertionError("calls kept coming")


async def test_batches_are_formed_in_batch_modes_fair_order_across_two_shells(
    make: Callable[..., Harness],
) -> None:
    """Tenant a's burst of 40 through one shell, then tenant b's 8 through another: the
    core grants the very batches batch mode sends, in the same order (b's rows in the
    batch after the first, beside a's, not after a's burst)."""
    relayed = make()
    for _ in range(40):
        relayed.submit("a")
    for _ in range(8):
        relayed.submit("b")
    await answer_all(relayed)
    expected = [sorted(b, key=lambda i: int(i[1:])) for b in relayed.triton.batches()]

    h = make(dispatcher=GrantedDispatcher)
    one, two = FakeShell(h, "one"), FakeShell(h, "two")
    reqs = [one.submit("a") for _ in range(40)] + [two.submit("b") for _ in range(8)]
    await answer_all(h)

    assert batches_of([one, two]) == expected
    b_ids = {f"r{r.call.id}" for r in reqs[40:]}
    assert b_ids <= set(batches_of([one, two])[1])  # fair: b right after the first batch
    # Every call answered once, by its shell; the core only recorded them.
    assert sorted(one.served) + sorted(two.served) == [r.call.id for r in reqs]
    assert all(len(v) == 1 for v in [*one.served.values(), *two.served.values()])
    assert not one.answers and not two.answers
    assert all(h.outcomes(r) == [Outcome.DISPATCHED] for r in reqs)
    # Each batch of both shells' rows reached Triton as one request per shell.
    assert len(h.triton.sent) == sum(len(s.grants) for s in (one, two))
    assert h.runtime.idle


async def test_the_early_send_counts_the_shells_hops(make: Callable[..., Harness]) -> None:
    """Batch mode's early send goes ``dispatch_lead_ms`` (3 ms) before the batch in
    Triton is predicted to end (every batch 10 ms here); in one hop it goes earlier by
    the hops the core measured (grant to report, less the shell's own time in Triton), so
    that the next batch's parts wait in Triton's queue, where its batcher merges them,
    and do not reach an idle instance one by one. The hops follow a rise at once and a
    fall slowly."""
    h = make(dispatcher=GrantedDispatcher, service=FixedService(0.010))
    one = FakeShell(h, "one", exec_s=0.006)
    t0 = h.clock.now()
    r1 = one.submit("a")
    await h.advance_to(t0 + 0.010)
    h.triton.pending[0].ok()  # 10 ms grant to report, 6 ms of it in Triton: 4 ms of hops
    await h.settle()
    assert one.served.keys() == {r1.call.id}

    t1 = h.clock.now()
    r2 = one.submit("a")  # a free slot: at once
    await h.settle()
    r3 = one.submit("b")
    await h.advance_to(t1 + 0.010 - 0.003 - 0.004 - 1e-6)
    assert batches_of([one]) == [[f"r{r1.call.id}"], [f"r{r2.call.id}"]]
    await h.advance_to(t1 + 0.003)  # 10 ms - 3 ms - 4 ms of hops
    assert batches_of([one])[-1] == [f"r{r3.call.id}"]

    # Smaller hops lower the lead slowly; a part not timed (no exec_s) leaves it.
    runtime = one.core
    one.exec_s = 0.0
    await answer_all(h)
    assert runtime._lead() == pytest.approx(0.007)
    one.exec_s = 0.010
    one.submit("c")
    await h.advance(0.010)
    await answer_all(h)
    assert 0.003 < runtime._lead() < 0.007


def merging(instances: int = 1) -> Callable[[FakeClock], MergingTriton]:
    return partial(MergingTriton, instances=instances, error=model_error)


async def run_merging(h: Harness, rounds: int = 500) -> None:
    triton = h.triton
    assert isinstance(triton, MergingTriton)
    for _ in range(rounds):
        await h.settle()
        while triton.start():
            pass
        if triton.running:
            triton.finish(0)
            continue
        await h.advance(0.001)
        if not triton.running and not triton.waiting and h.runtime.idle:
            return
    raise AssertionError("Triton and the frontend did not come to rest")


async def test_a_failing_row_is_found_by_bisection_and_only_it_fails(
    make: Callable[..., Harness],
) -> None:
    """Two shells' rows in one batch reach Triton as two requests, which its batcher runs
    as one execution: the culprit's part fails the other's too. The core bisects the
    failed rows (each half granted alone) and answers only the culprit with the error;
    every other row is answered once, by its shell."""
    h = make(dispatcher=GrantedDispatcher, triton=merging())
    one, two = FakeShell(h, "one"), FakeShell(h, "two")
    first = one.submit("a")  # goes alone at once; the rest queue behind it
    reqs = [first]
    for _ in range(6):
        reqs.append(one.submit("a"))
        reqs.append(two.submit("b"))
    culprit = reqs[6]
    assert culprit.route is two
    assert isinstance(h.triton, MergingTriton)
    h.triton.poisoned.add(culprit.call.id)

    await run_merging(h)

    assert [a.id for a in two.answers] == [culprit.call.id]
    fault = two.answers[0].fault
    assert fault is not None and fault.message == CULPRIT
    assert h.outcomes(culprit) == [Outcome.FAILED]
    others = [r for r in reqs if r is not culprit]
    assert all(h.outcomes(r) == [Outcome.DISPATCHED] for r in others)
    served = {**one.served, **two.served}
    assert sorted(served) == sorted(r.call.id for r in others)
    assert all(len(v) == 1 for v in served.values())  # answered once each
    # The two shells' parts did meet in one execution (what made the bisection needed).
    assert any(len(execution) > 1 for execution in h.triton.executions)
    assert h.runtime.idle and not one.held and not two.held


async def test_a_shell_gone_mid_batch_frees_the_slot_and_the_others_are_answered(
    make: Callable[..., Harness],
) -> None:
    h = make(dispatcher=GrantedDispatcher)
    one, two = FakeShell(h, "one"), FakeShell(h, "two")
    first = one.submit("a")
    await h.settle()
    mine = [one.submit("a") for _ in range(3)]
    theirs = [two.submit("b") for _ in range(3)]
    h.triton.pending[0].ok()  # the first batch back: the next has both shells' rows
    await h.settle()
    assert [len(s.grants) for s in (one, two)] == [2, 1]
    assert h.runtime.inflight == 1
    parts = h.triton.pending
    assert len(parts) == 2

    two.alive = False  # its process dies with its part in Triton
    h.runtime.drop(two)
    own: Sent = next(p for p in parts if set(p.ids) == {f"r{r.call.id}" for r in mine})
    own.ok()
    await h.settle()

    assert all(h.outcomes(r) == [Outcome.DISPATCHED] for r in [first, *mine])
    assert all(h.outcomes(r) == [Outcome.CANCELLED] for r in theirs)
    assert h.runtime.inflight == 0  # the slot is free: the dead shell's part is not waited for
    later = one.submit("a")
    await h.settle()
    assert h.triton.pending and h.triton.pending[-1].ids == [f"r{later.call.id}"]
    h.triton.pending[-1].ok()
    await h.settle()
    assert h.outcomes(later) == [Outcome.DISPATCHED]
    assert h.runtime.idle


async def test_a_part_that_never_reached_triton_is_granted_to_the_other(
    make: Callable[..., Harness],
) -> None:
    """A shell that could not reach the Triton its grant named reports ``never_sent``: the
    core marks that Triton down and grants the same rows again to the other of the pool,
    as batch mode re-routes a batch; the client gets one answer."""
    h = make(dispatcher=GrantedDispatcher, backends=2)
    shell = FakeShell(h, "one")
    req = shell.submit("a")
    await h.settle()
    first = shell.grants[0].backend
    sent = [s for t in h.tritons for s in t.pending]
    assert len(sent) == 1
    sent[0].fail(Unavailable("Triton is not reachable", never_sent=True))
    await h.settle()
    assert not h.backends[first].available
    again = shell.grants[-1]
    assert len(shell.grants) == 2 and again.backend != first and again.calls == [req.call.id]
    other: FakeTriton = h.tritons[again.backend]
    other.pending[0].ok()
    await h.settle()
    assert list(shell.served) == [req.call.id] and not shell.answers
    assert h.outcomes(req) == [Outcome.DISPATCHED]


async def test_batch_mode_is_untouched_by_facts_it_never_gets(
    make: Callable[..., Harness],
) -> None:
    """(control) The relay still sends the batch itself: no grant, the core answers."""
    h = make(dispatcher=BatchDispatcher)
    req = h.submit("a")
    await h.settle()
    h.triton.pending[0].ok()
    await h.settle()
    assert [a.id for a in h.answers(req)] == [req.call.id]


async def test_a_part_never_reported_is_given_up_on_after_the_timeout(
    make: Callable[..., Harness],
) -> None:
    """A shell that stays connected but never reports its part (hung): after
    triton.request_timeout_s and the margin its calls are answered UNAVAILABLE by the
    core and the batch's slot is free again."""
    h = make(dispatcher=GrantedDispatcher)
    h.triton.request_timeout_s = 2.0
    shell = FakeShell(h, "one")
    req = shell.submit("a")
    await h.settle()
    assert h.runtime.inflight == 1 and h.triton.pending  # in Triton, never answered
    await h.advance(2.0 + REPORT_MARGIN_S - 0.01)
    assert not shell.answers and h.runtime.inflight == 1
    await h.advance(0.02)
    assert [a.id for a in shell.answers] == [req.call.id]
    fault = shell.answers[0].fault
    assert fault is not None and fault.kind == "Unavailable"
    assert h.outcomes(req) == [Outcome.FAILED] and h.runtime.inflight == 0


async def test_whole_calls_are_relayed_beside_the_granted_ones(
    make: Callable[..., Harness],
) -> None:
    """A call that came whole (a shell in the core's process) queues with the facts of a
    shell process's calls, in one fair order, and the core relays its batch itself (and
    answers it, outputs and all) while the shell sends its own rows. (Their keys differ,
    a digest and a tuple: they do not share a batch; one core has either kind of shell.)"""
    h = make(dispatcher=GrantedDispatcher)
    shell = FakeShell(h, "one")
    first = h.submit("a")  # whole: goes alone at once
    await h.settle()
    whole = [h.submit("a") for _ in range(2)]
    facts = [shell.submit("b") for _ in range(2)]
    await answer_all(h)
    for r in [first, *whole]:
        (answer,) = h.answers(r)
        assert answer.fault is None and answer.outputs[0].name == "EMBEDDING"
    assert sorted(shell.served) == [r.call.id for r in facts] and not shell.answers
    assert all(h.outcomes(r) == [Outcome.DISPATCHED] for r in [first, *whole, *facts])
    assert h.runtime.idle


GRANTED_ACTIONS = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 1), st.sampled_from("ab"), st.sampled_from(
        [None, 0.05, 0.5])),
    st.tuples(st.just("submit"), st.integers(0, 1), st.sampled_from("ab"), st.just(None)),
    st.tuples(st.sampled_from(["serve", "fail", "again", "lost"]), st.integers(0, 15)),
    st.tuples(st.just("gone"), st.integers(0, 31)),
    st.tuples(st.just("die"), st.integers(0, 1)),
    st.tuples(st.just("turns"), st.integers(0, 3)),
    st.tuples(st.just("advance"), st.sampled_from([0.01, 0.1, 1.0])),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(GRANTED_ACTIONS, max_size=60))
# A bisection's half waits for the Triton to itself while its shell dies: not granted.
@example(
    [("submit", 0, "a", None), ("turns", 2), ("submit", 0, "a", None), ("fail", 0),
     ("turns", 2), ("die", 0)]
)  # fmt: skip
def test_every_granted_call_ends_once_and_no_batch_outlives_its_parts(
    program: list[tuple[Any, ...]],
) -> None:
    """Programs hypothesis draws over two shells, one Triton and small queues: calls
    submitted (some with a deadline), Triton's answer to each part (served, the model's
    error: bisected, not reached: held, lost after it was sent), a client gone (its shell
    drops its tensors and tells the core), a shell gone (its connection closed), the loop
    let run a few turns, time moved on. Then Triton serves what it holds until nothing is
    out: each call ended once, no slot held, nothing queued, and a new call is served."""

    async def main() -> None:
        h = Harness(dispatcher=GrantedDispatcher, instances=2, max_outage_s=1e6)
        h.probe.ready = True  # a Triton marked down is back at its next probe
        shells = [FakeShell(h, "one"), FakeShell(h, "two")]
        reqs: list[CoreRequest] = []
        for action in program:
            kind = action[0]
            if kind == "submit":
                shell = shells[action[1]]
                if shell.alive:
                    reqs.append(shell.submit(action[2], timeout_s=action[3]))
            elif kind in ("serve", "fail", "again", "lost"):
                pending = h.triton.pending
                if pending:
                    sent = pending[action[1] % len(pending)]
                    if kind == "serve":
                        sent.ok()
                    elif kind == "fail":
                        sent.fail(model_error())
                    elif kind == "again":
                        sent.fail(Unavailable("Triton is unavailable", never_sent=True))
                    else:
                        sent.fail(Unavailable("Triton is unavailable: the connection closed"))
            elif kind == "gone":  # a client went away: its shell drops it, tells the core
                waiting = [(s, r) for r in reqs for s in shells if r.call.id in s.held]
                if waiting:
                    shell, req = waiting[action[1] % len(waiting)]
                    del shell.held[req.call.id]
                    h.runtime.cancel(req)
            elif kind == "die":
                shell = shells[action[1]]
                if shell.alive:
                    shell.alive = False
                    h.runtime.drop(shell)
            elif kind == "turns":
                for _ in range(action[1]):
                    await asyncio.sleep(0)
            else:
                await h.advance(action[1])
        for _ in range(200):
            await h.advance(1.0)
            for sent in h.triton.pending:
                sent.ok()
            if not h.runtime.inflight and not h.scheduler.queued_requests:
                break
        await h.settle()
        for req in reqs:
            assert len(h.outcomes(req)) == 1, (req.call.id, h.outcomes(req))
        assert h.runtime.inflight == 0 and h.scheduler.queued_requests == 0
        live = [s for s in shells if s.alive] or [FakeShell(h, "three")]
        fresh = live[0].submit("a")
        await answer_all(h)
        await h.advance(0.1)
        assert h.outcomes(fresh) == [Outcome.DISPATCHED]
        await h.close()

    asyncio.run(main())
