"""``fair-frontend core`` and ``fair-frontend shell``: the frontend split across hosts.

A core runs the one scheduler. With ``--election redis`` or ``kubernetes`` any number of
cores may run: each starts warm (its core up, Tritons connected, the operator's port
answering ``/v2/health/live``), waits for the lease, and only the leader accepts shells
(and answers ``/v2/health/ready``). A leader that loses its lease exits at once (its
queued work is resent by the shells to the next leader); SIGTERM drains what it holds,
then frees the lease for a standby. SIGHUP reloads the config file, as for ``serve``:
the leader's shells get what changed at once, and a standby reads the file again as it
takes the lease (``run_core``).

A new leader resumes the fairness state of the one before it (``--election redis``):
the leader publishes its deficits and virtual token counters every tick beside its
lease, and a standby reads them back as it takes the lease, before any shell connects
(``fair_frontend.fleet.debt``): a tenant that had taken more than its share is served
less after the failover, until even. Rate limits carry on unchanged: they live in Redis.

``fair-frontend shell`` runs ``--workers`` shell processes on one HTTP and one gRPC port
(``ShellSupervisor``), each connected to the leading one of the ``--core`` addresses
(``fair_frontend.shell.remote``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
from collections.abc import Callable, Sequence

from fair_frontend.config import Config
from fair_frontend.fleet import DEFAULT_KUBERNETES_LEASE_S, DEFAULT_LEASE_S
from fair_frontend.fleet.debt import FairnessJournal
from fair_frontend.fleet.election import Election, KubernetesLease, NoElection, RedisLease
from fair_frontend.server import FrontendServer, Listen, ShellPool
from fair_frontend.shell.remote import SECRET_REFUSED
from fair_frontend.shell.router import encode_core_sets, parse_core_sets
from fair_frontend.wire.remote import SECRET_ENV, Tls
from fair_frontend.wire.tcp import server_context

log = logging.getLogger("fair_frontend.fleet")

STOP_S = 12.0  # a remote shell's drain (DRAIN_S) and its exit


def advertised(listen: str, advertise: str | None) -> str:
    """The address shells reach this core at: ``--advertise``, else ``--listen``'s with
    this host's name where it listens on every address."""
    if advertise:
        return advertise
    host, _, port = listen.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


def lease_identity(args: argparse.Namespace) -> str:
    """Who this core is in the lease: ``--identity``, else the address shells reach it at
    (``advertised``), this host's name, this process's id and a random part.

    Unique per process by default: an address alone is not (two cores on different hosts
    both listening on 127.0.0.1:P, containers sharing a host name, a core restarted in
    the pod of the one before it), and the lease is renewed, freed and, for a Kubernetes
    Lease, taken again by whoever carries the name it holds: two cores of one name would
    both lead."""
    if args.identity:
        return str(args.identity)
    where = advertised(args.listen, args.advertise)
    return f"{where}@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(6)}"


def make_election(args: argparse.Namespace, config: Config, identity: str) -> Election:
    if args.election == "redis":
        url = config.rate_limiting.storage_url()
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                "--election redis uses the Redis of rate_limiting.storage, which is "
                f"{config.rate_limiting.storage.split(':', 1)[0]}:// here"
            )
        lease_s = DEFAULT_LEASE_S if args.lease_s is None else args.lease_s
        return RedisLease(url, args.lease_name, identity, lease_s)
    if args.election == "kubernetes":
        lease_s = DEFAULT_KUBERNETES_LEASE_S if args.lease_s is None else args.lease_s
        return KubernetesLease(args.lease_name, identity, lease_s)
    return NoElection(identity)


