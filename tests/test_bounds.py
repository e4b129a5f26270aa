"""What one request may take (``models.RequestBounds``), the checks made before a tensor is
converted (``models.check_declared``), prompts refused before they are tokenised
(``models.prompt_texts``, ``tokens.max_token_bytes``), and tokenising off the event loop
in tenants' turns (``tokens.TokenCounter``). Unit tests: the shipped models' own
configurations and tokenizer, no server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from fair_frontend.backends.triton.model_config import model_info
from fair_frontend.config import WIRE_FRAMING_BYTES, Endpoint
from fair_frontend.errors import InvalidArgument
from fair_frontend.models import (
    WIRE_ELEMENT_BYTES,
    WIRE_NESTING_BYTES,
    ModelInfo,
    check_declared,
    prompt_texts,
    validate,
)
from fair_frontend.protocol import Declared, InferRequest, Tensor
from fair_frontend.tokens import (
    TokenCounter,
    _max_token_bytes,
    load_tokenizer,
    max_token_bytes,
)
from tests.support import ROOT, TEST_MODEL_REPOSITORY, make_config, planned

MODELS = ROOT / "model_repository"
TOKENIZER = str(MODELS / "llm" / "tokenizer.json")
CONTEXT = 512  # the llm's max_model_len (its config.pbtxt)
LONGEST_TOKEN = 32  # bytes of the shipped tokenizer's longest token


def model(path: Path) -> ModelInfo:
    cfg = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    return model_info(cfg)


@pytest.fixture(scope="module")
def llm() -> tuple[ModelInfo, Endpoint]:
    return model(MODELS / "llm" / "config.pbtxt"), make_config().endpoint("llm")


def prompt(text: bytes, name: str = "text_input") -> InferRequest:
    data = np.empty(1, dtype=object)
    data[0] = text
    return InferRequest("llm", inputs=[Tensor(name, "BYTES", (1,), data)])


# ---- the bound, from the model -------------------------------------------------------------


def test_the_shipped_tokenizers_longest_token() -> None:
    assert max_token_bytes(TOKENIZER) == LONGEST_TOKEN
    vocab = load_tokenizer(TOKENIZER).get_vocab()
    assert max(len(t) for t in vocab) == LONGEST_TOKEN  # byte-level: a byte a character


def test_llm_bound_follows_its_context_and_tokenizer(llm: tuple[ModelInfo, Endpoint]) -> None:
    """Six inputs of one element: two texts of at most CONTEXT x LONGEST_TOKEN bytes, four
    booleans; no batching. The configured ceiling (64 MiB, 129 MiB on the wire) is what a
    model of unknown size gets: this one gets a thousandth of it."""
    info, endpoint = llm
    bounds = info.bounds(endpoint)
    text = CONTEXT * LONGEST_TOKEN
    assert (bounds.derived, bounds.max_model_len, bounds.max_token_bytes) == (True, 512, 32)
    assert bounds.payload_bytes == 2 * (4 + text) + 4 * 1
    assert bounds.wire_bytes == (
        2 * (6 * text + 4 + WIRE_NESTING_BYTES)
        + 4 * (WIRE_ELEMENT_BYTES["BOOL"] + WIRE_NESTING_BYTES)
        + WIRE_FRAMING_BYTES
    )
    assert bounds.wire_bytes < endpoint.max_wire_bytes // 100


def test_fixed_dims_bound_is_batch_times_dims_times_element() -> None:
    """``simple``: INT32 INPUT0, INPUT1 [16], max_batch_size 8."""
    info = model(TEST_MODEL_REPOSITORY / "simple" / "config.pbtxt")
    bounds = info.bounds(Endpoint())
    assert bounds.derived
    assert bounds.payload_bytes == 2 * 8 * 16 * 4
    per_element = WIRE_ELEMENT_BYTES["INT32"] + 2 * WIRE_NESTING_BYTES
    assert bounds.wire_bytes == 2 * 8 * 16 * per_element + WIRE_FRAMING_BYTES


@pytest.mark.parametrize("name", ["embed", "generate"])
def test_variable_dims_get_the_configured_bound(name: str) -> None:
    info = model(MODELS / name / "config.pbtxt")
    endpoint = make_config().endpoint(name)
    bounds = info.bounds(endpoint)
    assert not bounds.derived
    assert (bounds.payload_bytes, bounds.wire_bytes) == (64 << 20, endpoint.max_wire_bytes)


def test_the_operators_max_request_bytes_is_the_bound(llm: tuple[ModelInfo, Endpoint]) -> None:
    info, endpoint = llm
    mine = endpoint.model_copy(update={"max_request_bytes": 64 << 20})
    bounds = info.bounds(mine)
    assert not bounds.derived
    assert bounds.wire_bytes == 2 * (64 << 20) + WIRE_FRAMING_BYTES
    # Still known: the prompt is refused from its bytes all the same.
    assert (bounds.max_model_len, bounds.max_token_bytes) == (CONTEXT, LONGEST_TOKEN)


def test_bounds_are_computed_once_per_endpoint_policy(llm: tuple[ModelInfo, Endpoint]) -> None:
    info, endpoint = llm
    assert info.bounds(endpoint) is info.bounds(endpoint)
    reloaded = endpoint.model_copy(update={"max_model_len": 64})
    assert info.bounds(reloaded).max_model_len == 64
    assert info.bounds(endpoint).max_model_len == CONTEXT


# ---- before a tensor is converted ----------------------------------------------------------


@pytest.mark.parametrize(
    ("inputs", "says"),
    [
        ([("INPUT0", "INT32", (1, 16)), ("NOPE", "INT32", (1, 16))], "unexpected inference input"),
        ([("INPUT0", "INT32", (1, 16))], "missing required input(s) ['INPUT1']"),
        ([("INPUT0", "FP32", (1, 16)), ("INPUT1", "INT32", (1, 16))], "data-type is 'FP32'"),
        ([("INPUT0", "INT32", (1, 8)), ("INPUT1", "INT32", (1, 16))], "unexpected shape"),
        ([("INPUT0", "INT32", (2, 16)), ("INPUT1", "INT32", (1, 16))], "batch size 1"),
        ([("INPUT0", "INT32", (9, 16)), ("INPUT1", "INT32", (9, 16))], "batch-size must be <= 8"),
    ],
)
def test_check_declared_says_what_validate_says(
    inputs: list[tuple[str, str, tuple[int, ...]]], says: str
) -> None:
    """The same message before conversion (from the shapes alone) as after."""
    info = model(TEST_MODEL_REPOSITORY / "simple" / "config.pbtxt")
    declared = [Declared(n, d, s) for n, d, s in inputs]
    with pytest.raises(InvalidArgument) as before:
        check_declared(info, Endpoint(), InferRequest("simple"), declared)
    tensors = [Tensor(n, d, s, np.zeros(s, dtype=np.int32)) for n, d, s in inputs]
    with pytest.raises(InvalidArgument) as after:
        validate(InferRequest("simple", inputs=tensors), planned(info))
    assert before.value.message == after.value.message
    assert says in before.value.message


def test_check_declared_refuses_more_than_the_model_takes_before_conversion() -> None:
    """Declared sizes over the model's payload bound: refused from the shapes."""
    info = model(TEST_MODEL_REPOSITORY / "simple_identity" / "config.pbtxt")  # BYTES [-1]
    endpoint = Endpoint(max_request_bytes=1000)
    with pytest.raises(InvalidArgument, match="request too large: 4000 bytes"):
        check_declared(
            info,
            endpoint,
            InferRequest("simple_identity"),
            [Declared("INPUT0", "BYTES", (1, 1000))],
        )


