"""The watch on a stream from Triton: how long it waits for Triton, how long its consumer
holds a response (both the gRPC stream, ``forwarder.TritonStream``, and the generate
extension's events, ``sse.SseStream``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from fair_frontend.errors import FrontendError, StalledStream, UpstreamError

STALL_CHECKS = 4  # looks per stalled_s for a consumer that started holding a response


class NoProgress(UpstreamError):
    """A stream that got no response from Triton for ``request_timeout_s``: cancelled,
    and answered UNAVAILABLE. It says nothing about Triton as a whole (a model can be
    stuck while Triton serves the others; a Triton that stops answering altogether is a
    transport failure, which gRPC's keepalive reports as one), so it marks nothing down."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"no response from Triton for {timeout_s:g} s (triton.request_timeout_s): "
            "the request was cancelled",
            grpc.StatusCode.UNAVAILABLE,
            503,
        )


class Watchdog:
    """Stops a call that makes no progress for ``timeout_s``, or whose consumer holds a
    response for ``stalled_s``: one timer per call, re-armed from the time of the latest
    response when it fires (``progress`` and ``hold`` only note the time: nothing per
    response but a clock read, and a timer that fires a few times per ``stalled_s``).

    Only the wait for Triton counts as Triton's lack of progress. While the consumer holds
    a response (``hold``, until its next ``progress``) the call is not read, by choice: a
    client that does not read holds its stream back (gRPC's flow control then holds
    Triton's sender), up to ``stalled_s`` (``queues.stalled_stream_s``), after which the
    request is cancelled in Triton and its slot freed (``StalledStream``)."""

    def __init__(
        self, stop: Callable[[FrontendError], None], timeout_s: float, stalled_s: float | None
    ) -> None:
        self._stop = stop
        self._timeout_s = timeout_s
        self._stalled_s = stalled_s
        # A hold may start at any response: while none is held the timer also looks in
        # every quarter of stalled_s, so a stall is found within 1.25 stalled_s.
        self._period = stalled_s / STALL_CHECKS if stalled_s is not None else timeout_s
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._held = False
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(
            self._last + min(timeout_s, self._period), self._check
        )

    def progress(self) -> None:
        """A response came, or the consumer asks for the next one: the wait starts now."""
        self._last = self._loop.time()
        self._held = False

    def hold(self) -> None:
        """The consumer has a response and has not asked for the next: Triton's clock
        stops, the consumer's starts."""
        self._last = self._loop.time()
        self._held = True

    def _check(self) -> None:
        now = self._loop.time()
        if self._held:
            limit = self._stalled_s
            if limit is not None and now - self._last >= limit:
                self._timer = None
                self._stop(StalledStream(limit))
                return
            due = self._last + limit if limit is not None else now + self._timeout_s
        else:
            due = self._last + self._timeout_s
            if now >= due:
                self._timer = None
                self._stop(NoProgress(self._timeout_s))
                return
            due = min(due, now + self._period)
        self._timer = self._loop.call_at(due, self._check)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
