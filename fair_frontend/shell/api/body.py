"""API request bodies read from their bytes, with nothing built per element.

A body parsed the plain way (``json.loads``, then checks over the dicts and lists) costs a
Python object per value, tens of bytes each, before any check runs: a 0.8 MiB rerank body
of 400,000 malformed documents grew a shell by 970 MiB, and a 46 MiB list of token ids
cost a Python int each. Here a body is read in steps, each bounded before it builds:

1. ``Body(raw).object(Shape)``: msgspec decodes the top-level object into a struct whose
   fields are all ``msgspec.Raw`` (a view of the value's bytes, nothing decoded): the
   whole text is checked to be JSON, and members the route does not know are skipped
   unbuilt. ``ABSENT`` stands for a member the body does not carry.
2. Each member is decoded when the route's checks ask for it, to what they ask:
   ``Members[name]`` gives a scalar as ``json.loads`` would (a string, number, boolean or
   None) and an array or object as a ``Container`` (its kind and bytes, nothing built),
   so that a check refusing a wrong type never builds the value.
3. Arrays are counted from their bytes (``count``, a numpy scan: ``json_tensor``) and
   refused when over their bound before one element exists; under it, ``elements`` gives
   each element's bytes (a ``Raw`` each) to decode in turn. msgspec's own ``max_length``
   does not do this: it checks the length once the whole list is built (measured: a
   list of 2,000,000 two-character strings over a bound of 3 peaks at 12x its bytes).
4. Token ids go straight into an int32 array (``token_ids``: the digits parsed by numpy
   a window at a time, as ``json_tensor`` scans a KServe tensor), their range checked
   over each window's numbers at once.

Lone surrogates: JSON can spell one (``"\\ud800"``), ``json.loads`` builds a ``str``
holding it, and that string fails wherever it is later encoded (a 500 with a traceback).
msgspec refuses the whole text instead, naming no field. ``Body`` finds them first (a
regular expression finds whether the body has any ``\\ud8``-``\\udf`` escape: most have
none; then a numpy scan tells the pairs from the lone ones), and writes each lone one as
the escape of a noncharacter the body does not hold (its ``marker``). ``Body.check``
then finds that marker in the strings the route reads, so the error names the field
(``InvalidText.where``), and text nobody reads (an unknown member) stays as harmless as
it was.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import msgspec
import numpy as np

from fair_frontend.shell.json_tensor import WINDOW, count_byte, count_members, first_byte

ABSENT = msgspec.Raw(b"")  # a member the body does not carry
TOKEN_ID_MAX = 2**31 - 1  # INT32 token ids

Kind = Literal["absent", "null", "string", "array", "object", "boolean", "integer", "number"]
# The kinds as the checks name them: the Python type ``json.loads`` gives each.
PYTHON_NAMES: dict[str, str] = {
    "string": "str",
    "array": "list",
    "object": "dict",
    "boolean": "bool",
    "integer": "int",
    "number": "float",
    "null": "NoneType",
    "absent": "NoneType",
}

S = TypeVar("S", bound=msgspec.Struct)


class NotJson(Exception):
    """The body is not JSON, or not JSON that Python reads (msgspec's reason in
    ``detail``): nested too deeply, an integer of thousands of digits."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class NotAnObject(Exception):
    """The body (or a member read as an object) is JSON but not an object."""


LONE_SURROGATE = "it holds a lone surrogate (a \\ud800-\\udfff escape not in a pair)"


class InvalidText(Exception):
    """A string the route reads is not valid Unicode text: it holds a lone UTF-16
    surrogate, or bytes that are not UTF-8 (``where``: the field; None where the body
    could not be read to tell)."""

    def __init__(self, where: str | None, reason: str = LONE_SURROGATE) -> None:
        super().__init__(where, reason)
        self.where = where
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Container:
    """An array or object member, unbuilt: what a scalar check sees in its place."""

    kind: Literal["array", "object"]
    raw: msgspec.Raw

    @property
    def python_name(self) -> str:
        return PYTHON_NAMES[self.kind]

    def is_empty(self) -> bool:
        return count(self.raw, 0) == 0


def type_name(value: Any) -> str:
    """What a member's type is called in messages (``json.loads``'s Python type)."""
    if isinstance(value, Container):
        return value.python_name
    return type(value).__name__


