"""Every queue bounded per tenant: no tenant fills a shared queue and locks the others out.

Issue 17, item 6, on the real stack (Triton, real gRPC clients), in both worker modes:

- one tenant sending requests whose bytes fill the global byte cap is held to its
  default share of it (``queues.tenant_bytes_share``), and another tenant's request is
  still admitted and served; once the core has said so, the shells shed the first
  tenant's requests themselves, before they reach the core;
- a tenant queuing 10,000 requests on the ``llm`` engine gets most of them refused at
  once (the engine's per-tenant queue cap, ``queues.engine_queue_slots``, and its
  throttle), while another tenant's request is admitted and served.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import parse_config
from fair_frontend.errors import MSG_QUEUE_FULL
from fair_frontend.kit.testing import GATE_PARAMETER, Gate, aeventually
from tests.support import KEYS, RunningFrontend, config_dict, ids_input, running_frontend

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
SETTLE_S = 60.0  # deadline of a condition polled on the core; met far sooner

GLOBAL_BYTES = 2_000_000
SHARE = 0.25
HOG_TOKENS = 20_000  # 80 KB of INT32 ids per request
HOG_REQUESTS = 25  # 2 MB: the whole global byte cap, were they all admitted
BLOCKER_TOKENS = 10  # the blocker holds sleeper at a gate: the queue waits behind it


def byte_config() -> dict[str, Any]:
    data = config_dict()
    data["queues"] = {"max_queued_bytes": GLOBAL_BYTES, "tenant_bytes_share": SHARE}
    # No batch sent ahead of the blocker's end: what is queued stays queued behind it.
    data["default_endpoint"]["dispatch_lead_ms"] = 0
    return data


async def _sleeper(
    client: grpcaio.InferenceServerClient, tenant: str, tokens: int, gate: Gate | None = None
) -> Any:
    """One request to ``sleeper``; ``gate``: held in Triton until the test opens it."""
    ids = np.ones((1, tokens), dtype=np.int32)
    try:
        return await client.infer(
            "sleeper",
            [ids_input(grpcaio, ids)],
            headers={"x-api-key": KEYS[tenant]},
            parameters={GATE_PARAMETER: gate.parameter} if gate is not None else None,
            client_timeout=SETTLE_S,
        )
    except InferenceServerException as err:
        return err


async def _depth(runtime: Any, tenant: str) -> int:
    return int(runtime.scheduler.depth(tenant))


async def _until(
    fe: RunningFrontend, condition: Any, what: str, deadline_s: float = SETTLE_S
) -> None:
    """``condition()`` (a coroutine) run on the frontend's loop until true."""
    await aeventually(lambda: fe.acall(condition()), deadline_s, 0.01, what=what)


async def test_one_tenant_cannot_fill_the_global_byte_cap(
    triton: EmbeddedTriton, workers: int, tmp_path: Path
) -> None:
    """acme sends 2 MB of requests behind one held in Triton: the global cap's worth. It
    gets its share (500 KB, 6 requests) and is refused the rest, naming its default;
    globex's request is admitted and served. Before: acme's 25 were all admitted (the
    global cap then full) and globex got 503 'global max_queued_bytes'."""
    share = int(GLOBAL_BYTES * SHARE)
    expected = (
        f"{MSG_QUEUE_FULL}: tenant 'acme' max_queued_bytes={share} (its default: "
        f"tenant_bytes_share {SHARE:g} of the global max_queued_bytes={GLOBAL_BYTES})"
    )
    with running_frontend(parse_config(byte_config()), triton, workers=workers) as fe:
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        gate = Gate(tmp_path)
        try:
            assert not isinstance(await _sleeper(client, "acme", 10), Exception)  # warm
            blocker = asyncio.ensure_future(_sleeper(client, "hooli", BLOCKER_TOKENS, gate))

            async def blocked() -> bool:
                return bool(fe.frontend.runtimes["sleeper"].inflight >= 1)

            await _until(fe, blocked, "the blocker in Triton")
            hog = [
                asyncio.ensure_future(_sleeper(client, "acme", HOG_TOKENS))
                for _ in range(HOG_REQUESTS)
            ]

            async def hog_settled() -> bool:
                runtime = fe.frontend.runtimes["sleeper"]
                refused = sum(1 for h in hog if h.done())
                return bool(runtime.scheduler.depth("acme") + refused >= HOG_REQUESTS)

            await _until(fe, hog_settled, "acme's requests queued or refused")
            quiet = asyncio.ensure_future(_sleeper(client, "globex", HOG_TOKENS))

            async def quiet_queued() -> bool:
                return bool(fe.frontend.runtimes["sleeper"].scheduler.depth("globex") == 1)

            await _until(fe, quiet_queued, "globex's request queued beside acme's share")
            gate.open()
            assert not isinstance(await asyncio.wait_for(quiet, SETTLE_S), Exception), quiet
            results = await asyncio.gather(*hog)
            assert not isinstance(await blocker, Exception)
        finally:
            gate.open()
            await client.close()
    refused = [r for r in results if isinstance(r, InferenceServerException)]
    served = [r for r in results if not isinstance(r, Exception)]
    assert len(served) == share // (4 * HOG_TOKENS)  # 6: all of its share, no more
    assert len(refused) == HOG_REQUESTS - len(served)
    assert {r.status() for r in refused} == {"StatusCode.UNAVAILABLE"}
    assert {r.message() for r in refused} == {expected}


