"""Unary requests take one hop (issue 30, item 1): against the real Triton, two shells.

With the endpoint in granted mode (``Endpoint.unary: one_hop``) a shell process keeps a
request's tensors, the core forms the batches from their facts and grants each shell its
rows, and the shell sends them to Triton itself (``core.granted``). Proved here on the real
stack: a 1 MiB tensor's bytes never reach the core (counted on the core's end of the
shells' links, both ways; a relayed one of the same size crosses it twice), nor do a
stream's (a decoupled model's calls are granted slots: their shells stream them), and it is
answered right; a failing row among many concurrent ones is found by bisection and only
its request fails; a one-hop call's shell logs it, not the core, and a stream's too.
The shell killed mid-load, with rows of its own in batches beside the other shell's,
is ``tests/test_shells.py``'s first test, run in both modes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import parse_config
from fair_frontend.core.granted import GrantedDispatcher
from fair_frontend.kit.testing import aeventually
from fair_frontend.observability.logs import REQUEST_LOGGER
from tests.support import (
    KEYS,
    PROMPT,
    RunningFrontend,
    config_dict,
    llm_inputs,
    running_frontend,
)

MIB = 1 << 20
# What may cross the core's links for one request whose tensors do not: its facts, its
# grant, its report (and the odd queue view or tally): records, not tensors.
RECORDS_BOUND = 64 << 10


@contextlib.contextmanager
def _two_shells(triton: EmbeddedTriton, request_log: str = "shell") -> Iterator[RunningFrontend]:
    """Two shell processes; ``raiser`` in granted mode, ``simple_identity`` relayed."""
    data = config_dict()
    data["observability"] = {"request_log": request_log}
    data["endpoints"]["raiser"] = {"throttle": False, "unary": "one_hop"}
    data["endpoints"]["simple_identity"] = {"throttle": False, "unary": "relay"}
    with running_frontend(parse_config(data), triton, workers=2) as fe:
        yield fe


@pytest.fixture(scope="module")
def two_shells(triton: EmbeddedTriton) -> Iterator[RunningFrontend]:
    with _two_shells(triton) as fe:
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


async def _one(request: dict[str, Any]) -> Any:
    yield request


async def _flood(client: grpcaio.InferenceServerClient, count: int, *, pad: int = 0) -> list[bytes]:
    """One flood_decoupled stream of ``count`` answers of 8 bytes, its request ``pad``
    bytes larger (``PAD``, which no answer carries): the answers, read to its end."""
    inputs = []
    for name, values in (
        ("COUNT", np.array([count], dtype=np.int32)),
        ("SIZE", np.array([8], dtype=np.int32)),
        ("PAD", np.full(pad // 4, 7, dtype=np.int32)),
    ):
        if values.size:
            tensor = grpcaio.InferInput(name, list(values.shape), "INT32")
            tensor.set_data_from_numpy(values)
            inputs.append(tensor)

    request = {"model_name": "flood_decoupled", "inputs": inputs}
    got = []
    headers = {"x-api-key": KEYS["initech"]}
    async for result, error in client.stream_infer(_one(request), headers=headers):
        assert error is None, error
        out = result.as_numpy("OUT")
        if out is not None:
            got.append(out.reshape(-1)[0])
    return got


async def test_a_streams_1_mib_tensor_never_reaches_the_core(two_shells: RunningFrontend) -> None:
    """A stream takes one hop too: its shell sends the core the call's facts, streams it
    from Triton once granted a slot, and tells the core its tokens and its end: a request
    of 1 MiB (flood_decoupled's ``PAD``, which no answer carries) costs the core's links
    records, not its tensor."""
    fe = two_shells
    client = grpcaio.InferenceServerClient(fe.grpc_url)
    try:
        assert await _flood(client, 3) == [b"x" * 8] * 3  # the model known
        before = await _settled(fe)
        assert await _flood(client, 3, pad=MIB) == [b"x" * 8] * 3
        streamed = await _settled(fe) - before
        assert streamed < RECORDS_BOUND, streamed
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
            assert not isinstance(r, BaseException), (str(r), getattr(r, "status", lambda: "")())
            assert r.as_numpy("Y").tolist() == [v]
    runtime = fe.frontend.runtimes["raiser"]
    await aeventually(lambda: runtime.idle, 30.0, 0.05, what="the core idle")
    c = runtime.scheduler.counters
    assert c.admitted == c.dispatched + c.expired + c.cancelled


@pytest.mark.parametrize("request_log", ["shell", "core"])
async def test_a_one_hop_call_is_logged_by_its_shell_a_relayed_one_by_the_core(
    triton: EmbeddedTriton,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    request_log: str,
) -> None:
    """The request log off the core (issue 30, item 2): a call that takes one hop is
    answered by its shell, which writes its line (``Call.logged``): served, with the core's
    queue time, its own time in Triton and its tokens; failed, with the error the client
    got. The core counts both and writes no line of them. A relayed call the core
    answers, and logs, as before. With ``observability.request_log: core`` the core writes
    every line and the shells none. (Shells started here write to this test's stderr:
    ``capfd``; at this process's log level, INFO here.)"""
    caplog.set_level(logging.INFO)
    with _two_shells(triton, request_log) as fe:
        await _logged_where_answered(fe, caplog, capfd, by_shell=request_log == "shell")


async def _logged_where_answered(
    fe: RunningFrontend,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    *,
    by_shell: bool,
) -> None:
    core = fe.frontend
    shells_wrote: list[str] = []

    def counted(model: str) -> int:  # the core's record of the model's requests, both ways
        stats = [s for (m, _), s in list(core.stats._models.items()) if m == model]
        return sum(s.success.count + s.fail.count for s in stats)

    def core_logged(request_id: str) -> int:
        lines = [r for r in caplog.records if r.name == REQUEST_LOGGER]
        return sum(getattr(r, "request_id", None) == request_id for r in lines)

    def shell_logged(request_id: str) -> list[dict[str, Any]]:
        shells_wrote.extend(capfd.readouterr().err.splitlines())
        docs = []
        for line in shells_wrote:
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if isinstance(doc, dict) and doc.get("logger") == REQUEST_LOGGER:
                    docs.append(doc)
        return [d for d in docs if d.get("request_id") == request_id]

    headers = {"x-api-key": KEYS["initech"]}
    client = grpcaio.InferenceServerClient(fe.grpc_url)
    try:
        with caplog.at_level(logging.INFO, logger=REQUEST_LOGGER):
            hops = counted("raiser")
            await client.infer("raiser", [_x([[1, 2]])], headers=headers, request_id="hop")
            with pytest.raises(InferenceServerException, match="refusing the value 13"):
                await client.infer("raiser", [_x([[13, 2]])], headers=headers, request_id="bad")
            streams = counted("llm")
            stream = client.stream_infer(
                _one({"model_name": "llm", "inputs": llm_inputs(PROMPT, 6),
                      "request_id": "streamed"}),
                headers={"x-api-key": KEYS["acme"]},
            )  # fmt: skip
            async for _result, error in stream:
                assert error is None, error
            text = np.array([[b"relayed"]], dtype=object)
            await client.infer(
                "simple_identity", [_x(text, "BYTES")], headers=headers, request_id="relayed"
            )
            # The core records a one-hop call when its shell's report comes (polled); its
            # line, were it written, would be written in the same step.
            await aeventually(lambda: counted("raiser") >= hops + 2, 30, 0.01, what="counted")
            await aeventually(lambda: counted("llm") >= streams + 1, 30, 0.01, what="streamed")
            await aeventually(lambda: core_logged("relayed"), 30, 0.01, what="the relayed line")
            assert core_logged("relayed") == 1
            called = ("hop", "bad", "streamed", "relayed")
            if not by_shell:
                assert core_logged("hop") == core_logged("bad") == core_logged("streamed") == 1
                # The shells answered those before the relayed call was sent: their lines
                # would be out by now.
                assert not [shell_logged(i) for i in called if shell_logged(i)]
                return
            assert core_logged("hop") == core_logged("bad") == core_logged("streamed") == 0
            await aeventually(lambda: shell_logged("streamed"), 30, 0.01, what="streamed")
            [streamed] = shell_logged("streamed")
            assert (streamed["tenant"], streamed["endpoint"], streamed["outcome"]) == (
                "acme", "llm", "dispatched"
            ), streamed  # fmt: skip
            assert streamed["tokens_out"] == 6 and streamed["tokens_in"] > 0, streamed
            assert streamed["queued_ms"] >= 0 and streamed["service_ms"] > 0, streamed
            assert streamed["latency_ms"] >= streamed["service_ms"], streamed
            for request_id in ("hop", "bad"):
                await aeventually(lambda: shell_logged(request_id), 30, 0.01, what=request_id)  # noqa: B023
            [hop] = shell_logged("hop")
            assert (hop["tenant"], hop["endpoint"], hop["outcome"]) == (
                "initech", "raiser", "dispatched"
            ), hop  # fmt: skip
            assert hop["queued_ms"] >= 0 and hop["service_ms"] > 0 and hop["latency_ms"] > 0, hop
            assert hop["latency_ms"] >= hop["service_ms"], hop
            [bad] = shell_logged("bad")
            assert bad["outcome"] != "dispatched" and "refusing the value 13" in bad["error"], bad
            assert not shell_logged("relayed")
    finally:
        await client.close()
