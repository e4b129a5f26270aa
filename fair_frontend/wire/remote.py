"""The core's link to shells on other hosts: the frames of ``fair_frontend.wire.framing``
carried by one gRPC bidirectional stream per shell, authenticated by a shared secret. This
is the default (``--link grpc``); ``--link tcp`` carries the same frames on a plain TCP
connection instead, for less of the core's CPU per message (``fair_frontend.wire.tcp``,
which shares this module's secret and ``Tls`` settings).

Why gRPC: it is the transport the frontend already speaks (HTTP/2 flow control, keepalive
pings that notice a host gone silent, TLS where the network needs it), so nothing about
the connection is ours to get wrong. What rides on it is what rides on the Unix socket:
the same frames, the same records, in order, in messages of at most ``MESSAGE_BYTES``
(frames joined up to it, a larger write cut into parts: the reader reassembles frames
across messages, as from a socket). The connection is
still the shell: when its stream ends, however it ends, the core drops that shell's queued
work at once (``Core.drop_route``), as for a shell process that died.

TLS (``Tls``): off by default (a secret crosses in the clear, so that is for a network
of the deployment's own, such as a Kubernetes pod network behind NetworkPolicies); with
``--tls-cert``/``--tls-key`` on the core the link is encrypted and the shells check the
core's certificate (``--tls-ca``), and with ``--tls-client-ca`` on the core it is mutual:
a shell without a certificate that CA signed cannot connect at all.

The secret: every stream carries it in its metadata (``SECRET_HEADER``); the core
compares digests of the two in constant time (``secret_matches``) and refuses a stream
without the right one (UNAUTHENTICATED) before reading a record. It comes from a file
(``--secret-file``, a Kubernetes Secret's mount) or the ``FAIR_FRONTEND_CORE_SECRET``
variable, never from the command line (other users see that in ``ps``).

``StreamTransport`` puts a gRPC stream under a ``Framed`` protocol in place of an asyncio
transport: ``write`` queues, a task writes (a write waits for HTTP/2's flow control),
and the queue's size is the transport's write buffer, so ``Framed``'s stall watch works
unchanged (a peer that stops reading is cut off after ``queues.stalled_shell_s``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

log = logging.getLogger(__name__)

METHOD = "/fair_frontend.Core/Link"
SECRET_HEADER = "x-fair-core-secret"
# Where a core and its shells find the secret when no --secret-file is given.
SECRET_ENV = "FAIR_FRONTEND_CORE_SECRET"
MIN_SECRET_BYTES = 16
MESSAGE_BYTES = 4 << 20  # the most one message carries: frames joined, or a write's part
# Both ends: no size limit of gRPC's own (a frame is bounded by MAX_FRAME), and pings
# that notice a peer whose host went silent within seconds rather than TCP's hours.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),  # a port another server holds is a start error
]
_DIGEST = hashlib.sha256


@dataclass(frozen=True)
class Tls:
    """TLS for the core link (PEM files). On a core: its ``cert`` and ``key``, and with
    ``ca`` the shells must present a certificate that CA signed (mutual TLS). On a shell:
    the ``ca`` the core's certificate is checked against, and with ``cert`` and ``key``
    its own (for a core that asks for one)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def _read(self, path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as err:
            raise SecretError(f"cannot read {path}: {err.strerror}") from err

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key = self._read(self.cert), self._read(self.key)
        if cert is None or key is None:
            raise SecretError("a core's TLS needs both --tls-cert and --tls-key")
        ca = self._read(self.ca)
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise SecretError("a shell's certificate needs both --tls-cert and --tls-key")
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca),
            private_key=self._read(self.key),
            certificate_chain=self._read(self.cert),
        )


class SecretError(ValueError):
    """No usable shared secret: none given, unreadable, or too short to resist guessing."""


