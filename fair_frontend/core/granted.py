"""Granted mode: batches formed here, sent to Triton by the shells that hold their rows.

A unary endpoint the plan puts in this mode (``EndpointPlan.one_hop``, ``.mode``)
runs ``GrantedDispatcher``: batch mode (``batches.BatchDispatcher``) in everything it
decides, with one hop for the bytes. A shell process keeps a request's tensors and sends
the core its facts (``records.Call`` with ``key``, the batch key the shell computed); the
scheduler forms each batch from the queued facts exactly as it forms a relayed one (the
same slots per model instance, the same throttle predictions and early send, the same
``max_queue_delay_ms``), and the batch goes out as one ``records.Rows`` per shell that
holds rows of it: that shell packs its rows into one Triton request (``batching.pack``),
sends it to the Triton the grant names, answers its clients and reports in one
``records.RowsDone``. The rows of several shells meet in Triton's dynamic batcher. A call
that came whole (a shell in the core's process, ``--workers 1``) is relayed from here,
as batch mode does; its key (a tuple) differs from the digest a shell sends, so it shares
no batch with granted rows (a core has one kind of shell or the other).

Invariants, beyond batch mode's:

* a batch holds its slot until every part of it is reported, or its shell is gone
  (``drop``: its calls end CANCELLED, the other shells' rows are answered as they come);
  its time for the feedback loop is the core's, grant to last report: the time the slot
  was held, which is what the throttle and the early send predict;
* the early send counts the shells' hops: a part reaches Triton a hop after its grant,
  and the core hears a batch is done a hop after Triton finished it, so the next batch
  goes ``dispatch_lead_ms`` plus the hops before the one in flight is predicted to end
  (``_lead``), and its parts wait in Triton's queue, where its batcher merges them into
  one execution, instead of reaching an idle instance one by one and running apart. The
  hops are what the core timed (grant to report) less what the shell timed (its call to
  Triton, ``RowsDone.exec_s``), the slowest part's per batch; they follow a rise at
  once and a fall slowly (a part late costs a whole execution, one early costs nothing);
* every call is answered once. A part Triton answered is answered by its shell (the
  core records the outcome, and charges its output tokens); a part that failed is not:
  its shell keeps the tensors and waits for the core's word, which is either a new grant
  or an ``Answer`` with the error (a few bytes);
* a failed part is judged as batch mode judges a failed batch, over the union of the
  batch's failed parts: not answered in time marks that Triton down; a part that never
  reached Triton (``never_sent``) is held with its slot and granted again first, to
  the next Triton with a free slot; a model's error is bisected (``_model_error``), each
  half granted on its own while nothing else of this model is in that Triton, so that
  only the culprit gets the error. A batch of several parts met in Triton's batcher
  (one execution may have held them all), so even a single failed call is tried once
  more alone. A shell never bisects on its own: it cannot know what else is in Triton;
* a part's shell that cannot find its calls any more (their clients went away) says so
  (``RowsDone.gone``): those end CANCELLED and take no answer.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from fair_frontend.batching import pack, unpack
from fair_frontend.core.batches import BatchDispatcher
from fair_frontend.core.dispatch import DISPATCH_MODES, CoreRequest, Route
from fair_frontend.errors import (
    DeadlineExceeded,
    FrontendError,
    Internal,
    ModelUnavailable,
    Unavailable,
)
from fair_frontend.observability.tracing import span_context
from fair_frontend.outcomes import Outcome
from fair_frontend.wire.records import Rows, RowsDone

REPORT_MARGIN_S = 10.0  # beyond triton.request_timeout_s, before a part is given up on
HOPS_FALL = 0.02  # how fast the early send's hops follow a smaller sample (per batch)


@dataclass(eq=False)
class _Batch:
    """One grant of a batch (or of a bisection's half), until every part is reported."""

    parts: dict[Route, list[CoreRequest]]  # not reported yet, by shell
    done: asyncio.Future[None]
    granted_at: float
    failed: list[tuple[list[CoreRequest], FrontendError]] = field(default_factory=list)
    hops: float | None = None  # the slowest part's hops (``GrantedDispatcher._lead``)


Failures = list[tuple[list[CoreRequest], FrontendError]]


class GrantedDispatcher(BatchDispatcher):
    """Batch mode whose batches the shells send (the module's doc)."""

    takes_facts = True

    def _start(self) -> None:
        super()._start()
        self._ids = itertools.count(1)
        self._granted: dict[int, _Batch] = {}
        self._hops = 0.0  # seconds: grant to Triton plus Triton to report (``_lead``)

    def _lead(self) -> float:
        """Batch mode's early send, ahead by the shells' hops too (the module's doc)."""
        lead = super()._lead()
        return lead + self._hops if lead > 0 else lead

    def _timed(self, granted: _Batch) -> None:
        """A batch whose parts are all reported: its hops into the early send's."""
        hops = granted.hops
        if hops is None:
            return
        if hops >= self._hops:
            self._hops = hops
        else:
            self._hops += HOPS_FALL * (hops - self._hops)

    # ---- a batch out, and its reports back ----------------------------------------------

    async def _send(self, batch: list[CoreRequest], backend: int) -> tuple[bool, bool]:
        batch = self._still_wanted(batch)
        if not batch:
            return True, False
        failures, parts = await self._out(batch, backend)
        if not failures:
            return True, False
        return await self._judge(failures, parts, backend)

    async def _send_group(self, group: list[CoreRequest], backend: int) -> None:
        """A bisection's half: granted alone in ``backend`` (``_bisect`` waits for that;
        raises its error, the worst of its parts', where one failed; its parts that
        succeeded are answered)."""
        failures, _ = await self._out(group, backend)
        if failures:
            raise _worst([err for _, err in failures])

    async def _out(self, batch: list[CoreRequest], backend: int) -> tuple[Failures, int]:
        """Grant ``batch``'s rows to their shells (and relay those that came whole);
        returns the failed parts once every part is reported, and how many parts."""
        whole = [r for r in batch if not r.call.key]
        parts: dict[Route, list[CoreRequest]] = {}
        for r in batch:
            if r.call.key:
                parts.setdefault(r.route, []).append(r)
        failures: Failures = []
        with self._in_triton(backend):
            if parts and whole:
                await asyncio.gather(
                    self._grant_rows(parts, backend, failures),
                    self._relay(whole, backend, failures),
                )
            elif parts:  # (the common case: awaited here, without a task of its own)
                await self._grant_rows(parts, backend, failures)
            else:
                await self._relay(whole, backend, failures)
        return failures, len(parts) + (1 if whole else 0)

    async def _grant_rows(
        self, parts: dict[Route, list[CoreRequest]], backend: int, failures: Failures
    ) -> None:
        batch_id = next(self._ids)
        granted = _Batch(dict(parts), asyncio.get_running_loop().create_future(), self.clock.now())
        self._granted[batch_id] = granted
        # A shell's call to Triton is bounded by the same timeout as the core's own; a
        # report later than that and a margin is not waited for (its calls fail).
        limit = getattr(self.pool.forwarders[backend], "request_timeout_s", None)
        timer = None
        if limit:
            due = self.clock.now() + limit + REPORT_MARGIN_S
            timer = self.clock.call_at(due, lambda: self._overdue(batch_id))
        try:
            for route, reqs in parts.items():
                rows = Rows(
                    self.model,
                    batch_id,
                    backend,
                    [r.call.id for r in reqs],
                    [r.queued_s for r in reqs],
                    [r.quota for r in reqs],
                )
                grant = getattr(route, "grant_rows", None)
                if grant is None:  # a route that cannot take rows: it sent no facts
                    granted.parts.pop(route)
                    for r in reqs:
                        self._fail(r, Internal("a call's facts came by a link without grants"))
                    continue
                grant(rows)
            if granted.parts:
                await granted.done
        finally:
            self._granted.pop(batch_id, None)
            if timer is not None:
                timer.cancel()
        failures.extend(granted.failed)

    def _overdue(self, batch_id: int) -> None:
        """A batch's parts not reported in time: their shells are connected but do not
        answer for them (the batch's slot is not held for ever). They fail here; a
        shell's answer that comes after the core's does not reach its client twice (the
        client has had the core's)."""
        granted = self._granted.get(batch_id)
        if granted is None:
            return
        err = Unavailable("the shell holding this request did not report its call to Triton")
        for reqs in granted.parts.values():
            self._fail_all(reqs, err)
        granted.parts.clear()
        if not granted.done.done():
            granted.done.set_result(None)

    async def _relay(self, whole: list[CoreRequest], backend: int, failures: Failures) -> None:
        """The calls that came whole: sent from here, as batch mode sends them."""
        try:
            packed = pack(whole, self.plan)
            version, outputs = await self._forward(packed, whole, backend)
        except FrontendError as err:
            failures.append((whole, err))
            return
        outs = unpack(outputs, whole, self.plan, packed.stripped)
        for r, out in zip(whole, outs, strict=True):
            self._finish(r, version, out)

    def rows_done(self, route: Route, done: RowsDone) -> None:
        """A shell's report on its part of a batch: the calls it served are done (it
        answered them), those whose client went away are cancelled, a failed part waits
        for the batch's verdict (``_judge``)."""
        granted = self._granted.get(done.batch)
        if granted is None:
            return
        reqs = granted.parts.pop(route, None)
        if reqs is None:
            return
        by_id = {r.call.id: r for r in reqs}
        sent = []
        served = []
        call_span = span_context(done.traceparent) if done.traceparent else None
        for call_id, tokens in done.served:
            r = by_id.pop(call_id, None)
            if r is None:
                continue
            r.batch_trace = call_span
            if done.fault is None:
                if self._served(r, done.version, tokens):
                    served.append(r)
            else:
                sent.append(r)
        if served:
            self._done_served(served, done.version)
        for r in by_id.values():  # gone (or not known to its shell): no answer to give
            if not r.answered:
                self._done(r, Outcome.CANCELLED, None, "")
        if sent and done.fault is not None:
            granted.failed.append((sent, done.fault.error()))
        elif done.exec_s > 0:  # a part its shell timed: grant to report, less its call
            hops = max(0.0, self.clock.now() - granted.granted_at - done.exec_s)
            granted.hops = hops if granted.hops is None else max(granted.hops, hops)
        if not granted.parts:
            self._timed(granted)
            if not granted.done.done():
                granted.done.set_result(None)

    def _served(self, req: CoreRequest, version: str, tokens: int) -> bool:
        """Its shell answered it: its output tokens charged; whether it was served (its
        outcome is then counted with the part's others, ``_done_served``), else its
        outcome here (its client went away) or before (answered already)."""
        if req.answered:
            return False
        if tokens > 0 and self._token_output is not None:
            req.produced += tokens
            self.on_tokens(req, tokens)
        if req.cancelled:
            self._done(req, Outcome.CANCELLED, None, version)
            return False
        return True

    def drop(self, route: Route) -> int:
        """A shell went away: its queued calls leave (batch mode), and its parts of the
        batches out end CANCELLED, so that their batches free their slots once the other
        shells have reported."""
        dropped = super().drop(route)
        for granted in list(self._granted.values()):
            reqs = granted.parts.pop(route, None)
            if reqs is None:
                continue
            for r in reqs:
                if not r.answered:
                    self._done(r, Outcome.CANCELLED, None, "")
            if not granted.parts and not granted.done.done():
                granted.done.set_result(None)
        return dropped

    # ---- a batch that failed ------------------------------------------------------------

    async def _judge(self, failures: Failures, parts: int, backend: int) -> tuple[bool, bool]:
        """The verdict on a batch's failed parts, as batch mode's ``_send`` gives it on a
        failed batch (the module's doc); returns ``_send``'s (succeeded, held)."""
        held: list[CoreRequest] = []
        bisect: list[CoreRequest] = []
        model_error: FrontendError | None = None
        for reqs, err in failures:
            reqs = [r for r in reqs if not r.answered]
            if isinstance(err, DeadlineExceeded):
                self._timed_out(backend)
                self._fail_all(reqs, err)
            elif isinstance(err, Unavailable):
                self.pool.backends[backend].mark_down()
                if err.never_sent and not self.pool.gave_up:
                    held.extend(reqs)
                else:
                    self._fail_all(reqs, err)
            elif isinstance(err, ModelUnavailable):
                self._fail_all(reqs, err)
            else:
                bisect.extend(reqs)
                model_error = model_error or err
        if held:
            # Triton was not reached: the whole rest waits for it (a model error beside
            # it is judged again when it is sent again, whole).
            self._held.append(held + bisect)
            return False, True
        if bisect and model_error is not None:
            if parts > 1:  # its parts met in Triton's batcher: each row is tried alone
                task = asyncio.current_task()
                if task is not None:
                    self._overlapped.add(task)
            return await self._model_error(bisect, model_error, backend)
        return False, False

    def _fail_all(self, reqs: list[CoreRequest], err: FrontendError) -> None:
        for r in reqs:
            self._fail(r, err)


def _worst(errors: list[FrontendError]) -> FrontendError:
    """The error a half is judged by (``BatchDispatcher._bisect``): Triton unreachable
    first (its parts wait or fail), then the model not there (they fail), then the
    model's error (split again)."""
    unreachable = [err for err in errors if isinstance(err, Unavailable)]
    if unreachable:
        # One that may have run first: its half is failed, never sent twice.
        return next((err for err in unreachable if not err.never_sent), unreachable[0])
    return next((err for err in errors if isinstance(err, ModelUnavailable)), errors[0])


DISPATCH_MODES.add("granted", GrantedDispatcher)
