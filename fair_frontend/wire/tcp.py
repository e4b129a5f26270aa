"""The core's link to shells on other hosts over plain TCP (``--link tcp`` on ``fair-frontend
core`` and ``fair-frontend shell``): the frames of ``fair_frontend.wire.framing`` straight
on the event loop's own TCP transport (uvloop), as over the Unix socket of a core's local
shells. The gRPC link (``fair_frontend.wire.remote``) stays the default.

Why: gRPC carries each frame through grpc.aio (a task per write, HTTP/2 framing, the
message queue between its threads and the loop), which is most of what the core spends
per request on that link; over a socket of its own the core pays what it pays for a local
shell. What gRPC gave for free is done here, in a few lines each:

* the secret: a connection's first bytes are a preamble, ``MAGIC``, the secret's length
  (two bytes, at most ``MAX_SECRET_BYTES``) and the secret; the core compares digests
  (``secret_matches``) before it reads a record, and answers with one verdict byte:
  ``ACCEPTED`` (frames follow), ``REFUSED`` (a wrong secret: the shell raises
  ``SecretRefused``, as for gRPC's UNAUTHENTICATED) or ``STOPPING``, then closes. A
  connection whose preamble is not whole within ``core_link.handshake_timeout_s`` (TLS's
  handshake included), or is malformed, is closed unanswered; past
  ``core_link.max_connections`` open connections, a new one is closed at once;
* liveness: both ends send an empty frame each ``HEARTBEAT_S`` in which they wrote
  nothing else, and cut a peer from which nothing arrived for ``SILENT_S`` (as gRPC's
  2 s pings with their 3 s timeout): a host gone silent, or a process stopped, is noticed
  within seconds (``Framed.start_heartbeat``). TCP keepalive and ``TCP_USER_TIMEOUT``
  are set too, so that the kernel gives up on unacknowledged data in that time as well;
* TLS: the ``Tls`` settings of the gRPC link, as ``ssl`` contexts: the core's
  certificate, and with a client CA mutual TLS (a shell without a certificate it signed
  fails the handshake, before the preamble is read).

The connection is still the shell: when it closes, however it closes, the core drops that
shell's queued work at once (``Core.drop_route``), and the stall watch of ``Framed``
applies unchanged (it is the same transport as the Unix socket's).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from typing import Any

from fair_frontend.wire.remote import SecretError, Tls

LINKS = ("grpc", "tcp")  # --link's choices; grpc the default
MAGIC = b"FAIRLNK1"  # a TCP link's first bytes (and its version)
MAX_SECRET_BYTES = 1024  # the longest secret a preamble may carry
PREAMBLE_HEAD = len(MAGIC) + 2  # MAGIC, then the secret's length
ACCEPTED, REFUSED, STOPPING = b"\x00", b"\x01", b"\x02"  # the core's verdict, one byte
HEARTBEAT_S = 1.0
SILENT_S = 5.0
# The kernel's own watch: probes after 2 s idle, 1 s apart, 3 unanswered end the
# connection; data unacknowledged for 5 s ends it too.
KEEPALIVE = (2, 1, 3)
USER_TIMEOUT_MS = 5000


def preamble(secret: bytes) -> bytes:
    if len(secret) > MAX_SECRET_BYTES:
        raise SecretError(f"a secret of {len(secret)} bytes: the TCP link takes {MAX_SECRET_BYTES}")
    return MAGIC + len(secret).to_bytes(2, "big") + secret


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (``[v6]:PORT`` too) as (host, port)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not HOST:PORT: {address!r}")
    return host.strip("[]"), int(port)


def tune(transport: Any) -> None:
    """Keepalive, ``TCP_USER_TIMEOUT`` and no Nagle delay on the link's socket (where the
    platform has them)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    options = [
        (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    ]
    for name, value in zip(
        ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE, strict=True
    ):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        options.append((socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS))
    for level, option, value in options:
        with contextlib.suppress(OSError):  # a platform without it
            sock.setsockopt(level, option, value)


def _read(tls: Tls, path: str | None) -> None:
    tls._read(path)  # a clear SecretError for a missing file, as the gRPC link's


def server_context(tls: Tls) -> ssl.SSLContext:
    """The core's: its certificate and key; with ``tls.ca``, shells must present one that
    CA signed."""
    if tls.cert is None or tls.key is None:
        raise SecretError("a core's TLS needs both --tls-cert and --tls-key")
    for path in (tls.cert, tls.key, tls.ca):
        _read(tls, path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert, tls.key)
    if tls.ca is not None:
        context.load_verify_locations(cafile=tls.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(tls: Tls) -> ssl.SSLContext:
    """A shell's: the core's certificate checked against ``tls.ca`` (else the system's
    CAs), and its own certificate where given."""
    if (tls.cert is None) != (tls.key is None):
        raise SecretError("a shell's certificate needs both --tls-cert and --tls-key")
    for path in (tls.cert, tls.key, tls.ca):
        _read(tls, path)
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
    if tls.cert is not None and tls.key is not None:
        context.load_cert_chain(tls.cert, tls.key)
    return context
