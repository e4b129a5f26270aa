"""What a scheduler's fairness owes its tenants, as a record a standby can resume from.

A failover must not forget who has been served how much: a tenant that took more than
its share just before a leader died would otherwise start even at the new leader, and
the tenant it took from would never get it back. The state that carries that debt is
small and relative:

* deficit round robin (``DrrState``): each backlogged tenant's deficit (its budget
  carried between rounds, below 0 while a charge-back is being paid off);
* virtual token counters (``VtcState``): every tenant's counter and weight, and the
  floor a joining tenant is lifted to.

Only differences between tenants matter (who is ahead by how much), and a resume keeps
them exactly: counters and deficits are restored as they were exported, not re-based.

Resuming. The new leader's queues start empty and fill as the shells send their held
calls again, in an order of their own: each backlogged tenant *joins* again. A join
normally resets the tenant (DRR: deficit 0; VTC: lifted to the least active counter,
so idle time banks no credit). For a tenant that was backlogged at the export, that
join is not a return from idle but the same backlog carried over, so the join restores
what was exported (``resumed``) instead: DRR its deficit, VTC its counter without the
lift. At every join, not only the first: the held calls come back one by one, and while
the new leader has free slots each is dispatched as it comes, so its tenant's queue
empties and fills again (DRR keeps the deficit it leaves with for the next join; a
VTC lift at the second join would undo the first). That
exception lasts ``keep_s`` after the resume (``Scheduler.resume_fairness``: the time the
shells take to send their calls again), then every join is an ordinary one: a tenant
whose calls never came back cannot bank its old position for later.

Programs inside a tenant (``TenantQueue``) carry their attained service the same way:
each backlogged tenant's, decayed to the export, restored to a program when it first
queues again at the new leader within ``keep_s``.

The round order of DRR is not carried (it is rebuilt by the joins); a tenant restored in
the middle of its round may therefore hold one quantum more than (I2) allows, once: the
bounds of the package docstring widen by ``q`` across a failover, never more.
"""

from __future__ import annotations

import msgspec


class TierFairness(msgspec.Struct, array_like=True, frozen=True):
    """One tier's fairness state (the policy's own, see the module docstring)."""

    # DRR: each backlogged tenant's deficit; VTC: every known tenant's counter.
    counters: dict[str, float]
    # VTC only: each known tenant's weight (a charge-back needs it before it queues again).
    weights: dict[str, float] = {}
    # VTC only: the tier's floor V, the most the least backlogged counter has been (the
    # last to leave's where none was backlogged): joiners are lifted from it.
    floor: float = 0.0
    # The tenants backlogged at the export: their next join restores their state.
    active: list[str] = []


class SchedulerFairness(msgspec.Struct, array_like=True, frozen=True):
    """One endpoint's fairness state: each tier's, and the DRR quantum learned so far."""

    tiers: dict[str, TierFairness]
    quantum: float = 0.0  # 0: not learned (the configured one holds)
    mean_row_cost: float = 0.0
    seen_rows: int = 0
    # Each backlogged tenant's programs' attained service (``TenantQueue``), decayed to
    # the moment of the export: inside a tenant the program that had taken the most
    # before the failover still waits behind the others after it. Last: older records
    # decode without it.
    programs: dict[str, dict[str, float]] = {}
    # The cost of the requests dispatched lately and their count (decayed alike): their
    # mean sizes the debt a returning tenant carries (VTC's ``debt_carried``), from the
    # new leader's first join on. Last: older records decode without them.
    request_cost: float = 0.0
    requests: float = 0.0
