"""The real-time throttle: reject early when the queue ahead cannot be served in time.

Can this request be served within its target? The target is the endpoint's
``latency_target_ms``, tightened by the request's own remaining deadline. The scheduler
says how much work will be served before the request, the request included
(``Scheduler.backlog_ahead``: an overestimate of DRR's share by construction); the
service model (``fair_frontend.feedback``) says how long batches take.

The predicted wait
------------------
With one model instance, batches run one after another, so the request is answered when
the batches in flight and then the backlog (as batches) have run. The backlog needs

    n = max(ceil(rows / max_batch_size), ceil(tokens / max_batch_tokens))

batches, and with the batch-time model ``fixed + per_row * rows + per_token * tokens`` the
way the backlog is split into those n batches does not matter (the model is linear):

    wait = (inflight + n) * fixed + per_row * (inflight + n) * max_batch_size
           + per_token * (max(tokens, n * T) + inflight * T)

where T is the tokens of a full batch of the typical rows lately (tokens per row times
``max_batch_size``, at most ``max_batch_tokens``). Every batch counts as *full*: under
overload the batches in flight are full, and the backlog's last batch, which holds the
request, is filled up by later arrivals before it is sent (the frontend assembles a batch
when a slot frees, not when a request arrives). Counting only the backlog's own rows
measurably lets through requests that then wait up to a batch too long (about 1 in 5 at
the target, in the overload test); counting the batches in flight at the typical size
does so while the typical size is still growing at the start of a burst. Conservative
further: the batches in flight count as not started, ``n`` is rounded up, and the backlog
is the scheduler's estimate of DRR's share. ``safety`` (the endpoint's ``throttle_safety``,
1.25 by default) multiplies the wait,
for deployments that want a margin. Why not backlog / throughput: the throughput of the
last seconds was measured at the last seconds' batch sizes; under a burst batches fill up
and the fixed cost is amortised over more rows, which the batch-time model sees and a
plain rate does not.

Never rejects a short queue: a backlog that fits in ``short_queue_batches`` (2) batches is
admitted whatever the prediction, so a slow model, a tight target or a wrong estimate can
never turn away a request that would be next in line. With no service data at all
(``ServiceModel.has_data`` false) nothing is rejected.

``retry_after``: the queue ahead drains one second of predicted work per second, so the
wait fits again after ``wait - target`` seconds if nothing arrives ahead meanwhile; at
least ``min_retry_after_s`` (0.1 s). A 503 rounds it up to whole seconds (``Retry-After``).

Monotone in the backlog: more rows or tokens never lower ``n`` or the wait (all terms are
>= 0), and the short-queue rule only admits small backlogs; so a rejected backlog stays
rejected when it grows (a property test checks it).

Higher tiers keep arriving: work of a higher tier that arrives *after* an admission is
served before the admitted request, so for a lower tier the wait is stretched by
``slowdown = 1 / (1 - s)``, where ``s`` is the higher tiers' recent share of the
endpoint's rows (the service tracks it per batch; at most 0.9 counts). Without it, a
lower tier under a busy higher tier was admitted for about twice its target.

Limits of the promise: the rest of what arrives after an admission and is served before
it (a new tenant taking its DRR share) is not predictable at admission; such a request
can still miss its target. Without Triton's queue (the frontend keeps at most
``max_inflight_batches`` there) nothing else waits ahead of the frontend's batches, except
traffic that bypasses the frontend.

Engine endpoints (``EngineThrottle``)
-------------------------------------
An engine (``max_inflight``: continuous batching inside the model) does not run batches
one after another: it serves S = ``max_inflight`` requests at once, each in a slot of its
own until its generation ends, and the frontend gives the next free slot to the next
request in its scheduling order (tier, fair share, priority). What a waiting request
waits for is therefore slots freeing up, not batches. The target is the wait *for a
slot* (time to its first token, roughly): how long a generation then runs is what the
client asked for (``max_tokens``), not the platform's doing.

Let I be the requests in the engine now and k the work ahead of the request in
scheduling order, itself included, in requests: ``Scheduler.backlog_ahead``'s rows (its
tier's and the higher tiers' queues, its own queued requests at its level or above, and
its fair share of its tier's others). It gets a slot once ``n = I + k - S`` requests
have left the engine (none: a slot is free for it now). With ``reserved_slots`` R a
tenant holds at most C = S - R slots, so its own requests also bound it: with i of
them in the engine and a of them queued ahead of it (itself included), it needs
``n_own = i + a - C`` of its own to leave. A slot is held H seconds on average
(``fair_frontend.feedback.slots.SlotTimes``: the mean time a request held its slot
lately, from dispatch's own timings); while all S are busy they free up at a rate of
S / H, C / H for the tenant's own. So

    wait = max(n * H / S * slowdown,  n_own * H / C) * safety      (0 for n, n_own <= 0)

with the batch throttle's ``safety`` and ``slowdown``: 1 / (1 - the higher tiers' recent
share of the requests the engine finished), which take slots first (the tenant's own
bound is not shared with them). Never rejected: a request with no data behind H
(``SlotTimes.has_data``), and one that is next in line (n, n_own <= 1: the next slot
that frees is its own), whatever the prediction. ``retry_after`` = wait - target, as for
batches.

With ``light_slots`` L (``core.engine``: the last L free slots go only to a request
whose program holds none, the fairest such one, out of turn) the order above holds for
a request only while more than L slots are free. One that may not take a light slot
(its program holds a slot, or has work queued before it) needs a slot with L still free
after: ``n = I + k - (S - L)``. One that may (its program holds none and queues nothing)
also gets a light slot as soon as the requests that may take one before it have: at
most one head of each other tenant queued in its tier or a higher one (``h`` of them:
``Scheduler.light_rivals``; the fairest goes first, and a tenant's next head waits for
its next turn), so ``n = min(I + k - S, I + h + 1 - S)``. An estimate, not a bound: a
rival's head may not be light (taking no light slot), and the request may not be its
tenant's head when a light slot frees (another of its programs has less service).

Its error. Releases are the ends of S generations of different lengths, not evenly
spaced: while the slots are busy the time to n of them concentrates around n H / S, with
a relative spread of about CV / sqrt(n) (CV: the coefficient of variation of hold
times), and H is itself a mean of the last ~2S hold times, about CV / sqrt(4S) off.
H is the mean of recent requests, not of those ahead: a queue of much longer (shorter)
generations than lately frees slots slower (faster) than predicted, by the ratio of
their mean length to H, until H follows (about 2S requests). Not foreseen, as for
batches: work that arrives after the admission and is served first, a higher tier
(the slowdown covers its recent share) or another tenant of the tier taking its fair
share of the slots as they free up. Measured in ``tests/feedback/test_engine_throttle.py``
(16 slots, hold times uniform in 0.2-1.8 x their mean, target 2 s, safety 1.25, five
seeds): one tenant at twice the capacity: about half refused, 0.6-2.1 % of the admitted
got their slot after the target, none later than 1.11 x it (without the throttle: all
late); a hog at three times the capacity beside a light tenant at a tenth of it, 4 slots
reserved: the light one never refused nor late, 1.0-4.3 % of the hog's admitted late
(its own bound, C = 12 slots, sets its wait); without reserved slots 11-17 % of the
hog's are late, pushed back by the light tenant's arrivals (a tenth of the releases).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fair_frontend.errors import Overloaded
from fair_frontend.feedback import ServiceModel
from fair_frontend.feedback.slots import SlotTimes
from fair_frontend.scheduler import Backlog

DEFAULT_LATENCY_TARGET_MS = 5000.0
DEFAULT_THROTTLE_SAFETY = 1.25
DEFAULT_SHORT_QUEUE_BATCHES = 2
DEFAULT_MIN_RETRY_AFTER_S = 0.1


@dataclass(frozen=True, slots=True)
class ThrottleDecision:
    """The throttle's answer for one request."""

    admitted: bool
    predicted_wait_s: float
    target_s: float
    batches: int  # batches the backlog (the request included) needs; engine: slot releases
    # "no service data", "short queue", "within target", "over target"; engine: "free
    # slot", "next in line" in place of "short queue"
    reason: str
    deadline_bound: bool = False  # the request's own deadline set the target
    retry_after_s: float | None = None  # on reject: when the wait would fit again
    slo_class: str = ""  # the SLO class whose target it was judged against ("": none)
    # engine: the expected wait for a slot, without margin or quantile (None: not known)
    mean_wait_s: float | None = None


