"""Helpers shared by the tests that run the frontend against a real Triton."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
import redis
import tritonclient.grpc.aio as grpcaio
import yaml
from tritonclient.grpc import service_pb2, service_pb2_grpc

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import Config, Endpoint, parse_config, resolve_relative_paths
from fair_frontend.endpoint import EndpointPlan, plan
from fair_frontend.kit.testing import free_port, scrape
from fair_frontend.models import ModelInfo
from fair_frontend.server import BackgroundServer, FrontendServer, Listen

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_CONFIG = ROOT / "examples" / "config.yaml"
TEST_MODEL_REPOSITORY = Path(__file__).resolve().parent / "model_repository"

# Test tenants and their keys (plain: these are test fixtures, not secrets).

# A short perf_analyzer run where what is asserted is that the plain command runs (and
# measures) through what it talks to, not that this shared machine's speed holds still:
# short windows, any spread between them accepted (the last --stability-percentage
# given wins; under two CPU hogs windows of 20 requests differed by more than 30 %
# twenty times in a row: "Failed to obtain stable measurement", on fresh clones).
PERF_ANALYZER_SHORT_RUN = [
    "--measurement-mode",
    "count_windows",
    "--measurement-request-count",
    "20",
    "--stability-percentage",
    "1000",
]

KEYS = {
    "acme": "acme-test-key",
    "globex": "globex-test-key",
    "initech": "initech-test-key",
    "umbrella": "umbrella-test-key",
    "hooli": "hooli-test-key",
}
TIERS = {
    "acme": "enterprise",
    "globex": "enterprise",
    "initech": "standard",
    "umbrella": "trial",
    "hooli": "standard",
}


def config_dict(**overrides: Any) -> dict[str, Any]:
    """The example config's endpoints and tiers, test tenants, no rate limits, no throttle,
    every model open to every tenant ("*").

    Tests of admission set their own limits and targets; the others test scheduling and
    must not depend on how fast these machines serve today.
    """
    data: dict[str, Any] = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    resolve_relative_paths(data, EXAMPLE_CONFIG.parent)
    data.pop("tier_limits", None)
    # The listeners are the tests' own (``Listen``), and statistics stay where Triton
    # keeps them (keyed, on the tenant ports) unless a test says otherwise.
    data.pop("server", None)
    # Every model open to every tier: the tests of model access close them themselves.
    data["tier_models"] = {tier: ["*"] for tier in data["tiers"]}
    for endpoint in data["endpoints"].values():
        endpoint["throttle"] = False
    data["default_endpoint"] = {"throttle": False}
    data["tenants"] = {name: {"tier": TIERS[name], "api_keys": [key]} for name, key in KEYS.items()}
    data.update(overrides)
    return data


def required_tool(name: str) -> str:
    """The path of the program ``name``, which ``make setup`` installs: a test that needs it
    fails where it is missing (a skip would pass a suite that tested nothing of it)."""
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: `make setup` installs it", pytrace=False)
    return found


def llm_served(triton: EmbeddedTriton) -> None:
    """Fail unless the Triton serves ``model_repository/llm`` (a model that does not load is
    a failure of every test that needs it, with Triton's reason)."""
    try:
        with urllib.request.urlopen(f"{triton.http_url}/v2/models/llm/ready", timeout=10) as r:
            if r.status == 200:
                return
    except OSError:
        pass
    pytest.fail(f"model_repository/llm is not ready on this Triton: see {triton.log_path}")


def planned(info: ModelInfo, endpoint: Endpoint | None = None) -> EndpointPlan:
    """The model's plan (``fair_frontend.endpoint.plan``) under a config whose entry for it
    is ``endpoint`` (the default one where not given): what a shell validates a request
    by, and packs and unpacks its batch by."""
    config = Config(tiers=["standard"], endpoints={info.name: endpoint or Endpoint()})
    return plan(config, info.name, info)


def make_config(**overrides: Any) -> Config:
    return parse_config(config_dict(**overrides))


def ids_input(mod: Any, ids: np.ndarray, *, binary: bool = True, name: str = "INPUT_IDS") -> Any:
    """An INT32 token-id input for tritonclient's grpc, grpc.aio or http module."""
    inp = mod.InferInput(name, list(ids.shape), "INT32")
    if mod.__name__.endswith("http"):
        inp.set_data_from_numpy(ids, binary_data=binary)
    else:
        inp.set_data_from_numpy(ids)
    return inp


@dataclass
class RunningFrontend:
    """A frontend on its own event loop in a thread, in front of a real Triton."""

    server: FrontendServer
    background: BackgroundServer

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.server.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.server.metrics_port}/metrics"

    @property
    def frontend(self) -> Any:
        """The core (in this process whatever the number of shells)."""
        return self.server.frontend

    @property
    def gateway(self) -> Any:
        """The in-process shell's gateway (``workers=1`` only)."""
        return self.server.gateway

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        """Run a coroutine on the frontend's loop (to read its state safely)."""
        return self.background.call(coro, timeout)

    async def acall(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """``call`` for async tests: awaits without blocking the test's own event loop."""
        future = asyncio.run_coroutine_threadsafe(coro, self.background.loop)
        return await asyncio.wrap_future(future)

    async def batch_count(self, model: str) -> int:
        runtime = self.frontend.runtimes.get(model)
        return 0 if runtime is None else runtime.batches_sent

    async def counters(self, model: str) -> Any:
        return self.frontend.runtimes[model].scheduler.counters


@contextlib.contextmanager
def running_frontend(
    config: Config,
    triton: EmbeddedTriton | str,
    *,
    workers: int = 1,
    listen: Listen | None = None,
) -> Iterator[RunningFrontend]:
    """The frontend, its core on a thread of this process (its state readable here), with
    ``workers`` shells: 1 in this process too, more as processes of their own.

    ``triton``: a running ``EmbeddedTriton`` (batches go over its HTTP endpoint, as in
    ``up`` mode, unless the config names one), or a gRPC address (batches over gRPC).
    ``listen``: addresses and ports (default: every listener on a free loopback port)."""
    url = triton if isinstance(triton, str) else triton.grpc_url
    if not isinstance(triton, str) and config.triton.http_url is None:
        http = config.triton.model_copy(update={"http_url": triton.http_url})
        config = config.model_copy(update={"triton": http})
    server = FrontendServer(config, url, listen or Listen(), workers=workers)
    background = BackgroundServer(server)
    with background:
        yield RunningFrontend(server, background)


async def gather_settled(*aws: Any) -> list[Any]:
    """asyncio.gather that returns exceptions as values."""
    return list(await asyncio.gather(*aws, return_exceptions=True))


def identity_request(payload: bytes) -> bytes:
    """A serialized ``ModelInferRequest`` to ``simple_identity``: one BYTES element,
    ``payload`` (its size is the request's size, for tests of message bounds)."""
    msg = service_pb2.ModelInferRequest(model_name="simple_identity")
    msg.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, 1])
    msg.raw_input_contents.append(struct.pack("<I", len(payload)) + payload)
    return msg.SerializeToString()


