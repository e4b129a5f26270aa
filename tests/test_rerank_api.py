"""The rerank APIs' translation (``fair_frontend.shell.api.rerank``): parsing Cohere's and
Jina's/vLLM's bodies, joining query and documents into token rows with the shipped
``rerank`` tokenizer, the KServe request per row, and the responses, which Cohere's own SDK
types must accept. Pure functions: no server here (``test_rerank_model`` runs the model)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cohere.core.unchecked_base_model import construct_type
from cohere.v2.types import V2RerankResponse
from hypothesis import example, given
from hypothesis import strategies as st

from fair_frontend.errors import Internal, InvalidArgument
from fair_frontend.protocol import InferResponse, Tensor
from fair_frontend.shell.api.rerank import (
    MAX_PROBLEMS,
    RerankCall,
    cohere_response,
    jina_response,
    pair_rows,
    parse_cohere,
    parse_jina,
    ranking,
    relevance,
    row_logit,
    row_request,
)
from fair_frontend.tokens import load_tokenizer, max_token_bytes
from python_backend import tokenizer as tokenizer_module

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = str(ROOT / "model_repository" / "rerank" / "tokenizer.json")
LLM_TOKENIZER = ROOT / "model_repository" / "llm" / "tokenizer.json"
_TOK = load_tokenizer(TOKENIZER)
CLS, SEP = _TOK.token_to_id("[CLS]"), _TOK.token_to_id("[SEP]")


def cohere(**fields: Any) -> dict[str, Any]:
    return {"model": "rerank-v3.5", "query": "what is fair", "documents": ["a", "b"], **fields}


def jina(**fields: Any) -> dict[str, Any]:
    return {"query": "what is fair", "documents": ["a", "b"], **fields}


# ---- parsing ------------------------------------------------------------------------------


def test_a_cohere_body_as_the_sdk_sends_it() -> None:
    call = parse_cohere(
        json.dumps(cohere(documents=["x", {"text": "y", "title": "ignored"}], top_n=1)).encode()
    )
    assert call == RerankCall(
        model="rerank-v3.5",
        query="what is fair",
        documents=["x", "y"],
        top_n=1,
        max_tokens_per_doc=None,
        return_documents=False,
        priority=None,
    )
    # Absent top_n: every document; past the count: clamped; unknown fields ignored.
    assert parse_cohere(cohere()).top_n == 2
    assert parse_cohere(cohere(top_n=10**30, something_new=True)).top_n == 2
    assert parse_cohere(cohere(max_tokens_per_doc=10**30)).max_tokens_per_doc == 10**30
    assert parse_cohere(cohere(relevant_spans={"mode": "disabled"})).top_n == 2


def test_a_jina_or_vllm_body() -> None:
    call = parse_jina(jina())
    assert (call.model, call.top_n, call.return_documents) == (None, 2, True)
    assert parse_jina(jina(top_n=0)).top_n == 2  # vLLM's default: all
    assert parse_jina(jina(top_n=1, return_documents=False, model="m")).return_documents is False
    assert parse_jina(jina(documents=[{"text": "t"}])).documents == ["t"]


BAD_COHERE = [
    (b"{", "not valid JSON"),
    (b"[1]", "must be a JSON object"),
    ([1], "must be a JSON object"),
    ({"query": "q", "documents": ["a"]}, "model is required"),
    (cohere(query=""), "query must not be empty"),
    (cohere(query=7), "query: input should be a valid string"),
    (cohere(documents=[]), "documents must hold at least one document"),
    (cohere(documents="a"), "documents: input should be a valid list"),
    (cohere(documents=["a", 3]), "documents[1] must be a string, or an object with"),
    (cohere(documents=[{"text": 3}]), "documents[0] must be a string, or an object with"),
    (cohere(top_n=0), "top_n must be at least 1, got 0"),
    (cohere(top_n=-(10**30)), "top_n must be at least 1"),
    (cohere(top_n="3"), "top_n: input should be a valid integer"),
    (cohere(top_n=True), "top_n: input should be a valid integer"),
    (cohere(top_n=2.0), "top_n: input should be a valid integer"),
    (cohere(max_tokens_per_doc=0), "max_tokens_per_doc must be at least 1, got 0"),
    (cohere(priority=-1), "priority must be between 0 and"),
    (cohere(priority=2**63), "priority must be between 0 and"),
    (cohere(relevant_spans={"mode": "enabled"}), "relevant_spans: not supported"),
    (cohere(relevant_spans={"mode": "maybe"}), "relevant_spans.mode: input should be"),
]


@pytest.mark.parametrize(("body", "expected"), BAD_COHERE)
def test_a_bad_cohere_body_is_refused_naming_the_field(body: Any, expected: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_cohere(body)
    assert expected in info.value.message
    assert info.value.http_status == 400


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (jina(top_n=-1), "top_n must be 0 (all) or more, got -1"),
        (jina(return_documents="yes"), "return_documents: input should be a valid boolean"),
        (jina(model=5), "model: input should be a valid string"),
        ({"documents": ["a"]}, "query is required"),
    ],
)
def test_a_bad_jina_body_is_refused_naming_the_field(body: Any, expected: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_jina(body)
    assert expected in info.value.message


def test_the_document_count_is_bounded_and_the_bound_is_the_callers() -> None:
    parse_cohere(cohere(documents=["d"] * 10_000))
    with pytest.raises(InvalidArgument, match="10001 documents; at most 10000 per call"):
        parse_cohere(cohere(documents=["d"] * 10_001))
    with pytest.raises(InvalidArgument, match="4 documents; at most 3 per call"):
        parse_jina(jina(documents=["d"] * 4), max_documents=3)


def test_many_malformed_documents_make_one_short_message() -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_cohere(cohere(documents=[1] * 10_000))
    message = info.value.message
    assert message.count("documents[") == MAX_PROBLEMS
    assert message.endswith(f"and {10_000 - MAX_PROBLEMS} more")


# ---- token rows ---------------------------------------------------------------------------


def test_the_rerank_tokenizer_is_the_llm_one_with_a_pair_template() -> None:
    rebuilt = tokenizer_module.cross_encoder(tokenizer_module.load(LLM_TOKENIZER))
    assert rebuilt.to_str() == _TOK.to_str()
    llm = tokenizer_module.load(LLM_TOKENIZER)
    assert llm.get_vocab_size() == CLS and CLS + 1 == SEP
    text = "Deficit round robin serves tenants"
    assert _TOK.encode(text, add_special_tokens=False).ids == llm.encode(text).ids


def test_a_row_is_cls_query_sep_document_sep() -> None:
    query, document = "what is fair scheduling", "Deficit round robin serves tenants"
    (row,) = pair_rows(TOKENIZER, query, [document], None, 512)
    q = _TOK.encode(query, add_special_tokens=False).ids
    d = _TOK.encode(document, add_special_tokens=False).ids
    assert row.dtype == np.int32
    assert row.tolist() == [CLS, *q, SEP, *d, SEP]
    # The tokenizer's own pair encoding agrees (what a Hugging Face client would send).
    assert row.tolist() == _TOK.encode(query, document).ids


def test_special_tokens_in_a_clients_text_are_plain_text() -> None:
    rows = pair_rows(TOKENIZER, "q [SEP] q", ["[CLS] d [SEP] d", "[SEP]"], None, 512)
    for row in rows:
        assert row.tolist().count(SEP) == 2 and row.tolist().count(CLS) == 1
    # The shared tokenizer (token counts) is left as it was.
    assert load_tokenizer(TOKENIZER).encode_special_tokens is False


def test_documents_are_cut_to_max_tokens_per_doc_and_to_the_row() -> None:
    query = "fair"
    q = len(_TOK.encode(query, add_special_tokens=False).ids)
    long = "tenant " * 400  # 400+ tokens
    rows = pair_rows(TOKENIZER, query, [long, "short"], 10, 512)
    assert len(rows[0]) == 3 + q + 10
    assert len(rows[1]) == len(pair_rows(TOKENIZER, query, ["short"], None, 512)[0])
    (row,) = pair_rows(TOKENIZER, query, [long], None, 64)
    assert len(row) == 64 and row[-1] == SEP


def test_a_query_that_leaves_no_room_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"query: \d+ tokens; .* at most 60"):
        pair_rows(TOKENIZER, "fair " * 100, ["d"], None, 64)
    # So long that its bytes prove it: refused without tokenising it.
    widest = max_token_bytes(TOKENIZER)
    assert widest is not None
    with pytest.raises(InvalidArgument, match=r"query: at least \d+ tokens"):
        pair_rows(TOKENIZER, "x" * (64 * widest), ["d"], None, 64)


def test_text_that_is_not_unicode_is_refused_naming_it() -> None:
    lone = json.loads('"a\\ud800b"')  # JSON can spell a lone surrogate; UTF-8 cannot
    with pytest.raises(InvalidArgument, match=r"documents\[1\] is not valid Unicode"):
        pair_rows(TOKENIZER, "q", ["ok", lone], None, 512)
    with pytest.raises(InvalidArgument, match="query is not valid Unicode"):
        pair_rows(TOKENIZER, lone, ["ok"], None, 512)


TEXT = st.text(st.characters(codec="utf-8"), max_size=300)


@given(
    query=TEXT.filter(lambda q: len(q) < 100),
    documents=st.lists(TEXT, min_size=1, max_size=4),
    per_doc=st.none() | st.integers(1, 300),
    max_row=st.integers(120, 512),
)
@example(query="q", documents=["x" * 5000], per_doc=1, max_row=120)
def test_rows_keep_their_bounds_and_the_texts_prefixes(
    query: str, documents: list[str], per_doc: int | None, max_row: int
) -> None:
    """Every row: ``[CLS] query [SEP] document [SEP]`` within ``max_row`` tokens, the
    document cut to ``per_doc``; its kept part is the start of the document's own tokens
    (exactly, unless the document was so long that it was cut as text first, when it keeps
    exactly as many tokens as it has room for)."""
    q = _TOK.encode(query, add_special_tokens=False).ids
    if len(q) >= max_row - 3:
        with pytest.raises(InvalidArgument):
            pair_rows(TOKENIZER, query, documents, per_doc, max_row)
        return
    rows = pair_rows(TOKENIZER, query, documents, per_doc, max_row)
    assert len(rows) == len(documents)
    room = max_row - 3 - len(q)
    limit = room if per_doc is None else min(room, per_doc)
    widest = max_token_bytes(TOKENIZER)
    assert widest is not None
    for row, document in zip(rows, documents, strict=True):
        ids = row.tolist()
        assert len(ids) <= max_row
        assert ids[: len(q) + 2] == [CLS, *q, SEP] and ids[-1] == SEP
        kept = ids[len(q) + 2 : -1]
        assert len(kept) <= limit
        full = _TOK.encode(document, add_special_tokens=False).ids
        if len(document) <= (limit + 1) * widest:
            assert kept == full[:limit]
        else:
            assert len(kept) == limit


# ---- KServe requests and answers ---------------------------------------------------------


def test_one_request_per_row_for_the_rerank_model() -> None:
    row = np.array([CLS, 5, SEP, 6, SEP], dtype=np.int64)
    req = row_request(row, request_id="r-1", priority=2, timeout_us=5_000_000)
    assert (req.model, req.id, req.priority, req.timeout_us) == ("rerank", "r-1", 2, 5_000_000)
    (ids,) = req.inputs
    assert (ids.name, ids.datatype, ids.shape) == ("INPUT_IDS", "INT32", (1, 5))
    assert ids.data.dtype == np.int32 and ids.data.tolist() == [row.tolist()]
    assert [o.name for o in req.outputs] == ["SCORE"]
    assert req.nbytes == 5 * 4


def answer(*outputs: Tensor) -> InferResponse:
    return InferResponse(model="rerank", version="1", id="", outputs=list(outputs))


def score(value: float) -> Tensor:
    return Tensor("SCORE", "FP32", (1, 1), np.array([[value]], dtype=np.float32))


def test_the_logit_is_read_from_the_answer() -> None:
    assert row_logit(answer(score(-1.5))) == -1.5
    with pytest.raises(Internal, match="no single SCORE"):
        row_logit(answer())
    with pytest.raises(Internal, match="not finite"):
        row_logit(answer(score(math.nan)))


@given(st.floats(allow_nan=False, allow_infinity=False), st.floats(-50, 50))
def test_relevance_is_a_sigmoid_in_the_unit_interval(logit: float, other: float) -> None:
    value = relevance(logit)
    assert 0.0 <= value <= 1.0
    assert math.isclose(relevance(-logit), 1.0 - value, abs_tol=1e-12)
    if logit < other:
        assert relevance(logit) <= relevance(other)
    assert relevance(0.0) == 0.5


@given(st.lists(st.integers(-3, 3).map(float), max_size=30), st.integers(0, 40))
def test_the_ranking_is_by_logit_then_document_order(logits: list[float], top_n: int) -> None:
    order = ranking(logits, top_n)
    assert len(order) == min(top_n, len(logits))
    full = ranking(logits, len(logits))
    assert sorted(full) == list(range(len(logits)))
    assert order == full[: len(order)]
    for a, b in itertools.pairwise(full):
        assert logits[a] > logits[b] or (logits[a] == logits[b] and a < b)


def test_the_cohere_response_is_what_cohere_s_sdk_reads() -> None:
    call = parse_cohere(cohere(documents=[f"d{i}" for i in range(250)], top_n=3))
    logits = [float(i % 7) - 3.0 for i in range(250)]
    body = cohere_response(call, logits, input_tokens=4321, response_id="r-9")
    wire = json.loads(json.dumps(body, allow_nan=False))  # as a route sends it
    # Validated against the SDK's pydantic types (as the SDK's own parsing does unchecked).
    parsed = V2RerankResponse.model_validate(wire)
    assert construct_type(type_=V2RerankResponse, object_=wire) == parsed
    assert parsed.id == "r-9"
    assert [r.index for r in parsed.results] == [6, 13, 20]  # logit 3.0, document order
    assert all(r.relevance_score == relevance(3.0) for r in parsed.results)
    assert parsed.meta is not None
    assert parsed.meta.api_version is not None and parsed.meta.api_version.version == "2"
    assert parsed.meta.billed_units is not None
    assert parsed.meta.billed_units.search_units == 3  # 250 documents: 3 units of 100
    assert parsed.meta.tokens is not None and parsed.meta.tokens.input_tokens == 4321
    assert set(wire) == {"id", "results", "meta"}
    assert all(set(r) == {"index", "relevance_score"} for r in wire["results"])
    with pytest.raises(Internal, match="2 scores for 250 documents"):
        cohere_response(call, [0.0, 1.0], 1)


def test_the_jina_response_carries_documents_when_asked() -> None:
    call = parse_jina(jina(documents=["low", "high", "mid"], top_n=2, model="jina-reranker"))
    body = jina_response(call, [-1.0, 2.0, 0.5], total_tokens=30, response_id="r-1")
    assert body == {
        "id": "r-1",
        "model": "jina-reranker",
        "usage": {"total_tokens": 30},
        "results": [
            {"index": 1, "relevance_score": relevance(2.0), "document": {"text": "high"}},
            {"index": 2, "relevance_score": relevance(0.5), "document": {"text": "mid"}},
        ],
    }
    bare = parse_jina(jina(documents=["a"], return_documents=False))
    out = jina_response(bare, [0.0], total_tokens=5)
    assert out["model"] == "rerank" and out["results"] == [{"index": 0, "relevance_score": 0.5}]
    assert out["id"] != jina_response(bare, [0.0], total_tokens=5)["id"]
