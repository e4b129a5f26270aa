"""What a tenant has left of its rate limits: the ``Quota`` an answer carries, as headers.

Every check of a request's rate limits (``fair_frontend.admission.ratelimit``) reads, in
the same atomic step that counts it, each limit's state afterwards: what is left of it
and how long until its window is empty again. Of those, the answer carries one per unit,
the *binding* window: for requests and for tokens separately, the limit with the least
remaining (ties: the longer window, which stays binding for longer). That is what a client
can send before its next refusal, and it is what OpenAI's rate-limit headers say
(``quota_headers``). A tenant (or endpoint) without limits in a unit has no window in it;
without any limits, no ``Quota`` at all, and no headers.

The ``Quota`` is computed by the core at admission and travels on the record that
answers the call (``records.Answer``, ``records.Grant`` for a stream, and on the
``records.Fault`` of a refusal: ``FrontendError.quota``); the shells only format it.
A check the storage did not answer (``fail_open``) has none.

The state is the one after this request's check: an admitted request is counted in it,
a refused one is not. What ``remaining`` counts is what the limit counts at admission:
for ``tokens`` limits, the request's estimate (prompt + ``max_tokens``); the correction
once it ends (``RateLimiter.adjust``) shows in the next answer's headers.

``reset`` is the time until the window holds nothing: until the newest bucket that holds
anything has left it (``admission.ratelimit``: "Lateness"), OpenAI's "time until the rate
limit resets to its initial state". With no traffic meanwhile, ``remaining`` is back to
``limit`` then; some capacity may come back earlier (the oldest buckets leave first: that
is ``Retry-After`` on a refusal).

This module imports nothing of the package: the records, the errors and the shells all
read it.
"""

from __future__ import annotations

import msgspec

HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-requests",
    "x-ratelimit-reset-tokens",
)
"""OpenAI's rate-limit headers, in its order: every name ``quota_headers`` may write."""


class QuotaWindow(msgspec.Struct, array_like=True, frozen=True):
    """One limit's state after a check: the binding window of its unit."""

    limit: int  # the limit's N (``amount``): what the window may hold
    remaining: int  # N minus what the window counts after this check (>= 0)
    reset_ms: int  # milliseconds until the window is empty (rounded up; 0: it is)
    window: str  # its window's name: second, minute, hour, day, month


class Quota(msgspec.Struct, array_like=True, frozen=True):
    """The binding window per unit (None: no limit in that unit)."""

    requests: QuotaWindow | None = None
    tokens: QuotaWindow | None = None


def format_reset(ms: int) -> str:
    """A reset time as OpenAI writes it (Go's ``time.Duration`` at millisecond precision):
    ``0s``, ``120ms``, ``1s``, ``7.66s``, ``6m0s``, ``1h2m3s``; hours do not roll over
    into days (30 days: ``720h0m0s``)."""
    if ms < 60_000:  # the common case first (a window of a second or a minute)
        if ms < 1000:
            return f"{ms}ms" if ms > 0 else "0s"
        seconds, fraction = divmod(ms, 1000)
        return f"{seconds}.{fraction:03d}".rstrip("0") + "s" if fraction else f"{seconds}s"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds, fraction = divmod(rest, 1000)
    text = f"{seconds}.{fraction:03d}".rstrip("0") if fraction else str(seconds)
    if hours:
        return f"{hours}h{minutes}m{text}s"
    if minutes:
        return f"{minutes}m{text}s"
    return f"{text}s"


def quota_headers(quota: Quota | None) -> dict[str, str]:
    """OpenAI's rate-limit headers for ``quota`` (lower case; HTTP headers and gRPC
    metadata alike), in OpenAI's order: ``x-ratelimit-limit-requests``,
    ``x-ratelimit-limit-tokens``, ``x-ratelimit-remaining-requests``,
    ``x-ratelimit-remaining-tokens``, ``x-ratelimit-reset-requests``,
    ``x-ratelimit-reset-tokens``. Only the units ``quota`` has a window in; none for
    None (no limits)."""
    if quota is None:
        return {}
    req, tok = quota.requests, quota.tokens
    if req is not None and tok is not None:  # the common case, in one literal
        return {
            "x-ratelimit-limit-requests": str(req.limit),
            "x-ratelimit-limit-tokens": str(tok.limit),
            "x-ratelimit-remaining-requests": str(req.remaining),
            "x-ratelimit-remaining-tokens": str(tok.remaining),
            "x-ratelimit-reset-requests": format_reset(req.reset_ms),
            "x-ratelimit-reset-tokens": format_reset(tok.reset_ms),
        }
    headers: dict[str, str] = {}
    if req is not None:
        headers["x-ratelimit-limit-requests"] = str(req.limit)
    if tok is not None:
        headers["x-ratelimit-limit-tokens"] = str(tok.limit)
    if req is not None:
        headers["x-ratelimit-remaining-requests"] = str(req.remaining)
    if tok is not None:
        headers["x-ratelimit-remaining-tokens"] = str(tok.remaining)
    if req is not None:
        headers["x-ratelimit-reset-requests"] = format_reset(req.reset_ms)
    if tok is not None:
        headers["x-ratelimit-reset-tokens"] = format_reset(tok.reset_ms)
    return headers