def _table(chars: bytes) -> np.ndarray:
    table = np.zeros(256, dtype=np.bool_)
    table[list(chars)] = True
    return table


# ---- lone surrogates ----------------------------------------------------------------------

# Any escape of a UTF-16 surrogate (first pass: most bodies have none).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_BLANKED = b"\x00\x00"  # no valid JSON text holds a NUL byte
_BACKSLASH, _U, _D = ord("\\"), ord("u"), ord("d")
_HEX = _table(b"0123456789abcdefABCDEF")
_SURROGATE_DIGIT = _table(b"89abcdef")  # "\ud8" to "\udf", lower-cased
_HIGH_DIGIT = _table(b"89ab")  # "\ud800"-"\udbff" opens a pair, "\udc00"-"\udfff" closes one
# Noncharacters (never text a client means) to stand for a lone surrogate: the first one
# the body does not hold in either spelling.
_MARKERS = [chr(c) for c in (*range(0xFDD0, 0xFDF0), 0xFFFE, 0xFFFF)]


def _without_lone_surrogates(raw: bytes) -> tuple[Any, str | None, bool]:
    """``raw`` with each lone surrogate escape written as the escape of a marker: the
    text (a buffer), the marker (None: none needed, or none free), whether any was found."""
    if _SURROGATE.search(raw) is None or b"\x00" in raw:
        return raw, None, False  # none (or not JSON at all: msgspec will say so)
    # Every escaped backslash blanked: every backslash left starts an escape.
    blanked = np.frombuffer(raw.replace(b"\\\\", _BLANKED), dtype=np.uint8)
    lone = list(_lone_escapes(blanked))
    if not lone:
        return raw, None, False  # surrogate pairs only
    for marker in _MARKERS:
        digits = f"{ord(marker):04x}".encode()
        if marker.encode() not in raw and not re.search(rb"\\u" + digits, raw, re.IGNORECASE):
            text = np.frombuffer(raw, dtype=np.uint8).copy()
            for at in lone:
                for k in range(4):
                    text[at + 2 + k] = digits[k]
            return text, marker, True
    return raw, None, True


def _lone_escapes(a: np.ndarray) -> Iterator[np.ndarray]:
    """Where the lone surrogate escapes of ``a`` (a JSON text, its escaped backslashes
    blanked) start, a window at a time: each "\\uD800"-"\\uDBFF" not followed by a
    "\\uDC00"-"\\uDFFF", and each of those not after one, as msgspec pairs them. A window
    looks 6 bytes back and 12 on, to see the escape paired with each of its own."""
    for lo in range(0, a.size, WINDOW):
        hi = min(lo + WINDOW, a.size)
        base = max(lo - 6, 0)
        w = a[base : hi + 12]
        at = np.flatnonzero((w[:-5] == _BACKSLASH) & (w[1:-4] == _U))
        if not at.size:
            continue
        third, fourth = w[at + 2] | 0x20, w[at + 3] | 0x20  # lower case
        surrogate = (third == _D) & _SURROGATE_DIGIT[fourth] & _HEX[w[at + 4]]
        surrogate &= _HEX[w[at + 5]]
        at, fourth = at[surrogate], fourth[surrogate]
        high = _HIGH_DIGIT[fourth]
        pair = high[:-1] & ~high[1:] & (at[1:] == at[:-1] + 6)  # element k opens a pair
        paired = np.zeros(at.size, dtype=np.bool_)
        paired[:-1] |= pair
        paired[1:] |= pair
        lone = at[~paired] + base
        lone = lone[(lone >= lo) & (lone < hi)]
        if lone.size:
            yield lone


# ---- decoding -------------------------------------------------------------------------------

_ANY = msgspec.json.Decoder()
_ELEMENTS = msgspec.json.Decoder(list[msgspec.Raw])
_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {}


def _decoder(shape: type[S]) -> msgspec.json.Decoder[S]:
    decoder = _DECODERS.get(shape)
    if decoder is None:
        decoder = _DECODERS[shape] = msgspec.json.Decoder(shape)
    return decoder


