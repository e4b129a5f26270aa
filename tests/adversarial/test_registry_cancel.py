"""A caller that goes away stops waiting; it does not fail the others (issue 11, item 6).

``ModelRegistry.get`` shares one lookup of a model among its concurrent first callers.
A client that disconnects (or a request cancelled for any reason) while that lookup runs
must not cancel it for the rest: each of them still gets the model's description, and
over HTTP its answer, not a connection closed without one.

The unit tests drive the registry with a fake forwarder whose lookup waits until the
test lets it finish. The integration test holds the real Triton's answer at a gate (the
real call, delayed) while one HTTP client disconnects and another waits.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import grpc
import pytest
from tritonclient.grpc import model_config_pb2

from fair_frontend.backends.protocol import BackendServer
from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.backends.triton.model_config import model_info
from fair_frontend.core.service import ModelRegistry
from fair_frontend.errors import UnknownModel, UpstreamError
from fair_frontend.models import ModelInfo
from tests.support import KEYS, make_config, running_frontend

MODEL = "m"
# The lookup starts on the first await: no time passes here, a hang fails the test.
STARTED_S = 5.0


def _config(model: str) -> model_config_pb2.ModelConfig:
    cfg = model_config_pb2.ModelConfig(name=model, max_batch_size=8)
    cfg.input.add(name="X", data_type=model_config_pb2.TYPE_INT32, dims=[4])
    cfg.output.add(name="Y", data_type=model_config_pb2.TYPE_INT32, dims=[4])
    return cfg


class GatedForwarder:
    """A Triton whose config lookups wait at a gate the test opens; counts them."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.lookups = 0
        self.error = error

    async def describe(self, model: str) -> ModelInfo:
        self.lookups += 1
        self.started.set()
        await self.gate.wait()
        if self.error is not None:
            raise self.error
        return model_info(_config(model), ("1",))


async def _waiting(*tasks: asyncio.Task[Any]) -> None:
    """Let the tasks run up to their first wait (on the shared lookup): no time passes."""
    for _ in tasks:
        await asyncio.sleep(0)


async def test_a_cancelled_first_caller_does_not_fail_the_others() -> None:
    forwarder = GatedForwarder()
    registry = ModelRegistry(cast(BackendServer, forwarder))
    first = asyncio.create_task(registry.get(MODEL))
    await asyncio.wait_for(forwarder.started.wait(), STARTED_S)
    second = asyncio.create_task(registry.get(MODEL))
    await _waiting(second)

    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    forwarder.gate.set()

    info = await second  # before the fix: the first caller's CancelledError
    assert isinstance(info, ModelInfo) and info.name == MODEL
    assert forwarder.lookups == 1  # shared, not started again
    assert registry.cached(MODEL) is info
    assert await registry.get(MODEL) is info and forwarder.lookups == 1


async def test_a_lookup_whose_callers_all_left_still_completes_and_is_kept() -> None:
    forwarder = GatedForwarder()
    registry = ModelRegistry(cast(BackendServer, forwarder))
    only = asyncio.create_task(registry.get(MODEL))
    await asyncio.wait_for(forwarder.started.wait(), STARTED_S)
    only.cancel()
    with pytest.raises(asyncio.CancelledError):
        await only
    forwarder.gate.set()

    info = await registry.get(MODEL)  # joins (or finds) the same lookup
    assert info.name == MODEL and forwarder.lookups == 1


async def test_a_real_lookup_error_reaches_every_caller_and_is_not_kept() -> None:
    unknown = UpstreamError(
        f"Request for unknown model: '{MODEL}' is not found", grpc.StatusCode.NOT_FOUND, 404
    )
    forwarder = GatedForwarder(error=unknown)
    registry = ModelRegistry(cast(BackendServer, forwarder))
    callers = [asyncio.create_task(registry.get(MODEL)) for _ in range(3)]
    await asyncio.wait_for(forwarder.started.wait(), STARTED_S)
    await _waiting(*callers)
    forwarder.gate.set()

    results = await asyncio.gather(*callers, return_exceptions=True)
    assert all(isinstance(r, UnknownModel) for r in results), results
    assert forwarder.lookups == 1
    assert registry.cached(MODEL) is None
    forwarder.error = None  # the model appears in Triton: the next caller asks again
    assert (await registry.get(MODEL)).name == MODEL
    assert forwarder.lookups == 2


