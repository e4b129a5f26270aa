"""The API routes' bodies read from their bytes (``fair_frontend.shell.api.body`` behind
``decode_chat``, ``decode_completion``, ``decode_embeddings``, ``decode_cohere`` and
``decode_jina``): the same requests and refusals as ``json.loads`` and the checks over its
dicts (``tests.api_oracle``, the code as it was) on any body; arrays refused over their
bounds before their elements exist; errors bounded and naming the field; lone surrogates
refused naming the field; the memory a hostile body costs, measured with tracemalloc as a
multiple of its bytes. Last, each route against a real frontend: a lone surrogate is a
400 naming the field, logged as a refused request (raw HTTP: neither the ``openai`` nor
the ``cohere`` SDK can send one, as the first test shows).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
import tracemalloc
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fair_frontend.errors import InvalidArgument
from fair_frontend.kit.testing import eventually
from fair_frontend.observability.logs import REQUEST_LOGGER
from fair_frontend.shell.api import openai, rerank
from fair_frontend.shell.json_tensor import WINDOW
from tests import api_oracle as oracle
from tests.support import KEYS, RunningFrontend, make_config, metric_sum

CONFIG = make_config()
SERVICE = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- bodies -----------------------------------------------------------------------------------

# Text as clients send it: any code point but a surrogate (those are tested on their own),
# quotes, backslashes and brackets among them.
TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from('ab "\\[]{},:-0u'), st.characters(blacklist_categories=["Cs"])
    ),
    max_size=8,
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    TEXT,
)
# Any JSON value: what a malformed field may hold.
ANY = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=2),
    max_leaves=6,
)


@st.composite
def encoded(draw: st.DrawFn, doc: Any) -> bytes:
    """``doc`` as JSON, as some client might write it: ASCII or UTF-8, compact or not."""
    ascii_only = draw(st.booleans())
    indent = draw(st.sampled_from([None, None, 0, 2]))
    separators = draw(st.sampled_from([None, (",", ":"), (" , ", " : ")]))
    return json.dumps(doc, ensure_ascii=ascii_only, indent=indent, separators=separators).encode()


@st.composite
def document(
    draw: st.DrawFn,
    valid: dict[str, st.SearchStrategy[Any]],
    required: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """A JSON object of the fields in ``valid``: each absent or present, and at most two of
    them (or none, half the time) holding any JSON value in place of a valid one; with
    fields no API defines beside them."""
    names = sorted(valid)
    bad = draw(st.sets(st.sampled_from(names), max_size=2)) if draw(st.booleans()) else set()
    doc: dict[str, Any] = {}
    for name in names:
        if name in required or draw(st.booleans()):
            doc[name] = draw(ANY if name in bad else valid[name])
    for name in draw(st.lists(st.sampled_from(["name", "metadata", "x_extra"]), max_size=2)):
        doc[name] = draw(ANY)
    return doc


PART = document({"type": st.just("text"), "text": TEXT}, frozenset({"type", "text"}))
MESSAGE = document(
    {
        "role": st.sampled_from(sorted(openai.ROLES)),
        "content": st.one_of(st.none(), TEXT, st.lists(PART, max_size=3)),
    },
    frozenset({"role"}),
)
GENERATION = {
    "model": st.sampled_from(["llm", "m"]),
    "max_tokens": st.integers(1, 100),
    "n": st.just(1),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.just(0),
    "logit_bias": st.just({}),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "user": TEXT,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "service_tier": st.sampled_from(openai.SERVICE_TIERS),
    "priority": st.integers(-3, 10),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5)),
}
CHAT = document(
    {
        **GENERATION,
        "messages": st.lists(MESSAGE, min_size=1, max_size=4),
        "tools": st.just([]),
        "functions": st.just([]),
        "tool_choice": st.just("none"),
        "response_format": st.fixed_dictionaries({"type": st.just("text")}),
        "logprobs": st.sampled_from([False, 0]),
        "top_logprobs": st.just(0),
        "max_completion_tokens": st.integers(1, 100),
    },
    frozenset({"model", "messages"}),
)
COMPLETION = document(
    {
        **GENERATION,
        "prompt": st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=1)),
        "echo": st.just(False),
        "best_of": st.just(1),
        "logprobs": st.just(0),
        "suffix": st.just(""),
    },
    frozenset({"model", "prompt"}),
)
IDS = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5)
EMBEDDINGS = document(
    {
        "model": st.just("embed"),
        "input": st.one_of(
            TEXT,
            st.lists(TEXT, min_size=1, max_size=4),
            IDS,
            st.lists(IDS, min_size=1, max_size=3),
            # near misses: out of range, mixed kinds
            st.lists(
                st.one_of(st.integers(-2, 2**32), st.booleans(), TEXT), min_size=1, max_size=3
            ),
            st.lists(st.lists(st.integers(-1, 2**31), max_size=2), min_size=1, max_size=2),
        ),
        "encoding_format": st.sampled_from(["float", "base64"]),
        "dimensions": st.integers(1, 2**31 - 1),
        "user": TEXT,
    },
    frozenset({"model", "input"}),
)
DOCUMENTS = st.lists(
    st.one_of(TEXT, document({"text": TEXT, "title": TEXT}, frozenset({"text"}))),
    max_size=4,
)
COHERE = document(
    {
        "model": TEXT,
        "query": TEXT,
        "documents": DOCUMENTS,
        "top_n": st.integers(-2, 2**64),
        "max_tokens_per_doc": st.integers(-1, 2**64),
        "priority": st.integers(-1, 2**64),
        "relevant_spans": document(
            {"mode": st.sampled_from(["enabled", "disabled"])}, frozenset({"mode"})
        ),
    },
    frozenset({"model", "query", "documents"}),
)
JINA = document(
    {
        "model": TEXT,
        "query": TEXT,
        "documents": DOCUMENTS,
        "top_n": st.integers(-1, 10),
        "return_documents": st.booleans(),
        "priority": st.integers(-1, 2**64),
    },
    frozenset({"query", "documents"}),
)
HEADERS = st.one_of(
    st.just({}), st.builds(lambda v: {"x-priority": v}, st.sampled_from(["1", " 3 ", "x", "-2"]))
)


def outcome(decode: Callable[[], Any]) -> tuple[Any, ...]:
    """What a decoder made of a body: the request (its fields; a generation's id and
    time aside), the refusal (its class, param, message and code), or the crash (the old
    checks crash on some bodies: a role that is a list, say)."""
    try:
        made = decode()
    except InvalidArgument as err:
        return ("refused", type(err).__name__, getattr(err, "param", None), err.message,
                getattr(err, "code", None))  # fmt: skip
    except Exception as err:  # what the old checks did, to compare
        return ("crashed", type(err).__name__)
    fields = dataclasses.asdict(made)
    fields.pop("id", None)
    fields.pop("created", None)
    ids = fields.get("ids")
    if ids is not None:  # int32 arrays now, lists of ints before
        assert all(isinstance(r, list) or r.dtype == np.int32 for r in ids)
        fields["ids"] = [r if isinstance(r, list) else r.tolist() for r in ids]
    return ("made", fields)


def agree(new: tuple[Any, ...], old: tuple[Any, ...]) -> None:
    """The same request or refusal; where the old checks crashed (a 500), a refusal."""
    assert new[0] != "crashed", new
    if old[0] == "crashed":
        assert new[0] == "refused", (new, old)
    else:
        assert new == old


# ---- the same as json.loads and the old checks ----------------------------------------------


@SERVICE
@given(data=st.data(), headers=HEADERS)
def test_chat_bodies_decode_as_json_loads_and_the_old_checks(
    data: st.DataObject, headers: dict[str, str]
) -> None:
    raw = data.draw(encoded(data.draw(CHAT)))
    new = outcome(lambda: openai.decode_chat(raw, headers, CONFIG))
    old = outcome(lambda: oracle.chat_request(oracle.parse_body(raw), headers, CONFIG))
    agree(new, old)


@SERVICE
@given(data=st.data(), headers=HEADERS)
def test_completion_bodies_decode_as_json_loads_and_the_old_checks(
    data: st.DataObject, headers: dict[str, str]
) -> None:
    raw = data.draw(encoded(data.draw(COMPLETION)))
    new = outcome(lambda: openai.decode_completion(raw, headers, CONFIG))
    old = outcome(lambda: oracle.completion_request(oracle.parse_body(raw), headers, CONFIG))
    agree(new, old)


@SERVICE
@given(data=st.data())
@example(data=None)
def test_embeddings_bodies_decode_as_json_loads_and_the_old_checks(data: Any) -> None:
    if data is None:  # the shapes of "input" one by one
        inputs: tuple[object, ...] = (
            "",
            "x",
            ["a", ""],
            [0, 2**31 - 1],
            [[1], [2, 3]],
            [-1],
            [2**31],
            [2**64],
            [True],
            [1.0],
            [[1], "x"],
            [[]],
            [["a"]],
            [1, [2]],
            {},
            [{}],
            [None],
            None,
        )
        bodies = [json.dumps({"model": "embed", "input": value}).encode() for value in inputs] + [
            b'{"model": "embed", "input": [-0, 0]}',
            b'{"model": "embed", "input": [[-0]]}',
        ]
    else:
        bodies = [data.draw(encoded(data.draw(EMBEDDINGS)))]
    for raw in bodies:

        def decoded(r: bytes = raw) -> Any:
            return openai.decode_embeddings(r)

        def checked(r: bytes = raw) -> Any:
            return oracle.embeddings_request(oracle.parse_body(r))

        agree(outcome(decoded), outcome(checked))


@SERVICE
@given(data=st.data())
def test_rerank_bodies_decode_as_the_routes_did(data: st.DataObject) -> None:
    """As the routes did: ``json.loads``, then pydantic over the dict."""
    cohere, jina = data.draw(encoded(data.draw(COHERE))), data.draw(encoded(data.draw(JINA)))
    agree(
        outcome(lambda: rerank.decode_cohere(cohere)),
        outcome(lambda: oracle.parse_cohere(json.loads(cohere))),
    )
    agree(
        outcome(lambda: rerank.decode_jina(jina)),
        outcome(lambda: oracle.parse_jina(json.loads(jina))),
    )


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[1]", b'"x"', b"null", b"5", b"{}", b' {"model": "llm"} ', b"\xff",
     b'{"model": "llm", "messages": [{"role": "user"}], "stop": [1, 2]}',
     b'{"model": "llm", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     b'{"model": "llm", "messages": [{"role": "user"}], "seed": ' + b"1" * 5000 + b"}"],
    ids=lambda raw: repr(raw[:40]),
)  # fmt: skip
def test_not_a_body_is_refused_as_before(raw: bytes) -> None:
    """Not JSON, or not JSON Python reads (nested too deeply, an integer of 5,000 digits),
    or not an object: the same 400 (in the parser's own words after the colon)."""

    def shape(o: tuple[Any, ...]) -> tuple[Any, ...]:
        return (*o[:3], o[3].split(":")[0]) if o[0] == "refused" and o[2] is None else o

    pairs = [
        (lambda: openai.decode_chat(raw, {}, CONFIG),
         lambda: oracle.chat_request(oracle.parse_body(raw), {}, CONFIG)),
        (lambda: openai.decode_embeddings(raw),
         lambda: oracle.embeddings_request(oracle.parse_body(raw))),
    ]  # fmt: skip
    if b'"seed"' in raw:
        # A member no route reads is skipped unread: to embeddings, "seed" is one.
        pairs = pairs[:1]
    for new, old in pairs:
        assert shape(outcome(new)) == shape(outcome(old))
    if raw.strip()[:1] != b"{" or len(raw) > 5000:
        for decode in (rerank.decode_cohere, rerank.decode_jina):
            with pytest.raises(InvalidArgument, match=r"not valid JSON|must be a JSON object"):
                decode(raw.replace(b'"seed"', b'"top_n"'))


def test_a_number_past_a_double_is_refused_as_json_loads_reads_it() -> None:
    """``1e400``: +inf to ``json.loads``, out of range to msgspec; the same field named."""
    raw = b'{"model": "llm", "messages": [{"role": "user"}], "temperature": 1e400}'
    assert outcome(lambda: openai.decode_chat(raw, {}, CONFIG)) == outcome(
        lambda: oracle.chat_request(oracle.parse_body(raw), {}, CONFIG)
    )


# ---- bounds before the elements exist ----------------------------------------------------------


@contextmanager
def peak() -> Iterator[list[int]]:
    """The peak of the memory Python and numpy allocated inside (bytes), in ``[0]``."""
    tracemalloc.start()
    found = [0]
    try:
        yield found
    finally:
        found[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


# What counting an array's members from its bytes costs at most, whatever the body: a few
# arrays the size of ``json_tensor.WINDOW``, at once (measured: 2.5 MiB at its peak).
SCAN = 12 * WINDOW


def array_body(head: bytes, element: bytes, n: int, tail: bytes = b"]}") -> bytes:
    return head + b",".join([element] * n) + tail


def test_400k_malformed_documents_are_counted_not_decoded() -> None:
    """Measured before: +970 MiB for this 0.8 MiB body, one validation error built per
    document. Now: the count from the bytes, and one short line."""
    raw = array_body(b'{"model": "rerank", "query": "q", "documents": [', b"1", 400_000)
    for decode in (rerank.decode_cohere, rerank.decode_jina):
        with peak() as used, pytest.raises(InvalidArgument) as refused:
            decode(raw)
        assert refused.value.message == "documents: 400000 documents; at most 10000 per call"
        assert used[0] < 4 * len(raw), used[0] / len(raw)


def test_arrays_over_their_bounds_are_refused_before_they_exist() -> None:
    """Messages, a message's parts, embedding inputs (texts or id lists), stop strings:
    each refused over its bound. The bodies hold a million elements each: what is built
    is far smaller (the scan's windows, a few MiB whatever the body)."""
    chat = b'{"model": "llm", "messages": ['
    part = b'{"type": "text", "text": ""}'
    cases: list[tuple[Callable[[bytes], Any], bytes, str]] = [
        (lambda r: openai.decode_chat(r, {}, CONFIG),
         array_body(chat, b'{"role": "user", "content": ""}', 1_000_000), "messages"),
        (lambda r: openai.decode_chat(r, {}, CONFIG),
         array_body(chat + b'{"role": "user", "content": [', part, 1_000_000, b"]}]}"),
         "messages[0].content"),
        (openai.decode_embeddings,
         array_body(b'{"model": "embed", "input": [', b'"a"', 1_000_000), "input"),
        (openai.decode_embeddings,
         array_body(b'{"model": "embed", "input": [', b"[1]", 1_000_000), "input"),
        (lambda r: openai.decode_chat(r, {}, CONFIG),
         array_body(chat + b'{"role": "user"}], "stop": [', b'"s"', 1_000_000), "stop"),
    ]  # fmt: skip
    for decode, raw, param in cases:
        with peak() as used, pytest.raises(openai.ParamError) as refused:
            decode(raw)
        assert refused.value.param == param
        assert "at most" in refused.value.message
        assert used[0] < 2 * len(raw), (param, used[0] / len(raw))
    # At the bounds: taken.
    gen = openai.decode_chat(
        array_body(chat, b'{"role": "user", "content": "x"}', openai.MAX_MESSAGES), {}, CONFIG
    )
    assert gen.prompt.count("<|im_start|>user\nx<|im_end|>") == openai.MAX_MESSAGES
    parts = array_body(
        chat + b'{"role": "user", "content": [', part, openai.MAX_CONTENT_PARTS, b"]}]}"
    )
    assert openai.decode_chat(parts, {}, CONFIG).prompt.startswith("<|im_start|>user")
    texts = array_body(b'{"model": "embed", "input": [', b'"a"', openai.MAX_EMBEDDING_INPUTS)
    assert openai.decode_embeddings(texts).texts == ["a"] * openai.MAX_EMBEDDING_INPUTS
    docs = array_body(b'{"query": "q", "documents": [', b'"d"', rerank.MAX_DOCUMENTS)
    assert rerank.decode_jina(docs).documents == ["d"] * rerank.MAX_DOCUMENTS


def ids_body(n: int, seed: int = 0) -> tuple[bytes, np.ndarray]:
    """An embeddings body of ``n`` one-digit token ids, built without a Python object each."""
    ids = np.random.default_rng(seed).integers(0, 10, n).astype(np.uint8)
    text = np.full(2 * n - 1, ord(","), dtype=np.uint8)
    text[::2] = ids + ord("0")
    return b'{"model": "embed", "input": [' + text.tobytes() + b"]}", ids


def test_24m_token_ids_go_straight_into_an_int32_array() -> None:
    """Measured before: each of 24M ids checked and converted in Python (46 MiB). Now:
    one int32 array (4 bytes an id: twice the body) and windows of the text."""
    raw, ids = ids_body(24_000_000)
    with peak() as used:
        call = openai.decode_embeddings(raw)
    assert call.ids is not None and len(call.ids) == 1
    (row,) = call.ids
    assert row.dtype == np.int32 and np.array_equal(row, ids)
    assert used[0] < 2.5 * len(raw), used[0] / len(raw)


def test_token_ids_take_time_in_proportion_to_their_number() -> None:
    """4x the ids, about 4x the time (a quadratic cost would be 16x): the best of three
    runs of each, in this test, with slack for a loaded machine."""

    def best(raw: bytes) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            openai.decode_embeddings(raw)
            times.append(time.perf_counter() - started)
        return min(times)

    small, large = ids_body(1_000_000)[0], ids_body(4_000_000)[0]
    assert best(large) / best(small) < 10


def test_bodies_at_the_bounds_cost_a_small_multiple_of_their_bytes() -> None:
    """4,096 messages, 10,000 documents, 2,048 texts of 100 characters: what is built is
    the request itself (a prompt, its documents, its texts) and the pieces it is made
    from, and the windows of the scan that counted them first (``SCAN``)."""
    text = b'"' + b"x" * 100 + b'"'
    bodies: list[tuple[Callable[[bytes], Any], bytes]] = [
        (lambda r: openai.decode_chat(r, {}, CONFIG),
         array_body(b'{"model": "llm", "messages": [',
                    b'{"role": "user", "content": ' + text + b"}", openai.MAX_MESSAGES)),
        (rerank.decode_jina,
         array_body(b'{"query": "q", "documents": [', text, rerank.MAX_DOCUMENTS)),
        (openai.decode_embeddings,
         array_body(b'{"model": "embed", "input": [', text, openai.MAX_EMBEDDING_INPUTS)),
    ]  # fmt: skip
    for decode, raw in bodies:
        with peak() as used:
            decode(raw)
        assert used[0] < 2 * len(raw) + SCAN, used[0] / len(raw)


# ---- errors: bounded, naming the field -------------------------------------------------------


def test_errors_are_few_and_name_the_field() -> None:
    bad_docs = array_body(b'{"model": "m", "query": 7, "documents": [', b"1", 10_000)
    with pytest.raises(InvalidArgument) as refused:
        rerank.decode_cohere(bad_docs)
    message = refused.value.message
    assert message.startswith("query: input should be a valid string; documents[0] must be")
    assert message.count("documents[") == rerank.MAX_PROBLEMS - 1
    assert message.endswith(f"; and {10_000 + 1 - rerank.MAX_PROBLEMS} more")
    chat = array_body(b'{"model": "llm", "messages": [', b'{"role": "wizard"}', 4096)
    with pytest.raises(openai.ParamError) as first:
        openai.decode_chat(chat, {}, CONFIG)
    assert first.value.param == "messages[0].role"
    lists = array_body(b'{"model": "embed", "input": [', b"[-1]", 2048)
    with pytest.raises(openai.ParamError) as ids:
        openai.decode_embeddings(lists)
    assert ids.value.param == "input" and "ids 0 to 2147483647" in ids.value.message


# ---- lone surrogates -----------------------------------------------------------------------------


def escape(text: str, upper: bool = False) -> str:
    """``text`` as the inside of a JSON string, every non-ASCII code unit escaped (a lone
    surrogate as ``\\udXXX``, as ``json.dumps`` writes it; its hex digits upper-cased
    with ``upper``)."""
    out = json.dumps(text)[1:-1]
    if upper:
        out = _ESCAPE.sub(lambda m: m[1] + "\\u" + m[2].upper(), out)
    return out


_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u([0-9a-f]{4})")


LONE = "\ud800"
TEXT_HERE = '"@"'  # where a case's text goes


def with_text(doc: dict[str, Any], text: str, upper: bool = False) -> bytes:
    """``doc`` as JSON, the string "@" in it written as ``text`` (escaped)."""
    return json.dumps(doc).replace(TEXT_HERE, f'"{escape(text, upper)}"').encode()


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "llm", "messages": [{"role": "user"}], **fields}


SURROGATE_CASES: list[tuple[str, Callable[[bytes], Any], dict[str, Any], str]] = [
    ("chat", lambda r: openai.decode_chat(r, {}, CONFIG),
     chat_body(messages=[{"role": "user", "content": "hi"}, {"role": "user", "content": "@"}]),
     "messages[1].content"),
    ("chat part", lambda r: openai.decode_chat(r, {}, CONFIG),
     chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "@"}]}]),
     "messages[0].content[0].text"),
    ("chat stop", lambda r: openai.decode_chat(r, {}, CONFIG), chat_body(stop=["@"]), "stop"),
    ("chat user", lambda r: openai.decode_chat(r, {}, CONFIG), chat_body(user="@"), "user"),
    ("chat model", lambda r: openai.decode_chat(r, {}, CONFIG), chat_body(model="@"), "model"),
    ("completion", lambda r: openai.decode_completion(r, {}, CONFIG),
     {"model": "llm", "prompt": "@"}, "prompt"),
    ("completion list", lambda r: openai.decode_completion(r, {}, CONFIG),
     {"model": "llm", "prompt": ["@"]}, "prompt[0]"),
    ("embeddings", openai.decode_embeddings, {"model": "embed", "input": "@"}, "input"),
    ("embeddings list", openai.decode_embeddings,
     {"model": "embed", "input": ["ok", "@"]}, "input[1]"),
    ("cohere documents", rerank.decode_cohere,
     {"model": "rerank", "query": "q", "documents": ["ok", "@"]}, "documents[1]"),
    ("cohere query", rerank.decode_cohere,
     {"model": "rerank", "query": "@", "documents": ["ok"]}, "query"),
    ("jina document text", rerank.decode_jina,
     {"query": "q", "documents": [{"text": "@"}]}, "documents[0]"),
    ("jina model", rerank.decode_jina, {"model": "@", "query": "q", "documents": ["d"]}, "model"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("decode", "doc", "where"),
    [c[1:] for c in SURROGATE_CASES],
    ids=[c[0] for c in SURROGATE_CASES],
)
@pytest.mark.parametrize("text", ["\ud800", "a\udfffb", "\udc00\ud800", "x\ud83d", "\\\ud83d"])
def test_a_lone_surrogate_is_refused_naming_the_field(
    decode: Callable[[bytes], Any], doc: dict[str, Any], where: str, text: str
) -> None:
    raw = with_text(doc, text)
    with pytest.raises(InvalidArgument) as refused:
        decode(raw)
    err = refused.value
    assert err.http_status == 400
    assert "not valid Unicode text" in err.message
    if isinstance(err, openai.ParamError):
        assert err.param == where
        assert err.message.startswith(f"'{where}' is not valid Unicode text")
    else:
        assert err.message.startswith(f"{where} is not valid Unicode text")


