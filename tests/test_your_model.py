"""docs/YOUR_MODEL.md's worked endpoint configs, as written there, served and called
through the frontend in front of a real Triton serving stand-ins with exactly the config
interface of Triton's vLLM backend, TensorRT-LLM's ``tensorrt_llm_bls`` model and an
exported embedding model (``tests/your_models/``, ``python_backend/standins.py``: the real
backends need a GPU and weights).

One Triton for the module (the stand-ins only) and one frontend (one process), started
once. The engine stand-ins refuse a sequence over their slots, so a test that passes
through the frontend shows it kept to ``max_inflight``; the same load sent straight to
Triton is the negative control that the refusal happens.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import yaml

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.backends.triton.model_config import model_info
from fair_frontend.config import Config, Endpoint, parse_config, resolve_relative_paths
from fair_frontend.endpoint import plan
from fair_frontend.errors import FrontendError
from fair_frontend.shell.api import openai
from python_backend.standins import TOKENIZER
from tests.support import RunningFrontend, metric_sum, planned, running_frontend

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "YOUR_MODEL.md"
STANDINS = Path(__file__).resolve().parent / "your_models"
MARKER = "<!-- your-model-config -->"
KEY = "your-model-test-key"
TENANT = "platform"
HEADERS = {"authorization": f"Bearer {KEY}"}
SLOTS_REFUSED = "sequences at once, more than"


def documented_config() -> dict[str, Any]:
    """The YAML block right after the marker in docs/YOUR_MODEL.md."""
    after = DOC.read_text().split(MARKER, 1)[1].lstrip("\n")
    assert after.startswith("```yaml\n"), "no yaml block right after the marker"
    data: dict[str, Any] = yaml.safe_load(after.split("\n", 1)[1].split("\n```", 1)[0])
    return data


@pytest.fixture(scope="module")
def standins() -> Iterator[EmbeddedTriton]:
    with EmbeddedTriton([STANDINS]) as server:
        yield server


def worked_config(folder: Path) -> Config:
    """The documented entries, as pasted, plus one tenant to call them; the tokenizer
    where the entries say, in ``folder``."""
    shutil.copy(TOKENIZER, folder / "tokenizer.json")  # "the model's own tokenizer.json"
    data = documented_config()
    data.update(
        tiers=["enterprise"],
        tier_models={"enterprise": sorted(data["endpoints"])},
        tenants={TENANT: {"tier": "enterprise", "api_keys": [KEY]}},
    )
    resolve_relative_paths(data, folder)
    return parse_config(data)


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-shells"])
def worked(
    standins: EmbeddedTriton,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Any]:
    """The frontend with the documented entries in front of the stand-ins: in one
    process, and with two shell processes in front of the core (one hop: the shells
    send the granted rows and streams to Triton themselves)."""
    config = worked_config(tmp_path_factory.mktemp("your-model"))
    with running_frontend(config, standins, workers=int(request.param)) as running:
        yield running


def model_config(triton: EmbeddedTriton, model: str) -> dict[str, Any]:
    url = f"{triton.http_url}/v2/models/{model}/config"
    with urllib.request.urlopen(url, timeout=30) as answer:
        config: dict[str, Any] = json.load(answer)
    return config


def test_the_entries_say_what_the_models_say(standins: EmbeddedTriton) -> None:
    """Each value the doc ties to a model setting is that setting, and each input or
    output an entry names is one of the model's, with the type the entry needs."""
    endpoints = documented_config()["endpoints"]
    engine_args = json.loads((STANDINS / "vllm_model" / "1" / "model.json").read_text())
    vllm = endpoints["vllm_model"]
    assert vllm["max_inflight"] == engine_args["max_num_seqs"]
    assert vllm["max_model_len"] == engine_args["max_model_len"]
    trt = endpoints["tensorrt_llm_bls"]
    assert trt["max_inflight"] == model_config(standins, "tensorrt_llm_bls")["max_batch_size"]
    embedding = model_config(standins, "embedding_onnx")
    assert endpoints["embedding_onnx"]["max_batch_size"] <= embedding["max_batch_size"]
    for model, entry in endpoints.items():
        config = model_config(standins, model)
        inputs = {i["name"]: i["data_type"] for i in config["input"]}
        outputs = {o["name"]: o["data_type"] for o in config["output"]}
        for key in ("token_input", "sampling_parameters_input", "token_count_input"):
            if key in entry:
                assert entry[key] in inputs, (model, key)
        for key in ("token_output", "token_count_output"):
            if key in entry:
                assert entry[key] in outputs, (model, key)
        assert set(entry.get("padding", {}).get("inputs", {})) <= set(inputs), model
        decoupled = config.get("model_transaction_policy", {}).get("decoupled", False)
        assert decoupled == ("max_inflight" in entry), model  # engines stream, embedders batch


