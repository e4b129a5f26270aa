"""Batch assembly: take the next chosen request until the batch is full.

The boundary rule (package docstring, "Batches"): a batch ends when it is full, or when
the next chosen request would overflow it or has another ``shape_key``. That request is
not skipped: it stays first for the next batch and its tenant keeps its turn (the
selectors' ``pick``/``choose`` are idempotent until ``take``).
"""

from __future__ import annotations

from collections.abc import Callable

from fair_frontend.scheduler.types import QueuedRequest

Peek = Callable[[], "QueuedRequest | None"]
Take = Callable[[QueuedRequest, float], None]


class BatchAssembler:
    """Fills one batch from a scheduler's chosen requests, within the endpoint's caps."""

    __slots__ = ("max_rows", "max_tokens")

    def __init__(self, max_batch_size: int, max_batch_tokens: int | None) -> None:
        self.max_rows = max_batch_size  # 0: no batching, one request per batch
        self.max_tokens = max_batch_tokens

    def assemble(self, peek: Peek, take: Take, now: float) -> list[QueuedRequest]:
        """``peek()``: the request chosen next, or None; ``take(req, now)``: dispatch it."""
        req = peek()
        if req is None:
            return []
        # The first request always goes, even if larger than a cap on its own.
        take(req, now)
        batch = [req]
        max_rows = self.max_rows
        if max_rows == 0:
            return batch
        max_tokens = self.max_tokens
        shape = req.shape_key
        rows = req.rows
        tokens = req.tokens
        if max_tokens is None:
            while rows < max_rows:
                req = peek()
                if req is None or rows + req.rows > max_rows or req.shape_key != shape:
                    break
                take(req, now)
                batch.append(req)
                rows += req.rows
        else:
            while rows < max_rows and tokens < max_tokens:
                req = peek()
                if (
                    req is None
                    or rows + req.rows > max_rows
                    or tokens + req.tokens > max_tokens
                    or req.shape_key != shape
                ):
                    break
                take(req, now)
                batch.append(req)
                rows += req.rows
                tokens += req.tokens
        return batch
