"""JSON tensor data without a Python object per element.

A KServe v2 JSON input carries its elements in ``data``: an array of numbers, booleans or
strings, flat or nested row by row. Parsed the plain way (``json.loads``, then a flat list,
then ``np.array``), ``[0,0,...]`` costs a Python object per element, two lists and the
array, about ten times the body, before anything checks the shape against the model.

Here the body is parsed by msgspec with ``data`` kept as ``msgspec.Raw`` (a view of the
body's bytes, already known to be valid JSON), and read in two passes over that text, a
window of ``WINDOW`` bytes at a time (numpy over the bytes, no object per element):

1. ``scan_leaves``: how many elements (leaves) the array holds, of which kinds (numbers,
   numbers with a fraction or exponent, ``true``/``false``, strings, anything else), and
   where to cut the text into windows that each start at an element. The caller checks
   the count against the declared shape, the kinds against the datatype, and the shape
   against the model, before anything is converted.
2. ``convert``: each window becomes a flat JSON array (brackets and whitespace between
   elements dropped, one comma before each element), decoded by msgspec into a list of
   at most a window's elements, copied into the final numpy array. The transient cost is
   a few times ``WINDOW``, whatever the tensor's size.

Strings are found with their escapes: a quote ends a string unless an odd run of
backslashes precedes it (``_Strings``), so commas and brackets inside strings are never
taken for separators. An element that is a JSON object cannot be counted this way; data
holding one is refused at once (as a value of the wrong type), before its count.

``count_members`` counts the members of an array or object (e.g. a request's ``inputs``)
the same way, so that the structures msgspec then builds are bounded before they exist.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from fair_frontend.errors import InvalidArgument

WINDOW = 1 << 18  # bytes of JSON text examined at a time


def _table(chars: bytes) -> np.ndarray:
    table = np.zeros(256, dtype=np.bool_)
    table[list(chars)] = True
    return table


# Byte classes, for single bytes (lookups); over whole windows the comparisons below are
# several times faster than a table lookup per byte. Outside strings, valid JSON holds
# only whitespace (all bytes <= 32 there), punctuation, and the bytes of numbers and of
# true, false, null.
_WHITESPACE = _table(b" \t\r\n")
_NUMBER_START = _table(b"-0123456789NI")  # NaN, Infinity: JSON extensions Triton takes
_OPEN = _table(b"[{")
_QUOTE, _BACKSLASH, _COMMA, _SPACE = ord('"'), ord("\\"), ord(","), ord(" ")
_TRUE, _FALSE, _LEFT_BRACE = ord("t"), ord("f"), ord("{")
_BRACKET, _BRACE = ord("[") & 0xF9, ord("{") & 0xF9  # "[" "]" and "{" "}" masked alike


def _separators(w: np.ndarray) -> np.ndarray:
    """Bytes between the leaves of nested arrays: whitespace, ",", "[", "]"."""
    sep: np.ndarray = (w <= _SPACE) | (w == _COMMA) | ((w & 0xF9) == _BRACKET)
    return sep


def _integer_bytes(w: np.ndarray) -> np.ndarray:
    """Digits and "-": all an integer is made of (a fraction, an exponent, a literal such
    as true or NaN has some other byte)."""
    digits: np.ndarray = ((w >= ord("0")) & (w <= ord("9"))) | (w == ord("-"))
    return digits


def _depth_steps(w: np.ndarray) -> np.ndarray | None:
    """How each byte changes the nesting depth (+1 "[" "{", -1 "]" "}"); None where no
    byte of ``w`` does."""
    masked = w & 0xF9
    brackets = (masked == _BRACKET) | (masked == _BRACE)
    if not brackets.any():
        return None
    opens = brackets & ((w & 0x06) == 0x02)  # "[" 0x5b, "{" 0x7b; "]" 0x5d, "}" 0x7d
    step: np.ndarray = opens.view(np.int8) * 2 - brackets.view(np.int8)
    return step


class _Strings:
    """Which bytes of a JSON text lie in string literals (their quotes included), for one
    window after another of it; the state carried from window to window is whether the
    next one starts inside a string, and whether its first byte is escaped."""

    def __init__(self) -> None:
        self.inside = False
        self.escaped = False

    def mask(self, w: np.ndarray) -> np.ndarray | None:
        """The mask for window ``w``; None when no byte of it is in a string."""
        if not self.inside and not (w == _QUOTE).any():
            return None  # no string here (valid JSON has no backslash outside strings)
        text = w.tobytes()
        if self.escaped:
            text = b"_" + text[1:]  # escaped by the run that ended the last window
        # Escaped backslashes out of the way (left to right, as JSON reads them): every
        # backslash left then escapes the byte after it.
        text = text.replace(b"\\\\", b"__")
        self.escaped = text.endswith(b"\\")
        t = np.frombuffer(text, dtype=np.uint8)
        quote = t == _QUOTE
        quote[1:] &= t[:-1] != _BACKSLASH
        parity = np.bitwise_xor.accumulate(quote.view(np.uint8))
        if self.inside:
            parity ^= 1
        self.inside = bool(parity[-1])
        inside: np.ndarray = parity.view(np.bool_) | quote
        return inside


def _windows(a: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
    """``(offset, window, in-string mask or None)`` over the whole text ``a``."""
    strings = _Strings()
    for lo in range(0, a.size, WINDOW):
        w = a[lo : lo + WINDOW]
        yield lo, w, strings.mask(w)


def _bytes(text: Any) -> np.ndarray:
    return np.frombuffer(text, dtype=np.uint8)


def _first_byte(a: np.ndarray) -> int | None:
    """The first byte that is not whitespace (None for none)."""
    for lo in range(0, a.size, WINDOW):
        w = a[lo : lo + WINDOW]
        solid = np.flatnonzero(~_WHITESPACE[w])
        if solid.size:
            return int(w[solid[0]])
    return None


def first_byte(text: Any) -> int | None:
    """The first byte of a JSON text that is not whitespace (None for none)."""
    return _first_byte(_bytes(text))


def is_container(text: Any) -> bool:
    """Whether a JSON value is an array or an object (not a string, number or literal)."""
    first = first_byte(text)
    return first is not None and bool(_OPEN[first])


def count_byte(text: Any, byte: int, limit: int) -> int:
    """How many times ``byte`` occurs in ``text``, counting up to ``limit + 1``."""
    a = _bytes(text)
    n = 0
    for lo in range(0, a.size, WINDOW):
        n += int(np.count_nonzero(a[lo : lo + WINDOW] == byte))
        if n > limit:
            break
    return n


def count_members(text: Any, limit: int) -> int:
    """Members of a JSON array or object (valid JSON), counting up to ``limit + 1``: a
    count over ``limit`` is all the caller needs to refuse it. Commas at the top level
    of the container, outside strings, separate its members."""
    a = _bytes(text)
    depth = 0
    commas = 0
    opened = False  # past the container's own opening bracket
    values = False  # anything inside it but whitespace
    for _lo, w, inside in _windows(a):
        step = _depth_steps(w)
        comma = w == _COMMA
        if inside is not None:
            comma &= ~inside
            if step is not None:
                step[inside] = 0
        if step is None:  # no bracket here: every byte at the depth the window starts at
            if depth == 1:
                commas += int(np.count_nonzero(comma))
            if depth >= 1 and not values:
                values = bool((w > _SPACE).any())
        else:
            level = np.cumsum(step, dtype=np.int16)  # the depth after each byte
            level += depth
            if not values:
                inner = (w > _SPACE) & (level >= 1)
                if not opened and inner.any():
                    inner[int(np.argmax(inner))] = False  # the container's own bracket
                    opened = True
                values = bool(inner.any())
            commas += int(np.count_nonzero(comma & (level == 1)))
            depth = int(level[-1])
        if commas + int(values) > limit:
            break
    return commas + int(values)


@dataclass(frozen=True, slots=True)
class Leaves:
    """What ``scan_leaves`` found in a tensor's ``data``: the element count, the kinds of
    its elements, and the windows to convert it by (each starts at an element)."""

    text: Any  # the data's JSON text (a buffer)
    count: int
    cuts: tuple[int, ...]  # window starts, each an element's first byte
    firsts: tuple[int, ...]  # index of the element each window starts with
    numbers: bool  # every element is a number (NaN, Infinity and -Infinity too)
    integers: bool  # ... and all are integers (no fraction, exponent or literal)
    booleans: bool  # every element is true or false
    first_non_string: int  # index of the first element that is not a string (-1: none)
    has_object: bool  # an element is a JSON object (the count is then not exact)


def scan_leaves(name: str, text: Any) -> Leaves:
    """Pass 1 over ``data``'s text (valid JSON): its leaves, without converting any."""
    a = _bytes(text)
    first = _first_byte(a)
    if first != ord("["):
        raise InvalidArgument(f"input '{name}': 'data' must be a list")
    count = 0
    cuts: list[int] = []
    firsts: list[int] = []
    numbers = booleans = True
    fraction = has_object = False
    first_non_string = -1
    before = True  # the byte before the window is a separator (or there is none)
    for lo, w, inside in _windows(a):
        sep = _separators(w)
        if inside is not None:
            sep &= ~inside
        start = ~sep
        start[0] &= before
        start[1:] &= sep[:-1]
        before = bool(sep[-1])
        leading = w[start]  # each element's first byte
        n = int(leading.size)
        if not fraction:  # a byte of an element (outside strings) that no integer has
            fraction = bool((~sep & ~_integer_bytes(w)).any())
        if not n:
            continue
        first_at = int(np.argmax(start))
        last_at = start.size - 1 - int(np.argmax(start[::-1]))
        cuts.append(lo + first_at)
        firsts.append(count)
        if last_at != first_at:
            cuts.append(lo + last_at)  # an element that may run on past this window
            firsts.append(count + n - 1)
        numbers = numbers and bool(_NUMBER_START[leading].all())  # NaN, Infinity too
        booleans = booleans and bool(((leading == _TRUE) | (leading == _FALSE)).all())
        has_object = has_object or bool((leading == _LEFT_BRACE).any())
        if first_non_string < 0:
            other = np.flatnonzero(leading != _QUOTE)
            if other.size:
                first_non_string = count + int(other[0])
        count += n
    return Leaves(
        text=text,
        count=count,
        cuts=tuple(cuts),
        firsts=tuple(firsts),
        numbers=numbers,
        integers=numbers and not fraction,
        booleans=booleans,
        first_non_string=first_non_string,
        has_object=has_object,
    )