def metric_sum(running: RunningFrontend, name: str, **labels: str) -> float:
    """The sum of the frontend's ``name`` samples whose labels include ``labels``, from
    one scrape of its /metrics (which counts what the shells answered themselves first)."""
    return scrape(running.metrics_url).sum(name, **labels)


# ---- a Redis of a test's own ----------------------------------------------------------------

START_TIMEOUT_S = 10.0


class RedisProcess:
    """A ``redis-server`` this test owns: no persistence, loopback only, a free port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = required_tool("redis-server")
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
        """Sum of a Prometheus family's samples at ``url`` (counters: the ``_total`` sample)
        whose labels include ``labels``; 0 when none."""
        return scrape(url, timeout=5).family_sum(family, **labels)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        if self._session is not None:
            await self._session.close()


# ---- raw HTTP: a request as bytes on a socket, the answer as the server sent it -------------

# How long a client waits for an answer. Far above what any refusal should take; a server
# that waits for a body the client never sends runs into it.
ANSWER_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def error(self) -> str:
        doc = json.loads(self.body)
        assert isinstance(doc, dict), self.body
        return str(doc["error"])


def connect(url: str, source: str | None = None) -> socket.socket:
    """A connection to ``url``, from the loopback address ``source`` if given."""
    host, port = url.rsplit(":", 1)
    address = (source, 0) if source is not None else None
    return socket.create_connection(
        (host, int(port)), timeout=ANSWER_TIMEOUT_S, source_address=address
    )


def send_head(sock: socket.socket, path: str, headers: Mapping[str, str]) -> None:
    """A POST's request line and headers, no body."""
    lines = [f"POST {path} HTTP/1.1", "Host: test", *(f"{k}: {v}" for k, v in headers.items())]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())


