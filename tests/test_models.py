"""The two served models, ``embed`` and ``generate``.

Most tests talk to the real Triton (session fixture ``triton``) with tritonclient over gRPC
and HTTP, exactly as a client that bypasses the frontend would. The rest run the code in
``python_backend/`` in-process: the ``TritonPythonModel`` contract with several requests in
one ``execute`` (which Triton's batcher only produces by timing), the TorchScript export,
and the config files Triton cannot load here (GPU variants).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from fair_frontend.backends.triton.embedded import EmbeddedTriton, default_model_repository
from fair_frontend.kit.testing import eventually, scrape
from python_backend import nets
from python_backend.embed import EmbedModel
from python_backend.export_torchscript import export, script_embed
from python_backend.generate import GenerateModel
from python_backend.rows import (
    RequestData,
    RequestError,
    decode_rows,
    pack,
    read_parameters,
    row_metadata,
    width_groups,
)
from python_backend.settings import ModelSettings

VOCAB = nets.VOCAB_SIZE
RTOL, ATOL = 1e-4, 1e-5  # padded next to other rows: equal up to float rounding
REPO = default_model_repository()


# ---- talking to Triton ---------------------------------------------------------------------


class Direct:
    """tritonclient straight to Triton over one protocol; answers as ``{output: array}``."""

    def __init__(self, triton: EmbeddedTriton, protocol: str) -> None:
        self.protocol = protocol
        self.mod: Any = grpcclient if protocol == "grpc" else httpclient
        url = triton.grpc_url if protocol == "grpc" else triton.http_url.removeprefix("http://")
        self.client = self.mod.InferenceServerClient(url)

    def infer(
        self,
        model: str,
        inputs: dict[str, np.ndarray],
        *,
        outputs: list[str] | None = None,
        parameters: dict[str, Any] | None = None,
        request_id: str = "",
    ) -> dict[str, np.ndarray]:
        tensors = []
        for name, value in inputs.items():
            tensor = self.mod.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        requested = [self.mod.InferRequestedOutput(n) for n in outputs] if outputs else None
        result = self.client.infer(
            model, tensors, outputs=requested, parameters=parameters, request_id=request_id
        )
        response = result.get_response()
        if self.protocol == "grpc":
            names = [o.name for o in response.outputs]
        else:
            names = [o["name"] for o in response["outputs"]]
        return {name: result.as_numpy(name) for name in names}

    def error(self, model: str, inputs: dict[str, np.ndarray], **kwargs: Any) -> str:
        """Send a request that must fail as invalid; return the client's error message."""
        with pytest.raises(InferenceServerException) as info:
            self.infer(model, inputs, **kwargs)
        expected = "StatusCode.INVALID_ARGUMENT" if self.protocol == "grpc" else "400"
        assert str(info.value.status()) == expected, info.value
        return str(info.value.message())


@pytest.fixture(scope="module", params=["grpc", "http"])
def direct(request: pytest.FixtureRequest, triton: EmbeddedTriton) -> Iterator[Direct]:
    client = Direct(triton, request.param)
    yield client
    client.client.close()


@pytest.fixture(scope="module")
def grpc_direct(triton: EmbeddedTriton) -> Iterator[Direct]:
    client = Direct(triton, "grpc")
    yield client
    client.client.close()


def ids(*rows: list[int]) -> np.ndarray:
    return np.array(rows, dtype=np.int32)


