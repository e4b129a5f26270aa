"""The core's port for shells on other hosts (``core_link``): bounds of its own, as the
tenant ports have theirs.

A core in this process (``FrontendServer`` with no shells of its own, leading, as
``fair-frontend core`` runs it) on the session's Triton, with small bounds; its peers
are raw sockets (a peer that connects and sends nothing, one that stops after HTTP/2's
preface), gRPC streams that carry the secret and say ``Hello`` as a shell does (each on
a connection of its own, or several on one), and a shell's own link (``RemoteLink``).
Before, the port had gRPC's defaults: a handshake of 120 s, no connection cap, no stream
cap, and no bound on a message or a frame below 2 GiB.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import Config, parse_config
from fair_frontend.kit.testing import aeventually, free_port
from fair_frontend.server import BackgroundServer, FrontendServer, Listen
from fair_frontend.shell.remote import RemoteLink, SecretRefused
from fair_frontend.wire.framing import encode, to_shell
from fair_frontend.wire.records import LINK_VERSION, Hello, Settings
from fair_frontend.wire.remote import MESSAGE_BYTES, METHOD, SECRET_HEADER, StreamTransport
from fair_frontend.wire.tcp import REFUSED, preamble
from tests.support import config_dict

SECRET = b"link-test-secret-0123456789abcdef"
MAX_CONNECTIONS = 3
MAX_STREAMS = 2
HANDSHAKE_S = 1.0
# How long a test waits for what must happen (a connection closed, a stream ended): far
# above the bound it tests, so a loaded machine does not fail it.
WAIT_S = 20.0
# How long a stream over the connection's bound is watched not to start (it must not).
HELD_S = 2.0


def link_config(triton: EmbeddedTriton) -> Config:
    """The tests' config on the session's Triton, with the link's small bounds, and
    requests of at most 256 KiB: the least message bound is then one message (4 MiB)."""
    data = config_dict()
    data["triton"] = {"backends": [{"grpc_url": triton.grpc_url}]}
    data["core_link"] = {
        "max_connections": MAX_CONNECTIONS,
        "max_streams_per_connection": MAX_STREAMS,
        "handshake_timeout_s": HANDSHAKE_S,
    }
    for endpoint in data["endpoints"].values():
        endpoint["max_request_bytes"] = 256 << 10
    data["default_endpoint"]["max_request_bytes"] = 256 << 10
    return parse_config(data)


@dataclass
class Core:
    server: FrontendServer
    background: BackgroundServer
    address: str

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def connections(self) -> int:
        """Shells connected to the core, as the core counts them."""
        assert self.server.shells is not None
        return len(self.server.shells.server.connections)


def leading(triton: EmbeddedTriton, link: str) -> Iterator[Core]:
    """A core leading on a free port of its own, its shells' link ``link``."""
    server = FrontendServer(link_config(triton), [], Listen(), workers=0)
    address = f"127.0.0.1:{free_port()}"
    background = BackgroundServer(server)
    with background:
        background.call(server.lead(address, SECRET, link=link))
        yield Core(server, background, address)


@pytest.fixture(scope="module")
def core(triton: EmbeddedTriton) -> Iterator[Core]:
    yield from leading(triton, "grpc")


class LinkStream:
    """A stream to the core as a shell opens it: the secret in its metadata, ``Hello``
    first; ``settings`` is the core's answer."""

    def __init__(self, channel: grpc.aio.Channel, index: int = 0) -> None:
        self.call: Any = channel.stream_stream(METHOD)(metadata=((SECRET_HEADER, SECRET.decode()),))
        self.index = index

    async def hello(self) -> Settings:
        await self.call.write(encode(Hello(self.index, 0, LINK_VERSION)))
        first = await asyncio.wait_for(self.call.read(), WAIT_S)
        assert first is not grpc.aio.EOF, await self.call.code()
        settings = to_shell.decode(first[4 : 4 + int.from_bytes(first[:4], "big")])
        assert isinstance(settings, Settings), settings
        return settings

    async def ended(self) -> grpc.StatusCode:
        """The stream's status once the core has ended it (reading what it still sends)."""

        async def drain() -> grpc.StatusCode:
            try:
                while await self.call.read() is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError as err:
                return err.code()
            code: grpc.StatusCode = await self.call.code()
            return code

        return await asyncio.wait_for(drain(), WAIT_S)


def own_channel(address: str) -> grpc.aio.Channel:
    """A channel on a connection of its own (channels of one process share one by
    default), as each shell process has."""
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


@pytest.fixture
async def channels(core: Core) -> AsyncIterator[list[grpc.aio.Channel]]:
    opened: list[grpc.aio.Channel] = []
    try:
        yield opened
    finally:
        for channel in opened:
            await channel.close()
        await aeventually(lambda: core.connections() == 0, WAIT_S, what="the streams to end")


