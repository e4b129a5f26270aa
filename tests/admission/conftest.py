"""Fixtures for the admission tests: a real ``redis-server`` on a free port, and storages.

Every test that takes ``storage`` runs once per storage (``memory``, ``redis``): the same
tests over every storage. The session's ``redis_server`` is flushed before each test;
tests that kill or pause Redis start their own with ``redis_process``.

``kserve`` (for the ``test_integration_*`` tests, on the real stack): calls a running
frontend over gRPC and HTTP keeping the retry hints, and reads Prometheus counters.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2, service_pb2_grpc

from fair_frontend.admission import MemoryStorage, RedisStorage, Storage

# Functional tests must never see a storage error: a loaded 2-core machine can stall for
# more than the 50 ms production default. The failure tests use the production timeout.
FUNCTIONAL_TIMEOUT_S = 5.0
START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """A ``redis-server`` this test owns: no persistence, loopback only, a free port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.wait_ready()

    def wait_ready(self) -> None:
        """Poll PING until it answers (no fixed sleeps)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        client = self.client()
        try:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not answer PING in time")
                time.sleep(0.01)  # polling interval, not a wait for readiness
        finally:
            client.close()

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def stop(self) -> None:
        """Terminate the process and wait for it to be gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    server = RedisProcess()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisProcess) -> str:
    return redis_server.url


@pytest.fixture
async def redis_client(redis_server: RedisProcess) -> AsyncIterator[aioredis.Redis]:
    """A client of the test's own on the session's Redis, to read what a storage wrote."""
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
def redis_process() -> Iterator[RedisProcess]:
    """A Redis of the test's own, to kill, pause or restart; stopped after the test."""
    server = RedisProcess()
    server.start()
    yield server
    server.stop()


StorageFactory = Callable[[], Storage]


@pytest.fixture(params=["memory", "redis"])
def storage_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def new_storage(storage_kind: str, request: pytest.FixtureRequest) -> StorageFactory:
    """Makes fresh storages of this test's kind over clean state (Redis flushed once)."""
    if storage_kind == "memory":
        return MemoryStorage
    server: RedisProcess = request.getfixturevalue("redis_server")
    with server.client() as c:
        c.flushall()
    return lambda: RedisStorage(server.url, timeout_s=FUNCTIONAL_TIMEOUT_S)


@pytest.fixture
async def storage(new_storage: StorageFactory) -> AsyncIterator[Storage]:
    made = new_storage()
    yield made
    await made.close()


# ---- the real stack: calls through a running frontend, and counters to watch ----------------
#
# The integration tests (``test_integration_*``) talk to a frontend the way clients do and
# need what tritonclient hides: gRPC trailing metadata and HTTP headers. ``KServe`` makes
# those calls (raw generated stub over grpc.aio; aiohttp for HTTP) and reads Prometheus
# counters, Triton's and the frontend's.

GRPC_OK = "OK"
_HTTP_CODES = {200: "OK", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}


@dataclass(frozen=True)
class Reply:
    """One answer, protocol-neutral: ``code`` is the gRPC status name (HTTP mapped onto it)."""

    protocol: str  # "grpc" or "http"
    status: str  # as the protocol says it: "OK" / "RESOURCE_EXHAUSTED" ..., or "200" / "429" ...
    code: str  # the gRPC status name for both protocols ("OK", "UNAVAILABLE", ...)
    message: str  # the error message ("" when OK)
    retry_after: str | None  # HTTP ``Retry-After`` header or gRPC trailing ``retry-after``
    sent: float  # time.monotonic() when the call started
    seconds: float  # client-side latency

    @property
    def ok(self) -> bool:
        return self.code == GRPC_OK


def infer_request(
    model: str, rows: int, tokens: int, *, max_tokens: int | None = None
) -> service_pb2.ModelInferRequest:
    """A KServe v2 ModelInfer request: INPUT_IDS [rows, tokens] (and the ``max_tokens``
    request parameter, as an int64 like tritonclient sends an int)."""
    req = service_pb2.ModelInferRequest(model_name=model)
    # Tensors' bytes go in raw_input_contents, in input order (what tritonclient sends).
    req.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[rows, tokens])
    req.raw_input_contents.append(np.full((rows, tokens), 7, np.int32).tobytes())
    if max_tokens is not None:
        req.parameters["max_tokens"].int64_param = max_tokens
    return req


