"""Builders for the scheduler tests: policies, tenant directories and requests.

Imported by the test modules beside it (pytest puts this directory on the path of a
test directory without ``__init__.py``). The scheduler is pure: tests drive it with
explicit ``now`` values (plain floats), never a clock or a sleep.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from fair_frontend.scheduler import (
    EndpointPolicy,
    GlobalCaps,
    Mode,
    QueuedRequest,
    Scheduler,
    TenantSpec,
)
from fair_frontend.scheduler.cost import CostUnit

TIERS = ("paid", "trial")


@dataclass(eq=False, slots=True, kw_only=True)
class TaggedRequest(QueuedRequest):
    """A request that carries a tag the tests read back (what a shell would carry)."""

    tag: Any = None


def make_policy(
    *,
    cost: CostUnit = CostUnit.REQUESTS,
    max_batch_size: int = 32,
    max_batch_tokens: int | None = None,
    quantum: float | None = 1.0,
    tiers: tuple[str, ...] = TIERS,
    min_share: Mapping[str, float] | None = None,
    window: int = 100,
    fairness: str = "drr",
) -> EndpointPolicy:
    return EndpointPolicy(
        cost=cost,
        max_batch_size=max_batch_size,
        max_batch_tokens=max_batch_tokens,
        quantum=quantum,
        tiers=tiers,
        tier_min_share=dict(min_share or {}),
        share_window_rows=window,
        fairness=fairness,
    )


def make_request(
    tenant: str,
    *,
    rows: int = 1,
    tokens: int = 1,
    nbytes: int = 0,
    priority: int = 1,
    deadline: float | None = None,
    shape: Hashable = None,
    tag: Any = None,
    program: str = "",
) -> TaggedRequest:
    return TaggedRequest(tenant, rows, tokens, nbytes, priority, deadline, shape, program, tag=tag)


def make_scheduler(
    tenants: Mapping[str, TenantSpec | str],
    *,
    mode: Mode = "fair",
    caps: GlobalCaps | None = None,
    **policy: Any,
) -> Scheduler:
    """A fresh scheduler; ``tenants``: name -> ``TenantSpec``, or name -> tier (weight 1)."""
    directory = {
        name: spec if isinstance(spec, TenantSpec) else TenantSpec(spec)
        for name, spec in tenants.items()
    }
    return Scheduler(make_policy(**policy), directory, caps or GlobalCaps(), mode=mode)


def tags(batch: list[QueuedRequest]) -> list[Any]:
    return [cast(TaggedRequest, r).tag for r in batch]  # the scheduler's, from make_request


def drain(s: Scheduler, now: float = 0.0) -> list[list[Any]]:
    """Every remaining batch, as lists of tags."""
    out = []
    while batch := s.next_batch(now):
        out.append(tags(batch))
    return out
