"""Rate limits on the real stack: real Triton, the real frontend, real clients, real Redis.

What a client sees when its tenant is over a limit (429 / RESOURCE_EXHAUSTED, the retry
hint, a message naming the limit and window), what is counted (input tokens; plus the
``max_tokens`` request parameter on ``generate``), that a rejected request costs nothing
downstream, and that the limit is exact under concurrency, with ``memory://`` and with
``redis://``, for one frontend and for two sharing one Redis. Redis dying mid-run is in
``test_integration_redis_down``.

Limits here are per minute: nothing a test admits leaves its window while the test runs,
so every count is exact whatever the machine's speed. Each test starts its own frontend
(fresh ``memory://`` counters) in front of the session's Triton, and flushes Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
import tritonclient.http.aio as httpaio
import yaml
from tritonclient.utils import InferenceServerException

from fair_frontend.kit.testing import aeventually
from tests.support import EXAMPLE_CONFIG, KEYS, RunningFrontend, make_config, running_frontend

if TYPE_CHECKING:
    from tests.support import KServe, RedisProcess, Reply

# Storage calls in these tests must never fail (a loaded 2-core machine can stall past the
# production 50 ms), and if one did, fail_closed makes it a visible 503, never an
# unchecked admission that would inflate a count.
TIMEOUT_MS = 5000.0
SETTLE_S = 30.0  # deadline of a count polled on Triton; met far sooner
PROTOCOLS = ["grpc", "http"]


def limited_config(
    tier_limits: dict[str, Any], *, storage: str = "memory://", **overrides: Any
) -> Any:
    return make_config(
        tier_limits=tier_limits,
        rate_limiting={
            "storage": storage,
            "on_storage_error": "fail_closed",
            "timeout_ms": TIMEOUT_MS,
        },
        **overrides,
    )


@contextlib.contextmanager
def limited_frontend(
    triton: Any, workers: int, tier_limits: dict[str, Any], **kw: Any
) -> Iterator[Any]:
    with running_frontend(limited_config(tier_limits, **kw), triton, workers=workers) as fe:
        yield fe


def urls(fe: RunningFrontend) -> tuple[str, str]:
    return (fe.grpc_url, fe.http_url)


def triton_rows(kserve: KServe, triton: Any, model: str) -> float:
    """Rows Triton has executed for ``model`` (``nv_inference_count``: batch items)."""
    return kserve.counter(triton.metrics_url, "nv_inference_count", model=model)


async def rows_since(kserve: KServe, triton: Any, model: str, before: float, least: int) -> float:
    """Rows Triton executed of ``model`` since it counted ``before``, once it counts at
    least ``least`` (a bound: the answer to check is exactly that). Triton counts a
    request once its ``execute`` has returned, a moment after the client had its answer."""
    return float(
        await aeventually(
            lambda: (n := triton_rows(kserve, triton, model) - before) >= least and n,
            SETTLE_S,
            what=f"Triton to count {least} rows of {model}",
        )
    )


def flush(redis_server: RedisProcess) -> None:
    with redis_server.client() as client:
        client.flushall()


def assert_rate_limited(reply: Reply, limit: str, tenant: str, model: str) -> None:
    """429 / RESOURCE_EXHAUSTED, a retry hint, and a message naming the limit and window."""
    expected = "429" if reply.protocol == "http" else "RESOURCE_EXHAUSTED"
    assert reply.status == expected, reply
    assert f"limit: {limit}" in reply.message, reply.message
    assert f"tenant '{tenant}'" in reply.message and f"model '{model}'" in reply.message
    assert reply.retry_after is not None, f"no retry-after on {reply.protocol}"
    # A per-minute limit frees its oldest admission within T + one bucket (61.2 s), and
    # the hint is whole seconds rounded up.
    assert 1 <= int(reply.retry_after) <= 62, reply.retry_after


# ---- what a client sees; what a rejection costs ----------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_over_the_limit_is_refused_with_a_retry_hint_and_costs_nothing(
    triton: Any, kserve: KServe, protocol: str, workers: int
) -> None:
    limit = {"standard": {"embed": {"requests_per_minute": 3}}}
    with limited_frontend(triton, workers, limit) as fe:
        before = triton_rows(kserve, triton, "embed")
        admitted = [await kserve.infer(protocol, urls(fe), KEYS["initech"], "embed", 1, 8)]
        admitted += [await kserve.infer(protocol, urls(fe), KEYS["initech"], "embed", 1, 8)]
        admitted += [await kserve.infer(protocol, urls(fe), KEYS["initech"], "embed", 1, 8)]
        assert all(r.ok for r in admitted), admitted
        assert admitted[0].retry_after is None
        # The positive control: admitted rows do reach Triton, and the scheduler.
        assert await rows_since(kserve, triton, "embed", before, 3) == 3
        served = triton_rows(kserve, triton, "embed")
        counters = await fe.acall(fe.counters("embed"))
        batches = await fe.acall(fe.batch_count("embed"))

        refused = [
            await kserve.infer(protocol, urls(fe), KEYS["initech"], "embed", 1, 8) for _ in range(5)
        ]
        for reply in refused:
            assert_rate_limited(reply, "3 requests per minute", "initech", "embed")
        # Nothing of the refused requests went downstream: Triton executed no row, the
        # scheduler admitted and dispatched nothing, no batch was sent.
        assert triton_rows(kserve, triton, "embed") == served
        assert await fe.acall(fe.counters("embed")) == counters
        assert await fe.acall(fe.batch_count("embed")) == batches
        # Another tenant of the same tier has its own count.
        other = await kserve.infer(protocol, urls(fe), KEYS["hooli"], "embed", 1, 8)
        assert other.ok, other


async def test_token_limits_count_input_tokens(triton: Any, kserve: KServe, workers: int) -> None:
    """``tokens_per_minute`` on ``embed`` counts each request's input tokens, rows included."""
    limit = {"standard": {"embed": {"tokens_per_minute": 300}}}
    with limited_frontend(triton, workers, limit) as fe:
        key, u = KEYS["initech"], urls(fe)
        assert (await kserve.infer("grpc", u, key, "embed", 1, 128)).ok  # 128
        assert (await kserve.infer("http", u, key, "embed", 2, 64)).ok  # 256: rows x tokens
        # 256 + 64 > 300: refused, though a request count would admit it.
        refused = await kserve.infer("grpc", u, key, "embed", 1, 64)
        assert_rate_limited(refused, "300 tokens per minute", "initech", "embed")
        refused = await kserve.infer("http", u, key, "embed", 1, 45)
        assert_rate_limited(refused, "300 tokens per minute", "initech", "embed")
        # Exactly up to the limit still fits (the refusals counted nothing).
        assert (await kserve.infer("http", u, key, "embed", 1, 44)).ok  # 300
        refused = await kserve.infer("grpc", u, key, "embed", 1, 1)
        assert_rate_limited(refused, "300 tokens per minute", "initech", "embed")


