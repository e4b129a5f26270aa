"""The ``rerank`` model (a cross-encoder): through the session's real Triton with
tritonclient, through the frontend (cost = the row's tokens), under perf_analyzer's random
data, and with ONNX weights: tiny cross-encoders exported in the test with Hugging Face's
signature, whose scores through the model must be those of onnxruntime and torch run on
each pair directly."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
import pytest
import torch
import tritonclient.grpc as grpcclient
from google.protobuf import text_format
from torch import nn
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton, default_model_repository
from fair_frontend.kit.testing import eventually, perf_analyzer
from fair_frontend.shell.api.rerank import pair_rows, row_request
from fair_frontend.tokens import load_tokenizer
from python_backend import nets
from python_backend.rerank import SCORE, RerankModel, RerankOptions
from python_backend.rows import RequestData
from tests.support import KEYS, PERF_ANALYZER_SHORT_RUN, RunningFrontend, metric_sum

REPO = default_model_repository()
TOKENIZER = str(REPO / "rerank" / "tokenizer.json")
_TOK = load_tokenizer(TOKENIZER)
SEP = _TOK.token_to_id("[SEP]")
RTOL, ATOL = 1e-4, 1e-5  # padded next to other rows: equal up to float rounding
QUERY = "how does the frontend share a model between tenants"
DOCUMENTS = [
    "Deficit round robin gives each backlogged tenant its share of the model, by weight.",
    "Tokenizers turn text into ids.",
    "A tenant that bursts ten thousand requests waits behind its own, not in front of others.",
    "",
    "Llamas are domesticated South American camelids.",
]


def pairs() -> list[np.ndarray]:
    return pair_rows(TOKENIZER, QUERY, DOCUMENTS, None, 512)


def padded(rows: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    lengths = [len(r) for r in rows]
    batch = np.zeros((len(rows), max(lengths)), dtype=np.int32)
    for i, r in enumerate(rows):
        batch[i, : len(r)] = r
    return batch, lengths


def fair_rows(lengths: list[int], tenant: str = "t") -> dict[str, str]:
    return {"fair_rows": json.dumps({"tenant": [tenant] * len(lengths), "length": lengths})}


def infer(
    client: Any, ids: np.ndarray, *, parameters: dict[str, Any] | None = None, **kwargs: Any
) -> np.ndarray:
    """``SCORE`` ``[B, 1]`` for ``ids`` ``[B, W]`` INT32."""
    tensor = grpcclient.InferInput("INPUT_IDS", list(ids.shape), "INT32")
    tensor.set_data_from_numpy(np.ascontiguousarray(ids, dtype=np.int32))
    result = client.infer(
        "rerank",
        [tensor],
        outputs=[grpcclient.InferRequestedOutput(SCORE)],
        parameters=parameters,
        **kwargs,
    )
    scores: np.ndarray = result.as_numpy(SCORE)
    return scores


@pytest.fixture(scope="module")
def direct(triton: EmbeddedTriton) -> Iterator[Any]:
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    yield client
    client.close()


def in_process(
    model: RerankModel, *batches: np.ndarray, lengths: list[int] | None = None
) -> list[np.ndarray]:
    """``SCORE`` per request, several requests in one ``run`` (as one Triton execute);
    ``lengths``: the rows' lengths for each (padded) batch."""
    params = "{}" if lengths is None else json.dumps(fair_rows(lengths))
    requests = [model.decode(RequestData({"INPUT_IDS": b}, params)) for b in batches]
    return [out[SCORE] for out in model.run(requests)]


# ---- the builtin model through Triton ------------------------------------------------------


def test_scores_are_deterministic_and_the_builtins_own(direct: Any) -> None:
    rows = pairs()
    through = [infer(direct, r.reshape(1, -1)) for r in rows]
    again = [infer(direct, r.reshape(1, -1)) for r in rows]
    assert all(np.array_equal(a, b) for a, b in zip(through, again, strict=True))
    assert all(s.shape == (1, 1) and s.dtype == np.float32 for s in through)
    # The same seed in this process gives the same network as in Triton's stub.
    local = RerankModel()
    for row, score in zip(rows, through, strict=True):
        np.testing.assert_allclose(in_process(local, row.reshape(1, -1))[0], score, rtol=1e-6)
    # Scores tell the pairs apart (a constant would pass the checks above).
    assert len({float(s[0, 0]) for s in through}) == len(rows)