def random_rows(lengths: list[int], seed: int, pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A right-padded ``[B, max]`` INT32 batch (padding = ``pad``) and ``[B, 1]`` lengths."""
    rng = np.random.default_rng(seed)
    batch = np.full((len(lengths), max(lengths)), pad, dtype=np.int32)
    for i, n in enumerate(lengths):
        batch[i, :n] = rng.integers(0, VOCAB, n)
    return batch, np.array(lengths, dtype=np.int32).reshape(-1, 1)


def col(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int32).reshape(-1, 1)


def fair_rows(tenants: list[str], **columns: list[Any]) -> dict[str, str]:
    """The ``fair_rows`` parameter as the frontend sends it (per-row lists)."""
    return {"fair_rows": json.dumps({"tenant": tenants, **columns})}


def padded(lengths: list[int] | np.ndarray, **columns: list[Any]) -> dict[str, str]:
    """``fair_rows`` for a padded batch: each row's real length (and other lists)."""
    values = [int(n) for n in np.asarray(lengths).reshape(-1)]
    return fair_rows(["t"] * len(values), length=values, **columns)


# ---- embed ---------------------------------------------------------------------------------


def test_embed_shape_dtype_and_only_embedding_by_default(direct: Direct) -> None:
    out = direct.infer("embed", {"INPUT_IDS": ids([1, 2, 3], [4, 5, 6])})
    assert set(out) == {"EMBEDDING"}
    assert out["EMBEDDING"].shape == (2, 128)
    assert out["EMBEDDING"].dtype == np.float32
    assert np.isfinite(out["EMBEDDING"]).all()
    assert not np.array_equal(out["EMBEDDING"][0], out["EMBEDDING"][1])


def test_embed_is_deterministic_across_requests_and_protocols(triton: EmbeddedTriton) -> None:
    batch, _ = random_rows([50], seed=1)
    answers = []
    for protocol in ("grpc", "http", "grpc"):
        client = Direct(triton, protocol)
        answers.append(client.infer("embed", {"INPUT_IDS": batch})["EMBEDDING"])
    assert all(np.array_equal(answers[0], a) for a in answers[1:])


def test_embed_token_ids_are_taken_modulo_the_vocabulary(grpc_direct: Direct) -> None:
    base, _ = random_rows([20], seed=2)
    plain = grpc_direct.infer("embed", {"INPUT_IDS": base})["EMBEDDING"]
    for shifted in (base + 3 * VOCAB, base - VOCAB, base - 5 * VOCAB):  # negatives too
        out = grpc_direct.infer("embed", {"INPUT_IDS": shifted.astype(np.int32)})["EMBEDDING"]
        assert np.array_equal(out, plain)


def test_embed_one_row_is_bit_identical_with_and_without_lengths(direct: Direct) -> None:
    row, _ = random_rows([37], seed=3)
    alone = direct.infer("embed", {"INPUT_IDS": row})["EMBEDDING"]
    with_lengths = direct.infer("embed", {"INPUT_IDS": row}, parameters=padded([37]))
    assert np.array_equal(with_lengths["EMBEDDING"], alone)
    # The same row right-padded in a wider tensor: the padding is trimmed away, bit for bit.
    wide = np.concatenate([row, np.full((1, 27), 999, np.int32)], axis=1)
    out = direct.infer("embed", {"INPUT_IDS": wide}, parameters=padded([37]))
    assert np.array_equal(out["EMBEDDING"], alone)


@pytest.mark.parametrize("pad", [0, 1234])  # what the padding holds must not matter
def test_embed_padded_batch_equals_each_row_alone(direct: Direct, pad: int) -> None:
    lengths = [1, 7, 33, 128, 64]
    batch, lens = random_rows(lengths, seed=4, pad=pad)
    together = direct.infer("embed", {"INPUT_IDS": batch}, parameters=padded(lens))["EMBEDDING"]
    assert together.shape == (len(lengths), 128)
    for i, n in enumerate(lengths):
        alone = direct.infer("embed", {"INPUT_IDS": batch[i : i + 1, :n]})["EMBEDDING"]
        np.testing.assert_allclose(together[i], alone[0], rtol=RTOL, atol=ATOL)


def test_embed_rows_differ_when_only_padding_length_differs(grpc_direct: Direct) -> None:
    # Guards the test above: a mask that ignored lengths would embed padding zeros too.
    batch, _ = random_rows([10], seed=5)
    wide = np.concatenate([batch, np.zeros((1, 10), np.int32)], axis=1)
    masked = grpc_direct.infer("embed", {"INPUT_IDS": wide}, parameters=padded([10]))
    unmasked = grpc_direct.infer("embed", {"INPUT_IDS": wide})
    assert not np.allclose(masked["EMBEDDING"], unmasked["EMBEDDING"], rtol=RTOL, atol=ATOL)


def test_embed_serves_2048_token_rows_and_rejects_longer_than_positions(
    grpc_direct: Direct,
) -> None:
    long_row, _ = random_rows([2048], seed=6)
    out = grpc_direct.infer("embed", {"INPUT_IDS": long_row})
    assert out["EMBEDDING"].shape == (1, 128)
    too_long = np.zeros((1, nets.MAX_POSITIONS + 1), np.int32)
    message = grpc_direct.error("embed", {"INPUT_IDS": too_long})
    assert "INPUT_IDS" in message and str(nets.MAX_POSITIONS) in message


@pytest.mark.parametrize("bad", [0, 9, "3", None])
def test_embed_lengths_out_of_range_are_rejected(direct: Direct, bad: Any) -> None:
    message = direct.error(
        "embed",
        {"INPUT_IDS": ids([1, 2, 3, 4, 5, 6, 7, 8])},
        parameters=fair_rows(["t"], length=[bad]),
    )
    assert "fair_rows" in message and "length[0]" in message and "(8)" in message


@pytest.mark.parametrize(
    ("model", "name"),
    [("embed", "INPUT_LENGTHS"), ("generate", "INPUT_LENGTHS"), ("generate", "MAX_TOKENS")],
)
def test_former_inputs_are_unexpected_inputs_to_triton(
    direct: Direct, model: str, name: str
) -> None:
    """Row lengths and token counts are parameters now: Triton itself refuses them as
    inputs (400 / INVALID_ARGUMENT), before the model sees the request (a breaking change
    of the interface). Triton 2.51 counts the inputs before it names an unknown one: with
    INPUT_IDS beside it, the answer is "expected 1 inputs but got 2 inputs for model ...
    Got input(s) [...]"; alone, "unexpected inference input '<name>' for model ...".
    """
    message = direct.error(model, {"INPUT_IDS": ids([1, 2, 3]), name: col([3])})
    assert f"expected 1 inputs but got 2 inputs for model '{model}'" in message
    assert f"'{name}'" in message
    alone = direct.error(model, {name: col([3])})
    assert f"unexpected inference input '{name}' for model '{model}'" in alone


def test_the_only_model_input_is_input_ids() -> None:
    """What perf_analyzer fills with random data: every declared input, optional or not."""
    for name in ("embed", "generate"):
        for path in (REPO / name / "config.pbtxt", REPO / name / "configs" / "gpu.pbtxt"):
            assert [i.name for i in parse_config(path).input] == ["INPUT_IDS"], path


# ---- generate ------------------------------------------------------------------------------


def test_generate_defaults_to_16_tokens_and_only_output_ids(direct: Direct) -> None:
    out = direct.infer("generate", {"INPUT_IDS": ids([5, 6, 7, 8])})
    # OUTPUT_LENGTHS is declared but absent: the counts did not come per row (fair_rows).
    assert set(out) == {"OUTPUT_IDS"}
    assert out["OUTPUT_IDS"].shape == (1, 16)
    assert out["OUTPUT_IDS"].dtype == np.int32
    assert ((out["OUTPUT_IDS"] >= 0) & (out["OUTPUT_IDS"] < VOCAB)).all()


@pytest.mark.parametrize("parameters", [None, {"max_tokens": 5}, padded([4])])
def test_generate_explicitly_requested_lengths_are_absent_without_per_row_counts(
    direct: Direct, parameters: dict[str, Any] | None
) -> None:
    out = direct.infer(
        "generate",
        {"INPUT_IDS": ids([5, 6, 7, 8])},
        outputs=["OUTPUT_IDS", "OUTPUT_LENGTHS"],
        parameters=parameters,
    )
    assert set(out) == {"OUTPUT_IDS"}


def test_generate_makes_exactly_max_tokens_and_greedy_prefixes_agree(direct: Direct) -> None:
    prompt, _ = random_rows([12], seed=7)
    by_count = {}
    for n in (1, 5, 16, 40):
        out = direct.infer("generate", {"INPUT_IDS": prompt}, parameters={"max_tokens": n})
        assert out["OUTPUT_IDS"].shape == (1, n)
        by_count[n] = out["OUTPUT_IDS"][0]
    for n in (1, 5, 16):
        assert np.array_equal(by_count[40][:n], by_count[n])
    assert len(set(by_count[40].tolist())) > 1  # not a degenerate model repeating a token


def test_generate_is_deterministic_and_depends_on_the_prompt(grpc_direct: Direct) -> None:
    a, _ = random_rows([9], seed=8)
    b, _ = random_rows([9], seed=9)
    first = grpc_direct.infer("generate", {"INPUT_IDS": a})["OUTPUT_IDS"]
    again = grpc_direct.infer("generate", {"INPUT_IDS": a})["OUTPUT_IDS"]
    other = grpc_direct.infer("generate", {"INPUT_IDS": b})["OUTPUT_IDS"]
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


@pytest.mark.parametrize("bad", [0, -3, 257, "many", 2.5, True])
def test_generate_rejects_max_tokens_out_of_range_and_keeps_serving(
    direct: Direct, bad: Any
) -> None:
    message = direct.error("generate", {"INPUT_IDS": ids([1, 2])}, parameters={"max_tokens": bad})
    assert "parameter 'max_tokens' must be an integer between 1 and 256" in message
    assert direct.infer("generate", {"INPUT_IDS": ids([1, 2])})["OUTPUT_IDS"].shape == (1, 16)


def test_generate_takes_max_tokens_as_a_string_of_digits(grpc_direct: Direct) -> None:
    """As Triton's vLLM backend does (``int(value)``): some clients send only strings."""
    out = grpc_direct.infer("generate", {"INPUT_IDS": ids([1, 2])}, parameters={"max_tokens": "5"})
    assert out["OUTPUT_IDS"].shape == (1, 5)


def test_generate_one_row_is_bit_identical_with_and_without_fair_rows(direct: Direct) -> None:
    row, _ = random_rows([21], seed=10)
    alone = direct.infer("generate", {"INPUT_IDS": row}, parameters={"max_tokens": 24})
    # As the frontend sends it: length and count per row, the row padded wider.
    wide = np.concatenate([row, np.full((1, 11), 77, np.int32)], axis=1)
    both = direct.infer("generate", {"INPUT_IDS": wide}, parameters=padded([21], max_tokens=[24]))
    assert set(alone) == {"OUTPUT_IDS"}
    assert set(both) == {"OUTPUT_IDS", "OUTPUT_LENGTHS"}  # counts per row: lengths answered
    assert np.array_equal(both["OUTPUT_IDS"], alone["OUTPUT_IDS"])
    assert both["OUTPUT_LENGTHS"].tolist() == [[24]]


def test_generate_padded_batch_equals_each_row_alone(direct: Direct) -> None:
    lengths = [3, 10, 32, 17, 1]
    counts = [16, 4, 20, 1, 7]
    batch, lens = random_rows(lengths, seed=11)
    out = direct.infer("generate", {"INPUT_IDS": batch}, parameters=padded(lens, max_tokens=counts))
    assert out["OUTPUT_IDS"].shape == (len(lengths), max(counts))
    assert out["OUTPUT_LENGTHS"].reshape(-1).tolist() == counts
    for i, (n, count) in enumerate(zip(lengths, counts, strict=True)):
        alone = direct.infer(
            "generate", {"INPUT_IDS": batch[i : i + 1, :n]}, parameters={"max_tokens": count}
        )["OUTPUT_IDS"][0]
        assert np.array_equal(out["OUTPUT_IDS"][i, :count], alone), f"row {i}"
        assert not out["OUTPUT_IDS"][i, count:].any(), "padding after a row's count is 0"


# ---- per-row metadata ------------------------------------------------------------------------


def test_row_meta_is_absent_unless_asked_for(direct: Direct) -> None:
    params = fair_rows(["acme"])
    assert set(direct.infer("embed", {"INPUT_IDS": ids([1])}, parameters=params)) == {"EMBEDDING"}
    assert set(direct.infer("generate", {"INPUT_IDS": ids([1])}, parameters=params)) == {
        "OUTPUT_IDS"
    }


def test_row_meta_echoes_fair_rows(direct: Direct) -> None:
    params = fair_rows(
        ["acme", "globex"], priority=[1, 3], deadline_us=[1_700_000_000_000_000, 0], id=["a", "b"]
    )
    out = direct.infer(
        "embed", {"INPUT_IDS": ids([1, 2], [3, 0])}, outputs=["ROW_META"], parameters=params
    )
    assert set(out) == {"ROW_META"}
    assert out["ROW_META"].shape == (2, 1)
    assert [json.loads(m) for m in out["ROW_META"][:, 0]] == [
        {"tenant": "acme", "priority": 1, "deadline_us": 1_700_000_000_000_000, "id": "a"},
        {"tenant": "globex", "priority": 3, "deadline_us": 0, "id": "b"},
    ]


def test_row_meta_for_direct_clients_uses_tenant_parameter_or_unknown(direct: Direct) -> None:
    named = direct.infer(
        "generate",
        {"INPUT_IDS": ids([1, 2], [3, 4])},
        outputs=["OUTPUT_IDS", "ROW_META"],
        parameters={"tenant": "initech", "max_tokens": 2},
        request_id="req-7",
    )
    assert named["OUTPUT_IDS"].shape == (2, 2)
    expected = {"tenant": "initech", "priority": 0, "deadline_us": 0, "id": "req-7"}
    assert [json.loads(m) for m in named["ROW_META"][:, 0]] == [expected, expected]
    anonymous = direct.infer("embed", {"INPUT_IDS": ids([1])}, outputs=["ROW_META"])
    assert json.loads(anonymous["ROW_META"][0, 0])["tenant"] == "unknown"


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"priority": [1, 2]}), "no 'tenant'"),
        (json.dumps({"tenant": ["a"]}), "has 1 entries, but the request has 2 rows"),
        (json.dumps({"tenant": ["a", "b"], "priority": [0, -1]}), "priority[1]"),
        (json.dumps({"tenant": ["a", 7]}), "tenant[1]"),
        (json.dumps({"tenant": ["a", "b"], "length": 1}), "'length' must be a list"),
        (json.dumps({"tenant": ["a", "b"], "length": [1, 2]}), "length[1] is 2"),
    ],
)
def test_malformed_fair_rows_is_a_per_request_error(direct: Direct, value: str, says: str) -> None:
    message = direct.error("embed", {"INPUT_IDS": ids([1], [2])}, parameters={"fair_rows": value})
    assert "fair_rows" in message and says in message
    assert direct.infer("embed", {"INPUT_IDS": ids([1], [2])})["EMBEDDING"].shape == (2, 128)


