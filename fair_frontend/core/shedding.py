"""What the shells shed before a call reaches the core (``QueueView``, every
``QUEUE_VIEW_INTERVAL_S``): the core's full queues and byte caps close to full, and the
tiers its throttle closes on each endpoint; and the same answers for a shell in the
core's own process (``LocalLink``), read here at each call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from fair_frontend.admission import overloaded_error
from fair_frontend.config import Config, Tenant
from fair_frontend.core.pool import BackendPool
from fair_frontend.errors import Overloaded
from fair_frontend.scheduler.caps import GlobalCaps

if TYPE_CHECKING:
    from fair_frontend.core.dispatch import Dispatcher


class Holder(Protocol):
    """What the shed views read of the core: its endpoints, caps, config, tenants, whether
    it admits, and its pool."""

    @property
    def runtimes(self) -> dict[str, Dispatcher]: ...

    @property
    def caps(self) -> GlobalCaps: ...

    @property
    def config(self) -> Config: ...

    @property
    def tenants(self) -> dict[str, Tenant]: ...

    @property
    def accepting(self) -> bool: ...

    @property
    def pool_if_made(self) -> BackendPool | None: ...


class Shedding:
    """A core's queue caps and closed tiers, as the shells read them."""

    def __init__(self, core: Holder) -> None:
        self.core = core
        # (model, tier) -> (message, retry-after) of the tiers the throttle closed at the
        # last ``refresh``; the tiers' largest weights (reset by a reload).
        self._closed: dict[tuple[str, str], tuple[str, float]] = {}
        self._tier_weights: dict[str, tuple[float, int]] | None = None  # (largest, count)

    def reload(self) -> None:
        """The tenants changed: their tiers' weights are taken again."""
        self._tier_weights = None

    def queue_full(self, tenant: str, model: str, nbytes: int = 0) -> str | None:
        """The queue cap a new request of ``tenant`` for ``model`` with ``nbytes`` tensor
        bytes would hit, if any (``nbytes`` 0: the count caps alone)."""
        core = self.core
        runtime = core.runtimes.get(model)
        if runtime is not None:
            return runtime.scheduler.full(tenant, nbytes)
        caps = core.caps
        if caps.queued >= caps.max_queued:
            return f"global max_queued={caps.max_queued}"
        return None

    def full_queues(self) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, int, str]]]:
        """What the shells shed (``QueueView``): every full queue, (tenant, model, cap),
        ("*", "*", cap) for the global cap; and the byte caps close to full, (tenant,
        model, bytes left, cap), model "*" for a tenant's default share, ("*", "*", ...)
        for the global byte cap. Close: less room than the largest request any model
        accepts (a request that fits everywhere is not refused by it)."""
        core = self.core
        caps = core.caps
        below = core.config.max_wire_bytes()
        room: list[tuple[str, str, int, str]] = []
        left = caps.max_queued_bytes - caps.queued_bytes
        if left < below:
            room.append(("*", "*", left, f"global max_queued_bytes={caps.max_queued_bytes}"))
        share = caps.tenant_max_queued_bytes
        for tenant, queued in caps.tenant_bytes.items():
            terms = core.tenants.get(tenant)
            if terms is not None and terms.max_queued_bytes is None and share - queued < below:
                room.append(
                    (tenant, "*", share - queued, f"tenant {tenant!r} {caps.tenant_default_cap()}")
                )
        if caps.queued >= caps.max_queued:
            return [("*", "*", f"global max_queued={caps.max_queued}")], room
        full = []
        for model, runtime in core.runtimes.items():
            scheduler = runtime.scheduler
            for tenant in scheduler.depths():
                cap = scheduler.full(tenant)
                if cap is not None:
                    full.append((tenant, model, cap))
            room.extend((tenant, model, n, cap) for tenant, n, cap in scheduler.byte_room(below))
        return full, room

    def refresh(self) -> list[tuple[str, str, str, float]]:
        """Work out which tiers the throttle closes on which endpoints now, and keep it
        for ``overloaded``: (model, tier, message, retry-after seconds) for each (model,
        tier) where even the most favourable request of the tier would be refused
        (``EndpointAdmission.verdict``), with the refusal the core would answer. What the
        shells shed with the full queues (``QueueView.overloaded``); called on their
        tick (``QUEUE_VIEW_INTERVAL_S``), not per request. O(tenants queued) at most."""
        core = self.core
        closed: dict[tuple[str, str], tuple[str, float]] = {}
        out: list[tuple[str, str, str, float]] = []
        pool = core.pool_if_made
        if core.accepting and (pool is None or not pool.gave_up):
            weights = self._tier_weights
            if weights is None:
                weights = {}
                for terms in core.tenants.values():
                    largest, count = weights.get(terms.tier, (0.0, 0))
                    weights[terms.tier] = (max(largest, float(terms.weight)), count + 1)
                self._tier_weights = weights
            for model, runtime in core.runtimes.items():
                admission = runtime.admission
                if admission is None or not admission.throttles:
                    continue
                for tier, (weight, count) in weights.items():
                    decision = admission.verdict(
                        runtime.scheduler, runtime.inflight, tier, weight, count
                    )
                    if decision is not None:
                        err = overloaded_error(decision, model)
                        retry = decision.retry_after_s or 0.0
                        closed[(model, tier)] = (err.message, retry)
                        out.append((model, tier, err.message, retry))
        self._closed = closed
        return out

    def overloaded(self, tier: str, model: str) -> Overloaded | None:
        """The refusal for a request of ``tier`` for ``model`` if the throttle closed the
        tier on it at the last ``refresh`` (a dict lookup)."""
        closed = self._closed.get((model, tier)) if self._closed else None
        return Overloaded(closed[0], retry_after=closed[1]) if closed is not None else None