def test_a_pair_scores_the_same_alone_and_padded_among_others(direct: Any) -> None:
    rows = pairs()
    alone = np.concatenate([infer(direct, r.reshape(1, -1)) for r in rows])
    batch, lengths = padded(rows)
    together = infer(direct, batch, parameters=fair_rows(lengths))
    np.testing.assert_allclose(together, alone, rtol=RTOL, atol=ATOL)
    # What is in the padding does not matter: lengths, not pad values, mask it.
    batch[batch == 0] = 1234
    for i, n in enumerate(lengths):
        batch[i, n:] = 1234
    np.testing.assert_allclose(
        infer(direct, batch, parameters=fair_rows(lengths)), alone, rtol=RTOL, atol=ATOL
    )


def test_tritons_batcher_mixes_widths_and_each_answer_matches_alone(direct: Any) -> None:
    # allow_ragged_batch lets Triton hand execute() requests of different widths; the model
    # pads them together. A full batch of long pairs keeps the model busy while the rest queue.
    rng = np.random.default_rng(5)
    busy = rng.integers(0, nets.VOCAB_SIZE, (32, 512)).astype(np.int32)
    rows = [r.reshape(1, -1) for r in pairs()]
    stats = direct.get_inference_statistics("rerank").model_stats[0]
    before = (stats.inference_count, stats.execution_count)
    with ThreadPoolExecutor(1 + len(rows)) as pool:
        first = pool.submit(infer, direct, busy)
        futures = [pool.submit(infer, direct, r) for r in rows]
        answers = [f.result() for f in futures]
        first.result()

    def counted() -> Any:  # Triton counts a request once its execute() has returned
        stats = direct.get_inference_statistics("rerank").model_stats[0]
        return stats if stats.inference_count - before[0] == 32 + len(rows) else None

    stats = eventually(counted, 30, what="Triton's statistics to count every request")
    assert stats.execution_count - before[1] < 1 + len(rows), "short requests were batched"
    for row, got in zip(rows, answers, strict=True):
        np.testing.assert_allclose(got, infer(direct, row), rtol=RTOL, atol=ATOL)


def test_ids_outside_the_vocabulary_wrap_around(direct: Any) -> None:
    row = pairs()[0].reshape(1, -1).astype(np.int64)
    expected = infer(direct, row.astype(np.int32))
    for shift in (nets.VOCAB_SIZE, -3 * nets.VOCAB_SIZE, 500_000 * nets.VOCAB_SIZE):
        shifted = row + shift  # still an INT32, the same ids modulo the vocabulary
        assert shifted.min() < 0 or shifted.max() >= nets.VOCAB_SIZE
        assert np.array_equal(infer(direct, shifted.astype(np.int32)), expected)


def test_a_pair_longer_than_max_model_len_is_refused(direct: Any) -> None:
    infer(direct, np.ones((1, 512), dtype=np.int32))
    with pytest.raises(InferenceServerException) as info:
        infer(direct, np.ones((1, 513), dtype=np.int32))
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "513 tokens" in str(info.value.message()) and "512" in str(info.value.message())


def test_row_meta_is_echoed_when_asked_alone(direct: Any) -> None:
    batch, lengths = padded(pairs()[:2])
    tensor = grpcclient.InferInput("INPUT_IDS", list(batch.shape), "INT32")
    tensor.set_data_from_numpy(batch)
    result = direct.infer(
        "rerank",
        [tensor],
        outputs=[grpcclient.InferRequestedOutput("ROW_META")],
        parameters=fair_rows(lengths, tenant="meta-tenant"),
    )
    assert [json.loads(m)["tenant"] for m in result.as_numpy("ROW_META")[:, 0]] == [
        "meta-tenant",
        "meta-tenant",
    ]
    assert result.as_numpy(SCORE) is None


