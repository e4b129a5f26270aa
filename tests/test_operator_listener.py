"""The operator's listener: /metrics and the statistics apart from the tenant ports.

``server.metrics_host`` binds /metrics and the statistics extension over HTTP (and
``metrics_grpc_port`` a gRPC listener serving ModelStatistics) on an address of their own;
``server.statistics: operator`` takes the statistics off the tenant ports, whose server
metadata then no longer lists the extension (so perf_analyzer does not ask). Real
frontends in front of the session's Triton, in both worker modes; the operator's address
is 127.0.0.2 (the loopback network), the tenants' 127.0.0.1.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.cli import _listen, build_parser
from fair_frontend.config import DEFAULT_METRICS_HOST
from fair_frontend.kit.testing import perf_analyzer, scrape
from fair_frontend.server import Listen
from tests.support import (
    KEYS,
    PERF_ANALYZER_SHORT_RUN,
    RunningFrontend,
    ids_input,
    make_config,
    running_frontend,
)

OPERATOR = "127.0.0.2"
TENANT = "acme"
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str) -> tuple[int, bytes]:
    try:
        with _HTTP.open(url, timeout=10) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read()


def _refused(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(5)
        return sock.connect_ex((host, port)) != 0


def _side_door_calls(running: RunningFrontend, door: str) -> float:
    url = f"http://{OPERATOR}:{running.server.metrics_port}/metrics"
    return scrape(url).family_sum("fair_side_door_calls", door=door)


@pytest.fixture(scope="module")
def operator_mode(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    """Statistics for the operator only; the operator's listeners on 127.0.0.2."""
    config = make_config(server={"statistics": "operator"})
    listen = Listen(metrics_host=OPERATOR, metrics_grpc_port=0)
    with running_frontend(config, triton, workers=workers, listen=listen) as running:
        yield running


def test_metrics_and_statistics_live_on_the_operators_address_only(
    operator_mode: RunningFrontend,
) -> None:
    running = operator_mode
    server = running.server
    headers = {"x-api-key": KEYS[TENANT]}
    client = grpcclient.InferenceServerClient(running.grpc_url)
    try:
        for rows in (1, 2):
            ids = np.arange(rows * 8, dtype=np.int32).reshape(rows, 8)
            client.infer("embed", [ids_input(grpcclient, ids)], headers=headers)
        # The tenant ports: no statistics extension listed, none answered, even keyed.
        assert "statistics" not in client.get_server_metadata().extensions
        with pytest.raises(InferenceServerException) as refused:
            client.get_inference_statistics("embed", headers=headers)
        assert refused.value.status() == "StatusCode.UNIMPLEMENTED"
    finally:
        client.close()
    http = httpclient.InferenceServerClient(running.http_url)
    try:
        assert "statistics" not in http.get_server_metadata()["extensions"]
    finally:
        http.close()
    # Not there for anyone: the same answer with or without a key.
    assert _get(f"http://{running.http_url}/v2/models/embed/stats")[0] == 501
    for path in ("/v2/models/stats", "/v2/models/embed/stats"):
        req = urllib.request.Request(f"http://{running.http_url}{path}", headers=headers)
        try:
            _HTTP.open(req, timeout=10)
            raise AssertionError(f"{path} answered on the tenant port")
        except urllib.error.HTTPError as err:
            assert err.code == 501, (path, err.code)
            assert "not offered on this port" in json.loads(err.read())["error"]
    # /metrics is not on the tenant ports, and the operator's port is not on their address.
    assert _get(f"http://{running.http_url}/metrics")[0] == 404
    assert _refused("127.0.0.1", server.metrics_port)
    assert _refused("127.0.0.1", server.metrics_grpc_port)

    # The operator's HTTP listener: /metrics and the statistics, no key asked.
    status, page = _get(f"http://{OPERATOR}:{server.metrics_port}/metrics")
    assert status == 200 and b"fair_requests_total" in page
    operator_http = httpclient.InferenceServerClient(f"{OPERATOR}:{server.metrics_port}")
    try:
        (stats,) = operator_http.get_inference_statistics("embed")["model_stats"]
        assert stats["name"] == "embed" and stats["inference_count"] >= 3  # 1 + 2 rows
        names = {m["name"] for m in operator_http.get_inference_statistics()["model_stats"]}
        assert "embed" in names
        with pytest.raises(InferenceServerException) as unknown:
            operator_http.get_inference_statistics("no_such_model")
        assert "unknown model" in unknown.value.message()
    finally:
        operator_http.close()
    # ... and its gRPC listener: ModelStatistics, health, metadata; nothing else.
    url = f"{OPERATOR}:{server.metrics_grpc_port}"
    operator_grpc = grpcclient.InferenceServerClient(url)
    try:
        assert operator_grpc.is_server_live() and operator_grpc.is_server_ready()
        (gstats,) = operator_grpc.get_inference_statistics("embed").model_stats
        assert gstats.inference_count == stats["inference_count"]
        with pytest.raises(InferenceServerException) as no_infer:
            ids = np.zeros((1, 8), dtype=np.int32)
            operator_grpc.infer("embed", [ids_input(grpcclient, ids)], headers=headers)
        assert no_infer.value.status() == "StatusCode.UNIMPLEMENTED"
    finally:
        operator_grpc.close()
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as no_metadata:
            stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="embed"), timeout=10)
        assert no_metadata.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_perf_analyzer_does_not_ask_for_statistics_the_tenant_port_does_not_list(
    operator_mode: RunningFrontend,
) -> None:
    """perf_analyzer reads ModelStatistics only when the server metadata lists the
    extension: against the tenant port in operator mode it measures without them."""
    running = operator_mode
    before = _side_door_calls(running, "statistics")
    metadata_before = _side_door_calls(running, "server_metadata")
    result = perf_analyzer(
        "embed",
        running.grpc_url,
        protocol="grpc",
        concurrency=2,
        shapes=["INPUT_IDS:16"],
        headers=[f"authorization: Bearer {KEYS[TENANT]}"],
        extra=PERF_ANALYZER_SHORT_RUN,
        timeout_s=120,
    )
    assert result["throughput"] > 0
    assert _side_door_calls(running, "server_metadata") > metadata_before  # it asked that
    assert _side_door_calls(running, "statistics") == before


