"""A shell's link to cores on other hosts (``fair-frontend shell --core HOST:PORT``).

The records are ``SocketLink``'s; they ride a gRPC stream (``fair_frontend.wire.remote``)
or, with ``--link tcp``, a TCP connection of their own (``fair_frontend.wire.tcp``: the
secret in its preamble, heartbeats for liveness) to whichever of the given cores leads;
all that follows holds for either. The link outlives a connection: when the core it
was connected to goes away (killed, its host gone, or stepping down), the shell keeps
every call not yet answered, finds the next leader (trying each core in turn, backing off
to once a second) and sends those calls to it again, in the order they came.

What a client sees across a failover:
* a call that was queued, or not yet sent: answered by the new leader, later by the gap;
* a call whose batch had reached Triton: sent again too (the old core's answer died with
  it), so Triton may run it twice; the client gets one answer. A step of a sequence is
  the exception: its state lives on the Triton the old core chose, so it is answered
  UNAVAILABLE (retryable) rather than replayed (the sequence goes on: a new leader that
  resumed the old one's state, ``fair_frontend.fleet.debt``, knows it and its Triton);
* a granted stream: untouched. The shell streams it from Triton itself; its tokens reach
  the client as before. The shell tells the new leader of it (``Running``), which holds
  its slot until it ends: the engine's slots stay exact across the failover. One whose
  Triton was gone before anything of it reached its client is a call again (held,
  ``Inbox.again``), sent to the next core like the rest if its grant had not come;
* a core that stops cleanly (SIGTERM) serves what it can in its drain; a call it refuses
  for stopping (``SHUTTING_DOWN``) never reached Triton, and is held for the next;
* a model's lookup, its statistics or a precharge asked while no core is connected:
  held as calls are, and asked of the next core (a shell that never served a model
  holds its first call through a failover, not only the calls it has looked up); a
  lookup or statistics query lost with its core is asked again of the next (it changes
  nothing), a precharge is not (the old core may have counted it);
* no core for ``hold_s``: the calls held that long are answered UNAVAILABLE.

Meanwhile the shell stays ready (for ``hold_s`` at most): a failover takes seconds, less
than a load balancer takes to act on readiness, and what arrives is held and sent on like
the rest; turning every shell unready at once would leave tenants no address at all. A
core that refuses the secret (UNAUTHENTICATED, or the TCP link's REFUSED) before this
shell ever connected is a configuration error: the shell exits (``SECRET_REFUSED``) rather
than retry forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from fair_frontend.errors import SHUTTING_DOWN, Unavailable
from fair_frontend.shell.link import Inbox, gone_before_answered
from fair_frontend.shell.socket_link import CORE_GONE, SocketLink
from fair_frontend.wire.records import (
    Answer,
    Call,
    Draining,
    Fault,
    Grant,
    Group,
    Hello,
    InfoQuery,
    Ready,
    RowsDone,
    Running,
    Settings,
    StatsQuery,
    Stop,
)
from fair_frontend.wire.remote import (
    CHANNEL_OPTIONS,
    METHOD,
    SECRET_HEADER,
    StreamTransport,
    Tls,
    rpc_error_text,
)
from fair_frontend.wire.tcp import (
    ACCEPTED,
    HEARTBEAT_S,
    REFUSED,
    SILENT_S,
    client_context,
    preamble,
    split_address,
    tune,
)

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # for a core's first record (its Settings) once the stream is open
# The first pause after trying every core, and the cap it doubles to: a refused connection
# costs a core nothing, and the cap adds to every failover's gap.
RETRY_S = (0.05, 0.1)
HOLD_CHECK_S = 0.25
# Each try at a core on a connection of its own, reconnecting at once: by default gRPC
# shares subchannels between a process's channels and backs off a refused address for
# 1 s, then 1.6 s and more, so a shell that tried the standby's port before it led
# would reach it seconds after it leads.
CONNECT_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", int(RETRY_S[0] * 1000)),
    ("grpc.min_reconnect_backoff_ms", int(RETRY_S[0] * 1000)),
    ("grpc.max_reconnect_backoff_ms", int(RETRY_S[1] * 1000)),
]
SECRET_REFUSED = 78  # EX_CONFIG: the exit status of a shell whose secret no core takes


@dataclass(slots=True)
class _Relayed:
    """A granted stream this shell relays: what a next core needs to adopt it
    (``Running``): the call, its Triton, when its limits counted it, and the tokens
    relayed so far."""

    call: Call
    backend: int
    limits_at: float
    relayed: int = 0


class SecretRefused(RuntimeError):
    """A core refused this shell's secret."""