def check_kinds(name: str, datatype: str, shape: tuple[int, ...], leaves: Leaves) -> None:
    """The element count against the declared ``shape``, then the kinds of the elements
    against ``datatype``, with the messages the frontend has always given (an element that
    is an object leaves the count unknown: refused as a value of the wrong kind at once)."""
    if leaves.has_object:
        raise _wrong_kind(name, datatype, leaves)
    expected = 1
    for d in shape:
        expected *= d
    if leaves.count != expected:
        raise InvalidArgument(
            f"input '{name}': shape {list(shape)} needs {expected} elements, data has "
            f"{leaves.count}"
        )
    if not _kinds_fit(datatype, leaves):
        raise _wrong_kind(name, datatype, leaves)


def _kinds_fit(datatype: str, leaves: Leaves) -> bool:
    if datatype == "BYTES":
        return leaves.first_non_string < 0
    if datatype == "BOOL":
        return leaves.booleans
    if datatype.startswith(("INT", "UINT")):
        return leaves.integers
    return leaves.numbers


def _wrong_kind(name: str, datatype: str, leaves: Leaves) -> InvalidArgument:
    if datatype == "BYTES":
        index = max(leaves.first_non_string, 0)
        return InvalidArgument(f"input '{name}': BYTES element {index} is not a string")
    return InvalidArgument(f"input '{name}': JSON data holds values that are not {datatype}")