# ---- the two engines ------------------------------------------------------------------


def vllm_inputs(prompt: str, max_tokens: int, **sampling: Any) -> list[Any]:
    text = grpcaio.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    stream = grpcaio.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    params = grpcaio.InferInput("sampling_parameters", [1], "BYTES")
    blob = json.dumps({"max_tokens": max_tokens, **sampling}).encode()
    params.set_data_from_numpy(np.array([blob], dtype=object))
    return [text, stream, params]


def trtllm_inputs(prompt: str, max_tokens: int) -> list[Any]:
    text = grpcaio.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[prompt.encode()]], dtype=object))
    count = grpcaio.InferInput("max_tokens", [1, 1], "INT32")
    count.set_data_from_numpy(np.array([[max_tokens]], dtype=np.int32))
    stream = grpcaio.InferInput("stream", [1, 1], "BOOL")
    stream.set_data_from_numpy(np.array([[True]]))
    temperature = grpcaio.InferInput("temperature", [1, 1], "FP32")
    temperature.set_data_from_numpy(np.array([[0.7]], dtype=np.float32))
    return [text, count, stream, temperature]


ENGINE_INPUTS = {"vllm_model": vllm_inputs, "tensorrt_llm_bls": trtllm_inputs}


async def streams(
    url: str, model: str, count: int, max_tokens: int, headers: dict[str, str] | None
) -> tuple[dict[str, list[str]], list[str], set[str]]:
    """``count`` streamed generations sent at once on one gRPC stream, read to its end:
    (text pieces per request id, errors, the output names the responses carried)."""
    client = grpcaio.InferenceServerClient(url)
    pieces: dict[str, list[str]] = {str(i): [] for i in range(count)}
    errors: list[str] = []
    names: set[str] = set()

    async def requests() -> AsyncIterator[dict[str, Any]]:
        for i in range(count):
            inputs = ENGINE_INPUTS[model](f"request {i} of a busy tenant", max_tokens)
            yield {"model_name": model, "inputs": inputs, "request_id": str(i)}

    try:
        async for result, error in client.stream_infer(requests(), headers=headers):
            if error is not None:
                errors.append(str(error))
                continue
            response = result.get_response()
            names.update(o.name for o in response.outputs)
            text = result.as_numpy("text_output")
            if text is not None and text.size:
                pieces[response.id].append(b"".join(text.reshape(-1)).decode())
    finally:
        await client.close()
    return pieces, errors, names


@pytest.mark.parametrize("model", sorted(ENGINE_INPUTS))
async def test_the_engine_stand_in_refuses_more_than_its_slots(
    standins: EmbeddedTriton, model: str
) -> None:
    """The negative control: five generations sent straight to Triton at once find two
    slots, and the stand-in refuses the rest (what the frontend's test relies on). Each
    takes 100 steps (0.4 s), so all five are sent long before the first ends."""
    _, errors, _ = await streams(standins.grpc_url, model, 5, 100, None)
    assert errors and all(SLOTS_REFUSED in e for e in errors), errors


