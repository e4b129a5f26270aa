"""A shell process: ``python -m fair_frontend.shell``, started and supervised by the core.

It connects to the core's socket, says ``Hello``, takes its ``Settings`` (the config,
the API keys' digests, Triton's address), serves HTTP on the listening socket it
inherited (every shell accepts from the same one) and gRPC on the shared port (each
shell binds it with SO_REUSEPORT; the kernel spreads connections over them), and says
``Ready``. It exits when the core says ``Stop`` or when the core is gone.

Signals: the core coordinates shutdown (it drains first, while the shells still carry
answers), so a shell ignores Ctrl-C's SIGINT and a SIGTERM sent to the whole process
group; the kernel sends it SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), and
then, its parent gone, it exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

import uvloop
from aiohttp import web

from fair_frontend.auth import KeyRing
from fair_frontend.backends import backend
from fair_frontend.backends.protocol import BackendServer
from fair_frontend.config import parse_config
from fair_frontend.observability.logs import configure_logging
from fair_frontend.parent_death import die_with_parent
from fair_frontend.shell import tls as tenant_tls
from fair_frontend.shell.gateway import Gateway
from fair_frontend.shell.grpc_server import make_server
from fair_frontend.shell.http_server import HttpShell
from fair_frontend.shell.remote import SECRET_REFUSED, RemoteLink, SecretRefused
from fair_frontend.shell.router import RouterLink, decode_core_sets
from fair_frontend.shell.socket_link import SocketLink
from fair_frontend.wire.records import LINK_VERSION, Hello, Ready, Settings
from fair_frontend.wire.remote import SECRET_ENV, SecretError, Tls, load_secret
from fair_frontend.wire.tcp import LINKS

log = logging.getLogger("fair_frontend.shell")

DRAIN_S = 10.0  # a remote shell's stop: the most it waits for what it has taken


def keyring_of(settings: Settings) -> KeyRing:
    return KeyRing({bytes.fromhex(d): tenant for d, tenant in settings.keys.items()})


class ShellProcess:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.parent = os.getppid()
        self.gateway: Gateway | None = None
        self.settings: asyncio.Future[Settings] | None = None
        self.done: asyncio.Event | None = None
        self.remote: RemoteLink | RouterLink | None = None

    def on_settings(self, settings: Settings) -> None:
        if self.settings is not None and not self.settings.done():
            self.settings.set_result(settings)
        elif self.gateway is not None:  # a reload
            self.gateway.configure(parse_config(settings.config), keyring_of(settings))
            log.info("shell %d: config reloaded", self.args.index)

    def on_end(self) -> None:
        assert self.done is not None and self.settings is not None
        self.done.set()
        if not self.settings.done():
            self.settings.cancel()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.settings = loop.create_future()
        self.done = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        hello = Hello(self.args.index, os.getpid(), LINK_VERSION)
        link: SocketLink
        if self.args.cores:  # cores elsewhere (fair-frontend shell): the leader's
            try:
                secret = load_secret(None, SECRET_ENV)
            except SecretError as err:
                log.error("shell %d: %s", self.args.index, err)
                return SECRET_REFUSED
            tls = None
            if self.args.tls_ca or self.args.tls_cert:
                tls = Tls(self.args.tls_cert, self.args.tls_key, self.args.tls_ca)
            sets = decode_core_sets(self.args.cores)
            remote: RemoteLink | RouterLink
            common = (secret, hello, self.on_settings, self.on_end, _nothing)
            try:
                if len(sets) == 1:
                    remote = RemoteLink(sets[0][1], *common, tls=tls, link=self.args.link)
                else:  # cores that own disjoint sets of endpoints
                    remote = RouterLink(sets, *common, tls=tls, link=self.args.link)
            except SecretError as err:
                log.error("shell %d: %s", self.args.index, err)
                return SECRET_REFUSED
            try:
                await remote.find_core()
            except SecretRefused as err:
                log.error(
                    "shell %d: the core refused this shell's secret (%s): check that every "
                    "core and shell has the same one",
                    self.args.index,
                    err,
                )
                return SECRET_REFUSED
            link = self.remote = remote  # type: ignore[assignment]
        else:
            link = await SocketLink.connect(
                self.args.core, self.on_settings, self.on_end, self.on_end
            )
            link.send(hello)
        try:
            settings = await self.settings
        except asyncio.CancelledError:
            log.error("shell %d: the core went away before it sent settings", self.args.index)
            return 1
        config = parse_config(settings.config)
        if self.remote is not None:
            self.remote.hold_s = config.triton.max_outage_s
        tritons = forwarders(settings, config.triton.request_timeout_s)
        self.gateway = Gateway(config, keyring_of(settings), link, tritons)

        shell = HttpShell(self.gateway, max_body_bytes=config.max_wire_bytes())
        runner = shell.runner()
        await runner.setup()
        sock = socket.socket(fileno=self.args.http_fd)
        site = web.SockSite(runner, sock, ssl_context=tenant_tls.http_context(config.server))
        await site.start()
        grpc_server = make_server(self.gateway, shared_port=True)
        address = f"{self.args.grpc_host}:{self.args.grpc_port}"
        credentials = tenant_tls.grpc_credentials(config.server)
        if credentials is not None:
            grpc_port = grpc_server.add_secure_port(address, credentials)
        else:
            grpc_port = grpc_server.add_insecure_port(address)
        if grpc_port == 0:
            log.error("shell %d: cannot bind gRPC port %d", self.args.index, self.args.grpc_port)
            return 1
        await grpc_server.start()
        ready = Ready(sock.getsockname()[1], grpc_port)
        if self.remote is not None:
            self.remote.ready = ready
        link.send(ready)
        await self.done.wait()
        if self.remote is not None:
            await self._drain(self.remote)
        link.flush_tally()
        await grpc_server.stop(1.0)
        await runner.cleanup()
        for triton in tritons:
            await triton.close()
        if self.remote is not None:
            await self.remote.aclose()
        else:
            link.close()
        return 0

    async def _drain(self, link: RemoteLink | RouterLink, grace_s: float = DRAIN_S) -> None:
        """A remote shell asked to stop: readiness turns false at once, and what it has
        taken is answered (or streamed to its end) within ``grace_s``."""
        link.accepting = False
        until = asyncio.get_running_loop().time() + grace_s
        while link.pending and asyncio.get_running_loop().time() < until:
            await asyncio.sleep(0.05)

    def _on_sigterm(self) -> None:
        # A shell of this host's core: the core coordinates the stop, unless it is gone.
        # A shell of remote cores (fair-frontend shell) drains and stops on its own.
        if self.remote is not None or os.getppid() != self.parent:
            assert self.done is not None
            self.done.set()


def _nothing() -> None:
    pass


def forwarders(settings: Settings, request_timeout_s: float) -> list[BackendServer]:
    """One forwarder per Triton of the pool, in the settings' order (a grant names the one
    to stream from), each with its HTTP address where the core has one for it."""
    urls = settings.triton_urls or [settings.triton_url]
    http = settings.triton_http_urls
    return [
        backend(
            url,
            request_timeout_s=request_timeout_s,
            http_url=(http[i] if i < len(http) else "") or None,
        )
        for i, url in enumerate(urls)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fair_frontend.shell")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--core", help="the core's Unix socket (a shell of this host's core)")
    where.add_argument(
        "--cores",
        help="HOST:PORT,... of cores elsewhere (fair-frontend shell); sets of cores that own "
        "endpoints: MODEL,...=HOST:PORT,...;... (shell.router); the secret comes in "
        f"${SECRET_ENV}",
    )
    parser.add_argument(
        "--link", choices=LINKS, default="grpc", help="--cores: the link's transport (gRPC, TCP)"
    )
    parser.add_argument("--tls-ca", help="--cores: the CA the core's certificate is checked by")
    parser.add_argument("--tls-cert", help="--cores: this shell's certificate (mutual TLS)")
    parser.add_argument("--tls-key", help="--cores: its private key")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--http-fd", type=int, required=True, help="inherited listening socket")
    parser.add_argument("--grpc-host", required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", default="json")
    args = parser.parse_args(argv)
    die_with_parent(signal.SIGTERM)  # elsewhere than Linux the lost connection ends it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(args.log_format, args.log_level)
    return uvloop.run(ShellProcess(args).run())


if __name__ == "__main__":
    sys.exit(main())
