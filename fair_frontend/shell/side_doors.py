"""Health and metadata: the side doors of the KServe protocol, in every shell.

Who may ask. Health (live, ready) stays open: Kubernetes probes and load balancers
carry no key. Server metadata stays open too: the frontend's name, version and
extensions, the same for every caller, answered here without Triton, and read
without a key by Triton's own examples (simple_*_health_metadata.py) beside health.
Model metadata, config, readiness and statistics need the tenant's key, under the
identity rules of inference (401 without one, 403 when it names another tenant),
and a model the tenant may call (403 naming it otherwise, before any lookup: the
same answer whether or not Triton has the model). They tell which models sit behind
the frontend, and each would reach Triton or the core. Statistics are the model's
over every tenant, as Triton's are (and perf_analyzer reads them so): keyed, not
split per tenant; the frontend does not keep them per tenant. Statistics of every
model (no name) list only the models the tenant may call. Not rate-limited: the
limiter lives in the core, and with the cache below a flood costs a shell's CPU,
not Triton's.

What reaches Triton. Its static answers (metadata, config) are kept per model and
version for side_doors.metadata_ttl_s, readiness for ready_ttl_s, "no such model or
version" for negative_ttl_s, at most max_entries of them (``LookupCache``);
concurrent identical calls share one lookup. Every call is counted by door and
answer (fair_side_door_calls), every lookup sent to Triton too (fair_side_door_lookups).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from tritonclient.grpc import service_pb2

from fair_frontend.auth import Authenticator, ModelAccess
from fair_frontend.backends.protocol import BackendServer, SideDoor
from fair_frontend.config import Config, SideDoors
from fair_frontend.errors import FrontendError, Unavailable, Unsupported
from fair_frontend.shell.link import CoreLink
from fair_frontend.shell.lookup_cache import Key, LookupCache
from fair_frontend.wire.records import SIDE_DOOR_LOOKUP, TallyEntry

T = TypeVar("T")

# Server metadata extensions the frontend implements (a subset of Triton's: no shared
# memory, which cannot cross hosts; no repository control or tracing, which stay with
# the operator of Triton itself). It lists those the Triton behind it has too.
EXTENSIONS = (
    "classification",
    "statistics",
    "sequence",
    "schedule_policy",
    "model_configuration",
    "binary_tensor_data",
    "parameters",
)
# What the tenant ports list with ``server.statistics: operator``: statistics
# then live on the operator's listener only, and perf_analyzer, reading this list, does
# not ask for them.
EXTENSIONS_WITHOUT_STATISTICS = tuple(e for e in EXTENSIONS if e != "statistics")
# Where the frontend names itself: an HTTP response header and a gRPC initial metadata
# entry beside the server metadata, which answers with the name and version of the Triton
# behind it, as clients expect (Triton's simple_*_health_metadata.py examples check for
# the name "triton").
FRONTEND_HEADER = "x-fair-frontend"


class Doorkeeper(Protocol):
    """What the side doors read of their gateway (a reload changes all but the
    Tritons): who asks, what they may call, the link and the Tritons."""

    @property
    def config(self) -> Config: ...

    @property
    def link(self) -> CoreLink: ...

    @property
    def auth(self) -> Authenticator: ...

    @property
    def access(self) -> ModelAccess: ...

    @property
    def tritons(self) -> list[BackendServer]: ...

    @property
    def triton(self) -> BackendServer: ...

    def admit_model(self, tenant: str, model: str) -> None: ...


class SideDoorAnswers:
    """A shell's answers to health, metadata, config and statistics (the module's doc);
    the gateway's identity, access and link, read through it (a reload changes them)."""

    # The side doors' cache and the config it was made for (``lookups``).
    _cache: LookupCache | None = None
    _cache_config: Config | None = None

    def __init__(self, gateway: Doorkeeper) -> None:
        self.gateway = gateway

    async def live(self) -> bool:
        self._count_door("live", None, "ok")
        return True

    async def ready(self) -> bool:
        """Ready while the core admits and Triton is ready (kept ready_ttl_s: probes
        need no key, so a flood of them must not reach Triton one call each)."""
        triton_ready = await self._from_triton(
            "ready",
            ("server_ready", "", ""),
            self._side_doors.ready_ttl_s,
            self._any_ready,
        )
        self._count_door("ready", None, "ok")
        return self.gateway.link.accepting and triton_ready

    async def model_ready(self, model: str, version: str, headers: Mapping[str, str]) -> bool:
        async def answer(tenant: str) -> bool:
            try:
                return bool(
                    await self._from_triton(
                        "model_ready",
                        ("model_ready", model, version),
                        self._side_doors.ready_ttl_s,
                        lambda: self._ask("model_ready", model, version),
                    )
                )
            except FrontendError:
                return False  # Triton cannot tell (or has no such model): not ready

        return await self._keyed("model_ready", model, headers, answer)

    async def server_metadata(self) -> dict[str, Any]:
        """Triton's name and version (a drop-in answers as the server it stands for), and
        the extensions both it and the frontend offer, in Triton's order. Triton's answer
        is static: kept metadata_ttl_s like the models' metadata, so unkeyed callers cost
        Triton one call per period. Triton unreachable and nothing kept: its error (503)."""
        try:
            triton = await self._from_triton(
                "server_metadata",
                ("server_metadata", "", ""),
                self._side_doors.metadata_ttl_s,
                lambda: self._ask("server_metadata"),
            )
        except FrontendError as err:
            self._count_door("server_metadata", None, err.grpc_code.name.lower())
            raise
        self._count_door("server_metadata", None, "ok")
        offered = (
            EXTENSIONS
            if self.gateway.config.server.statistics == "keyed"
            else EXTENSIONS_WITHOUT_STATISTICS
        )
        return {
            "name": triton.name,
            "version": triton.version,
            "extensions": [e for e in triton.extensions if e in offered],
        }

    async def model_metadata(self, model: str, version: str, headers: Mapping[str, str]) -> Any:
        return await self._keyed(
            "model_metadata",
            model,
            headers,
            lambda _: self._static("model_metadata", model, version),
        )

    async def model_config(self, model: str, version: str, headers: Mapping[str, str]) -> Any:
        return await self._keyed(
            "model_config",
            model,
            headers,
            lambda _: self._static("model_config", model, version),
        )

    async def statistics(self, model: str, version: str, headers: Mapping[str, str]) -> Any:
        """From the core, never kept (they change); "no such model" is kept briefly.
        ``model`` "": every model the tenant may call. With ``server.statistics: operator``
        not here at all: 501 / UNIMPLEMENTED, as a server without the extension (the
        operator's listener serves them)."""
        if self.gateway.config.server.statistics != "keyed":
            err = Unsupported("the statistics extension is not offered on this port")
            self._count_door("statistics", None, err.grpc_code.name.lower())
            raise err

        async def answer(tenant: str) -> Any:
            stats = await self.lookups.get(
                ("statistics", model, version),
                0.0,
                lambda: self.gateway.link.statistics(model, version),
            )
            if model:
                return stats
            visible = service_pb2.ModelStatisticsResponse()
            visible.model_stats.extend(
                s for s in stats.model_stats if self.gateway.access.allows(tenant, s.name)
            )
            return visible

        return await self._keyed("statistics", model, headers, answer)

    async def _keyed(
        self,
        door: str,
        model: str,
        headers: Mapping[str, str],
        answer: Callable[[str], Awaitable[T]],
    ) -> T:
        """``answer(tenant)`` for the tenant the headers prove, about a model it may call
        (``model`` "": about none in particular), counted by how it ended."""
        tenant: str | None = None
        try:
            tenant = self.gateway.auth.identify(headers, None)
            if model:
                self.gateway.admit_model(tenant, model)
            result = await answer(tenant)
        except FrontendError as err:
            self._count_door(door, tenant, err.grpc_code.name.lower())
            raise
        self._count_door(door, tenant, "ok")
        return result

    async def _static(self, door: SideDoor, model: str, version: str) -> Any:
        return await self._from_triton(
            door,
            (door, model, version),
            self._side_doors.metadata_ttl_s,
            lambda: self._ask(door, model, version),
        )

    async def _ask(self, door: SideDoor, model: str = "", version: str = "") -> Any:
        """Triton's answer (``BackendServer.side_door``): the first Triton's, or where one
        is unreachable the next one's."""
        for i, triton in enumerate(self.gateway.tritons):
            try:
                return await triton.side_door(door, model, version)
            except Unavailable:
                if i + 1 == len(self.gateway.tritons):
                    raise
        raise AssertionError("a gateway has at least one Triton")

    async def _any_ready(self) -> bool:
        """Is any Triton of the pool ready? (The endpoints are served while one is.)"""
        if len(self.gateway.tritons) == 1:
            return await self.gateway.triton.server_ready()
        answers = await asyncio.gather(*(t.server_ready() for t in self.gateway.tritons))
        return any(answers)

    async def _from_triton(
        self, door: str, key: Key, ttl_s: float, ask: Callable[[], Awaitable[T]]
    ) -> T:
        """Triton's answer to ``key``, kept ``ttl_s``; each real call counted."""

        async def lookup() -> T:
            self._count_door(door, None, SIDE_DOOR_LOOKUP)
            return await ask()

        return await self.lookups.get(key, ttl_s, lookup)

    def _count_door(self, door: str, tenant: str | None, outcome: str) -> None:
        self.gateway.link.tally(TallyEntry(tenant, "", outcome, 1, door=door))

    @property
    def _side_doors(self) -> SideDoors:
        return self.gateway.config.side_doors

    @property
    def lookups(self) -> LookupCache:
        """The side doors' cache, made anew for each (re)loaded config: a reload (of
        Triton's models too, as operators do it) empties it."""
        if self._cache is None or self._cache_config is not self.gateway.config:
            self._cache = LookupCache(
                max_entries=self._side_doors.max_entries,
                negative_ttl_s=self._side_doors.negative_ttl_s,
            )
            self._cache_config = self.gateway.config
        return self._cache