class Throttle:
    """Can this request be served within its target?

    Stateless apart from the endpoint's batching caps and target; one per endpoint.
    """

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_batch_tokens: int | None = None,
        latency_target_s: float = DEFAULT_LATENCY_TARGET_MS / 1000.0,
        short_queue_batches: int = DEFAULT_SHORT_QUEUE_BATCHES,
        min_retry_after_s: float = DEFAULT_MIN_RETRY_AFTER_S,
        safety: float = 1.0,
        servers: int = 1,
    ) -> None:
        if latency_target_s <= 0 or short_queue_batches < 1 or safety < 1 or servers < 1:
            raise ValueError(
                "need latency_target_s > 0, short_queue_batches >= 1, safety >= 1, servers >= 1"
            )
        # Tritons serving the endpoint side by side (a pool): the batches ahead are
        # shared among them, so the wait is the one-server wait divided by their number.
        self.servers = servers
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.latency_target_s = latency_target_s
        self.short_queue_batches = short_queue_batches
        self.min_retry_after_s = min_retry_after_s
        self.safety = safety

    def batches_for(self, rows: int, tokens: int) -> int:
        """The fewest batches the caps allow for ``rows`` rows and ``tokens`` tokens."""
        if self.max_batch_size <= 0:
            return max(1, rows)  # a model that does not batch: one request (row) at a time
        n = math.ceil(rows / self.max_batch_size)
        if self.max_batch_tokens is not None:
            n = max(n, math.ceil(tokens / self.max_batch_tokens))
        return max(1, n)

    def predicted_wait(
        self, backlog: Backlog, inflight: int, service: ServiceModel, slowdown: float = 1.0
    ) -> float:
        """Seconds until the last of ``backlog`` is served (the module docstring's formula).

        ``slowdown`` (>= 1) stretches it for the service that higher tiers will take
        meanwhile: 1 / (1 - their recent share of the endpoint's rows)."""
        bt = service.batch_time()
        typical_rows, typical_tokens = service.typical_batch()
        n = self.batches_for(backlog.rows, backlog.tokens)
        if self.max_batch_size > 0:
            # Every batch counts as full: those in flight may be, and the backlog's last
            # one is filled up by later arrivals before it is sent. Full of typical rows,
            # unless the backlog's own rows are heavier.
            full_rows = float(self.max_batch_size)
            full_tokens = full_rows * typical_tokens / max(1.0, typical_rows)
            if self.max_batch_tokens is not None:
                full_tokens = min(full_tokens, float(self.max_batch_tokens))
            rows = (n + inflight) * full_rows
            tokens = max(float(backlog.tokens), n * full_tokens) + inflight * full_tokens
        else:  # no batching: one request at a time, in flight too
            rows = float(backlog.rows) + inflight * typical_rows
            tokens = float(backlog.tokens) + inflight * typical_tokens
        wait = (inflight + n) * bt.fixed_s + bt.per_row_s * rows + bt.per_token_s * tokens
        return wait / self.servers * self.safety * max(1.0, slowdown)

    def check(
        self,
        backlog: Backlog,
        inflight: int,
        service: ServiceModel,
        *,
        remaining_s: float | None = None,
        slowdown: float = 1.0,
        target_s: float | None = None,
    ) -> ThrottleDecision:
        """Admit or reject a request whose backlog (itself included) is ``backlog``.

        ``inflight``: batches of this endpoint in Triton now. ``remaining_s``: the time left
        to the request's own deadline, if it has one. ``target_s``: its SLO class's target
        (``admission.slo``) in place of the endpoint's.
        """
        target = self.latency_target_s if target_s is None else target_s
        deadline_bound = remaining_s is not None and remaining_s < target
        if remaining_s is not None:
            target = min(target, remaining_s)
        n = self.batches_for(backlog.rows, backlog.tokens)
        wait = self.predicted_wait(backlog, inflight, service, slowdown)
        if not service.has_data:
            return ThrottleDecision(True, wait, target, n, "no service data", deadline_bound)
        if n * max(1.0, slowdown) <= self.short_queue_batches:
            # Short in time: a lower tier's two batches under a busy higher tier are not.
            return ThrottleDecision(True, wait, target, n, "short queue", deadline_bound)
        if wait <= target:
            return ThrottleDecision(True, wait, target, n, "within target", deadline_bound)
        retry = max(self.min_retry_after_s, wait - target)
        return ThrottleDecision(False, wait, target, n, "over target", deadline_bound, retry)


