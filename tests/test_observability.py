"""Observability on the real stack: the frontend's counters, Triton's own, logs, feedback status.

Every test starts its own frontend (in-process, free ports) in front of the session's
Triton, with tenants whose names are unique to the run: the frontend's registry is its
own, so its counters start at zero, and Triton's per-tenant families
(``fair_model_rows_total`` / ``fair_model_tokens_total``, ``python_backend/metering.py``)
are read as differences, for tenants nobody else uses. Requests are sent one at a time,
so every dispatched request is exactly one batch and the expected counts are exact.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
import tritonclient.http.aio as httpaio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton, free_port
from fair_frontend.core.metrics import OTHER_ENDPOINT, OTHER_TENANT, UNAUTHENTICATED
from fair_frontend.kit.testing import Samples, aeventually, ascrape
from fair_frontend.observability.logs import REQUEST_LOGGER, JsonFormatter
from tests.support import (
    RunningFrontend,
    config_dict,
    ids_input,
    make_config,
    running_frontend,
)

_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# ---- the workload -------------------------------------------------------------------------


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def ids(rows: int, width: int, value: int = 7) -> np.ndarray:
    return np.full((rows, width), value, dtype=np.int32)


@dataclass
class Expected:
    """What the workload should have produced, counted by the test as it sends."""

    requests: dict[tuple[str, str, str, str], int] = field(default_factory=dict)
    rows: dict[tuple[str, str], int] = field(default_factory=dict)  # (tenant, endpoint)
    tokens: dict[tuple[str, str], int] = field(default_factory=dict)
    batches: dict[str, int] = field(default_factory=dict)
    rate_hits: dict[tuple[str, str], int] = field(default_factory=dict)

    def outcome(self, tenant: str, tier: str, endpoint: str, outcome: str) -> None:
        key = (tenant, tier, endpoint, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    def served(self, tenant: str, tier: str, endpoint: str, rows: int, tokens: int) -> None:
        self.outcome(tenant, tier, endpoint, "dispatched")
        self.rows[(tenant, endpoint)] = self.rows.get((tenant, endpoint), 0) + rows
        self.tokens[(tenant, endpoint)] = self.tokens.get((tenant, endpoint), 0) + tokens
        self.batches[endpoint] = self.batches.get(endpoint, 0) + 1


async def grpc_call(
    client: grpcaio.InferenceServerClient,
    model: str,
    inputs: list[Any],
    key: str | None,
    **kw: Any,
) -> InferenceServerException | None:
    """One request; the error it was answered with, or None on success."""
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    try:
        await client.infer(model, inputs, headers=headers, **kw)
    except InferenceServerException as err:
        return err
    return None


def status_of(err: InferenceServerException | None) -> str | None:
    return None if err is None else str(err.status())


# ---- counters ------------------------------------------------------------------------------


@pytest.fixture
def tenants() -> dict[str, tuple[str, str]]:
    """role -> (tenant name unique to this run, tier)."""
    return {
        "a": (unique("obs-a"), "enterprise"),
        "b": (unique("obs-b"), "standard"),
        "c": (unique("obs-c"), "trial"),
    }


def _tenant_config(names: dict[str, tuple[str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tenant, tier in names.values():
        out[tenant] = {"tier": tier, "api_keys": [f"{tenant}-key"]}
    return out


async def test_every_counter_matches_the_workload_and_tritons_own_accounting(
    triton: EmbeddedTriton, tenants: dict[str, tuple[str, str]], workers: int
) -> None:
    (a, tier_a), (b, tier_b), (c, tier_c) = tenants["a"], tenants["b"], tenants["c"]
    tenant_cfg = _tenant_config(tenants)
    tenant_cfg[c]["limits"] = {"embed": {"requests_per_minute": 3}}  # the 4th and 5th: 429
    endpoints = config_dict()["endpoints"]
    # The throttle on generate only (its decisions are counted); it never rejects here:
    # requests go one at a time, a short queue.
    endpoints["generate"]["throttle"] = True
    endpoints["generate"]["normalize_cost"] = False  # plain cost: 1 per row, checked below
    config = make_config(tenants=tenant_cfg, endpoints=endpoints)
    key = {t: f"{t}-key" for t in (a, b, c)}
    exp = Expected()
    triton_before = await ascrape(triton.metrics_url)

    with running_frontend(config, triton, workers=workers) as fe:
        rpc = grpcaio.InferenceServerClient(fe.grpc_url)
        http = httpaio.InferenceServerClient(fe.http_url)
        try:
            # a: embed over gRPC, multi-row requests too.
            for rows, width in [(1, 16), (2, 40), (1, 7)]:
                inp = [ids_input(grpcaio, ids(rows, width))]
                assert await grpc_call(rpc, "embed", inp, key[a]) is None
                exp.served(a, tier_a, "embed", rows, rows * width)
            # a: generate; tokens = prompt + generated (max_tokens, default 16).
            assert await grpc_call(rpc, "generate", [ids_input(grpcaio, ids(1, 8))], key[a]) is None
            exp.served(a, tier_a, "generate", 1, 8 + 16)
            inp = [ids_input(grpcaio, ids(2, 5))]
            err = await grpc_call(rpc, "generate", inp, key[a], parameters={"max_tokens": 4})
            assert err is None
            exp.served(a, tier_a, "generate", 2, 2 * (5 + 4))
            # b: embed over HTTP (binary tensors), generate over gRPC.
            for width in (12, 300):
                await http.infer(
                    "embed",
                    [ids_input(httpaio, ids(1, width))],
                    headers={"authorization": f"Bearer {key[b]}"},
                )
                exp.served(b, tier_b, "embed", 1, width)
            assert await grpc_call(rpc, "generate", [ids_input(grpcaio, ids(3, 4))], key[b]) is None
            exp.served(b, tier_b, "generate", 3, 3 * (4 + 16))
            # c: 5 embed requests against a limit of 3 per minute.
            for i in range(5):
                err = await grpc_call(rpc, "embed", [ids_input(grpcaio, ids(1, 20))], key[c])
                if i < 3:
                    assert err is None
                    exp.served(c, tier_c, "embed", 1, 20)
                else:
                    assert status_of(err) == "StatusCode.RESOURCE_EXHAUSTED", err
                    exp.outcome(c, tier_c, "embed", "rejected_rate")
                    exp.rate_hits[(c, "embed")] = exp.rate_hits.get((c, "embed"), 0) + 1
            # Bad input: wrong datatype (a), an input the model does not have (b).
            bad = grpcaio.InferInput("INPUT_IDS", [1, 4], "FP32")
            bad.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
            err = await grpc_call(rpc, "embed", [bad], key[a])
            assert status_of(err) == "StatusCode.INVALID_ARGUMENT", err
            exp.outcome(a, tier_a, "embed", "rejected_invalid")
            bogus = ids_input(grpcaio, ids(1, 4), name="BOGUS")
            err = await grpc_call(rpc, "generate", [ids_input(grpcaio, ids(1, 4)), bogus], key[b])
            assert status_of(err) == "StatusCode.INVALID_ARGUMENT", err
            exp.outcome(b, tier_b, "generate", "rejected_invalid")
            # Unauthenticated: an unknown key twice, no key once. Refused before their
            # message is received, so before the model it names is known: "other".
            for _ in range(2):
                err = await grpc_call(rpc, "embed", [ids_input(grpcaio, ids(1, 4))], "nope")
                assert status_of(err) == "StatusCode.UNAUTHENTICATED", err
                exp.outcome(UNAUTHENTICATED, UNAUTHENTICATED, OTHER_ENDPOINT, "rejected_auth")
            err = await grpc_call(rpc, "generate", [ids_input(grpcaio, ids(1, 4))], None)
            assert status_of(err) == "StatusCode.UNAUTHENTICATED", err
            exp.outcome(UNAUTHENTICATED, UNAUTHENTICATED, OTHER_ENDPOINT, "rejected_auth")
            # Expired: a deadline 1 us after arrival has passed before the request can
            # be dispatched; it is answered at once with Triton's timeout message.
            for _ in range(2):
                inp = [ids_input(grpcaio, ids(1, 9))]
                err = await grpc_call(rpc, "embed", inp, key[b], timeout=1)
                assert status_of(err) == "StatusCode.UNAVAILABLE", err
                assert "Request timeout expired" in str(err)
                exp.outcome(b, tier_b, "embed", "expired")
        finally:
            await rpc.close()
            await http.close()

        got = await ascrape(fe.metrics_url)

    # fair_requests_total: one outcome per request, by tenant, tier, endpoint, outcome.
    seen = {
        (s.labels["tenant"], s.labels["tier"], s.labels["endpoint"], s.labels["outcome"]): s.value
        for s in got
        if s.name == "fair_requests_total"
    }
    assert seen == {k: float(v) for k, v in exp.requests.items()}
    for (tenant, endpoint), rows in exp.rows.items():
        assert got.sum("fair_served_rows_total", tenant=tenant, endpoint=endpoint) == rows
        tokens = exp.tokens[(tenant, endpoint)]
        assert got.sum("fair_served_tokens_total", tenant=tenant, endpoint=endpoint) == tokens
        # Plain cost (normalize_cost off): tokens on embed, rows on generate.
        cost = tokens if endpoint == "embed" else rows
        assert got.sum("fair_served_cost_total", tenant=tenant, endpoint=endpoint) == cost
    assert got.label_values("fair_served_rows_total", "tenant") == {a, b, c}
    # Queue wait: observed once per dispatched request, under its tenant and tier.
    for tenant, tier, endpoint in {k[:3] for k in exp.requests}:
        waits = got.sum("fair_queue_wait_seconds_count", tenant=tenant, endpoint=endpoint)
        assert waits == exp.requests.get((tenant, tier, endpoint, "dispatched"), 0), tenant
    # Batches: one per dispatched request (sent one at a time), all ok; rows histogram.
    for endpoint, n in exp.batches.items():
        assert got.sum("fair_batches_total", endpoint=endpoint, result="ok") == n
        assert got.sum("fair_batches_total", endpoint=endpoint, result="error") == 0
        assert got.sum("fair_batch_seconds_count", endpoint=endpoint) == n
        assert got.sum("fair_batch_rows_count", endpoint=endpoint) == n
        rows = sum(r for (_, ep), r in exp.rows.items() if ep == endpoint)
        assert got.sum("fair_batch_rows_sum", endpoint=endpoint) == rows
    # Rate-limit hits, by the limit that refused.
    assert got.sum("fair_rate_limit_hits_total", tenant=c, endpoint="embed") == 2
    assert got.label_values("fair_rate_limit_hits_total", "limit") == {"3 requests per minute"}
    # The throttle (generate only) decided once per valid, authenticated generate request.
    generate_checked = sum(
        n for (_, _, ep, oc), n in exp.requests.items() if ep == "generate" and oc == "dispatched"
    )
    assert got.sum("fair_throttle_decisions_total", endpoint="generate") == generate_checked
    assert got.sum("fair_throttle_decisions_total", endpoint="embed") == 0
    assert got.sum("fair_predicted_wait_seconds_count", endpoint="generate") == generate_checked
    assert got.sum("fair_backend_available") == 1
    # Nothing left queued or in flight.
    assert got.sum("fair_queue_depth") == 0
    assert got.sum("fair_inflight_batches") == 0

    # Triton's own per-tenant accounting agrees with the frontend's, tenant by tenant.
    async def triton_agrees() -> bool:
        after = await ascrape(triton.metrics_url)
        for (tenant, model), rows in exp.rows.items():
            for family, want in (
                ("fair_model_rows_total", rows),
                ("fair_model_tokens_total", exp.tokens[(tenant, model)]),
            ):
                delta = after.sum(family, model=model, tenant=tenant) - triton_before.sum(
                    family, model=model, tenant=tenant
                )
                if delta != want:
                    return False
        return True

    # The model increments its counters as it answers: poll, do not assume.
    await aeventually(
        triton_agrees, 20, what="Triton's per-tenant counters to match the frontend's"
    )
    after = await ascrape(triton.metrics_url)
    for tenant in (a, b, c):
        for model in ("embed", "generate"):
            assert after.sum("fair_model_rows_total", model=model, tenant=tenant) == got.sum(
                "fair_served_rows_total", tenant=tenant, endpoint=model
            )
            assert after.sum("fair_model_tokens_total", model=model, tenant=tenant) == got.sum(
                "fair_served_tokens_total", tenant=tenant, endpoint=model
            )


async def test_cardinality_guard_folds_later_tenants_into_other_and_keeps_totals(
    triton: EmbeddedTriton,
    workers: int,
) -> None:
    names = [unique(f"obs-g{i}") for i in range(4)]
    config = make_config(
        tenants={n: {"tier": "standard", "api_keys": [f"{n}-key"]} for n in names},
        observability={"max_metric_tenants": 2},
    )
    widths = [10, 20, 30, 40]
    with running_frontend(config, triton, workers=workers) as fe:
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        try:
            # An unauthenticated request first: "-" must not take one of the 2 slots.
            err = await grpc_call(client, "embed", [ids_input(grpcaio, ids(1, 4))], "nope")
            assert status_of(err) == "StatusCode.UNAUTHENTICATED"
            for name, width in zip(names, widths, strict=True):
                for _ in range(2):
                    inp = [ids_input(grpcaio, ids(2, width))]
                    assert await grpc_call(client, "embed", inp, f"{name}-key") is None
        finally:
            await client.close()
        got = await ascrape(fe.metrics_url)

    labels = got.label_values("fair_requests_total", "tenant")
    assert labels == {names[0], names[1], OTHER_TENANT, UNAUTHENTICATED}
    assert got.label_values("fair_served_tokens_total", "tenant") == {
        names[0],
        names[1],
        OTHER_TENANT,
    }
    for name, width in zip(names[:2], widths[:2], strict=True):
        assert got.sum("fair_requests_total", tenant=name, outcome="dispatched") == 2
        assert got.sum("fair_served_rows_total", tenant=name) == 4
        assert got.sum("fair_served_tokens_total", tenant=name) == 4 * width
    # The later two, together under "other".
    assert got.sum("fair_requests_total", tenant=OTHER_TENANT, outcome="dispatched") == 4
    assert got.sum("fair_served_rows_total", tenant=OTHER_TENANT) == 8
    assert got.sum("fair_served_tokens_total", tenant=OTHER_TENANT) == 4 * (30 + 40)
    assert got.sum("fair_queue_wait_seconds_count", tenant=OTHER_TENANT) == 4
    # Totals stay exact.
    assert got.sum("fair_requests_total", outcome="dispatched") == 8
    assert got.sum("fair_served_tokens_total") == 4 * sum(widths)
    assert got.sum("fair_batch_rows_sum", endpoint="embed") == 16


async def test_goodput_gauge_agrees_with_the_served_cost_counter_on_a_scrape(
    triton: EmbeddedTriton,
    workers: int,
) -> None:
    """fair_goodput on a real scrape: once the window's end (the latest whole second) is
    past the last dispatch, every tenant's goodput times the window (10 s) is the cost
    the served-cost counter counted, all of it served well within the window. One
    tenant at a time and never more than one request queued: nobody is backlogged
    through the window, so fair_service_gap and fair_jain_index have no sample (their
    families are on the page all the same)."""
    names = [unique("obs-w0"), unique("obs-w1")]
    config = make_config(tenants={n: {"tier": "standard", "api_keys": [f"{n}-key"]} for n in names})
    with running_frontend(config, triton, workers=workers) as fe:
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        try:
            for name, width in zip(names, (8, 24), strict=True):
                for _ in range(3):
                    inp = [ids_input(grpcaio, ids(2, width))]
                    assert await grpc_call(client, "embed", inp, f"{name}-key") is None
        finally:
            await client.close()

        async def agrees() -> Samples | None:
            got = await ascrape(fe.metrics_url)
            cost = got.by_label("fair_served_cost_total", "tenant", endpoint="embed")
            goodput = got.by_label("fair_goodput", "tenant", endpoint="embed")
            if set(cost) != set(names) or set(goodput) != set(names):
                return None
            if any(abs(goodput[n] * 10 - cost[n]) > 1e-9 * cost[n] for n in names):
                return None
            return got

        got = await aeventually(agrees, 5, 0.2, what="goodput x 10 s = the served cost")
        page = await asyncio.to_thread(
            lambda: _HTTP.open(fe.metrics_url, timeout=10).read().decode()
        )
    assert got.by_label("fair_served_cost_total", "tenant", endpoint="embed")[names[1]] > 0
    assert not got.label_values("fair_service_gap", "tier")
    assert not got.label_values("fair_jain_index", "tier")
    for family in ("fair_service_gap", "fair_jain_index", "fair_goodput"):
        assert f"# TYPE {family} gauge" in page


async def test_unknown_model_names_do_not_become_metric_labels(
    triton: EmbeddedTriton, workers: int
) -> None:
    """The endpoint label comes from the config and Triton's models, never from client input."""
    name = unique("obs-u")
    config = make_config(tenants={name: {"tier": "standard", "api_keys": [f"{name}-key"]}})
    with running_frontend(config, triton, workers=workers) as fe:
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        try:
            for i in range(3):
                model = f"no-such-model-{uuid.uuid4().hex[:6]}-{i}"
                err = await grpc_call(client, model, [ids_input(grpcaio, ids(1, 4))], f"{name}-key")
                assert status_of(err) == "StatusCode.INVALID_ARGUMENT", err
                assert "unknown model" in str(err)
            # No key: refused before the model is even looked up.
            model = f"no-such-model-{uuid.uuid4().hex[:6]}"
            err = await grpc_call(client, model, [ids_input(grpcaio, ids(1, 4))], None)
            assert status_of(err) == "StatusCode.UNAUTHENTICATED", err
            # A model Triton serves but the config does not name keeps its own label.
            inp = [ids_input(grpcaio, ids(1, 4))]
            assert await grpc_call(client, "sleeper", inp, f"{name}-key") is None
        finally:
            await client.close()
        got = await ascrape(fe.metrics_url)
    endpoints = got.label_values("fair_requests_total", "endpoint")
    assert not any(e.startswith("no-such-model") for e in endpoints), endpoints
    assert got.sum("fair_requests_total", endpoint=OTHER_ENDPOINT, outcome="rejected_invalid") == 3
    assert got.sum("fair_requests_total", endpoint=OTHER_ENDPOINT, outcome="rejected_auth") == 1
    assert got.sum("fair_requests_total", endpoint="sleeper", outcome="dispatched") == 1