_LIST_TYPES: dict[str, Any] = {"BOOL": list[bool], "BYTES": list[str], "FP": list[float]}


def convert(name: str, datatype: str, dtype: np.dtype[Any], leaves: Leaves) -> np.ndarray:
    """Pass 2: the elements as a flat array of ``dtype`` (object, of bytes, for BYTES),
    window by window. Call after ``check_kinds``."""
    out = np.empty(leaves.count, dtype=dtype)
    if not leaves.count:
        return out
    kind = "INT" if dtype.kind in "iu" else "FP" if dtype.kind == "f" else datatype
    decoder = msgspec.json.Decoder(_LIST_TYPES.get(kind, list[int]))
    a = _bytes(leaves.text)
    ends = (*leaves.cuts[1:], a.size)
    for lo, hi, first, nxt in zip(
        leaves.cuts, ends, leaves.firsts, (*leaves.firsts[1:], leaves.count), strict=True
    ):
        n = nxt - first
        if n == 0:
            continue
        fixes: list[tuple[np.ndarray, float]] = []
        if n == 1:
            # One element (perhaps a long string): no masks over it, only its own bytes.
            element = a[lo:hi].tobytes().rstrip(b"[], \t\r\n")
            if kind == "FP" and element.lstrip(b"-")[:1] in (b"N", b"I"):
                fixes = [(np.zeros(1, dtype=np.intp), _NONFINITE[element[:2]])]
                element = b"0"
            text = b"[" + element + b"]"
        else:
            text, fixes = _flat_array(a[lo:hi], nonfinite=kind == "FP")
        try:
            values = decoder.decode(text)
        except msgspec.ValidationError:
            # Kinds were checked: only a number too large for a double gets here.
            raise InvalidArgument(f"input '{name}': value out of range for {datatype}") from None
        except msgspec.DecodeError as err:
            raise InvalidArgument(
                f"input '{name}': BYTES elements must be valid UTF-8 text in JSON: {err}"
            ) from None
        if len(values) != n:  # pragma: no cover - the scan and the decode agree
            raise AssertionError(f"window of {n} elements decoded as {len(values)}")
        typed = _typed(name, datatype, dtype, values)
        for at, value in fixes:
            typed[at] = value
        out[first:nxt] = typed
    return out