class Body:
    """One request body, as its routes read it: ``object`` for its top-level members, then
    each member decoded as the checks ask (``Members``)."""

    def __init__(self, raw: bytes | bytearray | memoryview) -> None:
        self.text, self.marker, self._lone = _without_lone_surrogates(bytes(raw))

    def object(self, shape: type[S], raw: msgspec.Raw | None = None) -> S:
        """The body (or the object member ``raw``) as ``shape``, a struct of ``Raw``
        fields each defaulting to ``ABSENT``: ``NotJson`` or ``NotAnObject`` otherwise.
        Refuses a body with a lone surrogate it could not mark (``InvalidText(None)``)."""
        if raw is None and self._lone and self.marker is None:
            raise InvalidText(None)
        try:
            return _decoder(shape).decode(self.text if raw is None else raw)
        except msgspec.ValidationError:
            raise NotAnObject() from None
        except msgspec.DecodeError as err:
            raise NotJson(str(err)) from None
        except RecursionError:
            raise NotJson("it nests arrays or objects too deeply") from None

    def members(self, shape: type[S], raw: msgspec.Raw | None = None, prefix: str = "") -> Members:
        return Members(self, self.object(shape, raw), prefix)

    def check(self, value: str, where: str) -> str:
        """``value`` (a string read from the body at ``where``), or ``InvalidText``."""
        if self.marker is not None and self.marker in value:
            raise InvalidText(where)
        return value

    def scalar(self, raw: msgspec.Raw, where: str) -> Any:
        """A member's value as ``json.loads`` gives a scalar (None where absent or null);
        an array or object as a ``Container``, unbuilt. A string is checked (``string``)."""
        what = kind(raw)
        if what == "absent":
            return None
        if what in ("array", "object"):
            return Container(what, raw)
        if what == "string":
            return self.string(raw, where)
        try:
            return _ANY.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            if what == "number":  # past a double's range: +-inf, as json.loads reads it
                return float(bytes(raw))
            raise NotJson(str(err)) from None  # an integer too long to read (json.loads too)

    def string(self, raw: msgspec.Raw, where: str) -> str | None:
        """A string member's value, checked to be text (``InvalidText``: a lone surrogate,
        or bytes that are not UTF-8, which msgspec leaves unchecked in what it skips);
        None where it is not a string."""
        if kind(raw) != "string":
            return None
        try:
            value: str = _ANY.decode(raw)
        except msgspec.DecodeError:
            raise InvalidText(where, "it is not UTF-8") from None
        return self.check(value, where)


class Members(Mapping[str, Any]):
    """The members of one object in a body, each decoded when read, as a scalar
    (``Body.scalar``): what the checks written for ``json.loads``'s dicts read, with
    arrays and objects left unbuilt. ``raw`` gives a member's bytes; ``prefix`` is the
    object's place in the body, for the names of its members in errors."""

    def __init__(self, body: Body, fields: msgspec.Struct, prefix: str = "") -> None:
        self.body = body
        self.fields = fields
        self.prefix = prefix
        self._values: dict[str, Any] = {}

    def raw(self, name: str) -> msgspec.Raw:
        raw: msgspec.Raw = getattr(self.fields, name, ABSENT)
        return raw

    def __getitem__(self, name: str) -> Any:
        if name not in self._values:
            raw = self.raw(name)
            if kind(raw) == "absent":
                raise KeyError(name)
            self._values[name] = self.body.scalar(raw, self.prefix + name)
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return (n for n in self.fields.__struct_fields__ if kind(self.raw(n)) != "absent")

    def __len__(self) -> int:
        return sum(1 for _ in self)


def kind(raw: msgspec.Raw) -> Kind:
    """A member's JSON kind, from its first byte (a number's from its bytes)."""
    if not len(raw):
        return "absent"
    view = memoryview(raw)
    first = view[0]
    if first == 0x22:  # "
        return "string"
    if first == 0x5B:  # [
        return "array"
    if first == 0x7B:  # {
        return "object"
    if first == 0x6E:  # n
        return "null"
    if first in (0x74, 0x66):  # t f
        return "boolean"
    text = bytes(view)
    return "number" if b"." in text or b"e" in text or b"E" in text else "integer"


def count(raw: msgspec.Raw, limit: int) -> int:
    """An array's or object's members, counted from its bytes up to ``limit + 1``."""
    return count_members(raw, limit)


def elements(raw: msgspec.Raw) -> list[msgspec.Raw]:
    """An array's elements, each as its bytes (count them first: one ``Raw`` each)."""
    items: list[msgspec.Raw] = _ELEMENTS.decode(raw)
    return items