class EngineThrottle:
    """Can this request get one of the engine's slots within its target?

    The module docstring derives the wait (``Engine endpoints``). Stateless apart from
    the endpoint's slots and target; one per engine endpoint.
    """

    def __init__(
        self,
        *,
        slots: int,
        reserved_slots: int = 0,
        latency_target_s: float = DEFAULT_LATENCY_TARGET_MS / 1000.0,
        min_retry_after_s: float = DEFAULT_MIN_RETRY_AFTER_S,
        safety: float = 1.0,
        light_slots: int = 0,
    ) -> None:
        if slots < 1 or not 0 <= reserved_slots < slots:
            raise ValueError("need slots >= 1 and 0 <= reserved_slots < slots")
        if latency_target_s <= 0 or safety < 1:
            raise ValueError("need latency_target_s > 0 and safety >= 1")
        if not 0 <= light_slots < slots:
            raise ValueError("need 0 <= light_slots < slots")
        self.slots = slots
        self.tenant_slots = slots - reserved_slots  # the most one tenant holds
        self.light_slots = light_slots
        self.latency_target_s = latency_target_s
        self.min_retry_after_s = min_retry_after_s
        self.safety = safety

    def _overall(self, ahead: int, inflight: int, light: int | None) -> int:
        """Releases of any request's before this one's slot: the module docstring's n,
        with light slots (``light``: None where the request may not take one, else the
        requests that may take one before it, itself included)."""
        if not self.light_slots:
            return inflight + ahead - self.slots
        if light is None:
            return inflight + ahead - (self.slots - self.light_slots)
        return min(inflight + ahead, inflight + light) - self.slots

    def releases(
        self, ahead: int, own_ahead: int, inflight: int, own_inflight: int, light: int | None = None
    ) -> int:
        """Requests that must leave the engine before this one gets a slot (<= 0: a slot
        is free for it). ``ahead``: requests served before it, itself included;
        ``own_ahead``: of those, its tenant's; ``inflight``/``own_inflight``: requests
        in the engine, all and its tenant's; ``light``: as for ``_overall``."""
        overall = self._overall(ahead, inflight, light)
        own = own_inflight + own_ahead - self.tenant_slots
        return max(overall, own)

    def predicted_wait(
        self,
        ahead: int,
        own_ahead: int,
        inflight: int,
        own_inflight: int,
        hold_s: float,
        slowdown: float = 1.0,
        quantile_z: float = 0.0,
        light: int | None = None,
    ) -> float:
        """Seconds until a slot is free for the request (the module docstring's formula).
        ``hold_s``: the mean time a request holds its slot. ``quantile_z`` > 0: the
        releases counted at that quantile of their time (``release_quantile``), and no
        ``safety`` (the quantile is the margin); 0: at their mean, times ``safety``.
        ``light``: as for ``_overall``."""
        overall_n = float(max(0, self._overall(ahead, inflight, light)))
        own_n = float(max(0, own_inflight + own_ahead - self.tenant_slots))
        safety = self.safety
        if quantile_z > 0:
            overall_n = release_quantile(overall_n, quantile_z)
            own_n = release_quantile(own_n, quantile_z)
            safety = 1.0
        overall = overall_n * hold_s / self.slots * max(1.0, slowdown)
        own = own_n * hold_s / self.tenant_slots
        return max(overall, own) * safety

    def check(
        self,
        *,
        ahead: int,
        own_ahead: int,
        inflight: int,
        own_inflight: int,
        slot_times: SlotTimes,
        remaining_s: float | None = None,
        slowdown: float = 1.0,
        target_s: float | None = None,
        quantile_z: float = 0.0,
        light: int | None = None,
    ) -> ThrottleDecision:
        """Admit or reject a request (arguments as ``releases``); ``remaining_s``: the time
        left to its own deadline, if it has one; ``target_s``: its SLO class's target
        (``admission.slo``) in place of the endpoint's, judged at ``quantile_z``
        (``predicted_wait``)."""
        target = self.latency_target_s if target_s is None else target_s
        deadline_bound = remaining_s is not None and remaining_s < target
        if remaining_s is not None:
            target = min(target, remaining_s)
        n = self.releases(ahead, own_ahead, inflight, own_inflight, light)
        hold = slot_times.mean_hold_s
        wait = self.predicted_wait(
            ahead, own_ahead, inflight, own_inflight, hold, slowdown, quantile_z, light
        )
        # The expected wait (no margin, no quantile): what the time to first token is
        # predicted from (``EndpointAdmission.predicted_ttft_s``).
        mean = self.predicted_wait(
            ahead, own_ahead, inflight, own_inflight, hold, slowdown, light=light
        )
        mean /= self.safety
        shown = max(0, n)
        if n <= 0:
            reason = "free slot"
        elif not slot_times.has_data:
            reason = "no service data"
        elif n <= 1:
            reason = "next in line"
        elif wait <= target:
            reason = "within target"
        else:
            retry = max(self.min_retry_after_s, wait - target)
            return ThrottleDecision(
                False, wait, target, shown, "over target", deadline_bound, retry, mean_wait_s=mean
            )
        return ThrottleDecision(True, wait, target, shown, reason, deadline_bound, mean_wait_s=mean)