class RemoteLink(SocketLink):
    """A shell's link to the leading one of ``cores`` (see the module's doc)."""

    def __init__(
        self,
        cores: list[str],
        secret: bytes,
        hello: Hello,
        on_settings: Callable[[Settings], None],
        on_stop: Callable[[], None],
        on_lost: Callable[[], None],
        hold_s: float = 60.0,
        tls: Tls | None = None,
        link: str = "grpc",
    ) -> None:
        super().__init__(on_settings, on_stop, on_lost)
        self.link = link
        self._credentials = None
        self._ssl: ssl.SSLContext | None = None
        if link == "tcp":
            self._ssl = client_context(tls) if tls is not None else None
            self._preamble = preamble(secret)
        elif tls is not None:
            self._credentials = tls.channel_credentials()
        self._tcp: _TcpConnection | None = None  # the TCP link's connection to the core
        self.cores = cores
        self._metadata = ((SECRET_HEADER, secret.decode("latin-1")),)
        self.hello = hello
        self.ready: Ready | None = None  # resent to every new core
        self.hold_s = hold_s
        self.core = ""  # the address of the core connected to ("": none)
        self.connects = 0  # connections made (1 + failovers)
        self._held: dict[int, tuple[Call, float]] = {}  # not yet answered or granted
        # The parts of one call (``Group``), by each part's id: its group's part ids
        # (sent again together, those still held, to the next core).
        self._groups: dict[int, list[int]] = {}
        self._streaming: dict[int, _Relayed] = {}  # the granted streams it relays
        self._stopping = False
        self._draining = False  # the core connected to steps down: hold new calls
        self._channel: grpc.aio.Channel | None = None
        self._transport: StreamTransport | None = None
        self._reader: asyncio.Task[None] | None = None
        self._reconnect: asyncio.Task[None] | None = None
        self._hold_timer: asyncio.TimerHandle | None = None
        self._accepting = True
        self._lost_at: float | None = None  # when the core connected to was lost
        self._connected = asyncio.Event()  # set while connected to a core (``core``)
        self.closed = True

    async def find_core(self) -> None:
        """Connect to a leading core, waiting as long as it takes (``SecretRefused`` if
        the first core that answers refuses the secret)."""
        await self._find_core(first=True)

    @property
    def accepting(self) -> bool:
        """Ready: connected, or holding calls for the next core (at most ``hold_s``, as
        long as they are held), unless this shell stops. A shell never connected is not."""
        if not self._accepting:
            return False
        if self.core:
            return True
        lost = self._lost_at
        return lost is not None and asyncio.get_running_loop().time() - lost < self.hold_s

    @accepting.setter
    def accepting(self, value: bool) -> None:
        self._accepting = value

    @property
    def pending(self) -> int:
        """Calls taken and not yet done: unanswered, or streaming."""
        return len(self._inboxes)

    # calls

    def submit(self, call: Call) -> Inbox:
        inbox = self._register(call)
        self._held[call.id] = (call, asyncio.get_running_loop().time())
        if self.closed or self._draining:
            self._watch_hold()
        else:
            self.send(call)
        return inbox

    def submit_group(self, calls: list[Call]) -> list[Inbox]:
        inboxes = [self._register(call) for call in calls]
        now = asyncio.get_running_loop().time()
        ids = [call.id for call in calls]
        for call in calls:
            self._held[call.id] = (call, now)
            self._groups[call.id] = ids
        if self.closed or self._draining:
            self._watch_hold()
        else:
            self.send(Group(calls))
        return inboxes

    def _cancel(self, call_id: int) -> None:
        self._unhold(call_id)
        super()._cancel(call_id)

    def _unhold(self, call_id: int) -> None:
        self._held.pop(call_id, None)
        self._groups.pop(call_id, None)

    def received(self, record: Any) -> None:
        if isinstance(record, Answer):
            fault = record.fault
            if (
                fault is not None
                and fault.kind == "Unavailable"
                and fault.message == SHUTTING_DOWN
                and record.id in self._held
            ):
                # The core stops, with this call taken but never sent to Triton: it
                # stays held, for the next core (a standby takes over once it is gone).
                self._draining = True
                self._watch_hold()
                return
            self._unhold(record.id)
        elif isinstance(record, Grant):
            held = self._held.pop(record.id, None)
            if held is not None:
                self._streaming[record.id] = _Relayed(held[0], record.backend, record.limits_at)
        elif isinstance(record, Draining):
            # The core steps down: what it holds it answers; new calls wait for the next.
            self._draining = True
            return
        elif isinstance(record, Stop):  # the core is leaving: the next one follows
            return
        super().received(record)

    def rows_done(self, done: RowsDone) -> None:
        """Calls a granted part served are answered: held no more (one that failed stays
        held, for the core's word or the next core)."""
        if done.fault is None:
            for call_id, _ in done.served:
                self._unhold(call_id)
        super().rows_done(done)

    def close(self) -> None:
        self._stopping = True
        self._connected.set()  # queries held for a core: answered, see _placed
        if self._reconnect is not None:
            self._reconnect.cancel()
        super().close()

    # queries

    async def _query(self, make: Callable[[int], Any]) -> Any:
        """Ask the core; held while no core is connected, until one is or ``hold_s``
        passes. A lookup or statistics query whose core is lost before it answers is
        asked again of the next (the module's doc)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.hold_s
        while True:
            await self._placed(deadline)
            query_id = self.new_id()
            record = make(query_id)
            fut = loop.create_future()
            self._queries[query_id] = fut
            try:
                self.send(record)
                return await fut
            except Unavailable as err:
                if err.message != CORE_GONE or not isinstance(record, (InfoQuery, StatsQuery)):
                    raise
            finally:
                self._queries.pop(query_id, None)

    async def _placed(self, deadline: float) -> None:
        """Return once connected to a core; Unavailable at ``deadline`` or on a stop."""
        loop = asyncio.get_running_loop()
        while not self.core:
            if self._stopping:
                raise Unavailable(CORE_GONE)
            left = deadline - loop.time()
            if left <= 0:
                raise Unavailable(f"no core reachable for {self.hold_s:g} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._connected.wait(), left)

    async def aclose(self) -> None:
        self.close()
        if self._transport is not None:
            await asyncio.wait((self._transport.finished,), timeout=1.0)
        if self._reader is not None:
            self._reader.cancel()
        if self._channel is not None:
            await self._channel.close()

    # connections

    async def _find_core(self, first: bool = False) -> None:
        delay = RETRY_S[0]
        while not self._stopping:
            for address in self.cores:
                try:
                    await self._open(address)
                    return
                except SecretRefused:
                    if first and not self.connects:
                        raise
                    log.error("the core at %s refused this shell's secret", address)
                except (grpc.aio.AioRpcError, TimeoutError, OSError) as err:
                    log.debug("core %s: %s", address, rpc_error_text(err))
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_S[1])

    async def _open(self, address: str) -> None:
        if self.link == "tcp":
            await self._open_tcp(address)
            return
        if self._credentials is not None:
            channel = grpc.aio.secure_channel(address, self._credentials, CONNECT_OPTIONS)
        else:
            channel = grpc.aio.insecure_channel(address, options=CONNECT_OPTIONS)
        call = channel.stream_stream(METHOD)(metadata=self._metadata)
        transport = StreamTransport(call.write, self, done_writing=call.done_writing, peer=address)
        self.reattach(transport)
        self.send(self.hello)
        try:
            first = await asyncio.wait_for(call.read(), CONNECT_TIMEOUT_S)
            if first is grpc.aio.EOF:
                raise OSError(f"the core at {address} ended the stream at once")
        except BaseException as err:
            self.closed = True
            transport.abort()
            await channel.close()
            if (
                isinstance(err, grpc.aio.AioRpcError)
                and err.code() == grpc.StatusCode.UNAUTHENTICATED
            ):
                raise SecretRefused(err.details()) from err
            raise
        self._channel, self._transport = channel, transport
        self._connected_to(address)
        self.data_received(first)  # its Settings
        self._resume()
        self._reader = asyncio.get_running_loop().create_task(self._read(call, transport))

    async def _open_tcp(self, address: str) -> None:
        """Connect over the raw TCP link (``fair_frontend.wire.tcp``): the preamble and
        ``Hello`` at once, then the core's verdict and its first record (``Settings``)."""
        host, port = split_address(address)
        loop = asyncio.get_running_loop()
        transport, conn = await asyncio.wait_for(
            loop.create_connection(
                lambda: _TcpConnection(self),
                host,
                port,
                ssl=self._ssl,
                server_hostname=host if self._ssl is not None else None,
            ),
            CONNECT_TIMEOUT_S,
        )
        transport.write(self._preamble)
        self.reattach(transport)
        self.send(self.hello)
        try:
            first = await asyncio.wait_for(conn.first_record(), CONNECT_TIMEOUT_S)
            if first is None:
                raise OSError(f"the core at {address} closed the connection at once")
            if first[:1] == REFUSED:
                raise SecretRefused("wrong core secret")
            if first[:1] != ACCEPTED:
                raise OSError(f"the core at {address} is stopping")
        except BaseException:
            self.closed = True
            transport.abort()
            raise
        self._tcp = conn
        conn.current = True
        self._connected_to(address)
        self.data_received(first[1:])  # its Settings (and whatever came with them)
        self.start_heartbeat(HEARTBEAT_S, SILENT_S)
        self._resume()

    def connection_lost_tcp(self, conn: _TcpConnection, exc: Exception | None) -> None:
        if self._tcp is conn:
            self._tcp = None
            self._lost(exc)

    def _connected_to(self, address: str) -> None:
        self.core = address
        self._connected.set()
        self.connects += 1
        self._draining = False
        log.info(
            "shell %d: connected to the core at %s%s",
            self.hello.index,
            address,
            f" (failover {self.connects - 1}), sending {len(self._held)} calls again"
            if self.connects > 1
            else "",
        )

    def _resume(self) -> None:
        """Connected, the core's Settings taken: this shell's state, again."""
        if self.ready is not None:
            self.send(self.ready)
        self._lost_at = None
        self._resend()

    def _tokens(
        self, call_id: int, key: tuple[str, str], tokens: int, first_s: float, gap_s: float
    ) -> None:
        stream = self._streaming.get(call_id)
        if stream is not None:
            stream.relayed += tokens
        super()._tokens(call_id, key, tokens, first_s, gap_s)

    def _ended(self, call_id: int, version: str, fault: Any, cancelled: bool) -> None:
        streaming = self._streaming.pop(call_id, None)
        if streaming is not None and gone_before_answered(fault):
            # Given back (its Triton was gone): held again until granted or answered, and
            # sent again to the next core if this one is lost meanwhile.
            self._held[call_id] = (streaming.call, asyncio.get_running_loop().time())
        super()._ended(call_id, version, fault, cancelled)

    def _resend(self) -> None:
        """To the core just connected: the streams this shell relays (their slots are
        held there until they end), then every call not yet answered, in arrival order."""
        for call_id, stream in self._streaming.items():
            # Its tokens not yet told (``_pending``) go as ``Produced`` after this.
            pending = self._pending.streams.get(call_id)
            untold = pending[1] if pending is not None else 0
            told = stream.relayed - untold
            self.send(Running(stream.call, stream.backend, stream.limits_at, told))
        sent: set[int] = set()
        for call_id in sorted(self._held):
            if call_id in sent:
                continue
            group = self._groups.get(call_id)
            if group is None:
                self.send(self._held[call_id][0])
                continue
            parts = [i for i in group if i in self._held]  # the call's parts not answered
            sent.update(parts)
            self.send(Group([self._held[i][0] for i in parts]))

    async def _read(self, call: Any, transport: StreamTransport) -> None:
        error: BaseException | None = None
        try:
            while True:
                data = await call.read()
                if data is grpc.aio.EOF:
                    break
                self.data_received(data)
        except grpc.aio.AioRpcError as err:
            error = err
        except asyncio.CancelledError:
            return
        transport.abort()
        if self._transport is transport:
            self._lost(error)

    def _lost(self, error: BaseException | None) -> None:
        """The core connected to is gone: queries fail, calls wait for the next core."""
        self.closed = True
        self._lost_at = asyncio.get_running_loop().time()
        was, self.core = self.core, ""
        if not self._stopping:
            self._connected.clear()
        channel, self._channel = self._channel, None
        if channel is not None:
            asyncio.get_running_loop().create_task(channel.close())
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(Unavailable(CORE_GONE))
        if self._stopping:
            return
        log.warning(
            "shell %d: lost the core at %s (%s): holding %d calls for the next",
            self.hello.index,
            was,
            rpc_error_text(error)
            if error is not None
            else ("stream ended" if self.link == "grpc" else "connection closed"),
            len(self._held),
        )
        now = asyncio.get_running_loop().time()
        for call_id, (call, _) in list(self._held.items()):
            if call.request.sequence.get("sequence_id"):
                self._unhold(call_id)
                inbox = self._inboxes.pop(call_id, None)
                if inbox is not None:
                    fault = Fault.of(
                        Unavailable("the core was lost while this sequence step ran: retry")
                    )
                    inbox.answer(Answer(call_id, fault=fault))
            else:
                self._held[call_id] = (call, now)
        self._watch_hold()
        self.on_lost()
        self._reconnect = asyncio.get_running_loop().create_task(self._find_core())

    def _watch_hold(self) -> None:
        if self._hold_timer is None:
            loop = asyncio.get_running_loop()
            self._hold_timer = loop.call_later(HOLD_CHECK_S, self._check_hold)

    def _check_hold(self) -> None:
        """Calls held past ``hold_s`` with no core to send them to: answered UNAVAILABLE."""
        self._hold_timer = None
        if not (self.closed or self._draining):
            return
        cutoff = asyncio.get_running_loop().time() - self.hold_s
        for call_id, (_, since) in list(self._held.items()):
            if since <= cutoff:
                self._unhold(call_id)
                inbox = self._inboxes.pop(call_id, None)
                if inbox is not None:
                    fault = Fault.of(Unavailable(f"no core reachable for {self.hold_s:g} s"))
                    inbox.answer(Answer(call_id, fault=fault))
        self._watch_hold()

    @property
    def peer(self) -> str:
        return f"the core at {self.core or '(none)'}"

    def connection_lost(self, exc: Exception | None) -> None:  # a socket's; never here
        self._lost(exc)


