"""The door of the HTTP shell: one prologue for every POST route (issue 29, item 1).

Every inference route, KServe's (``/v2/models/{m}/infer``, ``generate``,
``generate_stream``) and the API's (``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, ``/v2/rerank``, ``/v1/rerank``), enters through ``Door`` and differs
only in what it does with the body once it is in. In this order, each step before the
work of the next (STYLE: "every input has a price"):

1. **Identity** from the headers (``Gateway.admit_early``: no key or an unknown one, a
   full queue), then the request's turn among its tenant's (``Gateway.turns``).
2. **The model**: from the path (KServe), or from the body (the API routes), where it is
   found by ``ModelScan`` in the first ``SCAN_BYTES`` as they arrive: a scan of the JSON
   text that follows strings and nesting and builds nothing. A body that names its model
   later (after a long array, as OpenAI's SDK writes ``messages`` before ``model``) is read
   on only up to the largest body a model of this tenant takes (``Door.reach``), and the
   member is then found by ``model_of`` (msgspec, skipping every other member unbuilt, off
   the event loop when large).
3. **Its name and access**: a name over ``MAX_NAME_BYTES`` is refused 400 without being
   echoed (a name still arriving is refused once its bytes prove it too long); a model
   the tenant may not call is refused as the route refuses it (the API routes: 404
   ``model_not_found``, whether it exists or not) before the rest of the body is read.
4. **The model's own bound** (``Gateway.wire_bound``): a declared Content-Length over it
   is refused unread, a body is cut off once it passes it, and the bytes read and decoded
   at once in this shell stay within ``server.http_max_reading_bytes`` (``Reading``; one
   that does not fit is refused 503). ``Expect: 100-continue`` is granted once the checks
   the headers allow have passed; the rest of the body must arrive within
   ``server.http_body_timeout_s`` (then 408).
5. **Decoding** (``Passage.decode``), on a worker thread for a large or compressed body.

A refusal at any step is one counted, logged outcome (``Gateway.rejected``) and reaches
the route as a ``FrontendError``, which answers it in its own envelope (KServe's
``{"error"}``, OpenAI's, Cohere's ``{"message"}``). A refusal that leaves a body unread
closes its connection after the answer (``close_abandoned``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from aiohttp.http import HttpVersion11

from fair_frontend.auth import Identity, identity_headers
from fair_frontend.errors import FrontendError, InvalidArgument, QueueFull, Unsupported
from fair_frontend.protocol import MAX_NAME_BYTES, check_name
from fair_frontend.shell.api.openai import ModelNotFound, ParamError
from fair_frontend.shell.gateway import Gateway

# A body is scanned for its model in its first SCAN_BYTES (a member named later is found
# once the body is in, within the tenant's reach): what a request that names a model it
# may not call costs the shell at most.
SCAN_BYTES = 32 << 10
# Bodies larger than this (or compressed ones) are decoded on a worker thread: parsing a
# megabyte of JSON holds the thread running it for about 20 ms on these CPUs, which on the
# event loop would stall every other client of this shell.
OFF_LOOP_BYTES = 256 << 10
# The longest a model name's JSON text can be and still decode to at most MAX_NAME_BYTES
# of UTF-8 (an escape, ``\\u0041``, is six bytes of text for one byte of name).
MAX_NAME_TEXT = 6 * MAX_NAME_BYTES

# Marks a request whose body was abandoned midway (refused, too large, too slow): its
# connection is closed after the answer, since the rest of the body would only be read to
# be discarded.
BODY_ABANDONED: web.RequestKey[bool] = web.RequestKey("body_abandoned", bool)
_T = TypeVar("_T")


class BodyTimeout(InvalidArgument):
    """The body did not arrive in time: HTTP's 408 Request Timeout (the client's fault,
    counted as invalid input)."""

    http_status = 408


def too_large(model: str, limit: int, what: str) -> InvalidArgument:
    return InvalidArgument(
        f"request too large: {what} exceeds {limit} bytes, the body limit for '{model}'"
    )


def _beyond_reach(limit: int, what: str) -> InvalidArgument:
    return InvalidArgument(
        f"request too large: {what} exceeds {limit} bytes, the largest body of any model "
        "this key may call"
    )


def encoded(headers: Mapping[str, str]) -> bool:
    return headers.get("content-encoding", "identity").strip().lower() not in ("", "identity")


async def expect_after_checks(request: web.Request) -> None:
    """``Expect`` handler of the POST routes: grants nothing itself. ``100 Continue`` is
    sent by the door once the checks the headers allow have passed, so a client that
    waits for it (curl, for large bodies) sends no body to be refused; aiohttp's default
    grants it at once."""
    expect = request.headers.get("Expect", "")
    if request.version == HttpVersion11 and expect.lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")


async def _grant_continue(request: web.Request) -> None:
    if (
        request.version == HttpVersion11
        and request.headers.get("Expect", "").lower() == "100-continue"
    ):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper starts after it


@web.middleware
async def close_abandoned(request: web.Request, handler: Any) -> web.StreamResponse:
    """``Connection: close`` on the answer to a request whose body was abandoned midway
    (aiohttp then reads and discards what is still coming for a bounded while, so that
    the client gets its answer, and closes)."""
    response: web.StreamResponse = await handler(request)
    if request.get(BODY_ABANDONED):
        response.force_close()
    return response


# ---- the model a body names -------------------------------------------------------------------

_SPACE = rb"[ \t\n\r]*+"
_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_SCALAR = rb'[^ \t\n\r,:"\[\]{}]++'
# Every spelling of the key "model" (a letter may be written as its \u escape).
_MODEL_KEY = rb'"(?:m|\\u006[dD])(?:o|\\u006[fF])(?:d|\\u0064)(?:e|\\u0065)(?:l|\\u006[cC])"'
# Groups (arrays, objects) nested at most this deep are skipped whole by one regex match;
# deeper ones a level at a time.
_GROUP_LEVELS = 12


def _content(levels: int) -> bytes:
    """Whatever may stand inside a group without closing it: text with no quote or
    bracket, whole strings, and whole groups ``levels`` deep."""
    inner = rb'(?:[^"\[\]{}]++|' + _STRING + rb")*+"
    for _ in range(levels):
        inner = rb'(?:[^"\[\]{}]++|' + _STRING + rb"|[\[{]" + inner + rb"[\]}])*+"
    return inner


_SPACE_RE = re.compile(_SPACE)
_SCALAR_RE = re.compile(_SCALAR)
_STRING_REST_RE = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+', re.DOTALL)
_CONTENT_RE = re.compile(_content(_GROUP_LEVELS), re.DOTALL)
_OPENINGS_RE = re.compile(rb"[\[{]++")
_CLOSINGS_RE = re.compile(rb"[\]}]++")
# Members after the first, ``, "key": value``, whose key is no spelling of "model" and
# whose value is whole within the bytes at hand (the next member's comma or the closing
# brace seen after it): skipped by one match.
_MEMBERS_RE = re.compile(
    rb"(?:," + _SPACE + rb"(?!" + _MODEL_KEY + rb")" + _STRING + _SPACE + rb":" + _SPACE
    + rb"(?:" + _STRING + rb"|" + _SCALAR + rb"|[\[{]" + _content(_GROUP_LEVELS) + rb"[\]}])"
    + _SPACE + rb"(?=[,}]))*+",
    re.DOTALL,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Named:
    """What a body says of its model: the name, or None where it names none (no
    top-level ``"model"``, or ``null``)."""

    model: str | None


def malformed(why: str) -> ParamError:
    return ParamError(None, f"We could not parse the JSON body of your request: {why}")


def _name_too_long() -> ParamError:
    return ParamError("model", f"model name is too long: the limit is {MAX_NAME_BYTES} bytes")


def _kind(first: int) -> str | None:
    """What a JSON value starting with ``first`` is, other than a string or null."""
    if first == ord("{"):
        return "an object"
    if first == ord("["):
        return "an array"
    if first in b"tf":
        return "a boolean"
    if first in b"-0123456789NI":  # NaN and Infinity as Python's json reads them
        return "a number"
    return None


def _name(text: bytes) -> Named:
    """The model a member's value (its JSON text, ``text``: whole, or b"" where there is no
    such member) names, or a refusal: a name too long to be one, a value not a string."""
    if not text or text == b"null":
        return Named(None)
    if text[:1] != b'"':
        kind = _kind(text[0])
        if kind is None:
            raise malformed("'model' has no value")
        raise ParamError("model", f"Invalid type for 'model': expected a string, got {kind}")
    if len(text) > MAX_NAME_TEXT + 2:
        raise _name_too_long()
    try:
        name = json.loads(text)
    except ValueError as exc:  # not UTF-8, a bad escape
        raise malformed(f"'model': {exc}") from None
    assert isinstance(name, str)
    return Named(name)


class ModelScan:
    """Finds a JSON object's top-level ``"model"`` from the first ``limit`` bytes of its
    text, fed as they arrive, following strings and nesting without building anything.

    ``feed`` returns ``Named`` once the member's value is whole (or the object closed
    without one) and None while it needs more bytes; once it has taken ``limit`` bytes
    without an answer it is ``exhausted`` and takes no more. Refusals (``ParamError``):
    a body that is not a JSON object, JSON broken before the member, a value that is not
    a string (or null), a name whose text is already longer than a name can be.

    The first member named "model" is the one found (``json.loads`` keeps the last of
    several: the route compares what its decoder found, ``Passage.named``). Where the
    text is not JSON, the scan may answer where a parser would refuse: the decoder then
    refuses it. Work: the bytes are matched by regular expressions (in C) a member, a
    string or a group at a time; a group nested deeper than ``_GROUP_LEVELS`` costs a
    few steps of Python more (about 3 ms for 32 KiB of the worst such text).
    """

    def __init__(self, limit: int = SCAN_BYTES) -> None:
        self.limit = limit
        self.text = bytearray()  # what it took, at most ``limit`` bytes
        self.exhausted = False
        self._pos = 0  # where the scan goes on
        self._state: Callable[[int], Named | None] = self._start
        self._depth = 0  # groups open inside a top-level value being skipped
        self._mark = 0  # the opening quote of the string being read
        self._is_model = False  # the key just read is "model"

    def feed(self, data: bytes) -> Named | None:
        if self.exhausted:
            return None
        room = self.limit - len(self.text)
        self.text += data[:room]
        found = self._run()
        if found is None and (len(data) >= room):
            self.exhausted = True
        return found

    def finish(self) -> Named:
        """The answer at the end of a body that gave none: its text ends too early."""
        found = self._run()
        if found is not None:
            return found
        if self._state == self._start:
            raise malformed("the body is empty")
        raise malformed("the body ends before its JSON object does")

    def _run(self) -> Named | None:
        end = len(self.text)
        while True:
            before = self._pos, self._state
            found = self._state(end)
            if found is not None:
                return found
            if (self._pos, self._state) == before:  # waits for more bytes
                return None

    # Each state reads from ``_pos`` what it can and moves on (or returns a ``Named``);
    # a state that cannot decide with the bytes at hand leaves ``_pos`` where it resumes.

    def _space(self) -> int:
        m = _SPACE_RE.match(self.text, self._pos)
        assert m is not None
        self._pos = m.end()
        return self._pos

    def _start(self, end: int) -> Named | None:
        if self._space() < end:
            if self.text[self._pos] != ord("{"):
                raise ParamError(None, "The request body must be a JSON object")
            self._pos += 1
            self._state = self._first_key
        return None

    def _first_key(self, end: int) -> Named | None:
        if self._space() < end:
            if self.text[self._pos] == ord("}"):
                return Named(None)
            self._state = self._key
        return None

    def _key(self, end: int) -> Named | None:
        if self._space() < end:
            if self.text[self._pos] != ord('"'):
                raise malformed(f"expected a member's name at byte {self._pos}")
            self._mark = self._pos
            self._pos += 1
            self._state = self._in_key
        return None

    def _string_end(self, end: int) -> bool:
        """Read on in the string opened at ``_mark``: True once its closing quote is
        read (``_pos`` after it)."""
        m = _STRING_REST_RE.match(self.text, self._pos)
        assert m is not None
        self._pos = m.end()
        if self._pos < end and self.text[self._pos] == ord('"'):
            self._pos += 1
            return True
        return False

    def _in_key(self, end: int) -> Named | None:
        if self._string_end(end):
            key = self.text[self._mark + 1 : self._pos - 1]
            # "model" with its letters escaped is at most 30 bytes of text.
            self._is_model = key == b"model" or (
                b"\\" in key and len(key) <= 30 and _decoded(key) == "model"
            )
            self._state = self._colon
        return None

    def _colon(self, end: int) -> Named | None:
        if self._space() < end:
            if self.text[self._pos] != ord(":"):
                raise malformed(f"expected ':' at byte {self._pos}")
            self._pos += 1
            self._state = self._value
        return None

    def _value(self, end: int) -> Named | None:
        if self._space() >= end:
            return None
        first = self.text[self._pos]
        if self._is_model:
            if first == ord('"'):
                self._mark = self._pos
                self._pos += 1
                self._state = self._in_model
            elif first == ord("n"):
                if end - self._pos >= 4:
                    return _name(bytes(self.text[self._pos : self._pos + 4]))
            elif first in b",:]}":
                raise malformed(f"expected a value at byte {self._pos}")
            else:
                return _name(bytes(self.text[self._pos : self._pos + 1]))
            return None
        if first == ord('"'):
            self._mark = self._pos
            self._pos += 1
            self._state = self._in_value
        elif first in b"[{":
            self._pos += 1
            self._depth = 1
            self._state = self._in_group
        elif first in b",:]}":
            raise malformed(f"expected a value at byte {self._pos}")
        else:
            self._state = self._in_scalar
        return None

    def _in_model(self, end: int) -> Named | None:
        if self._string_end(end):
            return _name(bytes(self.text[self._mark : self._pos]))
        if self._pos - self._mark > MAX_NAME_TEXT + 2:
            raise _name_too_long()
        return None

    def _in_value(self, end: int) -> Named | None:
        if self._string_end(end):
            self._state = self._after_value
        return None

    def _in_scalar(self, end: int) -> Named | None:
        m = _SCALAR_RE.match(self.text, self._pos)
        if m is not None:
            self._pos = m.end()
        if self._pos < end:
            self._state = self._after_value
        return None

    def _in_group(self, end: int) -> Named | None:
        while True:
            m = _CONTENT_RE.match(self.text, self._pos)
            assert m is not None
            self._pos = m.end()
            if self._pos >= end:
                return None
            c = self.text[self._pos]
            if c == ord('"'):  # a string the bytes at hand do not close
                self._mark = self._pos
                self._pos += 1
                self._state = self._in_group_string
                return None
            if c in b"[{":  # a group too deep to match whole: all but its last levels
                m = _OPENINGS_RE.match(self.text, self._pos)
                assert m is not None
                entered = max(1, m.end() - self._pos - _GROUP_LEVELS)
                self._depth += entered
                self._pos += entered
                continue
            m = _CLOSINGS_RE.match(self.text, self._pos)
            assert m is not None
            closed = m.end() - self._pos
            if closed < self._depth:
                self._depth -= closed
                self._pos += closed
                continue
            self._pos += self._depth  # the value's own closing is in this run
            self._depth = 0
            self._state = self._after_value
            return None

    def _in_group_string(self, end: int) -> Named | None:
        if self._string_end(end):
            self._state = self._in_group
        return None

    def _after_value(self, end: int) -> Named | None:
        if self._space() >= end:
            return None
        c = self.text[self._pos]
        if c == ord("}"):
            return Named(None)
        if c != ord(","):
            raise malformed(f"expected ',' or '}}' at byte {self._pos}")
        m = _MEMBERS_RE.match(self.text, self._pos)
        assert m is not None
        if m.end() > self._pos:
            self._pos = m.end()  # whole members that are not "model"
            return None
        self._pos += 1
        self._state = self._key
        return None


def _decoded(text: bytearray) -> str:
    """A JSON string's value from the text between its quotes."""
    try:
        value = json.loads(b'"' + text + b'"')
    except ValueError as exc:
        raise malformed(str(exc)) from None
    assert isinstance(value, str)
    return value