async def test_the_shells_shed_a_tenant_at_its_byte_share_before_the_core(
    triton: EmbeddedTriton, tmp_path: Path
) -> None:
    """Two shell processes: once the core has told the shells that acme is at its share,
    acme's next requests are refused by the shell (the same 503), never reaching the
    core's intake, while another tenant's request still goes through."""
    with running_frontend(parse_config(byte_config()), triton, workers=2) as fe:
        assert fe.server.shells is not None
        core_server = fe.server.shells.server
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        gate = Gate(tmp_path)
        try:
            assert not isinstance(await _sleeper(client, "acme", 10), Exception)  # warm
            blocker = asyncio.ensure_future(_sleeper(client, "hooli", BLOCKER_TOKENS, gate))

            async def blocked() -> bool:
                return bool(fe.frontend.runtimes["sleeper"].inflight >= 1)

            await _until(fe, blocked, "the blocker in Triton")
            hog = [asyncio.ensure_future(_sleeper(client, "acme", HOG_TOKENS)) for _ in range(6)]

            async def told() -> bool:
                return any(t == "acme" and m == "*" for t, m, _, _ in core_server.queue_view[1])

            await _until(fe, told, "the shells told that acme is near its share")

            async def hogs_queued() -> bool:
                # "Near" is less room than the largest request: the view can say so with
                # some of the six still on their way, and a probe then fits in their room
                # and waits behind the gate (a fresh clone under load): all six first.
                return bool(fe.frontend.runtimes["sleeper"].scheduler.depth("acme") == len(hog))

            try:
                await _until(fe, hogs_queued, "acme's six requests queued in the core")
            except AssertionError as err:  # what became of the six, for the report
                runtime = fe.frontend.runtimes["sleeper"]
                depth = await fe.acall(_depth(runtime, "acme"))
                done = [h.result() if h.done() else "pending" for h in hog]
                raise AssertionError(
                    f"{err}: acme's depth {depth}, sleeper's batches in Triton "
                    f"{runtime.inflight}, the view {core_server.queue_view}, the six: {done}"
                ) from None

            async def shell_sheds() -> bool:
                # The view is on its way to the shell process: read once it refuses alone.
                before = core_server.intake.admitted
                r = await _sleeper(client, "acme", HOG_TOKENS)
                return isinstance(r, InferenceServerException) and (
                    core_server.intake.admitted == before
                )

            await aeventually(shell_sheds, SETTLE_S, what="the shell refusing acme alone")
            admitted = core_server.intake.admitted
            shed = await asyncio.gather(*(_sleeper(client, "acme", HOG_TOKENS) for _ in range(5)))
            assert all(isinstance(r, InferenceServerException) for r in shed), shed
            assert all("tenant 'acme' max_queued_bytes=" in r.message() for r in shed)
            assert core_server.intake.admitted == admitted, "the core saw acme's refused calls"
            quiet = asyncio.ensure_future(_sleeper(client, "globex", HOG_TOKENS))
            await aeventually(
                lambda: core_server.intake.admitted > admitted, SETTLE_S, what="globex admitted"
            )
            gate.open()
            assert not isinstance(await asyncio.wait_for(quiet, SETTLE_S), Exception), quiet
            assert core_server.intake.admitted == admitted + 1
            assert not [r for r in await asyncio.gather(*hog) if isinstance(r, Exception)]
            assert not isinstance(await blocker, Exception)
        finally:
            gate.open()
            await client.close()


# ---- an engine endpoint -------------------------------------------------------------------

