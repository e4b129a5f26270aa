"""The side doors: keyed, cached, counted (issue 11, item 8).

Model metadata, config, readiness and statistics need the tenant's key, with the identity
rules of inference; health (live, ready) and server metadata stay open (probes, Triton's
examples; see ``Gateway``'s side doors). Triton's static answers are kept per shell, so a
flood of identical calls (or of calls for a model that does not exist) reaches Triton
once, not once per call; the cache is bounded, since model names are client input. Every
call is counted by door and answer, the lookups that reached Triton too, without a label
series per unknown key or model.

``LookupCache`` is tested on a fake clock with lookups the test answers; the rest against
the real Triton, through a frontend of this module's own (its TTLs longer than any test,
so that what reaches Triton is exact), with one and with two shell processes.
"""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.errors import Unavailable, UpstreamError
from fair_frontend.kit.testing import scrape
from fair_frontend.shell.lookup_cache import MAX_KEPT_NAME_CHARS, LookupCache
from tests.support import KEYS, RunningFrontend, make_config, running_frontend

TTL_S = 10.0
NEGATIVE_TTL_S = 1.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Source:
    """Triton, as the cache sees it: counts the lookups; each waits for the test's answer."""

    def __init__(self, answer: Any = "meta", error: BaseException | None = None) -> None:
        self.calls = 0
        self.answer = answer
        self.error = error
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self) -> Any:
        self.calls += 1
        await self.gate.wait()
        if self.error is not None:
            raise self.error
        return self.answer


def _cache(clock: FakeClock, max_entries: int = 64) -> LookupCache:
    return LookupCache(max_entries=max_entries, negative_ttl_s=NEGATIVE_TTL_S, clock=clock)


def _unknown(model: str) -> UpstreamError:
    return UpstreamError(
        f"Request for unknown model: '{model}' is not found", grpc.StatusCode.INVALID_ARGUMENT, 400
    )


# ---- LookupCache ----------------------------------------------------------------------------


async def test_concurrent_identical_calls_share_one_lookup_kept_for_its_ttl() -> None:
    clock, source = FakeClock(), Source()
    cache = _cache(clock)
    source.gate.clear()
    calls = [
        asyncio.create_task(cache.get(("model_metadata", "embed", ""), TTL_S, source))
        for _ in range(50)
    ]
    await asyncio.sleep(0)  # every caller reaches the shared lookup; no time passes
    source.gate.set()
    assert await asyncio.gather(*calls) == ["meta"] * 50
    assert source.calls == 1
    clock.now += TTL_S - 0.001
    assert await cache.get(("model_metadata", "embed", ""), TTL_S, source) == "meta"
    assert source.calls == 1
    clock.now += 0.002  # expired: asked again
    assert await cache.get(("model_metadata", "embed", ""), TTL_S, source) == "meta"
    assert source.calls == 2


async def test_a_caller_that_goes_away_does_not_fail_the_others() -> None:
    cache, source = _cache(FakeClock()), Source()
    source.gate.clear()
    key = ("model_config", "embed", "1")
    first = asyncio.create_task(cache.get(key, TTL_S, source))
    second = asyncio.create_task(cache.get(key, TTL_S, source))
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    source.gate.set()
    assert await second == "meta" and source.calls == 1


async def test_no_such_model_is_kept_briefly_and_triton_down_not_at_all() -> None:
    clock = FakeClock()
    cache = _cache(clock)
    key = ("model_metadata", "nope", "")
    unknown = Source(error=_unknown("nope"))
    for _ in range(20):
        with pytest.raises(UpstreamError, match="unknown model"):
            await cache.get(key, TTL_S, unknown)
    assert unknown.calls == 1
    clock.now += NEGATIVE_TTL_S
    with pytest.raises(UpstreamError):
        await cache.get(key, TTL_S, unknown)
    assert unknown.calls == 2

    down = Source(error=Unavailable("Triton is unavailable"))
    for _ in range(3):
        with pytest.raises(Unavailable):
            await cache.get(("model_metadata", "embed", ""), TTL_S, down)
    assert down.calls == 3  # a transient error is never the kept answer


