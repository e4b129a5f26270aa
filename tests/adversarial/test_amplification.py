"""Amplification: what one tenant's bad request costs everyone else.

A failing row used to make its whole batch retry one request at a time (up to
``max_batch_size`` times the work, in the same slot), and any UNAVAILABLE from Triton,
including its answer about a model version a tenant can ask for on purpose, marked the
whole backend down: every model's batches were held until the next readiness probe.
Now a failed batch is bisected (about 2 log2(n) sends for one culprit among n), and
only a failure to reach Triton marks it down.
"""

from __future__ import annotations

import asyncio
import math
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton, default_model_repository
from fair_frontend.core.dispatch import CoreRequest
from fair_frontend.errors import ModelUnavailable, UpstreamError
from fair_frontend.outcomes import Outcome
from tests.core.dispatch_support import Harness
from tests.support import KEYS, ids_input, make_config, running_frontend

BATCH = 32  # embed's max_batch_size in the dispatch harness: one full batch of 1-row requests


def model_error() -> UpstreamError:
    return UpstreamError("raiser: refusing the value 13", grpc.StatusCode.INTERNAL, 500)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = Harness()
    yield h
    await h.close()


async def full_batch(h: Harness) -> list[CoreRequest]:
    """BATCH requests of three tenants, sent as one batch (they queue behind a blocker in
    Triton, then go together); the blocker's call is then forgotten, so ``h.triton.sent``
    counts from the batch's own call."""
    blocker = h.submit("c")
    await h.settle()
    reqs = [h.submit("abc"[i % 3]) for i in range(BATCH)]
    h.triton.sent[0].ok()
    await h.settle()
    assert h.answers(blocker)
    assert h.triton.batches()[1:] == [[r.call.request.id for r in reqs]]
    del h.triton.sent[0]
    return reqs


async def triton_fails_rows(h: Harness, culprits: set[str]) -> None:
    """Answer every call as the raiser model would: an error for the whole call when it
    holds a culprit's row, the outputs otherwise; until nothing more is sent."""
    while pending := h.triton.pending:
        for sent in pending:
            if culprits & set(sent.ids):
                sent.fail(model_error())
            else:
                sent.ok()
        await h.settle()


@pytest.mark.parametrize("culprits", [[0], [17], [31], [3, 29]], ids=str)
async def test_a_failing_row_costs_log_n_sends_and_no_success_is_sent_twice(
    harness: Harness, culprits: list[int]
) -> None:
    h = harness
    reqs = await full_batch(h)
    bad = {reqs[i].call.request.id for i in culprits}
    await triton_fails_rows(h, bad)

    # Each culprit costs at most 2 sends per halving (one by one cost BATCH sends).
    sends = len(h.triton.sent)
    assert sends <= 1 + 2 * len(bad) * math.ceil(math.log2(BATCH)), h.triton.batches()
    # A request is in a call that succeeded at most once: nothing that ran is run again.
    succeeded = [i for s in h.triton.sent if not (bad & set(s.ids)) for i in s.ids]
    assert len(succeeded) == len(set(succeeded)) == BATCH - len(bad)
    # Exactly one answer each: the culprits get the model's error, the others their rows.
    for r in reqs:
        (answer,) = h.answers(r)
        if r.call.request.id in bad:
            assert answer.fault is not None and "refusing the value 13" in answer.fault.message
            assert h.outcomes(r) == [Outcome.FAILED]
        else:
            assert answer.fault is None
            assert np.all(answer.outputs[0].data == r.call.id)
            assert h.outcomes(r) == [Outcome.DISPATCHED]
    assert h.runtime.idle and h.backend.available


async def test_a_model_state_error_fails_its_batch_only_and_marks_nothing_down(
    harness: Harness,
) -> None:
    h = harness
    reqs = await full_batch(h)
    h.triton.sent[0].fail(
        ModelUnavailable("Request for unknown model: 'embed' version 1 is not at ready state")
    )
    await h.settle()
    assert h.backend.available  # no outage: nothing is held, no probe runs
    assert len(h.triton.sent) == 1  # the version is the batch's own: nothing to bisect
    for r in reqs:
        (answer,) = h.answers(r)
        assert answer.fault is not None and "is not at ready state" in answer.fault.message
        assert answer.fault.grpc_code == grpc.StatusCode.UNAVAILABLE.value[0]
    later = h.submit("a")  # the next request is sent at once
    await h.settle()
    assert h.triton.pending[0].ids == [later.call.request.id]


# ---- against the real Triton -------------------------------------------------------------


VERSIONED_CONFIG = """name: "versioned"
backend: "python"
max_batch_size: 8
version_policy: { specific: { versions: [ 1 ] } }
input [ { name: "X", data_type: TYPE_INT32, dims: [ -1 ] } ]
output [ { name: "Y", data_type: TYPE_INT32, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""
ECHO = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        xs = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy() for r in requests]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array(x))]) for x in xs]
"""


