"""The OpenAI translation's pure parts (``fair_frontend.shell.api.openai``): stop strings found
across pieces, the pre-built token events, request checks and the error envelope."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fair_frontend import errors
from fair_frontend.shell.api import openai
from tests.support import make_config


@given(
    text=st.text(alphabet="abc", max_size=60),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 60), max_size=10),
)
def test_stop_scanner_matches_a_search_of_the_whole_text(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    """However the text arrives in pieces, what goes out is the text up to the first
    occurrence of any stop string (all of it when none occurs), and nothing after."""
    scanner = openai.StopScanner(stops)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    out = []
    for a, b in itertools.pairwise(bounds):
        out.append(scanner.feed(text[a:b]))
        if scanner.stopped:
            break
    if not scanner.stopped:
        out.append(scanner.flush())
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    assert "".join(out) == (text[: min(found)] if found else text)
    assert scanner.stopped == bool(found)


@given(st.text(max_size=20))
def test_token_event_is_the_chunk_it_stands_for(text: str) -> None:
    for chat in (True, False):
        gen = openai.chat_request(
            {"model": "llm", "messages": [{"role": "user", "content": "x"}], "stream": True},
            {},
            make_config(),
        )
        gen.chat = chat
        assert openai.token_event(openai.token_events(gen), text) == openai.sse(
            openai.chunk(gen, text)
        )


U = {"model": "llm", "messages": [{"role": "user"}]}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "llm", "messages": []}, "messages"),
        ({"model": "llm", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": "llm", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]"),
        ({"model": "llm", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (b'{"model": "llm", "messages": [{"role": "user"}], "temperature": 1e400}', "temperature"),
        ({**U, "max_tokens": 2**64}, "max_tokens"),
        ({**U, "max_tokens": True}, "max_tokens"),
        ({**U, "top_p": 0}, "top_p"),
        ({**U, "stop": "x" * 300}, "stop"),
        ({**U, "stream_options": {}}, "stream_options"),
        ({**U, "tools": [{"type": "function"}]}, "tools"),
        ({**U, "user": "u" * 1000}, "user"),
        ({**U, "priority": "high"}, "priority"),
    ],
)  # fmt: skip
def test_bad_chat_fields_are_refused_naming_the_field(body: dict | bytes, param: str) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(openai.ParamError) as refused:
        openai.decode_chat(raw, {}, make_config())
    status, doc = openai.envelope(refused.value)
    assert status == 400
    assert doc["error"]["param"] == param
    assert doc["error"]["type"] == "invalid_request_error"


def test_huge_and_out_of_range_embeddings_inputs_are_refused() -> None:
    value: object
    for value in ("", [], [""], [-1], [2**31], [[]], [[1], "x"], {"a": 1}, 3.5):
        with pytest.raises(openai.ParamError):
            openai.embeddings_request({"model": "embed", "input": value})
    with pytest.raises(openai.ParamError):
        openai.embeddings_request({"model": "embed", "input": ["x"] * 2049})
    with pytest.raises(openai.ParamError):
        openai.embeddings_request({"model": "embed", "input": "x", "encoding_format": "hex"})


def test_priority_clamped_and_service_tiers() -> None:
    config = make_config()
    levels = config.priority_levels
    base = {"model": "llm", "messages": [{"role": "user", "content": "x"}]}
    assert openai.priority_of({**base, "priority": 10**30}, {}, config) == (levels, "default")
    assert openai.priority_of({**base, "priority": -5}, {}, config) == (0, "default")
    assert openai.priority_of(base, {"x-priority": "1"}, config) == (1, "default")
    assert openai.priority_of({**base, "service_tier": "priority"}, {}, config) == (1, "priority")
    assert openai.priority_of({**base, "service_tier": "flex"}, {}, config) == (levels, "flex")
    assert openai.priority_of({**base, "service_tier": "auto"}, {}, config) == (0, "default")


def test_envelope_statuses_and_codes() -> None:
    cases = [
        (errors.Unauthenticated("no key"), 401, "invalid_api_key"),
        (errors.PermissionDenied("not yours"), 403, "model_not_allowed"),
        (errors.UnknownModel("m"), 404, "model_not_found"),
        (errors.RateLimited("limit: 5 requests per minute"), 429, "rate_limit_exceeded"),
        (errors.Overloaded("busy", retry_after=2.0), 503, "overloaded"),
    ]
    for err, status, code in cases:
        got, doc = openai.envelope(err)
        assert (got, doc["error"]["code"]) == (status, code), err
        assert json.dumps(doc)  # serialisable as it is


def test_a_tiers_top_priority_clamps_and_the_echo_says_so() -> None:
    config = make_config(tier_top_priority={"standard": 3})
    assert config.top_priority("initech") == 3  # standard
    assert config.top_priority("acme") == 1  # enterprise: no entry, every level
    body = {
        "model": "llm",
        "messages": [{"role": "user", "content": "x"}],
        "service_tier": "priority",
    }
    gen = openai.chat_request(body, {}, config)
    assert openai.tier_used(gen, config, "initech") == "default"
    assert openai.tier_used(gen, config, "acme") == "priority"
    with pytest.raises(ValueError, match=r"tier_top_priority\.gold"):
        make_config(tier_top_priority={"gold": 1})
    with pytest.raises(ValueError, match=r"tier_top_priority\.trial"):
        make_config(tier_top_priority={"trial": 99})


_TEXT_KEY = "text_output"


@st.composite
def _generate_events(draw: st.DrawFn) -> tuple[bytes, list[str], bool]:
    """Triton's generate events as its HTTP server writes them (UTF-8 as is, the text
    among other outputs), the texts they carry, and whether each is an ASCII string."""
    events, texts, plain = [], [], True
    for _ in range(draw(st.integers(1, 5))):
        text = draw(st.text(max_size=12) | st.sampled_from(['"text_output":"x"', "a\\", "\n"]))
        as_list = draw(st.booleans()) and draw(st.booleans())
        value: object = [text] if as_list else text
        fields = {"model_name": "llm", "num_output_tokens": 1, _TEXT_KEY: value}
        if draw(st.booleans()):
            fields = dict(reversed(list(fields.items())))
        written = json.dumps(fields, ensure_ascii=False, separators=(",", ":"))
        events.append(b"data: " + written.encode() + b"\n\n")
        texts.append(text)
        plain = plain and not as_list and text.isascii()
    return b"".join(events), texts, plain


@given(_generate_events())
def test_a_chunk_carries_tritons_own_json_of_the_text(found: tuple[bytes, list[str], bool]) -> None:
    """The chat stream's chunk of events that came together carries their texts as
    Triton's JSON wrote them (no decoding and encoding again): the same text as decoding
    them gives, and it is taken only where each event's text is a string of ASCII."""
    from fair_frontend.protocol import InferResponse
    from fair_frontend.shell.api_http import _quoted, _text

    events, texts, plain = found
    quoted = _quoted(events, _TEXT_KEY)
    assert (quoted is not None) == plain
    if quoted is not None:
        resp = InferResponse("llm", "1", "", [], {}, None, events)
        assert json.loads(b'"' + quoted + b'"') == "".join(texts) == _text(resp, _TEXT_KEY)
        gen = openai.chat_request(
            {"model": "llm", "messages": [{"role": "user", "content": "x"}], "stream": True},
            {},
            make_config(),
        )
        head, tail = openai.token_events(gen)
        chunk = json.loads((head + b'"' + quoted + b'"' + tail)[len(b"data: ") :])
        assert chunk == openai.chunk(gen, "".join(texts))