class _Model(msgspec.Struct):
    """A body's ``model`` member as its JSON text; every other member skipped unbuilt."""

    model: msgspec.Raw = msgspec.Raw()


_MODEL_OF = msgspec.json.Decoder(_Model)


def model_of(body: bytes) -> Named:
    """The model a whole JSON body names (``ModelScan``'s answer where the member is
    beyond its reach): msgspec skips every other member without building it."""
    try:
        text = _MODEL_OF.decode(body).model
    except msgspec.ValidationError:
        raise ParamError(None, "The request body must be a JSON object") from None
    except msgspec.DecodeError as exc:
        raise malformed(str(exc)) from None
    return _name(bytes(text))


# ---- bytes read at once ---------------------------------------------------------------------


class Reading:
    """The bytes of bodies a shell reads and decodes at once, against
    ``server.http_max_reading_bytes``."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.held = 0

    def hold(self, size: int) -> Hold:
        hold = Hold(self)
        hold.resize(size)
        return hold

    def _take(self, more: int) -> None:
        limit = self.gateway.config.http_max_reading_bytes()
        if more > 0 and self.held + more > limit:
            raise QueueFull(
                f"{limit} bytes of request bodies are being read in this shell "
                "(server.http_max_reading_bytes)"
            )
        self.held += more


class Hold:
    """One body's share of ``Reading``: resized as its bound becomes known, released
    once it is decoded."""

    def __init__(self, reading: Reading) -> None:
        self.reading = reading
        self.size = 0

    def resize(self, size: int) -> None:
        """Hold ``size`` bytes (503 ``QueueFull`` where more do not fit: it holds what it
        held)."""
        self.reading._take(size - self.size)
        self.size = size

    def release(self) -> None:
        self.reading.held -= self.size
        self.size = 0


# ---- a request through the door ---------------------------------------------------------------


class _Body:
    """One request's body as it is read: its chunks, within its deadline."""

    def __init__(self, request: web.Request, timeout_s: float) -> None:
        self.request = request
        self.timeout_s = timeout_s
        self.deadline = asyncio.get_running_loop().time() + timeout_s
        self.chunks: list[bytes] = []
        self.size = 0
        self.whole = False

    async def chunk(self, limit: int, too_much: Callable[[], FrontendError]) -> bytes:
        """The next bytes (b"" at the end), refused once more than ``limit`` came."""
        content = self.request.content
        data = content.read_nowait()  # what has come (a small body: all of it), no timer
        if not data and not content.at_eof():
            try:
                async with asyncio.timeout_at(self.deadline):
                    data = await content.readany()
            except TimeoutError:
                raise BodyTimeout(
                    f"the request body did not arrive within {self.timeout_s:g} s "
                    "(server.http_body_timeout_s)"
                ) from None
        if not data:
            self.whole = True
            return data
        self.size += len(data)
        if self.size > limit:
            raise too_much()
        self.chunks.append(data)
        return data

    async def rest(self, limit: int, too_much: Callable[[], FrontendError]) -> None:
        while not self.whole:
            await self.chunk(limit, too_much)

    def joined(self) -> bytes:
        body = b"".join(self.chunks)
        self.chunks = [body]
        return body