def test_surrogate_pairs_and_unread_lone_surrogates_are_text_as_before() -> None:
    """A pair escaped (``json.dumps``'s way with an emoji) is one character; a lone
    surrogate in a member no route reads is no harm, as it was; a marker character in the
    text stays itself."""
    emoji = "\U0001f600 \ufdd0 \ufffe"
    for upper in (False, True):
        raw = with_text({"model": "embed", "input": "@", "x_note": LONE}, emoji, upper)
        assert openai.decode_embeddings(raw).texts == [emoji]
    raw = with_text({"model": "embed", "input": [emoji, "@"]}, "\ufdd0" + LONE)
    with pytest.raises(openai.ParamError) as refused:
        openai.decode_embeddings(raw)
    assert refused.value.param == "input[1]"


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(
        st.one_of(
            st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d\ude00", "\\", "\\u",
                             "ud800", "\\ud800", '"', "a", "\ufdd0", "\U0001f600", "é"]),
            st.characters(),
        ),
        max_size=12,
    ),
    upper=st.booleans(),
    window=st.integers(6, 40),
)  # fmt: skip
def test_lone_surrogates_are_found_as_python_decodes_the_json(
    pieces: list[str], upper: bool, window: int
) -> None:
    """Wherever they fall (across the scan's windows too), escaped or beside escaped
    backslashes: refused exactly where the text ``json.loads`` makes of the body is not
    valid Unicode; otherwise the same text."""
    from fair_frontend.shell.api import body

    raw = with_text({"model": "embed", "input": "@"}, "a" + "".join(pieces), upper)
    text = json.loads(raw)["input"]
    try:
        text.encode("utf-8")
        lone = False
    except UnicodeEncodeError:
        lone = True
    with mock.patch.object(body, "WINDOW", window):
        try:
            got = openai.decode_embeddings(raw)
        except openai.ParamError as err:
            assert lone and err.param == "input", err.message
            return
    assert not lone
    assert got.texts == [text]


