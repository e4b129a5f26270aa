"""Errors the frontend answers with, mapped once to gRPC and HTTP.

The mapping follows ``docs/PROTOCOL.md``: Triton's own codes and messages where
Triton has the situation, 429 for one tenant's quota, 503 for the platform's overload.
Raise a subclass anywhere on the request path; the HTTP and gRPC shells turn it into
the status, body and ``retry-after`` hint.
"""

from __future__ import annotations

import math

import grpc

from fair_frontend.outcomes import Outcome
from fair_frontend.quota import Quota

# Triton's exact strings; clients match on them.
MSG_TIMEOUT_EXPIRED = "Request timeout expired"
MSG_QUEUE_FULL = "Exceeds maximum queue size"


class FrontendError(Exception):
    """An error with a defined status on both protocols."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500
    outcome: Outcome = Outcome.FAILED
    quota: Quota | None = None
    """The tenant's rate-limit state when the core answered with this error (its quota
    headers): set on a refusal by its limits, and on an error after its limits counted it
    (``records.Fault`` carries it across processes). None: no limits, or not checked."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    @property
    def retry_after_header(self) -> str | None:
        """``Retry-After`` value: whole seconds, rounded up, at least 1."""
        if self.retry_after is None:
            return None
        return str(max(1, math.ceil(self.retry_after)))


class InvalidArgument(FrontendError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    outcome = Outcome.REJECTED_INVALID


class UnknownModel(InvalidArgument):
    def __init__(self, model: str) -> None:
        super().__init__(f"Request for unknown model: '{model}' is not found")


class Unauthenticated(FrontendError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401
    outcome = Outcome.REJECTED_AUTH


class PermissionDenied(FrontendError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403
    outcome = Outcome.REJECTED_AUTH


class RateLimited(FrontendError):
    """A tenant's rate limit refused the request: 429 / RESOURCE_EXHAUSTED, with the
    time until it would fit (``Retry-After``) unless it never fits."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    outcome = Outcome.REJECTED_RATE


class QuotaExhausted(RateLimited):
    """The binding limit is an allowance, a window of a day or a month: used up, rather
    than sent too fast. The same status and outcome as any ``RateLimited`` (429 /
    RESOURCE_EXHAUSTED, ``rejected_rate``); a class of its own so that a route can tell
    the two apart for its clients: OpenAI's ``insufficient_quota`` (do not retry: the
    plan's allowance is spent) against ``rate_limit_exceeded`` (a second, minute or hour
    window: slow down and retry).

    It keeps the retry hint: ``Retry-After`` is still true (the sliding window frees the
    oldest of what it counts then: up to a day ahead for a day's limit, a month for a
    month's), and KServe clients read it as they read any 429's. The OpenAI SDK retries
    every 429 (after ``Retry-After`` when that is short) unless the answer says
    ``x-should-retry: false``: that header, not the hint, is how a route tells it not to."""


SHUTTING_DOWN = "the frontend is shutting down"  # a core's refusal while it stops


class Unavailable(FrontendError):
    """Triton down, model not ready: the platform cannot serve now."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    outcome = Outcome.FAILED

    def __init__(
        self, message: str, *, retry_after: float | None = None, never_sent: bool = False
    ) -> None:
        super().__init__(message, retry_after=retry_after)
        # True when the request provably never reached Triton (no connection): it may be
        # sent again without risk of running twice.
        self.never_sent = never_sent


class DeadlineExceeded(Unavailable):
    """Triton did not answer a call within ``triton.request_timeout_s``: Triton may be
    hung, or the call is simply long. A batch's timeout marks the backend down; in engine
    mode (one request per call, as long as its generation) it fails that request alone."""


class Overloaded(Unavailable):
    """The throttle: the predicted wait exceeds the target."""

    outcome = Outcome.REJECTED_OVERLOAD


class QueueFull(Unavailable):
    outcome = Outcome.REJECTED_QUEUE_FULL

    def __init__(self, cap: str) -> None:
        super().__init__(f"{MSG_QUEUE_FULL}: {cap}")
        self.cap = cap


class TimeoutExpired(Unavailable):
    outcome = Outcome.EXPIRED

    def __init__(self) -> None:
        super().__init__(MSG_TIMEOUT_EXPIRED)


class Cancelled(FrontendError):
    grpc_code = grpc.StatusCode.CANCELLED
    http_status = 499  # nginx's "client closed request"; nobody is listening anyway
    outcome = Outcome.CANCELLED


class StalledStream(Cancelled):
    """A streamed request whose client took none of its responses for too long: it was
    cancelled in Triton (its slot freed)."""

    def __init__(self, stalled_s: float) -> None:
        super().__init__(
            f"the client read none of its stream's responses for {stalled_s:g} s "
            "(queues.stalled_stream_s): the request was cancelled"
        )


class UpstreamError(FrontendError):
    """Triton (or the model) answered an error: passed on with Triton's code."""

    outcome = Outcome.FAILED

    def __init__(self, message: str, grpc_code: grpc.StatusCode, http_status: int) -> None:
        super().__init__(message)
        self.grpc_code = grpc_code
        self.http_status = http_status


class ModelUnavailable(UpstreamError):
    """Triton answered that the model (or the version asked for) cannot serve now: not
    loaded, not at ready state. UNAVAILABLE / 503 as Triton says it, for the requests that
    asked for that model and version only. Triton itself answered: unlike ``Unavailable``
    it says nothing about whether Triton is reachable, and marks nothing down (a tenant
    can ask for a version that is not loaded, on purpose)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, grpc.StatusCode.UNAVAILABLE, 503)


class Unsupported(FrontendError):
    """A feature the request needs that neither the frontend nor Triton has (Triton: 501)."""

    grpc_code = grpc.StatusCode.UNIMPLEMENTED
    http_status = 501
    outcome = Outcome.REJECTED_INVALID


class Internal(FrontendError):
    pass


def error_class(name: str) -> type[FrontendError]:
    """The ``FrontendError`` subclass called ``name`` (an error that crossed from another
    process by name: ``records.Fault``), or ``FrontendError`` where none is."""
    found = _CLASSES.get(name)
    if found is None:
        todo: list[type[FrontendError]] = [FrontendError]
        while todo and found is None:
            cls = todo.pop()
            found = cls if cls.__name__ == name else None
            todo.extend(cls.__subclasses__())
        if found is not None:
            _CLASSES[name] = found
    return found or FrontendError


_CLASSES: dict[str, type[FrontendError]] = {}
