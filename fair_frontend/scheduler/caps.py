"""Caps shared by every endpoint's scheduler in the process."""

from __future__ import annotations

import math

from fair_frontend.config import (
    DEFAULT_ENGINE_QUEUE_SLOTS,
    DEFAULT_GLOBAL_MAX_QUEUED,
    DEFAULT_GLOBAL_MAX_QUEUED_BYTES,
    DEFAULT_TENANT_BYTES_SHARE,
    DEFAULT_TENANT_MAX_QUEUED,
    Queues,
)


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
    ) -> None:
        if max_queued < 1 or max_queued_bytes < 1:
            raise ValueError("global caps must be >= 1")
        if not 0 < tenant_bytes_share <= 1 or not engine_queue_slots > 0:
            raise ValueError("need 0 < tenant_bytes_share <= 1 and engine_queue_slots > 0")
        self.max_queued = max_queued
        self.max_queued_bytes = max_queued_bytes
        self.tenant_bytes_share = tenant_bytes_share
        self.engine_queue_slots = engine_queue_slots
        self.queued = 0
        self.queued_bytes = 0
        # Tenant -> its queued bytes over every endpoint (only tenants with some queued).
        self.tenant_bytes: dict[str, int] = {}

    @classmethod
    def from_config(cls, queues: Queues) -> GlobalCaps:
        caps = cls(queues.max_queued, queues.max_queued_bytes)
        caps.configure(queues)
        return caps

    def configure(self, queues: Queues) -> None:
        """Apply a (re)loaded ``queues`` section; what is queued stays counted."""
        self.max_queued = queues.max_queued
        self.max_queued_bytes = queues.max_queued_bytes
        self.tenant_bytes_share = queues.tenant_bytes_share
        self.engine_queue_slots = queues.engine_queue_slots

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
        self.queued += 1
        self.queued_bytes += nbytes
        if nbytes:
            self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + nbytes

    def remove(self, tenant: str, nbytes: int) -> None:
        """A request of ``tenant`` left its queue."""
        self.queued -= 1
        self.queued_bytes -= nbytes
        if nbytes:
            left = self.tenant_bytes[tenant] - nbytes
            if left:
                self.tenant_bytes[tenant] = left
            else:
                del self.tenant_bytes[tenant]
