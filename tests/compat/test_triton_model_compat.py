"""Triton's own QA models and examples, side by side: straight to Triton and through us.

Stand-ins (``tests/model_repository/``) for the models of Triton's QA tests that failed
through the frontend (issue 12): ``echo_parameters`` for qa/L0_parameters' ``parameter``
model (it answers with the request parameters it sees), ``all_optional`` for
qa/L0_input_validation's ``input_all_optional``. And the server metadata that Triton's
``simple_*_health_metadata.py`` examples check. Each request goes to Triton directly and
through the frontend with the tenant's key, nothing else changed; the answers must match.
"""

from __future__ import annotations

import json
from typing import Any, cast

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from compat_support import KEY_HEADER, KEY_METADATA, http_request, simple_grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from fair_frontend import __version__
from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.backends.triton.model_config import model_info
from fair_frontend.batching import OUTPUTS_PARAMETER, ROWS_PARAMETER, batch_key, pack
from fair_frontend.config import Config, Endpoint, PaddedInput, Padding
from fair_frontend.core.dispatch import CoreRequest, Route
from fair_frontend.endpoint import plan
from fair_frontend.errors import InvalidArgument
from fair_frontend.models import ModelInfo, TensorSpec, validate
from fair_frontend.protocol import InferRequest, RequestedOutput, Tensor
from fair_frontend.wire.records import Call
from tests.support import RunningFrontend, planned

# qa/L0_parameters' parameter lists (its "triton_" one is refused by both, and tested
# elsewhere), plus none at all.
PARAMETER_LISTS: list[dict[str, Any]] = [
    {"key1": "value1", "key2": "value2"},
    {"key1": 1, "key2": 2},
    {"key1": 123.123, "key2": 321.321},
    {"key1": True, "key2": "value2"},
    {},
]


def _client(url: str, protocol: str) -> Any:
    mod = httpclient if protocol == "http" else grpcclient
    return mod.InferenceServerClient(url)


def _urls(triton: EmbeddedTriton, frontend: RunningFrontend, protocol: str) -> tuple[str, str]:
    if protocol == "http":
        return triton.http_url.removeprefix("http://"), frontend.http_url
    return triton.grpc_url, frontend.grpc_url


def _echo(client: Any, protocol: str, parameters: dict[str, Any], headers: Any) -> list[str]:
    """The parameter names and values the echo model saw, as "name=value"."""
    mod = httpclient if protocol == "http" else grpcclient
    inp = mod.InferInput("INPUT0", [1, 1], "FP32")
    inp.set_data_from_numpy(np.ones((1, 1), dtype=np.float32))
    result = client.infer("echo_parameters", [inp], parameters=parameters or None, headers=headers)
    keys = [k.decode() for k in result.as_numpy("KEY").reshape(-1)]
    values = [v.decode() for v in result.as_numpy("VALUE").reshape(-1)]
    return sorted(f"{k}={v}" for k, v in zip(keys, values, strict=True))


# ---- 3: the frontend's own parameters go only to models that ask --------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("parameters", PARAMETER_LISTS, ids=["str", "int", "float", "bool", "none"])
def test_a_model_that_does_not_ask_sees_exactly_the_clients_parameters(
    triton: EmbeddedTriton, frontend: RunningFrontend, protocol: str, parameters: dict[str, Any]
) -> None:
    """qa/L0_parameters: the model finds the client's keys and nothing else (before the
    fix it also found ``fair_rows``, and, for some requests, ``fair_outputs``)."""
    direct_url, through_url = _urls(triton, frontend, protocol)
    direct = _echo(_client(direct_url, protocol), protocol, parameters, None)
    through = _echo(_client(through_url, protocol), protocol, parameters, dict(KEY_HEADER))
    assert through == direct
    assert [kv.split("=", 1)[0] for kv in through] == sorted(parameters)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_model_that_asks_still_gets_fair_rows(frontend: RunningFrontend, protocol: str) -> None:
    """``embed`` declares ``fair_frontend_rows``: its ROW_META output echoes the tenant
    and the request id it read from ``fair_rows``."""
    mod = httpclient if protocol == "http" else grpcclient
    inp = mod.InferInput("INPUT_IDS", [1, 4], "INT32")
    inp.set_data_from_numpy(np.arange(4, dtype=np.int32).reshape(1, 4))
    client = _client(frontend.http_url if protocol == "http" else frontend.grpc_url, protocol)
    result = client.infer(
        "embed",
        [inp],
        outputs=[mod.InferRequestedOutput("ROW_META")],
        request_id="asks",
        headers=dict(KEY_HEADER),
    )
    meta = json.loads(result.as_numpy("ROW_META").reshape(-1)[0])
    assert (meta["tenant"], meta["id"]) == ("acme", "asks")