# ---- token ids: the scan against json.loads --------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(
    values=st.lists(st.one_of(st.integers(-3, 12), st.integers(2**31 - 3, 2**31 + 3),
                              st.integers(-(2**70), 2**70), st.just("-0")), max_size=12),
    spaces=st.lists(st.sampled_from(["", " ", "\n", "\t "]), min_size=2, max_size=2),
    nested=st.booleans(),
    window=st.integers(4, 30),
)  # fmt: skip
def test_token_ids_read_as_json_loads_reads_them(
    values: list[Any], spaces: list[str], nested: bool, window: int
) -> None:
    """The numpy reading (a window at a time, small windows here so that numbers fall
    across them) gives the ids ``json.loads`` gives, or refuses what it refuses."""
    from fair_frontend.shell.api import body

    items = [str(v) for v in values]
    if nested and items:
        items[len(items) // 2] = f"[{items[len(items) // 2]}]"
    raw = ("[" + spaces[0] + ("," + spaces[1]).join(items) + spaces[0] + "]").encode()
    loaded = json.loads(raw)
    fits = bool(loaded) and all(type(v) is int and 0 <= v <= 2**31 - 1 for v in loaded)
    with mock.patch.object(body, "WINDOW", window), mock.patch.object(body, "SMALL_IDS", 0):
        got = body.token_ids(raw)  # type: ignore[arg-type]  # bytes for a msgspec.Raw: both buffers
    assert (got.tolist() if got is not None else None) == (loaded if fits else None)
    small = body.token_ids(raw)  # type: ignore[arg-type]  # as above
    assert (small.tolist() if small is not None else None) == (loaded if fits else None)


# ---- end to end: a lone surrogate on every route -------------------------------------------------

ROUTES = [
    ("/v1/chat/completions", chat_body(max_tokens=1, messages=[{"role": "user", "content": "@"}]),
     "messages[0].content"),
    ("/v1/completions", {"model": "llm", "max_tokens": 1, "prompt": "@"}, "prompt"),
    ("/v1/embeddings", {"model": "embed", "input": ["fine", "@"]}, "input[1]"),
    ("/v2/rerank", {"model": "rerank", "query": "@", "documents": ["d"]}, "query"),
    ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["d", {"text": "@"}]},
     "documents[1]"),
    # Before, the reranks refused a lone surrogate in a query or a document (as their
    # tokenizer met it, once the model was looked up), but not in the model's name: 404.
    ("/v2/rerank", {"model": "@", "query": "q", "documents": ["d"]}, "model"),
    ("/v1/rerank", {"model": "@", "query": "q", "documents": ["d"]}, "model"),
]  # fmt: skip