def load_secret(path: str | None, env: str) -> bytes:
    """The shared secret: ``path``'s content, else variable ``env``'s, without surrounding
    whitespace (a trailing newline from ``echo`` is no part of it)."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as err:
            raise SecretError(f"cannot read the secret file {path}: {err.strerror}") from err
        where = f"the secret file {path}"
    else:
        value = os.environ.get(env)
        if value is None:
            raise SecretError(
                f"no shared secret: give --secret-file FILE or set {env} "
                "(the same on every core and shell; e.g. `openssl rand -hex 32`)"
            )
        secret = value.strip().encode()
        where = f"${env}"
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(
            f"{where} holds {len(secret)} bytes: a shared secret needs at least "
            f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    return secret


def secret_matches(given: str | bytes | None, secret: bytes) -> bool:
    """Whether ``given`` is ``secret``, in time that tells nothing about either: digests
    of equal length, compared by ``hmac.compare_digest``."""
    if given is None:
        return False
    if isinstance(given, str):
        given = given.encode()
    return hmac.compare_digest(_DIGEST(given).digest(), _DIGEST(secret).digest())


class StreamTransport:
    """A gRPC stream as a ``Framed`` protocol's transport (see the module's doc)."""

    def __init__(
        self,
        write: Callable[[bytes], Awaitable[Any]],
        protocol: asyncio.BaseProtocol,
        *,
        done_writing: Callable[[], Awaitable[Any]] | None = None,
        peer: str = "",
    ) -> None:
        self._write = write
        self._done_writing = done_writing
        self._protocol = protocol
        self.peer = peer
        self._pending: deque[bytes] = deque()
        self._size = 0  # bytes written to this transport and not yet taken by the stream
        self._high = 64 << 10
        self._low = 16 << 10
        self._paused = False
        self._closing = False
        self._wake = asyncio.Event()
        self.finished: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )
        self._writer = asyncio.get_running_loop().create_task(self._run())

    # the asyncio.Transport methods Framed uses

    def write(self, data: bytes) -> None:
        if self._closing:
            return
        self._pending.append(data)
        self._size += len(data)
        self._wake.set()
        if not self._paused and self._size > self._high:
            self._paused = True
            self._protocol.pause_writing()

    def get_write_buffer_size(self) -> int:
        return self._size

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high = high if high is not None else self._high
        self._low = low if low is not None else self._high // 4

    def is_closing(self) -> bool:
        return self._closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.peer if name == "peername" else default

    def close(self) -> None:
        """End the stream once what was written has gone."""
        self._closing = True
        self._wake.set()

    def abort(self) -> None:
        """End it now: what was written and not taken is dropped."""
        self._closing = True
        self._writer.cancel()

    async def _write_parts(self, data: bytes) -> None:
        """Write ``data`` as messages of ``MESSAGE_BYTES`` at most: the peer reassembles
        frames across messages, and bounds what one message may hold (a core's
        ``core_link.max_message_bytes``), whatever went out in one loop iteration."""
        view = memoryview(data)
        for start in range(0, len(data), MESSAGE_BYTES):
            part = bytes(view[start : start + MESSAGE_BYTES])
            await self._write(part)
            self._size -= len(part)
            if self._paused and self._size <= self._low:
                self._paused = False
                self._protocol.resume_writing()

    async def _run(self) -> None:
        pending = self._pending
        error: BaseException | None = None
        try:
            while True:
                if not pending:
                    if self._closing:
                        break
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                data = pending.popleft()
                if len(data) > MESSAGE_BYTES:  # one message at most MESSAGE_BYTES
                    await self._write_parts(data)
                    continue
                if pending and len(data) < MESSAGE_BYTES:
                    parts = [data]
                    size = len(data)
                    while pending and size + len(pending[0]) <= MESSAGE_BYTES:
                        part = pending.popleft()
                        parts.append(part)
                        size += len(part)
                    data = b"".join(parts)
                await self._write(data)
                self._size -= len(data)
                if self._paused and self._size <= self._low:
                    self._paused = False
                    self._protocol.resume_writing()
            if self._done_writing is not None:
                await self._done_writing()
        except asyncio.CancelledError:
            pass
        except Exception as err:  # the stream broke: the reader side sees it end too
            error = err
        finally:
            self._closing = True
            if not self.finished.done():
                self.finished.set_result(error)


def rpc_error_text(err: BaseException) -> str:
    """How a failed stream is named in logs: gRPC's code and details."""
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return f"{type(err).__name__}: {err}"
