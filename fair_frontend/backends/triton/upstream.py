"""The one classification of Triton's errors: what a failed call to Triton is to the frontend.

An ``UpstreamError`` carrying Triton's own gRPC code and the HTTP status Triton's HTTP
server would have used for it, so a client sees through the frontend what it would have
seen from Triton; an unreachable Triton is ``Unavailable``; Triton's own UNAVAILABLE about
one model or version is ``ModelUnavailable``. Both ways to Triton use it: the gRPC
forwarder (``fair_frontend.backends.triton.forwarder``) and the HTTP one
(``fair_frontend.backends.triton.http``).
"""

from __future__ import annotations

import re

import grpc
from tritonclient.utils import InferenceServerException

from fair_frontend.errors import (
    DeadlineExceeded,
    FrontendError,
    ModelUnavailable,
    Unavailable,
    UpstreamError,
)

# Triton's HTTP server's mapping of its error codes (src/http_server.cc, HttpCodeFromError),
# and RESOURCE_EXHAUSTED, which Triton's core has no code for (it reaches a gRPC client from
# gRPC's own limits, e.g. a message over the size limit): 429, as docs/PROTOCOL.md maps
# it (and grpc-gateway), not the 400 Triton's table gives everything it does not list.
_HTTP_STATUS = {
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
}
_CODES = {str(c): c for c in grpc.StatusCode}
_UNKNOWN_MODEL = re.compile(r"unknown model: '[^']*' is not found")
# gRPC's words for "no connection was ever made": the request did not reach Triton.
_NOT_CONNECTED = ("failed to connect", "Connection refused", "connections to all backends")
# Triton's words for a model or version it knows but cannot serve now (model_repository_
# manager: "Request for unknown model: 'M' version N is not at ready state", "... is not
# ready"): an answer from a reachable Triton, about that model only. A tenant can ask for
# such a version at will: it must not read as Triton being down for everyone.
_MODEL_STATE = re.compile(r"is not at ready state|is not ready")


def upstream_error(err: InferenceServerException) -> FrontendError:
    code = _CODES.get(str(err.status()), grpc.StatusCode.UNKNOWN)
    message = err.message() or str(err)
    if code is grpc.StatusCode.UNAVAILABLE and _MODEL_STATE.search(message):
        return ModelUnavailable(message)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"Triton is unavailable: {message}")
    if code is grpc.StatusCode.UNAVAILABLE:
        never_sent = code is grpc.StatusCode.UNAVAILABLE and any(
            s in message for s in _NOT_CONNECTED
        )
        return Unavailable(f"Triton is unavailable: {message}", never_sent=never_sent)
    if _UNKNOWN_MODEL.search(message):
        # An unknown model (not an unknown version of a known one): Triton 2.51 says
        # NOT_FOUND / 404 on some paths; docs/PROTOCOL.md says INVALID_ARGUMENT / 400,
        # as the frontend's infer answers: one answer everywhere.
        return UpstreamError(message, grpc.StatusCode.INVALID_ARGUMENT, 400)
    return UpstreamError(message, code, _HTTP_STATUS.get(code, 400))


def upstream_message_error(message: str) -> FrontendError:
    """An error Triton put in a stream response (it carries no status code): a model that
    says it is not ready (Triton's words, which the shipped llm uses while its engine
    restarts) is UNAVAILABLE for this request alone, like Triton's own answer about a
    model; the rest INTERNAL, as Triton's HTTP generate maps a model's error."""
    if "unknown model" in message:
        return UpstreamError(message, grpc.StatusCode.INVALID_ARGUMENT, 400)
    if _MODEL_STATE.search(message):
        return ModelUnavailable(message)
    return UpstreamError(message, grpc.StatusCode.INTERNAL, 500)
