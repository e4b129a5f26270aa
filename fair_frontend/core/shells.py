"""The core's end of its shell processes' connections (``fair_frontend.wire.framing``).

Fair intake: the core does not admit calls in the order bytes arrived. ``Intake`` keeps
the calls read but not yet admitted per tenant and admits them round robin, a slice at a
time, so that a burst one tenant poured into a socket delays another tenant's call by at
most one call per tenant with calls waiting, not by the whole burst. A ``Group`` (the
parts of one API call) is one entry: admitted whole, in one turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from fair_frontend.auth import GatewayTrust
from fair_frontend.config import SHA256_PREFIX
from fair_frontend.errors import FrontendError, Internal
from fair_frontend.wire.framing import Framed, FrameTooLarge, to_core
from fair_frontend.wire.records import (
    LINK_VERSION,
    Answer,
    Call,
    Cancel,
    Ended,
    Fault,
    Flushed,
    FlushTally,
    Grant,
    Group,
    Hello,
    InfoAnswer,
    InfoQuery,
    Precharge,
    Precharged,
    Produced,
    QueueView,
    Ready,
    Rows,
    RowsDone,
    Running,
    Settings,
    StatsAnswer,
    StatsQuery,
    Stop,
    Tally,
)
from fair_frontend.wire.remote import (
    METHOD,
    SECRET_HEADER,
    SERVER_OPTIONS,
    StreamTransport,
    Tls,
    secret_matches,
)
from fair_frontend.wire.tcp import (
    ACCEPTED,
    HEARTBEAT_S,
    MAGIC,
    MAX_SECRET_BYTES,
    PREAMBLE_HEAD,
    REFUSED,
    SILENT_S,
    STOPPING,
    server_context,
    split_address,
    tune,
)

if TYPE_CHECKING:
    from fair_frontend.config import Config
    from fair_frontend.core.dispatch import CoreRequest
    from fair_frontend.core.service import Core

log = logging.getLogger(__name__)

INTAKE_SLICE = 64  # calls admitted before the loop runs anything else
QUEUE_VIEW_INTERVAL_S = 0.05  # how stale a shell's view of the full queues may be


class Intake:
    """Calls read from the shells but not admitted yet, admitted per tenant round robin.

    ``push`` is all ``data_received`` does per call; ``_admit`` runs soon after, admits
    one call per tenant in turn, ``INTAKE_SLICE`` at a time, and lets the loop run
    between slices (answers go out, batches come back, more is read). A slice is one
    tick of the core's: the throttle judges each tenant's calls of it together
    (``Core.judge_together``: one decision per tenant and model, not one per call), and
    each model's batches are decided once, at its end (``Core.tick``).
    """

    def __init__(self, core: Core) -> None:
        self.core = core
        self._waiting: dict[str, deque[tuple[Call | Group, ShellConnection]]] = {}
        self._scheduled = False
        self.admitted = 0  # calls admitted, in order (tests read how many went ahead)

    def push(self, call: Call | Group, conn: ShellConnection) -> None:
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
        taken: list[tuple[Call | Group, ShellConnection]] = []
        while waiting and budget > 0:
            for tenant in list(waiting):
                queue = waiting[tenant]
                taken.append(queue.popleft())
                if not queue:
                    del waiting[tenant]
                budget -= 1
                if budget <= 0:
                    break
        judged = iter(self._judge([call for call, _ in taken if not isinstance(call, Group)]))
        with self.core.tick():
            for call, conn in taken:
                self.admitted += 1
                try:  # a bug in one call's admission costs the slice's others nothing
                    if isinstance(call, Group):
                        conn.admit(call)
                    else:
                        conn.admit(call, judged=next(judged, False))
                except Exception:
                    log.exception("admitting a call of tenant %r failed", call.tenant)
        if waiting and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._admit)

    def _judge(self, calls: list[Call]) -> list[bool]:
        """``Core.judge_together`` for a slice's calls; where it fails, each call is
        judged alone in ``submit`` (none is lost to it)."""
        if len(calls) < 2:
            return []
        try:
            return self.core.judge_together(calls)
        except Exception:
            log.exception("the throttle could not judge a slice's calls together")
            return []

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


class ShellConnection(Framed):
    """The core's end of one shell's connection; the ``Route`` of that shell's calls."""

    decoder = to_core

    def __init__(self, server: CoreServer) -> None:
        super().__init__()
        self.server = server
        self.core = server.core
        self.max_frame = server.core.config.link_max_message_bytes()
        self.index = -1
        self.pid = 0
        self.host = ""  # a shell on another host: its address
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
        where = self.host and f" at {self.host}"
        return f"shell {self.index} (pid {self.pid}{where})"

    def pause_writing(self) -> None:
        self.stall_s = self.core.config.queues.stalled_shell_s  # live: a reload may change it
        super().pause_writing()

    def received(self, record: Any) -> None:
        if isinstance(record, Call):
            self.calls[record.id] = None
            self.server.intake.push(record, self)
        elif isinstance(record, Group):
            if record.calls:
                for call in record.calls:
                    self.calls[call.id] = None
                self.server.intake.push(record, self)
        elif isinstance(record, Precharge):
            self._spawn(self._precharge(record))
        elif isinstance(record, Cancel):
            if record.id in self.calls:
                req = self.calls.pop(record.id)
                if req is not None:
                    self.core.cancel(req)
                else:  # still in the intake: admitted, then cancelled at once
                    self.calls[record.id] = _CANCELLED
        elif isinstance(record, Produced):
            calls = self.calls
            reports = []
            for call_id, tokens, first_s in record.entries:
                req = calls.get(call_id)
                if req is not None and req is not _CANCELLED:
                    reports.append((req, tokens, first_s))
            # One tick of this shell's streams at once, and their inter-token times.
            self.core.produced_all(reports, record.gaps)
        elif isinstance(record, Ended):
            # A stream given back (never sent: its Triton was gone) is still this shell's
            # call: granted again or answered (``answer``) here.
            again = record.fault is not None and record.fault.never_sent
            req = self.calls.get(record.id) if again else self.calls.pop(record.id, None)
            if req is not None and req is not _CANCELLED:
                err = record.fault.error() if record.fault is not None else None
                self.core.stream_ended(req, record.version, err, record.cancelled)
        elif isinstance(record, RowsDone):
            self.core.rows_done(record, self)
            calls = self.calls
            if record.fault is None:  # answered by the shell: no answer follows
                for call_id, _ in record.served:
                    calls.pop(call_id, None)
            for call_id in record.gone:
                calls.pop(call_id, None)
        elif isinstance(record, Running):
            req = self.core.adopt(
                record.call, self, record.backend, record.limits_at, record.produced
            )
            if req is not None:
                self.calls[record.call.id] = req
        elif isinstance(record, Tally):
            self.core.tally(record)
        elif isinstance(record, InfoQuery):
            self._spawn(self._info(record))
        elif isinstance(record, StatsQuery):
            self._spawn(self._stats(record))
        elif isinstance(record, Hello):
            self.index, self.pid = record.index, record.pid
            if record.link != LINK_VERSION:
                log.error(
                    "%s speaks the link's version %d, this core %d: shells and cores must "
                    "be of one version (UPGRADING.md); its connection is closed",
                    self.peer,
                    record.link,
                    LINK_VERSION,
                )
                self.close()
                return
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

    def admit(self, call: Call | Group, *, judged: bool = False) -> None:
        """The intake's turn for this call (or group of calls): into the core.
        ``judged``: the throttle admitted it already (``Core.judge_together``)."""
        if self.closed:
            return
        if isinstance(call, Group):
            self._admit_group(call)
            return
        if self.calls.get(call.id, None) is _CANCELLED:
            del self.calls[call.id]
            return
        req = self.core.submit(call, self, judged=judged)
        if call.id in self.calls:  # not answered at once
            if req is None:
                self.calls.pop(call.id, None)
            else:
                self.calls[call.id] = req

    def _admit_group(self, group: Group) -> None:
        """A group's turn: its parts not cancelled meanwhile, into the core together."""
        calls = self.calls
        live = []
        for call in group.calls:
            if calls.get(call.id, None) is _CANCELLED:
                del calls[call.id]
            else:
                live.append(call)
        if not live:
            return
        reqs = self.core.submit_group(Group(live) if len(live) < len(group.calls) else group, self)
        for i, call in enumerate(live):
            if call.id in calls:  # not answered at once
                if reqs is None:
                    calls.pop(call.id, None)
                else:
                    calls[call.id] = reqs[i]

    async def _precharge(self, query: Precharge) -> None:
        try:
            at, _ = await self.core.precharge(
                query.tenant, query.model, requests=query.requests, tokens=query.tokens
            )
            self.send(Precharged(query.id, at))
        except FrontendError as err:
            self.send(Precharged(query.id, fault=Fault.of(err)))
        except Exception as err:
            log.exception("precharge failed")
            self.send(Precharged(query.id, fault=Fault.of(Internal(type(err).__name__))))

    def answer(self, answer: Answer | Grant) -> None:
        """The core's answer to one of this shell's calls (the ``Route``); a granted call
        stays until its shell says it ended."""
        if isinstance(answer, Answer):
            self.calls.pop(answer.id, None)
        try:
            self.send(answer)
        except FrameTooLarge as err:  # outputs beyond what one frame carries
            log.error("answer to %s: %s", self.peer, err)
            self.send(Answer(answer.id, fault=Fault.of(Internal(str(err)))))

    def grant_rows(self, rows: Rows) -> None:
        """Rows of a batch for this shell to send (``core.granted``); their calls stay
        until it reports (``RowsDone``)."""
        self.send(rows)

    async def _info(self, query: InfoQuery) -> None:
        try:
            info = await self.core.model_info(query.model)
            self.send(InfoAnswer(query.id, info.described()))
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


