"""Streams to Triton over its generate extension: ``POST /v2/models/<m>[/versions/<v>]/
generate_stream``, Triton's own server-sent events, passed on as bytes.

Why: a client of the frontend's ``generate_stream`` reads exactly the events Triton writes.
Read from Triton's gRPC stream instead, every response was decoded into tensors and encoded
again as one such event, per token; here the shell reads only what it counts (the events'
token counts, an error event, the end of the body: ``shell.gateway``) and writes the bytes
as they came, several events in one write when they come together.

The wire: HTTP/1.1, one stream on a connection at a time, answered with a chunked body
(Triton writes each response as one chunk, ``data: {...}\\n\\n``); a connection whose
stream ended cleanly is kept for the next (``MAX_IDLE``). Closing the connection cancels
the request in Triton (its HTTP server cancels a request whose client went away: the
shipped ``llm`` counts it in ``fair_llm_cancelled_total`` within half a second). A client
that stops reading stops this connection's reading too, past ``HIGH_WATER`` bytes held
(TCP then holds Triton's sender), up to the watchdog's ``stalled_s``.

A request's answer before any event (Triton refusing it, or the model's error as its first
response) is Triton's status and ``{"error": ...}``, as ``http.error_of`` reads it. A
connection that could not be made is ``Unavailable(never_sent=True)``; one lost before the
body's end is ``Unavailable``: the gateway gives a call back to the core only while its
client has had nothing (``StreamRelay.relay``). A kept-alive connection Triton closed while it
was idle is found before its first byte and the request sent once more on a new one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from urllib.parse import quote

from fair_frontend.backends.protocol import Events
from fair_frontend.backends.triton.http import address, dial, error_of
from fair_frontend.backends.triton.upstream import upstream_message_error
from fair_frontend.backends.triton.watchdog import Watchdog
from fair_frontend.errors import FrontendError, Unavailable

MAX_IDLE = 64  # kept-alive connections per Triton, for the streams to come
HIGH_WATER = 256 * 1024  # bytes of events held for a consumer before reading pauses
_ERROR_EVENT = b'data: {"error":'  # the model's error, as Triton writes it in a stream


class _Dropped(Exception):
    """The connection ended before the whole answer came."""


# The states of a connection's answer (``_EventConnection``).
_HEAD, _SIZE, _CHUNK, _CHUNK_END, _TRAILER, _BODY, _DONE = range(7)


class _EventConnection(asyncio.Protocol):
    """One HTTP/1.1 connection to Triton: a request, then its answer, de-chunked as it
    comes (``take``)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.status = 0
        self.keep_alive = True
        self.heard = False  # any byte of the answer
        self._raw = b""  # received, not yet parsed
        self._body = bytearray()  # the answer's body, not yet taken
        self._state = _HEAD
        self._left = 0  # bytes left of the chunk (_CHUNK) or the body (_BODY; -1: to close)
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.heard = True
        if self._raw:  # the rest of a part that came before
            data = self._raw + data
        self._raw = self._parse(data)
        body = self._body
        if self._state == _DONE or self.status not in (0, 200) or b"\n\n" in body:
            self._wake()
        if len(body) > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _parse(self, raw: bytes) -> bytes:
        """What of ``raw`` is not parsed yet (a part of a line or of a chunk's end)."""
        pos, n = 0, len(raw)
        body = self._body
        while pos < n:
            state = self._state
            if state == _SIZE:
                end = raw.find(b"\r\n", pos)
                if end < 0:
                    break
                size = int(raw[pos:end].split(b";", 1)[0], 16)
                start = end + 2
                if size and start + size + 2 <= n:  # a whole chunk (Triton's: an event)
                    body += raw[start : start + size]
                    pos = start + size + 2
                    continue
                pos = start
                self._left = size
                self._state = _CHUNK if size else _TRAILER
            elif state == _CHUNK:
                take = min(self._left, n - pos)
                body += raw[pos : pos + take]
                pos += take
                self._left -= take
                if not self._left:
                    self._state = _CHUNK_END
            elif state == _CHUNK_END:
                if n - pos < 2:
                    break
                pos += 2
                self._state = _SIZE
            elif state == _HEAD:
                end = raw.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                lines = raw[pos:end].decode("latin-1").split("\r\n")
                pos = end + 4
                self.status = int(lines[0].split(" ", 2)[1])
                headers = {}
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip().lower()
                self.keep_alive = headers.get("connection") != "close"
                if "chunked" in headers.get("transfer-encoding", ""):
                    self._state = _SIZE
                elif "content-length" in headers:
                    self._left = int(headers["content-length"])
                    self._state = _BODY if self._left else _DONE
                else:
                    self._left = -1  # to the connection's end
                    self.keep_alive = False
                    self._state = _BODY
            elif state == _TRAILER:  # trailers (Triton sends none), then an empty line
                end = raw.find(b"\r\n", pos)
                if end < 0:
                    break
                if end == pos:
                    self._state = _DONE
                pos = end + 2
            elif state == _BODY:
                take = n - pos if self._left < 0 else min(self._left, n - pos)
                body += raw[pos : pos + take]
                pos += take
                if self._left >= 0:
                    self._left -= take
                    if not self._left:
                        self._state = _DONE
            else:  # _DONE: bytes past the answer (none expected): not kept alive
                self.keep_alive = False
                return b""
        return raw[pos:] if pos < n else b""

    def send(self, request: bytes) -> None:
        """A request, its answer read from here on (the connection's last one was whole)."""
        assert self.transport is not None
        self.status = 0
        self.heard = False
        self._state = _HEAD
        self._raw = b""
        self._body.clear()
        self.transport.write(request)

    @property
    def done(self) -> bool:
        return self._state == _DONE

    async def _wait(self) -> None:
        if self.closed:
            raise _Dropped()
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def head(self) -> int:
        """The answer's status, once its head has come."""
        while self._state == _HEAD:
            await self._wait()
        return self.status

    async def take(self) -> bytes | None:
        """The whole events come so far (waiting for one); None at the body's end."""
        while True:
            body = self._body
            end = body.rfind(b"\n\n") + 2
            if end > 1:
                data = bytes(body[:end])
                del body[:end]
                if self._paused and self.transport is not None and len(body) < HIGH_WATER // 2:
                    self._paused = False
                    self.transport.resume_reading()
                return data
            if self._state == _DONE or (self._left < 0 and self.closed):
                return None  # (a torn last event, never whole, is not passed on)
            await self._wait()

    async def rest(self) -> bytes:
        """The whole body (an error's answer)."""
        while not (self._state == _DONE or (self._left < 0 and self.closed)):
            await self._wait()
        return bytes(self._body)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
        self._wake()