def _config(takes_rows: bool) -> model_config_pb2.ModelConfig:
    cfg = model_config_pb2.ModelConfig(name="m", max_batch_size=8)
    cfg.input.add(name="IDS", data_type=model_config_pb2.TYPE_INT32, dims=[-1])
    cfg.output.add(name="OUT", data_type=model_config_pb2.TYPE_FP32, dims=[1])
    if takes_rows:
        cfg.parameters["fair_frontend_rows"].string_value = "true"
    return cfg


def test_the_model_config_parameter_is_what_asks() -> None:
    assert model_info(_config(True)).takes_rows
    assert not model_info(_config(False)).takes_rows
    other = _config(False)
    other.parameters["fair_frontend_rows"].string_value = "no"
    assert not model_info(other).takes_rows


PADDED = Endpoint(
    padding=Padding(inputs={"IDS": PaddedInput(lengths_field="length")}),
    max_tokens_parameter="max_tokens",
    max_tokens_default=4,
)


def _queued(width: int, n: int, **parameters: Any) -> CoreRequest:
    data = np.full((1, width), n, dtype=np.int32)
    request = InferRequest(
        model="m",
        id=f"r{n}",
        inputs=[Tensor("IDS", "INT32", (1, width), data)],
        parameters=dict(parameters),
        outputs=[RequestedOutput("OUT")],
    )
    call = Call(n, "acme", 1, 0.0, 0.0, 1, width, request.nbytes, [width], request)
    # No route: only packed into a batch here, never answered.
    return CoreRequest(
        "acme", 1, width, request.nbytes, 1, None, None, call=call, route=cast(Route, None)
    )


@pytest.mark.parametrize("takes_rows", [True, False])
def test_ragged_rows_are_merged_only_for_a_model_told_their_lengths(takes_rows: bool) -> None:
    """Padding with a lengths field needs fair_rows: without it, rows 3 and 5 wide would
    reach the model as two 5-wide rows, the padding read as tokens. And the tokens to
    generate stay the client's parameter, so only requests asking the same share."""
    info = model_info(_config(takes_rows))
    a, b, c = _queued(3, 1, max_tokens=2), _queued(5, 2, max_tokens=7), _queued(5, 3, max_tokens=2)
    for it in (a, b, c):
        validate(it.request, planned(info, PADDED))
    padded = plan(Config(tiers=["paid"], endpoints={"m": PADDED}), "m", info)
    assert (batch_key(a.request, padded) == batch_key(b.request, padded)) is takes_rows
    assert (batch_key(b.request, padded) == batch_key(c.request, padded)) is takes_rows
    packed = pack([a], planned(info, PADDED))
    if takes_rows:
        rows = json.loads(str(packed.parameters[ROWS_PARAMETER]))
        assert (rows["length"], rows["max_tokens"], rows["tenant"]) == ([3], [2], ["acme"])
        assert "max_tokens" not in packed.parameters
    else:
        assert packed.parameters == {"max_tokens": 2}  # exactly as the client sent it
        assert ROWS_PARAMETER not in packed.parameters
        assert OUTPUTS_PARAMETER not in packed.parameters


# ---- 5: a model whose inputs are all optional takes a request without any -----------------


