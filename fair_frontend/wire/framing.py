"""Frames between the core and its shell processes: the records of
``fair_frontend.wire.records`` over a Unix socket (and, for shells on other hosts, a gRPC
stream or a TCP connection: ``fair_frontend.wire.remote``, ``fair_frontend.wire.tcp``).

A frame is a 4-byte big-endian length and a msgpack document (``msgspec``: a tagged
record; numpy arrays inside as ``(dtype, shape, raw bytes)``, decoded as views of the
frame), at most ``MAX_FRAME`` bytes: a longer one is refused by the writer
(``FrameTooLarge``) and, from a peer, closes the connection. An empty frame (length 0)
carries no record: a heartbeat (``start_heartbeat``), which the reader skips. Both ends
run on the event loop's own transports (uvloop), coalesce what they write in one loop
iteration into one ``write``, and parse whatever arrived in one ``data_received``.

Flow: a peer that reads slowly is waited for, one that stopped reading is cut off. What
one end writes and the other has not taken yet waits in the writer's transport; past its
high-water mark (``WRITE_BUFFER_HIGH``) the transport pauses the writer's protocol, and
from then on the writer watches the bytes actually sent: a link whose unsent bytes stay
above the mark while none are taken for ``queues.stalled_shell_s`` (the peer is hung or
stopped: SIGSTOP, a debugger) is cut, as if the peer had died. A large burst to a peer
that is reading, however slowly, is delivered whole. What waits is bounded by the work
in flight: one answer (or grant) per call; streams do not cross the socket (a shell relays
them from Triton itself), only their token reports, one record per loop iteration.

Why a socket of our own rather than a broker or ZeroMQ: the connection *is* the shell.
When a shell process dies its connection closes at once, and the core drops that shell's
queued work at that moment (``Core.drop_route``): nothing is left for answers that can
no longer be delivered, and nothing is answered twice. Order is kept per connection, so
a client's requests on one stream reach the core in the order it sent them.

The two ends: ``fair_frontend.core.shells`` (the core's) and
``fair_frontend.shell.socket_link`` (a shell process's).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import msgspec
import numpy as np

from fair_frontend.protocol import deserialize_bytes, serialize_bytes
from fair_frontend.wire.records import ToCore, ToShell

log = logging.getLogger(__name__)

_HEADER = 4
HEARTBEAT = bytes(_HEADER)  # an empty frame: no record, a sign of life
MAX_FRAME = (1 << 31) - 1  # the most one frame carries (a record's msgpack)
# Unsent bytes past which a transport pauses its writer (and the stall watch starts), and
# below which it resumes it.
WRITE_BUFFER_HIGH = 8 << 20
WRITE_BUFFER_LOW = 2 << 20
STALL_CHECKS = 4  # checks of a paused link's progress per stalled_shell_s
DEFAULT_STALLED_SHELL_S = 10.0  # queues.stalled_shell_s


class FrameTooLarge(ValueError):
    """A record whose frame would exceed ``MAX_FRAME``: it cannot cross."""


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            return ("|O", obj.shape, serialize_bytes(obj))
        return (obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    raise NotImplementedError(f"cannot send {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = obj
        if dtype == "|O":
            return deserialize_bytes(data, math.prod(shape), "tensor").reshape(shape)
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
    raise NotImplementedError(f"cannot receive {kind.__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
to_core = msgspec.msgpack.Decoder(ToCore, dec_hook=_dec_hook)
to_shell = msgspec.msgpack.Decoder(ToShell, dec_hook=_dec_hook)


def encode(record: Any) -> bytes:
    body = _encoder.encode(record)
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(
            f"a {type(record).__name__} of {len(body)} bytes exceeds the {MAX_FRAME}-byte frame"
        )
    return len(body).to_bytes(_HEADER, "big") + body


class Framed(asyncio.Protocol):
    """Length-prefixed frames in and out; writes of one loop iteration go out together."""

    decoder: msgspec.msgpack.Decoder[Any]
    max_frame = MAX_FRAME  # the largest frame taken from the peer; one over it ends the link

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self.closed = False
        self.stall_s = DEFAULT_STALLED_SHELL_S  # queues.stalled_shell_s
        self._written = 0  # bytes handed to the transport, ever
        self.received_bytes = 0  # bytes taken from the transport, ever
        self._watch: asyncio.TimerHandle | None = None  # set while the transport is paused
        self._sent_seen = 0  # bytes sent at the last progress seen
        self._progress_at = 0.0  # the loop's time of that progress
        self.cut_off = False  # closed for not reading
        self._beat: asyncio.TimerHandle | None = None  # set while heartbeats run
        self._beat_seen = (0, 0, 0.0)  # (bytes written, bytes received, when received last)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        transport.set_write_buffer_limits(  # type: ignore[attr-defined]
            high=WRITE_BUFFER_HIGH, low=WRITE_BUFFER_LOW
        )

    def reattach(self, transport: Any) -> None:
        """Start over on a new connection (a remote shell's, to the next core): what the
        old one had half read or not yet written is gone with it."""
        self.stop_heartbeat()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._buffer.clear()
        self._out = []
        self._written = 0
        self.closed = False
        self.cut_off = False
        self.transport = None
        self.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.received_bytes += len(data)
        buf = self._buffer
        buf += data
        start = 0
        end = len(buf)
        decode = self.decoder.decode
        records = []
        view = memoryview(buf)
        bad = False  # a frame over the bound, or one that does not decode
        try:
            while end - start >= _HEADER:
                size = int.from_bytes(buf[start : start + _HEADER], "big")
                if not size:  # an empty frame: a heartbeat (the TCP link's), no record
                    start += _HEADER
                    continue
                if size > self.max_frame:
                    log.error("%s sent a %d-byte frame: closing the connection", self.peer, size)
                    bad = True
                    break
                if end - start - _HEADER < size:
                    break
                begin = start + _HEADER
                # bytes(): decoded arrays are views of it, so it must outlive the buffer.
                records.append(decode(bytes(view[begin : begin + size])))
                start = begin + size
        except msgspec.DecodeError:
            log.exception("undecodable frame from %s: closing the connection", self.peer)
            bad = True
        view.release()
        if bad:
            buf.clear()  # nothing of this link is read again
        elif start:
            del buf[:start]
        # What came before a bad frame is taken first, as it would have been had the bad
        # one come in a later read: which records count must not hang on how TCP cut the
        # bytes (``tests/test_framing_properties.py``).
        for record in records:
            self.received(record)
        if bad:
            self.close()

    def received(self, record: Any) -> None:
        raise NotImplementedError

    @property
    def peer(self) -> str:
        return type(self).__name__

    def send(self, record: Any) -> None:
        if self.closed:
            return
        self._out.append(encode(record))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        if self.closed or self.transport is None or not out:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        self._written += len(data)
        self.transport.write(data)

    # Write flow control: the transport pauses this protocol past WRITE_BUFFER_HIGH unsent
    # and resumes it below WRITE_BUFFER_LOW; meanwhile the peer must take something every
    # stall_s, or it is cut off.

    def pause_writing(self) -> None:
        if self._watch is not None or self.closed:
            return
        loop = asyncio.get_running_loop()
        self._sent_seen = self._sent()
        self._progress_at = loop.time()
        self._watch = loop.call_later(self.stall_s / STALL_CHECKS, self._check_progress)

    def resume_writing(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _sent(self) -> int:
        """Bytes the peer has taken off the socket (or the kernel buffers hold for it)."""
        assert self.transport is not None
        return self._written - self.transport.get_write_buffer_size()

    def _check_progress(self) -> None:
        self._watch = None
        if self.closed or self.transport is None:
            return
        loop = asyncio.get_running_loop()
        sent = self._sent()
        if sent > self._sent_seen:
            self._sent_seen, self._progress_at = sent, loop.time()
        elif loop.time() - self._progress_at >= self.stall_s:
            log.error(
                "%s took none of %d unsent bytes for %.1f s (queues.stalled_shell_s): "
                "cutting it off",
                self.peer,
                self.transport.get_write_buffer_size(),
                loop.time() - self._progress_at,
            )
            self.cut_off = True
            self.close()
            return
        self._watch = loop.call_later(self.stall_s / STALL_CHECKS, self._check_progress)

    # Heartbeats (the raw TCP link, ``fair_frontend.wire.tcp``): an empty frame every
    # ``interval_s`` in which nothing else was written, and a peer from which nothing at
    # all arrived for ``silent_s`` is cut off, as if it had died. What gRPC's keepalive
    # pings do for its link; unlike TCP's own keepalive, it also notices a peer whose
    # kernel still answers but whose process stopped (SIGSTOP, a hung loop).

    def start_heartbeat(self, interval_s: float, silent_s: float) -> None:
        self.stop_heartbeat()
        loop = asyncio.get_running_loop()
        self._beat_seen = (self._written, self.received_bytes, loop.time())
        self._beat = loop.call_later(interval_s, self._heartbeat, interval_s, silent_s)

    def stop_heartbeat(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None

    def _heartbeat(self, interval_s: float, silent_s: float) -> None:
        self._beat = None
        if self.closed or self.transport is None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        written, received, heard = self._beat_seen
        if self.received_bytes != received:
            heard = now
        elif now - heard >= silent_s:
            log.error("%s sent nothing for %.1f s: cutting it off", self.peer, now - heard)
            self.cut_off = True
            Framed.close(self)  # the connection, not what a subclass's close ends besides
            return
        if self._written == written and not self._out:
            self._written += _HEADER
            self.transport.write(HEARTBEAT)
        self._beat_seen = (self._written, self.received_bytes, heard)
        self._beat = loop.call_later(interval_s, self._heartbeat, interval_s, silent_s)

    def close(self) -> None:
        self.stop_heartbeat()
        if self.transport is not None and not self.closed:
            self.closed = True
            self.resume_writing()
            if self.cut_off:
                self.transport.abort()  # what waits is for a peer that does not read
            else:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.stop_heartbeat()
        self.resume_writing()
