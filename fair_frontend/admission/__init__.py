"""Admission: what a request must pass before it may queue.

``ratelimit``: per-tenant, per-endpoint limits in requests and tokens over sliding windows
(second .. month), exact (never more than N in any window of length T), checked and counted
atomically over all of a request's limits; the algorithm and its guarantee are derived in
``ratelimit``'s docstring. Each check also reads every limit's state after it (remaining,
reset), from which ``Decision.quota`` (``fair_frontend.quota``) keeps the binding window
per unit. ``storage``: where the counters live, chosen by URI (``memory://``,
``redis://host:port[/db]``).
"""

from __future__ import annotations

from fair_frontend.admission.ratelimit import (
    Decision,
    RateLimiter,
    RateLimitItem,
    items_from_limits,
    limit_key,
    rate_limited_error,
)
from fair_frontend.admission.storage import (
    MemoryStorage,
    RedisStorage,
    Storage,
    StorageError,
    storage_from_uri,
)
from fair_frontend.admission.throttle import (
    EngineThrottle,
    Throttle,
    ThrottleDecision,
    overloaded_error,
)

__all__ = [
    "Decision",
    "EngineThrottle",
    "MemoryStorage",
    "RateLimitItem",
    "RateLimiter",
    "RedisStorage",
    "Storage",
    "StorageError",
    "Throttle",
    "ThrottleDecision",
    "items_from_limits",
    "limit_key",
    "overloaded_error",
    "rate_limited_error",
    "storage_from_uri",
]