def read_answer(sock: socket.socket) -> Answer:
    """The final response (http.client skips any 100 Continue)."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    body = response.read()
    return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, body)


def request(url: str, path: str, body: bytes, headers: Mapping[str, str]) -> Answer:
    """A whole request on a connection of its own. A server that refuses it from its first
    bytes may answer and close before the rest is sent (the send then meets a closed
    socket): the answer came first and is read all the same, as HTTP clients do."""
    with connect(url) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            send_head(sock, path, {**headers, "Content-Length": str(len(body))})
            sock.sendall(body)
        return read_answer(sock)


def embed_body(tokens: int, **extra: Any) -> bytes:
    ids = [[t % 4096 for t in range(tokens)]]
    doc = {
        "inputs": [{"name": "INPUT_IDS", "shape": [1, tokens], "datatype": "INT32", "data": ids}]
    }
    return json.dumps({**doc, **extra}).encode()


async def repeat_stream(
    url: str, delays_ms: list[int], *, on_first: Any = None, parameters: Any = None
) -> tuple[int, Any]:
    """One repeat_int32 request on a gRPC stream through the frontend: (responses with a
    value, the error that ended it or None). ``on_first`` runs at the first response;
    ``parameters``: the request's (a gate's, for the model).

    The stream is read to its end (the server closes it once the request's final response
    is out), so whatever the frontend records of the request (its outcome, its tokens) is
    recorded as served, not as cancelled by a client that left early."""
    client = grpcaio.InferenceServerClient(url)
    n = len(delays_ms)
    tensors = []
    for name, dtype, values in (
        ("IN", "INT32", np.arange(n, dtype=np.int32)),
        ("DELAY", "UINT32", np.array(delays_ms, dtype=np.uint32)),
        ("WAIT", "UINT32", np.array([0], dtype=np.uint32)),
    ):
        tensor = grpcaio.InferInput(name, list(values.shape), dtype)
        tensor.set_data_from_numpy(values)
        tensors.append(tensor)

    async def one() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": "repeat_int32", "inputs": tensors, "parameters": parameters}

    got = 0
    try:
        async for result, error in client.stream_infer(one(), headers={"x-api-key": KEYS["acme"]}):
            if error is not None:
                return got, error
            if result.as_numpy("OUT") is None:
                continue
            got += 1
            if got == 1 and on_first is not None:
                on_first()
    finally:
        await client.close()
    return got, None


# ---- streams from the llm model ---------------------------------------------------------

PROMPT = "the quiet tenant asks a short question"


def llm_inputs(prompt: str, max_tokens: int, *, stream: bool = True) -> list[Any]:
    text = grpcaio.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    flag = grpcaio.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([stream]))
    sampling = grpcaio.InferInput("sampling_parameters", [1], "BYTES")
    params = {"max_tokens": max_tokens, "temperature": 0}
    sampling.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
    return [text, flag, sampling]


@dataclass
class Stream:
    """One request's stream as its client saw it."""

    tenant: str
    sent: float = 0.0
    prompt: str = ""
    tokens: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # time.monotonic() of each token
    error: str | None = None

    @property
    def first_token_at(self) -> float:
        return self.times[0]


async def generate(
    url: str, tenant: str | None, prompt: str, max_tokens: int, *, log: list[Any] | None = None
) -> Stream:
    """Stream one generation (one gRPC stream, one request), read to the stream's end
    (as ``repeat_stream``); ``log`` gets (time, tenant) per token, in arrival order across
    concurrent streams."""
    client = grpcaio.InferenceServerClient(url)
    headers = {"x-api-key": KEYS[tenant]} if tenant is not None else None
    out = Stream(tenant or "-", sent=time.monotonic())

    async def one() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": "llm", "inputs": llm_inputs(prompt, max_tokens)}

    try:
        async for result, error in client.stream_infer(one(), headers=headers):
            if error is not None:
                out.error = str(error)
                break
            text = result.as_numpy("text_output")
            if text is None or not text.size:
                continue
            now = time.monotonic()
            out.tokens.append(b"".join(text.reshape(-1)).decode())
            out.times.append(now)
            if log is not None:
                log.append((now, out.tenant))
    finally:
        await client.close()
    return out


async def generate_many(
    url: str, tenant: str, count: int, max_tokens: int, log: list[Any]
) -> dict[str, Stream]:
    """``count`` generations on one gRPC stream (queued at once, as a busy client's
    are), read to the stream's end; ``log`` gets (time, tenant) per token."""
    client = grpcaio.InferenceServerClient(url)
    streams = {
        str(i): Stream(tenant, sent=time.monotonic(), prompt=f"{PROMPT} {i}") for i in range(count)
    }

    async def requests() -> AsyncIterator[dict[str, Any]]:
        for i in range(count):
            yield {
                "model_name": "llm",
                "inputs": llm_inputs(streams[str(i)].prompt, max_tokens),
                "request_id": str(i),
            }

    try:
        async for result, error in client.stream_infer(
            requests(), headers={"x-api-key": KEYS[tenant]}
        ):
            assert error is None, error
            text = result.as_numpy("text_output")
            if text is None or not text.size:
                continue
            now = time.monotonic()
            s = streams[result.get_response().id]
            s.tokens.append(b"".join(text.reshape(-1)).decode())
            s.times.append(now)
            log.append((now, tenant))
    finally:
        await client.close()
    return streams


# ---- fair-frontend commands as processes ------------------------------------------------


@dataclass
class Proc:
    """A ``fair-frontend`` process of this test's, its output in a file."""

    popen: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def start(args: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    out = log.open("wb")
    popen = subprocess.Popen(
        [sys.executable, "-m", "fair_frontend.cli", *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    return Proc(popen, log)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return 0