async def run_core(
    config: Config,
    triton_urls: Sequence[str],
    listen: Listen,
    args: argparse.Namespace,
    secret: bytes,
    stop: asyncio.Event,
    reload: Callable[[FrontendServer], None] | None = None,
) -> int:
    """Serve as one of the fleet's cores until ``stop`` (a signal) or the lease is lost
    (exit status 1: the orchestrator starts it again, as a standby).

    ``reload`` (``fair-frontend core``: read the config file again and apply it, as
    ``serve`` does) runs on SIGHUP, leading or standing by: a leader's shells get what
    changed at once (their settings are sent again), a standby's core holds it for when
    it leads. It also runs as a standby takes the lease: a reload signalled to the
    leader alone (a key revoked, a tenant removed) is not undone by a failover to a core
    still holding the file as it was when that core started."""
    tls = None
    if args.tls_cert or args.tls_key or args.tls_client_ca:
        tls = Tls(args.tls_cert, args.tls_key, args.tls_client_ca)
        # Unreadable or incomplete: said now, not once leading.
        server_context(tls) if args.link == "tcp" else tls.server_credentials()
    identity = lease_identity(args)
    election = make_election(args, config, identity)
    server = FrontendServer(config, list(triton_urls), listen, workers=0)
    started = False
    signalled = False  # a SIGHUP before the start finished: applied right after it

    def on_sighup() -> None:
        nonlocal signalled
        if reload is None:
            return
        if started:
            reload(server)
        else:
            signalled = True

    # Handled from the start: SIGHUP's default action would kill the core.
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, on_sighup)
    try:
        await server.start()
    except BaseException:
        loop.remove_signal_handler(signal.SIGHUP)
        raise
    started = True
    if signalled and reload is not None:
        reload(server)
    log.info(
        "core %s started (operator's port %d); %s",
        identity,
        server.metrics_port,
        "waiting for the lease" if args.election != "none" else "leading",
    )
    acquire = asyncio.ensure_future(election.acquire())
    stopped = asyncio.ensure_future(stop.wait())
    journal = FairnessJournal.of(election)
    follow: asyncio.Future[None] | None = None
    try:
        await asyncio.wait((acquire, stopped), return_when=asyncio.FIRST_COMPLETED)
        if not acquire.done():
            acquire.cancel()
            return 0
        if reload is not None and args.election != "none":
            reload(server)  # the file as it is now, before any shell connects
        if journal is not None and server.core is not None:
            await journal.resume(server.core)  # the debt the last leader left
            follow = asyncio.ensure_future(journal.follow(server.core))
        await server.lead(args.listen, secret, tls, args.link)
        print(
            f"fair_frontend core {identity} leads: shells connect to port {server.core_port}",
            flush=True,
        )
        lost = asyncio.ensure_future(election.lost.wait())
        await asyncio.wait((lost, stopped), return_when=asyncio.FIRST_COMPLETED)
        if lost.done() and not stop.is_set():
            log.error("lost the lease: stopping at once (the next leader takes the shells)")
            return 1
        log.info("stopping: finishing queued and in-flight requests, then freeing the lease")
        return 0
    finally:
        stopped.cancel()
        if follow is not None:
            follow.cancel()
        if not election.lost.is_set() or stop.is_set():
            await server.stop()
            if follow is not None and journal is not None and server.core is not None:
                await journal.last(server.core)  # what the drain left, for the next
        await election.release()
        close = getattr(election, "close", None)
        if close is not None:
            await close()
        loop.remove_signal_handler(signal.SIGHUP)


class ShellSupervisor(ShellPool):
    """``workers`` shell processes on one HTTP and one gRPC port, for cores elsewhere:
    ``ShellPool``'s sockets and restarts, without a core in this process. A shell whose
    secret the core refused is not restarted: the supervisor stops (``failed``)."""

    def __init__(
        self,
        cores: Sequence[str],
        secret: bytes,
        listen: Listen,
        workers: int,
        log_format: str = "json",
        tls: Tls | None = None,
        link: str = "grpc",
    ) -> None:
        self.cores = list(cores)
        self.link = link
        self.tls = tls or Tls()
        self.secret = secret
        self._format = log_format
        self._supervise(listen, workers)
        self.failed = asyncio.Event()
        os.environ[SECRET_ENV] = secret.decode("latin-1")  # the children's, not argv

    async def start(self) -> None:
        self._bind()
        for index in range(self.workers):
            await self._spawn(index)

    def _where(self) -> list[str]:
        tls = [
            arg
            for flag, path in (("--tls-ca", self.tls.ca), ("--tls-cert", self.tls.cert),
                               ("--tls-key", self.tls.key))
            if path is not None
            for arg in (flag, path)
        ]  # fmt: skip
        where = ["--cores", encode_core_sets(parse_core_sets(self.cores)), *tls]
        return where + (["--link", self.link] if self.link != "grpc" else [])

    def _log_format(self) -> str:
        return self._format

    def fatal(self, code: int) -> bool:
        if code == SECRET_REFUSED:
            log.error("a shell's secret was refused (see above): stopping")
            self.failed.set()
            return True
        return False

    async def stop(self, timeout_s: float = STOP_S) -> None:
        self._stopping = True
        for p in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)  # each drains what it has taken
        await self._reap(timeout_s)
        self._close_sockets()
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)


async def run_shells(args: argparse.Namespace, secret: bytes, stop: asyncio.Event) -> int:
    parse_core_sets(args.core)  # a ValueError names a --core that cannot be
    listen = Listen(host=args.host, http_port=args.http_port, grpc_port=args.grpc_port)
    tls = Tls(args.tls_cert, args.tls_key, args.tls_ca)
    supervisor = ShellSupervisor(
        args.core,
        secret,
        listen,
        args.workers,
        args.log_format,
        tls if tls != Tls() else None,
        args.link,
    )
    await supervisor.start()
    print(
        f"fair_frontend shells: HTTP {args.host}:{supervisor.http_port}, gRPC "
        f"{args.host}:{supervisor.grpc_port}, {args.workers} processes, cores "
        f"{', '.join(args.core)}",
        flush=True,
    )
    failed = asyncio.ensure_future(supervisor.failed.wait())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((failed, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        failed.cancel()
        stopped.cancel()
        await supervisor.stop()
    return 2 if supervisor.failed.is_set() else 0
