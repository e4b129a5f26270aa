"""How a shell reaches the core: ``CoreLink``, and the in-process one.

A shell sends each request to the core as a ``Call`` and reads its answer from an
``Inbox``: one ``Answer``, or for a decoupled model's request a ``Grant`` (its slot), after
which the shell relays the stream itself and reports on it through the same inbox
(``produced``, ``end``). The core answers through the inbox (it is the call's ``Route``).
``LocalLink`` is the link of a shell in the core's own process (``--workers 1``): records
pass as objects, answers are put straight into the inbox. ``socket_link.SocketLink`` is
the link of a shell process: the same records, framed over a Unix socket.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from fair_frontend.errors import FrontendError, Overloaded, Unavailable
from fair_frontend.models import ModelInfo
from fair_frontend.wire.records import (
    PRODUCED_TICK_S,
    Answer,
    Call,
    Grant,
    Group,
    Tally,
    TallyEntry,
    bin_gaps,
    gaps_of,
)


class Inbox:
    """The answer to one call; the core's ``Route`` for it.

    ``get`` returns it: an ``Answer``, or a ``Grant``. After a grant the shell relays the
    stream, tells the core what it produced (``produced``) and, once, how it ended
    (``end``); an ``Answer`` arriving after the grant is the core taking the slot back
    (``on_revoke`` hears of it). A stream whose Triton was gone before anything of it
    reached the client is not ended but given back (``again``): the core grants it once
    more (another Triton) or answers it, and ``get`` waits for that as for the first
    answer. ``cancel`` tells the core the client went away before the call was answered
    (a call not yet answered is dropped there).
    """

    __slots__ = (
        "_answer", "_cancel", "_end", "_produced", "_waiter", "done", "granted", "granted_at",
        "held", "on_answer", "on_end", "on_revoke", "served", "tokens",
    )  # fmt: skip

    def __init__(self) -> None:
        self._answer: Answer | Grant | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._cancel: Any = None  # set by the link: how to cancel the call in the core
        self._produced: Produce = _no_tokens  # set by the link: how to report tokens
        self._end: Callable[[str, FrontendError | None, bool], None] = _never
        self.on_revoke: Callable[[FrontendError], None] = _nothing
        # Told of the answer as it comes (the parts of one call wait on them together).
        self.on_answer: Callable[[Answer | Grant], None] | None = None
        self.done = False  # answered and read, or ended
        self.granted = False
        # A call whose tensors its shell kept (granted mode): what it needs to send the
        # rows the core grants (set by the gateway; ``RowsSender.send``).
        self.held: Any = None
        # Where its shell sent it to Triton itself (granted mode): the part's seconds in
        # Triton and the call's output tokens, for its request-log line.
        self.served: tuple[float, int] | None = None
        # A granted stream: when its grant was read (``time.monotonic()``), the output
        # tokens relayed (``produced``), and who hears of its end once it is told to the
        # core (its shell's request-log line: ``Gateway._stream_logged``).
        self.granted_at = 0.0
        self.tokens = 0
        self.on_end: Callable[[str, FrontendError | None, bool], None] | None = None

    def answer(self, answer: Answer | Grant) -> None:
        if self.granted:  # the core takes the slot back
            if isinstance(answer, Answer) and answer.fault is not None:
                self.on_revoke(answer.fault.error())
            return
        self._answer = answer
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.on_answer is not None:
            self.on_answer(answer)

    @property
    def answered(self) -> Answer | Grant | None:
        """The answer, once it has come (``get`` returns it at once then)."""
        return self._answer

    async def get(self) -> Answer | Grant:
        while self._answer is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        answer = self._answer
        if isinstance(answer, Grant):
            self.granted = True
            self.granted_at = time.monotonic()
        else:
            self.done = True
        return answer

    def produced(self, tokens: int, first_token_s: float, gap_s: float) -> None:
        """The granted stream relayed ``tokens`` output tokens in one response, its first
        ``first_token_s`` after the call arrived (-1: not its first), ``gap_s`` after the
        response before (-1: none before), which its tokens share: ``per_token``."""
        self.tokens += tokens
        self._produced(tokens, first_token_s, gap_s)

    def end(
        self, version: str = "", fault: FrontendError | None = None, cancelled: bool = False
    ) -> None:
        """The granted stream ended (once; later calls are no-ops, as is one after
        ``again``): served (no ``fault``), failed with ``fault``, or ``cancelled`` (its
        client went away)."""
        if self.done or not self.granted:
            return
        self.done = True
        if gone_before_answered(fault):  # ended here: the core must not grant it again
            assert fault is not None
            fault = Unavailable(fault.message, retry_after=fault.retry_after)
        self._end(version, fault, cancelled)
        if self.on_end is not None:
            self.on_end(version, fault, cancelled)

    def again(self, fault: FrontendError) -> None:
        """The granted stream's Triton is gone, and nothing of the stream reached its
        client (``gone_before_answered``): the core hears of it as never sent, holds the
        call for another grant or answers it, and this inbox waits for that (``get``)."""
        if self.done or not self.granted:
            return
        self.granted = False
        self._answer = None
        self.on_revoke = _nothing
        self._end("", Unavailable(fault.message, never_sent=True), False)

    def cancel(self) -> None:
        """The client went away: a call not answered is cancelled in the core; a granted
        one ends, cancelled."""
        if self.done:
            return
        if self.granted:
            self.end(cancelled=True)
        elif self._cancel is not None:
            self.done = True
            self._cancel()


def gone_before_answered(fault: FrontendError | None) -> bool:
    """Does a stream's end with ``fault`` give its call back to the core (``Inbox.again``:
    its Triton was gone before anything reached its client) rather than end it?"""
    return isinstance(fault, Unavailable) and fault.never_sent


Produce = Callable[[int, float, float], None]
"""(tokens, first_token_s, gap_s): ``Inbox.produced``."""


def _nothing(value: Any) -> None:
    pass


class TickTokens:
    """Output tokens of granted streams not yet told to the core, as one tick's report
    carries them (``records.Produced``; ``PRODUCED_TICK_S``): per stream, [who (its call
    id on a shell process's link, the core's request in the core's process), tokens, its
    first token's time (-1: not among them)]; per (tenant, model), the inter-token times
    of them all, [their sum, their bins] (``bin_gaps``: no time per token is kept)."""

    __slots__ = ("gaps", "streams")

    def __init__(self) -> None:
        self.streams: dict[int, list[Any]] = {}
        self.gaps: dict[tuple[str, str], list[Any]] = {}

    def __bool__(self) -> bool:
        return bool(self.streams or self.gaps)

    def add(
        self,
        key: int,
        who: Any,
        kind: tuple[str, str],
        tokens: int,
        first_s: float,
        gap_s: float,
    ) -> None:
        """``tokens`` a stream (``key``: a number for it, ``who``: what its report names;
        ``kind``: its tenant and model) relayed in one response (``Inbox.produced``)."""
        entry = self.streams.get(key)
        if entry is None:
            entry = self.streams[key] = [who, 0, -1.0]
        entry[1] += tokens
        if first_s >= 0:
            entry[2] = first_s
        if gap_s >= 0 and tokens > 0:
            gaps = self.gaps.get(kind)
            if gaps is None:
                gaps = self.gaps[kind] = [0.0, {}]
            gaps[0] += bin_gaps(gaps[1], tokens, gap_s)

    def take(
        self,
    ) -> tuple[list[tuple[Any, int, float]], list[tuple[str, str, float, list[int]]]]:
        """The tick's reports (who, tokens, first token's time) and inter-token times
        (tenant, model, their sum, their bins as a record carries them); none kept."""
        streams, self.streams = self.streams, {}
        gaps, self.gaps = self.gaps, {}
        return (
            [(who, tokens, first) for who, tokens, first in streams.values()],
            [(t, m, *gaps_of(total, bins)) for (t, m), (total, bins) in gaps.items()],
        )


def _no_tokens(tokens: int, first_token_s: float, gap_s: float) -> None:
    pass


def _never(version: str, fault: FrontendError | None, cancelled: bool) -> None:
    raise AssertionError("a stream ended that was never granted")


class CoreLink(Protocol):
    """How does this shell reach the core?"""

    def new_id(self) -> int:
        """A number for a new call, unique on this link."""
        ...

    def submit(self, call: Call) -> Inbox:
        """Hand a call to the core; its answers arrive in the returned inbox."""
        ...

    def submit_group(self, calls: list[Call]) -> list[Inbox]:
        """Hand the parts of one API call to the core, to be admitted or refused whole
        (``records.Group``); each part's answers arrive in its inbox (in order)."""
        ...

    async def precharge(self, tenant: str, model: str, requests: int, tokens: int) -> float | None:
        """Count ``requests`` and ``tokens`` against the tenant's limits on ``model`` now
        (``records.Precharge``): the wall time they were counted at (None: not counted);
        raises the core's refusal (429)."""
        ...

    async def model_info(self, model: str) -> ModelInfo:
        """What is this model? (the core's answer, raising Triton's error if unknown)"""
        ...

    async def statistics(self, model: str, version: str) -> Any:
        """Triton's ``ModelStatisticsResponse`` for what went through the frontend."""
        ...

    def tally(self, entry: TallyEntry) -> None:
        """Count a request this shell answered itself (in the core's metrics)."""
        ...

    def queue_full(self, tenant: str, model: str, nbytes: int = 0) -> str | None:
        """The queue cap a new request with ``nbytes`` tensor bytes would hit now, as far
        as this shell knows (then it is shed here: the core would refuse it); ``nbytes``
        0 before its size is known (the count caps alone)."""
        ...

    def overloaded(self, tier: str, model: str) -> Overloaded | None:
        """The core's refusal (503, Retry-After) for any request of a tenant of ``tier``
        for ``model``, if its throttle closed the tier there at its last look
        (``Shedding.refresh``, every ``QUEUE_VIEW_INTERVAL_S``): even the most
        favourable request of the tier would be refused. A dict lookup."""
        ...

    @property
    def accepting(self) -> bool:
        """False once the core drains for shutdown (readiness turns false)."""
        ...


class InProcessCore(Protocol):
    """What a shell in the core's process calls of it (``fair_frontend.core.Core``).
    ``submit`` returns the core's handle for a call it keeps (None: answered at once),
    which the other calls about that call take."""

    accepting: bool

    def submit(self, call: Call, route: Inbox, *, judged: bool = False) -> Any: ...

    def submit_group(self, group: Group, route: Any) -> list[Any] | None: ...

    async def precharge(
        self, tenant: str, model: str, *, requests: int, tokens: int
    ) -> tuple[float | None, Any]: ...

    def cancel(self, req: Any) -> None: ...

    def produced_all(
        self,
        reports: list[tuple[Any, int, float]],
        gaps: list[tuple[str, str, float, list[int]]],
    ) -> None: ...

    def stream_ended(
        self, req: Any, version: str, err: FrontendError | None, cancelled: bool
    ) -> None: ...

    async def model_info(self, model: str) -> ModelInfo: ...

    async def statistics(self, model: str, version: str) -> Any: ...

    def tally(self, tally: Tally) -> None: ...

    @property
    def shedding(self) -> Shedding: ...


class Shedding(Protocol):
    """The core's queue caps and closed tiers (``fair_frontend.core.shedding``)."""

    def queue_full(self, tenant: str, model: str, nbytes: int = 0) -> str | None: ...

    def overloaded(self, tier: str, model: str) -> Overloaded | None: ...


class Intake(Protocol):
    """The core's intake (``fair_frontend.core.shells.Intake``): calls are admitted in
    turns per tenant, each by ``conn.admit(call)``, as a shell process's are."""

    def push(self, call: Call | Group, conn: Any) -> None: ...


class _Parts:
    """The route of a group's parts in the core's process: each answer to its inbox."""

    __slots__ = ("inboxes",)

    def __init__(self, inboxes: dict[int, Inbox]) -> None:
        self.inboxes = inboxes

    def answer(self, answer: Answer | Grant) -> None:
        inbox = self.inboxes.get(answer.id)
        if inbox is not None:
            inbox.answer(answer)


class LocalLink:
    """The link of a shell in the core's process: records pass as objects. Calls reach
    the core through the same intake as a shell process's (both link modes admit in the
    same order)."""

    def __init__(self, core: InProcessCore, intake: Intake) -> None:
        self.core = core
        self.intake = intake
        self._ids = itertools.count(1)
        self._waiting: dict[int, Inbox] = {}  # calls in the intake, not admitted yet
        # Output tokens of granted streams not yet told to the core, as a shell process
        # keeps them (``SocketLink``): told within ``PRODUCED_TICK_S``, every stream's at
        # once (``Core.produced_all``: one charge per tenant and program a tick, not one
        # per response).
        self._pending = TickTokens()
        self._tick: asyncio.TimerHandle | None = None

    def new_id(self) -> int:
        return next(self._ids)

    def submit(self, call: Call) -> Inbox:
        inbox = Inbox()
        call_id = call.id
        self._waiting[call_id] = inbox
        inbox._cancel = lambda: self._waiting.pop(call_id, None)  # gone before admitted
        self.intake.push(call, self)
        return inbox

    def submit_group(self, calls: list[Call]) -> list[Inbox]:
        inboxes = []
        for call in calls:
            inbox = Inbox()
            call_id = call.id
            self._waiting[call_id] = inbox
            inbox._cancel = partial(self._waiting.pop, call_id, None)  # gone before admitted
            inboxes.append(inbox)
        self.intake.push(Group(calls), self)
        return inboxes

    def admit(self, call: Call | Group, *, judged: bool = False) -> None:
        """The intake's turn for this call (or the parts of one): into the core (those
        whose client has not gone). ``judged``: the throttle admitted it already
        (``Core.judge_together``)."""
        if isinstance(call, Group):
            self._admit_group(call)
            return
        inbox = self._waiting.pop(call.id, None)
        if inbox is None:
            return
        inbox._cancel = None
        req = self.core.submit(call, inbox, judged=judged)
        if req is not None:
            self._wire(inbox, req)

    def _admit_group(self, group: Group) -> None:
        inboxes: dict[int, Inbox] = {}
        live = []
        for call in group.calls:
            inbox = self._waiting.pop(call.id, None)
            if inbox is not None:
                inbox._cancel = None
                inboxes[call.id] = inbox
                live.append(call)
        if not live:
            return
        reqs = self.core.submit_group(Group(live), _Parts(inboxes))
        if reqs is not None:
            for call, req in zip(live, reqs, strict=True):
                self._wire(inboxes[call.id], req)

    def _wire(self, inbox: Inbox, req: Any) -> None:
        """Tell ``inbox`` how to reach the core about its call, kept there as ``req``."""
        core = self.core
        inbox._cancel = lambda: core.cancel(req)
        inbox._produced = partial(self._tokens, req)
        inbox._end = partial(self._ended, req)

    def _tokens(self, req: Any, tokens: int, first_s: float, gap_s: float) -> None:
        """Output tokens the granted stream of ``req`` relayed: told to the core by the
        tick's end (``_told``), with every other stream's."""
        if self._tick is None:
            self._tick = asyncio.get_running_loop().call_later(PRODUCED_TICK_S, self._told)
        self._pending.add(
            id(req), req, (req.tenant, req.call.request.model), tokens, first_s, gap_s
        )

    def _told(self) -> None:
        """The tick's tokens, to the core at once."""
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        reports, times = self._pending.take()
        if reports or times:
            self.core.produced_all(reports, times)

    def _ended(self, req: Any, version: str, fault: FrontendError | None, cancelled: bool) -> None:
        """A granted stream ended: the tokens not yet told go first (every stream's:
        the core's counts hold all a stream relayed once it has ended)."""
        if self._pending:
            self._told()
        self.core.stream_ended(req, version, fault, cancelled)

    async def precharge(self, tenant: str, model: str, requests: int, tokens: int) -> float | None:
        at, _ = await self.core.precharge(tenant, model, requests=requests, tokens=tokens)
        return at

    async def model_info(self, model: str) -> ModelInfo:
        return await self.core.model_info(model)

    async def statistics(self, model: str, version: str) -> Any:
        return await self.core.statistics(model, version)

    def tally(self, entry: TallyEntry) -> None:
        self.core.tally(Tally([entry]))

    def queue_full(self, tenant: str, model: str, nbytes: int = 0) -> str | None:
        return self.core.shedding.queue_full(tenant, model, nbytes)

    def overloaded(self, tier: str, model: str) -> Overloaded | None:
        return self.core.shedding.overloaded(tier, model)

    @property
    def accepting(self) -> bool:
        return self.core.accepting