# ---- per-tenant metrics ----------------------------------------------------------------------


def counters(triton: EmbeddedTriton) -> dict[tuple[str, str, str], float]:
    """``{(sample, model, tenant): value}`` of the fair_model_* counters on /metrics."""
    return {
        (s.name, s.labels["model"], s.labels["tenant"]): s.value
        for s in scrape(triton.metrics_url, timeout=5)
        if s.name in ("fair_model_rows_total", "fair_model_tokens_total")
    }


def test_metrics_count_rows_and_real_tokens_per_tenant(
    triton: EmbeddedTriton, direct: Direct
) -> None:
    a, b, c = (f"t-{uuid.uuid4().hex[:8]}" for _ in range(3))
    before = counters(triton)
    batch, lens = random_rows([3, 5, 7], seed=12)
    lengths = lens[:, 0].tolist()
    direct.infer("embed", {"INPUT_IDS": batch}, parameters=fair_rows([a, b, a], length=lengths))
    direct.infer("embed", {"INPUT_IDS": ids([1, 2, 3, 4])}, parameters={"tenant": b})
    # generate: prompt tokens + generated tokens; a rejected request counts nothing.
    direct.infer("generate", {"INPUT_IDS": ids([1] * 6)}, parameters={"tenant": c, "max_tokens": 4})
    batch, lens = random_rows([2, 9], seed=13)
    direct.infer(
        "generate",
        {"INPUT_IDS": batch},
        parameters=fair_rows([c, a], length=lens[:, 0].tolist(), max_tokens=[1, 3]),
    )
    direct.error("generate", {"INPUT_IDS": ids([1])}, parameters={"tenant": c, "max_tokens": 0})
    after = counters(triton)

    def delta(sample: str, model: str, tenant: str) -> float:
        key = (f"fair_model_{sample}_total", model, tenant)
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert (delta("rows", "embed", a), delta("tokens", "embed", a)) == (2, 3 + 7)
    assert (delta("rows", "embed", b), delta("tokens", "embed", b)) == (2, 5 + 4)
    assert (delta("rows", "generate", c), delta("tokens", "generate", c)) == (2, 6 + 4 + 2 + 1)
    assert (delta("rows", "generate", a), delta("tokens", "generate", a)) == (1, 9 + 3)
    assert delta("rows", "generate", b) == 0