# ---- over HTTP, against the real Triton -------------------------------------------------


def _infer_body(request_id: str) -> bytes:
    values = list(range(16))
    inputs = [
        {"name": name, "shape": [1, 16], "datatype": "INT32", "data": values}
        for name in ("INPUT0", "INPUT1")
    ]
    return json.dumps({"id": request_id, "inputs": inputs}).encode()


def _headers(body: bytes) -> dict[str, str]:
    return {
        "authorization": f"Bearer {KEYS['acme']}",
        "content-type": "application/json",
        "content-length": str(len(body)),
    }


def _post(host_port: str, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    host, port = host_port.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=body, headers=_headers(body))
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _send_and_leave_open(host_port: str, path: str, body: bytes) -> socket.socket:
    """A whole request on a raw socket, not read: the test closes it (a disconnect)."""
    host, port = host_port.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    head = "".join(f"{k}: {v}\r\n" for k, v in _headers(body).items())
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: {host}\r\n{head}\r\n".encode() + body)
    return sock


def test_a_client_that_disconnects_during_the_first_lookup_does_not_fail_another(
    triton: EmbeddedTriton, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client A's request starts the first lookup of ``simple`` (held at a gate in front
    of the real Triton); client B's request for the same model waits on it; A
    disconnects (aiohttp cancels its handler); the gate opens: B gets its answer."""
    with running_frontend(make_config(), triton) as fe:
        loop = fe.background.loop
        gate = asyncio.Event()
        in_lookup, b_waiting, a_gone = threading.Event(), threading.Event(), threading.Event()
        forwarder = fe.frontend.forwarder
        real_describe, real_bound = forwarder.describe, fe.gateway.wire_bound
        calls = 0

        async def gated_describe(model: str) -> ModelInfo:
            in_lookup.set()
            await gate.wait()
            return await real_describe(model)

        async def tracked_bound(model: str) -> int:
            # The first thing an HTTP infer asks of its model, before its body is read: its
            # bound, which needs the model's description. A's call starts the lookup; B's
            # (the second) waits on it.
            nonlocal calls
            calls += 1
            n = calls
            if n == 2:
                b_waiting.set()
            try:
                return await real_bound(model)
            finally:
                if n == 1:
                    a_gone.set()

        monkeypatch.setattr(forwarder, "describe", gated_describe)
        monkeypatch.setattr(fe.gateway, "wire_bound", tracked_bound)
        path = "/v2/models/simple/infer"
        a = _send_and_leave_open(fe.http_url, path, _infer_body("A"))
        try:
            assert in_lookup.wait(30), "A's request never started the lookup"
            with ThreadPoolExecutor(1) as pool:
                b = pool.submit(_post, fe.http_url, path, _infer_body("B"))
                assert b_waiting.wait(30), "B's request never arrived"
                a.shutdown(socket.SHUT_RDWR)
                a.close()
                assert a_gone.wait(30), "A's handler was not cancelled"
                loop.call_soon_threadsafe(gate.set)
                status, doc = b.result(60)  # before the fix: connection closed, no answer
        finally:
            a.close()
            loop.call_soon_threadsafe(gate.set)
        assert status == 200, doc
        assert doc["id"] == "B"
        outputs = {o["name"]: o["data"] for o in doc["outputs"]}
        assert outputs["OUTPUT0"] == [2 * v for v in range(16)]
        assert outputs["OUTPUT1"] == [0] * 16