class TcpShellConnection(ShellConnection):
    """A shell's connection over the raw TCP link (``fair_frontend.wire.tcp``): its
    preamble first, the secret checked before a record is read; a shell from then on."""

    def __init__(self, server: CoreServer) -> None:
        super().__init__(server)
        self._preamble: bytearray | None = bytearray()  # None once the secret was taken
        self._raw: Any = None
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._raw = transport
        server = self.server  # (a transport: uvloop's is no asyncio.Transport subclass)
        server.tcp_open += 1
        if server.tcp_open > self.core.config.core_link.max_connections:
            self._raw.abort()  # over the cap: closed at once, unread
            return
        server.tcp_unsettled.add(self)
        tune(transport)
        peer = transport.get_extra_info("peername")
        self.host = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        loop = asyncio.get_running_loop()
        bound = self.core.config.core_link.handshake_timeout_s
        self._deadline = loop.call_later(bound, self._too_slow)

    def _too_slow(self) -> None:
        self._deadline = None
        if self._preamble is not None:
            log.warning("a connection from %s sent no preamble in time: closed", self.host)
            self._raw.abort()

    def data_received(self, data: bytes) -> None:
        pre = self._preamble
        if pre is None:
            if self.transport is not None:  # a shell (refused: nothing more is read)
                super().data_received(data)
            return
        pre += data
        if len(pre) < PREAMBLE_HEAD:
            return
        size = int.from_bytes(pre[len(MAGIC) : PREAMBLE_HEAD], "big")
        if pre[: len(MAGIC)] != MAGIC or size > MAX_SECRET_BYTES:
            log.warning("a connection from %s sent no link preamble: closed", self.host)
            self._refuse(b"")
            return
        if len(pre) < PREAMBLE_HEAD + size:
            return
        given, rest = (
            bytes(pre[PREAMBLE_HEAD : PREAMBLE_HEAD + size]),
            bytes(pre[PREAMBLE_HEAD + size :]),
        )
        self._settled()
        server = self.server
        if not secret_matches(given, server._secret):
            server.refused += 1
            log.warning("a shell at %s offered a wrong core secret: refused", self.host)
            self._refuse(REFUSED)
            return
        if server.stopping:
            self._refuse(STOPPING)
            return
        self._raw.write(ACCEPTED)
        super().connection_made(self._raw)
        self.start_heartbeat(HEARTBEAT_S, SILENT_S)
        if rest:
            super().data_received(rest)

    def _settled(self) -> None:
        """The preamble is judged: no deadline, and the core's close need not cut it."""
        self._preamble = None
        self.server.tcp_unsettled.discard(self)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _refuse(self, verdict: bytes) -> None:
        self._settled()
        if verdict:
            self._raw.write(verdict)
        self._raw.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.tcp_open -= 1
        self._settled()
        if self.transport is not None:  # taken as a shell
            super().connection_lost(exc)