# ---- in-process: the TritonPythonModel contract ------------------------------------------


class _Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class _Request:
    def __init__(self, inputs: dict[str, np.ndarray], params: dict[str, Any] | None = None):
        self.inputs, self.params = inputs, params or {}

    def parameters(self) -> str:
        return json.dumps(self.params)

    def request_id(self) -> str:
        return ""

    def requested_output_names(self) -> list[str]:
        return []


class _Metric:
    def __init__(self, labels: dict[str, str], sink: dict[tuple[str, ...], float], family: str):
        self.key = (family, labels["model"], labels["tenant"])
        self.sink = sink

    def increment(self, value: float) -> None:
        self.sink[self.key] = self.sink.get(self.key, 0.0) + value


def fake_pb_utils(sink: dict[tuple[str, ...], float]) -> types.ModuleType:
    """Just enough of ``triton_python_backend_utils`` for model.py, recording metrics."""
    pb = types.ModuleType("triton_python_backend_utils")

    class TritonError:
        INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"

        def __init__(self, message: str, code: str | None = None) -> None:
            self.message, self.code = message, code

    class InferenceResponse:
        def __init__(self, output_tensors: list[_Tensor] | None = None, error: Any = None):
            self.outputs = {t.name: t.array for t in output_tensors or []}
            self.error = error

    class MetricFamily:
        COUNTER = "COUNTER"

        def __init__(self, name: str, description: str, kind: str) -> None:
            self.name = name

        def Metric(self, labels: dict[str, str]) -> _Metric:  # Triton's name
            return _Metric(labels, sink, self.name)

    # The module's names (a ModuleType has none that mypy knows of to assign).
    vars(pb).update(
        TritonError=TritonError,
        InferenceResponse=InferenceResponse,
        MetricFamily=MetricFamily,
        Tensor=_Tensor,
        get_input_tensor_by_name=lambda request, name: (
            _Tensor(name, request.inputs[name]) if name in request.inputs else None
        ),
    )
    return pb


