"""Model access per tier and tenant, on every door (issue 17, item 5 and item 7's labels).

Before, any tenant could call any model Triton serves, a model an operator added to Triton
was open to every key at once, and the side doors (model metadata, config, readiness,
statistics) checked the key but not the model. Now each tier lists the models its tenants
may call (``tier_models``; ``"*"`` opens every model), a tenant's own entry replaces
(``models``), widens (``extra_models``) or narrows (``denied_models``) it, and everything
else is 403 / PERMISSION_DENIED ``tenant 'x' may not use model 'y'``:

- on every door: HTTP infer, generate and generate_stream, gRPC ModelInfer, each request
  of a ModelStreamInfer stream, model metadata, config, readiness and statistics (over
  both transports); statistics of every model list only the tenant's;
- before any model lookup or body read (HTTP: a 64 MiB body declared, none sent, is
  answered), so the answer is the same whether or not Triton has the model;
- a reload (SIGHUP) applies a change at once.

And client strings stay bounded: refusals never mint a metric label from the model name
they name (a full queue refuses any name), and a request id, model name or tenant claim
over 1 KiB is refused for its length before an error or a log line echoes it.

Real stack: the session's Triton, the frontend with one and with two shell processes,
raw HTTP over sockets and tritonclient's generated gRPC stub.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import Config, parse_config
from fair_frontend.core.metrics import FrontendMetrics
from fair_frontend.kit.testing import eventually, fetch, parse, scrape
from fair_frontend.observability.logs import REQUEST_LOGGER, JsonFormatter
from fair_frontend.outcomes import Outcome
from tests.support import KEYS, RunningFrontend, config_dict, running_frontend

ANSWER_TIMEOUT_S = 30.0
EXISTS = "generate"  # Triton serves it; the trial tier's list does not open it
MISSING = "no_such_model_access"  # Triton has no such model
UNLISTED = "simple_identity"  # Triton serves it; no list names it
TIER_MODELS = {
    "enterprise": ["embed", "generate", "simple", "repeat_int32"],
    "standard": ["embed", "simple"],
    "trial": ["embed"],
}
TENANTS: dict[str, dict[str, Any]] = {
    "acme": {"tier": "enterprise"},
    "umbrella": {"tier": "trial"},
    "initech": {"tier": "standard", "denied_models": ["simple"]},  # narrows its tier's list
    "hooli": {"tier": "standard", "extra_models": ["generate"]},  # widens it
    "globex": {"tier": "enterprise", "models": ["embed"]},  # replaces it: narrower
}
SIDE_DOORS = ["", "/config", "/ready", "/stats"]  # GET /v2/models/{m}<door>
POST_DOORS = ["infer", "generate", "generate_stream"]
GRPC_SIDE_DOORS: dict[str, Callable[[str], Any]] = {
    "ModelMetadata": lambda m: service_pb2.ModelMetadataRequest(name=m),
    "ModelConfig": lambda m: service_pb2.ModelConfigRequest(name=m),
    "ModelReady": lambda m: service_pb2.ModelReadyRequest(name=m),
    "ModelStatistics": lambda m: service_pb2.ModelStatisticsRequest(name=m),
}


def access_config(**changes: Any) -> Config:
    data = config_dict()
    data["tier_models"] = TIER_MODELS
    data["tenants"] = {name: {**spec, "api_keys": [KEYS[name]]} for name, spec in TENANTS.items()}
    data.update(changes)
    return parse_config(data)


@pytest.fixture(scope="module")
def fe(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    with running_frontend(access_config(), triton, workers=workers) as running:
        yield running


def denied(tenant: str, model: str) -> str:
    return f"tenant '{tenant}' may not use model '{model}'"


# ---- clients ---------------------------------------------------------------------------------


def key(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


def http_call(
    fe: RunningFrontend,
    method: str,
    path: str,
    headers: Mapping[str, str],
    body: bytes | None = None,
) -> tuple[int, Any]:
    """(status, the JSON answer or the raw body) of one request on a connection of its own."""
    host, port = fe.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=ANSWER_TIMEOUT_S)
    try:
        conn.request(method, path, body=body, headers=dict(headers))
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(raw) if raw else None
    except ValueError:
        return response.status, raw


def http_head_only(fe: RunningFrontend, path: str, headers: Mapping[str, str]) -> tuple[int, Any]:
    """A POST declaring a 64 MiB body and sending none: any answer came from the headers."""
    host, port = fe.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=ANSWER_TIMEOUT_S)
    try:
        conn.putrequest("POST", path)
        for name, value in {**headers, "Content-Length": str(64 << 20)}.items():
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


EMBED_BODY = json.dumps(
    {"inputs": [{"name": "INPUT_IDS", "shape": [1, 4], "datatype": "INT32", "data": [1, 2, 3, 4]}]}
).encode()
SIMPLE_GENERATE = json.dumps({"INPUT0": list(range(16)), "INPUT1": [1] * 16}).encode()


def infer_request(model: str, **fields: Any) -> service_pb2.ModelInferRequest:
    """An ``embed``-shaped request (INT32 INPUT_IDS [1, 4]) to ``model``."""
    req = service_pb2.ModelInferRequest(model_name=model, **fields)
    req.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, 4])
    req.raw_input_contents.append(np.arange(4, dtype=np.int32).tobytes())
    return req


def grpc_call(fe: RunningFrontend, method: str, request: Any, tenant: str) -> tuple[str, str]:
    """(status name, details) of one unary call; ("OK", "") when it succeeded."""
    with grpc.insecure_channel(fe.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            getattr(stub, method)(
                request, metadata=tuple(key(tenant).items()), timeout=ANSWER_TIMEOUT_S
            )
        except grpc.RpcError as err:
            return err.code().name, str(err.details())
    return "OK", ""


def grpc_stream(
    fe: RunningFrontend, requests: list[service_pb2.ModelInferRequest], tenant: str
) -> list[service_pb2.ModelStreamInferResponse]:
    """Every reply of one ModelStreamInfer stream that sends ``requests``."""
    with grpc.insecure_channel(fe.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        replies = stub.ModelStreamInfer(
            iter(requests), metadata=tuple(key(tenant).items()), timeout=ANSWER_TIMEOUT_S
        )
        return list(replies)


def side_door_lookups(fe: RunningFrontend) -> float:
    return scrape(fe.metrics_url, ANSWER_TIMEOUT_S).sum("fair_side_door_lookups_total")


# ---- every door, the same answer whether or not Triton has the model -------------------------


def every_door(fe: RunningFrontend, tenant: str, model: str) -> dict[str, tuple[Any, str]]:
    """Each door's (status, message) for ``tenant`` asking about ``model``."""
    out: dict[str, tuple[Any, str]] = {}
    for prefix in (f"/v2/models/{model}", f"/v2/models/{model}/versions/1"):
        for door in SIDE_DOORS:
            status, doc = http_call(fe, "GET", prefix + door, key(tenant))
            out[f"GET {prefix.replace(model, 'M')}{door}"] = (status, _error(doc))
        for door in POST_DOORS:
            status, doc = http_head_only(fe, f"{prefix}/{door}", key(tenant))
            out[f"POST {prefix.replace(model, 'M')}/{door}"] = (status, _error(doc))
    out["ModelInfer"] = grpc_call(fe, "ModelInfer", infer_request(model), tenant)
    for method, make in GRPC_SIDE_DOORS.items():
        out[method] = grpc_call(fe, method, make(model), tenant)
    # One stream: the refused request answered in-stream, the next one still served.
    first, second = grpc_stream(fe, [infer_request(model), infer_request("embed")], tenant)
    out["ModelStreamInfer"] = ("in-stream", first.error_message)
    assert not second.error_message and second.infer_response.model_name == "embed", second
    return out


