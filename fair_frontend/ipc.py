"""Shells and core in separate processes: the records of ``fair_frontend.records``, framed
over a Unix socket.

Each shell process keeps one connection to the core. A frame is a 4-byte big-endian
length and a msgpack document (``msgspec``: a tagged record; numpy arrays inside as
``(dtype, shape, raw bytes)``, decoded as views of the frame). Both ends run on the
event loop's own transports (uvloop), coalesce what they write in one loop iteration
into one ``write``, and parse whatever arrived in one ``data_received``.

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

Fair intake: the core does not admit calls in the order bytes arrived. ``Intake`` keeps
the calls read but not yet admitted per tenant and admits them round robin, a slice at a
time, so that a burst one tenant poured into a socket delays another tenant's call by at
most one call per tenant with calls waiting, not by the whole burst.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from tritonclient.grpc import model_config_pb2, service_pb2

from fair_frontend.config import DEFAULT_STALLED_SHELL_S
from fair_frontend.errors import FrontendError, Internal, Unavailable
from fair_frontend.models import ModelInfo
from fair_frontend.protocol import deserialize_bytes, serialize_bytes
from fair_frontend.records import (
    Answer,
    Call,
    Cancel,
    Draining,
    Ended,
    Fault,
    Flushed,
    FlushTally,
    Grant,
    Hello,
    InfoAnswer,
    InfoQuery,
    Produced,
    QueueView,
    Ready,
    Settings,
    StatsAnswer,
    StatsQuery,
    Stop,
    Tally,
    TallyEntry,
    ToCore,
    ToShell,
)
from fair_frontend.shell.link import Inbox

if TYPE_CHECKING:
    from fair_frontend.core import Core, CoreRequest

log = logging.getLogger(__name__)

_HEADER = 4
MAX_FRAME = (1 << 31) - 1
# Unsent bytes past which a transport pauses its writer (and the stall watch starts), and
# below which it resumes it.
WRITE_BUFFER_HIGH = 8 << 20
WRITE_BUFFER_LOW = 2 << 20
STALL_CHECKS = 4  # checks of a paused link's progress per stalled_shell_s
TALLY_INTERVAL_S = 0.25
TALLY_MAX_KEYS = 1024  # distinct (tenant, model, outcome) before a tally goes early
INTAKE_SLICE = 64  # calls admitted before the loop runs anything else
QUEUE_VIEW_INTERVAL_S = 0.05  # how stale a shell's view of the full queues may be


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
_to_core = msgspec.msgpack.Decoder(ToCore, dec_hook=_dec_hook)  # type: ignore[arg-type]
_to_shell = msgspec.msgpack.Decoder(ToShell, dec_hook=_dec_hook)  # type: ignore[arg-type]


def encode(record: Any) -> bytes:
    body = _encoder.encode(record)
    return len(body).to_bytes(_HEADER, "big") + body


class _Framed(asyncio.Protocol):
    """Length-prefixed frames in and out; writes of one loop iteration go out together."""

    decoder: msgspec.msgpack.Decoder[Any]

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self.closed = False
        self.stall_s = DEFAULT_STALLED_SHELL_S  # queues.stalled_shell_s
        self._written = 0  # bytes handed to the transport, ever
        self._watch: asyncio.TimerHandle | None = None  # set while the transport is paused
        self._sent_seen = 0  # bytes sent at the last progress seen
        self._progress_at = 0.0  # the loop's time of that progress
        self.cut_off = False  # closed for not reading

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        transport.set_write_buffer_limits(  # type: ignore[attr-defined]
            high=WRITE_BUFFER_HIGH, low=WRITE_BUFFER_LOW
        )

    def data_received(self, data: bytes) -> None:
        buf = self._buffer
        buf += data
        start = 0
        end = len(buf)
        decode = self.decoder.decode
        records = []
        view = memoryview(buf)
        try:
            while end - start >= _HEADER:
                size = int.from_bytes(buf[start : start + _HEADER], "big")
                if end - start - _HEADER < size:
                    break
                begin = start + _HEADER
                # bytes(): decoded arrays are views of it, so it must outlive the buffer.
                records.append(decode(bytes(view[begin : begin + size])))
                start = begin + size
        except msgspec.DecodeError:
            log.exception("undecodable frame from %s: closing the connection", self.peer)
            view.release()
            self.close()
            return
        view.release()
        if start:
            del buf[:start]
        for record in records:
            self.received(record)

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

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.resume_writing()
            if self.cut_off:
                self.transport.abort()  # what waits is for a peer that does not read
            else:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.resume_writing()


# ---- the core's end -----------------------------------------------------------------------


class Intake:
    """Calls read from the shells but not admitted yet, admitted per tenant round robin.

    ``push`` is all ``data_received`` does per call; ``_admit`` runs soon after, admits
    one call per tenant in turn, ``INTAKE_SLICE`` at a time, and lets the loop run
    between slices (answers go out, batches come back, more is read).
    """

    def __init__(self, core: Core) -> None:
        self.core = core
        self._waiting: dict[str, deque[tuple[Call, ShellConnection]]] = {}
        self._scheduled = False
        self.admitted = 0  # calls admitted, in order (tests read how many went ahead)

    def push(self, call: Call, conn: ShellConnection) -> None:
        queue = self._waiting.get(call.tenant)
        if queue is None:
            queue = self._waiting[call.tenant] = deque()
        queue.append((call, conn))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._admit)

    def __len__(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def _admit(self) -> None:
        self._scheduled = False
        budget = INTAKE_SLICE
        waiting = self._waiting
        while waiting and budget > 0:
            for tenant in list(waiting):
                queue = waiting[tenant]
                call, conn = queue.popleft()
                if not queue:
                    del waiting[tenant]
                self.admitted += 1
                budget -= 1
                conn.admit(call)
                if budget <= 0:
                    break
        if waiting and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._admit)

    def drop(self, conn: ShellConnection) -> int:
        """Forget the calls of a shell that went away; returns how many."""
        dropped = 0
        for tenant in list(self._waiting):
            queue = self._waiting[tenant]
            kept = deque(item for item in queue if item[1] is not conn)
            dropped += len(queue) - len(kept)
            if kept:
                self._waiting[tenant] = kept
            else:
                del self._waiting[tenant]
        return dropped


class ShellConnection(_Framed):
    """The core's end of one shell's connection; the ``Route`` of that shell's calls."""

    decoder = _to_core

    def __init__(self, server: CoreServer) -> None:
        super().__init__()
        self.server = server
        self.core = server.core
        self.index = -1
        self.pid = 0
        self.ready: Ready | None = None
        self.calls: dict[int, CoreRequest | None] = {}  # sent, not finally answered
        self._tasks: set[asyncio.Task[None]] = set()
        self._flushes: dict[int, asyncio.Future[None]] = {}
        self._flush_ids = itertools.count(1)

    async def flush_tally(self) -> None:
        """Ask the shell for its tally now, and wait until it has arrived."""
        flush_id = next(self._flush_ids)
        fut = asyncio.get_running_loop().create_future()
        self._flushes[flush_id] = fut
        self.send(FlushTally(flush_id))
        try:
            await fut
        finally:
            self._flushes.pop(flush_id, None)

    @property
    def peer(self) -> str:
        return f"shell {self.index} (pid {self.pid})"

    def pause_writing(self) -> None:
        self.stall_s = self.core.config.queues.stalled_shell_s  # live: a reload may change it
        super().pause_writing()

    def received(self, record: Any) -> None:
        if isinstance(record, Call):
            self.calls[record.id] = None
            self.server.intake.push(record, self)
        elif isinstance(record, Cancel):
            if record.id in self.calls:
                req = self.calls.pop(record.id)
                if req is not None:
                    self.core.cancel(req)
                else:  # still in the intake: admitted, then cancelled at once
                    self.calls[record.id] = _CANCELLED
        elif isinstance(record, Produced):
            calls = self.calls
            for call_id, tokens in record.entries:
                req = calls.get(call_id)
                if req is not None and req is not _CANCELLED:
                    self.core.produced(req, tokens)
        elif isinstance(record, Ended):
            req = self.calls.pop(record.id, None)
            if req is not None and req is not _CANCELLED:
                err = record.fault.error() if record.fault is not None else None
                self.core.stream_ended(req, record.tokens, record.version, err, record.cancelled)
        elif isinstance(record, Tally):
            self.core.tally(record)
        elif isinstance(record, InfoQuery):
            self._spawn(self._info(record))
        elif isinstance(record, StatsQuery):
            self._spawn(self._stats(record))
        elif isinstance(record, Hello):
            self.index, self.pid = record.index, record.pid
            self.send(self.server.settings())
            if self.server.queue_view != _NO_VIEW:
                self.send(QueueView(*self.server.queue_view))
        elif isinstance(record, Ready):
            self.ready = record
            self.server.shell_ready(self)
        elif isinstance(record, Flushed):
            fut = self._flushes.pop(record.id, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        else:
            log.error("%s sent an unexpected %s", self.peer, type(record).__name__)

    def admit(self, call: Call) -> None:
        """The intake's turn for this call: into the core."""
        if self.closed:
            return
        if self.calls.get(call.id, None) is _CANCELLED:
            del self.calls[call.id]
            return
        req = self.core.submit(call, self)
        if call.id in self.calls:  # not answered at once
            if req is None:
                self.calls.pop(call.id, None)
            else:
                self.calls[call.id] = req

    def answer(self, answer: Answer | Grant) -> None:
        """The core's answer to one of this shell's calls (the ``Route``); a granted call
        stays until its shell says it ended."""
        if isinstance(answer, Answer):
            self.calls.pop(answer.id, None)
        self.send(answer)

    async def _info(self, query: InfoQuery) -> None:
        try:
            info = await self.core.model_info(query.model)
            raw = info.raw_config.SerializeToString() if info.raw_config is not None else b""
            self.send(InfoAnswer(query.id, raw, info.versions))
        except FrontendError as err:
            self.send(InfoAnswer(query.id, fault=Fault.of(err)))
        except Exception as err:
            log.exception("model lookup failed")
            self.send(InfoAnswer(query.id, fault=Fault.of(Internal(type(err).__name__))))

    async def _stats(self, query: StatsQuery) -> None:
        try:
            await self.server.flush_tallies()  # failures the shells answered count too
            msg = await self.core.statistics(query.model, query.version)
            self.send(StatsAnswer(query.id, msg.SerializeToString()))
        except FrontendError as err:
            self.send(StatsAnswer(query.id, fault=Fault.of(err)))
        except Exception as err:
            log.exception("statistics failed")
            self.send(StatsAnswer(query.id, fault=Fault.of(Internal(type(err).__name__))))

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.server.connections.discard(self)
        for task in self._tasks:
            task.cancel()
        for fut in self._flushes.values():
            if not fut.done():
                fut.set_result(None)
        waiting = self.server.intake.drop(self)
        dropped = self.core.drop_route(self)
        if waiting + dropped or not self.server.stopping:
            log.warning("%s disconnected: dropped %d of its requests", self.peer, waiting + dropped)
        self.calls.clear()
        self.server.shell_gone(self)


_CANCELLED: Any = object()  # a call cancelled while still in the intake
View = tuple[list[tuple[str, str, str]], list[tuple[str, str, int, str]]]  # QueueView's
_NO_VIEW: View = ([], [])


class CoreServer:
    """The core's listening socket: shells connect, get their settings, send calls."""

    def __init__(self, core: Core, settings: Callable[[], Settings], path: str) -> None:
        self.core = core
        self.settings = settings
        self.path = path
        self.intake = Intake(core)
        self.connections: set[ShellConnection] = set()
        self.on_ready: Callable[[ShellConnection], None] = lambda conn: None
        self.on_gone: Callable[[ShellConnection], None] = lambda conn: None
        self._server: asyncio.AbstractServer | None = None
        self.stopping = False
        self._view: View = _NO_VIEW
        self._viewer: asyncio.Task[None] | None = None

    async def flush_tallies(self, timeout_s: float = 1.0) -> None:
        """Every shell's tally, in the core's metrics before this returns (or the timeout)."""
        flushes = [conn.flush_tally() for conn in list(self.connections)]
        if flushes:
            await asyncio.wait([asyncio.ensure_future(f) for f in flushes], timeout=timeout_s)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: ShellConnection(self), self.path)
        os.chmod(self.path, 0o600)  # only this user's processes may act as shells
        self._viewer = loop.create_task(self._publish_queue_view())

    @property
    def queue_view(self) -> View:
        """The full queues (and byte caps close to full) the shells were last told of."""
        return self._view

    async def _publish_queue_view(self) -> None:
        """Tell the shells which queues are full, when that changes (``QueueView``)."""
        while True:
            await asyncio.sleep(QUEUE_VIEW_INTERVAL_S)
            view = self.core.full_queues()
            if view != self._view:
                self._view = view
                self.broadcast(QueueView(*view))

    def shell_ready(self, conn: ShellConnection) -> None:
        self.on_ready(conn)

    def shell_gone(self, conn: ShellConnection) -> None:
        self.on_gone(conn)

    def broadcast(self, record: Any) -> None:
        if isinstance(record, Stop):
            self.stopping = True
        for conn in list(self.connections):
            conn.send(record)

    async def close(self) -> None:
        if self._viewer is not None:
            self._viewer.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for conn in list(self.connections):
            conn.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