class TritonEvents:
    """Streams to one Triton's generate extension (``http://host:port``)."""

    def __init__(self, url: str, *, request_timeout_s: float = 60.0) -> None:
        self.host, self.port = address(url)
        self.request_timeout_s = request_timeout_s
        self._idle: list[_EventConnection] = []
        # Streams sent, and connections made for them (tests and benchmarks read them).
        self.streams = 0
        self.connections = 0

    async def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    def stream(
        self,
        model: str,
        version: str,
        body: bytes,
        *,
        stalled_s: float | None = None,
        traceparent: str = "",
    ) -> SseStream:
        """One request (``body``: generate's JSON object) and its events (``SseStream``);
        a consumer that holds them for ``stalled_s`` has the request cancelled."""
        path = f"/v2/models/{quote(model, safe='')}"
        if version:
            path += f"/versions/{quote(version, safe='')}"
        trace_head = f"traceparent: {traceparent}\r\n" if traceparent else ""
        head = (
            f"POST {path}/generate_stream HTTP/1.1\r\nHost: triton\r\n"
            f"Content-Type: application/json\r\n{trace_head}Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.streams += 1
        return SseStream(self, head + body, self.request_timeout_s, stalled_s)

    async def _open(self, request: bytes, fresh: bool) -> tuple[_EventConnection, bool]:
        """A connection with ``request`` written on it, and whether it was kept alive."""
        while self._idle and not fresh:
            conn = self._idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                conn.send(request)
                return conn, True
        conn = await dial(_EventConnection, self.host, self.port)
        self.connections += 1
        conn.send(request)
        return conn, False

    def _release(self, conn: _EventConnection) -> None:
        if conn.keep_alive and not conn.closed and len(self._idle) < MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.close()


class SseStream:
    """One request to a model over ``generate_stream``: its events, as an async iterator of
    ``Events`` (the last one an error, if one ended it). ``stop(err)`` cancels it in
    Triton from outside (the consumer's next item is ``err``); ``on_stop`` hears of every
    stop at once (the watchdog's too): as ``forwarder.TritonStream``."""

    def __init__(
        self, client: TritonEvents, request: bytes, timeout_s: float, stalled_s: float | None
    ) -> None:
        self._client = client
        self._request = request
        self._watch = Watchdog(self.stop, timeout_s, stalled_s)
        self._conn: _EventConnection | None = None
        self.stopped: FrontendError | None = None
        self.on_stop: Callable[[FrontendError], None] = lambda err: None
        self._events = self._read()

    def stop(self, err: FrontendError) -> None:
        if self.stopped is None:
            self.stopped = err
            if self._conn is not None:
                self._conn.close()  # Triton cancels the request
            self.on_stop(err)

    def __aiter__(self) -> AsyncIterator[Events]:
        return self._events

    async def aclose(self) -> None:
        """Closed on every way out: cancels the request in Triton at once if not done."""
        self._watch.close()
        if self._conn is not None and not self._conn.done:
            self._conn.close()
        await self._events.aclose()

    async def _connect(self) -> _EventConnection:
        """The request sent and the head of its answer come: once more on a new connection
        where a kept-alive one turns out closed before any byte of the answer."""
        conn, kept = await self._client._open(self._request, fresh=False)
        self._conn = conn
        if kept:
            if self.stopped is not None:
                conn.close()
            try:
                await conn.head()
                return conn
            except _Dropped:
                if conn.heard or self.stopped is not None:
                    raise
            conn, _ = await self._client._open(self._request, fresh=True)
            self._conn = conn
        if self.stopped is not None:
            conn.close()
        await conn.head()
        return conn

    async def _read(self) -> AsyncGenerator[Events, None]:
        watch = self._watch
        conn: _EventConnection | None = None
        try:
            conn = await self._connect()
            watch.progress()
            if conn.status != 200:
                body = (await conn.rest()).strip()
                if body.startswith(b"data:"):
                    body = body[5:].strip()
                yield Events(error=error_of(conn.status, body))
                return
            while (data := await conn.take()) is not None:
                if self.stopped is not None:  # what came before the stop is not passed on
                    yield Events(error=self.stopped)
                    return
                watch.hold()
                cut = data.find(_ERROR_EVENT)
                if cut >= 0:  # the model's error: Triton's last event
                    yield Events(
                        data[:cut], model_error=upstream_message_error(error_message(data[cut:]))
                    )
                else:
                    yield Events(data)
                watch.progress()  # asked for more: the wait for Triton
            if self.stopped is not None:
                yield Events(error=self.stopped)
                return
            self._client._release(conn)
            conn = None
        except _Dropped:
            yield Events(
                error=self.stopped
                or Unavailable(
                    "Triton is unavailable: the connection closed before the stream ended",
                    never_sent=False,
                )
            )
        except FrontendError as err:  # not connected
            yield Events(error=self.stopped or err)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.stopped is None or (task is not None and task.cancelling()):
                raise  # the request's own cancellation (its client went away)
            yield Events(error=self.stopped)
        finally:
            watch.close()
            if conn is not None:
                conn.close()


def error_message(data: bytes) -> str:
    """The message of Triton's error event (``data: {"error": ...}``)."""
    payload = data[len(b"data: ") :].split(b"\n\n", 1)[0]
    try:
        return str(json.loads(payload)["error"])
    except (ValueError, KeyError, TypeError):
        return payload.decode("utf-8", "replace")
