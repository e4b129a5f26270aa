"""Caps shared by every endpoint's scheduler in the process."""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_GLOBAL_MAX_QUEUED = 100_000
DEFAULT_GLOBAL_MAX_QUEUED_BYTES = 1 << 30  # 1 GiB of queued tensor payload
DEFAULT_TENANT_MAX_QUEUED = 10_000
# A tenant without its own max_queued_bytes may hold this fraction of the global byte cap
# (over every model): one tenant cannot fill the global cap and lock the others out.
DEFAULT_TENANT_BYTES_SHARE = 0.25
# An engine endpoint (max_inflight) queues per tenant this many times its slots by default:
# a queue the engine turns over a few times, not 10,000 generations.
DEFAULT_ENGINE_QUEUE_SLOTS = 4.0
# Programs (``QueuedRequest.program``) one tenant's queue on one endpoint keeps apart;
# further ids share one overflow program (``TenantQueue``).
DEFAULT_PROGRAMS_PER_TENANT = 64


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """The caps ``GlobalCaps`` applies (the config's ``queues`` section has them)."""

    max_queued: int = DEFAULT_GLOBAL_MAX_QUEUED
    max_queued_bytes: int = DEFAULT_GLOBAL_MAX_QUEUED_BYTES
    tenant_bytes_share: float = DEFAULT_TENANT_BYTES_SHARE
    engine_queue_slots: float = DEFAULT_ENGINE_QUEUE_SLOTS
    programs_per_tenant: int = DEFAULT_PROGRAMS_PER_TENANT


class GlobalCaps:
    """Total queued requests and bytes across all endpoints, their caps, and the defaults
    of the per-tenant caps.

    One object per process, passed to every ``Scheduler``; each scheduler adds what it
    admits and subtracts what leaves its queues, so the totals are exact across endpoints.
    Per tenant too (``tenant_bytes``): a tenant without its own ``max_queued_bytes`` may
    hold at most ``tenant_bytes_share`` of ``max_queued_bytes`` over all endpoints, so one
    tenant cannot fill the global cap and lock the others out. A reload changes the caps
    in place (``Core.reload``). Not thread-safe: the schedulers run on one event loop.
    """

    __slots__ = (
        "engine_queue_slots",
        "max_queued",
        "max_queued_bytes",
        "programs_per_tenant",
        "queued",
        "queued_bytes",
        "tenant_bytes",
        "tenant_bytes_share",
    )

    def __init__(
        self,
        max_queued: int = DEFAULT_GLOBAL_MAX_QUEUED,
        max_queued_bytes: int = DEFAULT_GLOBAL_MAX_QUEUED_BYTES,
        *,
        tenant_bytes_share: float = DEFAULT_TENANT_BYTES_SHARE,
        engine_queue_slots: float = DEFAULT_ENGINE_QUEUE_SLOTS,
        programs_per_tenant: int = DEFAULT_PROGRAMS_PER_TENANT,
    ) -> None:
        if max_queued < 1 or max_queued_bytes < 1:
            raise ValueError("global caps must be >= 1")
        if not 0 < tenant_bytes_share <= 1 or not engine_queue_slots > 0:
            raise ValueError("need 0 < tenant_bytes_share <= 1 and engine_queue_slots > 0")
        if programs_per_tenant < 1:
            raise ValueError("programs_per_tenant must be >= 1")
        self.max_queued = max_queued
        self.max_queued_bytes = max_queued_bytes
        self.tenant_bytes_share = tenant_bytes_share
        self.engine_queue_slots = engine_queue_slots
        # Read as a tenant's queue on an endpoint takes a program it has not seen
        # (``TenantQueue``): a lower bound takes effect as its idle programs are dropped.
        self.programs_per_tenant = programs_per_tenant
        self.queued = 0
        self.queued_bytes = 0
        # Tenant -> its queued bytes over every endpoint (only tenants with some queued).
        self.tenant_bytes: dict[str, int] = {}

    @classmethod
    def of(cls, limits: QueueLimits) -> GlobalCaps:
        caps = cls(limits.max_queued, limits.max_queued_bytes)
        caps.configure(limits)
        return caps

    def configure(self, limits: QueueLimits) -> None:
        """Apply (re)loaded caps; what is queued stays counted."""
        self.max_queued = limits.max_queued
        self.max_queued_bytes = limits.max_queued_bytes
        self.tenant_bytes_share = limits.tenant_bytes_share
        self.engine_queue_slots = limits.engine_queue_slots
        self.programs_per_tenant = limits.programs_per_tenant

    @property
    def tenant_max_queued_bytes(self) -> int:
        """The bytes a tenant without its own ``max_queued_bytes`` may have queued, over
        every endpoint together."""
        return max(1, int(self.max_queued_bytes * self.tenant_bytes_share))

    def tenant_default_cap(self) -> str:
        """How ``QueueFull`` names that default (it says where it comes from)."""
        return (
            f"max_queued_bytes={self.tenant_max_queued_bytes} (its default: "
            f"tenant_bytes_share {self.tenant_bytes_share:g} of the global "
            f"max_queued_bytes={self.max_queued_bytes})"
        )

    def default_max_queued(self, slots: int | None) -> int:
        """The requests a tenant without its own ``max_queued`` may have queued on one
        endpoint: ``engine_queue_slots`` x its slots on an engine endpoint (``slots``:
        ``max_inflight``), the batching default elsewhere (``slots`` None)."""
        if slots is None:
            return DEFAULT_TENANT_MAX_QUEUED
        return max(1, math.ceil(self.engine_queue_slots * slots))

    def add(self, tenant: str, nbytes: int) -> None:
        """A request of ``tenant`` was queued."""
        self.hold(tenant, 1, nbytes)

    def remove(self, tenant: str, nbytes: int) -> None:
        """A request of ``tenant`` left its queue."""
        self.release(tenant, 1, nbytes)

    def hold(self, tenant: str, count: int, nbytes: int) -> None:
        """``count`` requests of ``tenant``, ``nbytes`` in all, are queued or will be (a
        call's parts whose room is held: ``Scheduler.reserve``)."""
        self.queued += count
        self.queued_bytes += nbytes
        if nbytes:
            self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + nbytes

    def release(self, tenant: str, count: int, nbytes: int) -> None:
        """``count`` requests of ``tenant``, ``nbytes`` in all, left (or never took) the
        room they held."""
        self.queued -= count
        self.queued_bytes -= nbytes
        if nbytes:
            left = self.tenant_bytes[tenant] - nbytes
            if left:
                self.tenant_bytes[tenant] = left
            else:
                del self.tenant_bytes[tenant]