# ---- the shell's end ----------------------------------------------------------------------


class SocketLink(_Framed):
    """A shell process's link to the core (``fair_frontend.shell.link.CoreLink``)."""

    decoder = _to_shell

    def __init__(
        self,
        on_settings: Callable[[Settings], None],
        on_stop: Callable[[], None],
        on_lost: Callable[[], None],
    ) -> None:
        super().__init__()
        self.on_settings = on_settings
        self.on_stop = on_stop
        self.on_lost = on_lost
        self._ids = itertools.count(1)
        self._inboxes: dict[int, Inbox] = {}
        self._queries: dict[int, asyncio.Future[Any]] = {}
        self._tally: dict[tuple[str | None, str, str, str | None, str], list[float]] = {}
        self._tally_timer: asyncio.TimerHandle | None = None
        self._full: dict[tuple[str, str], str] = {}
        self._room: dict[tuple[str, str], tuple[int, str]] = {}
        # Output tokens of granted streams not yet told to the core, per call: told at
        # the end of this loop iteration, all calls' in one ``Produced``.
        self._produced: dict[int, int] = {}
        self.accepting = True

    @classmethod
    async def connect(
        cls,
        path: str,
        on_settings: Callable[[Settings], None],
        on_stop: Callable[[], None],
        on_lost: Callable[[], None],
    ) -> SocketLink:
        loop = asyncio.get_running_loop()
        _, link = await loop.create_unix_connection(
            lambda: cls(on_settings, on_stop, on_lost), path
        )
        return link

    # CoreLink

    def new_id(self) -> int:
        return next(self._ids)

    def submit(self, call: Call) -> Inbox:
        inbox = Inbox()
        if self.closed:
            inbox.answer(Answer(call.id, fault=Fault.of(Unavailable(_CORE_GONE))))
            return inbox
        call_id = call.id
        self._inboxes[call_id] = inbox
        inbox._cancel = lambda: self._cancel(call_id)
        inbox._produced = lambda tokens: self._tokens(call_id, tokens)
        inbox._end = lambda tokens, version, fault, cancelled: self._ended(
            call_id, tokens, version, fault, cancelled
        )
        super().send(call)
        return inbox

    def _cancel(self, call_id: int) -> None:
        if self._inboxes.pop(call_id, None) is not None:
            super().send(Cancel(call_id))

    def _tokens(self, call_id: int, tokens: int) -> None:
        """Output tokens a granted stream relayed: told to the core at the end of this
        loop iteration, with every other stream's (one ``Produced`` per iteration)."""
        produced = self._produced
        if not produced:
            asyncio.get_running_loop().call_soon(self._send_produced)
        produced[call_id] = produced.get(call_id, 0) + tokens

    def _send_produced(self) -> None:
        produced, self._produced = self._produced, {}
        if produced:
            super().send(Produced(list(produced.items())))

    def _ended(
        self,
        call_id: int,
        tokens: int,
        version: str,
        fault: FrontendError | None,
        cancelled: bool,
    ) -> None:
        """A granted stream ended: with the tokens not yet told (so none arrive after)."""
        tokens += self._produced.pop(call_id, 0)
        if self._inboxes.pop(call_id, None) is None:
            return
        sent = Fault.of(fault) if fault is not None else None
        super().send(Ended(call_id, tokens, version, sent, cancelled))

    async def model_info(self, model: str) -> ModelInfo:
        answer: InfoAnswer = await self._query(lambda i: InfoQuery(i, model))
        if answer.fault is not None:
            raise answer.fault.error()
        config = model_config_pb2.ModelConfig.FromString(answer.config)
        return ModelInfo.from_config(config, tuple(answer.versions))

    async def statistics(self, model: str, version: str) -> Any:
        answer: StatsAnswer = await self._query(lambda i: StatsQuery(i, model, version))
        if answer.fault is not None:
            raise answer.fault.error()
        return service_pb2.ModelStatisticsResponse.FromString(answer.message)

    async def _query(self, make: Callable[[int], Any]) -> Any:
        if self.closed:
            raise Unavailable(_CORE_GONE)
        query_id = self.new_id()
        fut = asyncio.get_running_loop().create_future()
        self._queries[query_id] = fut
        try:
            super().send(make(query_id))
            return await fut
        finally:
            self._queries.pop(query_id, None)

    def tally(self, entry: TallyEntry) -> None:
        """Aggregated, and sent every ``TALLY_INTERVAL_S``: a flood of refusals costs the
        core one record per interval, not one per request."""
        key = (entry.tenant, entry.model, entry.outcome, entry.failed_version, entry.door)
        counts = self._tally.get(key)
        if counts is None:
            self._tally[key] = [entry.count, entry.failed_s]
        else:
            counts[0] += entry.count
            counts[1] += entry.failed_s
        if len(self._tally) >= TALLY_MAX_KEYS:
            self.flush_tally()
        elif self._tally_timer is None:
            loop = asyncio.get_running_loop()
            self._tally_timer = loop.call_later(TALLY_INTERVAL_S, self.flush_tally)

    def queue_full(self, tenant: str, model: str, nbytes: int = 0) -> str | None:
        full = self._full
        if full:
            cap = full.get((tenant, model)) or full.get(("*", "*"))
            if cap is not None:
                return cap
        room = self._room
        if nbytes and room:
            for key in ((tenant, model), (tenant, "*"), ("*", "*")):
                left = room.get(key)
                if left is not None and nbytes > left[0]:
                    return left[1]
        return None

    def flush_tally(self) -> None:
        if self._tally_timer is not None:
            self._tally_timer.cancel()
            self._tally_timer = None
        if not self._tally:
            return
        entries = [
            TallyEntry(tenant, model, outcome, int(n), version, failed_s, door)
            for (tenant, model, outcome, version, door), (n, failed_s) in self._tally.items()
        ]
        self._tally.clear()
        super().send(Tally(entries))

    # from the core

    def received(self, record: Any) -> None:
        if isinstance(record, Answer):
            inbox = self._inboxes.get(record.id)
            if inbox is None:
                return  # its client went away
            if not inbox.granted:  # (a granted one's stream ends, then it goes)
                del self._inboxes[record.id]
            inbox.answer(record)
        elif isinstance(record, Grant):
            inbox = self._inboxes.get(record.id)
            if inbox is not None:
                inbox.answer(record)
        elif isinstance(record, (InfoAnswer, StatsAnswer)):
            fut = self._queries.get(record.id)
            if fut is not None and not fut.done():
                fut.set_result(record)
        elif isinstance(record, QueueView):
            self._full = {(tenant, model): cap for tenant, model, cap in record.full}
            self._room = {(tenant, model): (left, cap) for tenant, model, left, cap in record.room}
        elif isinstance(record, Settings):
            queues = record.config.get("queues")
            if isinstance(queues, dict) and "stalled_shell_s" in queues:
                self.stall_s = float(queues["stalled_shell_s"])
            self.on_settings(record)
        elif isinstance(record, FlushTally):
            self.flush_tally()
            super().send(Flushed(record.id))
        elif isinstance(record, Draining):
            self.accepting = False
        elif isinstance(record, Stop):
            self.accepting = False
            self.on_stop()
        else:
            log.error("the core sent an unexpected %s", type(record).__name__)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        gone = Fault.of(Unavailable(_CORE_GONE))
        for call_id, inbox in list(self._inboxes.items()):
            inbox.answer(Answer(call_id, fault=gone))
        self._inboxes.clear()
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(Unavailable(_CORE_GONE))
        self.on_lost()


_CORE_GONE = "the frontend's core process is gone"