def shell_config(config: Config) -> dict[str, Any]:
    """What a shell is told of the config (``Settings.config``): all of it but what a
    shell never uses and must not hold. The tenants' keys (inline, and where their files
    and variables are): a shell gets their digests (``Settings.keys``), which is all
    ``KeyRing`` compares with. The trusted gateway's secret: its digest, in the
    "sha256:<hex>" form ``GatewayTrust`` reads (where it is a variable of the core's, the
    shell need not have that variable)."""
    data = config.model_dump(mode="json")
    for tenant in data["tenants"].values():
        tenant.update(api_keys=[], api_keys_file=None, api_keys_env=None)
    trust = GatewayTrust.from_config(config.auth)
    digest = trust.secret_digest if trust is not None else None
    data["auth"].update(
        trusted_gateway_secret=None if digest is None else SHA256_PREFIX + digest.hex(),
        trusted_gateway_secret_env=None,
    )
    return data


def link_server_options(config: Config) -> list[tuple[str, int]]:
    """The link's gRPC options: ``SERVER_OPTIONS`` (keepalive, the port its own) and the
    port's bounds (``core_link``), like the tenant ports': connections, streams on one,
    the handshake and a connection without a stream, the largest message. What anyone
    who reaches the port holds before its secret is checked is bounded by them."""
    link = config.core_link
    handshake_ms = max(1, min(round(link.handshake_timeout_s * 1000), 2**31 - 1))
    bounds = {
        "grpc.max_receive_message_length": config.link_max_message_bytes(),
        "grpc.max_allowed_incoming_connections": link.max_connections,
        "grpc.max_concurrent_streams": link.max_streams_per_connection,
        "grpc.server_handshake_timeout_ms": handshake_ms,
        "grpc.max_connection_idle_ms": handshake_ms,
    }
    return [(k, v) for k, v in SERVER_OPTIONS if k not in bounds] + list(bounds.items())