def _error(doc: Any) -> str:
    return str(doc["error"]) if isinstance(doc, dict) and "error" in doc else repr(doc)


def test_a_closed_model_is_refused_on_every_door_the_same_whether_it_exists_or_not(
    fe: RunningFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trial tenant: ``generate`` (Triton has it) and a model Triton does not have get
    the same 403 / PERMISSION_DENIED naming the model on every door, and neither reaches a
    model lookup (the core's, or a side door's to Triton)."""
    forwarder = fe.frontend.forwarder  # the core's model lookups, whatever the shells
    real_config = forwarder.model_config
    asked: list[str] = []

    async def counted(model: str, version: str = "") -> Any:
        asked.append(model)
        return await real_config(model, version)

    monkeypatch.setattr(forwarder, "model_config", counted)
    lookups = side_door_lookups(fe)
    answers = {model: every_door(fe, "umbrella", model) for model in (EXISTS, MISSING)}
    for model, doors in answers.items():
        for door, (status, message) in doors.items():
            assert status in (403, "PERMISSION_DENIED", "in-stream"), (model, door, status)
            assert message == denied("umbrella", model), (model, door, message)
    assert {
        door: (status, message.replace(EXISTS, "M"))
        for door, (status, message) in answers[EXISTS].items()
    } == {
        door: (status, message.replace(MISSING, "M"))
        for door, (status, message) in answers[MISSING].items()
    }
    assert EXISTS not in asked and MISSING not in asked, asked
    assert side_door_lookups(fe) == lookups


def test_a_model_named_late_in_a_grpc_message_is_checked_before_its_lookup(
    fe: RunningFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message whose ``model_name`` comes after the fields the shell peeks at (bytes
    concatenated: protobuf merges them) is checked once parsed, still before any lookup of
    the model; on a stream too."""
    forwarder = fe.frontend.forwarder
    real_config = forwarder.model_config
    asked: list[str] = []

    async def counted(model: str, version: str = "") -> Any:
        asked.append(model)
        return await real_config(model, version)

    monkeypatch.setattr(forwarder, "model_config", counted)
    model = f"{MISSING}_late"
    front = service_pb2.ModelInferRequest(
        parameters={f"p{i}": service_pb2.InferParameter(bool_param=True) for i in range(12)}
    )
    raw = front.SerializeToString() + infer_request(model).SerializeToString()
    with grpc.insecure_channel(fe.grpc_url) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as err:
            call(raw, metadata=tuple(key("umbrella").items()), timeout=ANSWER_TIMEOUT_S)
        assert (err.value.code(), err.value.details()) == (
            grpc.StatusCode.PERMISSION_DENIED,
            denied("umbrella", model),
        )
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        replies = list(
            stream(iter([raw]), metadata=tuple(key("umbrella").items()), timeout=ANSWER_TIMEOUT_S)
        )
    assert [r.error_message for r in replies] == [denied("umbrella", model)]
    assert model not in asked, asked


def test_a_model_no_list_names_is_closed_even_to_the_highest_tier(fe: RunningFrontend) -> None:
    """``simple_identity`` is served by Triton but named by no list: an operator's new
    model is closed until the config opens it."""
    doors = every_door(fe, "acme", UNLISTED)
    assert {message for _, message in doors.values()} == {denied("acme", UNLISTED)}, doors


def test_an_allowed_tenant_is_served_on_every_door(fe: RunningFrontend) -> None:
    for tenant in ("acme", "umbrella"):
        status, doc = http_call(fe, "POST", "/v2/models/embed/infer", key(tenant), EMBED_BODY)
        assert status == 200 and doc["outputs"], (tenant, doc)
        assert grpc_call(fe, "ModelInfer", infer_request("embed"), tenant) == ("OK", "")
        for door in SIDE_DOORS:
            status, doc = http_call(fe, "GET", f"/v2/models/embed{door}", key(tenant))
            assert status == 200, (tenant, door, doc)
        for method, make in GRPC_SIDE_DOORS.items():
            assert grpc_call(fe, method, make("embed"), tenant) == ("OK", ""), (tenant, method)
    for door in ("generate", "generate_stream"):
        status, doc = http_call(
            fe, "POST", f"/v2/models/simple/{door}", key("acme"), SIMPLE_GENERATE
        )
        assert status == 200, (door, doc)


def test_a_tenant_entry_widens_narrows_or_replaces_its_tiers_list(fe: RunningFrontend) -> None:
    def infer(tenant: str, model: str) -> tuple[str, str]:
        if model == "simple":
            status, doc = http_call(
                fe, "POST", "/v2/models/simple/generate", key(tenant), SIMPLE_GENERATE
            )
            return ("OK", "") if status == 200 else (str(status), _error(doc))
        return grpc_call(fe, "ModelInfer", infer_request(model), tenant)

    # hooli (standard + extra_models [generate]) may call generate; initech (standard) not.
    generate = service_pb2.ModelInferRequest(model_name="generate")
    generate.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, 4])
    generate.raw_input_contents.append(np.arange(4, dtype=np.int32).tobytes())
    assert grpc_call(fe, "ModelInfer", generate, "hooli") == ("OK", "")
    assert grpc_call(fe, "ModelInfer", generate, "initech") == (
        "PERMISSION_DENIED",
        denied("initech", "generate"),
    )
    # initech (standard, denied_models [simple]) may not call simple; hooli (standard) may.
    assert infer("hooli", "simple") == ("OK", "")
    assert infer("initech", "simple") == ("403", denied("initech", "simple"))
    # globex (enterprise, models [embed]): its own list replaces enterprise's.
    assert infer("globex", "embed") == ("OK", "")
    assert grpc_call(fe, "ModelInfer", generate, "globex") == (
        "PERMISSION_DENIED",
        denied("globex", "generate"),
    )
    status, doc = http_call(fe, "GET", "/v2/models/generate/config", key("globex"))
    assert (status, _error(doc)) == (403, denied("globex", "generate"))


