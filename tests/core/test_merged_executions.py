"""Bisection against a Triton that merges concurrent sends, as its dynamic batcher does.

``MergingTriton`` (``dispatch_support``) runs every call waiting for a free instance as
one execution, and a model that raises fails that whole execution: a batch sent early, or
a second batch on a second instance, can share an execution with a culprit it never met in
the frontend. The frontend's defence (``core.batches``: batches that met in one Triton are
overlapped, a lone overlapped request is tried again alone, a failed batch is bisected with
nothing beside it) is proved here on the fake clock: only the culprit fails, every other
request is served once, whatever the order Triton runs them in. The real-stack test is
``tests/test_frontend.py::test_a_failing_row_does_not_fail_its_batch_neighbours``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import grpc
import numpy as np
import pytest
from dispatch_support import FakeClock, FixedService, Harness, MergingTriton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fair_frontend.config import Endpoint
from fair_frontend.core.dispatch import CoreRequest
from fair_frontend.errors import UpstreamError
from fair_frontend.outcomes import Outcome

CULPRIT = "raiser: refusing the value 13"


def model_error() -> UpstreamError:
    return UpstreamError(CULPRIT, grpc.StatusCode.INTERNAL, 500)


def merging(instances: int = 1) -> Callable[[FakeClock], MergingTriton]:
    return partial(MergingTriton, instances=instances, error=model_error)


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


def triton_of(h: Harness) -> MergingTriton:
    assert isinstance(h.triton, MergingTriton)
    return h.triton


def poison(h: Harness, req: CoreRequest) -> CoreRequest:
    triton_of(h).poisoned.add(req.call.id)
    return req


async def run_to_the_end(h: Harness, rounds: int = 500) -> None:
    """Triton runs whatever it is sent, oldest execution first, until nothing is left."""
    triton = triton_of(h)
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


def assert_only_culprits_failed(h: Harness, reqs: list[CoreRequest]) -> None:
    triton = triton_of(h)
    for req in reqs:
        answers = h.answers(req)
        assert len(answers) == 1, (req.call.request.id, answers)
        fault = answers[0].fault
        if req.call.id in triton.poisoned:
            assert fault is not None and fault.message == CULPRIT, req.call.request.id
        else:
            assert fault is None, (req.call.request.id, fault)
            assert np.all(answers[0].outputs[0].data == req.call.id)  # its own rows
            assert h.outcomes(req) == [Outcome.DISPATCHED]
    assert len(h.finished) == len(reqs)


@pytest.mark.parametrize("early_rows", [1, 2], ids=["a lone request", "a batch of two"])
async def test_a_batch_sent_early_that_shared_the_culprits_execution_is_not_failed(
    make: Callable[..., Harness], early_rows: int
) -> None:
    """A = [r1, r2*, r3] is sent; B is sent early (``dispatch_lead_ms``) while A still
    waits for Triton's instance, and Triton runs the two as one execution, which r2 fails.
    B met A in Triton's queue: its requests are not answered with r2's error (a lone one is
    tried again alone, two are bisected), and each half of A waits until B has come back."""
    h = make(service=FixedService(0.010), triton=merging())
    triton = triton_of(h)
    t0 = h.clock.now()
    r0 = h.submit("c")  # a blocker: A queues behind it
    await h.settle()
    a = [h.submit("a"), h.submit("a"), h.submit("b")]
    assert triton.start() and triton.executions == [ids(r0)]
    triton.finish()
    await h.settle()
    (sent_a,) = triton.waiting  # A, not started yet
    b = [h.submit("c") for _ in range(early_rows)]
    poison(h, next(r for r in a if r.call.request.id == sent_a.ids[1]))
    await h.advance_to(t0 + 0.020)  # B goes early: A is predicted to end soon
    assert [s.ids for s in triton.waiting] == [sent_a.ids, ids(*b)]
    assert triton.start()  # one execution: A and B
    triton.finish()  # ... failed by r2
    await run_to_the_end(h)
    assert_only_culprits_failed(h, [r0, *a, *b])
    # After the failure, everything ran alone or in halves of one batch, never mixed.
    for execution in triton.executions[3:]:
        assert set(execution) <= set(sent_a.ids) or set(execution) <= set(ids(*b))


async def test_a_half_waits_for_what_else_is_in_triton(make: Callable[..., Harness]) -> None:
    """Two instances. C is in Triton (waiting for an instance) when A = [x, y*] fails on
    the other: A's half [x] is not sent until C has come back, so that the two cannot share
    an execution (C holds a culprit of its own: x would get its error)."""
    h = make(Endpoint(max_inflight_batches=2), instances=2, triton=merging(instances=2))
    triton = triton_of(h)
    blockers = [h.submit("c"), h.submit("c")]  # one on each slot: A queues behind them
    await h.settle()
    a = [h.submit("a"), h.submit("b")]
    await h.settle()
    assert triton.start()
    triton.finish()  # the blockers come back; A goes as one batch
    await h.settle()
    assert triton.start() and sorted(triton.executions[-1]) == sorted(ids(*a))
    c = poison(h, h.submit("c"))
    await h.settle()
    assert [s.ids for s in triton.waiting] == [ids(c)]  # C waits for the second instance
    x, y = (next(r for r in a if r.call.request.id == i) for i in triton.executions[-1])
    poison(h, y)
    triton.finish()  # A fails while C is still in Triton
    await h.settle()
    assert [s.ids for s in triton.waiting] == [ids(c)]  # [x] waits
    assert triton.start()
    triton.finish()  # C comes back, failed by its own culprit
    await run_to_the_end(h)
    assert_only_culprits_failed(h, [*blockers, x, y, c])


async def test_two_instances_send_nothing_beside_a_bisection(
    make: Callable[..., Harness],
) -> None:
    """Two instances: A = [x, y*] fails, and its halves go one by one. Meanwhile z*, a
    culprit of its own, arrives, and the second instance is free. Sent then, z* would wait
    in Triton beside the lone half [x] and share its execution: x, innocent, would get z's
    error as its own, with nothing left to bisect. Nothing goes beside a bisection."""
    h = make(Endpoint(max_inflight_batches=2), instances=2, triton=merging(instances=2))
    triton = triton_of(h)
    a = [h.submit("a"), h.submit("b")]
    await h.settle()
    assert triton.start() and sorted(triton.executions[-1]) == ids(*a)
    x, y = (next(r for r in a if r.call.request.id == i) for i in triton.executions[-1])
    poison(h, y)
    triton.finish()  # A fails: its first half, [x], goes alone
    await h.settle()
    assert [s.ids for s in triton.waiting] == [ids(x)]
    z = poison(h, h.submit("c"))
    await h.settle()
    assert [s.ids for s in triton.waiting] == [ids(x)]  # not z, beside it
    await run_to_the_end(h)
    assert_only_culprits_failed(h, [x, y, z])
    assert triton.executions[1:] == [ids(x), ids(y), ids(z)]


def ids(*reqs: CoreRequest) -> list[str]:
    return [r.call.request.id for r in reqs]


# ---- any order Triton runs things in ------------------------------------------------------

STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from("abc"), st.integers(1, 12), st.booleans()),
        st.tuples(st.just("start")),
        st.tuples(st.just("finish"), st.integers(0, 1)),
        st.tuples(st.just("advance"), st.sampled_from([0.001, 0.004, 0.02])),
    ),
    min_size=10,
    max_size=50,
)


async def story(instances: int, lead: bool, steps: list[tuple[Any, ...]]) -> None:
    endpoint = Endpoint(max_inflight_batches=instances)
    service = FixedService(0.010) if lead else None
    h = Harness(endpoint, instances=instances, service=service, triton=merging(instances))
    triton = triton_of(h)
    reqs: list[CoreRequest] = []
    try:
        for op, *args in steps:
            if op == "submit":
                tenant, rows, bad = args
                reqs.append(h.submit(tenant, rows=rows))
                if bad:
                    poison(h, reqs[-1])
            elif op == "start":
                triton.start()
            elif op == "finish" and triton.running:
                triton.finish(args[0] % len(triton.running))
            elif op == "advance":
                await h.advance(args[0])
            await h.settle()
        await run_to_the_end(h)
        assert_only_culprits_failed(h, reqs)
    finally:
        await h.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances=st.sampled_from([1, 2]), lead=st.booleans(), steps=STEPS)
def test_only_the_culprit_fails_whatever_triton_merges(
    instances: int, lead: bool, steps: list[tuple[Any, ...]]
) -> None:
    asyncio.run(story(instances, lead, steps))