class _TcpConnection(asyncio.Protocol):
    """One TCP connection of a ``RemoteLink`` to a core: until the link takes it (the
    core's verdict and first record came), what arrives is kept here; from then on it
    goes to the link, and its end is the link's loss of that core. A connection the link
    gave up on (a failed try) tells the link nothing."""

    def __init__(self, link: RemoteLink) -> None:
        self.link = link
        self.current = False
        self._pending = bytearray()
        self._changed = asyncio.Event()
        self._gone = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tune(transport)

    def data_received(self, data: bytes) -> None:
        if self.current:
            self.link.data_received(data)
            return
        self._pending += data
        self._changed.set()

    async def first_record(self) -> bytes | None:
        """The verdict byte and, where accepted, the first whole frame after it (and all
        that came with it); None if the core closed the connection first."""
        while True:
            pending = self._pending
            if pending[:1] and pending[:1] != ACCEPTED:
                return bytes(pending[:1])
            start = 1
            while len(pending) >= start + 4:  # heartbeats (empty frames) before it: skipped
                size = int.from_bytes(pending[start : start + 4], "big")
                if size and len(pending) >= start + 4 + size:
                    return bytes(pending)
                if size:
                    break
                start += 4
            if self._gone:
                return None
            self._changed.clear()
            await self._changed.wait()

    def pause_writing(self) -> None:
        self.link.pause_writing()

    def resume_writing(self) -> None:
        self.link.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._gone = True
        self._changed.set()
        if self.current:
            self.link.connection_lost_tcp(self, exc)
