"""Engine mode: one model that batches inside itself gets each request alone.

A model with continuous batching (Triton's vLLM and TensorRT-LLM backends, the shipped
``llm``) is configured with ``max_inflight``: its slots. ``EngineDispatcher`` sends it
each request on its own, on top of what every mode does (``dispatch.Dispatcher``: a
decoupled model's request is granted to its shell, a unary one is sent from here).
Invariants of this mode:

* at most ``max_inflight`` requests are in the engine at once; a slot frees when a
  request ends, so nothing is sent early and nothing waits for a fuller batch;
* with ``reserved_slots``, no one tenant holds more than ``max_inflight -
  reserved_slots`` of them, so another tenant's first request finds one free; the next
  in line at its cap waits (and so does everything behind it: the order is the
  scheduler's) until the order changes, which a stream's charged tokens may do;
* with ``light_slots``, the last that many free slots go only to a request whose
  program (inside its tenant) holds no slot: the fairest such request queued, taken out
  of turn (``Scheduler.next_where``; its tenant is charged as for any other), so a
  chat's call beside agents' fan-outs finds a slot instead of waiting for one to turn
  over (every slot an agent's, each freeing once a generation). While none waits, those
  slots stay free: the rest wait for more to free. The throttle judges each call by the
  slots it may take (``light_place``, ``EngineThrottle``);
* a call past its deadline fails only the request it carried: a generation may be long,
  and gRPC's keepalive, not a deadline, finds a Triton that stopped answering.
"""

from __future__ import annotations

from fair_frontend.core.dispatch import DISPATCH_MODES, CoreRequest, Dispatcher
from fair_frontend.wire.records import Call


class EngineDispatcher(Dispatcher):
    """Feeds one model's requests to its engine, at most ``max_inflight`` (requests) at a
    time."""

    def _start(self) -> None:
        if not self.plan.engine:
            raise ValueError("EngineDispatcher is for engine endpoints (max_inflight)")
        self._capped: str | None = None  # holds its cap while next in line (a slot waits)

    def _may_send(self, now: float) -> int | None:
        """A backend with a free slot (the pool's choice), and (where ``reserved_slots``
        are kept from any one tenant) a next in line below its cap: the slots of the
        reachable backends less the reserved ones."""
        backend = self.pool.choose(self.running, self.max_inflight, self._pinned(now))
        if backend is None:
            return None
        reserved = self.endpoint.reserved_slots
        if not reserved or self._held:
            # A stream granted again (its Triton was gone) kept its slot while held: no
            # tenant's count changes when it goes, whoever is next in line.
            return backend
        head = self.scheduler.peek(now)
        if head is None:
            return None
        # The next in line holds its cap: wait until the order changes (its counter grows
        # as its streams produce: _tokens_charged kicks again meanwhile).
        cap = self.pool.up * self.max_inflight - reserved
        capped = self.in_engine(head.tenant) >= cap
        self._capped = head.tenant if capped else None
        return None if capped else backend

    def _next(self, now: float) -> list[CoreRequest]:
        """The scheduler's next request; with ``light_slots``, where no more than that
        many slots are free (counting the one about to be taken), the fairest request
        whose program holds none (the module's doc), or none. (``kick`` sends the held
        first: none is held when it asks for this.)"""
        light = self.endpoint.light_slots
        if not light or self._free() > light:
            return super()._next(now)
        busy = {(r.tenant, r.program) for batch in self._tasks.values() for r in batch}
        taken = self.scheduler.next_where(now, lambda r: (r.tenant, r.program) not in busy)
        return taken  # type: ignore[return-value]

    def _free(self) -> int:
        """Slots free on the reachable backends."""
        slots = self.max_inflight
        running = self.running
        return sum(slots - running[i] for i, b in enumerate(self.pool.backends) if b.available)

    def _arm_lead(self) -> None:
        """A slot frees when a request ends, whenever that is: no batch time to send ahead
        of."""

    def _tokens_charged(self) -> None:
        capped = self._capped
        if capped is not None and self.scheduler.queued_requests > self.scheduler.depth(capped):
            self.kick()  # the charge may have moved another tenant ahead of it

    def _timed_out(self, backend: int) -> None:
        """A call is one request, as long as its generation: its length says nothing of
        Triton, and only that request fails."""

    def scheduled_tokens(self, call: Call) -> int:
        """Its input only: the output is charged as it streams (``output_cost``)."""
        return call.tokens - call.max_tokens

    def output_cost(self, req: CoreRequest, tokens: int) -> float:
        """Each output token as it streams, weighed against an input token (none was
        charged at dispatch)."""
        return tokens * self.endpoint.output_token_weight

    def light_place(self, tenant: str, program: str) -> int | None:
        """For the throttle (``EngineThrottle``, light slots): None where a new request
        of ``tenant``'s ``program`` may not take a light slot (none are kept, its program
        holds a slot, or has requests queued before it), else the requests that may take
        one before it, itself included: one head of each other tenant queued in its tier
        or a higher one (``Scheduler.light_rivals``), at most. O(tiers), and O(slots)
        where its tenant holds some."""
        if not self.endpoint.light_slots or self.scheduler.program_queued(tenant, program):
            return None
        if self.in_engine(tenant) and any(
            r.tenant == tenant and r.program == program
            for batch in (*self._tasks.values(), *self._held)
            for r in batch
        ):
            return None
        rivals = self.scheduler.light_rivals(tenant)
        return None if rivals is None else rivals + 1

    def in_engine(self, tenant: str) -> int:
        """``tenant``'s requests in Triton (counted as they go and end) or held for it (a
        scan of the held, which are few: batches that never reached a Triton)."""
        held = sum(1 for b in self._held for r in b if r.tenant == tenant) if self._held else 0
        return self._in_tasks.get(tenant, 0) + held


DISPATCH_MODES.add("engine", EngineDispatcher)