def first_bytes(port: int, *, preface: bytes = b"") -> tuple[int, bool]:
    """Connect, send ``preface``, read until the core closes the connection: how many
    bytes it sent, and whether it closed within WAIT_S."""
    received, closed = first_bytes_of(port, preface)
    return len(received), closed


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # + SETTINGS


async def test_a_peer_that_sends_nothing_is_closed_after_the_handshake(core: Core) -> None:
    """core_link.handshake_timeout_s: a connection that never sends HTTP/2's preface is
    closed (gRPC's own deadline would be 120 s), as is one that sends it and opens no
    stream; the core's own preface (its SETTINGS) comes first."""
    for preface in (b"", H2_PREFACE):
        received, closed = await asyncio.to_thread(first_bytes, core.port, preface=preface)
        assert closed, f"still open after {WAIT_S} s (sent {preface!r})"
        assert received > 0  # the core's SETTINGS, then its GOAWAY: it was within the cap


async def test_connections_over_the_cap_are_closed_unread(
    core: Core, channels: list[grpc.aio.Channel]
) -> None:
    """core_link.max_connections: with that many shells connected (each its own
    connection), one more connection is closed at once, before the core sends a byte;
    once a shell leaves, a connection is taken again and a shell's link works."""
    streams = []
    for i in range(MAX_CONNECTIONS):
        channels.append(own_channel(core.address))
        streams.append(LinkStream(channels[-1], i))
        await streams[-1].hello()
    assert core.connections() == MAX_CONNECTIONS
    received, closed = await asyncio.to_thread(first_bytes, core.port)
    assert closed and received == 0, (received, closed)
    streams[0].call.cancel()
    await aeventually(lambda: core.connections() < MAX_CONNECTIONS, WAIT_S, what="a shell gone")

    async def taken() -> bool:
        received, _ = await asyncio.to_thread(first_bytes, core.port)
        return received > 0

    await aeventually(taken, WAIT_S, what="a connection taken again")
    # A shell connects, as a shell does: again where its connection was closed (the
    # probe's own may still count at the core for a moment, on a loaded machine).
    links: list[RemoteLink] = []

    async def connected() -> bool:
        hello = Hello(9, 0, LINK_VERSION)
        link = RemoteLink([core.address], SECRET, hello, lambda s: None, lambda: None,
                          lambda: None)  # fmt: skip
        links.append(link)
        try:
            await link._open(core.address)  # the core's Settings came: connected
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err  # closed unread, only
            await link.aclose()
            return False
        return True

    try:
        await aeventually(connected, WAIT_S, what="a shell's link connected")
        assert links[-1].core == core.address and core.connections() == MAX_CONNECTIONS
    finally:
        for link in links:
            await link.aclose()


async def test_streams_over_the_connection_bound_wait(
    core: Core, channels: list[grpc.aio.Channel]
) -> None:
    """core_link.max_streams_per_connection: with that many streams open on one
    connection, gRPC's client holds the next (the core announced the bound); it starts
    once one of them ends."""
    channels.append(own_channel(core.address))
    streams = [LinkStream(channels[0], i) for i in range(MAX_STREAMS)]
    for stream in streams:
        await stream.hello()
    held = asyncio.ensure_future(LinkStream(channels[0], MAX_STREAMS).hello())
    done, _ = await asyncio.wait({held}, timeout=HELD_S)
    assert not done, "a stream over the bound started"
    streams[0].call.cancel()
    assert isinstance(await asyncio.wait_for(held, WAIT_S), Settings)


async def test_an_oversized_message_or_frame_is_refused(
    core: Core, channels: list[grpc.aio.Channel]
) -> None:
    """The largest message and frame a shell may send (core_link.max_message_bytes, by
    default what the largest request needs: one message, 4 MiB, here): a message over it
    is refused by gRPC (RESOURCE_EXHAUSTED) before it is buffered whole; a frame that says
    it is longer, however it is cut into messages, ends the shell's connection."""
    bound = core.server.config.link_max_message_bytes()
    assert bound == MESSAGE_BYTES
    channels.append(own_channel(core.address))
    big = LinkStream(channels[-1])
    await big.hello()
    await big.call.write(b"\0" * (bound + 1))
    assert await big.ended() == grpc.StatusCode.RESOURCE_EXHAUSTED

    channels.append(own_channel(core.address))
    long = LinkStream(channels[-1])
    await long.hello()
    await long.call.write((bound + 1).to_bytes(4, "big") + b"\0" * 1024)
    assert await long.ended() == grpc.StatusCode.OK  # the core closed it
    await aeventually(lambda: core.connections() == 0, WAIT_S, what="the core to drop them")