# ---- prompts: refused from their bytes, and text that is not UTF-8 ----------------------------


def test_a_prompt_its_bytes_prove_too_long_is_refused_without_tokenising(
    llm: tuple[ModelInfo, Endpoint],
) -> None:
    info, endpoint = llm
    fits = CONTEXT * LONGEST_TOKEN  # could still be CONTEXT tokens: must be counted
    assert prompt_texts(prompt(b"a" * fits), info, endpoint) == ["a" * fits]
    with pytest.raises(InvalidArgument) as err:
        prompt_texts(prompt(b"a" * (fits + 1)), info, endpoint)
    assert "text_input" in err.value.message
    assert f"at least {CONTEXT + 1} tokens" in err.value.message
    assert f"is {CONTEXT} tokens (max_model_len)" in err.value.message


def test_a_prompt_longer_than_the_context_once_counted_is_refused(
    llm: tuple[ModelInfo, Endpoint],
) -> None:
    """Within the bytes' bound, over the context once counted (a token per "é " pair)."""
    info, endpoint = llm
    text = "é " * 2000
    with pytest.raises(InvalidArgument, match=r"the prompt has [0-9]+ tokens"):
        validate(prompt(text.encode()), planned(info, endpoint))


def test_text_that_is_not_utf8_is_refused_naming_the_input(
    llm: tuple[ModelInfo, Endpoint],
) -> None:
    info, endpoint = llm
    # A lone surrogate as UTF-8 would have it (Python's "surrogatepass"), and a stray byte.
    for text in ("\ud800".encode("utf-8", "surrogatepass"), b"ok \xff"):
        with pytest.raises(InvalidArgument, match="input 'text_input' is not valid UTF-8"):
            prompt_texts(prompt(text), info, endpoint)


