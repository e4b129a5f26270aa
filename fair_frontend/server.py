"""Runs the frontend: the HTTP, gRPC and metrics listeners around one ``Frontend``.

``FrontendServer`` is what ``fair-frontend serve`` and ``up`` run, and what tests start
in-process. Ports given as 0 are chosen by the OS; the bound ports are attributes after
``start()``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import uvloop
from aiohttp import web

from fair_frontend.config import Config
from fair_frontend.forwarder import TritonForwarder
from fair_frontend.grpc_server import make_server
from fair_frontend.http_server import HttpShell
from fair_frontend.service import Frontend

log = logging.getLogger(__name__)


@dataclass
class Listen:
    host: str = "127.0.0.1"
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    metrics_host: str | None = None  # default: host


class FrontendServer:
    def __init__(
        self,
        config: Config,
        triton_url: str,
        listen: Listen,
        *,
        frontend_factory: Callable[[Config, TritonForwarder], Frontend] | None = None,
    ) -> None:
        self.config = config
        self.triton_url = triton_url
        self.listen = listen
        self._factory = frontend_factory or (lambda c, f: Frontend(c, f))
        self.frontend: Frontend | None = None
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None
        self.http_port = 0
        self.grpc_port = 0
        self.metrics_port = 0

    @property
    def max_body_bytes(self) -> int:
        eps = [*self.config.endpoints.values(), self.config.default_endpoint]
        # Room for the JSON header and base64-free binary framing around the tensors.
        return max(ep.max_request_bytes for ep in eps) * 2 + (1 << 20)

    async def start(self) -> None:
        forwarder = TritonForwarder(
            self.triton_url, request_timeout_s=self.config.triton.request_timeout_s
        )
        self.frontend = self._factory(self.config, forwarder)
        await self.frontend.start()
        shell = HttpShell(self.frontend, max_body_bytes=self.max_body_bytes)
        # Bodies are inflated by the shell itself (size-capped, Triton's errors for the
        # encodings it does not know), not by aiohttp.
        self._runner = web.AppRunner(
            shell.app(), handler_cancellation=True, access_log=None, auto_decompress=False
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.listen.host, self.listen.http_port)
        await site.start()
        self.http_port = _bound_port(site)

        self._grpc = make_server(self.frontend)
        self.grpc_port = self._grpc.add_insecure_port(
            f"{_grpc_host(self.listen.host)}:{self.listen.grpc_port}"
        )
        await self._grpc.start()

        metrics_app = self.metrics_app()
        self._metrics_runner = web.AppRunner(metrics_app, access_log=None)
        await self._metrics_runner.setup()
        msite = web.TCPSite(
            self._metrics_runner,
            self.listen.metrics_host or self.listen.host,
            self.listen.metrics_port,
        )
        await msite.start()
        self.metrics_port = _bound_port(msite)

    def metrics_app(self) -> web.Application:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        registry = getattr(self.frontend, "registry", None)

        async def metrics(request: web.Request) -> web.Response:
            body = generate_latest(registry) if registry is not None else b""
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        return app

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop accepting, finish what is queued and in flight, close."""
        # Drain first, while the listeners can still deliver the answers.
        if self.frontend is not None:
            try:
                await asyncio.wait_for(self.frontend.shutdown(grace_s), grace_s + 5.0)
            except asyncio.TimeoutError:
                log.warning("shutdown: gave up waiting for in-flight batches")
        if self._grpc is not None:
            await self._grpc.stop(1.0)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        if self.frontend is not None:
            await self.frontend.forwarder.close()


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
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(60)
        return self.server

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the server's loop (to inspect its state) and return the result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)