def http_body(model: str, rows: int, tokens: int, *, max_tokens: int | None = None) -> bytes:
    """The same request as KServe v2 JSON."""
    inputs: list[dict[str, Any]] = [
        {"name": "INPUT_IDS", "datatype": "INT32", "shape": [rows, tokens],
         "data": [7] * (rows * tokens)},
    ]  # fmt: skip
    doc: dict[str, Any] = {"inputs": inputs}
    if max_tokens is not None:
        doc["parameters"] = {"max_tokens": max_tokens}
    return json.dumps(doc).encode()


def scrape(url: str, family: str, **labels: str) -> float:
    """Sum of a Prometheus family's samples (counters: the ``_total`` sample) whose labels
    include ``labels``; 0 when none."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name != family:
            continue
        for sample in fam.samples:
            if sample.name.endswith("_created"):
                continue
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


class KServe:
    """Calls a frontend as clients do, keeping what tritonclient hides (trailers, headers).

    One gRPC channel and one HTTP session per address, closed by the fixture.
    """

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, service_pb2_grpc.GRPCInferenceServiceStub] = {}
        self._session: aiohttp.ClientSession | None = None

    def stub(self, url: str) -> service_pb2_grpc.GRPCInferenceServiceStub:
        stub = self._stubs.get(url)
        if stub is None:
            channel = self._channels[url] = grpc.aio.insecure_channel(url)
            stub = self._stubs[url] = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return stub

    async def grpc(self, url: str, key: str, request: service_pb2.ModelInferRequest) -> Reply:
        """ModelInfer over gRPC; the error's trailing metadata read from the call."""
        sent = time.monotonic()
        call = self.stub(url).ModelInfer(request, metadata=(("authorization", f"Bearer {key}"),))
        with contextlib.suppress(grpc.aio.AioRpcError):  # the call keeps code and trailers
            await call
        code = (await call.code()).name
        trailers = dict(await call.trailing_metadata() or ())
        message = "" if code == GRPC_OK else str(await call.details())
        retry = trailers.get("retry-after")
        return Reply(
            "grpc", code, code, message, None if retry is None else str(retry), sent,
            time.monotonic() - sent,
        )  # fmt: skip

    async def http(self, url: str, key: str, model: str, body: bytes) -> Reply:
        """POST /v2/models/<model>/infer with a JSON body."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        sent = time.monotonic()
        async with self._session.post(
            f"http://{url}/v2/models/{model}/infer",
            data=body,
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        ) as response:
            payload = await response.json(content_type=None)
            status = response.status
            retry = response.headers.get("Retry-After")
        message = "" if status == 200 else str(payload.get("error", ""))
        code = _HTTP_CODES.get(status, f"HTTP {status}")
        return Reply("http", str(status), code, message, retry, sent, time.monotonic() - sent)

    async def infer(
        self,
        protocol: str,
        url: tuple[str, str],
        key: str,
        model: str,
        rows: int,
        tokens: int,
        *,
        max_tokens: int | None = None,
    ) -> Reply:
        """One request over ``protocol``; ``url`` is (gRPC address, HTTP address)."""
        if protocol == "grpc":
            return await self.grpc(
                url[0], key, infer_request(model, rows, tokens, max_tokens=max_tokens)
            )
        body = http_body(model, rows, tokens, max_tokens=max_tokens)
        return await self.http(url[1], key, model, body)

    @staticmethod
    def counter(url: str, family: str, **labels: str) -> float:
        """A Prometheus family's value at ``url`` (``scrape``)."""
        return scrape(url, family, **labels)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        if self._session is not None:
            await self._session.close()


@pytest.fixture
async def kserve() -> AsyncIterator[KServe]:
    made = KServe()
    yield made
    await made.close()