def test_keyed_statistics_stay_on_the_tenant_ports_and_the_operators_listener_has_them(
    triton: EmbeddedTriton, workers: int
) -> None:
    """The default (``keyed``): Triton's place, for drop-in clients; the operator's
    listener answers them too."""
    with running_frontend(make_config(), triton, workers=workers) as running:
        client = grpcclient.InferenceServerClient(running.grpc_url)
        try:
            assert "statistics" in client.get_server_metadata().extensions
            headers = {"x-api-key": KEYS[TENANT]}
            client.infer(
                "embed", [ids_input(grpcclient, np.ones((1, 8), np.int32))], headers=headers
            )
            (tenant_view,) = client.get_inference_statistics("embed", headers=headers).model_stats
        finally:
            client.close()
        status, body = _get(f"http://127.0.0.1:{running.server.metrics_port}/v2/models/embed/stats")
        assert status == 200
        (operator_view,) = json.loads(body)["model_stats"]
        assert operator_view["inference_count"] == tenant_view.inference_count >= 1


def test_the_operators_listener_defaults_to_loopback_whatever_the_tenant_ports() -> None:
    """``--host 0.0.0.0`` opens the tenant ports; /metrics stays on loopback unless the
    config (or ``--metrics-host``) says otherwise."""
    config = make_config()
    assert config.server.metrics_host == DEFAULT_METRICS_HOST == "127.0.0.1"
    args = build_parser().parse_args(
        ["serve", "--config", "c", "--triton-url", "t", "--host", "0.0.0.0"]
    )
    listen = _listen(args, config)
    assert (listen.host, listen.metrics_host, listen.metrics_grpc_port) == (
        "0.0.0.0",
        "127.0.0.1",
        None,
    )
    args = build_parser().parse_args(
        ["serve", "--config", "c", "--triton-url", "t", "--metrics-host", "10.0.0.5"]
    )
    assert _listen(args, config).metrics_host == "10.0.0.5"
    pod = make_config(server={"metrics_host": "0.0.0.0", "metrics_grpc_port": 8003})
    listen = _listen(
        build_parser().parse_args(["serve", "--config", "c", "--triton-url", "t"]), pod
    )
    assert (listen.metrics_host, listen.metrics_grpc_port) == ("0.0.0.0", 8003)
