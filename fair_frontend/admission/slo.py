"""SLO classes: what a request's latency is held to, and how well each class is served.

A class is ``interactive`` (a time-to-first-token target, and an inter-token one) or
``batch`` (a completion deadline). The config names them (``slo_classes``) and gives
one to a tier, a tenant, or a request (the ``slo_class`` parameter, ``x-slo-class``);
``SloClasses.resolve`` says which holds.

What a class changes
--------------------
Admission, on every endpoint that throttles (``EndpointAdmission``): the target the
throttle compares its predicted wait with is the class's, not the endpoint's
``latency_target_ms``. An interactive request's is its TTFT target less the time it
spent before admission (from its shell's arrival: its shell's and the link's lag under
load) and the time a request takes from its slot to its first token (``SloLedger``:
measured, its moving mean and spread; the target leaves room for its 99th percentile, as
the wait for a slot is judged at its 99th percentile: ``SLO_QUANTILE_Z``). A batch
request's is its deadline less the time a request holds its slot (``SlotTimes``: it must
also finish), so a batch request is refused only when even the wait predicted for it
cannot leave it time to complete; that prediction is a lower bound (batch work yields,
below), so what is refused could not have made it. Either way the request's own deadline
still tightens the target, and the throttle's rules stand: a request that finds a free
slot or is next in line is never refused, and a tenant's wait is predicted from its own
place in the fair order (its own work ahead and its fair share of its tier's others,
``Scheduler.backlog_ahead``) and the slots' measured turnover, so a tenant within its
share is not refused for another's backlog. Its own work ahead is its program's place
inside its tenant where it names one: a chat's call beside its own agent's fan-out
waits for what least attained service serves first (one or two of the agent's calls),
not the fan-out, and is not refused for it.

Order: a batch request's priority level is moved below every level
(``priority_levels`` is added to it: ``Core._new_request``), so inside its tenant it goes after
every interactive (or unclassed) request, whatever priority it asked for: batch work
takes the slack its tenant's interactive work leaves. Between tenants nothing changes:
tiers in strict order, then fair shares (so batch work of a tenant within its share is
served as before, and a tenant cannot make its batch work jump others' by naming a
class). To make batch tenants yield to interactive ones, put them in a lower tier; the
scheduler is work-conserving, so a lower tier takes whatever slots the higher leave.

Attainment (``SloLedger``): an interactive request met its class when its first token
came within ``ttft_ms`` of its arrival; a batch one when it ended served within
``deadline_s``. Counted per whole second when the verdict is known, per tenant and
class, and read over the fairness window's seconds (``scheduler.window.WINDOW_S``);
refused requests are not counted (the throttle's counters count them). The inter-token
target is carried and shown, not enforced: an engine's step time follows its slots
(``max_inflight``), not the order of its queue.

Prediction error: for each admitted interactive request, the TTFT the throttle predicted
(its wait for a slot, without the safety margin, plus the first-token time measured
then) against its first token's actual time; the relative error
``(predicted - actual) / actual`` is observed in a histogram per class.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fair_frontend.errors import InvalidArgument
from fair_frontend.protocol import SLO_CLASS_HEADER, SLO_CLASS_PARAMETER
from fair_frontend.scheduler.window import WINDOW_S

# First-token time (slot to first token) assumed before any was measured; and the weight
# of each new measurement in its moving average.
DEFAULT_FIRST_TOKEN_S = 0.0
FIRST_TOKEN_ALPHA = 0.05
# An interactive class is judged at the 99th percentile of the time its slot takes to
# free (engine endpoints: ``throttle.release_quantile``), not at the mean times a margin:
# what it admits should make its target 99 times in 100, whatever the queue's length.
SLO_QUANTILE_Z = 2.326


class SloKind(enum.StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"


@dataclass(frozen=True, slots=True)
class SloClass:
    """One class: its name, its kind and its targets (seconds; None where not its kind's)."""

    name: str
    kind: SloKind
    ttft_s: float | None = None  # interactive
    itl_s: float | None = None  # interactive, optional (shown, not enforced)
    deadline_s: float | None = None  # batch

    @property
    def interactive(self) -> bool:
        return self.kind is SloKind.INTERACTIVE

    def target_s(self, first_token_s: float, hold_s: float) -> float:
        """The throttle's target for a wait for a slot: the TTFT target less the first token's time
        once in a slot (interactive; the caller adds the time the request spent before
        admission), or the deadline less a slot's mean hold time (batch). At least a
        millisecond: a target the slot's own time uses up refuses every request that
        must wait (a free slot or the next in line still go)."""
        if self.interactive:
            assert self.ttft_s is not None
            left = self.ttft_s - first_token_s
        else:
            assert self.deadline_s is not None
            left = self.deadline_s - hold_s
        return max(1e-3, left)

    def met(self, seconds: float) -> bool:
        """Whether ``seconds`` (to the first token: interactive; to the end: batch) met it."""
        limit = self.ttft_s if self.interactive else self.deadline_s
        assert limit is not None
        return seconds <= limit


class SloClasses:
    """Which class holds for a request: its own, else its tenant's, else its tier's.

    ``classes``: the configured ones by name; ``class_of``: a tenant's own or its tier's
    class name (None: none), read at each request (a reload changes tenants live)."""

    def __init__(
        self, classes: Mapping[str, SloClass], class_of: Callable[[str], str | None]
    ) -> None:
        self.classes = dict(classes)
        self._class_of = class_of

    def resolve(self, tenant: str, asked: str = "") -> SloClass | None:
        """The class of a request of ``tenant`` that named ``asked`` ("": none). A name
        not configured is refused (400) with the names that are."""
        if asked:
            slo = self.classes.get(asked)
            if slo is None:
                known = ", ".join(sorted(self.classes)) or "none are configured"
                raise InvalidArgument(
                    f"unknown SLO class {asked!r} (the {SLO_CLASS_PARAMETER} parameter or "
                    f"{SLO_CLASS_HEADER} header): the classes are {known}"
                )
            return slo
        if not self.classes:
            return None
        name = self._class_of(tenant)
        return self.classes.get(name) if name else None

    def loosest_target_s(self, first_token_s: float, hold_s: float) -> float | None:
        """The largest target of any class (None: no class): a tier whose best request
        is refused against it is refused whatever class its requests name."""
        targets = [c.target_s(first_token_s, hold_s) for c in self.classes.values()]
        return max(targets) if targets else None


class SloLedger:
    """One endpoint's SLO outcomes: attainment per second, and the first-token time.

    ``first_token_s``: the moving average of the time from a request's slot (its
    dispatch) to its first token, which the interactive target leaves for the wait.
    ``record`` counts a verdict in the second it is known; ``window`` sums the whole
    seconds of the fairness window, [floor(now) - WINDOW_S, floor(now)).
    """

    def __init__(self) -> None:
        self.first_token_s = DEFAULT_FIRST_TOKEN_S
        self.first_token_dev_s = 0.0  # the moving mean absolute deviation of it
        self._measured = False
        # (second, {(tenant, class): [met, total]}), oldest first, WINDOW_S + 1 at most
        self._seconds: deque[tuple[float, dict[tuple[str, str], list[int]]]] = deque()

    def observe_first_token(self, slot_to_first_s: float) -> None:
        if slot_to_first_s < 0 or not math.isfinite(slot_to_first_s):
            return
        if not self._measured:
            self.first_token_s, self._measured = slot_to_first_s, True
            return
        off = slot_to_first_s - self.first_token_s
        self.first_token_s += FIRST_TOKEN_ALPHA * off
        self.first_token_dev_s += FIRST_TOKEN_ALPHA * (abs(off) - self.first_token_dev_s)

    def first_token_quantile_s(self, z: float) -> float:
        """A high quantile of the first-token time: its mean and ``z`` times its spread
        (the mean absolute deviation scaled to a normal's standard deviation, 1.25x)."""
        return self.first_token_s + z * 1.25 * self.first_token_dev_s

    def record(self, tenant: str, slo: str, met: bool, now: float) -> None:
        second = float(math.floor(now))
        seconds = self._seconds
        if not seconds or seconds[-1][0] < second:
            seconds.append((second, {}))
            while seconds[0][0] < second - WINDOW_S:
                seconds.popleft()
        counts = seconds[-1][1].setdefault((tenant, slo), [0, 0])
        counts[0] += met
        counts[1] += 1

    def window(self, now: float) -> dict[tuple[str, str], tuple[int, int]]:
        """(tenant, class) -> (met, total) over the window's whole seconds."""
        end = float(math.floor(now))
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for second, counts in self._seconds:
            if end - WINDOW_S <= second < end:
                for key, (met, total) in counts.items():
                    was = out.get(key, (0, 0))
                    out[key] = (was[0] + met, was[1] + total)
        return out


def prediction_error(predicted_s: float, actual_s: float) -> float | None:
    """``(predicted - actual) / actual`` (None where the actual time is not positive)."""
    if actual_s <= 0:
        return None
    return (predicted_s - actual_s) / actual_s


__all__ = [
    "SLO_QUANTILE_Z",
    "SloClass",
    "SloClasses",
    "SloKind",
    "SloLedger",
    "prediction_error",
]
