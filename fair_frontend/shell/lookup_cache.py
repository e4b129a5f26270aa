"""What did Triton answer to this question lately? Kept briefly, asked once at a time.

The side doors (model metadata, config, readiness, and the model lookups behind
statistics and inference) would otherwise reach Triton once per call, and their model
names are client input. So, in each shell:

* **single flight**: concurrent identical questions share one lookup. It runs in a task
  of its own, so a caller that goes away only stops waiting; the others still get the
  answer (``ModelRegistry`` in the core does the same).
* **time to live**: an answer is kept for the ``ttl_s`` its caller gives (0: not kept);
  an answer that the model or version does not exist (Triton's INVALID_ARGUMENT or
  NOT_FOUND) for ``negative_ttl_s``. Other errors (Triton unreachable, internal) are not
  kept: the next caller asks again.
* **bounded**: at most ``max_entries`` answers, the least recently used dropped first;
  names too long to be any model's are answered but never kept.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from fair_frontend.errors import FrontendError

T = TypeVar("T")
Key = tuple[str, str, str]  # (question, model, version)

# Model names and versions beyond this (together) are never kept: a client can send
# names of any length, and a full cache of them must stay small.
MAX_KEPT_NAME_CHARS = 1024
# Triton's answers that the request names what does not exist: kept as negative answers.
_NEGATIVE_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND})


@dataclass(slots=True, frozen=True)
class _Kept:
    expires: float
    value: Any = None
    error: FrontendError | None = None


class LookupCache:
    """Answers to questions about models, kept for a while, one lookup per question."""

    def __init__(
        self,
        *,
        max_entries: int,
        negative_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.negative_ttl_s = negative_ttl_s
        self._clock = clock
        self._kept: OrderedDict[Key, _Kept] = OrderedDict()
        self._inflight: dict[Key, asyncio.Task[Any]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    async def get(self, key: Key, ttl_s: float, lookup: Callable[[], Awaitable[T]]) -> T:
        """The kept answer to ``key``, else the one lookup in flight, else a new one."""
        kept = self._fresh(key)
        if kept is not None:
            if kept.error is not None:
                # with_traceback(None): re-raising one object must not grow its traceback.
                raise kept.error.with_traceback(None)
            result: T = kept.value
            return result
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._lookup(key, ttl_s, lookup))
            task.add_done_callback(_retrieve)
            self._inflight[key] = task
        answer: T = await asyncio.shield(task)
        return answer

    def _fresh(self, key: Key) -> _Kept | None:
        kept = self._kept.get(key)
        if kept is None:
            return None
        if kept.expires <= self._clock():
            del self._kept[key]
            return None
        self._kept.move_to_end(key)
        return kept

    async def _lookup(self, key: Key, ttl_s: float, lookup: Callable[[], Awaitable[T]]) -> T:
        try:
            value = await lookup()
        except FrontendError as err:
            if err.grpc_code in _NEGATIVE_CODES:
                self._keep(key, self.negative_ttl_s, error=err)
            raise
        finally:
            if self._inflight.get(key) is asyncio.current_task():
                del self._inflight[key]
        self._keep(key, ttl_s, value=value)
        return value

    def _keep(
        self, key: Key, ttl_s: float, value: Any = None, error: FrontendError | None = None
    ) -> None:
        if ttl_s <= 0 or len(key[1]) + len(key[2]) > MAX_KEPT_NAME_CHARS:
            return
        self._kept[key] = _Kept(self._clock() + ttl_s, value, error)
        self._kept.move_to_end(key)
        while len(self._kept) > self.max_entries:
            self._kept.popitem(last=False)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a failed lookup's error as seen: every caller may have gone away."""
    if not task.cancelled():
        task.exception()
