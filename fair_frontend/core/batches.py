"""Batch mode: one model's batches, assembled here, at most one per model instance.

The default mode (``max_inflight`` unset): the scheduler assembles batches of rows and
``BatchDispatcher`` sends them, on top of what every mode does (``dispatch.Dispatcher``).
Invariants of this mode:

* at most ``max_inflight_batches`` batches are in Triton at once (by default one per
  model instance), and each is assembled at the moment an instance frees up (late
  binding), or ``dispatch_lead_ms`` before the batches in flight are predicted to finish
  (the early send: Triton starts it without a gap), once the feedback loop has batch
  times to predict from;
* work-conserving, unless ``max_queue_delay_ms`` asks to wait (only while Triton is
  idle) for a fuller batch, Triton-style;
* a batch whose model call fails for one bad row does not fail its neighbours: on a
  model error it is bisected (each half sent on its own, a failing half split again), so
  only the culprit sees the error, at about 2 log2(n) extra sends for one culprit among
  n, not n; a half that succeeded is finished and never sent again. A half goes only
  while nothing else of this model is in that Triton (the calls sent before wait to come
  back), and nothing else goes to it meanwhile (no batch to a free instance, no early
  send): Triton's batcher would put it into the same execution as a half, and a lone
  innocent request sharing a culprit's execution would get its error with nothing left
  to bisect (``tests/core/test_merged_executions.py``). This resends the
  requests of a failed call, which assumes what Triton's batching assumes of a model: a
  call that fails as a whole had no effect (the Python backend fails every request of
  an ``execute`` that raises; a model with side effects per row must answer per-row
  errors in its responses instead of raising);
* a batch is expected back in time: one Triton did not answer by its deadline marks the
  backend down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from fair_frontend.batching import Packed, pack, unpack
from fair_frontend.core.dispatch import DISPATCH_MODES, CoreRequest, Dispatcher
from fair_frontend.errors import FrontendError, ModelUnavailable, Unavailable
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import Tensor


class BatchDispatcher(Dispatcher):
    """Feeds one model's batches to Triton, at most ``max_inflight`` (batches) at a time."""

    def _start(self) -> None:
        # Per backend: failed batches being bisected there (nothing else goes to it), and
        # this model's calls in it now (a half waits until it is the only one).
        self._isolating = [0] * len(self.pool)
        self._calls = [0] * len(self.pool)
        self._alone: list[list[asyncio.Future[None]]] = [[] for _ in range(len(self.pool))]
        self._isolation: asyncio.Lock | None = None  # they take turns (made on first use)
        self._overlapped: set[asyncio.Task[None]] = set()  # were in Triton beside another
        # Per backend: when its batches in flight are predicted to be done.
        self._busy_until = [0.0] * len(self.pool)
        # Per batch in Triton: (backend, sent at, predicted seconds); _busy_until is
        # derived from them and recomputed as each batch comes back, early or late.
        self._predicted: dict[asyncio.Task[None], tuple[int, float, float]] = {}

    # ---- when a batch goes --------------------------------------------------------------

    def _may_send(self, now: float) -> int | None:
        """A backend with a free slot (the pool's choice), or the early send: one more
        batch to a backend whose slots are all taken, ``dispatch_lead_ms`` before its
        batches in flight are predicted to finish, so that it starts the batch without a
        gap while the batch is still assembled at the last moment (late binding); of
        those, the one predicted to free first."""
        pin = self._pinned(now)
        running = self.running
        if any(self._isolating):  # a backend bisecting takes nothing: as if it were full
            full = self.max_inflight
            running = [full if n else r for n, r in zip(self._isolating, running, strict=True)]
        free = self.pool.choose(running, self.max_inflight, pin)
        if free is not None:
            return free
        lead = self._lead()
        if lead <= 0:
            return None
        early = self._fullest_first(pin)
        if early is not None and now >= self._busy_until[early] - lead:
            return early
        return None

    def _fullest_first(self, only: int | None) -> int | None:
        """Of the reachable backends whose slots are all taken (``only``: that one) and
        that are not bisecting, the one whose batches are predicted to be done first."""
        best: int | None = None
        for i, backend in enumerate(self.pool.backends):
            if only is not None and i != only:
                continue
            if not backend.available or self.running[i] != self.max_inflight:
                continue
            if self._isolating[i]:
                continue
            if best is None or self._busy_until[i] < self._busy_until[best]:
                best = i
        return best

    def _arm_lead(self) -> None:
        """The early send's timer, at the first moment a reachable backend whose slots are
        all taken may take one more (a backend that is not there takes nothing: the moment
        passes, and a timer for it would fire at once, for ever; ``kick`` runs again when
        it is back)."""
        lead = self._lead()
        if lead <= 0:
            return
        early = self._fullest_first(None)
        if early is not None:
            self._arm(self._busy_until[early] - lead)

    def _tokens_charged(self) -> None:
        """No slot waits on a tenant's charge here: a batch goes when an instance frees."""

    def _hold_until(self, now: float) -> float | None:
        """Triton-style max_queue_delay: wait (only while idle) for a fuller batch."""
        delay = self.endpoint.max_queue_delay_ms / 1000.0
        if delay <= 0 or self.inflight > 0:
            return None
        oldest = self.scheduler.oldest_arrival()
        if oldest is None or oldest + delay <= now:
            return None
        policy = self.scheduler.policy
        if self.scheduler.queued_rows >= (policy.max_batch_size or 1):
            return None  # a full batch by rows
        if policy.max_batch_tokens is not None and (
            self.scheduler.queued_tokens >= policy.max_batch_tokens
        ):
            return None  # ... or by tokens
        return oldest + delay

    def _lead(self) -> float:
        service = self.service
        if service is None or not service.has_data:
            return 0.0
        return self.endpoint.dispatch_lead_ms / 1000.0

    # ---- batches in Triton: their predicted end -----------------------------------------

    def _launch(self, batch: list[CoreRequest], now: float, backend: int) -> asyncio.Task[None]:
        # Batches that meet in one Triton's queue (its batcher may run them as one).
        meeting = [t for t, b in self._where.items() if b == backend]
        task = super()._launch(batch, now, backend)
        if meeting:
            self._overlapped.update(meeting)
            self._overlapped.add(task)
        self._predicted[task] = (backend, now, self._predict(batch))
        self._busy_until[backend] = self._predicted_end(now, backend)
        return task

    def _forget(self, task: asyncio.Task[None]) -> None:
        super()._forget(task)
        self._overlapped.discard(task)
        done = self._predicted.pop(task, None)
        if done is not None:  # it came back: predict the rest of its backend's
            self._busy_until[done[0]] = self._predicted_end(self.clock.now(), done[0])

    def _predict(self, batch: list[CoreRequest]) -> float:
        service = self.service
        if service is None or not service.has_data:
            return 0.0
        rows = sum(r.rows for r in batch)
        tokens = sum(r.tokens for r in batch)
        return float(service.predict_batch_seconds(rows, tokens))

    def _predicted_end(self, now: float, backend: int) -> float:
        """When the batches in ``backend`` are predicted to be done: one instance runs
        them one after another, each from when it was sent or the one before it ends."""
        busy = now
        for b, sent, seconds in sorted(self._predicted.values()):
            if b == backend:
                busy = max(busy, sent) + seconds
        return busy

    # ---- failed batches -----------------------------------------------------------------

    async def _forward(
        self, packed: Packed, batch: list[CoreRequest], backend: int
    ) -> tuple[str, list[Tensor]]:
        with self._in_triton(backend):
            return await super()._forward(packed, batch, backend)

    @contextmanager
    def _in_triton(self, backend: int) -> Iterator[None]:
        """A call of this model out to ``backend`` (a batch sent from here, or in
        granted mode a shell's part): a bisection's half waits until none is
        (``_alone_in``)."""
        self._calls[backend] += 1
        try:
            yield
        finally:
            self._calls[backend] -= 1
            if not self._calls[backend]:
                for waiting in self._alone[backend]:
                    if not waiting.done():
                        waiting.set_result(None)
                self._alone[backend].clear()

    async def _alone_in(self, backend: int) -> None:
        """Until no call of this model is in ``backend`` (none goes meanwhile: it is
        bisecting); each is bounded by the batch deadline."""
        while self._calls[backend]:
            waiting = asyncio.get_running_loop().create_future()
            self._alone[backend].append(waiting)
            await waiting

    def _timed_out(self, backend: int) -> None:
        """A batch is expected back in time: that Triton is taken for down."""
        self.pool.backends[backend].mark_down()

    async def _model_error(
        self, batch: list[CoreRequest], err: FrontendError, backend: int
    ) -> tuple[bool, bool]:
        """One bad row must not fail its neighbours: find it by bisection (also a request
        alone whose batch overlapped another in Triton, whose own batcher may have run
        them as one execution: it is tried once more alone), and nothing beside it (no
        early send: Triton's own batcher would put a request sent meanwhile into the same
        execution as the culprit, nor anything to a free instance of the same Triton)."""
        if len(batch) == 1 and asyncio.current_task() not in self._overlapped:
            return await super()._model_error(batch, err, backend)
        self._isolating[backend] += 1
        try:
            if self._isolation is None:
                self._isolation = asyncio.Lock()
            async with self._isolation:  # one batch at a time: none meets another's
                unsent = await self._bisect(batch, backend)
        finally:
            self._isolating[backend] -= 1
        if unsent:  # Triton went away meanwhile: the rest waits for it, as a batch
            self._held.append(unsent)
            return False, True
        return False, False

    async def _bisect(self, batch: list[CoreRequest], backend: int) -> list[CoreRequest]:
        """Answer a batch that failed with a model error, culprits found by halves.

        Each half is sent on its own (to the batch's ``backend``): one that succeeds is
        finished (never sent again), one that fails is split again, and a request alone
        that fails gets its error. One culprit among n costs 2 sends per halving, about
        2 log2(n), where one by one cost n. Halves go one after another, in batch order.
        Returns the requests not sent because Triton became unreachable (to hold), []
        when every one was answered.
        """
        todo = [batch] if len(batch) == 1 else list(reversed(_halves(batch)))
        while todo:
            group = self._still_wanted(todo.pop())
            if group:
                await self._alone_in(backend)
                # What left while it waited (a client gone, its shell gone) is not sent: a
                # granted part to a dead shell would never be reported, and would hold
                # the Triton until the report's timeout.
                group = self._still_wanted(group)
            if not group:
                continue
            try:
                await self._send_group(group, backend)
            except Unavailable as err:
                self.pool.backends[backend].mark_down()
                if not err.never_sent:  # it may have run: never sent twice
                    for r in group:
                        self._fail(r, err)
                    group = []
                rest = [r for g in (group, *reversed(todo)) for r in g if not r.answered]
                if not self.pool.gave_up:
                    return rest
                for r in rest:
                    self._fail(r, self.outage_error())
                return []
            except ModelUnavailable as err:
                for r in group:
                    self._fail(r, err)
            except FrontendError as err:
                if len(group) == 1:
                    self._fail(group[0], err)
                else:
                    todo.extend(reversed(_halves(group)))
        return []

    def _still_wanted(self, group: list[CoreRequest]) -> list[CoreRequest]:
        """The requests of ``group`` still to send: not answered, and whose client is still
        there (one that went away is done with, CANCELLED: no work for an answer nobody
        reads)."""
        wanted = []
        for r in group:
            if r.answered:
                continue
            if r.cancelled:
                self._done(r, Outcome.CANCELLED, None, "")
                continue
            wanted.append(r)
        return wanted

    async def _send_group(self, group: list[CoreRequest], backend: int) -> None:
        """Send part of a failed batch as one call, alone in ``backend`` (``_bisect``
        waits for that), and finish its requests (raises the call's error, nothing
        answered, when it fails)."""
        packed = pack(group, self.plan)
        version, outputs = await self._forward(packed, group, backend)
        outs = unpack(outputs, group, self.plan, packed.stripped)
        for r, out in zip(group, outs, strict=True):
            self._finish(r, version, out)


def _halves(batch: list[CoreRequest]) -> list[list[CoreRequest]]:
    """The two halves of a batch, in order (the first one the larger)."""
    middle = (len(batch) + 1) // 2
    return [batch[:middle], batch[middle:]]


DISPATCH_MODES.add("batches", BatchDispatcher)
