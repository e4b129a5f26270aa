"""Runs the frontend: the core, its shells, and the metrics listener.

``FrontendServer`` is what ``fair-frontend serve`` and ``up`` run, and what tests start
in-process. The core (admission, schedulers, dispatch) always lives in this process.
With ``workers=1`` the one shell lives here too (one process, as a small deployment
wants); with more, ``ShellPool`` runs that many shell processes on the same HTTP and
gRPC ports (``fair_frontend.shell``), restarting one that dies. Ports given as 0 are
chosen by the OS; the bound ports are attributes after ``start()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import uvloop
from aiohttp import web
from tritonclient.grpc import service_pb2, service_pb2_grpc

from fair_frontend import __version__
from fair_frontend.auth import KeyRing
from fair_frontend.backends import backend
from fair_frontend.backends.protocol import BackendServer
from fair_frontend.config import Config
from fair_frontend.core import Core
from fair_frontend.core.shells import (
    QUEUE_VIEW_INTERVAL_S,
    CoreServer,
    Intake,
    ShellConnection,
    shell_config,
)
from fair_frontend.errors import FrontendError
from fair_frontend.shell import tls as tenant_tls
from fair_frontend.shell.gateway import Gateway
from fair_frontend.shell.grpc_server import abort, make_server
from fair_frontend.shell.http_server import HttpShell, error_response, proto_to_json
from fair_frontend.shell.link import LocalLink
from fair_frontend.wire.records import Draining, Settings, Stop
from fair_frontend.wire.remote import Tls

log = logging.getLogger(__name__)

MAX_DEFAULT_WORKERS = 8
SHELL_START_TIMEOUT_S = 60.0
RESTART_BACKOFF_S = (0.1, 5.0)  # first delay before restarting a dead shell, and the cap
# A shell killed by a signal before it was ready is started again this many times
# before start() fails: one crash while a busy machine spawns it is not a broken build.
START_RETRIES = 1


def default_workers() -> int:
    """Shell processes by default: one per core this process may use, less the core's own,
    at most 8 (beyond that, the one core process is the limit; ``benchmarks/bench_core``).
    So one process on a machine of 2 cores or fewer: there, a shell process and the core
    would share the cores Triton and the clients need (``benchmarks/bench_throughput``)."""
    return max(1, min(usable_cpus() - 1, MAX_DEFAULT_WORKERS))


def usable_cpus(cgroup: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The CPUs this process may use: its affinity, bounded by its cgroup's CPU quota (a
    container limited to 2 CPUs on a 64-core node sees 64 in its affinity)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path(cgroup).read_text().split()[:2]
    except (OSError, ValueError):
        return cpus
    if quota != "max" and int(period) > 0:
        cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    return cpus


@dataclass
class Listen:
    host: str = "127.0.0.1"
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    metrics_host: str | None = None  # default: host
    metrics_grpc_port: int | None = None  # the operator's gRPC listener; None: none


class FrontendServer:
    def __init__(
        self,
        config: Config,
        triton_url: str | Sequence[str],
        listen: Listen,
        *,
        workers: int = 1,
        core_factory: Callable[[Config, list[BackendServer]], Core] | None = None,
    ) -> None:
        if workers < 0:
            raise ValueError(f"workers must be >= 0, not {workers}")
        self.config = config
        # The Tritons behind every endpoint (``Triton.pool``): serve's --triton-url, one or
        # repeated, or the config's triton.backends where none is given.
        urls = [triton_url] if isinstance(triton_url, str) else list(triton_url)
        self.backends = config.triton.pool(urls)
        self.triton_urls = [b.grpc_url for b in self.backends]
        self.http_urls = [b.http_url or "" for b in self.backends]
        self.triton_url = self.triton_urls[0]
        self.listen = listen
        self.workers = workers
        self._factory = core_factory or (lambda c, f: Core(c, f))
        self.core: Core | None = None
        self.gateway: Gateway | None = None  # the in-process shell (workers=1)
        self._verdicts: asyncio.Task[None] | None = None  # its view of the throttle
        self.shells: ShellPool | RemoteShells | None = None
        self.leading = workers > 0  # workers=0 (a core for remote shells): once lead()
        self.core_port = 0  # where remote shells connect, once leading
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None
        self._operator_grpc: grpc.aio.Server | None = None
        self.http_port = 0
        self.grpc_port = 0
        self.metrics_port = 0
        self.metrics_grpc_port = 0  # the operator's gRPC listener, once started (0: none)

    @property
    def frontend(self) -> Core | None:
        """The core (tests and benchmarks read its schedulers and counters)."""
        return self.core

    async def start(self) -> None:
        # One forwarder per Triton, the core's and (with workers=1) the shell's: a grant
        # names the Triton by its index in this list, which the shell processes get too.
        forwarders = [
            backend(
                server.grpc_url,
                request_timeout_s=self.config.triton.request_timeout_s,
                http_url=server.http_url,
            )
            for server in self.backends
        ]
        self.core = self._factory(self.config, forwarders)
        await self.core.start()
        # Metrics first: once a shell listens, it answers readiness probes, and everything
        # it reports on must be up by then.
        await self._start_metrics()
        if self.workers == 0:
            self.shells = RemoteShells(self.core, self.triton_urls, self.http_urls)
            await self.shells.start()
        elif self.workers == 1:
            await self._start_local_shell(forwarders)
        else:
            self.shells = ShellPool(
                self.core, self.triton_urls, self.listen, self.workers, self.http_urls
            )
            await self.shells.start()
            self.http_port, self.grpc_port = self.shells.http_port, self.shells.grpc_port

    async def lead(
        self, address: str, secret: bytes, tls: Tls | None = None, link: str = "grpc"
    ) -> None:
        """A core for shells elsewhere (``workers=0``), started warm: from now on it
        accepts them at ``address`` (HOST:PORT), each carrying ``secret`` (over ``tls``
        where given), on ``link``: gRPC streams or raw TCP (``fair_frontend.wire.tcp``)."""
        assert isinstance(self.shells, RemoteShells)
        self.core_port = await self.shells.server.listen(address, secret, tls, link)
        self.leading = True

    @property
    def ready(self) -> bool:
        """Serving: leading, and the core admitting."""
        return self.leading and self.core is not None and self.core.accepting

    async def _start_local_shell(self, forwarders: list[BackendServer]) -> None:
        assert self.core is not None
        link = LocalLink(self.core, Intake(self.core))  # the intake shell processes have
        self.gateway = Gateway(self.config, self.core.keyring, link, forwarders)
        # The tiers the throttle closed, on the shell processes' tick (CoreServer's).
        self._verdicts = asyncio.get_running_loop().create_task(self._refresh_overload())
        shell = HttpShell(self.gateway, max_body_bytes=self.config.max_wire_bytes())
        self._runner = shell.runner()
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self.listen.host,
            self.listen.http_port,
            ssl_context=tenant_tls.http_context(self.config.server),
        )
        await site.start()
        self.http_port = _bound_port(site)
        self._grpc = make_server(self.gateway)
        self.grpc_port = _bind_grpc(
            self._grpc,
            f"{_grpc_host(self.listen.host)}:{self.listen.grpc_port}",
            tenant_tls.grpc_credentials(self.config.server),
        )
        await self._grpc.start()

    async def _refresh_overload(self) -> None:
        assert self.core is not None
        while True:
            await asyncio.sleep(QUEUE_VIEW_INTERVAL_S)
            self.core.shedding.refresh()

    # ---- the operator's listener ----------------------------------------------------
    #
    # What shows every tenant's traffic lives apart from the tenant ports: /metrics and
    # Triton's statistics extension (over HTTP on the metrics port; over gRPC on
    # metrics_grpc_port where set), on metrics_host, in this (the core's) process. No key
    # is asked there: whoever reaches the address is the operator (loopback by default;
    # in Kubernetes the pod network, where a NetworkPolicy admits Prometheus only). The
    # tenant ports serve statistics too only with server.statistics: keyed (Gateway).

    async def _start_metrics(self) -> None:
        host = self.listen.metrics_host or self.listen.host
        self._metrics_runner = web.AppRunner(self.metrics_app(), access_log=None)
        await self._metrics_runner.setup()
        msite = web.TCPSite(self._metrics_runner, host, self.listen.metrics_port)
        await msite.start()
        self.metrics_port = _bound_port(msite)
        if self.listen.metrics_grpc_port is not None:
            self._operator_grpc = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
                OperatorGrpc(self), self._operator_grpc
            )
            self.metrics_grpc_port = _bind_grpc(
                self._operator_grpc, f"{_grpc_host(host)}:{self.listen.metrics_grpc_port}"
            )
            await self._operator_grpc.start()

    async def collect(self) -> None:
        """Count what the shells answered themselves before a scrape or statistics call."""
        if self.shells is not None:
            await self.shells.collect_tallies()

    async def statistics(self, model: str, version: str) -> Any:
        """The statistics extension's answer for the operator (every tenant's traffic)."""
        assert self.core is not None
        await self.collect()
        return await self.core.statistics(model, version)

    def metrics_app(self) -> web.Application:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        registry = getattr(self.core, "registry", None)

        async def metrics(request: web.Request) -> web.Response:
            await self.collect()
            body = generate_latest(registry) if registry is not None else b""
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def statistics(request: web.Request) -> web.Response:
            model = request.match_info.get("model", "")
            version = request.match_info.get("version", "")
            try:
                answer = await self.statistics(model, version)
            except FrontendError as err:
                return error_response(err)
            return web.json_response(proto_to_json(answer))

        async def live(request: web.Request) -> web.Response:
            return web.Response(status=200)

        async def ready(request: web.Request) -> web.Response:
            # A standby core is live, not ready: a Service routes shells to the leader.
            return web.Response(status=200 if self.ready else 503)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v2/health/live", live)
        app.router.add_get("/v2/health/ready", ready)
        # Triton's statistics extension, the tenant ports' paths (tritonclient's
        # get_inference_statistics pointed here works unchanged).
        app.router.add_get("/v2/models/stats", statistics)
        app.router.add_get("/v2/models/{model}/stats", statistics)
        app.router.add_get("/v2/models/{model}/versions/{version}/stats", statistics)
        return app

    def reload(self, config: Config, keyring: KeyRing | None = None) -> list[str]:
        """Apply a new config (SIGHUP) in the core and in every shell; see ``Core.reload``
        (``keyring``: ``config``'s keys, where the caller has read them already). The
        shells get the config the core runs: ``config`` with the running values of what
        needs a restart (the notes name them)."""
        assert self.core is not None
        notes = self.core.reload(config, keyring)
        self.config = self.core.config
        if self.gateway is not None:
            self.gateway.configure(self.core.config, self.core.keyring)
        if self.shells is not None:
            self.shells.server.broadcast(self.shells.settings())
        return notes

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop accepting, finish what is queued and in flight, close."""
        # Drain first, while the listeners can still deliver the answers.
        if self.shells is not None:
            self.shells.server.broadcast(Draining())
        if self.core is not None:
            try:
                await asyncio.wait_for(self.core.shutdown(grace_s), grace_s + 5.0)
            except TimeoutError:
                log.warning("shutdown: gave up waiting for in-flight batches")
            await self._quiet(self.core)
        if self.shells is not None:
            await self.shells.stop()
        if self._verdicts is not None:
            self._verdicts.cancel()
        if self._grpc is not None:
            await self._grpc.stop(1.0)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        if self._operator_grpc is not None:
            await self._operator_grpc.stop(1.0)
        if self.core is not None:
            for forwarder in self.core.forwarders:
                await forwarder.close()

    @staticmethod
    async def _quiet(core: Core, quiet_s: float = 0.25, limit_s: float = 5.0) -> None:
        """Keep the listeners while calls still arrive (each answered UNAVAILABLE: the
        frontend is shutting down), until none has for ``quiet_s``: calls a busy server
        had accepted but not yet handed to a handler would be cancelled by closing the
        listener, unanswered."""
        until = time.monotonic() + limit_s
        while time.monotonic() < until and core.clock.now() - core.last_call_at < quiet_s:
            await asyncio.sleep(0.05)


class OperatorGrpc(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The operator's gRPC listener (``server.metrics_grpc_port``): the statistics
    extension (``ModelStatistics``) and what a client checks before it (server health and
    metadata). Every other method is UNIMPLEMENTED: no inference and no model doors here."""

    def __init__(self, server: FrontendServer) -> None:
        self.server = server

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        core = self.server.core
        return service_pb2.ServerReadyResponse(ready=core is not None and core.accepting)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerMetadataResponse(
            name="fair_frontend", version=__version__, extensions=["statistics"]
        )

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        try:
            return await self.server.statistics(request.name, request.version)
        except FrontendError as err:
            await abort(context, err)


def _bind_grpc(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None
) -> int:
    """``server.add_insecure_port`` (``add_secure_port`` with ``credentials``), failing as
    a socket's bind does (gRPC raises a bare RuntimeError for a port in use)."""
    try:
        if credentials is not None:
            return int(server.add_secure_port(address, credentials))
        return int(server.add_insecure_port(address))
    except RuntimeError as err:
        raise OSError(errno.EADDRINUSE, f"gRPC cannot bind {address} (in use?)") from err


def _free_port(family: socket.AddressFamily, host: str, port: int) -> int:
    """``port`` (0: one the kernel picks) if nothing holds it, else OSError (EADDRINUSE).

    The shells share their gRPC port through SO_REUSEPORT, which any other socket of the
    same user with SO_REUSEPORT could join as well (another frontend, any gRPC server): a
    bind without it, first, fails on a port anyone holds, as Triton's own does."""
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT only
        probe.bind((host, port))
        return int(probe.getsockname()[1])


class RemoteShells:
    """The shells of a core that runs none itself (``fair-frontend core``): the ones that
    connect over the network (``CoreServer.listen``), on other hosts or this one."""

    def __init__(
        self, core: Core, triton_urls: Sequence[str], http_urls: Sequence[str] = ()
    ) -> None:
        self.core = core
        self.triton_urls = list(triton_urls)
        self.http_urls = list(http_urls)
        self.server = CoreServer(core, self.settings, None)
        self.http_port = 0
        self.grpc_port = 0

    def settings(self) -> Settings:
        return _settings(self.core, self.triton_urls, self.http_urls)

    async def start(self) -> None:
        await self.server.start()

    async def collect_tallies(self) -> None:
        await self.server.flush_tallies()

    async def stop(self, timeout_s: float = 10.0) -> None:
        self.server.broadcast(Stop())
        await self.server.close()


def _settings(core: Core, triton_urls: Sequence[str], http_urls: Sequence[str]) -> Settings:
    """What a shell is told of the config: sent when it connects and on every reload."""
    keys = {d.hex(): tenant for d, tenant in core.keyring.digests().items()}
    return Settings(
        shell_config(core.config), keys, triton_urls[0], list(triton_urls), list(http_urls)
    )


class ShellPool:
    """``workers`` shell processes on one HTTP and one gRPC port, kept running.

    HTTP: this process binds the listening socket and every shell inherits it and
    accepts from it. gRPC: each shell binds the port itself (grpc sets SO_REUSEPORT);
    this process holds a placeholder bound to it, never listening, so the port stays
    this frontend's while shells come and go. A shell that exits is started again
    (after a back-off that doubles while it keeps dying); the core has dropped its
    queued work the moment its connection closed.
    """

    def __init__(
        self,
        core: Core,
        triton_urls: str | Sequence[str],
        listen: Listen,
        workers: int,
        http_urls: Sequence[str] = (),
    ) -> None:
        self.core = core
        self.triton_urls = [triton_urls] if isinstance(triton_urls, str) else list(triton_urls)
        self.http_urls = list(http_urls)  # each Triton's HTTP address, "" where none
        self._supervise(listen, workers)
        self.server = CoreServer(core, self.settings, os.path.join(self._dir, "core.sock"))
        self.server.on_ready = self._on_ready

    def _supervise(self, listen: Listen, workers: int) -> None:
        """The state of the shell processes this pool keeps running."""
        self.listen = listen
        self.workers = workers
        self._dir = tempfile.mkdtemp(prefix="fair-frontend-")
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.restarts = 0
        self.start_retries: dict[int, int] = {}
        self._ready: dict[int, asyncio.Future[None]] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._http_sock: socket.socket | None = None
        self._grpc_hold: socket.socket | None = None
        self.http_port = 0
        self.grpc_port = 0

    def settings(self) -> Settings:
        return _settings(self.core, self.triton_urls, self.http_urls)

    async def start(self) -> None:
        await self.server.start()
        self._bind()
        for index in range(self.workers):
            await self._spawn(index)
        try:
            await asyncio.wait_for(
                asyncio.gather(*(self._ready[i] for i in range(self.workers))),
                SHELL_START_TIMEOUT_S,
            )
        except BaseException:
            await self.stop()
            raise
        log.info("%d shell processes serving", self.workers)

    def _bind(self) -> None:
        """The HTTP listening socket the shells inherit, and the gRPC port they share."""
        host = self.listen.host
        family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
        http = socket.socket(family, socket.SOCK_STREAM)
        http.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        http.bind((host, self.listen.http_port))
        http.listen(4096)
        http.set_inheritable(True)
        self._http_sock = http
        self.http_port = http.getsockname()[1]
        hold = socket.socket(family, socket.SOCK_STREAM)
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        hold.bind((host, _free_port(family, host, self.listen.grpc_port)))
        self._grpc_hold = hold
        self.grpc_port = hold.getsockname()[1]

    def _where(self) -> list[str]:
        """How a shell process finds its core: this one's Unix socket."""
        assert self.server.path is not None
        return ["--core", self.server.path]

    def _log_format(self) -> str:
        return self.core.config.observability.log_format

    async def _spawn(self, index: int) -> None:
        assert self._http_sock is not None
        ready = self._ready.get(index)
        if ready is None or ready.done():  # a start retry keeps the future start() awaits
            self._ready[index] = asyncio.get_running_loop().create_future()
        root = logging.getLogger()
        cmd = [
            sys.executable,
            "-X",
            "faulthandler",  # a crash leaves its Python stack on stderr
            "-m",
            "fair_frontend.shell",
            *self._where(),
            "--index",
            str(index),
            "--http-fd",
            str(self._http_sock.fileno()),
            "--grpc-host",
            _grpc_host(self.listen.host),
            "--grpc-port",
            str(self.grpc_port),
            "--log-level",
            logging.getLevelName(root.level),
            "--log-format",
            self._log_format(),
        ]
        proc = await asyncio.create_subprocess_exec(*cmd, pass_fds=(self._http_sock.fileno(),))
        self.processes[index] = proc
        watcher = asyncio.get_running_loop().create_task(self._watch(index, proc))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)

    def _on_ready(self, conn: ShellConnection) -> None:
        fut = self._ready.get(conn.index)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def _watch(self, index: int, proc: asyncio.subprocess.Process) -> None:
        backoff = RESTART_BACKOFF_S[0]
        while True:
            code = await proc.wait()
            fut = self._ready.get(index)
            if fut is not None and not fut.done() and self._retry_start(index, proc, code):
                await self._spawn(index)
                return  # the new process has a watcher of its own
            if fut is not None and not fut.done():
                fut.set_exception(RuntimeError(f"shell {index} exited with {code} at start"))
                fut.exception()  # start() reads it; a restart's readiness nobody awaits
            if self._stopping:
                return
            if self.fatal(code):
                return
            log.error("shell %d (pid %d) exited with %s; restarting it", index, proc.pid, code)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_S[1])
            if self._stopping:
                return
            self.restarts += 1
            await self._spawn(index)
            return  # the new process has a watcher of its own

    def _retry_start(self, index: int, proc: asyncio.subprocess.Process, code: int) -> bool:
        """Whether a shell that died before it was ready is started again: killed by a
        signal (a crash, not a refusal such as a bad argument), within START_RETRIES."""
        tried = self.start_retries.get(index, 0)
        if self._stopping or code >= 0 or tried >= START_RETRIES:
            return False
        self.start_retries[index] = tried + 1
        log.warning(
            "shell %d (pid %d) died of signal %d before it was ready; starting it again",
            index,
            proc.pid,
            -code,
        )
        return True

    async def _reap(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the shells told to stop, then kill the rest."""
        procs = list(self.processes.values())
        if not procs:
            return
        await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=timeout_s)
        for p in procs:
            if p.returncode is None:
                log.warning("shell pid %d did not stop: killing it", p.pid)
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()

    def _close_sockets(self) -> None:
        for sock in (self._http_sock, self._grpc_hold):
            if sock is not None:
                sock.close()

    def fatal(self, code: int) -> bool:
        """Whether a shell's exit status says restarting it would not help."""
        return False

    async def collect_tallies(self) -> None:
        """What the shells answered themselves, counted before a scrape is answered."""
        await self.server.flush_tallies()

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self.server.broadcast(Stop())
        await self._reap(timeout_s)
        await self.server.close()
        self._close_sockets()
        shutil.rmtree(self._dir, ignore_errors=True)


def _bound_port(site: web.TCPSite) -> int:
    server: Any = site._server  # aiohttp keeps the asyncio server here
    return int(server.sockets[0].getsockname()[1])


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class BackgroundServer:
    """A ``FrontendServer`` on its own event loop in a thread (tests, benchmarks)."""

    def __init__(self, server: FrontendServer) -> None:
        self.server = server
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> FrontendServer:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(90)
        except BaseException:
            self.__exit__()  # what did start (a listener, shells) stops with the loop
            raise
        return self.server

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the server's loop (to inspect its state) and return the result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)