def test_perf_analyzers_random_rows_are_valid(triton: EmbeddedTriton) -> None:
    result = perf_analyzer(
        "rerank",
        triton.grpc_url,
        concurrency=2,
        shapes=["INPUT_IDS:128"],
        extra=PERF_ANALYZER_SHORT_RUN,
        timeout_s=120,
    )  # raises with perf_analyzer's output on any error
    assert result["throughput"] > 0


# ---- through the frontend ----------------------------------------------------------------


def test_one_row_per_document_through_the_frontend_costs_its_tokens(
    triton: EmbeddedTriton, frontend: RunningFrontend, direct: Any
) -> None:
    """What the rerank routes will send: one KServe request per document (``row_request``),
    each charged its tokens to the caller's tenant on the ``rerank`` endpoint."""
    tenant = "hooli"
    rows = pairs()
    requests = [row_request(r) for r in rows]
    labels = {"tenant": tenant, "endpoint": "rerank"}
    cost_before = metric_sum(frontend, "fair_served_cost_total", **labels)
    tokens_before = metric_sum(frontend, "fair_served_tokens_total", **labels)
    client = grpcclient.InferenceServerClient(frontend.grpc_url)
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            futures = [
                pool.submit(infer, client, req.inputs[0].data, headers={"x-api-key": KEYS[tenant]})
                for req in requests
            ]
            through = [f.result() for f in futures]
    finally:
        client.close()
    for req, got in zip(requests, through, strict=True):
        np.testing.assert_allclose(got, infer(direct, req.inputs[0].data), rtol=RTOL, atol=ATOL)
    tokens = sum(len(r) for r in rows)
    assert metric_sum(frontend, "fair_served_cost_total", **labels) - cost_before == tokens
    assert metric_sum(frontend, "fair_served_tokens_total", **labels) - tokens_before == tokens


def test_the_frontend_refuses_a_row_longer_than_the_models_max_model_len(
    frontend: RunningFrontend,
) -> None:
    client = grpcclient.InferenceServerClient(frontend.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            infer(client, np.ones((1, 513), dtype=np.int32), headers={"x-api-key": KEYS["acme"]})
    finally:
        client.close()
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "max_model_len" in str(info.value.message())


# ---- ONNX weights ----------------------------------------------------------------------------


class TinyCrossEncoder(nn.Module):
    """A cross-encoder with Hugging Face's signature, small enough to export in a test:
    token, position and (BERT-like) segment embeddings, one masked self-attention, the
    first position read by a linear head. ``segments=False``: RoBERTa-like, no
    ``token_type_ids``."""

    def __init__(self, segments: bool, vocab: int = nets.VOCAB_SIZE, d: int = 16) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(512, d)
        self.segments = nn.Embedding(2, d) if segments else None
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, 1)
        self.scale = d**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        width = input_ids.shape[1]
        x = self.tokens(input_ids) + self.positions(torch.arange(width).unsqueeze(0))
        if self.segments is not None:
            assert token_type_ids is not None
            x = x + 3.0 * self.segments(token_type_ids)  # large: a wrong segment shows
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = (q @ k.transpose(1, 2)) * self.scale
        weights = weights.masked_fill(attention_mask[:, None, :] == 0, float("-inf"))
        h = x + torch.softmax(weights, dim=-1) @ v
        return self.head(h[:, 0])