def load_model(
    name: str, monkeypatch: pytest.MonkeyPatch, sink: dict[tuple[str, ...], float]
) -> Any:
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils(sink))
    spec = importlib.util.spec_from_file_location(f"_{name}_model", REPO / name / "1" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    config = (REPO / name / "config.pbtxt").read_text()
    parsed = text_format.Parse(config, model_config_pb2.ModelConfig())
    params = {k: {"string_value": v.string_value} for k, v in parsed.parameters.items()}
    model.initialize(
        {
            "model_config": json.dumps({"parameters": params}),
            "model_name": name,
            "model_instance_kind": "CPU",
            "model_instance_device_id": "0",
        }
    )
    return model


def test_execute_answers_each_request_and_isolates_a_bad_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink: dict[tuple[str, ...], float] = {}
    model = load_model("generate", monkeypatch, sink)
    first, _ = random_rows([5], seed=14)
    second, _ = random_rows([11, 11], seed=15)
    requests = [
        _Request({"INPUT_IDS": first}, {"tenant": "x", "max_tokens": 3}),
        _Request({"INPUT_IDS": ids([1, 2])}, {"tenant": "x", "max_tokens": 300}),
        _Request({"INPUT_IDS": second}, {"tenant": "y"}),  # a different width, batched along
    ]
    responses = model.execute(requests)
    assert len(responses) == 3
    assert responses[1].error is not None and responses[1].error.code == "INVALID_ARG"
    assert "max_tokens" in responses[1].error.message
    assert responses[0].error is None and responses[2].error is None
    alone = model.execute([_Request({"INPUT_IDS": first}, {"max_tokens": 3})])
    assert np.array_equal(responses[0].outputs["OUTPUT_IDS"], alone[0].outputs["OUTPUT_IDS"])
    assert responses[2].outputs["OUTPUT_IDS"].shape == (2, 16)
    assert sink[("fair_model_rows_total", "generate", "x")] == 1
    assert sink[("fair_model_tokens_total", "generate", "x")] == 5 + 3
    assert sink[("fair_model_tokens_total", "generate", "y")] == 2 * (11 + 16)
    model.finalize()


def test_execute_turns_a_failing_forward_pass_into_internal_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = load_model("embed", monkeypatch, {})

    def broken(*args: Any) -> None:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(model.model, "embed", broken)
    responses = model.execute(
        [_Request({"INPUT_IDS": ids([1])}), _Request({"INPUT_IDS": ids([2])})]
    )
    assert [r.error.code for r in responses] == ["INTERNAL", "INTERNAL"]
    assert "out of memory" in responses[0].error.message


# ---- in-process: python_backend ------------------------------------------------------------


def test_requests_of_different_widths_in_one_run_equal_each_alone() -> None:
    model = EmbedModel()
    parts = [random_rows(lengths, seed=16 + i) for i, lengths in enumerate([[4], [40, 2], [900]])]
    decoded = [model.decode(RequestData({"INPUT_IDS": b}, json.dumps(padded(n)))) for b, n in parts]
    together = model.run(decoded)
    for request, (batch, lens) in zip(together, parts, strict=True):
        for i, n in enumerate(lens[:, 0]):
            alone = model.run([model.decode(RequestData({"INPUT_IDS": batch[i : i + 1, :n]}))])
            np.testing.assert_allclose(
                request["EMBEDDING"][i], alone[0]["EMBEDDING"][0], rtol=RTOL, atol=ATOL
            )


def test_width_groups_keep_a_full_batch_together_and_long_rows_apart() -> None:
    assert [g.tolist() for g in width_groups(np.full(32, 128), 8192)] == [list(range(32))]
    lengths = np.array([5, 2048, 7, 3])
    groups = width_groups(lengths, 4096)
    assert sorted(i for g in groups for i in g.tolist()) == [0, 1, 2, 3]
    assert max(int(lengths[g].max()) * len(g) for g in groups) <= 4096


def test_pack_pads_with_zero_and_remembers_each_requests_rows() -> None:
    a = decode_rows(ids([1, 2, 3]), None, vocab=VOCAB, max_row_tokens=100)
    b = decode_rows(ids([4, 9], [5, 6]), [1, 2], vocab=VOCAB, max_row_tokens=100)
    packed = pack([a, b])
    assert packed.ids.tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]
    assert packed.lengths.tolist() == [3, 1, 2]
    assert packed.slices == [slice(0, 1), slice(1, 3)]


