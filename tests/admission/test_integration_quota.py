"""Quota headers on the real stack: real Triton, the real frontend (in one process and with
two shell processes: ``workers``), real clients (aiohttp, grpc.aio on tritonclient's
stub), real Redis.

What a client reads: OpenAI's ``x-ratelimit-*`` headers (HTTP) and metadata (gRPC) on
every answer of the KServe routes: infer, generate, generate_stream, ModelInfer,
ModelStreamInfer, the 429s included. ``remaining`` counts down with each request and a
refusal counts nothing; once ``reset`` has passed the whole limit is back, and not a
millisecond before (on the core's wall clock, which the test holds still and moves on
itself: a one-second window does not depend on how fast this machine answers). Two
frontends sharing one Redis report one count. A day's limit used up is ``QuotaExhausted``
in the shell that answers (its class crossed the core's socket by name), a 429 with the
headers for its client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from fair_frontend.backends.triton.forwarder import TritonForwarder
from fair_frontend.config import parse_config
from fair_frontend.errors import QuotaExhausted, RateLimited
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.shell.gateway import Gateway
from fair_frontend.shell.process import keyring_of
from fair_frontend.shell.socket_link import SocketLink
from fair_frontend.wire.records import LINK_VERSION, Hello, Settings
from tests.support import (
    KEYS,
    http_body,
    infer_request,
    llm_served,
    make_config,
    running_frontend,
)
from tests.test_quota import parse_duration

if TYPE_CHECKING:
    from tests.support import RedisProcess, RunningFrontend

TIMEOUT_MS = 5000.0  # storage calls must never fail here (fail_closed: a visible 503)
PROTOCOLS = ["grpc", "http"]
KEY = KEYS["initech"]  # tier standard


@contextlib.contextmanager
def limited(
    triton: Any, workers: int, limits: dict[str, Any], storage: str = "memory://"
) -> Iterator[RunningFrontend]:
    config = make_config(
        tier_limits={"standard": limits},
        rate_limiting={
            "storage": storage,
            "on_storage_error": "fail_closed",
            "timeout_ms": TIMEOUT_MS,
        },
    )
    with running_frontend(config, triton, workers=workers) as fe:
        yield fe


@dataclass(frozen=True)
class Got:
    """One answer as its client read it: OK or not, its quota headers, its retry hint."""

    ok: bool
    refused: bool  # 429 / RESOURCE_EXHAUSTED
    quota: dict[str, str]
    retry_after: str | None

    def remaining(self, unit: str = "requests") -> int:
        return int(self.quota[f"x-ratelimit-remaining-{unit}"])

    def limit(self, unit: str = "requests") -> int:
        return int(self.quota[f"x-ratelimit-limit-{unit}"])

    def reset_s(self, unit: str = "requests") -> float:
        return parse_duration(self.quota[f"x-ratelimit-reset-{unit}"]) / 1000


def _quota(pairs: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in pairs if str(k).startswith("x-ratelimit-")}


class Client:
    """KServe calls as clients make them, keeping headers and metadata."""

    def __init__(self) -> None:
        self.session = aiohttp.ClientSession()
        self.channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, url: str) -> service_pb2_grpc.GRPCInferenceServiceStub:
        if url not in self.channels:
            self.channels[url] = grpc.aio.insecure_channel(url)
        return service_pb2_grpc.GRPCInferenceServiceStub(self.channels[url])

    async def infer(self, protocol: str, fe: RunningFrontend, tokens: int = 8) -> Got:
        if protocol == "grpc":
            return await self.grpc(fe.grpc_url, infer_request("embed", 1, tokens))
        return await self.http(fe.http_url, "/v2/models/embed/infer", http_body("embed", 1, tokens))

    async def grpc(self, url: str, request: service_pb2.ModelInferRequest) -> Got:
        call = self.stub(url).ModelInfer(request, metadata=(("authorization", f"Bearer {KEY}"),))
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call
        code = await call.code()
        trailers = dict(await call.trailing_metadata() or ())
        retry = trailers.get("retry-after")
        return Got(
            code == grpc.StatusCode.OK,
            code == grpc.StatusCode.RESOURCE_EXHAUSTED,
            _quota(await call.initial_metadata() or ()),
            None if retry is None else str(retry),
        )

    async def http(self, url: str, path: str, body: bytes) -> Got:
        async with self.session.post(
            f"http://{url}{path}", data=body, headers={"authorization": f"Bearer {KEY}"}
        ) as response:
            await response.read()
            return Got(
                response.status == 200,
                response.status == 429,
                _quota(response.headers.items()),
                response.headers.get("Retry-After"),
            )

    async def close(self) -> None:
        await self.session.close()
        for channel in self.channels.values():
            await channel.close()


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    made = Client()
    yield made
    await made.close()


def _nothing() -> None:
    pass


class StillWall:
    """A wall clock that stands still until the test moves it on, for a running core: the
    rate limits' only clock is the core's ``wall`` (``Core(wall=...)``, read by its
    ``accounting`` at each check), so requests answered at any speed are all at one moment
    of their windows. Whole microseconds from a whole second, as the limiter counts them."""

    def __init__(self) -> None:
        self._us = int(time.time()) * 1_000_000

    def __call__(self) -> float:
        return self._us / 1e6

    def advance_ms(self, ms: int) -> None:
        self._us += ms * 1000

    def hold(self, fe: RunningFrontend) -> StillWall:
        """Be the clock of ``fe``'s rate limits from now on (its core runs in this process
        whatever the number of shells)."""
        fe.frontend.accounting.wall = self
        return self


# ---- counts down, refuses, resets -------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_remaining_counts_down_and_the_window_resets(
    triton: Any, client: Client, protocol: str, workers: int
) -> None:
    limits = {"embed": {"requests_per_second": 4, "tokens_per_minute": 1000}}
    with limited(triton, workers, limits) as fe:
        wall = StillWall().hold(fe)
        admitted = [await client.infer(protocol, fe) for _ in range(4)]
        assert all(g.ok for g in admitted), admitted
        assert [g.limit() for g in admitted] == [4] * 4
        assert [g.remaining() for g in admitted] == [3, 2, 1, 0]
        assert [g.limit("tokens") for g in admitted] == [1000] * 4
        assert [g.remaining("tokens") for g in admitted] == [992, 984, 976, 968]
        for g in admitted:
            # The window empties one second (plus at most one 20 ms bucket) after the
            # newest admission; the minute's a minute (plus 1.2 s) after it.
            assert 0 < g.reset_s() <= 1.02, g.quota
            assert g.reset_s() == admitted[0].reset_s()  # one moment: one bucket
            assert 58 < g.reset_s("tokens") <= 61.2, g.quota
        refused = await client.infer(protocol, fe)
        assert refused.refused and refused.retry_after is not None, refused
        # The 429 has the headers too, and counted nothing.
        assert (refused.remaining(), refused.remaining("tokens")) == (0, 968)
        assert 0 < refused.reset_s() <= 1.02
        reset_ms = parse_duration(refused.quota["x-ratelimit-reset-requests"])
        # A millisecond before the reset it told, the window still holds the four.
        wall.advance_ms(reset_ms - 1)
        early = await client.infer(protocol, fe)
        assert early.refused and early.remaining() == 0, early
        # Once that reset has passed, the whole limit is back: this request leaves 3.
        wall.advance_ms(1)
        again = await client.infer(protocol, fe)
        assert again.ok, again
        assert again.remaining() == 3 and again.remaining("tokens") == 960


async def test_no_limits_no_headers(triton: Any, client: Client, workers: int) -> None:
    with limited(triton, workers, {"generate": {"requests_per_minute": 5}}) as fe:
        for protocol in PROTOCOLS:
            got = await client.infer(protocol, fe)  # embed: this tier has no limit on it
            assert got.ok and got.quota == {}, got


# ---- generate, generate_stream and ModelStreamInfer ---------------------------------------


async def test_generate_routes_carry_the_headers(triton: Any, client: Client, workers: int) -> None:
    limits = {
        "generate": {"requests_per_minute": 5, "tokens_per_minute": 100},
        "llm": {"requests_per_minute": 5},
    }
    with limited(triton, workers, limits) as fe:
        body = json.dumps({"INPUT_IDS": [1, 2, 3], "parameters": {"max_tokens": 4}}).encode()
        path = "/v2/models/generate/generate"
        first = await client.http(fe.http_url, path, body)
        assert first.ok, first
        assert (first.remaining(), first.remaining("tokens")) == (4, 93)  # 3 + max_tokens 4
        # generate_stream on the same batch model: one event, the same headers.
        second = await client.http(fe.http_url, path + "_stream", body)
        assert second.ok and (second.remaining(), second.remaining("tokens")) == (3, 86)
        # A refusal before any answer: 429 with the headers (tokens: 86 + 90 > 100).
        big = json.dumps({"INPUT_IDS": [1, 2, 3], "parameters": {"max_tokens": 87}}).encode()
        refused = await client.http(fe.http_url, path, big)
        assert refused.refused and refused.retry_after is not None
        assert (refused.remaining(), refused.remaining("tokens")) == (3, 86)
        refused = await client.http(fe.http_url, path + "_stream", big)
        assert refused.refused and refused.remaining("tokens") == 86

        llm_served(triton)  # a stream granted a slot: the headers come with its grant
        prompt = {"text_input": "a quota", "parameters": {"stream": True, "max_tokens": 3}}
        streamed = await client.http(
            fe.http_url, "/v2/models/llm/generate_stream", json.dumps(prompt).encode()
        )
        assert streamed.ok and streamed.limit() == 5 and streamed.remaining() == 4, streamed
        assert "x-ratelimit-limit-tokens" not in streamed.quota  # no token limit on llm


def _llm_request(n: int) -> service_pb2.ModelInferRequest:
    """An llm generation of 2 tokens that ends with an empty final response (flagged)."""
    request = service_pb2.ModelInferRequest(model_name="llm", id=str(n))
    for name, dtype, data in (
        ("text_input", "BYTES", b"a quota"),
        ("sampling_parameters", "BYTES", json.dumps({"max_tokens": 2}).encode()),
    ):
        request.inputs.add(name=name, datatype=dtype, shape=[1])
        request.raw_input_contents.append(len(data).to_bytes(4, "little") + data)
    request.inputs.add(name="stream", datatype="BOOL", shape=[1])
    request.raw_input_contents.append(np.array([True]).tobytes())
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


async def test_a_grpc_stream_has_the_state_at_each_end(
    triton: Any, client: Client, workers: int
) -> None:
    """ModelStreamInfer: the initial metadata has the state its first request left, the
    trailing metadata the state the last one left (sent after the first ended)."""
    llm_served(triton)
    with limited(triton, workers, {"llm": {"requests_per_minute": 5}}) as fe:
        first_done = asyncio.Event()

        async def requests() -> AsyncIterator[service_pb2.ModelInferRequest]:
            yield _llm_request(1)
            await first_done.wait()
            yield _llm_request(2)

        call = client.stub(fe.grpc_url).ModelStreamInfer(
            requests(), metadata=(("authorization", f"Bearer {KEY}"),)
        )
        finals = 0
        async for reply in call:
            assert not reply.error_message, reply.error_message
            if reply.infer_response.parameters["triton_final_response"].bool_param:
                finals += 1
                if finals == 1:
                    first_done.set()
                else:
                    break
        assert finals == 2
        initial = _quota(await call.initial_metadata() or ())
        assert initial["x-ratelimit-limit-requests"] == "5", initial
        assert initial["x-ratelimit-remaining-requests"] == "4", initial
        # The stream ends once both are answered (the client half-closed after the second).
        trailing = _quota(await call.trailing_metadata() or ())
        assert trailing["x-ratelimit-remaining-requests"] == "3", trailing
        assert await call.code() == grpc.StatusCode.OK


# ---- replicas, and the day's allowance -------------------------------------------------------


async def test_two_frontends_sharing_redis_report_one_count(
    triton: Any, client: Client, redis_server: RedisProcess, workers: int
) -> None:
    with redis_server.client() as r:
        r.flushall()
    limits = {"embed": {"requests_per_minute": 10, "tokens_per_day": 1000}}
    with (
        limited(triton, workers, limits, storage=redis_server.url) as a,
        limited(triton, workers, limits, storage=redis_server.url) as b,
    ):
        got = []
        for i in range(6):  # a, b, a, b ... over both protocols
            got.append(await client.infer(PROTOCOLS[i // 2 % 2], (a, b)[i % 2], tokens=8 + i))
        assert all(g.ok for g in got), got
        assert [g.remaining() for g in got] == [9, 8, 7, 6, 5, 4]
        spent = np.cumsum([8 + i for i in range(6)])
        assert [g.remaining("tokens") for g in got] == [1000 - int(s) for s in spent]
        assert all(0 < g.reset_s() <= 61.2 for g in got)


async def _attached_gateway(fe: RunningFrontend) -> tuple[Gateway, SocketLink]:
    """A shell of this test's own on the core's socket: the records a shell process reads
    (framed, decoded), through the ``Gateway`` every shell process runs."""
    shells = fe.server.shells
    assert shells is not None and shells.server.path is not None
    settings: asyncio.Future[Settings] = asyncio.get_running_loop().create_future()

    def on_settings(got: Settings) -> None:
        if not settings.done():
            settings.set_result(got)

    link = await SocketLink.connect(shells.server.path, on_settings, _nothing, _nothing)
    link.send(Hello(99, os.getpid(), LINK_VERSION))
    got = await asyncio.wait_for(settings, 10.0)
    config = parse_config(got.config)
    triton = TritonForwarder(got.triton_url, request_timeout_s=config.triton.request_timeout_s)
    return Gateway(config, keyring_of(got), link, triton), link


async def test_a_day_used_up_is_quota_exhausted_across_the_shell_socket(
    triton: Any, client: Client
) -> None:
    limits = {"embed": {"requests_per_day": 2, "requests_per_second": 100}}
    with limited(triton, 2, limits) as fe:  # two shell processes: the core answers by socket
        gateway, link = await _attached_gateway(fe)
        try:
            ids = np.full((1, 8), 7, dtype=np.int32)
            request = InferRequest("embed", inputs=[Tensor("INPUT_IDS", "INT32", (1, 8), ids)])
            headers = {"authorization": f"Bearer {KEY}"}
            answer = await gateway.infer(request, headers)
            assert answer.quota is not None and answer.quota.requests is not None
            assert (answer.quota.requests.remaining, answer.quota.requests.window) == (1, "day")
            # The second, through a real shell process: the last of the day.
            assert (await client.infer("http", fe)).remaining() == 0
            with pytest.raises(QuotaExhausted) as refused:
                await gateway.infer(request, headers)
            err = refused.value
            assert isinstance(err, RateLimited) and err.http_status == 429
            assert err.quota is not None and err.quota.requests is not None
            assert err.quota.requests.remaining == 0 and err.retry_after is not None
            assert err.retry_after > 86_000  # the day's oldest admission frees it
        finally:
            assert link.transport is not None
            link.transport.close()
            await gateway.triton.close()
        # What a client of the shell processes reads: the same 429, with the headers.
        for protocol in PROTOCOLS:
            got = await client.infer(protocol, fe)
            assert got.refused and got.remaining() == 0, got
            assert 86_000 < got.reset_s() <= 86_400 + 1728, got.quota  # a day (+ a bucket)
            assert int(got.retry_after or 0) > 86_000
