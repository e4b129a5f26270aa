"""A pool of Tritons behind every endpoint: which one starts this batch soonest?

Each Triton of the pool (``config.Triton.pool``: serve's repeated ``--triton-url``, or
``triton.backends``) is a ``dispatch.Backend`` (is it reachable? its probe, its outage)
and a forwarder (how to call it). Each model's ``Dispatcher`` keeps, per backend, what
it has running there, and the endpoint's slots (``max_inflight_batches`` in batch mode,
``max_inflight`` in engine mode) are per backend: a pool of n Tritons runs up to n times
the slots of one, each Triton at most its own.

The choice (``BackendPool.choose``), for each batch or granted stream as it goes:

* only a backend that is reachable, with a free slot, may take it;
* of those, the one with the fewest running relative to its slots: the one that will
  start it soonest, as Triton runs a model's batches one per instance (a free instance
  starts at once; the least loaded frees first, batch times being alike);
* ties go round robin, from the backend after the last one chosen (one cursor for the
  pool: a lone request at a time alternates over the pool, and no backend is kept cold).

What a backend's outage does:

* it takes only what runs on it: a call that fails because the backend went away (a
  connection lost, refused) marks it down, its requests answered UNAVAILABLE (retryable)
  where they may have reached it, held and sent to another backend where they never did;
  a granted stream likewise: held and granted again where its shell says nothing of it
  reached its client (it could not reach that Triton, or lost it before the first
  response), failed where it had sent its client anything;
* nothing queued is lost: the queue is the dispatcher's, and it keeps feeding the
  backends that are there (a backend down has no free slot);
* it rejoins when its own probe says Triton is ready (``Backend.mark_up``: every
  dispatcher is kicked);
* the endpoint is down (``available`` false: nothing is sent, what waits is held) only
  while every backend is, and gives up (``max_outage_s``: what waits is answered
  UNAVAILABLE, ``give_up_listeners``) once every backend has: the last one to go down
  gives up last, ``max_outage_s`` after the whole pool went down.

A stateful model's sequence stays on the backend that holds its state (Triton keeps it
per server): its dispatcher pins the sequence's id to the backend its first request went
to, and its later requests go there alone (``choose(only=...)``), or fail UNAVAILABLE if
that backend is down (its state went with it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fair_frontend.backends.protocol import Forwarder
    from fair_frontend.core.dispatch import Backend

log = logging.getLogger(__name__)


class BackendPool:
    """Which Triton takes the next batch (``choose``), and is any of them there?"""

    def __init__(
        self,
        backends: Sequence[Backend],
        forwarders: Sequence[Forwarder],
        names: Sequence[str] | None = None,
    ) -> None:
        if not backends or len(backends) != len(forwarders):
            raise ValueError("a pool needs one forwarder per backend, and at least one")
        self.backends = list(backends)
        self.forwarders = list(forwarders)
        self.names = list(names) if names is not None else [str(i) for i in range(len(backends))]
        # Called when the whole pool's outage outlasted max_outage_s (every backend gave up).
        self.give_up_listeners: list[Callable[[], None]] = []
        # Called (soon, not from within mark_down) when a backend goes down.
        self.down_listeners: list[Callable[[], None]] = []
        self._turn = 0  # where the round robin of ties starts
        for backend in self.backends:
            backend.give_up_listeners.append(self._member_gave_up)
            backend.down_listeners.append(self._member_down)

    def __len__(self) -> int:
        return len(self.backends)

    @property
    def available(self) -> bool:
        """Is any backend reachable? (The endpoint is down only when none is.)"""
        backends = self.backends
        if len(backends) == 1:  # the hot path's common case, without a generator
            return backends[0].available
        return any(b.available for b in backends)

    @property
    def up(self) -> int:
        """How many backends are reachable."""
        return sum(1 for b in self.backends if b.available)

    @property
    def gave_up(self) -> bool:
        """Every backend is down, and has been for longer than ``max_outage_s``."""
        backends = self.backends
        if len(backends) == 1:
            return backends[0].gave_up
        return all(b.gave_up for b in backends)

    @property
    def outage_s(self) -> float:
        """How long the whole pool has been down (0 while a backend is there)."""
        return min(b.outage_s for b in self.backends)

    @property
    def max_outage_s(self) -> float:
        return max(b.max_outage_s for b in self.backends)

    def choose(self, running: Sequence[int], slots: int, only: int | None = None) -> int | None:
        """The backend to send one more batch to: reachable, with fewer than ``slots``
        running (``running[i]``: the caller's, on backend i), the fewest of them; ties
        round robin (the module docstring; ``took`` moves the cursor). ``only``: that
        backend or none. None: no backend may take it now."""
        backends = self.backends
        if only is not None:
            return only if backends[only].available and running[only] < slots else None
        n = len(backends)
        if n == 1:  # the common case, without the scan
            return 0 if backends[0].available and running[0] < slots else None
        best: int | None = None
        start = self._turn
        for k in range(n):
            i = (start + k) % n
            free = backends[i].available and running[i] < slots
            if free and (best is None or running[i] < running[best]):
                best = i
        return best

    def took(self, i: int) -> None:
        """Backend ``i`` was chosen and took a batch: ties start after it next time."""
        self._turn = (i + 1) % len(self.backends)

    def _member_gave_up(self) -> None:
        if self.gave_up:
            for give_up in self.give_up_listeners:
                give_up()

    def _member_down(self) -> None:
        if not self.down_listeners:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # marked down outside the loop (a test's direct call)
            for listener in self.down_listeners:
                listener()
            return
        for listener in self.down_listeners:
            loop.call_soon(listener)

    async def close(self) -> None:
        for backend in self.backends:
            await backend.close()
