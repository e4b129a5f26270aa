"""Sequence ids, per tenant: one tenant cannot reach another's stateful sequence.

Triton keys a sequence-batched model's state by the request's ``sequence_id`` (its
correlation id) alone. Passed through unchanged, tenant A could add to, or restart,
tenant B's sequence by sending B's id. So the core maps each (model, tenant, client id)
to the id Triton sees: the client's own while no other open sequence of the model holds
it (a model that reads its correlation id sees what the client sent, as from Triton),
else a random one of the frontend's, of the same type (an integer for an integer id, a
string for a string id: the type the client chose is the type the model's sequence
batcher expects). A tenant can then never reach another's open sequence: its START under
a taken id opens a sequence of its own elsewhere, and its continuation of a sequence it
never opened is refused here. The map is this core's: frontend replicas in front of one
Triton must route a sequence's requests to one replica (one gRPC connection does).

The map follows Triton's own life cycle of a sequence:

* a request with ``sequence_start`` opens an entry (or, for an open one, keeps its id:
  Triton restarts that sequence, as it would for the client's own id);
* a request with ``sequence_end`` closes it; the request itself still goes under it;
* a request without ``sequence_start`` for a sequence not open is answered here with
  Triton's own error for an unknown sequence, naming the client's id: no id of another
  tenant's is ever chosen for it;
* an entry idle for twice the model's ``max_sequence_idle_microseconds`` is dropped
  (Triton has dropped the sequence by then: a request seen here reaches Triton later,
  after its time in the frontend's queue, so the frontend keeps an entry longer);
* a tenant holds at most ``max_per_tenant`` open sequences per model; one more is
  refused (RESOURCE_EXHAUSTED / 429) until one ends or idles out.

Ids 0 and "" (and requests with no ``sequence_id``) are not sequences to Triton, which
refuses them on a sequence-batched model: they are passed on for Triton's own answer.
Time is the caller's ``now`` (the core's clock); the class reads no clock.

A failover keeps the map (``export`` / ``resume``, carried by ``fair_frontend.fleet.debt``
with the fairness state): Triton still holds each open sequence's state under the id this
map chose, so a new leader that forgot it would refuse every continuation, or send it
under the client's id, which may be another tenant's. Each carried entry restarts its idle
time at the resume (the old leader's last use is at most one journal tick older).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from fair_frontend.errors import InvalidArgument, RateLimited
from fair_frontend.protocol import INT64_MAX, ParamValue

DEFAULT_MAX_SEQUENCES_PER_TENANT = 1024
# Entries are kept this many times the model's idle timeout (see the module docstring).
IDLE_MARGIN = 2.0

SequenceId = int | str


class OpenSequence(msgspec.Struct, array_like=True, frozen=True):
    """One open sequence as a new leader takes it over (``SequenceIds.export``)."""

    tenant: str
    client_id: int | str  # the id the tenant sends
    assigned: int | str  # the id Triton holds its state under
    backend: int = -1  # the Triton of a pool that holds that state (-1: none pinned yet)


@dataclass(slots=True)
class _Open:
    """One open sequence: the id Triton knows it by, and when it was last used."""

    tenant: str
    assigned: SequenceId
    last_used: float


class _ModelSequences:
    """One model's open sequences, least recently used first (the order they expire in:
    one idle timeout per model)."""

    __slots__ = ("assigned", "open", "per_tenant")

    def __init__(self) -> None:
        self.open: OrderedDict[tuple[str, SequenceId], _Open] = OrderedDict()
        self.per_tenant: dict[str, int] = {}
        self.assigned: set[SequenceId] = set()

    def expire(self, before: float) -> None:
        """Drop the entries last used before ``before``."""
        while self.open:
            key, entry = next(iter(self.open.items()))
            if entry.last_used >= before:
                return
            self.close(key)

    def close(self, key: tuple[str, SequenceId]) -> None:
        entry = self.open.pop(key)
        self.assigned.discard(entry.assigned)
        left = self.per_tenant[entry.tenant] - 1
        if left:
            self.per_tenant[entry.tenant] = left
        else:
            del self.per_tenant[entry.tenant]


class SequenceIds:
    """Which Triton sequence id does this tenant's sequence id name? (module docstring)"""

    def __init__(self, max_per_tenant: int = DEFAULT_MAX_SEQUENCES_PER_TENANT) -> None:
        self.max_per_tenant = max_per_tenant
        self._models: dict[str, _ModelSequences] = {}

    def open_sequences(self, model: str, tenant: str | None = None) -> int:
        """Open sequences of ``model`` (of one ``tenant``, if given)."""
        seqs = self._models.get(model)
        if seqs is None:
            return 0
        return len(seqs.open) if tenant is None else seqs.per_tenant.get(tenant, 0)

    def export(self) -> dict[str, list[OpenSequence]]:
        """Every open sequence, per model, least recently used first."""
        return {
            model: [OpenSequence(e.tenant, key[1], e.assigned) for key, e in seqs.open.items()]
            for model, seqs in self._models.items()
            if seqs.open
        }

    def resume(self, saved: Mapping[str, list[OpenSequence]], now: float) -> None:
        """Take over a failed leader's ``export``, each entry as if used ``now``. One this
        core opened meanwhile (the same tenant's id, or Triton's id taken) stays its own."""
        for model, entries in saved.items():
            seqs = self._models.setdefault(model, _ModelSequences())
            for s in entries:
                key = (s.tenant, s.client_id)
                if key in seqs.open or s.assigned in seqs.assigned:
                    continue
                seqs.open[key] = _Open(s.tenant, s.assigned, now)
                seqs.assigned.add(s.assigned)
                seqs.per_tenant[s.tenant] = seqs.per_tenant.get(s.tenant, 0) + 1

    def assign(
        self,
        model: str,
        tenant: str,
        sequence: Mapping[str, ParamValue],
        *,
        idle_s: float,
        now: float,
    ) -> dict[str, ParamValue]:
        """``sequence`` (a request's sequence_id / _start / _end) as it goes to Triton:
        under the frontend's id for this tenant's sequence. Raises ``InvalidArgument``
        for a continuation of a sequence that is not open, ``RateLimited`` for one
        sequence more than the tenant may hold."""
        client_id = sequence.get("sequence_id")
        if isinstance(client_id, bool) or not isinstance(client_id, (int, str)) or not client_id:
            return dict(sequence)  # not a sequence to Triton: its own error follows
        keep_s = IDLE_MARGIN * idle_s
        seqs = self._models.setdefault(model, _ModelSequences())
        seqs.expire(now - keep_s)
        key = (tenant, client_id)
        entry = seqs.open.get(key)
        if entry is None:
            if not sequence.get("sequence_start", False):
                raise InvalidArgument(
                    f"inference request for sequence {client_id} to model '{model}' must "
                    "specify the START flag on the first request of the sequence"
                )
            entry = self._open(seqs, model, key, keep_s, now)
        entry.last_used = now
        seqs.open.move_to_end(key)
        assigned = entry.assigned
        if sequence.get("sequence_end", False):
            seqs.close(key)
        return {**sequence, "sequence_id": assigned}

    def _open(
        self,
        seqs: _ModelSequences,
        model: str,
        key: tuple[str, SequenceId],
        keep_s: float,
        now: float,
    ) -> _Open:
        tenant, client_id = key
        if seqs.per_tenant.get(tenant, 0) >= self.max_per_tenant:
            raise RateLimited(
                f"tenant '{tenant}' has {self.max_per_tenant} open sequences on model "
                f"'{model}', the most it may hold: end one (sequence_end) or let one idle "
                f"out ({keep_s:g} s unused)",
                retry_after=keep_s,
            )
        # The client's own id while no other open sequence holds it (a model that reads
        # its correlation id, as Triton's dyna-sequence examples do, sees what it was
        # sent); another tenant's sequence under the same id gets a fresh one.
        assigned = (
            client_id if client_id not in seqs.assigned else _fresh_id(client_id, seqs.assigned)
        )
        entry = _Open(tenant, assigned, now)
        seqs.open[key] = entry
        seqs.assigned.add(assigned)
        seqs.per_tenant[tenant] = seqs.per_tenant.get(tenant, 0) + 1
        return entry