def test_row_metadata_defaults() -> None:
    params = read_parameters(json.dumps(fair_rows(["a", "b"])), 2)
    rows = row_metadata(params, 2, "r")
    assert [(m.tenant, m.priority, m.deadline_us, m.id) for m in rows] == [
        ("a", 0, 0, "r"),
        ("b", 0, 0, "r"),
    ]
    with pytest.raises(RequestError, match="tenant"):
        row_metadata(read_parameters(json.dumps({"tenant": 5}), 1), 1, "")


def test_generate_reads_max_tokens_per_row_then_per_request_then_default() -> None:
    model = GenerateModel()

    def decode(params: dict[str, Any]) -> Any:
        return model.decode(RequestData({"INPUT_IDS": ids([1, 2], [3, 4])}, json.dumps(params)))

    per_row = decode({"max_tokens": 9, **fair_rows(["a", "b"], max_tokens=[2, 7])})
    assert (per_row.max_tokens.tolist(), per_row.per_row) == ([2, 7], True)
    per_request = decode({"max_tokens": " 9"})
    assert (per_request.max_tokens.tolist(), per_request.per_row) == ([9, 9], False)
    assert decode({}).max_tokens.tolist() == [16, 16]
    with pytest.raises(RequestError, match=r"fair_rows': max_tokens\[1\] must be an integer"):
        decode(fair_rows(["a", "b"], max_tokens=[2, 257]))


