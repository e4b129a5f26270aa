"""Caps shared by every endpoint's scheduler in the process."""

from __future__ import annotations

from fair_frontend.config import (
    DEFAULT_GLOBAL_MAX_QUEUED,
    DEFAULT_GLOBAL_MAX_QUEUED_BYTES,
    Queues,
)


class GlobalCaps:
    """Total queued requests and bytes across all endpoints, and their caps.

    One object per process, passed to every ``Scheduler``; each scheduler adds what it
    admits and subtracts what leaves its queues, so the totals are exact across endpoints.
    Not thread-safe: the schedulers run on one event loop.
    """

    __slots__ = ("max_queued", "max_queued_bytes", "queued", "queued_bytes")

    def __init__(
        self,
        max_queued: int = DEFAULT_GLOBAL_MAX_QUEUED,
        max_queued_bytes: int = DEFAULT_GLOBAL_MAX_QUEUED_BYTES,
    ) -> None:
        if max_queued < 1 or max_queued_bytes < 1:
            raise ValueError("global caps must be >= 1")
        self.max_queued = max_queued
        self.max_queued_bytes = max_queued_bytes
        self.queued = 0
        self.queued_bytes = 0

    @classmethod
    def from_config(cls, queues: Queues) -> GlobalCaps:
        return cls(queues.max_queued, queues.max_queued_bytes)