def holds_array(raw: msgspec.Raw) -> bool:
    """Whether an array holds an array (a "[" in a string counts too: a safe yes)."""
    return count_byte(raw, _OPEN, 1) > 1


def first_element(raw: msgspec.Raw) -> int | None:
    """The first byte of an array's first element (None for an empty array)."""
    first = first_byte(memoryview(raw)[1:])
    return None if first == 0x5D else first  # ]


# ---- token ids ------------------------------------------------------------------------------

_DIGIT = _table(b"0123456789")
_ZERO, _NINE, _OPEN, _CLOSE = ord("0"), ord("9"), ord("["), ord("]")
_SPACE, _COMMA, _MINUS = ord(" "), ord(","), ord("-")
_ID_DIGITS = len(str(TOKEN_ID_MAX))  # more digits than this: out of range (JSON has no 007)
_IDS = msgspec.json.Decoder(list[int])
SMALL_IDS = 1 << 16  # ids in fewer bytes: read through msgspec's list[int]


def token_ids(raw: msgspec.Raw) -> np.ndarray | None:
    """A flat array of integers 0 to ``TOKEN_ID_MAX`` as an int32 array; None where ``raw``
    is anything else (empty, nested, another kind of element, an id out of range).

    A long one is read without a Python object per element: its integers are parsed by
    numpy, a window of ``json_tensor.WINDOW`` bytes at a time, into an array allocated
    once (its length is its commas plus one: no strings in it, or it is refused); the
    transient cost is a few times the window. A short one (``SMALL_IDS`` bytes) is
    decoded by msgspec as a ``list[int]``, which is faster for a row of a few ids.
    """
    if kind(raw) != "array":
        return None
    if len(raw) <= SMALL_IDS:
        try:
            small = np.array(_IDS.decode(raw), dtype=np.int64)
        except (msgspec.ValidationError, OverflowError):
            return None
        if not small.size or small.min() < 0 or small.max() > TOKEN_ID_MAX:
            return None
        return small.astype(np.int32)
    a = np.frombuffer(raw, dtype=np.uint8)
    if holds_array(raw):
        return None  # an array inside (or a "[" in a string: refused below either way)
    out = np.empty(count_byte(raw, ord(","), a.size) + 1, dtype=np.int32)
    filled = 0
    lo = 0
    while lo < a.size:
        hi = min(lo + WINDOW, a.size)
        while hi < a.size and _DIGIT[a[hi]]:  # no number cut in two
            hi += 1
            if hi - lo > WINDOW + _ID_DIGITS:
                return None
        values = _window_ids(a[lo:hi])
        if values is None or filled + values.size > out.size:
            return None
        out[filled : filled + values.size] = values
        filled += values.size
        lo = hi
    return out if filled == out.size else None


def _window_ids(w: np.ndarray) -> np.ndarray | None:
    """The integers in ``w`` (a stretch of a valid JSON array, cut between numbers), or
    None where it holds anything else or an integer out of range. Digit by digit over
    all the numbers at once (Horner's rule): as many steps as the longest has digits."""
    if ((w > _NINE) & (w != _OPEN) & (w != _CLOSE)).any():
        return None  # a letter (true, null, an exponent), a brace, a backslash
    if ((w > _SPACE) & (w < _ZERO) & (w != _COMMA) & (w != _MINUS)).any():
        return None  # a quote, a point, a plus
    digit = (w >= _ZERO) & (w <= _NINE)
    first, last = digit.copy(), digit.copy()  # a number's first and last digits
    first[1:] &= ~digit[:-1]
    last[:-1] &= ~digit[1:]
    starts = np.flatnonzero(first)
    if not starts.size:
        return np.empty(0, dtype=np.int32)
    lengths = np.flatnonzero(last) - starts + 1
    longest = int(lengths.max())
    if longest > _ID_DIGITS:
        return None
    values = (w[starts] - _ZERO).astype(np.int64)
    for k in range(1, longest):
        more = lengths > k
        at = starts[more] + k
        values[more] = values[more] * 10 + (w[at] - _ZERO)
    negative = np.zeros(starts.size, dtype=np.bool_)
    inner = starts > 0
    negative[inner] = w[starts[inner] - 1] == _MINUS
    if (negative & (values != 0)).any() or int(values.max()) > TOKEN_ID_MAX:
        return None  # -0 is 0
    return values.astype(np.int32)