class BuiltinAsHuggingFace(nn.Module):
    """The builtin ``nets.CrossEncoder`` behind Hugging Face's signature."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nets.build_cross_encoder()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids, attention_mask.sum(dim=1)).unsqueeze(1)


def export_onnx(model: nn.Module, path: Path, inputs: int) -> Path:
    """``model`` to ONNX with dynamic batch and sequence (the torch.export-based exporter)."""
    names = ["input_ids", "attention_mask", "token_type_ids"][:inputs]
    # One tensor each: torch.export takes one tensor passed twice for one input.
    example = (
        torch.randint(0, nets.VOCAB_SIZE, (2, 7)),
        torch.ones((2, 7), dtype=torch.int64),
        torch.zeros((2, 7), dtype=torch.int64),
    )[:inputs]
    batch, width = torch.export.Dim("batch"), torch.export.Dim("sequence", max=512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on unused dynamic axis names
        torch.onnx.export(
            model.eval(),
            example,
            str(path),
            input_names=names,
            output_names=["logits"],
            dynamic_shapes=tuple({0: batch, 1: width} for _ in names),
            dynamo=True,
            verbose=False,
        )
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[nn.Module, Path]]:
    """Three exported cross-encoders: BERT-like (with segments), RoBERTa-like (without),
    and the builtin network itself."""
    out = tmp_path_factory.mktemp("onnx")
    torch.manual_seed(11)
    models: dict[str, tuple[nn.Module, int]] = {
        "bert": (TinyCrossEncoder(segments=True), 3),
        "roberta": (TinyCrossEncoder(segments=False), 2),
        "builtin": (BuiltinAsHuggingFace(), 2),
    }
    return {
        name: (model.eval(), export_onnx(model, out / f"{name}.onnx", inputs))
        for name, (model, inputs) in models.items()
    }


def onnx_model(path: Path, *, sep: bool = True) -> RerankModel:
    options = RerankOptions(
        weights=f"onnx:{path}", vocab_size=nets.VOCAB_SIZE, sep_token_id=SEP if sep else None
    )
    return RerankModel(options=options)


def reference(model: nn.Module, path: Path, query: str, document: str) -> tuple[float, float]:
    """One pair scored alone, unpadded, by torch and by onnxruntime, fed what a Hugging
    Face tokenizer gives (segments from the tokenizer's own type ids: an oracle independent
    of how the backend derives them)."""
    encoding = _TOK.encode(query, document)
    ids = torch.tensor([encoding.ids])
    feeds = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.tensor([encoding.type_ids]),
    }
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    with torch.inference_mode():
        torch_logit = float(model(*(feeds[n] for n in names))[0, 0])
    (logits,) = session.run(["logits"], {n: feeds[n].numpy() for n in names})
    return torch_logit, float(logits[0, 0])


@pytest.mark.parametrize("name", ["bert", "roberta", "builtin"])
def test_onnx_weights_score_as_the_exported_model_run_directly(
    exported: dict[str, tuple[nn.Module, Path]], name: str
) -> None:
    model, path = exported[name]
    backend = onnx_model(path)
    rows = pairs()
    batch, lengths = padded(rows)
    params = json.dumps(fair_rows(lengths))
    # One padded request of all pairs, and each pair alone in the same execute.
    together, *alone = [
        out[SCORE]
        for out in backend.run(
            [backend.decode(RequestData({"INPUT_IDS": batch}, params))]
            + [backend.decode(RequestData({"INPUT_IDS": r.reshape(1, -1)})) for r in rows]
        )
    ]
    for i, document in enumerate(DOCUMENTS):
        torch_logit, ort_logit = reference(model, path, QUERY, document)
        assert together[i, 0] == pytest.approx(torch_logit, rel=RTOL, abs=ATOL)
        assert together[i, 0] == pytest.approx(ort_logit, rel=RTOL, abs=ATOL)
        assert alone[i][0, 0] == pytest.approx(ort_logit, rel=RTOL, abs=ATOL)
    if name == "builtin":  # the same network, loaded either way, scores alike
        np.testing.assert_allclose(
            together, in_process(RerankModel(), batch, lengths=lengths)[0], rtol=RTOL, atol=ATOL
        )


def test_onnx_segments_are_read_from_the_first_sep(
    exported: dict[str, tuple[nn.Module, Path]],
) -> None:
    """The negative control of the oracle above: with every segment 0 the BERT-like model
    scores differently, so the equality there rests on the segments being right."""
    model, path = exported["bert"]
    encoding = _TOK.encode(QUERY, DOCUMENTS[0])
    ids = torch.tensor([encoding.ids])
    with torch.inference_mode():
        flat = float(model(ids, torch.ones_like(ids), torch.zeros_like(ids))[0, 0])
    right, _ = reference(model, path, QUERY, DOCUMENTS[0])
    assert abs(flat - right) > 1e-3


def test_onnx_weights_that_do_not_fit_fail_the_load(
    exported: dict[str, tuple[nn.Module, Path]], tmp_path: Path
) -> None:
    _, bert = exported["bert"]
    with pytest.raises(ValueError, match="set sep_token_id"):
        onnx_model(bert, sep=False)
    onnx_model(exported["roberta"][1], sep=False)  # no segments: no [SEP] needed
    with pytest.raises(ValueError, match="no such ONNX file"):
        onnx_model(tmp_path / "missing.onnx")

    class Renamed(nn.Module):
        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return (ids * mask).sum(dim=1, keepdim=True).float()

    wrong = tmp_path / "wrong.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Renamed(),
            (torch.ones((1, 3), dtype=torch.int64), torch.ones((1, 3), dtype=torch.int64)),
            str(wrong),
            input_names=["ids", "mask"],
            output_names=["logits"],
            dynamo=True,
            verbose=False,
        )
    with pytest.raises(ValueError, match="a cross-encoder takes input_ids, attention_mask"):
        onnx_model(wrong)


def test_rerank_config_parameters_are_checked_together() -> None:
    def options(**values: str) -> RerankOptions:
        params = {k: {"string_value": v} for k, v in values.items()}
        return RerankOptions.from_model_config({"parameters": params})

    assert options() == RerankOptions()
    got = options(weights="onnx:1/model.onnx", vocab_size="30522", sep_token_id="102")
    assert (got.onnx_path, got.vocab_size, got.sep_token_id) == ("1/model.onnx", 30522, 102)
    with pytest.raises(ValueError) as info:
        options(weights="onnx:", max_model_len="0", pad_token_id="x")
    for expected in ("names no file", "max_model_len=0 must be >= 1", "pad_token_id='x'"):
        assert expected in str(info.value)
    with pytest.raises(ValueError, match="vocab_size is required with onnx weights"):
        options(weights="onnx:m.onnx")
    with pytest.raises(ValueError) as info:
        options(weights="safetensors", vocab_size="100", max_model_len="5000")
    for expected in ("must be 'builtin' or 'onnx:<path>'", "vocabulary is 4096", "positions"):
        assert expected in str(info.value)


# ---- ONNX weights through Triton -----------------------------------------------------------


@pytest.fixture(scope="module")
def onnx_triton(
    exported: dict[str, tuple[nn.Module, Path]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedTriton]:
    """A Triton of its own serving ``rerank`` with the BERT-like ONNX weights, configured
    as an operator would: the shipped config with ``weights``, ``vocab_size`` and
    ``sep_token_id`` changed, the file in the model's directory."""
    repo = tmp_path_factory.mktemp("onnx-repo")
    shutil.copytree(REPO / "rerank", repo / "rerank")
    _, path = exported["bert"]
    for part in path.parent.glob(f"{path.name}*"):  # the model and any external data
        shutil.copy(part, repo / "rerank" / "1" / part.name)
    config_path = repo / "rerank" / "config.pbtxt"
    config = text_format.Parse(config_path.read_text(), model_config_pb2.ModelConfig())
    config.parameters["weights"].string_value = f"onnx:1/{path.name}"
    config.parameters["vocab_size"].string_value = str(nets.VOCAB_SIZE)
    config.parameters["sep_token_id"].string_value = str(SEP)
    config_path.write_text(text_format.MessageToString(config))
    server = EmbeddedTriton(repo)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_onnx_weights_through_triton(
    onnx_triton: EmbeddedTriton, exported: dict[str, tuple[nn.Module, Path]]
) -> None:
    model, path = exported["bert"]
    client = grpcclient.InferenceServerClient(onnx_triton.grpc_url)
    try:
        batch, lengths = padded(pairs())
        scores = infer(client, batch, parameters=fair_rows(lengths))
    finally:
        client.close()
    for i, document in enumerate(DOCUMENTS):
        torch_logit, _ = reference(model, path, QUERY, document)
        assert scores[i, 0] == pytest.approx(torch_logit, rel=RTOL, abs=ATOL)