# NaN and Infinity by their first two bytes, as the fix-ups of ``convert`` write them.
_NONFINITE = {b"Na": np.nan, b"In": np.inf, b"-I": -np.inf}


def _flat_array(w: np.ndarray, *, nonfinite: bool = False) -> tuple[bytes, list[Any]]:
    """The leaves of window ``w`` (which starts at one, outside strings) as a flat JSON
    array: separators outside strings blanked, a comma put before every leaf but the
    first (the byte before a leaf is a separator, so the text keeps its length).

    ``nonfinite`` (numbers, no strings): NaN, Infinity and -Infinity (JSON extensions
    Triton takes, msgspec does not) are written as 0 (-0), and returned as fix-ups:
    ``(indices of the leaves, value)`` pairs."""
    inside = _Strings().mask(w)
    sep = _separators(w)
    if inside is not None:
        sep &= ~inside
    start = ~sep
    start[1:] &= sep[:-1]
    out = w.copy()
    out[sep] = _SPACE
    out[np.flatnonzero(start[1:])] = _COMMA
    fixes: list[Any] = []
    if nonfinite:
        lower = w | 0x20
        # Letters besides e/E: those of NaN and Infinity.
        letters = (lower >= ord("a")) & (lower <= ord("z")) & (lower != ord("e"))
        if letters.any():
            first = letters & ((w == ord("N")) | (w == ord("I")))
            first[1:] &= ~letters[:-1]  # the last N of NaN follows a letter
            out[letters] = _SPACE
            out[first] = ord("0")
            leading = w[start]
            second = w[np.minimum(np.flatnonzero(start) + 1, w.size - 1)]
            fixes = [
                (np.flatnonzero(leading == ord("N")), np.nan),
                (np.flatnonzero(leading == ord("I")), np.inf),
                (np.flatnonzero((leading == ord("-")) & (second == ord("I"))), -np.inf),
            ]
    return b"[" + out.tobytes() + b"]", fixes


def _typed(name: str, datatype: str, dtype: np.dtype[Any], values: list[Any]) -> Any:
    if datatype == "BYTES":
        try:
            return [v.encode() for v in values]
        except UnicodeEncodeError:  # pragma: no cover - msgspec refuses lone surrogates
            raise InvalidArgument(f"input '{name}': BYTES element is not valid Unicode") from None
    if dtype.kind in "iu":
        # numpy picks int64, uint64, or object for what neither holds: always out of range.
        wide = np.array(values)
        if wide.dtype == object:
            raise InvalidArgument(f"input '{name}': value out of range for {datatype}")
        info = np.iinfo(dtype)
        if wide.min() < info.min or wide.max() > info.max:
            raise InvalidArgument(f"input '{name}': value out of range for {datatype}")
        return wide
    return np.array(values, dtype=np.float64 if dtype.kind == "f" else dtype)


# ---- NaN and Infinity: what Triton's JSON parser takes and msgspec does not ---------------


def has_nonfinite(text: Any) -> bool:
    """Whether a JSON text (perhaps invalid) holds NaN or Infinity outside strings: an
    "N" or "I" there can be nothing else."""
    for _lo, w, inside in _windows(_bytes(text)):
        found = (w == ord("N")) | (w == ord("I"))
        if inside is not None:
            found &= ~inside
        if found.any():
            return True
    return False


_PLAIN = {b"NaN": b"0e0", b"Infinity": b"0e000000"}  # valid numbers of the same length


def without_nonfinite(text: Any) -> bytes:
    """A copy of a JSON text with NaN and Infinity (outside strings) written as numbers
    of the same length, so that msgspec parses it and every value keeps its offset: their
    own values are then read from the text itself (``http_codec._Text``)."""
    a = _bytes(text)
    out = a.copy()
    for lo, w, inside in _windows(a):
        for literal, plain in _PLAIN.items():
            at = np.flatnonzero(w == literal[0])
            if inside is not None:
                at = at[~inside[at]]
            at = at + lo
            at = at[at + len(literal) <= a.size]
            for k in range(1, len(literal)):
                at = at[a[at + k] == literal[k]]
            for k, byte in enumerate(plain):
                out[at + k] = byte
    return out.tobytes()
