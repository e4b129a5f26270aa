"""The door's scan for a body's model (``shell.door.ModelScan``, ``model_of``), on its own.

Properties, over generated JSON objects written member by member (any key order, any
whitespace, the key ``"model"`` in any spelling its letters' escapes allow, values of any
JSON kind and nesting, strings full of quotes, backslashes, brackets and non-ASCII) and fed
in arbitrary chunks:

- what the scan finds is exactly ``json.loads(body)["model"]`` (None where there is no
  such member); a value that is not a string (nor null) is refused naming ``model``;
- it never takes more than its bound: with a bound shorter than the body it answers as
  above or says it is exhausted, never anything else;
- ``model_of`` (the whole body, msgspec) finds the same.

And the refusals: a body that is not an object, a body cut short, a name whose text
already proves it over 1 KiB (refused before the rest of it arrives, never echoed).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fair_frontend.protocol import MAX_NAME_BYTES
from fair_frontend.shell import door
from fair_frontend.shell.api.openai import ParamError
from fair_frontend.shell.door import SCAN_BYTES, ModelScan, Named, model_of

MISSING = object()  # a document without a top-level "model"

# Text that JSON must escape or that looks like structure: the scan must follow strings.
TRICKY = st.text(
    alphabet=st.sampled_from(list('ab"\\/{}[],: \n\t\u00e9\u4e2d\U0001f600model')), max_size=12
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=False, allow_infinity=False),
    TRICKY,
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(TRICKY, st.just("model")), inner, max_size=4),
    ),
    max_leaves=20,
)
# Keys other than "model" (some of them near it).
OTHER_KEYS = st.one_of(TRICKY, st.sampled_from(["mode", "models", "Model", "modell", "m"])).filter(
    lambda k: k != "model"
)
# A model's value: mostly names, sometimes another kind (refused).
MODEL_VALUES = st.one_of(TRICKY, st.text(max_size=40), st.none(), VALUES)


def escaped(key: str, mask: int, upper: bool) -> str:
    """``key``'s JSON text with the letters ``mask`` picks written as ``\\uXXXX``."""
    letters = []
    for i, ch in enumerate(key):
        hexa = f"{ord(ch):04x}"
        letters.append(("\\u" + (hexa.upper() if upper else hexa)) if mask >> i & 1 else ch)
    return '"' + "".join(letters) + '"'


def spelled(key: str, draw: st.DrawFn) -> str:
    """A key's JSON text; "model" with some of its letters written as escapes."""
    if key != "model":
        return json.dumps(key, ensure_ascii=draw(st.booleans()))
    return escaped(key, draw(st.sampled_from(range(32))), draw(st.booleans()))


SPACE = st.text(alphabet=st.sampled_from(" \t\n\r"), max_size=3)


@st.composite
def documents(draw: st.DrawFn) -> tuple[bytes, Any]:
    """(a JSON object's text, its "model" as ``json.loads`` reads it, or MISSING)."""
    keys = draw(st.lists(OTHER_KEYS, max_size=6, unique=True))
    members = [(k, draw(VALUES)) for k in keys]
    model: Any = MISSING
    if draw(st.booleans()):
        model = draw(MODEL_VALUES)
        members.insert(draw(st.sampled_from(range(len(members) + 1))), ("model", model))
    parts = []
    for key, value in members:
        text = json.dumps(
            value,
            ensure_ascii=draw(st.booleans()),
            indent=draw(st.sampled_from([None, 0, 2])),
        )
        parts.append(spelled(key, draw) + draw(SPACE) + ":" + draw(SPACE) + text)
    body = draw(SPACE) + "{" + draw(SPACE) + ("," + draw(SPACE)).join(parts) + draw(SPACE) + "}"
    return body.encode(), model