def post(url: str, path: str, body: bytes, key: str) -> tuple[int, Any]:
    req = urllib.request.Request(
        f"http://{url}{path}",
        data=body,
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, raw


def test_the_sdks_cannot_send_a_lone_surrogate() -> None:
    """Why the routes are tried with raw HTTP: the ``openai`` SDK writes UTF-8 JSON
    (``ensure_ascii=False``), the ``cohere`` SDK writes through httpx, which does too."""
    from openai._utils._json import openapi_dumps

    with pytest.raises(UnicodeEncodeError):
        openapi_dumps({"input": LONE})
    with pytest.raises(UnicodeEncodeError):
        httpx.Request("POST", "http://localhost/v2/rerank", json={"query": LONE})


@pytest.mark.parametrize(("path", "body", "where"), ROUTES, ids=[f"{r[0]}-{r[2]}" for r in ROUTES])
def test_every_route_answers_a_lone_surrogate_with_a_400_naming_the_field(
    frontend: RunningFrontend,
    workers: int,
    caplog: pytest.LogCaptureFixture,
    path: str,
    body: dict[str, Any],
    where: str,
) -> None:
    """Before: a 500 and a traceback on chat, completions and embeddings, neither counted
    nor logged; a 404 for a rerank model so named. Now: 400 naming the field, counted as
    a refusal (``rejected_invalid``) and, where the shell is in this process to see it,
    logged."""
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)

    def refused() -> float:
        return metric_sum(
            frontend, "fair_requests_total", tenant="umbrella", outcome="rejected_invalid"
        )

    before = refused()
    status, answer = post(frontend.http_url, path, with_text(body, "a\ud800"), KEYS["umbrella"])
    assert status == 400, answer
    message = answer["message"] if path == "/v2/rerank" else answer["error"]["message"]
    assert "not valid Unicode text" in message and where in message, message
    if path != "/v2/rerank":
        assert answer["error"]["type"] == "invalid_request_error"
        if path != "/v1/rerank":
            assert answer["error"]["param"] == where
    eventually(lambda: refused() == before + 1, 10, 0.05, what="the refusal counted")
    if workers == 1:

        def logged() -> list[logging.LogRecord]:
            return [
                r for r in caplog.records
                if r.name == REQUEST_LOGGER and getattr(r, "tenant", None) == "umbrella"
                and "not valid Unicode text" in getattr(r, "error", "")
            ]  # fmt: skip

        assert len(eventually(logged, 10, 0.01, what="the refusal's request-log line")) == 1


# ---- token ids over the model's context: counted, never read --------------------------------


@pytest.mark.parametrize(
    ("value", "where"),
    [(list(range(5000)), "input"), ([[1, 2], list(range(5000))], "input[1]")],
)
def test_token_ids_over_the_context_are_refused_from_their_count_unread(
    value: list[Any], where: str
) -> None:
    """The route passes the model's context (``decode_embeddings(raw, most_ids)``): a list
    of ids longer is refused naming it from a scan of its bytes, and no id in it is
    converted (24M ids cost a count, not a decode: 0.65 s of a shell's CPU before)."""
    raw = json.dumps({"model": "embed", "input": value}).encode()
    never = AssertionError("read")
    with (
        mock.patch.object(openai, "token_ids", side_effect=never) as read,
        pytest.raises(openai.ParamError) as refused,
    ):
        openai.decode_embeddings(raw, 4096)
    assert read.call_count == 0  # every row counted before any is read
    assert refused.value.param == "input"
    assert f"{where} holds more than 4096 token ids" in refused.value.message
    # Within the context, or with none known, the same body is read as before.
    assert openai.decode_embeddings(raw, 5000).ids is not None
    assert openai.decode_embeddings(raw).ids is not None