def _fresh_id(like: SequenceId, taken: set[SequenceId]) -> SequenceId:
    """A random id of the type of ``like``, none of ``taken``: an integer in
    [1, 2**63 - 1] (it travels as gRPC int64_param), or a string."""
    while True:
        fresh: SequenceId
        if isinstance(like, int):
            fresh = 1 + secrets.randbelow(INT64_MAX)
        else:
            fresh = f"fair-{secrets.token_hex(16)}"
        if fresh not in taken:
            return fresh


class Pins:
    """A stateful model's open sequences in a pool of more than one Triton: the backend
    that holds each one's state, by Triton's sequence id, least recently used first. A
    sequence stays on its backend until its end, or twice the model's idle timeout unused
    (Triton has dropped it by then)."""

    def __init__(self, idle_s: float, backends: int) -> None:
        self.keep_s = IDLE_MARGIN * idle_s
        self.backends = backends
        self._pins: OrderedDict[ParamValue, tuple[int, float]] = OrderedDict()

    def backend_of(self, sequence_id: ParamValue | None) -> int | None:
        """The backend that holds this sequence's state, if one does."""
        pin = self._pins.get(sequence_id) if sequence_id is not None else None
        return None if pin is None else pin[0]

    def pin(self, sequences: list[tuple[ParamValue, bool]], backend: int, now: float) -> None:
        """A batch went to ``backend`` with these sequences (Triton's id, whether the
        request ends it): each goes on there, or is forgotten at its end."""
        pins = self._pins
        while pins:
            key, (_, used) = next(iter(pins.items()))
            if used >= now - self.keep_s:
                break
            del pins[key]
        for sequence_id, end in sequences:
            if end:
                pins.pop(sequence_id, None)
            else:
                pins[sequence_id] = (backend, now)
                pins.move_to_end(sequence_id)

    def export(self) -> dict[ParamValue, int]:
        """Each pinned sequence's backend (Triton's sequence id -> its index in the pool),
        for a new leader (``fair_frontend.core.carried``)."""
        return {key: b for key, (b, _) in self._pins.items()}

    def resume(self, pins: Mapping[ParamValue, int], now: float) -> None:
        """Take over a failed leader's ``export``, each as if used ``now``; a sequence
        this core pinned meanwhile keeps its own."""
        for key, backend in pins.items():
            if key not in self._pins and 0 <= backend < self.backends:
                self._pins[key] = (backend, now)