def fed(scan: ModelScan, body: bytes, sizes: list[int]) -> Named | str:
    """Feed ``body`` in chunks of ``sizes`` (cycled): the answer, or "exhausted"."""
    at = 0
    for size in sizes * (len(body) // max(1, sum(sizes)) + 2):
        chunk = body[at : at + size]
        at += len(chunk)
        if not chunk:
            return scan.finish()
        found = scan.feed(chunk)
        if found is not None:
            return found
        if scan.exhausted:
            return "exhausted"
    return scan.finish()


def expected(model: Any) -> Named | type[ParamError]:
    if model is MISSING or model is None:
        return Named(None)
    if isinstance(model, str):
        return Named(model)
    return ParamError


def outcome(call: Any) -> Any:
    try:
        return call()
    except ParamError as err:
        assert err.param == "model", err.message
        return ParamError


@settings(max_examples=400, deadline=None)
@given(documents(), st.lists(st.integers(1, 64), min_size=1, max_size=5))
@example((b'{"mod\\u0065l": "x", "model": "y"}', "y"), [1]).xfail(
    reason="duplicate members: the scan keeps the first, JSON the last (Passage.named)"
)
def test_the_scan_finds_what_json_reads(doc: tuple[bytes, Any], sizes: list[int]) -> None:
    body, model = doc
    want = expected(model)
    assert json.loads(body).get("model", MISSING) == model or model is MISSING
    got = outcome(lambda: fed(ModelScan(len(body) + 1), body, sizes))
    assert got == want, (body, got)
    assert outcome(lambda: model_of(body)) == want


@settings(max_examples=400, deadline=None)
@given(documents(), st.lists(st.integers(1, 64), min_size=1, max_size=5), st.data())
def test_the_scan_takes_no_more_than_its_bound(
    doc: tuple[bytes, Any], sizes: list[int], data: st.DataObject
) -> None:
    """Bounded below the body's length: the right answer from the bytes it took, or
    exhausted; never a byte over its bound, never a wrong answer."""
    body, model = doc
    bound = data.draw(st.integers(1, max(1, len(body) - 1)))
    scan = ModelScan(bound)
    got = outcome(lambda: fed(scan, body, sizes))
    assert len(scan.text) <= bound
    if got == "exhausted":
        assert len(scan.text) == bound
        return
    assert got == expected(model), (body, bound, got)


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("mask", range(32))
def test_every_spelling_of_the_key_is_found_first_or_later(mask: int, upper: bool) -> None:
    """Where the member comes first (read a member at a time) and where it follows
    members the scan skips whole (``_MEMBERS_RE``)."""
    key = escaped("model", mask, upper)
    for body in (
        f'{{{key}: "x", "a": 1}}',
        f'{{"a": 1, "b": "s", "c": [1, {{"d": 2}}], {key}: "x"}}',
        f'{{"a": 1,{key}:"x"}}',
    ):
        assert json.loads(body)["model"] == "x"
        for sizes in ([len(body)], [1], [7]):
            assert fed(ModelScan(), body.encode(), sizes) == Named("x"), (body, sizes)
        assert model_of(body.encode()) == Named("x")


def test_a_member_after_a_long_array_is_beyond_the_scan_and_found_whole() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 100}] * 1000, "model": "m"})
    scan = ModelScan(SCAN_BYTES)
    assert fed(scan, body.encode(), [4096]) == "exhausted"
    assert len(scan.text) == SCAN_BYTES
    assert model_of(body.encode()) == Named("m")


def test_the_first_of_two_model_members_is_the_scans() -> None:
    """JSON keeps the last: the route compares the two (``Passage.named``)."""
    body = b'{"model": "a", "x": 1, "model": "b"}'
    assert fed(ModelScan(), body, [5]) == Named("a")
    assert model_of(body) == Named("b") == Named(json.loads(body)["model"])


