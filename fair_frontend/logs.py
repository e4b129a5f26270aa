"""Structured logs: one JSON object per line, and one line per finished request.

Request lines carry the request id, tenant, endpoint, outcome, latency and queue wait,
and the error message if any: never an API key (the frontend never puts a key into an
error message or a log record in the first place). The request id and the model name
are the client's strings: the frontend refuses ones too long before it echoes them, and
a line carries at most ``MAX_ID_BYTES`` / ``MAX_NAME_BYTES`` characters of each (and
``MAX_LOGGED_ERROR_CHARS`` of the error) whatever reaches it. ``observability.log_format: text``
gives the classic one-line format for humans at a terminal.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fair_frontend.observe import Observer
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import MAX_ID_BYTES, MAX_NAME_BYTES, clipped
from fair_frontend.usage import Usage

REQUEST_LOGGER = "fair_frontend.requests"
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
# An error message in a request's log line is cut beyond this (messages that quote a
# client's input are bounded where they are made; this bounds the line whatever comes).
MAX_LOGGED_ERROR_CHARS = 8192


class JsonFormatter(logging.Formatter):
    """A record as one JSON object; ``extra=`` fields become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, separators=(",", ":"))


def configure_logging(fmt: str = "json", level: str | int = "INFO") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class RequestLog(Observer):
    """One log record per finished request."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.log = logger or logging.getLogger(REQUEST_LOGGER)

    def request_finished(
        self,
        *,
        tenant: str | None,
        model: str,
        outcome: Outcome,
        queued_s: float | None,
        request_id: str = "",
        latency_s: float | None = None,
        error: str | None = None,
        usage: Usage | None = None,
        service_s: float | None = None,
    ) -> None:
        if not self.log.isEnabledFor(logging.INFO):
            return
        fields: dict[str, Any] = {
            "request_id": clipped(request_id, MAX_ID_BYTES),
            "tenant": tenant,
            "endpoint": clipped(model, MAX_NAME_BYTES),
            "outcome": outcome.value,
        }
        if latency_s is not None:
            fields["latency_ms"] = round(latency_s * 1e3, 3)
        if queued_s is not None:
            fields["queued_ms"] = round(queued_s * 1e3, 3)
        if service_s is not None:
            fields["service_ms"] = round(service_s * 1e3, 3)
        if usage is not None:  # the billing record: what the tenant was charged
            fields["tokens_in"] = usage.prompt_tokens
            fields["tokens_out"] = usage.completion_tokens
        if error is not None:
            fields["error"] = clipped(error, MAX_LOGGED_ERROR_CHARS)
        self.log.info("request %s", outcome.value, extra=fields)