_CANCELLED: Any = object()  # a call cancelled while still in the intake
View = tuple[  # QueueView's
    list[tuple[str, str, str]], list[tuple[str, str, int, str]], list[tuple[str, str, str, float]]
]
_NO_VIEW: View = ([], [], [])


class CoreServer:
    """The core's listening socket: shells connect, get their settings, send calls. On
    the Unix socket ``path`` (the shell processes of this host) and, once ``listen`` has
    been called, over gRPC (``fair_frontend.wire.remote``) or raw TCP
    (``fair_frontend.wire.tcp``) for shells anywhere."""

    def __init__(self, core: Core, settings: Callable[[], Settings], path: str | None) -> None:
        self.core = core
        self.settings = settings
        self.path = path
        self.intake = Intake(core)
        self.connections: set[ShellConnection] = set()
        self.on_ready: Callable[[ShellConnection], None] = lambda conn: None
        self.on_gone: Callable[[ShellConnection], None] = lambda conn: None
        self._server: asyncio.AbstractServer | None = None
        self._remote: grpc.aio.Server | None = None
        self._tcp: asyncio.AbstractServer | None = None
        self._secret = b""
        self.refused = 0  # streams (or TCP connections) refused for a wrong secret
        self.tcp_open = 0  # connections open on the TCP link, shells or not yet
        self.tcp_unsettled: set[TcpShellConnection] = set()  # their preamble not judged yet
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
        if self.path is not None:
            self._server = await loop.create_unix_server(lambda: ShellConnection(self), self.path)
            os.chmod(self.path, 0o600)  # only this user's processes may act as shells
        self._viewer = loop.create_task(self._publish_queue_view())

    async def listen(
        self, address: str, secret: bytes, tls: Tls | None = None, link: str = "grpc"
    ) -> int:
        """Accept shells from other hosts at ``address`` (HOST:PORT), each stream carrying
        ``secret`` (over TLS where ``tls`` is given); returns the port bound. ``link``:
        gRPC streams (``fair_frontend.wire.remote``) or raw TCP (``fair_frontend.wire.tcp``)."""
        self._secret = secret
        if link == "tcp":
            return await self._listen_tcp(address, tls)
        server = grpc.aio.server(options=link_server_options(self.core.config))
        handler = grpc.stream_stream_rpc_method_handler(self._link)  # bytes in, bytes out
        service, method = METHOD.rsplit("/", 1)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service.strip("/"), {method: handler}),)
        )
        if tls is not None:
            port = server.add_secure_port(address, tls.server_credentials())
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot listen for shells on {address}")
        await server.start()
        self._remote = server
        return port

    async def _listen_tcp(self, address: str, tls: Tls | None) -> int:
        host, port = split_address(address)
        loop = asyncio.get_running_loop()
        self._tcp = await loop.create_server(
            lambda: TcpShellConnection(self),
            host or None,
            port,
            ssl=server_context(tls) if tls is not None else None,
            ssl_handshake_timeout=(
                self.core.config.core_link.handshake_timeout_s if tls is not None else None
            ),
            reuse_address=True,
        )
        return int(self._tcp.sockets[0].getsockname()[1])

    async def _link(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        """One remote shell's stream, from the secret's check to its end."""
        given = dict(context.invocation_metadata()).get(SECRET_HEADER)
        if not secret_matches(given, self._secret):
            self.refused += 1
            log.warning("a shell at %s offered a wrong core secret: refused", context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong core secret")
        if self.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the core is stopping")
        conn = ShellConnection(self)
        conn.host = context.peer()
        transport = StreamTransport(context.write, conn, peer=conn.host)
        conn.connection_made(transport)  # type: ignore[arg-type]  # a transport in all it uses

        async def read() -> None:
            async for data in requests:
                conn.data_received(data)
                if conn.closed:
                    return

        reader = asyncio.ensure_future(read())
        try:
            await asyncio.wait((reader, transport.finished), return_when=asyncio.FIRST_COMPLETED)
        finally:
            reader.cancel()
            transport.abort()
            conn.connection_lost(None)

    @property
    def queue_view(self) -> View:
        """The full queues (and byte caps close to full), and the tiers the throttle
        closed, that the shells were last told of."""
        return self._view

    async def _publish_queue_view(self) -> None:
        """Tell the shells which queues are full and which tiers the throttle closed, when
        that changes (``QueueView``)."""
        while True:
            await asyncio.sleep(QUEUE_VIEW_INTERVAL_S)
            view = (*self.core.shedding.full_queues(), self.core.shedding.refresh())
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
        if self._tcp is not None:
            self._tcp.close()
            for pending in list(self.tcp_unsettled):
                pending._refuse(STOPPING)
        for conn in list(self.connections):
            conn.close()
        if self._tcp is not None:
            await self._tcp.wait_closed()
        if self._remote is not None:
            await self._remote.stop(1.0)
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
