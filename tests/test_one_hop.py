"""Unary requests take one hop (issue 30, item 1): against the real Triton, two shells.

With the endpoint in granted mode (``Endpoint.unary: one_hop``) a shell process keeps a
request's tensors, the core forms the batches from their facts and grants each shell its
rows, and the shell sends them to Triton itself (``core.granted``). Proved here on the real
stack: a 1 MiB tensor's bytes never reach the core (counted on the core's end of the
shells' links, both ways; a relayed one of the same size crosses it twice), and it is
answered right; a failing row among many concurrent ones is found by bisection and only
its request fails. The shell killed mid-load, with rows of its own in batches beside the
other shell's, is ``tests/test_shells.py``'s first test, run in both modes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from fair_frontend.config import parse_config
from fair_frontend.core.granted import GrantedDispatcher
from fair_frontend.embedded import EmbeddedTriton
from fair_frontend.testing import aeventually
from tests.support import KEYS, RunningFrontend, config_dict, running_frontend

MIB = 1 << 20
# What may cross the core's links for one request whose tensors do not: its facts, its
# grant, its report (and the odd queue view or tally): records, not tensors.
RECORDS_BOUND = 64 << 10


@pytest.fixture(scope="module")
def two_shells(triton: EmbeddedTriton) -> Iterator[RunningFrontend]:
    """Two shell processes; ``raiser`` in granted mode, ``simple_identity`` relayed."""
    data = config_dict()
    data["endpoints"]["raiser"] = {"throttle": False, "unary": "one_hop"}
    data["endpoints"]["simple_identity"] = {"throttle": False, "unary": "relay"}
    with running_frontend(parse_config(data), triton, workers=2) as fe:
        yield fe


def _core_bytes(fe: RunningFrontend) -> int:
    """Bytes on the core's ends of the shells' links so far, both ways."""
    shells = fe.server.shells
    assert shells is not None
    return sum(c.received_bytes + c._written for c in shells.server.connections)


def _x(values: Any, dtype: str = "INT32") -> grpcaio.InferInput:
    data = np.asarray(values, dtype=np.int32 if dtype == "INT32" else object)
    inp = grpcaio.InferInput("X" if dtype == "INT32" else "INPUT0", list(data.shape), dtype)
    inp.set_data_from_numpy(data)
    return inp


async def _settled(fe: RunningFrontend) -> int:
    """The core's link bytes once a moment passes without any (the tallies are in)."""
    seen = -1

    def still() -> bool:
        nonlocal seen
        now, seen = seen, _core_bytes(fe)
        return now == seen

    await aeventually(still, 30.0, 0.3, what="the links quiet")
    return seen


async def test_a_1_mib_tensor_never_reaches_the_core(two_shells: RunningFrontend) -> None:
    fe = two_shells
    core = fe.frontend
    headers = {"x-api-key": KEYS["initech"]}
    big = np.full((1, MIB // 4), 7, dtype=np.int32)
    client = grpcaio.InferenceServerClient(fe.grpc_url)
    try:
        await client.infer("raiser", [_x([[1, 2]])], headers=headers)  # the model known
        before = await _settled(fe)
        result = await client.infer("raiser", [_x(big)], headers=headers, request_id="big")
        one_hop = await _settled(fe) - before
        assert np.array_equal(result.as_numpy("Y"), big)
        assert isinstance(core.runtimes["raiser"], GrantedDispatcher)
        assert one_hop < RECORDS_BOUND, one_hop

        # (control) The relayed endpoint's tensor crosses the core twice: the count sees it.
        text = np.array([[b"x" * MIB]], dtype=object)
        before = await _settled(fe)
        echoed = await client.infer("simple_identity", [_x(text, "BYTES")], headers=headers)
        relayed = await _settled(fe) - before
        assert echoed.as_numpy("OUTPUT0")[0][0] == text[0][0]
        assert relayed > 2 * MIB, relayed
    finally:
        await client.close()


async def test_a_failing_row_fails_only_its_request(two_shells: RunningFrontend) -> None:
    """Many clients on many connections (both shells): their rows share batches and meet
    in Triton's batcher; the model raises for the whole execution that holds a 13. Only
    that request fails; every other is answered with its own rows."""
    fe = two_shells
    own = [("grpc.use_local_subchannel_pool", 1)]
    clients = [grpcaio.InferenceServerClient(fe.grpc_url, channel_args=own) for _ in range(8)]
    values = [[i, i + 1] for i in range(40)]
    values[5] = [13, 13]
    values[27] = [12, 13]
    headers = {"x-api-key": KEYS["initech"]}
    try:
        results = await asyncio.gather(
            *(
                clients[i % len(clients)].infer("raiser", [_x([v])], headers=headers)
                for i, v in enumerate(values)
            ),
            return_exceptions=True,
        )
    finally:
        for c in clients:
            await c.close()
    for v, r in zip(values, results, strict=True):
        if 13 in v:
            assert isinstance(r, InferenceServerException)
            assert "refusing the value 13" in str(r.message())
        else:
            assert not isinstance(r, Exception), (str(r), getattr(r, "status", lambda: "")())
            assert r.as_numpy("Y").tolist() == [v]
    runtime = fe.frontend.runtimes["raiser"]
    await aeventually(lambda: runtime.idle, 30.0, 0.05, what="the core idle")
    c = runtime.scheduler.counters
    assert c.admitted == c.dispatched + c.expired + c.cancelled