def _no_inputs(client: Any, headers: Any) -> tuple[float, int]:
    result = client.infer("all_optional", [], headers=headers)
    return float(result.as_numpy("OUTPUT0")[0]), int(result.as_numpy("COUNT")[0])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_no_inputs_for_a_model_whose_inputs_are_all_optional(
    triton: EmbeddedTriton, frontend: RunningFrontend, protocol: str
) -> None:
    """qa/L0_input_validation: Triton serves it (before the fix the frontend refused "the
    request must have at least one input")."""
    direct_url, through_url = _urls(triton, frontend, protocol)
    direct = _no_inputs(_client(direct_url, protocol), None)
    through = _no_inputs(_client(through_url, protocol), dict(KEY_HEADER))
    assert through == direct == (0.0, 0)


def test_a_missing_required_input_is_tritons_message(
    triton: EmbeddedTriton, frontend: RunningFrontend
) -> None:
    """``simple`` without INPUT1, and without any input: the frontend refuses it itself,
    in Triton's exact words (before the fix: the names as a Python list, and for no
    inputs at all a message of its own)."""
    one = simple_grpc()
    del one.inputs[1]
    del one.raw_input_contents[1]
    none = service_pb2.ModelInferRequest(model_name="simple")
    for request in (one, none):
        details = []
        for url, metadata in ((triton.grpc_url, ()), (frontend.grpc_url, KEY_METADATA)):
            channel = grpc.insecure_channel(url)
            try:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                with pytest.raises(grpc.RpcError) as err:
                    stub.ModelInfer(request, metadata=metadata, timeout=30)
            finally:
                channel.close()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details.append(err.value.details())
        assert details[1] == details[0]


def test_a_model_with_optional_inputs_says_how_many_it_takes() -> None:
    """Triton's other wording, where some inputs are optional (qa/L0_input_validation's
    input_optional: "expected number of inputs between 3 and 4 ...")."""
    info = ModelInfo(
        name="input_optional",
        max_batch_size=0,
        inputs={
            **{n: TensorSpec(n, "FP32", (1,)) for n in ("INPUT0", "INPUT1", "INPUT2")},
            "INPUT3": TensorSpec("INPUT3", "FP32", (1,), optional=True),
        },
        outputs={"OUTPUT0": TensorSpec("OUTPUT0", "FP32", (1,))},
    )
    with pytest.raises(InvalidArgument) as err:
        validate(InferRequest(model="input_optional"), planned(info))
    assert str(err.value) == (
        "[request id: <id_unknown>] expected number of inputs between 3 and 4 but got 0 "
        "inputs for model 'input_optional'. Got input(s) [], but missing required input(s) "
        "['INPUT0','INPUT1','INPUT2']. Please provide all required input(s)."
    )


# ---- 6: server metadata is Triton's; the frontend names itself beside it -----------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_server_metadata_is_tritons(
    triton: EmbeddedTriton, frontend: RunningFrontend, protocol: str
) -> None:
    """simple_http_health_metadata.py / simple_grpc_health_metadata.py check the name is
    "triton"; the version is the Triton's; the extensions, Triton's that we offer too."""
    direct_url, through_url = _urls(triton, frontend, protocol)
    direct = _client(direct_url, protocol).get_server_metadata()
    through = _client(through_url, protocol).get_server_metadata()  # no key: open
    if protocol == "grpc":
        direct, through = (
            {"name": m.name, "version": m.version, "extensions": list(m.extensions)}
            for m in (direct, through)
        )
    assert through["name"] == direct["name"] == "triton"
    assert through["version"] == direct["version"]
    assert through["extensions"] == [e for e in direct["extensions"] if e in through["extensions"]]
    assert {"binary_tensor_data", "classification", "statistics", "parameters"} <= set(
        through["extensions"]
    )
    assert not {"system_shared_memory", "cuda_shared_memory"} & set(through["extensions"])


def test_the_frontend_names_itself_beside_the_server_metadata(frontend: RunningFrontend) -> None:
    answer = http_request(frontend.http_url, "GET", "/v2")
    assert answer.status == 200
    assert answer.headers["x-fair-frontend"] == __version__
    channel = grpc.insecure_channel(frontend.grpc_url)
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        _, call = stub.ServerMetadata.with_call(service_pb2.ServerMetadataRequest(), timeout=30)
    finally:
        channel.close()
    assert dict(call.initial_metadata())["x-fair-frontend"] == __version__