async def test_a_shell_of_another_link_version_is_closed_at_its_hello(
    core: Core, channels: list[grpc.aio.Channel], caplog: pytest.LogCaptureFixture
) -> None:
    """A shell whose ``Hello`` says another version of the link's records (0: one from
    before the version was said) gets no Settings: the core closes its stream at once
    and says why, instead of misreading its records later. Its own version connects."""
    for link in (0, LINK_VERSION + 1):
        channels.append(own_channel(core.address))
        stream = LinkStream(channels[-1])
        with caplog.at_level(logging.ERROR, logger="fair_frontend.core.shells"):
            await stream.call.write(encode(Hello(0, 0, link)))
            first = await asyncio.wait_for(stream.call.read(), WAIT_S)
            assert first is grpc.aio.EOF, "Settings sent to a shell of another version"
            assert await stream.call.code() == grpc.StatusCode.OK  # the core closed it
        assert f"speaks the link's version {link}, this core {LINK_VERSION}" in caplog.text
    channels.append(own_channel(core.address))
    assert isinstance(await LinkStream(channels[-1]).hello(), Settings)


async def test_a_shell_cuts_what_it_writes_into_messages_the_core_takes() -> None:
    """What a shell writes in one go (a loop iteration's frames: a burst of calls) may be
    larger than the core takes in one message: it goes out in messages of at most
    MESSAGE_BYTES, in order, the bytes whole (frames are reassembled across them)."""
    sent: list[bytes] = []

    async def write(message: bytes) -> None:
        sent.append(message)

    protocol = asyncio.Protocol()
    transport = StreamTransport(write, protocol)
    burst = bytes(range(256)) * ((2 * MESSAGE_BYTES + 12345) // 256)
    transport.write(b"small")
    transport.write(burst)
    transport.write(b"after")
    transport.close()
    assert await asyncio.wait_for(transport.finished, WAIT_S) is None
    assert max(len(m) for m in sent) <= MESSAGE_BYTES, [len(m) for m in sent]
    assert b"".join(sent) == b"small" + burst + b"after"
    assert transport.get_write_buffer_size() == 0


# ---- the raw TCP link (``fair_frontend.wire.tcp``, ``--link tcp``) ---------------------------


@pytest.fixture(scope="module")
def tcp_core(triton: EmbeddedTriton) -> Iterator[Core]:
    yield from leading(triton, "tcp")


def tcp_link(address: str, secret: bytes = SECRET) -> RemoteLink:
    return RemoteLink([address], secret, Hello(9, 0, LINK_VERSION), lambda s: None, lambda: None,
                      lambda: None, link="tcp")  # fmt: skip


async def test_the_tcp_link_refuses_a_wrong_secret_before_reading_a_record(tcp_core: Core) -> None:
    """A wrong secret is answered REFUSED and the connection closed: the ``Hello`` sent
    behind it is never read (no Settings come back), nothing is admitted, and a shell's
    link raises ``SecretRefused`` (its process exits rather than retry). The right one
    connects: the core's verdict, then its Settings. A peer that sends nothing, or no
    preamble, is closed (within core_link.handshake_timeout_s), unanswered."""
    assert tcp_core.server.shells is not None
    server = tcp_core.server.shells.server
    refused, admitted = server.refused, server.intake.admitted
    wrong = b"not-the-link-secret-0123456789abc"
    sent = preamble(wrong) + encode(Hello(1, 0, LINK_VERSION))
    received, closed = await asyncio.to_thread(first_bytes_of, tcp_core.port, sent)
    assert closed and received == REFUSED, received
    with pytest.raises(SecretRefused):
        await tcp_link(tcp_core.address, wrong)._open(tcp_core.address)
    assert server.refused == refused + 2 and server.intake.admitted == admitted
    assert tcp_core.connections() == 0
    for sent in (b"", b"GET / HTTP/1.1\r\n\r\n"):
        received, closed = await asyncio.to_thread(first_bytes_of, tcp_core.port, sent)
        assert closed and received == b"", (sent, received)
    link = tcp_link(tcp_core.address)
    await link._open(tcp_core.address)  # the core's Settings came: connected
    try:
        assert link.core == tcp_core.address and tcp_core.connections() == 1
    finally:
        await link.aclose()
    await aeventually(lambda: tcp_core.connections() == 0, WAIT_S, what="the shell gone")


def first_bytes_of(port: int, sent: bytes) -> tuple[bytes, bool]:
    """Connect, send ``sent``, read until the core closes the connection: what it sent,
    and whether it closed within WAIT_S."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(sent)
        received = b""
        try:
            while chunk := sock.recv(4096):
                received += chunk
                assert len(received) < 1 << 16, "the core sends more than its preface and GOAWAY"
        except ConnectionResetError:
            pass
        except TimeoutError:
            return received, False
        return received, True