SLOTS = 16
RESERVED = 4
FLOOD = 10_000
ENGINE_CAP = 4 * SLOTS  # queues.engine_queue_slots (4, the default) x max_inflight


def engine_config() -> dict[str, Any]:
    data = config_dict()
    llm = data["endpoints"]["llm"]
    llm.update(max_inflight=SLOTS, reserved_slots=RESERVED, throttle=True)
    return data


def llm_request(prompt: str, max_tokens: int) -> bytes:
    """A serialized ``ModelInferRequest`` to ``llm``: one response, the whole text."""
    msg = service_pb2.ModelInferRequest(model_name="llm")
    params = json.dumps({"max_tokens": max_tokens, "temperature": 0}).encode()
    for name, datatype, raw in (
        ("text_input", "BYTES", struct.pack("<I", len(prompt)) + prompt.encode()),
        ("stream", "BOOL", b"\x00"),
        ("sampling_parameters", "BYTES", struct.pack("<I", len(params)) + params),
    ):
        msg.inputs.add(name=name, datatype=datatype, shape=[1])
        msg.raw_input_contents.append(raw)
    return msg.SerializeToString()


@pytest.fixture(scope="module")
def engine(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    with running_frontend(parse_config(engine_config()), triton, workers=workers) as running:
        yield running


async def test_a_tenant_queuing_10000_generations_is_mostly_refused_at_once(
    engine: RunningFrontend,
) -> None:
    """acme writes 10,000 ``llm`` requests on one stream as fast as it can: at most a
    few turnovers of the engine's slots are admitted, the rest refused at once with 503's
    words (the queue cap, or the throttle's predicted wait); globex's request, sent
    meanwhile, is admitted and served. Before: all 10,000 were queued (the tenant default
    of 10,000), and globex's waited behind acme's share of them."""
    body = llm_request("tell me everything", 200)  # long: the slots turn over slowly
    async with (
        grpc.aio.insecure_channel(engine.grpc_url) as hog_channel,
        grpc.aio.insecure_channel(engine.grpc_url) as quiet_channel,
    ):
        open_stream = hog_channel.stream_stream(
            STREAM, request_serializer=None,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )  # fmt: skip
        hog = open_stream(metadata=(("x-api-key", KEYS["acme"]),))
        before = await engine.acall(engine.counters("llm"))
        refusals: list[str] = []
        answered = 0

        async def write() -> None:
            for _ in range(FLOOD):
                await hog.write(body)

        async def read() -> None:
            nonlocal answered
            while len(refusals) + answered < FLOOD:
                reply = await hog.read()
                if reply is grpc.aio.EOF:
                    return
                if reply.error_message:
                    refusals.append(reply.error_message)
                elif reply.infer_response.outputs:  # the whole text, in one response
                    answered += 1

        writer = asyncio.ensure_future(write())
        reader = asyncio.ensure_future(read())
        try:
            await asyncio.wait_for(writer, SETTLE_S)
            # Another tenant, while acme's flood holds the engine: admitted and served.
            quiet = quiet_channel.stream_stream(
                STREAM, request_serializer=None,
                response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
            )(metadata=(("x-api-key", KEYS["globex"]),))  # fmt: skip
            await quiet.write(llm_request("a short question", 4))
            await quiet.done_writing()
            replies = [r async for r in quiet]
            assert replies and not [r.error_message for r in replies if r.error_message]
            assert any(r.infer_response.outputs for r in replies)
            # Refusals are answered as the requests are read, not after a wait.
            deadline = time.monotonic() + SETTLE_S
            while len(refusals) < 0.8 * FLOOD:
                assert time.monotonic() < deadline, f"{len(refusals)} refused"
                await asyncio.sleep(0.05)
        finally:
            writer.cancel()
            hog.cancel()
            reader.cancel()

    async def idle() -> bool:
        return bool(engine.frontend.runtimes["llm"].idle)

    # Cancelled with their stream (a loaded machine's engine takes a while to get there).
    await _until(engine, idle, "acme's admitted requests end (its stream is gone)", 3 * SETTLE_S)
    after = await engine.acall(engine.counters("llm"))
    admitted = after.admitted - before.admitted
    assert admitted < 0.1 * FLOOD, admitted
    assert all(
        f"{MSG_QUEUE_FULL}: tenant 'acme' max_queued={ENGINE_CAP}" == r
        or r.startswith("Server overloaded on model 'llm': predicted wait")
        for r in refusals
    ), set(refusals)
    assert after.admitted == after.dispatched + after.expired + after.cancelled
