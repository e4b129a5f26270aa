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

import asyncio
import logging
import sys
from typing import IO, Any

import msgspec

from fair_frontend.observability.observe import Observer
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import MAX_ID_BYTES, MAX_NAME_BYTES, clipped
from fair_frontend.usage import Usage

REQUEST_LOGGER = "fair_frontend.requests"
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
# An error message in a request's log line is cut beyond this (messages that quote a
# client's input are bounded where they are made; this bounds the line whatever comes).
MAX_LOGGED_ERROR_CHARS = 8192
# A turn's lines go out together; this many go out at once whatever the turn.
FLUSH_LINES = 1024
_ENCODER = msgspec.json.Encoder(enc_hook=str)  # what JSON cannot hold, as its str()


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
        return _ENCODER.encode(doc).decode()


class TurnStreamHandler(logging.StreamHandler):
    """A stream handler that writes the lines of one event-loop turn together.

    Each record is formatted at once and held; at the end of the loop turn it came in
    (``call_soon``) the turn's lines go to the stream in one write. A record from a
    thread without a running loop, the ``FLUSH_LINES``-th held, ``flush()`` and
    ``logging.shutdown()`` at exit write at once. A core logs a line per finished request
    (``RequestLog``): one write per turn, not one per request. What a process killed
    mid-turn had not written yet is lost (one turn's lines at most)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        super().__init__(stream)
        self._held: list[str] = []
        self._due = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self._held.append(line)  # ``handle`` holds the lock
        if len(self._held) >= FLUSH_LINES:
            self._write()
            return
        if self._due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write()  # no loop runs here: nothing would end the turn
            return
        self._due = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self._due = False
            self._write()

    def _write(self) -> None:
        if not self._held:
            return
        text = "\n".join(self._held) + "\n"
        self._held = []
        try:
            self.stream.write(text)
            self.stream.flush()
        except Exception:  # a closed or broken stream: as ``StreamHandler`` does
            self.handleError(logging.makeLogRecord({"msg": text[:200]}))


def configure_logging(fmt: str = "json", level: str | int = "INFO") -> None:
    handler = TurnStreamHandler()
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
        # ``Logger.info`` less its search of the stack for the caller (always this line):
        # one per finished request, on the core's hot path.
        log = self.log
        record = log.makeRecord(
            log.name, logging.INFO, __file__, sys._getframe().f_lineno, "request %s",
            (outcome.value,), None, "request_finished", fields,
        )  # fmt: skip
        log.handle(record)