@pytest.mark.parametrize(
    ("change", "bound"),
    [
        ({}, 7),
        ({"normalizer": {"type": "NFC"}}, None),  # may compose several characters into one
        ({"pre_tokenizer": {"type": "Whitespace"}}, None),  # drops whitespace
        ({"added_tokens": [{"content": "<|a long special token|>"}]}, 24),
        ({"model": {"type": "BPE", "vocab": {"ab": 0}, "unk_token": "?", "fuse_unk": True}}, None),
        ({"model": {"type": "WordPiece", "vocab": {"ab": 0}}}, 400),  # a word of 100 -> [UNK]
        ({"model": {"type": "WordLevel", "vocab": {"ab": 0}}}, None),
    ],
)
def test_max_token_bytes_only_where_it_bounds_every_text(
    change: dict[str, Any], bound: int | None
) -> None:
    doc: dict[str, Any] = {
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": {"abc": 0, "ĠĠĠĠĠĠĠ": 1}},
        "added_tokens": [],
    }
    doc.update(change)
    assert _max_token_bytes(json.loads(json.dumps(doc))) == bound


# ---- tokenising off the event loop, in tenants' turns ---------------------------------------


async def test_one_tenants_long_prompts_do_not_hold_the_pool_for_another() -> None:
    """Tenant A queues four long prompts (a piece each), then tenant B one shorter: A's
    first two run on the pool's two threads (nobody else waits), B's goes to the first
    thread that frees, before A's third and fourth; it is done before A's third. Small
    texts are counted inline. (The order piece by piece: ``tests/test_tokenize_pool.py``.)"""
    counter = TokenCounter(threads=2)
    done: list[str] = []

    async def count(tenant: str, label: str, size: int) -> list[int]:
        counts = await counter.count(tenant, TOKENIZER, ["the prompt " * (size // 11)])
        done.append(label)
        return counts

    try:
        hog = [asyncio.ensure_future(count("a", f"a{i}", 128 << 10)) for i in range(4)]
        await asyncio.sleep(0)  # A's first two are on the threads, the rest wait
        other = await count("b", "b", 32 << 10)
        assert other[0] > 0
        assert done.index("b") <= 2  # after A's first two at most: not after all four
        await asyncio.gather(*hog)
        assert sorted(done) == ["a0", "a1", "a2", "a3", "b"]
        assert len(counter) == 0  # no piece left behind
        assert await counter.count("c", TOKENIZER, ["hi"]) == [1]  # inline
    finally:
        counter.close()