async def test_requests_the_codec_rejects_are_counted(triton: EmbeddedTriton, workers: int) -> None:
    name = unique("obs-m")
    config = make_config(tenants={name: {"tier": "standard", "api_keys": [f"{name}-key"]}})
    auth = {"authorization": f"Bearer {name}-key"}
    with running_frontend(config, triton, workers=workers) as fe:

        def post() -> int:
            req = urllib.request.Request(
                f"http://{fe.http_url}/v2/models/embed/infer",
                data=b'{"inputs": [ {"name": ',
                headers=auth,
                method="POST",
            )
            try:
                with _HTTP.open(req, timeout=5) as r:
                    return int(r.status)
            except urllib.error.HTTPError as err:
                return int(err.code)

        assert await asyncio.to_thread(post) == 400
        # gRPC: 3 bytes of raw contents for a [1, 4] INT32 tensor.
        request = service_pb2.ModelInferRequest(model_name="embed")
        tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, 4])
        assert tensor.name == "INPUT_IDS"
        request.raw_input_contents.append(b"\x00" * 3)
        async with grpc.aio.insecure_channel(fe.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ModelInfer(request, metadata=tuple(auth.items()))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        got = await ascrape(fe.metrics_url)
    assert got.sum("fair_requests_total", tenant=name, outcome="rejected_invalid") == 2


async def test_a_tenant_added_by_reload_is_counted_under_its_tier(
    triton: EmbeddedTriton, workers: int
) -> None:
    first, added = unique("obs-r1"), unique("obs-r2")
    tenants = {first: {"tier": "standard", "api_keys": [f"{first}-key"]}}
    with running_frontend(make_config(tenants=tenants), triton, workers=workers) as fe:
        tenants[added] = {"tier": "trial", "api_keys": [f"{added}-key"]}
        reloaded = make_config(tenants=tenants)
        # The same Triton section as the running one (running_frontend set its HTTP address).
        reloaded = reloaded.model_copy(update={"triton": fe.server.config.triton})

        async def reload() -> list[str]:
            notes: list[str] = fe.server.reload(reloaded)
            return notes

        assert await fe.acall(reload()) == []
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        try:
            inp = [ids_input(grpcaio, ids(1, 4))]
            assert await grpc_call(client, "embed", inp, f"{added}-key") is None
        finally:
            await client.close()
        got = await ascrape(fe.metrics_url)
    assert got.sum("fair_requests_total", tenant=added, outcome="dispatched") == 1
    assert got.label_values("fair_requests_total", "tier") == {"trial"}


# ---- the request log ----------------------------------------------------------------------


class Lines(logging.Handler):
    """Formats every record it gets as the JSON line the frontend would print."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def log_lines() -> Iterator[tuple[Lines, Lines]]:
    """(request log lines, every line of every logger) while the test runs."""
    requests, everything = Lines(), Lines()
    req_logger, root = logging.getLogger(REQUEST_LOGGER), logging.getLogger()
    level = req_logger.level
    req_logger.setLevel(logging.INFO)
    req_logger.addHandler(requests)
    root.addHandler(everything)
    try:
        yield requests, everything
    finally:
        req_logger.removeHandler(requests)
        root.removeHandler(everything)
        req_logger.setLevel(level)


async def test_request_log_is_one_json_line_per_request_without_keys(
    triton: EmbeddedTriton, log_lines: tuple[Lines, Lines]
) -> None:
    requests, everything = log_lines
    a, b = unique("obs-la"), unique("obs-lb")
    secret = {a: f"sk-{uuid.uuid4().hex}", b: f"sk-{uuid.uuid4().hex}"}
    wrong = f"sk-{uuid.uuid4().hex}"
    config = make_config(
        tenants={
            a: {"tier": "enterprise", "api_keys": [secret[a]]},
            b: {"tier": "standard", "api_keys": [secret[b]]},
        }
    )
    with running_frontend(config, triton) as fe:
        rpc = grpcaio.InferenceServerClient(fe.grpc_url)
        http = httpaio.InferenceServerClient(fe.http_url)
        try:
            inp = [ids_input(grpcaio, ids(1, 8))]
            assert await grpc_call(rpc, "embed", inp, secret[a], request_id="rid-grpc") is None
            await http.infer(
                "embed",
                [ids_input(httpaio, ids(1, 8))],
                headers={"x-api-key": secret[b]},
                request_id="rid-http",
            )
            err = await grpc_call(rpc, "embed", inp, wrong, request_id="rid-wrong-key")
            assert status_of(err) == "StatusCode.UNAUTHENTICATED"
            # A valid key naming another tenant: 403, and still no key in any line.
            with pytest.raises(InferenceServerException) as denied:
                await rpc.infer(
                    "embed",
                    inp,
                    headers={"authorization": f"Bearer {secret[a]}", "x-tenant-id": b},
                    request_id="rid-claim",
                )
            assert status_of(denied.value) == "StatusCode.PERMISSION_DENIED"
            err = await grpc_call(rpc, "embed", inp, secret[b], request_id="rid-late", timeout=1)
            assert status_of(err) == "StatusCode.UNAVAILABLE"
        finally:
            await rpc.close()
            await http.close()

    docs = [json.loads(line) for line in requests.lines]
    # The gRPC calls refused by their key (rid-wrong-key, rid-claim) are refused from
    # their metadata, before their message, and so their id and model, is received.
    refused = [d for d in docs if d["request_id"] == ""]
    by_id = {d["request_id"]: d for d in docs if d["request_id"]}
    assert set(by_id) == {"rid-grpc", "rid-http", "rid-late"}
    assert len(refused) == 2
    assert len(docs) == 5  # exactly one line per request
    for d in docs:
        assert d["logger"] == REQUEST_LOGGER and d["level"] == "info"
        assert d["endpoint"] == ("" if d in refused else "embed")
        assert isinstance(d["latency_ms"], float) and d["latency_ms"] >= 0
    assert by_id["rid-grpc"]["tenant"] == a and by_id["rid-grpc"]["outcome"] == "dispatched"
    assert by_id["rid-http"]["tenant"] == b and by_id["rid-http"]["outcome"] == "dispatched"
    for rid in ("rid-grpc", "rid-http"):
        assert by_id[rid]["queued_ms"] >= 0 and "error" not in by_id[rid]
    wrong_key, claim = refused
    assert wrong_key["tenant"] is None
    assert wrong_key["outcome"] == "rejected_auth"
    assert wrong_key["error"] == "unknown API key"
    assert claim["outcome"] == "rejected_auth"
    assert "does not belong" in claim["error"]
    assert by_id["rid-late"]["tenant"] == b and by_id["rid-late"]["outcome"] == "expired"
    assert "timeout" in by_id["rid-late"]["error"].lower()
    # No key, valid or not, in any line of any logger.
    assert everything.lines, "the root handler saw nothing"
    for line in everything.lines:
        for key in (*secret.values(), wrong):
            assert key not in line, line


# ---- the feedback loop's status ---------------------------------------------------------


def _sleeper_config(tenant: str, metrics_url: str) -> Any:
    return make_config(
        tenants={tenant: {"tier": "standard", "api_keys": [f"{tenant}-key"]}},
        triton={"metrics_url": metrics_url, "metrics_interval_s": 0.2},
    )


async def _one_sleeper_request(fe: RunningFrontend, tenant: str) -> None:
    client = grpcaio.InferenceServerClient(fe.grpc_url)
    try:
        err = await grpc_call(client, "sleeper", [ids_input(grpcaio, ids(4, 64))], f"{tenant}-key")
        assert err is None, err
    finally:
        await client.close()


def _source(got: Samples, endpoint: str) -> dict[str, float]:
    return got.by_label("fair_service_source", "source", endpoint=endpoint)


async def test_feedback_status_is_exported_with_tritons_metrics_as_source(
    triton: EmbeddedTriton,
    workers: int,
) -> None:
    tenant = unique("obs-f")
    with running_frontend(
        _sleeper_config(tenant, triton.metrics_url), triton, workers=workers
    ) as fe:

        async def from_triton() -> Samples | None:
            # Keep batches coming: Triton's counters must move between two scrapes.
            await _one_sleeper_request(fe, tenant)
            got = await ascrape(fe.metrics_url)
            return got if _source(got, "sleeper").get("triton") == 1 else None

        got = await aeventually(
            from_triton, 20, what="the service estimates to come from Triton's metrics"
        )
    assert _source(got, "sleeper") == {"triton": 1.0, "frontend": 0.0, "default": 0.0}
    assert got.sum("fair_triton_metrics_stale", endpoint="sleeper") == 0
    terms = got.label_values("fair_batch_time_seconds", "term")
    assert terms == {"fixed", "per_row", "per_token"}
    # sleeper costs 2 ms + 20 us per token: a 4 x 64 batch takes about 7 ms.
    predicted = sum(
        got.sum("fair_batch_time_seconds", endpoint="sleeper", term=t) * x
        for t, x in (("fixed", 1), ("per_row", 4), ("per_token", 256))
    )
    assert 0.003 < predicted < 0.1, predicted
    assert got.sum("fair_service_unit_seconds", endpoint="sleeper") > 0
    assert got.sum("fair_service_rate", endpoint="sleeper", unit="rows") > 0
    assert got.sum("fair_service_rate", endpoint="sleeper", unit="tokens") > 0


async def test_stale_tritons_metrics_fall_back_to_the_frontends_timing_and_say_so(
    triton: EmbeddedTriton,
    workers: int,
) -> None:
    tenant = unique("obs-s")
    nowhere = f"http://127.0.0.1:{free_port()}/metrics"  # nothing listens there
    scrape_log = Lines()
    scrape_logger = logging.getLogger("fair_frontend.backends.triton.metrics")
    scrape_logger.addHandler(scrape_log)
    try:
        with running_frontend(_sleeper_config(tenant, nowhere), triton, workers=workers) as fe:
            for _ in range(3):
                await _one_sleeper_request(fe, tenant)

            async def failed_twice() -> bool:
                async def failures() -> int:
                    metrics = fe.frontend.backend_metrics
                    return 0 if metrics is None else int(metrics.status().failures)

                return await fe.acall(failures()) >= 2

            await aeventually(failed_twice, 20, what="two failed scrapes")
            await _one_sleeper_request(fe, tenant)
            got = await ascrape(fe.metrics_url)
    finally:
        scrape_logger.removeHandler(scrape_log)
    assert _source(got, "sleeper") == {"triton": 0.0, "frontend": 1.0, "default": 0.0}
    assert got.sum("fair_triton_metrics_stale", endpoint="sleeper") == 1
    # The frontend's own timing of its batches stands in: real estimates, not defaults.
    assert got.sum("fair_service_rate", endpoint="sleeper", unit="rows") > 0
    # The failure is logged once per streak, naming the URL.
    failures = [json.loads(line) for line in scrape_log.lines if "scrape failed" in line]
    assert len(failures) == 1 and nowhere in failures[0]["msg"]