def release_quantile(n: float, z: float) -> float:
    """The releases whose mean time is the ``z``-quantile of the time to ``n`` releases,
    where releases come as a Poisson process (S slots of varied hold times free up
    nearly so): Gamma(n)'s quantile by Wilson and Hilferty's approximation, ``n (1 -
    1/(9n) + z / (3 sqrt n))^3`` (for n = 1 and z = 2.33, 4.63: the exact 4.61). 0 for
    ``n`` <= 0. Monotone in ``n`` and ``z``."""
    if n <= 0:
        return 0.0
    return float(n * (1.0 - 1.0 / (9.0 * n) + z / (3.0 * math.sqrt(n))) ** 3)


def overloaded_error(decision: ThrottleDecision, endpoint: str) -> Overloaded:
    """The 503 for a rejected decision: says the predicted wait and the target."""
    if decision.admitted:
        raise ValueError("overloaded_error needs a rejected decision")
    whose = "the latency target"
    if decision.deadline_bound:
        whose = "the request's deadline"
    elif decision.slo_class:
        whose = f"the target of SLO class '{decision.slo_class}'"
    wait, target = _wait_and_target(decision.predicted_wait_s, decision.target_s)
    return Overloaded(
        f"Server overloaded on model '{endpoint}': predicted wait {wait} exceeds {whose} of "
        f"{target}; retry after {_seconds(decision.retry_after_s or 0)}",
        retry_after=decision.retry_after_s,
    )


def _seconds(value: float) -> str:
    if value < 10:
        return f"{value:.2f} s"
    return f"{math.ceil(value)} s"


def _wait_and_target(wait: float, target: float) -> tuple[str, str]:
    """Both as ``_seconds`` shows them, unless that shows them equal (a wait just over its
    target: "0.30 s exceeds ... 0.30 s"); then with as many decimals as tell them apart, up
    to microseconds. Rounding is monotone, so a larger wait never shows as smaller."""
    shown = _seconds(wait), _seconds(target)
    digits = 3
    while shown[0] == shown[1] and digits <= 6:
        shown = f"{wait:.{digits}f} s", f"{target:.{digits}f} s"
        digits += 1
    return shown


__all__ = [
    "DEFAULT_LATENCY_TARGET_MS",
    "DEFAULT_MIN_RETRY_AFTER_S",
    "DEFAULT_SHORT_QUEUE_BATCHES",
    "DEFAULT_THROTTLE_SAFETY",
    "EngineThrottle",
    "Throttle",
    "ThrottleDecision",
    "overloaded_error",
    "release_quantile",
]
