"""Drop-in compatibility: every tritonclient form gets from us what it gets from Triton.

Each request goes twice, side by side: straight to the session's Triton, and through the
session's frontend with a tenant key. The answers (output names, datatypes, shapes,
values, request id, model name and version) and the statuses must be the same. Covers the
project's models (``embed``, ``generate``) and Triton's classic examples (``simple``,
``simple_identity``, ``simple_nobatch``), over HTTP with JSON and binary tensors, HTTP
with gzip/deflate both ways, gRPC and gRPC asyncio.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from compat_support import (
    KEY_HEADER,
    KEY_METADATA,
    decompress,
    grpc_call,
    grpc_stub,
    http_request,
    ids_grpc,
    simple_http,
)
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from tests.support import RunningFrontend

RNG = np.random.default_rng(20261129)
PROTOCOLS = ["http-binary", "http-json", "grpc"]
MODELS = ["simple", "simple_identity", "simple_nobatch", "embed", "generate"]


# ---- the two sides ------------------------------------------------------------------------


@dataclass
class Side:
    """One way in: Triton itself, or the frontend (which needs the tenant's key)."""

    name: str
    http_url: str
    grpc_url: str
    key: dict[str, str]

    @property
    def headers(self) -> dict[str, str]:
        """A fresh copy each time: tritonclient's HTTP ``infer`` writes
        ``Inference-Header-Content-Length`` into the dict it is given."""
        return dict(self.key)

    def client(self, protocol: str) -> Any:
        if protocol.startswith("http"):
            return httpclient.InferenceServerClient(self.http_url)
        return grpcclient.InferenceServerClient(self.grpc_url)


@pytest.fixture(scope="module")
def sides(triton: EmbeddedTriton, frontend: RunningFrontend) -> tuple[Side, Side]:
    direct = Side("triton", triton.http_url.removeprefix("http://"), triton.grpc_url, {})
    through = Side("frontend", frontend.http_url, frontend.grpc_url, dict(KEY_HEADER))
    return direct, through


def side_by_side(sides: tuple[Side, Side], call: Callable[[Side], Any]) -> tuple[Any, Any]:
    direct, through = sides
    return call(direct), call(through)


# ---- what each model is sent --------------------------------------------------------------


def model_inputs(model: str, rows: int) -> dict[str, np.ndarray]:
    """Inputs for ``rows`` rows in one client request (``simple_nobatch``: no batch dim)."""
    if model == "simple":
        return {
            "INPUT0": RNG.integers(-1000, 1000, size=(rows, 16), dtype=np.int32),
            "INPUT1": RNG.integers(-1000, 1000, size=(rows, 16), dtype=np.int32),
        }
    if model == "simple_nobatch":
        return {
            "INPUT0": RNG.integers(-1000, 1000, size=16, dtype=np.int32),
            "INPUT1": RNG.integers(-1000, 1000, size=16, dtype=np.int32),
        }
    if model == "simple_identity":
        words = [b"", b"hello", "wörld".encode(), b"x" * 300]
        return {
            "INPUT0": np.array(
                [[words[(r + i) % len(words)] for i in range(3)] for r in range(rows)],
                dtype=np.object_,
            )
        }
    ids = RNG.integers(0, 4096, size=(rows, 12 if model == "embed" else 6), dtype=np.int32)
    return {"INPUT_IDS": ids}


def model_parameters(model: str) -> dict[str, Any] | None:
    """Request parameters a model is sent: ``generate`` asks for 4 tokens (quick answers;
    through the frontend the count travels per row in ``fair_rows``)."""
    return {"max_tokens": 4} if model == "generate" else None


# The outputs a client may name explicitly (a strict subset where the model has several).
EXPLICIT_OUTPUTS = {
    "simple": ["OUTPUT1"],
    "simple_identity": ["OUTPUT0"],
    "simple_nobatch": ["OUTPUT0", "OUTPUT1"],
    "embed": ["EMBEDDING"],
    "generate": ["OUTPUT_IDS"],
}


def make_inputs(protocol: str, arrays: dict[str, np.ndarray]) -> list[Any]:
    mod = grpcclient if protocol == "grpc" else httpclient
    out = []
    for name, arr in arrays.items():
        inp = mod.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        if protocol == "grpc":
            inp.set_data_from_numpy(arr)
        else:
            inp.set_data_from_numpy(arr, binary_data=protocol == "http-binary")
        out.append(inp)
    return out


def make_outputs(protocol: str, names: list[str] | None, class_count: int = 0) -> Any:
    if names is None:
        return None
    if protocol == "grpc":
        return [grpcclient.InferRequestedOutput(n, class_count=class_count) for n in names]
    binary = protocol == "http-binary"
    return [
        httpclient.InferRequestedOutput(n, binary_data=binary, class_count=class_count)
        for n in names
    ]


def response_fields(result: Any) -> tuple[str, str, str, list[tuple[str, str, list[int]]]]:
    """(id, model, version, [(output, datatype, shape)]) of an HTTP or gRPC result."""
    resp = result.get_response()
    if isinstance(resp, dict):
        outs = [(o["name"], o["datatype"], list(o["shape"])) for o in resp["outputs"]]
        return resp.get("id", ""), resp["model_name"], resp["model_version"], sorted(outs)
    outs = [(o.name, o.datatype, list(o.shape)) for o in resp.outputs]
    return resp.id, resp.model_name, resp.model_version, sorted(outs)


def assert_same_answer(direct: Any, through: Any) -> None:
    assert response_fields(through) == response_fields(direct)
    for name, datatype, _ in response_fields(direct)[3]:
        want, got = direct.as_numpy(name), through.as_numpy(name)
        assert got.dtype == want.dtype, name
        if datatype == "FP32":
            # A padded batch of one request; README: equal within float rounding.
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
        else:
            assert np.array_equal(got, want), name


# ---- inference: same answers --------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("outputs", ["all", "explicit"])
def test_same_answer_as_triton(
    sides: tuple[Side, Side], protocol: str, model: str, outputs: str
) -> None:
    """One row and three rows in one client request, all outputs or some named."""
    names = None if outputs == "all" else EXPLICIT_OUTPUTS[model]
    for rows in (1, 3) if model != "simple_nobatch" else (1,):
        arrays = model_inputs(model, rows)
        request_id = f"compat-{model}-{protocol}-{outputs}-{rows}"

        def call(side: Side, arrays: dict[str, np.ndarray] = arrays, rid: str = request_id) -> Any:
            return side.client(protocol).infer(
                model,
                make_inputs(protocol, arrays),
                outputs=make_outputs(protocol, names),
                request_id=rid,
                headers=side.headers,
                parameters=model_parameters(model),
            )

        direct, through = side_by_side(sides, call)
        assert_same_answer(direct, through)
        assert response_fields(through)[0] == request_id
        if names is not None:
            assert [n for n, _, _ in response_fields(through)[3]] == sorted(names)
        if model == "simple":  # and the answer is right, not just equal
            a, b = arrays["INPUT0"], arrays["INPUT1"]
            if names is None:
                assert np.array_equal(through.as_numpy("OUTPUT0"), a + b)
            assert np.array_equal(through.as_numpy("OUTPUT1"), a - b)


@pytest.mark.parametrize("request_compression", [None, "gzip", "deflate"])
@pytest.mark.parametrize("response_compression", [None, "gzip", "deflate"])
@pytest.mark.parametrize("model", ["simple", "embed"])
def test_http_compression_both_ways(
    sides: tuple[Side, Side],
    model: str,
    request_compression: str | None,
    response_compression: str | None,
) -> None:
    arrays = model_inputs(model, 2)

    def call(side: Side) -> Any:
        return side.client("http-binary").infer(
            model,
            make_inputs("http-binary", arrays),
            headers=side.headers,
            request_compression_algorithm=request_compression,
            response_compression_algorithm=response_compression,
        )

    assert_same_answer(*side_by_side(sides, call))


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_response_is_compressed_as_accept_encoding_asks(
    sides: tuple[Side, Side], encoding: str
) -> None:
    """The raw bytes: Content-Encoding is what the client accepted, on both servers."""
    req = simple_http(rows=2)

    def call(side: Side) -> Any:
        headers = {**req.wire_headers(), **side.headers, "Accept-Encoding": encoding}
        return http_request(side.http_url, "POST", req.path, req.body(), headers)

    direct, through = side_by_side(sides, call)
    assert direct.status == through.status == 200
    assert direct.headers.get("content-encoding") == encoding
    assert through.headers.get("content-encoding") == encoding
    assert (
        json.loads(decompress(through.body, encoding))["outputs"]
        == json.loads(decompress(direct.body, encoding))["outputs"]
    )


@pytest.mark.parametrize(
    "outputs",
    [
        None,
        [{"name": "OUTPUT0"}],
        [{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"}],
    ],
    ids=["all", "named", "named-one-binary"],
)
def test_request_level_binary_data_output(
    sides: tuple[Side, Side], outputs: list[dict[str, Any]] | None
) -> None:
    """``binary_data_output: true`` in raw JSON: binary for all outputs when none is named;
    a named output is binary only by its own ``binary_data`` (as Triton does)."""
    req = simple_http(rows=2)
    req.doc["parameters"] = {"binary_data_output": True}
    if outputs is not None:
        req.doc["outputs"] = outputs

    def call(side: Side) -> tuple[list[tuple[str, bool]], Any]:
        answer = http_request(
            side.http_url, "POST", req.path, req.body(), {**req.wire_headers(), **side.headers}
        )
        assert answer.status == 200, answer
        length = answer.headers.get("inference-header-content-length")
        result = httpclient.InferenceServerClient.parse_response_body(
            answer.body, header_length=None if length is None else int(length)
        )
        layout = [
            (o["name"], "binary_data_size" in o.get("parameters", {}))
            for o in answer.json()["outputs"]
        ]
        return layout, result

    (direct_layout, direct), (through_layout, through) = side_by_side(sides, call)
    assert through_layout == direct_layout
    assert_same_answer(direct, through)
    if outputs is None:
        assert all(binary for _, binary in through_layout)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(("model", "output"), [("simple", "OUTPUT0"), ("embed", "EMBEDDING")])
def test_classification(sides: tuple[Side, Side], protocol: str, model: str, output: str) -> None:
    """Triton's classification extension (``class_count``): the same top-k strings."""
    arrays = model_inputs(model, 2)

    def call(side: Side) -> Any:
        return side.client(protocol).infer(
            model,
            make_inputs(protocol, arrays),
            outputs=make_outputs(protocol, [output], class_count=3),
            headers=side.headers,
        )

    direct, through = side_by_side(sides, call)
    assert_same_answer(direct, through)
    labels = through.as_numpy(output)
    assert labels.shape == (2, 3)
    # "value:index" (bytes in binary answers, str from JSON)
    assert all(":" in (v.decode() if isinstance(v, bytes) else v) for v in labels.reshape(-1))


async def test_grpc_aio_concurrent_requests_get_their_own_answers(
    sides: tuple[Side, Side],
) -> None:
    """The asyncio gRPC client, several models at once: each answer is Triton's."""
    direct_side, through_side = sides
    jobs = [(m, model_inputs(m, 2 if m != "simple_nobatch" else 1)) for m in MODELS * 2]

    async def run(side: Side) -> list[Any]:
        client = grpcaio.InferenceServerClient(side.grpc_url)
        try:
            return list(
                await asyncio.gather(
                    *(
                        client.infer(
                            m,
                            make_inputs("grpc", a),
                            headers=side.headers,
                            parameters=model_parameters(m),
                        )
                        for m, a in jobs
                    )
                )
            )
        finally:
            await client.close()

    direct = await run(direct_side)
    through = await run(through_side)
    for d, t in zip(direct, through, strict=True):
        assert_same_answer(d, t)


# ---- request parameters ---------------------------------------------------------------------


def row_meta(result: Any) -> dict[str, Any]:
    value = result.as_numpy("ROW_META").reshape(-1)[0]
    return dict(json.loads(value))


@pytest.mark.parametrize("protocol", ["http-json", "http-binary", "grpc"])
def test_priority_and_timeout_reach_the_scheduler(sides: tuple[Side, Side], protocol: str) -> None:
    """tritonclient's forms: HTTP JSON numbers; gRPC priority as uint64, timeout int64."""
    arrays = model_inputs("embed", 1)

    def call(side: Side) -> Any:
        return side.client(protocol).infer(
            "embed",
            make_inputs(protocol, arrays),
            outputs=make_outputs(protocol, ["ROW_META"]),
            priority=3,
            timeout=30_000_000,
            request_id="prio",
            headers=side.headers,
        )

    direct, through = side_by_side(sides, call)
    assert response_fields(direct)[3] == response_fields(through)[3]
    meta = row_meta(through)
    assert (meta["tenant"], meta["priority"], meta["id"]) == ("acme", 3, "prio")
    assert meta["deadline_us"] > 0


def test_priority_as_int64_param(sides: tuple[Side, Side]) -> None:
    """Triton also takes ``priority`` as int64_param (what other clients send)."""
    msg = ids_grpc("embed", RNG.integers(0, 4096, size=(1, 5), dtype=np.int32))
    msg.outputs.add(name="ROW_META")
    msg.parameters["priority"].int64_param = 2
    msg.parameters["timeout"].int64_param = 10_000_000
    direct_side, through_side = sides
    with grpc_stub(direct_side.grpc_url) as stub:
        direct = grpc_call(stub, msg)
    with grpc_stub(through_side.grpc_url) as stub:
        through = grpc_call(stub, msg, metadata=KEY_METADATA)
    assert direct.code == through.code == direct.code.OK
    result = grpcclient.InferResult(through.response)
    assert row_meta(result)["priority"] == 2


@pytest.mark.parametrize("protocol", ["http-json", "grpc"])
def test_custom_parameters_reach_triton_with_their_types(
    sides: tuple[Side, Side], protocol: str
) -> None:
    """Judged by Triton's model itself (``echo_parameters`` answers each parameter it was
    given as JSON): the frontend's call to Triton carries the client's parameters with
    their types, whichever process makes it (the core relaying a batch, or a shell
    sending its rows in one hop), as Triton called directly sees them."""
    params = {"custom": "x", "count": 3, "flag": True, "ratio": 0.5}
    arrays = {"INPUT0": np.ones((1, 1), dtype=np.float32)}

    def call(side: Side) -> Any:
        return side.client(protocol).infer(
            "echo_parameters",
            make_inputs(protocol, arrays),
            parameters=params,
            headers=side.headers,
        )

    def seen(result: Any) -> dict[str, Any]:
        keys = [k.decode() for k in result.as_numpy("KEY")[0]]
        values = [json.loads(v) for v in result.as_numpy("VALUE")[0]]
        return dict(zip(keys, values, strict=True))

    direct, through = (seen(result) for result in side_by_side(sides, call))
    assert through == direct == params
    assert {k: type(v) for k, v in through.items()} == {k: type(v) for k, v in params.items()}


# ---- metadata, config, health -----------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("version", ["", "1"])
def test_model_metadata_and_config_are_tritons(
    sides: tuple[Side, Side], protocol: str, version: str
) -> None:
    """Also the ``/v2/models/{m}/versions/{v}`` forms (HTTP) and version fields (gRPC)."""
    for model in MODELS:

        def metadata(s: Side, m: str = model) -> Any:
            return s.client(protocol).get_model_metadata(
                m, model_version=version, headers=s.headers
            )

        def config(s: Side, m: str = model) -> Any:
            return s.client(protocol).get_model_config(m, model_version=version, headers=s.headers)

        direct, through = side_by_side(sides, metadata)
        assert through == direct
        direct, through = side_by_side(sides, config)
        assert through == direct
    if protocol == "grpc":
        direct, through = side_by_side(
            sides,
            lambda s: s.client("grpc").get_model_config("embed", as_json=True, headers=s.headers),
        )
        assert through == direct


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("call", ["get_model_metadata", "get_model_config"])
def test_unknown_version_is_the_same_error(
    sides: tuple[Side, Side], protocol: str, call: str
) -> None:
    def ask(side: Side) -> InferenceServerException:
        with pytest.raises(InferenceServerException) as info:
            getattr(side.client(protocol), call)("simple", model_version="7", headers=side.headers)
        return info.value

    direct, through = side_by_side(sides, ask)
    assert (through.status(), through.message()) == (direct.status(), direct.message())
    assert "version 7" in through.message()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_health_and_readiness_are_tritons(sides: tuple[Side, Side], protocol: str) -> None:
    """Health is open; a model's readiness is keyed (the frontend's side doors)."""
    probes: list[Callable[[Any, dict[str, str]], Any]] = [
        lambda c, h: c.is_server_live(),
        lambda c, h: c.is_server_ready(),
        lambda c, h: [c.is_model_ready(m, headers=h) for m in MODELS],
        lambda c, h: [c.is_model_ready(m, model_version="1", headers=h) for m in MODELS],
        lambda c, h: c.is_model_ready("simple", model_version="7", headers=h),
        lambda c, h: c.is_model_ready("no_such_model", headers=h),
    ]
    for probe in probes:

        def probed(s: Side, p: Callable[[Any, dict[str, str]], Any] = probe) -> Any:
            return p(s.client(protocol), s.headers)

        direct, through = side_by_side(sides, probed)
        assert through == direct
    assert through is False  # the last probe: an unknown model is not ready
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/simple/versions/1/ready"):

        def got(s: Side, p: str = path) -> Any:
            return http_request(s.http_url, "GET", p, headers=s.headers)

        direct, through = side_by_side(sides, got)
        assert through.status == direct.status == 200


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_server_metadata_lists_only_what_the_frontend_implements(
    sides: tuple[Side, Side], protocol: str
) -> None:
    direct, through = side_by_side(sides, lambda s: s.client(protocol).get_server_metadata())
    if protocol == "grpc":
        direct = {"name": direct.name, "extensions": list(direct.extensions)}
        through = {"name": through.name, "extensions": list(through.extensions)}
    assert through["name"] == direct["name"] == "triton"  # Triton's examples check it
    extensions = set(through["extensions"])
    assert extensions <= set(direct["extensions"])
    assert {"binary_tensor_data", "classification", "schedule_policy", "parameters"} <= extensions
    # perf_analyzer reads per-model statistics as soon as they are listed.
    assert "statistics" in extensions
    # Shared memory cannot cross hosts: not implemented, so not listed.
    assert not extensions & {"system_shared_memory", "cuda_shared_memory"}


def _inference_count(stats: Any) -> int:
    if isinstance(stats, dict):
        return int(stats["model_stats"][0]["inference_count"])
    return int(stats.model_stats[0].inference_count)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_model_statistics_count_what_went_through(sides: tuple[Side, Side], protocol: str) -> None:
    """tritonclient reads the frontend's statistics (Triton's message, both protocols), and
    they count the rows it served."""
    _, through = sides
    client = through.client(protocol)
    before = _inference_count(client.get_inference_statistics("simple", headers=through.headers))
    client.infer(
        "simple", make_inputs(protocol, model_inputs("simple", 3)), headers=through.headers
    )
    after = client.get_inference_statistics("simple", model_version="1", headers=through.headers)
    assert _inference_count(after) == before + 3


def test_grpc_model_ready_for_a_version_is_tritons(sides: tuple[Side, Side]) -> None:
    for version, ready in (("1", True), ("7", False)):
        request = service_pb2.ModelReadyRequest(name="simple", version=version)
        answers = []
        for side in sides:
            with grpc_stub(side.grpc_url) as stub:
                answers.append(grpc_call(stub, request, "ModelReady", tuple(side.key.items())))
        assert [a.response.ready for a in answers] == [ready, ready]


# ---- former inputs, parameters, outputs: what the frontend adds must not show -----------------


@pytest.mark.parametrize("protocol", ["http-binary", "grpc"])
@pytest.mark.parametrize(
    ("model", "name"),
    [("embed", "INPUT_LENGTHS"), ("generate", "INPUT_LENGTHS"), ("generate", "MAX_TOKENS")],
)
def test_former_inputs_are_refused_alike(
    sides: tuple[Side, Side], protocol: str, model: str, name: str
) -> None:
    """A client still sending the inputs the models had before (row lengths, tokens to
    generate; now request parameters) gets 400 / INVALID_ARGUMENT naming the input from
    both. Wording: Triton 2.51 counts inputs first ("expected 1 inputs but got 2 inputs
    ... Got input(s) [...]"); the frontend names the stray input ("unexpected inference
    input"), which is what Triton says when the count is right."""
    arrays = model_inputs(model, 2)
    arrays[name] = np.array([[3], [4]], dtype=np.int32)

    def call(side: Side) -> InferenceServerException:
        with pytest.raises(InferenceServerException) as info:
            side.client(protocol).infer(model, make_inputs(protocol, arrays), headers=side.headers)
        return info.value

    direct, through = side_by_side(sides, call)
    bad = "StatusCode.INVALID_ARGUMENT" if protocol == "grpc" else "400"
    assert direct.status() == through.status() == bad
    assert f"'{name}'" in direct.message()
    assert f"unexpected inference input '{name}' for model '{model}'" in through.message()


@pytest.mark.parametrize("protocol", ["http-binary", "grpc"])
def test_max_tokens_parameter_same_answer(sides: tuple[Side, Side], protocol: str) -> None:
    """``max_tokens`` as a request parameter: through the frontend it travels per row in
    ``fair_rows`` (OUTPUT_LENGTHS comes back from the model), and the client still gets
    Triton's answer: exactly OUTPUT_IDS, as many tokens as it asked for."""
    arrays = model_inputs("generate", 2)
    for count in (1, 7):

        def call(side: Side, n: int = count) -> Any:
            return side.client(protocol).infer(
                "generate",
                make_inputs(protocol, arrays),
                headers=side.headers,
                parameters={"max_tokens": n},
            )

        direct, through = side_by_side(sides, call)
        assert_same_answer(direct, through)
        assert [(n, shape) for n, _, shape in response_fields(through)[3]] == [
            ("OUTPUT_IDS", [2, count])
        ]


@pytest.mark.parametrize("protocol", ["http-binary", "http-json", "grpc"])
@pytest.mark.parametrize(
    "names",
    [["OUTPUT_IDS", "OUTPUT_LENGTHS"], ["OUTPUT_IDS", "OUTPUT_LENGTHS", "ROW_META"]],
    ids=["ids-and-lengths", "every-output"],  # the second is what perf_analyzer asks for
)
def test_named_outputs_the_model_leaves_out_are_left_out(
    sides: tuple[Side, Side], protocol: str, names: list[str]
) -> None:
    """A client's counts do not come per row, so generate leaves OUTPUT_LENGTHS (and here
    ROW_META) out even when named; through the frontend, whose per-row counts in
    ``fair_rows`` make the model emit OUTPUT_LENGTHS, too."""
    arrays = model_inputs("generate", 2)

    def call(side: Side) -> Any:
        return side.client(protocol).infer(
            "generate",
            make_inputs(protocol, arrays),
            outputs=make_outputs(protocol, names),
            headers=side.headers,
            parameters=model_parameters("generate"),
        )

    direct, through = side_by_side(sides, call)
    assert_same_answer(direct, through)
    assert [n for n, _, _ in response_fields(through)[3]] == ["OUTPUT_IDS"]


def test_generate_row_meta_with_output_ids(sides: tuple[Side, Side]) -> None:
    arrays = model_inputs("generate", 1)

    def call(side: Side) -> Any:
        return side.client("grpc").infer(
            "generate",
            make_inputs("grpc", arrays),
            outputs=make_outputs("grpc", ["OUTPUT_IDS", "ROW_META"]),
            headers=side.headers,
            parameters=model_parameters("generate"),
        )

    direct, through = side_by_side(sides, call)
    assert [n for n, _, _ in response_fields(direct)[3]] == ["OUTPUT_IDS", "ROW_META"]
    assert [n for n, _, _ in response_fields(through)[3]] == ["OUTPUT_IDS", "ROW_META"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_output_named_twice_is_answered_once(sides: tuple[Side, Side], protocol: str) -> None:
    """Triton answers it once, with the settings named last (here: classification)."""
    if protocol == "http":
        req = simple_http(rows=1)
        req.doc["outputs"] = [
            {"name": "OUTPUT0"},
            {"name": "OUTPUT0", "parameters": {"classification": 2}},
        ]

        def call(side: Side) -> Any:
            answer = http_request(
                side.http_url, "POST", req.path, req.body(), {**req.wire_headers(), **side.headers}
            )
            assert answer.status == 200, answer
            return answer.json()["outputs"]

    else:
        msg = ids_grpc("embed", RNG.integers(0, 4096, size=(1, 4), dtype=np.int32))
        msg.outputs.add(name="EMBEDDING")
        msg.outputs.add(name="EMBEDDING").parameters["classification"].int64_param = 2

        def call(side: Side) -> Any:
            with grpc_stub(side.grpc_url) as stub:
                answer = grpc_call(stub, msg, metadata=tuple(side.headers.items()))
            assert answer.code == answer.code.OK, answer
            result = grpcclient.InferResult(answer.response)
            return response_fields(result)[3], result.as_numpy("EMBEDDING").tolist()

    direct, through = side_by_side(sides, call)
    assert through == direct