def test_a_name_too_long_is_refused_before_it_is_all_in_and_never_echoed() -> None:
    name = "n" * (1 << 20)
    body = json.dumps({"model": name, "input": "x"}).encode()
    scan = ModelScan()
    with pytest.raises(ParamError) as refused:
        fed(scan, body, [1000])
    assert refused.value.param == "model"
    assert "too long" in refused.value.message and "nnnn" not in refused.value.message
    assert len(scan.text) < 8 * MAX_NAME_BYTES  # it stopped once the text proved it
    with pytest.raises(ParamError) as whole:
        model_of(body)
    assert "nnnn" not in whole.value.message


def test_a_name_of_escapes_is_judged_by_what_it_decodes_to() -> None:
    """1,000 escaped letters are 6,000 bytes of text and 1,000 of name: found, and its
    length judged by the door (``check_name``), not refused from its text."""
    body = ('{"model": "' + "\\u0041" * 1000 + '"}').encode()
    assert fed(ModelScan(), body, [333]) == Named("A" * 1000)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'["model", "x"]', "must be a JSON object"),
        (b'"model"', "must be a JSON object"),
        (b"   ", "empty"),
        (b'{"model": "x', "ends before"),
        (b'{"a": [1, 2', "ends before"),
        (b'{"a" 1}', "expected ':'"),
        (b'{"a": 1 "model": "x"}', "expected ','"),
        (b'{"model": "\\x"}', "could not parse"),
    ],
)
def test_what_is_not_a_json_object_is_refused(body: bytes, why: str) -> None:
    with pytest.raises(ParamError) as refused:
        fed(ModelScan(), body, [3])
    assert why in refused.value.message, refused.value.message


@pytest.mark.parametrize("value", ["5", "true", "[]", '{"a": 1}', "-1.5"])
def test_a_model_that_is_not_a_string_is_refused_naming_it(value: str) -> None:
    body = f'{{"model": {value}, "x": 1}}'.encode()
    for call in (lambda: fed(ModelScan(), body, [2]), lambda: model_of(body)):
        with pytest.raises(ParamError) as refused:
            call()
        assert refused.value.param == "model"
        assert "expected a string" in refused.value.message


class Counted:
    """A compiled pattern whose matches are counted: the scan's steps in Python."""

    def __init__(self, pattern: re.Pattern[bytes]) -> None:
        self.pattern = pattern
        self.matches = 0

    def match(self, text: Any, pos: int = 0) -> re.Match[bytes] | None:
        self.matches += 1
        return self.pattern.match(text, pos)


DENSE = {
    **{
        f"nested {depth} deep": '{"a": ['
        + ",".join(["[" * depth + '"x"' + "]" * depth] * (SCAN_BYTES // (2 * depth + 3) + 1))
        + "]}"
        for depth in (1, 3, 12, 13, 17, 40, 2000)
    },
    "members": "{" + ",".join(f'"k": {i}' for i in range(SCAN_BYTES // 6)) + "}",
    "escaped keys": "{" + ",".join(f'"\\u0061": {i}' for i in range(SCAN_BYTES // 10)) + "}",
    "empty strings": '{"a": [' + ",".join(['""'] * (SCAN_BYTES // 3)) + "]}",
    "empty groups": '{"a": [' + ",".join(["[]", "{}"] * (SCAN_BYTES // 6)) + "]}",
}


@pytest.mark.parametrize("text", DENSE.values(), ids=DENSE.keys())
def test_dense_text_costs_few_steps(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worst the scan meets in its bytes: an element every few bytes, groups nested
    past what one match skips. Its steps in Python (regular expression matches, each in
    C) stay a fraction of the bytes: a step per element or per bracket would be more."""
    counters = []
    for name in dir(door):
        if name.endswith("_RE"):
            counted = Counted(getattr(door, name))
            monkeypatch.setattr(door, name, counted)
            counters.append(counted)
    scan = ModelScan()
    assert fed(scan, text.encode(), [4096]) == "exhausted"
    steps = sum(c.matches for c in counters)
    assert steps < SCAN_BYTES // 6, steps
