"""How a request ended: the one enum behind metric labels and error mapping.

Every admitted request ends in exactly one outcome. Rejections before admission
(authentication, bad input, rate limits, the throttle) are outcomes too, so the
frontend's counters add up to the requests it received.
"""

from __future__ import annotations

import enum


class Outcome(str, enum.Enum):
    """The single source of truth for how a request ended."""

    DISPATCHED = "dispatched"  # sent to Triton and answered successfully
    REJECTED_AUTH = "rejected_auth"  # no, unknown or mismatched API key
    REJECTED_INVALID = "rejected_invalid"  # bad input: never entered a queue
    REJECTED_RATE = "rejected_rate"  # over the tenant's rate limit (429)
    REJECTED_OVERLOAD = "rejected_overload"  # throttle: predicted wait over target (503)
    REJECTED_QUEUE_FULL = "rejected_queue_full"  # a queue cap was reached (503)
    EXPIRED = "expired"  # queued past its deadline (503 "Request timeout expired")
    CANCELLED = "cancelled"  # the client went away or cancelled
    FAILED = "failed"  # Triton or the model answered an error, or Triton was unreachable

    @property
    def admitted(self) -> bool:
        """True for outcomes of requests that entered a queue."""
        return self in _ADMITTED


_ADMITTED = frozenset({Outcome.DISPATCHED, Outcome.EXPIRED, Outcome.CANCELLED, Outcome.FAILED})