async def test_generate_counts_max_tokens_and_its_default(
    triton: Any, kserve: KServe, workers: int
) -> None:
    """On ``generate`` a request costs its input tokens plus ``max_tokens`` (16 when absent),
    a request parameter (gRPC int64_param, HTTP JSON)."""
    limit = {"standard": {"generate": {"tokens_per_minute": 100}}}
    with limited_frontend(triton, workers, limit) as fe:
        key, u = KEYS["initech"], urls(fe)
        assert (await kserve.infer("grpc", u, key, "generate", 1, 32)).ok  # 32 + 16 = 48
        assert (await kserve.infer("http", u, key, "generate", 1, 32)).ok  # 96
        # 96 + 1 + 4 = 101: refused. (Without the default 16 counted, 69: admitted.)
        refused = await kserve.infer("grpc", u, key, "generate", 1, 1, max_tokens=4)
        assert_rate_limited(refused, "100 tokens per minute", "initech", "generate")
        # 96 + 1 + 3 = 100: fits exactly.
        assert (await kserve.infer("http", u, key, "generate", 1, 1, max_tokens=3)).ok
        # One token of prompt and no max_tokens still costs 17.
        refused = await kserve.infer("http", u, key, "generate", 1, 1)
        assert_rate_limited(refused, "100 tokens per minute", "initech", "generate")


async def test_example_config_limits_generate_before_embed(
    triton: Any, kserve: KServe, workers: int
) -> None:
    """The shipped example: a trial tenant's ``generate`` (the heavier endpoint) is refused
    after 10 requests a minute while the same pace on ``embed`` is admitted throughout."""
    tier_limits = yaml.safe_load(EXAMPLE_CONFIG.read_text())["tier_limits"]
    trial = tier_limits["trial"]
    assert trial["generate"]["requests_per_minute"] == 10
    assert trial["embed"]["requests_per_second"] == 20
    with limited_frontend(triton, workers, tier_limits) as fe:
        key, u = KEYS["umbrella"], urls(fe)
        generate: list[Reply] = []
        embed: list[Reply] = []
        # 15 of each, interleaved: at most 15 embed requests in any second (limit 20).
        for i in range(15):
            protocol = PROTOCOLS[i % 2]
            generate.append(await kserve.infer(protocol, u, key, "generate", 1, 4, max_tokens=2))
            embed.append(await kserve.infer(protocol, u, key, "embed", 1, 16))
        assert all(r.ok for r in embed), [r for r in embed if not r.ok][:2]
        assert all(r.ok for r in generate[:10]), generate[:10]
        for reply in generate[10:]:
            assert_rate_limited(reply, "10 requests per minute", "umbrella", "generate")


