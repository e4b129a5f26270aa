"""What a core carries across a failover (``fair_frontend.fleet.debt`` stores it).

The leader exports what its endpoints owe and hold: each scheduler's fairness state
(``Scheduler.export_fairness``: deficits, virtual token counters, programs' service),
every open sequence with the backend that holds its state, and the Tritons it could not
reach. A new leader resumes it before it serves: an endpoint already set up at once, any
other as it is set up (``set_up``), within ``keep_s`` of the resume; the carried backlog
comes back in that time, or not at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

from fair_frontend.core.clock import Clock
from fair_frontend.core.pool import BackendPool
from fair_frontend.core.sequences import OpenSequence, SequenceIds
from fair_frontend.protocol import ParamValue
from fair_frontend.scheduler import SchedulerFairness

if TYPE_CHECKING:
    from fair_frontend.core.dispatch import Dispatcher


class Holder(Protocol):
    """What a core's failover state reads of the core: its clock, endpoints, sequence
    ids and pool."""

    @property
    def clock(self) -> Clock: ...

    @property
    def runtimes(self) -> dict[str, Dispatcher]: ...

    @property
    def sequences(self) -> SequenceIds: ...

    @property
    def pool(self) -> BackendPool: ...

    @property
    def pool_if_made(self) -> BackendPool | None: ...


class Carried:
    """A core's state for a failover: its export, and what a failed leader left it."""

    def __init__(self, core: Holder) -> None:
        self.core = core
        # A failed leader's fairness state per model, for the endpoints not set up yet:
        # resumed as each is (``set_up``).
        self._fairness: dict[str, SchedulerFairness] = {}
        self._until = 0.0  # clock.now() past which the rest of it is forgotten
        # ... and its sequences' backends in a pool (Triton's id -> backend), likewise.
        self._pins: dict[str, dict[ParamValue, int]] = {}

    def set_up(self, model: str, runtime: Dispatcher) -> None:
        """An endpoint just set up takes what a failed leader left for it."""
        now = self.core.clock.now()
        saved = self._fairness.pop(model, None)
        if saved is not None and now < self._until:
            runtime.scheduler.resume_fairness(saved, now, self._until - now)
        pins = self._pins.pop(model, None)
        if pins and runtime.pins is not None:
            runtime.pins.resume(pins, now)

    def export_fairness(self) -> dict[str, SchedulerFairness]:
        """Each endpoint's fairness state (``Scheduler.export_fairness``), and what a
        resume left for endpoints this core has not set up yet: still owed."""
        core = self.core
        out = dict(self._fairness) if core.clock.now() < self._until else {}
        for model, runtime in list(core.runtimes.items()):
            out[model] = runtime.scheduler.export_fairness()
        return out

    def resume_fairness(self, saved: dict[str, SchedulerFairness], keep_s: float) -> None:
        """Take over a failed leader's ``export_fairness``, before this core serves: each
        endpoint resumes it as it is set up (at once where it is already), within
        ``keep_s`` of now: the carried backlog comes back in that time, or not at all."""
        now = self.core.clock.now()
        self._until = now + keep_s
        for model, state in saved.items():
            runtime = self.core.runtimes.get(model)
            if runtime is None:
                self._fairness[model] = state
            else:
                runtime.scheduler.resume_fairness(state, now, keep_s)

    def export_sequences(self) -> dict[str, list[OpenSequence]]:
        """Every open sequence of a stateful model, with the backend that holds its state
        where the model has a pool (``SequenceIds.export``, ``Pins.export``)."""
        out = self.core.sequences.export()
        for model, entries in out.items():
            runtime = self.core.runtimes.get(model)
            pins = runtime.pins.export() if runtime is not None and runtime.pins else {}
            if pins:
                out[model] = [
                    msgspec.structs.replace(s, backend=pins.get(s.assigned, -1)) for s in entries
                ]
        return out

    def resume_sequences(self, saved: dict[str, list[OpenSequence]]) -> None:
        """Take over a failed leader's ``export_sequences`` before this core serves: its
        tenants' sequences go on under the ids Triton holds them by, on the same backends."""
        core = self.core
        now = core.clock.now()
        core.sequences.resume(saved, now)
        for model, entries in saved.items():
            pins: dict[ParamValue, int] = {s.assigned: s.backend for s in entries if s.backend >= 0}
            runtime = core.runtimes.get(model)
            if not pins:
                continue
            if runtime is None:
                self._pins[model] = pins
            elif runtime.pins is not None:
                runtime.pins.resume(pins, now)

    def export_down(self) -> list[str]:
        """The Tritons of the pool this core finds unreachable (by address), for a new
        leader: it must not grant them work before its own probe finds them back."""
        pool = self.core.pool_if_made
        if pool is None:
            return []
        return [name for name, b in zip(pool.names, pool.backends, strict=True) if not b.available]

    def resume_down(self, down: Sequence[str]) -> None:
        """Take a failed leader's ``export_down``: those Tritons start down here (probed
        until they answer), instead of each costing a grant that fails first."""
        pool = self.core.pool
        for name, backend in zip(pool.names, pool.backends, strict=True):
            if name in down:
                backend.mark_down()