@dataclass
class Passage:
    """A request past the door: who sent it, for which model, and its body (read whole,
    held in ``Reading`` until decoded)."""

    headers: dict[str, str]
    started: float  # time.monotonic() at its arrival
    model: str = ""  # "" until known
    known: Identity | None = None  # the tenant, as far as the headers tell
    _body: _Body | None = None
    _hold: Hold | None = None
    _reading: bool = False  # its body is being read: a refusal leaves it unread

    @property
    def tenant(self) -> str | None:
        return self.known.tenant if self.known is not None else None

    @property
    def size(self) -> int:
        return self._body.size if self._body is not None else 0

    async def decode(self, decode: Callable[..., _T], *args: Any) -> _T:
        """``decode(body, *args)``: on a worker thread for a body over ``OFF_LOOP_BYTES``
        (or a compressed one), on the event loop for a small one (where the hop to a
        thread would cost more than the decode). The body is then let go of, and its
        hold released."""
        assert self._body is not None
        body, self._body.chunks = self._body.chunks, []
        try:
            if self.size > OFF_LOOP_BYTES or encoded(self.headers):
                return await asyncio.to_thread(_joined_then, body, decode, args)
            return _joined_then(body, decode, args)
        finally:
            self.release()

    def named(self, decoded: str | None, default: str | None = None) -> None:
        """The decoder found the model the door found (JSON keeps the last of several
        members of one name, the door's scan the first): else 400."""
        if (decoded or default) != self.model:
            raise ParamError("model", "'model' is given more than once, with different values")

    def release(self) -> None:
        if self._hold is not None:
            self._hold.release()


