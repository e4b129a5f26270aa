"""Cores that own disjoint sets of endpoints, and a shell that routes to them by model.

Fairness is per endpoint (each has its own queues, counters and slots), so where one core
is not enough each core (with its own standbys, on a lease of its own: ``--lease-name``)
schedules a set of endpoints, and a shell sends each call to the core of its model:
``fair-frontend shell --core embed,rerank=core-a:8010 --core core-b:8010`` sends ``embed``
and ``rerank`` to ``core-a`` and every other model to ``core-b`` (the set without models
is the default; without one, a model no set names is answered UNAVAILABLE).

``RouterLink`` is the shell's ``CoreLink`` over one ``RemoteLink`` per set: every call,
lookup, tally and queue view is per model already, so each goes to its set's link. The
config and keys come from the default set's core (the first set where none is named
default); the others' are the same file, deployed alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from tritonclient.grpc import service_pb2

from fair_frontend.errors import Overloaded, Unavailable
from fair_frontend.models import ModelInfo
from fair_frontend.shell.link import Inbox
from fair_frontend.shell.remote import RemoteLink
from fair_frontend.shell.socket_link import RowsTaker
from fair_frontend.wire.records import (
    Answer,
    Call,
    Fault,
    Hello,
    Ready,
    RowsDone,
    Settings,
    TallyEntry,
)
from fair_frontend.wire.remote import Tls


def parse_core_sets(specs: Sequence[str]) -> list[tuple[frozenset[str] | None, list[str]]]:
    """``--core`` values: ``HOST:PORT`` (the default set) or ``MODEL[,MODEL...]=HOST:PORT``;
    the addresses of one set (its leader and standbys) grouped, in the order given."""
    sets: dict[frozenset[str] | None, list[str]] = {}
    for spec in specs:
        models: frozenset[str] | None = None
        address = spec
        if "=" in spec:
            names, address = spec.split("=", 1)
            models = frozenset(m.strip() for m in names.split(",") if m.strip())
            if not models:
                raise ValueError(f"--core {spec}: no model before '='")
        if not address:
            raise ValueError(f"--core {spec}: no HOST:PORT")
        sets.setdefault(models, []).append(address)
    named = [m for m in sets if m is not None]
    for a, b in itertools.combinations(named, 2):
        if a & b:
            raise ValueError(f"--core: {', '.join(sorted(a & b))} named for two sets of cores")
    return list(sets.items())


def encode_core_sets(sets: list[tuple[frozenset[str] | None, list[str]]]) -> str:
    """For a shell process's ``--cores``: sets split by ``;``, a set's models before
    ``=``, its addresses by ``,``."""
    return ";".join(
        (",".join(sorted(models)) + "=" if models else "") + ",".join(addresses)
        for models, addresses in sets
    )


def decode_core_sets(text: str) -> list[tuple[frozenset[str] | None, list[str]]]:
    out: list[tuple[frozenset[str] | None, list[str]]] = []
    for part in text.split(";"):
        models: frozenset[str] | None = None
        if "=" in part:
            names, part = part.split("=", 1)
            models = frozenset(names.split(","))
        out.append((models, part.split(",")))
    return out


class RouterLink:
    """A shell's link to several sets of cores, each call to its model's (module doc)."""

    def __init__(
        self,
        sets: list[tuple[frozenset[str] | None, list[str]]],
        secret: bytes,
        hello: Hello,
        on_settings: Callable[[Settings], None],
        on_stop: Callable[[], None],
        on_lost: Callable[[], None],
        tls: Tls | None = None,
        link: str = "grpc",
    ) -> None:
        primary = next((i for i, (models, _) in enumerate(sets) if models is None), 0)
        self.links: list[tuple[frozenset[str] | None, RemoteLink]] = []
        for i, (models, addresses) in enumerate(sets):
            settings = on_settings if i == primary else _ignore
            remote = RemoteLink(
                addresses, secret, hello, settings, on_stop, on_lost, tls=tls, link=link
            )
            self.links.append((models, remote))
        self._by_model: dict[str, RemoteLink] = {
            model: link for models, link in self.links if models for model in models
        }
        self._default = next((link for models, link in self.links if models is None), None)
        self._ids = itertools.count(1)

    def link_for(self, model: str) -> RemoteLink | None:
        return self._by_model.get(model, self._default)

    # granted rows (``records.Rows``): each set's core grants its own models' rows

    takes_rows = True

    @property
    def on_rows(self) -> RowsTaker | None:
        return self.links[0][1].on_rows

    @on_rows.setter
    def on_rows(self, value: RowsTaker | None) -> None:
        for _, link in self.links:
            link.on_rows = value

    def rows_done(self, done: RowsDone) -> None:
        link = self.link_for(done.model)
        if link is not None:
            link.rows_done(done)

    # what ShellProcess sets and reads of a remote link

    async def find_core(self) -> None:
        for _, link in self.links:
            await link.find_core()

    @property
    def hold_s(self) -> float:
        return self.links[0][1].hold_s

    @hold_s.setter
    def hold_s(self, value: float) -> None:
        for _, link in self.links:
            link.hold_s = value

    @property
    def ready(self) -> Ready | None:
        return self.links[0][1].ready

    @ready.setter
    def ready(self, value: Ready | None) -> None:
        for _, link in self.links:
            link.ready = value

    @property
    def pending(self) -> int:
        return sum(link.pending for _, link in self.links)

    def send(self, record: Any) -> None:
        for _, link in self.links:
            link.send(record)

    async def aclose(self) -> None:
        for _, link in self.links:
            await link.aclose()

    # CoreLink

    def new_id(self) -> int:
        return next(self._ids)

    def submit(self, call: Call) -> Inbox:
        link = self.link_for(call.request.model)
        if link is None:
            inbox = Inbox()
            inbox.answer(Answer(call.id, fault=Fault.of(Unavailable(_no_core(call.request.model)))))
            return inbox
        return link.submit(call)

    def submit_group(self, calls: list[Call]) -> list[Inbox]:
        link = self.link_for(calls[0].request.model)
        if link is None:
            return [self.submit(call) for call in calls]
        return link.submit_group(calls)

    async def precharge(self, tenant: str, model: str, requests: int, tokens: int) -> float | None:
        link = self.link_for(model)
        if link is None:
            raise Unavailable(_no_core(model))
        return await link.precharge(tenant, model, requests, tokens)

    async def model_info(self, model: str) -> ModelInfo:
        link = self.link_for(model)
        if link is None:
            raise Unavailable(_no_core(model))
        return await link.model_info(model)

    async def statistics(self, model: str, version: str) -> Any:
        if model:
            link = self.link_for(model)
            if link is None:
                raise Unavailable(_no_core(model))
            return await link.statistics(model, version)
        merged = service_pb2.ModelStatisticsResponse()  # every model: each set's own
        for _, link in self.links:
            merged.model_stats.extend((await link.statistics(model, version)).model_stats)
        return merged

    def tally(self, entry: TallyEntry) -> None:
        (self.link_for(entry.model) or self.links[0][1]).tally(entry)

    def flush_tally(self) -> None:
        for _, link in self.links:
            link.flush_tally()

    def queue_full(self, tenant: str, model: str, nbytes: int = 0) -> str | None:
        link = self.link_for(model)
        return link.queue_full(tenant, model, nbytes) if link is not None else None

    def overloaded(self, tier: str, model: str) -> Overloaded | None:
        link = self.link_for(model)
        return link.overloaded(tier, model) if link is not None else None

    @property
    def accepting(self) -> bool:
        return all(link.accepting for _, link in self.links)

    @accepting.setter
    def accepting(self, value: bool) -> None:
        for _, link in self.links:
            link.accepting = value


def _ignore(settings: Settings) -> None:
    pass


def _no_core(model: str) -> str:
    return f"no core serves model '{model}' (this shell's --core names no set for it)"