# ---- exact under concurrency -----------------------------------------------------------------


async def _burst(frontends: list[RunningFrontend], key: str, count: int) -> list[list[str]]:
    """``count`` concurrent requests from tritonclient, interleaved: request ``i`` goes to
    ``frontends[i % len]``, over gRPC aio and HTTP aio alternately. Per frontend, the status
    of each of its requests: "OK" or the error's status."""
    ids = np.full((1, 8), 7, dtype=np.int32)
    grpc_clients = [grpcaio.InferenceServerClient(fe.grpc_url) for fe in frontends]
    http_clients = [
        httpaio.InferenceServerClient(fe.http_url, conn_limit=count) for fe in frontends
    ]

    async def one(i: int) -> str:
        which = i % len(frontends)
        headers = {"authorization": f"Bearer {key}"}  # one each: the HTTP client adds to it
        try:
            if (i // len(frontends)) % 2:
                inp = httpaio.InferInput("INPUT_IDS", [1, 8], "INT32")
                inp.set_data_from_numpy(ids)
                await http_clients[which].infer("embed", [inp], headers=headers)
            else:
                inp = grpcaio.InferInput("INPUT_IDS", [1, 8], "INT32")
                inp.set_data_from_numpy(ids)
                await grpc_clients[which].infer("embed", [inp], headers=headers)
        except InferenceServerException as err:
            return str(err.status())
        return "OK"

    try:
        statuses = await asyncio.gather(*(one(i) for i in range(count)))
        return [list(statuses[n :: len(frontends)]) for n in range(len(frontends))]
    finally:
        for client in grpc_clients + http_clients:
            await client.close()


REFUSED = {"StatusCode.RESOURCE_EXHAUSTED", "429"}


@pytest.mark.parametrize("where", ["memory", "redis"])
async def test_concurrent_burst_admits_exactly_the_limit(
    triton: Any, kserve: KServe, where: str, request: pytest.FixtureRequest, workers: int
) -> None:
    limit, burst = 12, 48
    storage = "memory://"
    if where == "redis":
        redis_server: RedisProcess = request.getfixturevalue("redis_server")
        flush(redis_server)
        storage = redis_server.url
    tier_limits = {"standard": {"embed": {"requests_per_minute": limit}}}
    with limited_frontend(triton, workers, tier_limits, storage=storage) as fe:
        before = triton_rows(kserve, triton, "embed")
        [statuses] = await _burst([fe], KEYS["initech"], burst)
        assert statuses.count("OK") == limit, statuses
        assert set(statuses) - {"OK"} <= REFUSED, set(statuses)
        assert await rows_since(kserve, triton, "embed", before, limit) == limit
        counters = await fe.acall(fe.counters("embed"))
        assert counters.admitted == counters.dispatched == limit


@pytest.mark.parametrize(("where", "admitted"), [("redis", 20), ("memory", 40)])
async def test_two_frontends_sharing_redis_never_exceed_the_limit_together(
    triton: Any,
    kserve: KServe,
    where: str,
    admitted: int,
    request: pytest.FixtureRequest,
    workers: int,
) -> None:
    """Concurrent traffic split across two frontends: with one Redis, one limit in all.

    ``memory://`` is the control: each frontend counts alone and admits the limit itself,
    twice the limit in all, which is what this test must be able to tell apart.
    """
    limit, burst = 20, 80
    storage = "memory://"
    if where == "redis":
        redis_server: RedisProcess = request.getfixturevalue("redis_server")
        flush(redis_server)
        storage = redis_server.url
    tier_limits = {"standard": {"embed": {"requests_per_minute": limit}}}
    with (
        limited_frontend(triton, workers, tier_limits, storage=storage) as a,
        limited_frontend(triton, workers, tier_limits, storage=storage) as b,
    ):
        before = triton_rows(kserve, triton, "embed")
        split = await _burst([a, b], KEYS["initech"], burst)
        ok = [statuses.count("OK") for statuses in split]
        assert sum(ok) == admitted, ok
        for statuses in split:
            assert set(statuses) - {"OK"} <= REFUSED, set(statuses)
        assert await rows_since(kserve, triton, "embed", before, admitted) == admitted
        counters = [await fe.acall(fe.counters("embed")) for fe in (a, b)]
        assert [c.admitted for c in counters] == ok