def _joined_then(chunks: list[bytes], decode: Callable[..., _T], args: tuple[Any, ...]) -> _T:
    body = b"".join(chunks)
    del chunks[:]  # the chunks go as the body is made: never three copies
    return decode(body, *args)


class Door:
    """The prologue of every POST route of one HTTP shell (the module docstring)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.reading = Reading(gateway)

    def path(
        self,
        request: web.Request,
        model: str,
        ahead: Callable[[], Awaitable[None]] | None = None,
    ) -> contextlib.AbstractAsyncContextManager[Passage]:
        """A KServe route: ``model`` from its path. ``ahead``: the route's own checks
        before its body is read (generate: the model exists, its version, the body's
        encoding)."""
        return self._through(request, lambda p: self._by_path(request, p, model, ahead))

    def body(
        self, request: web.Request, default: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[Passage]:
        """An API route: the model named in the JSON body's top-level ``"model"`` (a body
        that names none: ``default``, else 400)."""
        return self._through(request, lambda p: self._by_body(request, p, default))

    @contextlib.asynccontextmanager
    async def _through(
        self, request: web.Request, enter: Callable[[Passage], Awaitable[None]]
    ) -> AsyncIterator[Passage]:
        """The passage once ``enter`` let it in; a refusal in it or in the route's block
        (until the route hands the request to the gateway) is counted and logged, and the
        connection of a body left unread closed after the answer."""
        passage = Passage(
            identity_headers(request.headers.items(), request.remote), time.monotonic()
        )
        try:
            try:
                await enter(passage)
                passage._reading = False
                yield passage
            finally:
                passage.release()
        except FrontendError as err:
            if passage._reading:
                request[BODY_ABANDONED] = True
            latency_s = time.monotonic() - passage.started
            self.gateway.rejected(passage.model, passage.headers, err, latency_s)
            raise

    def reach(self, known: Identity | None) -> int:
        """The largest body a model this tenant may call takes (the configured bounds:
        a model's own is at most its endpoint's); any model's where the tenant is not
        known from the headers."""
        config = self.gateway.config
        if known is None:
            return config.max_wire_bytes()
        access = self.gateway.access
        bounds = [
            endpoint.max_wire_bytes
            for name, endpoint in config.endpoints.items()
            if access.allows(known.tenant, name)
        ]
        if access.opens_beyond(known.tenant, config.endpoints):
            bounds.append(config.default_endpoint.max_wire_bytes)
        return max(bounds, default=SCAN_BYTES)

    # ---- the model in the path -----------------------------------------------------------

    async def _by_path(
        self,
        request: web.Request,
        p: Passage,
        model: str,
        ahead: Callable[[], Awaitable[None]] | None,
    ) -> None:
        gateway = self.gateway
        p.model = model
        p.known = gateway.admit_early(model, p.headers)
        check_name("model name", model)  # (where the headers name no tenant too)
        # Read and decoded in turn with other tenants' requests (``shell.turns``).
        await gateway.turns.take(p.tenant)
        if ahead is not None:
            await ahead()
        p._reading = True
        # Held from the headers: its declared length; one that declares none or is
        # compressed, its model's bound (as far as it could grow); one declared over its
        # bound, nothing (refused unread below).
        configured = gateway.config.endpoint(model).max_wire_bytes
        declared = request.content_length
        size = configured if declared is None or encoded(p.headers) else declared
        p._hold = self.reading.hold(0 if size > configured else size)
        bound = await gateway.wire_bound(model)
        if declared is not None and declared > bound:
            raise too_large(model, bound, f"the declared Content-Length of {declared} bytes")
        await _grant_continue(request)
        p._body = _Body(request, gateway.config.server.http_body_timeout_s)
        await p._body.rest(bound, lambda: too_large(model, bound, "the body"))

    # ---- the model in the body -----------------------------------------------------------

    async def _by_body(self, request: web.Request, p: Passage, default: str | None) -> None:
        gateway = self.gateway
        p.known = gateway.admit_early("", p.headers)
        await gateway.turns.take(p.tenant)
        if encoded(p.headers):
            raise Unsupported(
                f"Content-Encoding '{p.headers['content-encoding'].strip()}' is not "
                "supported on this route: send the JSON body as it is"
            )
        p._reading = True
        reach = self.reach(p.known)
        declared = request.content_length
        if declared is not None and declared > reach:
            raise _beyond_reach(reach, f"the declared Content-Length of {declared} bytes")
        # Until its model is known and let in, a body holds what the scan reads of it.
        p._hold = self.reading.hold(
            min(declared, SCAN_BYTES) if declared is not None else SCAN_BYTES
        )
        await _grant_continue(request)
        body = p._body = _Body(request, gateway.config.server.http_body_timeout_s)
        scan = ModelScan(SCAN_BYTES)
        found: Named | None = None
        while found is None and not scan.exhausted:
            chunk = await body.chunk(reach, lambda: _beyond_reach(reach, "the body"))
            found = scan.feed(chunk) if chunk else scan.finish()
        if found is not None:
            bound = await self._let_in(p, found, default)
            if declared is not None and declared > bound:
                raise too_large(p.model, bound, f"the declared Content-Length of {declared} bytes")
            if body.size > bound:
                raise too_large(p.model, bound, "the body")
            p._hold.resize(declared if declared is not None else bound)
            await body.rest(bound, lambda: too_large(p.model, bound, "the body"))
            return
        # Not among the first SCAN_BYTES (after a long array, say): the body is read
        # within the tenant's reach, and the member found in it whole.
        p._hold.resize(declared if declared is not None else reach)
        await body.rest(reach, lambda: _beyond_reach(reach, "the body"))
        if body.size > OFF_LOOP_BYTES:
            found = await asyncio.to_thread(lambda: model_of(body.joined()))
        else:
            found = model_of(body.joined())
        bound = await self._let_in(p, found, default)
        if body.size > bound:
            raise too_large(p.model, bound, "the body")
        p._hold.resize(body.size)

    async def _let_in(self, p: Passage, found: Named, default: str | None) -> int:
        """The model a body names, checked in order: its name's length (400, unechoed),
        the tenant may call it (404, as OpenAI answers for a model that does not exist or
        that the key has no access to: no name a client tries tells which), what the
        headers and the name decide (a closed tier, a full queue: 503); then its bound,
        from its description (404 where Triton has no such model)."""
        gateway = self.gateway
        model = found.model or default
        if not model:
            raise ParamError("model", "you must provide a model parameter")
        try:
            check_name("model name", model)
        except InvalidArgument as err:
            raise ParamError("model", err.message) from None
        p.model = model
        if p.known is not None and not gateway.access.allows(p.known.tenant, model):
            raise ModelNotFound(model, "does not exist or you do not have access to it")
        p.known = gateway.admit_early(model, p.headers) or p.known
        return await gateway.wire_bound(model)
