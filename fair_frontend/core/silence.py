"""Granted streams whose shell has gone silent: their slots taken back.

A decoupled model's slot is held from its grant until its shell says the stream ended
(``Dispatcher.ended``), or the shell's link closes (``Dispatcher.drop``). A shell that is
connected but has lost a stream (its relay never started, or never finished) would hold
that slot for ever, and an engine whose every slot is held so serves no one again. A
shell reports a live stream's tokens every tick, and its own watchdog ends a stream that
Triton has given nothing for ``triton.request_timeout_s`` or whose client has read
nothing for ``queues.stalled_stream_s``; so a granted stream of which its core has heard
nothing (no token, no end) for both and ``SILENT_MARGIN_S`` more (``Core`` gives the sum
to each dispatcher: ``silent_after_s``) is lost. ``SilentGrants`` looks at the granted
streams once every quarter of that, and takes each lost one back: the call fails
UNAVAILABLE (its answer to the shell is also the revoke a live relay stops on:
``Inbox.on_revoke``) and its slot is free. Nothing is paid per token or per grant: a
stream's progress is its token count, compared at each look.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from fair_frontend.core.clock import Clock, Timer
from fair_frontend.errors import Unavailable

if TYPE_CHECKING:
    from fair_frontend.core.dispatch import CoreRequest

SILENT_MARGIN_S = 10.0  # beyond the shell's own watchdogs (``Core``: silent_after_s)
LOOKS_PER_LIMIT = 4


class SilentGrants:
    """The lost streams among ``granted()`` (the module's doc), each given to ``lost``
    once; ``limit_s``: how long silence proves a stream lost."""

    def __init__(
        self,
        clock: Clock,
        limit_s: float,
        granted: Callable[[], Iterable[CoreRequest]],
        lost: Callable[[CoreRequest, Unavailable], None],
    ) -> None:
        self.clock = clock
        self.limit_s = limit_s
        self._granted = granted
        self._lost = lost
        self._seen: dict[CoreRequest, tuple[int, float]] = {}  # its tokens, since when
        self._timer: Timer | None = None

    def watch(self) -> None:
        """A stream was granted: look while any is (one timer for them all)."""
        if self._timer is None:
            self._arm()

    def _arm(self) -> None:
        self._timer = self.clock.call_at(
            self.clock.now() + self.limit_s / LOOKS_PER_LIMIT, self._look
        )

    def _look(self) -> None:
        self._timer = None
        now = self.clock.now()
        seen, self._seen = self._seen, {}
        lost = []
        for req in self._granted():
            if req.answered:
                continue
            tokens, since = seen.get(req, (-1, now))
            if tokens != req.produced:
                since = now
            elif now - since > self.limit_s:
                lost.append(req)
                continue
            self._seen[req] = (req.produced, since)
        for req in lost:
            self._lost(
                req,
                Unavailable(
                    f"the stream's shell said nothing of it for {now - seen[req][1]:.0f} s "
                    "(no token, no end): its slot is taken back"
                ),
            )
        if self._seen:
            self._arm()
