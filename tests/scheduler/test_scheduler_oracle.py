"""Long runs against an independent oracle: weighted max-min fair shares.

Tenants with different weights and offered loads share a fixed service capacity per
step (one batch per step) for a long run. The oracle, written here from the definition
and sharing no code with the scheduler, computes the allocation that strict tiers plus
weighted max-min fairness prescribe: each tier in order takes what it can of the
capacity left; inside a tier, water-filling: every tenant gets min(demand, weight *
level), the level chosen so that the tier's allocations use up the capacity (or every
demand is met). Each tenant's measured share must be within a small tolerance of it.

The negative control runs the same check on ``mode="fifo"`` and asserts that it FAILS:
the check can tell a fair scheduler from one that serves whoever offers the most.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from sched_support import make_request

from fair_frontend.scheduler import EndpointPolicy, GlobalCaps, Mode, Scheduler, TenantSpec
from fair_frontend.scheduler.cost import CostUnit

TOLERANCE = 0.02  # of the capacity per step
STEPS = 2000
WARMUP = 400  # steps before measuring: queues of the overloaded tenants build up


def water_fill(capacity: float, demands: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Weighted max-min fair allocation of ``capacity`` (the oracle, from its definition)."""
    alloc = [0.0] * len(demands)
    unmet = set(range(len(demands)))
    left = capacity
    while unmet and left > 1e-12:
        level = left / sum(weights[i] for i in unmet)
        met = [i for i in unmet if demands[i] <= weights[i] * level]
        if not met:
            for i in unmet:
                alloc[i] = weights[i] * level
            break
        for i in met:
            alloc[i] = demands[i]
            left -= demands[i]
            unmet.remove(i)
    return alloc


@dataclass(frozen=True)
class Offered:
    tenant: str
    tier: str
    weight: float
    demand: float  # units (rows or tokens) offered per step
    size: int  # units per request


def fair_allocation(
    capacity: float, tiers: Sequence[str], loads: Sequence[Offered]
) -> dict[str, float]:
    out: dict[str, float] = {}
    left = capacity
    for tier in tiers:
        mine = [o for o in loads if o.tier == tier]
        alloc = water_fill(left, [o.demand for o in mine], [o.weight for o in mine])
        out.update({o.tenant: a for o, a in zip(mine, alloc, strict=True)})
        left -= sum(alloc)
    return out


def simulate(
    mode: Mode, unit: CostUnit, tiers: Sequence[str], loads: Sequence[Offered], capacity: int
) -> dict[str, float]:
    """Served units per step for each tenant, over the measured part of the run."""
    tokens = unit is CostUnit.TOKENS
    policy = EndpointPolicy(
        cost=unit,
        max_batch_size=capacity if not tokens else 10_000,
        max_batch_tokens=capacity if tokens else None,
        quantum=float(capacity) if tokens else 1.0,
        tiers=tuple(tiers),
    )
    directory = {o.tenant: TenantSpec(o.tier, o.weight, max_queued=10**6) for o in loads}
    s = Scheduler(policy, directory, GlobalCaps(10**7, 1 << 40), mode=mode)
    credit = dict.fromkeys(directory, 0.0)
    served = dict.fromkeys(directory, 0.0)
    for step in range(STEPS):
        now = float(step)
        for o in loads:
            credit[o.tenant] += o.demand / o.size
            while credit[o.tenant] >= 1.0:
                credit[o.tenant] -= 1.0
                rows, n = (1, o.size) if tokens else (o.size, 0)
                s.enqueue(make_request(o.tenant, rows=rows, tokens=n), now)
        for r in s.next_batch(now):
            if step >= WARMUP:
                served[r.tenant] += r.tokens if tokens else r.rows
    return {t: v / (STEPS - WARMUP) for t, v in served.items()}


def unfair_tenants(
    unit: CostUnit, tiers: Sequence[str], loads: Sequence[Offered], served: dict[str, float]
) -> dict[str, tuple[float, float]]:
    """Tenant -> (served, fair) where they differ by more than the tolerance.

    The capacity is what was served in all: with token caps a batch can end under-full
    (the next request does not fit), so the usable capacity is measured, not assumed.
    """
    capacity = sum(served.values())
    fair = fair_allocation(capacity, tiers, loads)
    return {
        t: (served[t], fair[t]) for t in served if abs(served[t] - fair[t]) > TOLERANCE * capacity
    }


SCENARIOS = {
    # One tier, overloaded about 2x, weights 1-4; three tenants ask for less than their share.
    "one-tier-weighted": (
        CostUnit.REQUESTS,
        16,
        ("paid",),
        [
            Offered("a", "paid", 1, 0.5, 1),
            Offered("b", "paid", 1, 6.0, 1),
            Offered("c", "paid", 2, 6.0, 1),
            Offered("d", "paid", 4, 6.0, 1),
            Offered("e", "paid", 1, 1.0, 1),
            Offered("f", "paid", 3, 8.0, 1),
            Offered("g", "paid", 1, 0.2, 1),
            Offered("h", "paid", 2, 3.0, 1),
        ],
    ),
    # Paid asks for 10 of 16 rows and gets it all; trial shares the other 6 by weight.
    "two-tiers": (
        CostUnit.REQUESTS,
        16,
        ("paid", "trial"),
        [
            Offered("p1", "paid", 1, 4.0, 1),
            Offered("p2", "paid", 1, 6.0, 1),
            Offered("t1", "trial", 1, 4.0, 1),
            Offered("t2", "trial", 1, 6.0, 1),
            Offered("t3", "trial", 2, 2.0, 1),
        ],
    ),
    # Token cost: shares are in tokens, whatever each tenant's request size.
    "token-cost": (
        CostUnit.TOKENS,
        1000,
        ("paid",),
        [
            Offered("small", "paid", 1, 400.0, 50),
            Offered("medium", "paid", 1, 400.0, 100),
            Offered("light", "paid", 1, 100.0, 200),
            Offered("heavy", "paid", 2, 600.0, 250),
        ],
    ),
}


def test_water_fill_oracle_on_a_hand_example() -> None:
    # Capacity 10, weights 1:1:2. Level 2.5: a's 1 is met; 9 left over weights 3: level 3.
    assert water_fill(10, [1, 10, 10], [1, 1, 2]) == [1, 3, 6]
    assert water_fill(10, [1, 2, 3], [1, 1, 1]) == [1, 2, 3]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fair_mode_serves_the_weighted_max_min_fair_shares(name: str) -> None:
    unit, capacity, tiers, loads = SCENARIOS[name]
    served = simulate("fair", unit, tiers, loads, capacity)
    assert unfair_tenants(unit, tiers, loads, served) == {}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_negative_control_fifo_fails_the_same_check(name: str) -> None:
    unit, capacity, tiers, loads = SCENARIOS[name]
    served = simulate("fifo", unit, tiers, loads, capacity)
    assert unfair_tenants(unit, tiers, loads, served) != {}
