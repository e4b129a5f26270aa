"""How a shell reaches the core: ``CoreLink``, and the in-process one.

A shell sends each request to the core as a ``Call`` and reads its answers from an
``Inbox``: one final ``Answer``, after any parts a decoupled model streams. The core
answers through the inbox (it is the call's ``Route``). ``LocalLink`` is the link of a
shell in the core's own process (``--workers 1``): records pass as objects, answers
are put straight into the inbox. ``fair_frontend.ipc.SocketLink`` is the link of a shell
process: the same records, framed over a Unix socket.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from fair_frontend.models import ModelInfo
from fair_frontend.records import Answer, Call, Tally, TallyEntry

if TYPE_CHECKING:
    from fair_frontend.core import Core, CoreRequest


class Inbox:
    """The answers to one call, in order; the core's ``Route`` for it.

    ``get`` returns them one at a time; the last one has ``final`` set. ``cancel`` tells
    the core the client went away (a call not yet finally answered is dropped there).
    Bounded: the core sends at most ``records.ANSWER_WINDOW`` parts its client has not
    taken, and ``get`` tells it each one taken (through the link), so an inbox holds at
    most that many parts and the final answer, however slowly its client reads.
    """

    __slots__ = ("_answers", "_cancel", "_read", "_waiter", "done")

    def __init__(self) -> None:
        self._answers: deque[Answer] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._cancel: Any = None  # set by the link: how to cancel the call in the core
        self._read: Any = None  # set by the link: how to tell the core a part was taken
        self.done = False  # the final answer has been read

    def answer(self, answer: Answer) -> None:
        self._answers.append(answer)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Answer:
        while not self._answers:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        answer = self._answers.popleft()
        if answer.final:
            self.done = True
        elif self._read is not None:
            self._read()
        return answer

    def __len__(self) -> int:
        """Answers waiting to be read."""
        return len(self._answers)

    def cancel(self) -> None:
        if not self.done and self._cancel is not None:
            self.done = True
            self._cancel()


class CoreLink(Protocol):
    """How does this shell reach the core?"""

    def new_id(self) -> int:
        """A number for a new call, unique on this link."""
        ...

    def submit(self, call: Call) -> Inbox:
        """Hand a call to the core; its answers arrive in the returned inbox."""
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

    @property
    def accepting(self) -> bool:
        """False once the core drains for shutdown (readiness turns false)."""
        ...


class LocalLink:
    """The link of a shell in the core's process: records pass as objects."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._ids = itertools.count(1)

    def new_id(self) -> int:
        return next(self._ids)

    def submit(self, call: Call) -> Inbox:
        inbox = Inbox()
        req = self.core.submit(call, inbox)
        if req is not None:
            inbox._cancel = _Canceller(self.core, req)
            inbox._read = _Reader(self.core, req)
        return inbox

    async def model_info(self, model: str) -> ModelInfo:
        return await self.core.model_info(model)

    async def statistics(self, model: str, version: str) -> Any:
        return await self.core.statistics(model, version)

    def tally(self, entry: TallyEntry) -> None:
        self.core.tally(Tally([entry]))

    def queue_full(self, tenant: str, model: str, nbytes: int = 0) -> str | None:
        return self.core.queue_full(tenant, model, nbytes)

    @property
    def accepting(self) -> bool:
        return self.core.accepting


class _Canceller:
    __slots__ = ("core", "req")

    def __init__(self, core: Core, req: CoreRequest) -> None:
        self.core = core
        self.req = req

    def __call__(self) -> None:
        self.core.cancel(self.req)


class _Reader:
    """Tells the core that the client took a part of its streamed answer (at once)."""

    __slots__ = ("core", "req")

    def __init__(self, core: Core, req: CoreRequest) -> None:
        self.core = core
        self.req = req

    def __call__(self) -> None:
        self.core.parts_read(self.req, 1)