@pytest.mark.parametrize("model", sorted(ENGINE_INPUTS))
async def test_generations_through_the_frontend_keep_to_the_engines_slots(
    worked: RunningFrontend, model: str
) -> None:
    """Five generations at once through the frontend: the engine never sees more than
    max_inflight (no refusal), each streams its max_tokens tokens one per response, and
    the tenant is charged each output token (vLLM: the count each response carries,
    asked for by the frontend and not passed on to this client, who did not ask)."""
    before = metric_sum(worked, "fair_output_tokens_total", tenant=TENANT, endpoint=model)
    pieces, errors, names = await streams(worked.grpc_url, model, 5, 40, HEADERS)
    assert errors == []
    assert all(len(p) == 40 for p in pieces.values()), {k: len(p) for k, p in pieces.items()}
    assert "num_output_tokens" not in names
    after = metric_sum(worked, "fair_output_tokens_total", tenant=TENANT, endpoint=model)
    assert after - before == 5 * 40


async def test_vllm_sampling_is_checked_at_the_door(worked: RunningFrontend) -> None:
    """vLLM's rules, and its context from model.json's max_model_len (which its config
    does not carry: the entry says it), refuse a request before it waits for a slot."""
    client = grpcaio.InferenceServerClient(worked.grpc_url)

    async def one(inputs: list[Any]) -> str:
        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": "vllm_model", "inputs": inputs}

        async for _, error in client.stream_infer(requests(), headers=HEADERS):
            return "answered" if error is None else str(error.message())
        return "no answer"

    try:
        hot = await one(vllm_inputs("hello", 4, temperature=-1))
        long = await one(vllm_inputs("hello", 300))
    finally:
        await client.close()
    # The stand-in checks neither: these are the frontend's words (vLLM's rules).
    assert hot == "input 'sampling_parameters': temperature must be non-negative, got -1.0."
    assert "maximum context length of 256 tokens" in long, long


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(
        f"http://{url}{path}",
        data=json.dumps(body).encode(),
        headers={**HEADERS, "content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_vllm_model_serves_the_openai_completions_route(worked: RunningFrontend) -> None:
    body = {"model": "vllm_model", "prompt": "a fair queue is", "max_tokens": 6}
    status, answer = post(worked.http_url, "/v1/completions", body)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 6
    assert answer["choices"][0]["finish_reason"] == "length"
    status, answer = post(worked.http_url, "/v1/completions", {**body, "top_p": 0})
    assert status == 400 and "top_p" in answer["error"]["message"], answer


def test_trtllm_generate_extension_as_its_readme_calls_it(worked: RunningFrontend) -> None:
    """TensorRT-LLM's README: POST /v2/models/<m>/generate with text_input, max_tokens,
    bad_words, stop_words; the answer's text_output is the generated text."""
    body = {"text_input": "What is ML?", "max_tokens": 5, "bad_words": "", "stop_words": ""}
    status, answer = post(worked.http_url, "/v2/models/tensorrt_llm_bls/generate", body)
    assert status == 200, answer
    assert answer["model_name"] == "tensorrt_llm_bls"
    assert isinstance(answer["text_output"], str) and answer["text_output"], answer


def test_the_completions_route_gives_each_engine_its_sampling_its_way(
    standins: EmbeddedTriton, tmp_path: Path
) -> None:
    """vLLM: every sampling parameter in its sampling_parameters JSON; TensorRT-LLM's BLS
    model: those it has an input for as tensors of that input's type, the rest (seed: its
    input is random_seed) as request parameters."""
    config = worked_config(tmp_path)
    client = grpcclient.InferenceServerClient(standins.grpc_url)
    try:
        infos = {m: model_info(client.get_model_config(m).config) for m in ENGINE_INPUTS}
    finally:
        client.close()
    doc = {"prompt": "hi", "max_tokens": 6, "temperature": 0.5, "seed": 3}
    trt = openai.completion_request({**doc, "model": "tensorrt_llm_bls"}, {}, config)
    req = openai.engine_request(trt, plan(config, trt.model, infos["tensorrt_llm_bls"]))
    tensors = {t.name: t for t in req.inputs}
    assert (tensors["max_tokens"].datatype, tensors["max_tokens"].data.tolist()) == ("INT32", [[6]])
    assert (tensors["temperature"].datatype, tensors["temperature"].data.tolist()) == (
        "FP32",
        [[0.5]],
    )
    assert req.parameters == {"seed": 3}
    vllm = openai.completion_request({**doc, "model": "vllm_model"}, {}, config)
    req = openai.engine_request(vllm, plan(config, vllm.model, infos["vllm_model"]))
    tensors = {t.name: t for t in req.inputs}
    assert set(tensors) == {
        "text_input",
        "stream",
        "exclude_input_in_output",
        "sampling_parameters",
    }
    blob = json.loads(tensors["sampling_parameters"].data.reshape(-1)[0])
    assert blob == {"temperature": 0.5, "seed": 3, "max_tokens": 6}
    assert req.parameters == {}


def test_trtllm_generate_stream_streams_each_token(worked: RunningFrontend) -> None:
    """/generate_stream with "stream": true: one server-sent event per token, each with
    its text_output."""
    body = {"text_input": "What is ML?", "max_tokens": 5, "stream": True}
    req = urllib.request.Request(
        f"http://{worked.http_url}/v2/models/tensorrt_llm_bls/generate_stream",
        data=json.dumps(body).encode(),
        headers={**HEADERS, "content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as answer:
        assert answer.status == 200
        events = [
            json.loads(line[len(b"data: ") :])
            for line in answer.read().splitlines()
            if line.startswith(b"data: ")
        ]
    texts = [e["text_output"] for e in events if e.get("text_output")]
    assert len(texts) == 5, events


def test_the_embeddings_route_names_an_input_it_cannot_fill(standins: EmbeddedTriton) -> None:
    """A model that requires an input beside its ids and the two the route fills is
    refused with the input's name, not sent to fail in Triton."""
    client = grpcclient.InferenceServerClient(standins.grpc_url)
    try:
        cfg = client.get_model_config("embedding_onnx").config
    finally:
        client.close()
    endpoint = documented_endpoint("embedding_onnx")
    filled = openai.embedding_companions(planned(model_info(cfg), endpoint))
    assert filled == [("attention_mask", "INT64", 1)]
    extra = cfg.input.add()
    extra.CopyFrom(cfg.input[0])
    extra.name = "position_ids"
    with pytest.raises(FrontendError, match="requires input 'position_ids'"):
        openai.embedding_companions(planned(model_info(cfg), endpoint))


def documented_endpoint(model: str) -> Endpoint:
    return Endpoint.model_validate(documented_config()["endpoints"][model])


def test_trtllm_serves_the_openai_completions_route(worked: RunningFrontend) -> None:
    """The BLS model takes its sampling parameters as inputs of their own: the route
    sends max_tokens (INT32, required), temperature and top_p (FP32) as those tensors.
    It answered 400 before, the required max_tokens input missing."""
    body = {"model": "tensorrt_llm_bls", "prompt": "a fair queue is", "max_tokens": 6}
    status, answer = post(worked.http_url, "/v1/completions", {**body, "temperature": 0.5})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 6  # the stand-in made max_tokens
    assert answer["choices"][0]["text"]
    status, answer = post(worked.http_url, "/v1/completions", {**body, "max_tokens": 2**40})
    assert status == 400 and "max_tokens" in answer["error"]["message"], answer


# ---- the embedding model -------------------------------------------------------------


def embedding_inputs(ids: list[int]) -> list[Any]:
    out = []
    for name, values in (("input_ids", ids), ("attention_mask", [1] * len(ids))):
        tensor = grpcaio.InferInput(name, [1, len(ids)], "INT64")
        tensor.set_data_from_numpy(np.array([values], dtype=np.int64))
        out.append(tensor)
    return out


async def test_embeddings_of_ragged_rows_are_each_rows_own(
    worked: RunningFrontend, standins: EmbeddedTriton
) -> None:
    """Twenty requests of 3 to 60 tokens at once through the frontend share padded
    batches (fewer batches than requests), and each answer is the one Triton gives the
    same request alone: the padded attention_mask keeps the padding out of the mean."""
    rows = [[(7 * i + j) % 5000 + 1 for j in range(3 + (i * 13) % 58)] for i in range(20)]
    direct = grpcaio.InferenceServerClient(standins.grpc_url)
    front = grpcaio.InferenceServerClient(worked.grpc_url)
    batches = await worked.acall(worked.batch_count("embedding_onnx"))
    try:
        alone = [
            (await direct.infer("embedding_onnx", embedding_inputs(r))).as_numpy("embeddings")
            for r in rows
        ]
        answers = await asyncio.gather(
            *(front.infer("embedding_onnx", embedding_inputs(r), headers=HEADERS) for r in rows)
        )
    finally:
        await direct.close()
        await front.close()
    for row, answer, expected in zip(rows, answers, alone, strict=True):
        got = answer.as_numpy("embeddings")
        assert got.shape == (1, 32), (len(row), got.shape)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    sent = await worked.acall(worked.batch_count("embedding_onnx")) - batches
    assert 1 <= sent < len(rows), sent


def test_the_openai_embeddings_route_fills_the_attention_mask(
    worked: RunningFrontend, standins: EmbeddedTriton
) -> None:
    """POST /v1/embeddings sends each input's token ids and, as the exported model
    requires, its attention_mask (all ones): each vector is the one Triton gives the same
    row sent straight to it. It answered 400 before (attention_mask missing)."""
    rows = [[11, 12, 13], [21, 22, 23, 24, 25, 26, 27]]
    body = {"model": "embedding_onnx", "input": rows, "encoding_format": "float"}
    status, answer = post(worked.http_url, "/v1/embeddings", body)
    assert status == 200, answer

    async def alone() -> list[np.ndarray]:
        client = grpcaio.InferenceServerClient(standins.grpc_url)
        try:
            return [
                (await client.infer("embedding_onnx", embedding_inputs(r))).as_numpy("embeddings")
                for r in rows
            ]
        finally:
            await client.close()

    expected = asyncio.run(alone())
    for item, vector in zip(answer["data"], expected, strict=True):
        np.testing.assert_allclose(item["embedding"], vector[0], rtol=1e-5, atol=1e-6)


# ---- the doc's own commands ------------------------------------------------------------


def doc_block(after: str, language: str) -> str:
    """The first ``language`` fenced block after the text ``after`` in docs/YOUR_MODEL.md."""
    rest = DOC.read_text().split(after, 1)[1]
    return rest.split(f"```{language}\n", 1)[1].split("\n```", 1)[0]


def test_the_docs_tritonclient_example_streams_through_the_frontend(
    worked: RunningFrontend,
) -> None:
    """The doc's vLLM example, as written but for the address and the key: it prints
    max_tokens pieces of text and no error."""
    code = doc_block("vLLM, as Triton's own client examples do", "python")
    code = code.replace("localhost:8001", worked.grpc_url).replace("<key>", KEY)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    lines = out.splitlines()
    assert len(lines) == 32 and all(line.startswith("[b") for line in lines), out


def test_the_docs_curl_command_generates_through_the_frontend(worked: RunningFrontend) -> None:
    """TensorRT-LLM's README call, as the doc writes it, but for the address and the key."""
    command = doc_block("TensorRT-LLM, as its", "sh").replace("\\\n", " ")
    command = command.replace("localhost:8000", worked.http_url).replace("<key>", KEY)
    out = subprocess.run(
        ["bash", "-c", f"{command} --silent --show-error --fail-with-body"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    answer = json.loads(out)
    assert answer["model_name"] == "tensorrt_llm_bls" and answer["text_output"], answer
