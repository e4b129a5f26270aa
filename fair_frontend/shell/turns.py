"""Who decodes next? A shell's requests take turns per tenant for their expensive part.

Under a burst the transport hands a shell thousands of calls in the order their bytes
arrived; each then costs the transport's own floor (grpc.aio's or aiohttp's per-call
work) and ours: reading and decoding its body, validating it, handing it to the core. In
arrival order a quiet tenant's request waits for all of that, for every call ahead of it.
So a request, once its tenant is known from its headers (cheap), waits for its turn
(``Turns.take``) before the expensive part: the turns are given out round robin, one
request of each tenant waiting at a time, ``TURNS_PER_ITERATION`` per loop iteration, so
a burst one tenant pours into a shell delays another tenant's request by about one
request per tenant with requests waiting (and the iteration the transport itself takes),
not by the whole burst. Only the transport's floor stays in arrival order.

Nothing waits while nobody else does: a request that finds no turn given out in this
loop iteration and no one waiting goes at once.
"""

from __future__ import annotations

import asyncio
from collections import deque

TURNS_PER_ITERATION = 32  # requests let on to their decode before the loop runs again
UNKNOWN = ""  # requests whose tenant only the body tells (a trusted gateway's parameter)


class Turns:
    """Round-robin turns per tenant for the expensive part of a request (the module
    docstring)."""

    def __init__(self) -> None:
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        self._given = 0  # turns given out in this loop iteration
        self._scheduled = False

    async def take(self, tenant: str | None) -> None:
        """Wait for this request's turn (at once if no one waits and few went ahead)."""
        if not self._waiting and self._given < TURNS_PER_ITERATION:
            self._given += 1
            self._schedule()
            return
        loop = asyncio.get_running_loop()
        turn = loop.create_future()
        queue = self._waiting.get(tenant or UNKNOWN)
        if queue is None:
            queue = self._waiting[tenant or UNKNOWN] = deque()
        queue.append(turn)
        self._schedule()
        await turn

    def __len__(self) -> int:
        """Requests waiting for their turn."""
        return sum(len(q) for q in self._waiting.values())

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._give)

    def _give(self) -> None:
        """A new loop iteration: give out up to ``TURNS_PER_ITERATION`` turns, one per
        waiting tenant in turn."""
        self._scheduled = False
        self._given = 0
        waiting = self._waiting
        while waiting and self._given < TURNS_PER_ITERATION:
            for tenant in list(waiting):
                queue = waiting[tenant]
                turn = queue.popleft()
                if not queue:
                    del waiting[tenant]
                if turn.done():  # its caller went away meanwhile
                    continue
                turn.set_result(None)
                self._given += 1
                if self._given >= TURNS_PER_ITERATION:
                    break
        if waiting or self._given:
            self._schedule()  # the next iteration: more turns, or a fresh count
