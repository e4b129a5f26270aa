"""One endpoint's admission: may this request join the queue now?

The throttle (``fair_frontend.admission.throttle``) rejects early what cannot be served
within its target; to predict the wait it needs the scheduler's backlog ahead of the
request, the service model (what batches cost, ``fair_frontend.feedback``) and how much
of the capacity the higher tiers take lately (``TierShares``). ``EndpointAdmission``
holds those three for one endpoint and answers with one call, ``admit``; the batches that
come back feed it through ``observe_batch``. An engine endpoint (``max_inflight``) has
the ``EngineThrottle`` instead, which predicts the wait for a slot from how long requests
hold their slots (``SlotTimes``, fed by the same reports: one per request). Rate limits
are the tenant's, not the endpoint's: ``Core`` checks them after the throttle (a request
the platform cannot serve in time costs the tenant no quota).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from fair_frontend.admission import EngineThrottle, Throttle, ThrottleDecision
from fair_frontend.admission.slo import SLO_QUANTILE_Z, SloClass, SloClasses, SloLedger
from fair_frontend.feedback import ServiceModel, SlotTimes
from fair_frontend.scheduler import Backlog, Scheduler

# The throttle stretches a lower tier's predicted wait by 1 / (1 - higher tiers' share);
# capped so that a tier starved by strict order is still judged, not rejected outright.
MAX_HIGHER_TIER_SHARE = 0.9


class TierShares:
    """Each tier's recent share of an endpoint's capacity (an EMA over batches).

    A batch's capacity is ``batch_rows`` rows and ``batch_tokens`` tokens (or what it
    holds, if more); a tier's share of a batch is the larger of its share of the rows and
    of the tokens: whichever cap fills first. So a tier that fills half of every batch
    takes half the capacity, whether the rest is filled by lower tiers or left empty (a
    lower tier the throttle holds back does not make the higher tiers look larger).
    """

    def __init__(
        self, alpha: float = 0.1, batch_rows: int = 1, batch_tokens: int | None = None
    ) -> None:
        self.alpha = alpha
        self.batch_rows = max(1, batch_rows)
        self.batch_tokens = batch_tokens
        self.share: dict[str, float] = {}

    def observe(
        self, rows_by_tier: dict[str, int], tokens_by_tier: dict[str, int] | None = None
    ) -> None:
        rows_cap = max(sum(rows_by_tier.values()), self.batch_rows)
        tokens_cap = 0
        if tokens_by_tier is not None and self.batch_tokens is not None:
            tokens_cap = max(sum(tokens_by_tier.values()), self.batch_tokens)
        for tier in set(self.share) | set(rows_by_tier):
            now = rows_by_tier.get(tier, 0) / rows_cap
            if tokens_cap and tokens_by_tier is not None:
                now = max(now, tokens_by_tier.get(tier, 0) / tokens_cap)
            self.share[tier] = (1 - self.alpha) * self.share.get(tier, 0.0) + self.alpha * now

    def above(self, tier: str, tiers: Sequence[str]) -> float:
        """The share of the tiers served before ``tier`` (strict order)."""
        if tier not in tiers:
            return 0.0
        return sum(self.share.get(t, 0.0) for t in tiers[: list(tiers).index(tier)])


@dataclass
class EndpointAdmission:
    """The throttle of one endpoint, with the service model and tier shares it reads."""

    service: ServiceModel
    throttle: Throttle | None  # None: the endpoint does not throttle (batches)
    tiers: Sequence[str]  # highest first
    strict_tiers: bool = True  # fair mode; fifo has no tier order to stretch waits by
    tier_shares: TierShares = field(default_factory=TierShares)
    engine: EngineThrottle | None = None  # an engine endpoint's throttle (then no throttle)
    slot_times: SlotTimes = field(default_factory=SlotTimes)  # engine: slot hold times
    # The configured SLO classes (``admission.slo``; None: none), and what this endpoint
    # measured of them (attainment, the time from a slot to the first token).
    slo_classes: SloClasses | None = None
    slo: SloLedger = field(default_factory=SloLedger)

    @property
    def throttles(self) -> bool:
        """Whether admission asks a throttle (batches' or an engine's) at all."""
        return self.throttle is not None or self.engine is not None

    def admit(
        self,
        scheduler: Scheduler,
        inflight: int,
        *,
        tenant: str,
        tier: str,
        priority: int,
        rows: int,
        tokens: int,
        remaining_s: float | None,
        own_inflight: int = 0,
        slo: SloClass | None = None,
        elapsed_s: float = 0.0,
        program: str | None = None,
        light: int | None = None,
    ) -> ThrottleDecision | None:
        """The throttle's decision for a new request (None: the endpoint does not throttle).

        ``inflight``: batches in Triton (engine: requests in the engine), ``own_inflight``
        of them the tenant's (engine only). ``remaining_s``: the time left to the
        request's own deadline, if it has one. ``slo``: its SLO class, whose target
        replaces the endpoint's (``admission.slo``), less ``elapsed_s``: the time since
        the request arrived at its shell (its class's clock runs from then). ``program``:
        its program, whose place inside its tenant's queue it waits by (None: the
        tenant's calls judged together, behind all of its queued work). ``light``
        (engine, with light slots): None where the request may not take a light slot,
        else the requests that may take one before it, itself included
        (``EngineThrottle``).
        """
        if self.throttle is None and self.engine is None:
            return None
        backlog = scheduler.backlog_ahead(tenant, priority, rows, tokens, program)
        own_ahead = 0
        if self.engine:
            own_ahead = scheduler.own_ahead(tenant, priority, program, rows, tokens) + rows
        if slo is None:
            return self._decide(
                backlog, own_ahead, inflight, own_inflight, tier, remaining_s, light=light
            )
        z = SLO_QUANTILE_Z if slo.interactive else 0.0
        target = slo.target_s(self.slo.first_token_quantile_s(z) + elapsed_s, self._hold_s)
        decision = self._decide(
            backlog, own_ahead, inflight, own_inflight, tier, remaining_s, target, z, light
        )
        return replace(decision, slo_class=slo.name)

    @property
    def _hold_s(self) -> float:
        """How long a request holds its slot (engine), or a batch runs, lately."""
        if self.engine is not None:
            return self.slot_times.mean_hold_s if self.slot_times.has_data else 0.0
        if not self.service.has_data:
            return 0.0
        bt = self.service.batch_time()
        rows, tokens = self.service.typical_batch()
        return bt.fixed_s + bt.per_row_s * rows + bt.per_token_s * tokens

    def predicted_ttft_s(self, decision: ThrottleDecision, elapsed_s: float = 0.0) -> float:
        """The time to first token ``decision`` predicts, without the safety margin: the
        time since arrival ``elapsed_s``, its wait for a slot (or for its batches), and
        the time from a slot to a first token measured lately."""
        if decision.mean_wait_s is not None:
            return elapsed_s + decision.mean_wait_s + self.slo.first_token_s
        gate = self.engine if self.engine is not None else self.throttle
        safety = gate.safety if gate is not None else 1.0
        return elapsed_s + decision.predicted_wait_s / safety + self.slo.first_token_s

    def verdict(
        self, scheduler: Scheduler, inflight: int, tier: str, weight: float, tenants: int
    ) -> ThrottleDecision | None:
        """The throttle's decision for the most favourable request ``tier`` could send now,
        if even that one is refused (None: some request of the tier may be admitted, or
        the endpoint does not throttle). ``weight``: the largest weight of the tier's
        tenants, ``tenants`` how many it has.

        The most favourable request, for each tenant of the tier that could send one
        (``Scheduler.least_backlogs``): one row, no tokens, the highest priority level,
        no deadline of its own (a deadline only tightens the target), none of its
        tenant's requests in the engine. The throttle's decision is monotone in each of
        those (a larger backlog, more of the tenant's own ahead or in the engine, a
        tighter target never turn a refusal into an admission), and the tier's slowdown
        and the endpoint's state are the same for all; so if each tenant's best request
        is refused, every request of the tier is, until the state changes. Of the
        refusals, the one with the shortest predicted wait is returned (its message and
        retry-after are the least any request of the tier would get)."""
        if self.throttle is None and self.engine is None:
            return None
        least = scheduler.least_backlogs(tier, weight, tenants)
        if not least:
            return None  # too many tenants queued to go through (or no such tier)
        # With SLO classes, a request of the tier may name any class: judged against the
        # loosest target of all (and the endpoint's own), so a tier is closed only when
        # every request of it would be refused whatever class it named.
        loosest = None
        if self.slo_classes is not None:
            loosest = self.slo_classes.loosest_target_s(self.slo.first_token_s, self._hold_s)
            gate = self.engine if self.engine is not None else self.throttle
            if loosest is not None and gate is not None:
                loosest = max(loosest, gate.latency_target_s)
        # With light slots, the most favourable request may take one: behind the fewest
        # rivals any tenant of the tier has (one with work queued: itself not a rival).
        light = None
        if self.engine is not None and self.engine.light_slots:
            light = 1 + scheduler.tier_light_rivals(tier)
        best: ThrottleDecision | None = None
        for backlog, own_ahead in least:
            decision = self._decide(
                backlog, own_ahead, inflight, 0, tier, None, loosest, light=light
            )
            if decision.admitted:
                return None
            if best is None or decision.predicted_wait_s < best.predicted_wait_s:
                best = decision
        return best

    def _decide(
        self,
        backlog: Backlog,
        own_ahead: int,
        inflight: int,
        own_inflight: int,
        tier: str,
        remaining_s: float | None,
        target_s: float | None = None,
        quantile_z: float = 0.0,
        light: int | None = None,
    ) -> ThrottleDecision:
        slowdown = 1.0
        if self.strict_tiers:
            above = self.tier_shares.above(tier, self.tiers)
            slowdown = 1.0 / (1.0 - min(above, MAX_HIGHER_TIER_SHARE))
        if self.engine is not None:
            return self.engine.check(
                ahead=backlog.rows,
                own_ahead=own_ahead,
                inflight=inflight,
                own_inflight=own_inflight,
                slot_times=self.slot_times,
                remaining_s=remaining_s,
                slowdown=slowdown,
                target_s=target_s,
                quantile_z=quantile_z,
                light=light,
            )
        assert self.throttle is not None
        return self.throttle.check(
            backlog,
            inflight,
            self.service,
            remaining_s=remaining_s,
            slowdown=slowdown,
            target_s=target_s,
        )

    def observe_batch(
        self,
        *,
        rows: dict[str, int],
        tokens: dict[str, int],
        tier_of: Callable[[str], str],
        ok: bool,
        started: float,
        finished: float,
        now: float,
    ) -> None:
        """A batch came back: what it cost, and (if it succeeded) whose tiers it served."""
        if ok:
            rows_by_tier: dict[str, int] = {}
            tokens_by_tier: dict[str, int] = {}
            for tenant, n in rows.items():
                tier = tier_of(tenant)
                rows_by_tier[tier] = rows_by_tier.get(tier, 0) + n
                tokens_by_tier[tier] = tokens_by_tier.get(tier, 0) + tokens[tenant]
            self.tier_shares.observe(rows_by_tier, tokens_by_tier)
        if self.engine is not None:
            self.slot_times.observe(finished - started)  # its slot is free, whatever ended it
        self.service.observe_batch(
            sum(rows.values()), sum(tokens.values()), started, finished, now, ok=ok
        )