async def test_the_cache_is_bounded_least_recently_used_first() -> None:
    cache = _cache(FakeClock(), max_entries=8)
    sources = {f"m{i}": Source(error=_unknown(f"m{i}")) for i in range(100)}
    for name, source in sources.items():
        with pytest.raises(UpstreamError):
            await cache.get(("model_metadata", name, ""), TTL_S, source)
    assert len(cache) == 8
    with pytest.raises(UpstreamError):  # the oldest was dropped: asked again
        await cache.get(("model_metadata", "m0", ""), TTL_S, sources["m0"])
    assert sources["m0"].calls == 2
    with pytest.raises(UpstreamError):  # among the newest: kept
        await cache.get(("model_metadata", "m99", ""), TTL_S, sources["m99"])
    assert sources["m99"].calls == 1


async def test_names_too_long_for_any_model_are_never_kept() -> None:
    cache = _cache(FakeClock())
    name = "x" * (MAX_KEPT_NAME_CHARS + 1)
    source = Source(error=_unknown(name))
    for _ in range(2):
        with pytest.raises(UpstreamError):
            await cache.get(("model_metadata", name, ""), TTL_S, source)
    assert source.calls == 2 and len(cache) == 0


# ---- through the frontend, against the real Triton ------------------------------------------


@pytest.fixture(scope="module")
def fe(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    """A frontend whose shells keep every answer longer than this module runs."""
    long = {"metadata_ttl_s": 3600, "ready_ttl_s": 3600, "negative_ttl_s": 3600}
    with running_frontend(make_config(side_doors=long), triton, workers=workers) as running:
        yield running


KEY = {"authorization": f"Bearer {KEYS['acme']}"}
MODEL_DOORS = [
    "/v2/models/embed",
    "/v2/models/embed/config",
    "/v2/models/embed/ready",
    "/v2/models/embed/stats",
    "/v2/models/stats",
    "/v2/models/simple/versions/1",
    "/v2/models/simple/versions/1/config",
    "/v2/models/simple/versions/1/ready",
    "/v2/models/simple/versions/1/stats",
]
GRPC_DOORS = {
    "ModelMetadata": grpcclient.service_pb2.ModelMetadataRequest(name="embed"),
    "ModelConfig": grpcclient.service_pb2.ModelConfigRequest(name="embed"),
    "ModelReady": grpcclient.service_pb2.ModelReadyRequest(name="embed"),
    "ModelStatistics": grpcclient.service_pb2.ModelStatisticsRequest(name="embed"),
}


def _get(fe: RunningFrontend, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    host, port = fe.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        body = response.read()
        return response.status, json.loads(body) if body else None
    finally:
        conn.close()


def _grpc(fe: RunningFrontend, method: str, request: Any, metadata: Any = ()) -> grpc.StatusCode:
    with grpc.insecure_channel(fe.grpc_url) as channel:
        stub = grpcclient.service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            getattr(stub, method)(request, metadata=metadata, timeout=30)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def _count(fe: RunningFrontend, name: str, **labels: str) -> float:
    return scrape(fe.metrics_url, timeout=30).sum(name, **labels)


def test_model_doors_refuse_a_missing_or_unknown_key_and_a_borrowed_identity(
    fe: RunningFrontend,
) -> None:
    for path in MODEL_DOORS:
        status, doc = _get(fe, path)
        assert status == 401, (path, status, doc)
        assert "missing API key" in doc["error"]
        status, doc = _get(fe, path, {"authorization": "Bearer not-a-key"})
        assert (status, doc["error"]) == (401, "unknown API key"), path
        status, doc = _get(fe, path, {**KEY, "x-tenant-id": "globex"})
        assert status == 403, (path, status, doc)
        status, _ = _get(fe, path, KEY)
        assert status == 200, path
    claim = (("authorization", KEY["authorization"]), ("x-tenant-id", "globex"))
    for method, request in GRPC_DOORS.items():
        assert _grpc(fe, method, request) == grpc.StatusCode.UNAUTHENTICATED, method
        bad = (("x-api-key", "not-a-key"),)
        assert _grpc(fe, method, request, bad) == grpc.StatusCode.UNAUTHENTICATED, method
        assert _grpc(fe, method, request, claim) == grpc.StatusCode.PERMISSION_DENIED, method
        assert _grpc(fe, method, request, tuple(KEY.items())) == grpc.StatusCode.OK, method


def test_health_and_server_metadata_stay_open(fe: RunningFrontend) -> None:
    """Kubernetes probes and Triton's simple_*_health_metadata examples carry no key."""
    assert _get(fe, "/v2/health/live")[0] == 200
    assert _get(fe, "/v2/health/ready")[0] == 200
    status, doc = _get(fe, "/v2")
    assert status == 200 and doc["name"] == "triton"  # the Triton behind it
    client = grpcclient.InferenceServerClient(fe.grpc_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata().name == "triton"


async def _flood(fe: RunningFrontend, call: str, model: str, n: int) -> list[Any]:
    client = grpcaio.InferenceServerClient(fe.grpc_url)
    try:
        return await asyncio.gather(
            *(getattr(client, call)(model, headers=dict(KEY)) for _ in range(n)),
            return_exceptions=True,
        )
    finally:
        await client.close()


async def test_a_flood_of_metadata_calls_reaches_triton_once_per_shell(
    fe: RunningFrontend, workers: int
) -> None:
    n = 40
    for call, door in (
        ("get_model_metadata", "model_metadata"),
        ("get_model_config", "model_config"),
    ):
        lookups = _count(fe, "fair_side_door_lookups_total", door=door)
        answered = _count(fe, "fair_side_door_calls_total", tenant="acme", door=door, outcome="ok")
        answers = await _flood(fe, call, "generate", n)
        assert not [a for a in answers if isinstance(a, BaseException)], answers
        assert len({a.SerializeToString() for a in answers}) == 1
        sent = _count(fe, "fair_side_door_lookups_total", door=door) - lookups
        assert 1 <= sent <= workers, (door, sent)  # without the cache: n
        after = _count(fe, "fair_side_door_calls_total", tenant="acme", door=door, outcome="ok")
        assert after - answered == n


async def test_a_flood_for_a_model_that_does_not_exist_reaches_triton_once_per_shell(
    fe: RunningFrontend, workers: int
) -> None:
    n = 40
    lookups = _count(fe, "fair_side_door_lookups_total", door="model_metadata")
    refused = _count(
        fe, "fair_side_door_calls_total", door="model_metadata", outcome="invalid_argument"
    )
    answers = await _flood(fe, "get_model_metadata", "no_such_model_side_doors", n)
    assert all(isinstance(a, InferenceServerException) for a in answers), answers
    assert all("unknown model" in a.message() for a in answers)
    sent = _count(fe, "fair_side_door_lookups_total", door="model_metadata") - lookups
    assert 1 <= sent <= workers, sent
    after = _count(
        fe, "fair_side_door_calls_total", door="model_metadata", outcome="invalid_argument"
    )
    assert after - refused == n


def test_side_door_calls_are_counted_without_a_series_per_unknown_key(
    fe: RunningFrontend,
) -> None:
    before = _count(
        fe, "fair_side_door_calls_total", tenant="-", door="model_config", outcome="unauthenticated"
    )
    live = _count(fe, "fair_side_door_calls_total", door="live", outcome="ok")
    for i in range(25):
        status, _ = _get(fe, "/v2/models/embed/config", {"x-api-key": f"guess-{i}"})
        assert status == 401
    _get(fe, "/v2/health/live")
    after = _count(
        fe, "fair_side_door_calls_total", tenant="-", door="model_config", outcome="unauthenticated"
    )
    assert after - before == 25
    assert _count(fe, "fair_side_door_calls_total", door="live", outcome="ok") == live + 1
    page = scrape(fe.metrics_url, timeout=30)
    tenants = page.label_values("fair_side_door_calls_total", "tenant")
    assert tenants <= {*KEYS, "-"}, tenants
    doors = page.label_values("fair_side_door_calls_total", "door")
    assert doors <= {
        "live", "ready", "server_metadata", "model_metadata", "model_config", "model_ready",
        "statistics",
    }  # fmt: skip


def test_inference_for_a_model_that_does_not_exist_asks_triton_once_per_shell(
    fe: RunningFrontend, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model lookup behind inference keeps "no such model" too: one client naming the
    same missing model again and again costs Triton one lookup per shell, not one each."""
    forwarder = fe.frontend.forwarder  # the core's, in this process whatever the shells
    real_config = forwarder.model_config
    asked: list[str] = []

    async def counted(model: str, version: str = "") -> Any:
        asked.append(model)
        return await real_config(model, version)

    monkeypatch.setattr(forwarder, "model_config", counted)
    client = grpcclient.InferenceServerClient(fe.grpc_url)
    model = "no_such_model_infer_flood"
    inp = grpcclient.InferInput("INPUT_IDS", [1, 4], "INT32")
    inp.set_data_from_numpy(np.zeros((1, 4), dtype=np.int32))
    for _ in range(20):  # one after another: nothing to share but what is kept
        with pytest.raises(InferenceServerException, match="unknown model"):
            client.infer(model, [inp], headers=dict(KEY))
    assert 1 <= asked.count(model) <= workers, asked  # without the negative answer: 20