@pytest.fixture
def own_triton(tmp_path: Path) -> Iterator[EmbeddedTriton]:
    """A Triton of this test's own (its models get unloaded), explicit model control:
    ``embed``, and ``versioned``, two version directories of which the policy loads 1."""
    repo = tmp_path / "repo"
    for version in ("1", "2"):
        (repo / "versioned" / version).mkdir(parents=True)
        (repo / "versioned" / version / "model.py").write_text(ECHO)
    (repo / "versioned" / "config.pbtxt").write_text(VERSIONED_CONFIG)
    shutil.copytree(default_model_repository() / "embed", repo / "embed")
    server = EmbeddedTriton(
        repo,
        extra_args=[
            "--model-control-mode=explicit",
            "--load-model=embed",
            "--load-model=versioned",
        ],
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def _infer(client: grpcaio.InferenceServerClient, tenant: str, model: str, **kw: Any) -> Any:
    if model == "embed":
        inputs = [ids_input(grpcaio, np.full((1, 16), 3, dtype=np.int32))]
    else:
        x = grpcaio.InferInput("X", [1, 2], "INT32")
        x.set_data_from_numpy(np.array([[1, 2]], dtype=np.int32))
        inputs = [x]
    try:
        return await client.infer(model, inputs, headers={"x-api-key": KEYS[tenant]}, **kw)
    except InferenceServerException as err:
        return err


async def test_a_version_that_is_not_ready_does_not_mark_triton_down(
    own_triton: EmbeddedTriton, workers: int
) -> None:
    """umbrella asks for versions of ``versioned`` that Triton does not serve: 2 (not in
    its version policy: NOT_FOUND), then 1 after the operator unloaded the model
    (UNAVAILABLE, "... is not at ready state"). Each gets Triton's own answer; acme's
    requests to ``embed`` are served at once, never held for an outage."""
    with running_frontend(make_config(), own_triton, workers=workers) as fe:
        came_back: list[float] = []  # Backend calls its listeners when an outage ends

        async def listen() -> None:
            fe.frontend.backend.listeners.append(lambda: came_back.append(1.0))

        await fe.acall(listen())
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        try:
            ok = await _infer(client, "umbrella", "versioned", model_version="1")
            assert not isinstance(ok, Exception), ok
            missing = await _infer(client, "umbrella", "versioned", model_version="2")
            assert isinstance(missing, InferenceServerException)
            assert missing.status() == "StatusCode.NOT_FOUND", missing.message()
            await _unload(own_triton, "versioned")
            for _ in range(3):
                err = await _infer(client, "umbrella", "versioned", model_version="1")
                assert isinstance(err, InferenceServerException), err
                assert err.status() == "StatusCode.UNAVAILABLE", err.message()
                assert err.message() == (
                    "Request for unknown model: 'versioned' version 1 is not at ready state"
                )
                assert await fe.acall(_is_available(fe))
                # Another tenant's model is served, and was never held: had the backend
                # gone down, this would have waited for a probe to bring it back.
                served = await _infer(client, "acme", "embed")
                assert not isinstance(served, Exception), served
                assert served.as_numpy("EMBEDDING").shape == (1, 128)
        finally:
            await client.close()
        assert came_back == [], "the backend was marked down for a model's state"


async def _unload(triton: EmbeddedTriton, model: str) -> None:
    """The operator unloads a model (Triton's repository API, straight to Triton)."""
    client = grpcaio.InferenceServerClient(triton.grpc_url)
    try:
        await client.unload_model(model)
    finally:
        await client.close()


async def _is_available(fe: Any) -> bool:
    return bool(fe.frontend.backend.available)


async def test_many_concurrent_failing_rows_each_fail_alone_against_raiser(frontend: Any) -> None:
    """The real raiser model: 24 concurrent requests, three of them culprits; each
    culprit gets its error, every other request its own rows (bisection on the real
    Triton, whose own batcher may also merge the frontend's calls)."""
    client = grpcaio.InferenceServerClient(frontend.grpc_url)
    values = [[i, i + 100] for i in range(24)]
    for i in (2, 11, 23):
        values[i] = [13, i]

    async def one(v: list[int]) -> Any:
        x = grpcaio.InferInput("X", [1, 2], "INT32")
        x.set_data_from_numpy(np.array([v], dtype=np.int32))
        try:
            return await client.infer("raiser", [x], headers={"x-api-key": KEYS["hooli"]})
        except InferenceServerException as err:
            return err

    try:
        results = await asyncio.gather(*(one(v) for v in values))
    finally:
        await client.close()
    for v, r in zip(values, results, strict=True):
        if 13 in v:
            assert isinstance(r, InferenceServerException) and "refusing" in r.message()
        else:
            assert not isinstance(r, Exception), r
            assert r.as_numpy("Y").tolist() == [v]