def test_statistics_of_every_model_list_only_the_tenants(fe: RunningFrontend) -> None:
    """``/v2/models/stats`` (and ModelStatistics without a name) answer with the models a
    tenant may call, not every model the frontend has seen."""
    assert (
        http_call(fe, "POST", "/v2/models/simple/generate", key("acme"), SIMPLE_GENERATE)[0] == 200
    )
    assert http_call(fe, "POST", "/v2/models/embed/infer", key("acme"), EMBED_BODY)[0] == 200
    status, doc = http_call(fe, "GET", "/v2/models/stats", key("acme"))
    assert status == 200 and {"simple", "embed"} <= {s["name"] for s in doc["model_stats"]}
    status, doc = http_call(fe, "GET", "/v2/models/stats", key("umbrella"))
    assert status == 200 and {s["name"] for s in doc["model_stats"]} == {"embed"}, doc
    with grpc.insecure_channel(fe.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelStatistics(
            service_pb2.ModelStatisticsRequest(name=""),
            metadata=tuple(key("umbrella").items()),
            timeout=ANSWER_TIMEOUT_S,
        )
    assert {s.name for s in reply.model_stats} == {"embed"}


# ---- reload ----------------------------------------------------------------------------------


def test_a_reload_applies_access_changes_at_once(triton: EmbeddedTriton, workers: int) -> None:
    """SIGHUP's reload: opening a model to a tier and closing one to a tenant apply in the
    core and every shell without a restart."""

    def reload(fe: RunningFrontend, config: Config) -> list[str]:
        config = config.model_copy(update={"triton": fe.server.config.triton})

        async def apply() -> list[str]:
            notes: list[str] = fe.server.reload(config)
            return notes

        return list(fe.call(apply()))

    def metadata(fe: RunningFrontend, tenant: str, model: str) -> int:
        return http_call(fe, "GET", f"/v2/models/{model}", key(tenant))[0]

    with running_frontend(access_config(), triton, workers=workers) as fe:
        assert metadata(fe, "umbrella", "generate") == 403
        opened = {**TIER_MODELS, "trial": ["embed", "generate"]}
        assert reload(fe, access_config(tier_models=opened)) == []
        eventually(
            lambda: metadata(fe, "umbrella", "generate") == 200,
            30,
            what="generate opened to trial",
        )
        assert grpc_call(fe, "ModelInfer", infer_request("embed"), "umbrella") == ("OK", "")
        tenants = dict(TENANTS, umbrella={"tier": "trial", "denied_models": ["embed"]})
        data = config_dict(tier_models=opened)
        data["tenants"] = {n: {**s, "api_keys": [KEYS[n]]} for n, s in tenants.items()}
        assert reload(fe, parse_config(data)) == []
        closed = ("PERMISSION_DENIED", denied("umbrella", "embed"))
        eventually(
            lambda: grpc_call(fe, "ModelInfer", infer_request("embed"), "umbrella") == closed,
            30,
            what="embed closed to umbrella",
        )
        assert metadata(fe, "umbrella", "generate") == 200


# ---- labels: refused names never become metric series ---------------------------------------


def _hold_the_queue(fe: RunningFrontend, hold_ms: int) -> threading.Thread:
    """One ``repeat_int32`` request in Triton for ``hold_ms`` and one queued behind it (the
    model takes one at a time): the frontend's global queue (max_queued 1) is full until
    the first is answered. The second is sent once the first is in Triton (queued beside
    it, it would find the queue full). Returns the thread that reads the stream to its
    end."""

    def request(delay_ms: int) -> service_pb2.ModelInferRequest:
        req = service_pb2.ModelInferRequest(model_name="repeat_int32")
        for name, dtype, value in (
            ("IN", np.int32, [1]),
            ("DELAY", np.uint32, [delay_ms]),
            ("WAIT", np.uint32, [0]),
        ):
            req.inputs.add(name=name, datatype=np.dtype(dtype).name.upper(), shape=[1])
            req.raw_input_contents.append(np.array(value, dtype=dtype).tobytes())
        return req

    replies: list[Any] = []

    async def inflight() -> int:
        runtime = fe.frontend.runtimes.get("repeat_int32")
        return 0 if runtime is None else int(runtime.inflight)

    def requests() -> Iterator[service_pb2.ModelInferRequest]:
        yield request(hold_ms)
        eventually(lambda: fe.call(inflight()) >= 1, 30, what="the first request is in Triton")
        yield request(0)

    def read() -> None:
        with grpc.insecure_channel(fe.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            stream = stub.ModelStreamInfer(
                requests(),
                metadata=tuple(key("acme").items()),
                timeout=hold_ms / 1e3 + 60,
            )
            replies.extend(stream)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


def test_a_shells_refusal_never_confirms_a_model_label() -> None:
    """Unit, on the metrics alone: what a shell tallies (a queue-full refusal of any name)
    is counted under "other"; what the core itself observed confirms the model."""
    metrics = FrontendMetrics(access_config())
    metrics.requests_answered("acme", "made-up", Outcome.REJECTED_QUEUE_FULL, 3)
    metrics.request_finished(
        tenant="acme", model="sleeper", outcome=Outcome.REJECTED_QUEUE_FULL, queued_s=None
    )
    metrics.requests_answered("acme", "sleeper", Outcome.REJECTED_INVALID, 1)
    text = generate_latest(metrics.registry).decode()
    assert "made-up" not in text
    got = {
        (s.labels["endpoint"], s.labels["outcome"]): s.value
        for s in parse(text)
        if s.name == "fair_requests_total"
    }
    assert got == {
        ("other", "rejected_queue_full"): 3,
        ("sleeper", "rejected_queue_full"): 1,
        ("sleeper", "rejected_invalid"): 1,
    }


def test_refused_requests_with_random_model_names_add_no_label_series(
    triton: EmbeddedTriton, workers: int
) -> None:
    """200 refused requests, each naming a model of its own: 100 the trial tenant may not
    call (403) and 100 an open tenant sends while the global queue is full (503, refused
    before any lookup: this one minted a label per name before, ``endpoint`` being
    confirmed by any queue-full refusal). None of the names reaches /metrics."""
    prefix = f"rnd{uuid.uuid4().hex[:8]}"
    open_tiers = {"enterprise": ["*"], "standard": ["*"], "trial": ["embed"]}
    config = access_config(tier_models=open_tiers, queues={"max_queued": 1})
    with running_frontend(config, triton, workers=workers) as fe:
        before = fetch(fe.metrics_url, ANSWER_TIMEOUT_S)

        def post(tenant: str, i: int) -> tuple[int, str]:
            path = f"/v2/models/{prefix}-{tenant}-{i}/infer"
            status, doc = http_call(fe, "POST", path, key(tenant), EMBED_BODY)
            return status, _error(doc)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            closed = list(pool.map(lambda i: post("umbrella", i), range(100)))
            assert all(s == 403 and "may not use model" in m for s, m in closed), closed[:3]
            reader = _hold_the_queue(fe, hold_ms=6000)
            eventually(
                lambda: "Exceeds maximum queue size" in post("acme", -1)[1],
                30,
                what="the global queue is full",
            )
            full = list(pool.map(lambda i: post("acme", i), range(100)))
        reader.join(timeout=120)
        assert not reader.is_alive()
        assert all(s == 503 and "Exceeds maximum queue size" in m for s, m in full), full[:3]
        after = fetch(fe.metrics_url, ANSWER_TIMEOUT_S)
    assert prefix not in after
    endpoints_before = parse(before).label_values("fair_requests_total", "endpoint")
    endpoints_after = parse(after).label_values("fair_requests_total", "endpoint")
    assert endpoints_after <= endpoints_before | {"other", "repeat_int32"}, endpoints_after
    refused = {
        (s.labels["tenant"], s.labels["outcome"]): s.value
        for s in parse(after)
        if s.name == "fair_requests_total" and s.labels["endpoint"] == "other"
    }
    assert refused[("umbrella", "rejected_auth")] == 100
    assert refused[("acme", "rejected_queue_full")] >= 101  # the burst and the probe(s)


# ---- lengths: client strings are checked before they are echoed -----------------------------

LONG = 100_000  # bytes: far over the 1 KiB limit of ids and names


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def test_long_ids_names_and_claims_are_refused_before_they_are_echoed(
    fe: RunningFrontend, workers: int
) -> None:
    """A 100 KB request id, model name or tenant claim: each answer says how long, not
    what (before, each of these echoed the whole string into the answer and the request's
    log line), and every log line of the frontend stays small."""
    rid, name, claim = "r" * LONG, "m" * LONG, "t" * LONG
    lines = _Lines()
    logger = logging.getLogger()  # the request log and every other (one-process mode)
    level = logging.getLogger(REQUEST_LOGGER).level
    logging.getLogger(REQUEST_LOGGER).setLevel(logging.INFO)
    logger.addHandler(lines)
    try:
        answers: dict[str, str] = {}
        # HTTP: binary tensor data of the wrong size, whose error quotes the request id.
        header = json.dumps(
            {
                "id": rid,
                "inputs": [
                    {
                        "name": "INPUT_IDS",
                        "shape": [1, 4],
                        "datatype": "INT32",
                        "parameters": {"binary_data_size": 8},
                    }
                ],
            }
        ).encode()
        headers = {**key("acme"), "Inference-Header-Content-Length": str(len(header))}
        status, doc = http_call(fe, "POST", "/v2/models/embed/infer", headers, header + bytes(8))
        answers["http id"] = f"{status} {_error(doc)}"
        # gRPC: the same, over ModelInfer.
        req = infer_request("embed", id=rid)
        req.raw_input_contents[0] = bytes(8)
        answers["grpc id"] = " ".join(grpc_call(fe, "ModelInfer", req, "acme"))
        # A model name: inference and a side door.
        answers["grpc model"] = " ".join(grpc_call(fe, "ModelInfer", infer_request(name), "acme"))
        answers["grpc metadata"] = " ".join(
            grpc_call(fe, "ModelMetadata", service_pb2.ModelMetadataRequest(name=name), "acme")
        )
        # A tenant claim in the body, beside a key of another tenant.
        body = json.loads(EMBED_BODY)
        body["parameters"] = {"tenant": claim}
        status, doc = http_call(
            fe, "POST", "/v2/models/embed/infer", key("acme"), json.dumps(body).encode()
        )
        answers["http claim"] = f"{status} {_error(doc)}"
    finally:
        logger.removeHandler(lines)
        logging.getLogger(REQUEST_LOGGER).setLevel(level)
    too_long = f"is too long: {LONG} bytes, the limit is 1024 bytes"
    expected = {
        "http id": f"400 request id {too_long}",
        "grpc id": f"INVALID_ARGUMENT request id {too_long}",
        "grpc model": f"INVALID_ARGUMENT model name {too_long}",
        "grpc metadata": f"INVALID_ARGUMENT model name {too_long}",
    }
    for what, answer in expected.items():
        assert answers[what] == answer, (what, answers[what][:300])
    assert answers["http claim"].startswith("403 the API key does not belong"), answers
    assert len(answers["http claim"]) < 2048
    if workers == 1:  # the shells of two-shell mode log in their own processes
        assert len(lines.lines) >= 4, lines.lines
        assert max(len(line) for line in lines.lines) < 8192, max(map(len, lines.lines))