def test_settings_from_model_config_parameters() -> None:
    config = {"parameters": {"torch_threads": {"string_value": "2"}}}
    assert ModelSettings.from_model_config(config).torch_threads == 2
    with pytest.raises(ValueError, match="torch_threads"):
        ModelSettings.from_model_config({"parameters": {"torch_threads": {"string_value": "0"}}})
    gpu = ModelSettings.from_triton_args(
        {"model_config": "{}", "model_instance_kind": "GPU", "model_instance_device_id": "1"}
    )
    assert gpu.device == "cuda:1"


def test_generate_model_rows_decode_alike_alone_and_batched_in_process() -> None:
    model = GenerateModel()
    batch, lens = random_rows([30, 2, 17], seed=19)
    together = model.greedy(batch.astype(np.int64), lens[:, 0].astype(np.int64), 12)
    for i, n in enumerate(lens[:, 0]):
        alone = model.greedy(batch[i : i + 1, :n].astype(np.int64), np.array([n]), 12)
        assert np.array_equal(together[i], alone[0])


# ---- GPU variants and TorchScript ------------------------------------------------------------


def parse_config(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


@pytest.mark.parametrize("name", ["embed", "generate", "rerank"])
def test_gpu_config_differs_from_the_cpu_one_only_in_instance_kind(name: str) -> None:
    cpu = parse_config(REPO / name / "config.pbtxt")
    gpu = parse_config(REPO / name / "configs" / "gpu.pbtxt")
    assert [g.kind for g in cpu.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_CPU]
    assert [g.kind for g in gpu.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_GPU]
    del cpu.instance_group[:]
    del gpu.instance_group[:]
    assert cpu == gpu


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
def test_torchscript_embed_equals_the_python_backend_model(tmp_path: Path) -> None:
    scripted = script_embed()
    model = EmbedModel()
    batch, _ = random_rows([40, 40, 40, 40], seed=20)  # no lengths there: full-width rows
    batch[0, 0] = -7  # modulo, as in the Python backend
    expected = model.run([model.decode(RequestData({"INPUT_IDS": batch}))])
    with torch.inference_mode():
        for _ in range(3):  # past the TorchScript profiling runs, which may re-optimise
            got = scripted(torch.from_numpy(batch)).numpy()
            np.testing.assert_allclose(got, expected[0]["EMBEDDING"], rtol=1e-5, atol=1e-6)
    out = export(tmp_path / "repo", "KIND_GPU")
    loaded = torch.jit.load(str(out / "embed" / "1" / "model.pt"))
    with torch.inference_mode():
        again = loaded(torch.from_numpy(batch)).numpy()
    np.testing.assert_allclose(again, expected[0]["EMBEDDING"], rtol=1e-5, atol=1e-6)
    config = parse_config(out / "embed" / "config.pbtxt")
    assert config.platform == "pytorch_libtorch"
    assert [i.name for i in config.input] == ["INPUT_IDS"]
    generate = parse_config(out / "generate" / "config.pbtxt")
    assert generate.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert (out / "generate" / "1" / "model.py").is_file()


def test_tritons_batcher_mixes_widths_and_each_answer_matches_alone(grpc_direct: Direct) -> None:
    # allow_ragged_batch lets Triton hand execute() requests of different widths; the model
    # pads them together. A long request keeps the model busy while short ones queue.
    widths = [2048] + [5 + 3 * i for i in range(10)]
    rows = [random_rows([w], seed=100 + i)[0] for i, w in enumerate(widths)]

    def burst() -> list[np.ndarray] | None:
        """Send the rows at once; their answers if Triton batched some of them together."""
        stats = grpc_direct.client.get_inference_statistics("embed").model_stats[0]
        before = (stats.inference_count, stats.execution_count)
        # The 2048-token request keeps the model busy while the rest queue (whichever of
        # them Triton takes first, several wait together for the next execute).
        with ThreadPoolExecutor(len(widths)) as pool:
            futures = [pool.submit(grpc_direct.infer, "embed", {"INPUT_IDS": r}) for r in rows]
            answers = [f.result()["EMBEDDING"] for f in futures]

        def counted() -> Any:  # Triton counts a request once its execute() has returned
            stats = grpc_direct.client.get_inference_statistics("embed").model_stats[0]
            return stats if stats.inference_count - before[0] == len(widths) else None

        stats = eventually(counted, 30, what="Triton's statistics to count every request")
        return answers if stats.execution_count - before[1] < len(widths) else None

    # On a loaded machine the client's threads may send so slowly that each request finds
    # the model idle; a burst is sent again until some of its rows met in one execute().
    answers = eventually(burst, 120, what="Triton to batch short requests of different widths")
    for i, row in enumerate(rows):
        alone = grpc_direct.infer("embed", {"INPUT_IDS": row})["EMBEDDING"]
        np.testing.assert_allclose(answers[i], alone, rtol=RTOL, atol=ATOL)


def test_cached_decoding_matches_full_causal_passes() -> None:
    # The KV cache is an optimisation: each step must give what a full pass over the prompt
    # plus the tokens so far gives at the row's last position (the reference forward()).
    net = GenerateModel().net
    batch, lens = random_rows([6, 1, 13], seed=21)
    ids = torch.from_numpy(batch.astype(np.int64))
    pos = torch.from_numpy(lens[:, 0].astype(np.int64))
    steps = 10
    buffer = torch.zeros(ids.shape[0], ids.shape[1] + steps, dtype=torch.int64)
    buffer[:, : ids.shape[1]] = ids
    rows = torch.arange(ids.shape[0])
    with torch.inference_mode():
        logits, cache = net.prefill(ids, pos.clone(), width=buffer.shape[1])
        for _ in range(steps):
            reference = net(buffer[:, : int(pos.max())], pos - 1)
            torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
            token = logits.argmax(dim=-1)
            assert torch.equal(token, reference.argmax(dim=-1))
            buffer[rows, pos] = token
            logits = net.step(token, pos, cache)
            pos = pos + 1
