"""Where rate-limit counters live: in this process (``memory://``) or in Redis (``redis://``).

Both storages implement the same algorithm, the bucketed sliding window derived in
``fair_frontend.admission.ratelimit`` (read that first); this module only says where the
buckets are kept and how one check stays atomic:

- ``MemoryStorage``: plain synchronous Python behind an ``async`` method that never awaits,
  so a check-and-count runs without interleaving on the event loop (and under a lock, so
  threads are safe too). One replica only: each process counts on its own.
- ``RedisStorage``: one Lua script per check (another per adjustment), atomic on the
  Redis server. The scripts of concurrent checks share round trips: those queued in one
  event-loop turn (and while a round trip is in flight) go in one pipelined write, on a
  thread and connection of the storage's own (``RoundTrips``), whose socket timeout is
  the storage timeout: it measures Redis, never this process's queueing or loop lag.
  One hash per (key, limit) holds the buckets and their running sum, so a check costs O(1)
  Redis work (buckets are read only when one leaves the window, and to compute
  ``retry_after`` on a rejection). All the keys of one check share the hash tag
  ``{<key>}``, so they map to one Redis Cluster slot. Keys expire once idle for a window
  plus a bucket (garbage collection only: the script itself drops buckets that have left
  the window).

Storage answers one question: "do these costs fit every one of these limits at ``now``? If
so, count them"; and takes one correction without a question, ``adjust`` (the charge-back
of an admitted request's tokens: "Adjustments" in ``ratelimit``). With the answer come
each limit's state after the check, read in the same atomic step (``WindowState``: what
remains of the limit, and how long until its window is empty again), from which the
answer's quota headers are made (``fair_frontend.quota``). Reading it costs no more Redis
work on the common path: the sum is at hand, and the newest bucket that holds anything
is the one just counted into; only a refused check (or one that counted nothing) may read
the newest bucket's field, and scan the hash where a refund emptied it. Time always comes from
the caller (integer microseconds), never from the storage, so tests drive both storages on
one fake clock. Replicas sharing Redis must keep their clocks synchronised (NTP): the
guarantee holds on the timestamps the replicas pass, so with a skew of ``d`` between
replicas it holds for every window of real time ``T - d`` (a window of real time ``T`` may
hold what the limit admits in a further ``d``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from fair_frontend.admission.limits import RateLimitItem

DEFAULT_RATELIMIT_STORAGE = "memory://"
DEFAULT_RATELIMIT_TIMEOUT_MS = 50.0
DEFAULT_BUCKETS = 50
"""Buckets per window (K). A window's capacity returns at most T/K late (2 %: 20 ms for a
second, 1.2 s for a minute, 28.8 min for a day, 14.4 h for a month); memory per limit and key
is at most K + 1 counters. 50 divides every configured window in microseconds exactly."""

DEFAULT_TIMEOUT_S = DEFAULT_RATELIMIT_TIMEOUT_MS / 1000.0
MEMORY_SWEEP_INTERVAL_US = 60_000_000  # how often the memory storage drops idle windows
log = logging.getLogger(__name__)

REDIS_KEY_PREFIX = "rl"
MAX_BATCH = 512
"""Most commands in one Redis round trip. Redis answers a pipeline in chunks as it reads
it (about 16 KiB of commands at a time), so a full batch keeps replies flowing well inside
the timeout; more queued go in the next round trip."""
BACKSTOP_S = 1.0
BACKSTOP_TIMEOUTS = 16
"""A call the round-trip thread never answers fails after ``BACKSTOP_S`` +
``BACKSTOP_TIMEOUTS`` x the timeout (``RoundTrips``): far above a round trip's worst case
(the one ahead of it and its own, each at most a connect, a reconnect and their replies),
so only a wedged thread (a DNS lookup that hangs) reaches it."""

StorageFailure = Literal["timeout", "error"]


class StorageError(Exception):
    """The storage could not answer (down, slow, refused). Never a limit decision.

    ``reason``: ``timeout`` (Redis silent for longer than the timeout) or ``error``
    (connection refused or reset, an error reply, the storage closed).
    """

    def __init__(self, message: str, *, reason: StorageFailure = "error") -> None:
        super().__init__(message)
        self.reason: StorageFailure = reason

    @classmethod
    def of(cls, error: Exception) -> StorageError:
        """The storage error for a client library's exception."""
        if isinstance(error, RedisTimeoutError | TimeoutError):
            return cls(f"timed out: {error}", reason="timeout")
        return cls(f"{type(error).__name__}: {error}")


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a check did not fit: which limit, and how long until it would."""

    index: int
    """Position in the checked items of the limit that binds (the longest wait)."""
    wait_us: int | None
    """Microseconds until enough of that limit frees up for this request (with no other
    traffic); ``None`` when the request's cost alone exceeds the limit: it never fits."""


WindowState = tuple[int, int]
"""One limit's state right after a check, read in the same atomic step: ``(remaining,
reset_us)``. ``remaining``: the limit minus what its window counts (this request
included if it was admitted), at least 0. ``reset_us``: microseconds until the window is
empty again, i.e. until the newest bucket that holds anything has left it (0: it holds
nothing); with no traffic meanwhile ``remaining`` is the whole limit again then. (The
limit itself is the item's ``amount``.)"""


Checked = tuple[Rejection | None, Sequence[WindowState]]
"""What ``Storage.acquire`` answers: the rejection (None: counted) and each item's
``WindowState`` after the check, in the order of the items (empty where a storage keeps no
such state: the test doubles that model broken limiters). A plain tuple: one is made per
check, on the hot path."""


class Storage(Protocol):
    """Do these costs fit every one of these limits at ``now_us``? If so, count them.

    ``acquire`` checks and counts atomically: it counts the request against every item when
    each has room, and against none when any has not (then its answer holds the binding
    ``Rejection``); either way the answer holds every item's ``WindowState`` after the
    check, read in the same atomic step (on Redis, by the same script: every replica
    sharing it reads the one state). ``items`` must be distinct (unit, window) pairs;
    ``costs[i]`` is what the request costs against ``items[i]``. ``acquire`` returns or
    raises ``StorageError`` (with its ``reason``); it never hangs (Redis: ``RoundTrips``
    says how long it may take).
    """

    async def acquire(
        self, key: str, items: Sequence[RateLimitItem], costs: Sequence[int], now_us: int
    ) -> Checked: ...

    async def adjust(
        self,
        key: str,
        items: Sequence[RateLimitItem],
        deltas: Sequence[int],
        admitted_us: int,
        now_us: int,
    ) -> None:
        """Correct what an admitted request counted, without a check (never refuses).

        ``deltas[i] > 0`` is counted against ``items[i]`` at ``now_us`` (the current bucket,
        or the newest one if the clock stepped back), exactly as ``acquire`` counts.
        ``deltas[i] < 0`` is taken out of the bucket of ``admitted_us``, at most what that
        bucket holds, and only while that bucket is still counted at ``now_us``; otherwise
        it is dropped. Atomic over all items; raises ``StorageError`` as ``acquire`` does.
        """
        ...

    async def close(self) -> None: ...


# ---- the bucket arithmetic both storages share -------------------------------------------


def bucket_width_us(seconds: float, buckets: int) -> int:
    """Bucket width for a window of ``seconds`` split into ``buckets``: ceil(T / K) µs.

    Rounding up keeps K widths >= T, which is what the safety argument needs.
    """
    window_us = round(seconds * 1_000_000)
    if window_us <= 0:
        raise ValueError(f"a window must be positive, not {seconds} s")
    return max(1, -(-window_us // buckets))


def _release_wait_us(
    live: Sequence[tuple[int, int]], need: int, width: int, span: int, now_us: int
) -> int:
    """Time until the oldest buckets that hold ``need`` have left the window.

    ``live`` is (bucket, amount) oldest first. Bucket ``j`` is counted while the current
    bucket is at most ``j + span``, so it stops counting at ``(j + span + 1) * width``.
    """
    freed = 0
    for index, amount in live:
        freed += amount
        if freed >= need:
            return (index + span + 1) * width - now_us
    raise AssertionError("need exceeds what the window holds")  # callers ensure it cannot


# ---- memory:// ---------------------------------------------------------------------------


class _Window:
    """One key's buckets for one limit: (bucket index, amount) oldest first, and their sum."""

    __slots__ = ("buckets", "span", "total", "width")

    def __init__(self, width: int, span: int) -> None:
        self.width = width
        self.span = span
        self.buckets: deque[list[int]] = deque()
        self.total = 0

    def prune(self, now_us: int) -> int:
        """Drop the buckets that have left the window at ``now_us``; the current bucket."""
        current = now_us // self.width
        oldest_counted = current - self.span
        held = self.buckets
        while held and held[0][0] < oldest_counted:
            self.total -= held.popleft()[1]
        return current

    def reset_us(self, now_us: int) -> int:
        """Microseconds until the window holds nothing (pruned at ``now_us`` already): the
        newest bucket that holds anything leaves at ``(j + span + 1) * width``. Buckets a
        refund emptied stay as zero entries: they hold nothing and are skipped."""
        if self.total <= 0:
            return 0
        for index, amount in reversed(self.buckets):
            if amount > 0:
                return (index + self.span + 1) * self.width - now_us
        return 0  # a positive total is held by some bucket: not reached

    def count(self, current: int, amount: int) -> None:
        """Add ``amount`` (> 0) to bucket ``current`` (pruned already)."""
        held = self.buckets
        # A clock that stepped back counts into the newest bucket: later, never earlier.
        if held and held[-1][0] >= current:
            held[-1][1] += amount
        else:
            held.append([current, amount])
        self.total += amount

    def refund(self, bucket: int, amount: int, now_us: int) -> None:
        """Take up to ``amount`` (> 0) out of ``bucket``: never below zero, and nothing once
        that bucket has left the window (it no longer counts anyway). A bucket emptied
        stays as a zero entry until it leaves (the deque is at most K + 1 long)."""
        current = now_us // self.width
        if bucket < current - self.span:
            return
        self.prune(now_us)
        for entry in reversed(self.buckets):
            if entry[0] <= bucket:
                if entry[0] == bucket:
                    taken = min(entry[1], amount)
                    entry[1] -= taken
                    self.total -= taken
                return


class MemoryStorage:
    """Counters in this process: the default, right for one replica."""

    def __init__(self, *, buckets: int = DEFAULT_BUCKETS) -> None:
        if buckets < 1:
            raise ValueError("buckets must be >= 1")
        self.buckets = buckets
        self._windows: dict[tuple[str, str, float], _Window] = {}
        self._widths: dict[float, int] = {}
        self._next_sweep_us = 0
        # Uncontended on one event loop (a few tens of ns); makes threads safe too.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Windows held (idle ones are dropped by a sweep at most once a minute)."""
        return len(self._windows)

    async def acquire(
        self, key: str, items: Sequence[RateLimitItem], costs: Sequence[int], now_us: int
    ) -> Checked:
        with self._lock:
            return self.acquire_now(key, items, costs, now_us)

    def acquire_now(
        self, key: str, items: Sequence[RateLimitItem], costs: Sequence[int], now_us: int
    ) -> Checked:
        """``acquire`` without the coroutine: synchronous, for callers that hold no loop."""
        if now_us >= self._next_sweep_us:
            self._sweep(now_us)
        windows = self._windows
        # (window, current bucket, left: what remains if admitted (< 0: no room), cost)
        touched: list[tuple[_Window, int, int, int]] = []
        worst: Rejection | None = None
        for i, item in enumerate(items):
            cost = costs[i]
            window = windows.get((key, item.unit, item.seconds))
            if window is None:
                window = self._window(key, item)
            current = window.prune(now_us)
            left = item.amount - window.total - cost
            touched.append((window, current, left, cost))
            if cost > item.amount:
                if worst is None or worst.wait_us is not None:
                    worst = Rejection(i, None)
            elif left < 0 and (worst is None or worst.wait_us is not None):
                live = [(b, amount) for b, amount in window.buckets]
                wait = _release_wait_us(live, -left, window.width, window.span, now_us)
                if worst is None or worst.wait_us is None or wait > worst.wait_us:
                    worst = Rejection(i, wait)
        if worst is not None:  # nothing counted: the state as it was
            return worst, [
                (max(0, left + cost), window.reset_us(now_us)) for window, _, left, cost in touched
            ]
        states: list[WindowState] = []
        for window, current, left, cost in touched:
            if cost:
                window.count(current, cost)
                # The newest bucket holds this request: it empties once that one leaves.
                states.append(
                    (left, (window.buckets[-1][0] + window.span + 1) * window.width - now_us)
                )
            else:
                states.append((left, window.reset_us(now_us)))
        return None, states

    async def adjust(
        self,
        key: str,
        items: Sequence[RateLimitItem],
        deltas: Sequence[int],
        admitted_us: int,
        now_us: int,
    ) -> None:
        with self._lock:
            self.adjust_now(key, items, deltas, admitted_us, now_us)

    def adjust_now(
        self,
        key: str,
        items: Sequence[RateLimitItem],
        deltas: Sequence[int],
        admitted_us: int,
        now_us: int,
    ) -> None:
        """``adjust`` without the coroutine (see ``Storage.adjust``)."""
        if now_us >= self._next_sweep_us:
            self._sweep(now_us)
        for item, delta in zip(items, deltas, strict=True):
            if delta > 0:
                window = self._window(key, item)
                window.count(window.prune(now_us), delta)
            elif delta < 0:
                found = self._windows.get((key, item.unit, item.seconds))
                if found is not None:
                    found.refund(admitted_us // found.width, -delta, now_us)

    def _window(self, key: str, item: RateLimitItem) -> _Window:
        window = self._windows.get((key, item.unit, item.seconds))
        if window is None:
            width = self._widths.get(item.seconds)
            if width is None:
                width = self._widths[item.seconds] = bucket_width_us(item.seconds, self.buckets)
            window = self._windows[(key, item.unit, item.seconds)] = _Window(width, self.buckets)
        return window

    def _sweep(self, now_us: int) -> None:
        """Drop windows whose every bucket has left the window (idle keys)."""
        stale = [
            k
            for k, w in self._windows.items()
            if not w.buckets or w.buckets[-1][0] < now_us // w.width - w.span
        ]
        for k in stale:
            del self._windows[k]
        self._next_sweep_us = now_us + MEMORY_SWEEP_INTERVAL_US

    async def close(self) -> None:
        with self._lock:
            self._windows.clear()


# ---- redis:// ----------------------------------------------------------------------------

# KEYS[i]: a hash per limit. Fields: one per bucket (index -> amount counted in it), and
# 't' = the sum of the buckets, 'o' = no bucket is older than this, 'n' = the newest bucket.
# The running sum keeps a check O(1): buckets are read only when one has left the window
# (about once per bucket width and key) and to compute retry_after on a rejection.
# Both scripts below start with these functions; same algorithm and tie-breaks as
# MemoryStorage (``_Window.prune`` / ``count`` / ``refund``); see ratelimit.py.
_BUCKETS_LUA = """
local function bucket_of(t, width)
  -- floor(t / width), exact for the integer µs a double holds (t < 2^53).
  local b = math.floor(t / width)
  if b * width > t then b = b - 1
  elseif (b + 1) * width <= t then b = b + 1 end
  return b
end

local function prune(key, oldest, span, current)
  -- Drop the buckets older than `oldest`. Returns the sum, the lower bound, the newest
  -- bucket left and the amount in bucket `current` (nil, nil, nil, 0 for an empty key).
  local meta = redis.call('HMGET', key, 't', 'o', 'n', string.format('%d', current))
  local total, low, newest = tonumber(meta[1]), tonumber(meta[2]), tonumber(meta[3])
  local here = tonumber(meta[4]) or 0
  if not total then return 0, nil, nil, 0 end
  if low >= oldest then return total, low, newest, here end
  if newest < oldest then
    redis.call('DEL', key)
    return 0, nil, nil, 0
  end
  local gone, stale = 0, {}
  if oldest - low <= 2 * span + 2 then
    local fields = {}
    for b = low, oldest - 1 do fields[#fields + 1] = string.format('%d', b) end
    local values = redis.call('HMGET', key, unpack(fields))
    for j = 1, #fields do
      if values[j] then
        gone = gone + tonumber(values[j])
        stale[#stale + 1] = fields[j]
      end
    end
  else  -- a clock that jumped: scan the hash instead of the index range
    local flat = redis.call('HGETALL', key)
    for j = 1, #flat, 2 do
      local b = tonumber(flat[j])
      if b and b < oldest then
        gone = gone + tonumber(flat[j + 1])
        stale[#stale + 1] = flat[j]
      end
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  total = total - gone
  redis.call('HSET', key, 't', total, 'o', oldest)
  return total, oldest, newest, here
end

local function count(key, width, span, amount, total, low, newest, here, current)
  -- Add `amount` (> 0) to bucket `current`, given what prune(..., current) returned.
  if newest and newest > current then
    -- A clock that stepped back counts into the newest bucket: later, never earlier.
    redis.call('HINCRBY', key, string.format('%d', newest), amount)
    redis.call('HSET', key, 't', total + amount)
  else
    local bucket = string.format('%d', current)
    redis.call('HSET', key, bucket, here + amount, 't', total + amount, 'o', low or bucket,
               'n', bucket)
    if newest ~= current then  -- a new bucket: the key must outlive it by a window
      redis.call('PEXPIRE', key, math.ceil((span + 1) * width / 1000) + 1000)
    end
  end
end
"""

# ARGV[1] = now (µs); then per key 4 values: limit, bucket width (µs), span (K), cost.
# Returns {1, <state>} when counted, {0, i, wait_us, <state>} when limit i binds (wait_us =
# -1: never fits); <state> is each key's remaining and reset_us after the check, in order
# (``WindowState``), read by the same script.
_ACQUIRE_LUA = (
    _BUCKETS_LUA
    + """
local function newest_held(key, total, newest, here, current)
  -- The newest bucket that holds anything, given what prune(..., current) returned (nil
  -- for none). A refund may have emptied (deleted) the one 'n' names: then a scan.
  if total <= 0 or not newest then return nil end
  if newest == current then
    if here > 0 then return newest end
  else
    local amount = tonumber(redis.call('HGET', key, string.format('%d', newest)))
    if amount and amount > 0 then return newest end
  end
  local flat = redis.call('HGETALL', key)
  local best = nil
  for j = 1, #flat, 2 do
    local b = tonumber(flat[j])  -- 't', 'o' and 'n' are no bucket
    if b and tonumber(flat[j + 1]) > 0 and (not best or b > best) then best = b end
  end
  return best
end

local function release_wait(key, need, width, span, now)
  -- Oldest buckets first until they hold `need`: the request fits once that one has left.
  local flat = redis.call('HGETALL', key)
  local live = {}
  for j = 1, #flat, 2 do
    local b = tonumber(flat[j])
    if b then live[#live + 1] = {b, tonumber(flat[j + 1])} end
  end
  table.sort(live, function(x, y) return x[1] < y[1] end)
  local freed = 0
  for _, e in ipairs(live) do
    freed = freed + e[2]
    if freed >= need then return (e[1] + span + 1) * width - now end
  end
  return redis.error_reply('rate limit: window holds less than it counts')
end

local now = tonumber(ARGV[1])
local state = {}
local worst, worst_wait = 0, 0
for i = 1, #KEYS do
  local a = 1 + (i - 1) * 4
  local limit = tonumber(ARGV[a + 1])
  local width = tonumber(ARGV[a + 2])
  local span = tonumber(ARGV[a + 3])
  local cost = tonumber(ARGV[a + 4])
  local current = bucket_of(now, width)
  local total, low, newest, here = prune(KEYS[i], current - span, span, current)
  state[i] = {total, low, newest, here, current, limit, width, span, cost}
  if cost > limit then
    if worst == 0 or worst_wait >= 0 then worst, worst_wait = i, -1 end
  elseif total + cost > limit and (worst == 0 or worst_wait >= 0) then
    local wait = release_wait(KEYS[i], total + cost - limit, width, span, now)
    if worst == 0 or wait > worst_wait then worst, worst_wait = i, wait end
  end
end
local out = {1}
if worst > 0 then out = {0, worst - 1, worst_wait} end
for i = 1, #KEYS do
  local s = state[i]
  local total, low, newest, here, current = s[1], s[2], s[3], s[4], s[5]
  local limit, width, span, cost = s[6], s[7], s[8], s[9]
  local held
  if worst == 0 and cost > 0 then
    count(KEYS[i], width, span, cost, total, low, newest, here, current)
    total = total + cost
    held = current  -- counted there, or in the newest if the clock stepped back
    if newest and newest > current then held = newest end
  else
    held = newest_held(KEYS[i], total, newest, here, current)
  end
  local left = limit - total
  out[#out + 1] = left > 0 and left or 0
  out[#out + 1] = held and (held + span + 1) * width - now or 0
end
return out
"""
)
_ACQUIRE_SHA = hashlib.sha1(_ACQUIRE_LUA.encode()).hexdigest()

# ARGV[1] = now (µs), ARGV[2] = admitted at (µs); then per key 3 values: bucket width (µs),
# span (K), delta. No check: a delta > 0 is counted at now like an admission; a delta < 0
# is taken out of the admission's bucket, at most what it holds, while it is still counted
# (a bucket emptied is deleted; 'n' may then name a bucket gone, which every reader takes
# as 0). Returns 1.
_ADJUST_LUA = (
    _BUCKETS_LUA
    + """
local now, admitted = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 1, #KEYS do
  local a = 2 + (i - 1) * 3
  local width = tonumber(ARGV[a + 1])
  local span = tonumber(ARGV[a + 2])
  local delta = tonumber(ARGV[a + 3])
  local current = bucket_of(now, width)
  if delta > 0 then
    local total, low, newest, here = prune(KEYS[i], current - span, span, current)
    count(KEYS[i], width, span, delta, total, low, newest, here, current)
  elseif delta < 0 then
    local bucket = bucket_of(admitted, width)
    if bucket >= current - span then  -- else it left every window: nothing to take back
      local total, _, _, here = prune(KEYS[i], current - span, span, bucket)
      local taken = math.min(here, -delta)
      if taken > 0 then
        local field = string.format('%d', bucket)
        if taken == here then
          redis.call('HDEL', KEYS[i], field)
        else
          redis.call('HSET', KEYS[i], field, here - taken)
        end
        redis.call('HSET', KEYS[i], 't', total - taken)
      end
    end
  end
end
return 1
"""
)
_ADJUST_SHA = hashlib.sha1(_ADJUST_LUA.encode()).hexdigest()


def _window_states(reply: list[Any], start: int) -> list[WindowState]:
    """The (remaining, reset_us) pairs that follow ``reply[start - 1]``."""
    return [(int(reply[i]), int(reply[i + 1])) for i in range(start, len(reply), 2)]


def _escape_key(key: str) -> str:
    """Keep a hash tag intact: braces in a key would end or open it early."""
    if "{" in key or "}" in key or "%" in key:
        return key.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return key


# ---- round trips: one thread, one connection, one pipelined write per batch ------------------


@dataclass(eq=False, slots=True)
class _Call:
    """One command on its way to Redis and back to the event loop that asked."""

    command: tuple[Any, ...]
    script: str | None  # the body behind an EVALSHA (sent again after a NOSCRIPT)
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    backstop: asyncio.TimerHandle | None = None
    answered: bool = False  # set by the thread before the answer is handed to the loop
    expired: bool = False  # set by the loop when the backstop answered it first


class _Broken(Exception):
    """A round trip that failed after ``replies`` (its first replies, in order) came back."""

    def __init__(self, replies: list[Any], error: Exception) -> None:
        super().__init__(str(error))
        self.replies = replies
        self.error = error


class RoundTrips:
    """Sends commands to Redis in pipelined round trips, on a thread of its own.

    The commands queued in one event-loop turn go to the thread together (one hand-off per
    turn); the thread writes everything queued since its last round trip, up to
    ``max_batch`` commands, in one write on its one connection and reads the replies in
    order. N concurrent checks therefore cost one round trip, not N connections: the
    frontend's queueing happens before the write, in the queue, never on the clock.

    The timeout measures Redis alone. It is the socket timeout of that connection: a round
    trip fails when Redis stays silent for ``timeout_s`` while the thread waits for it (to
    connect, to take the write, or for the next bytes of the replies). The clock starts
    when the command is written, on a thread the event loop's own lag cannot hold back
    (a busy loop, or one that holds the GIL, only delays the answer's hand-off, and a
    reply that arrived is read whatever the hand-off cost). Replies that came back before
    a failure keep their answers; the rest of the round trip fails (``StorageError``, with
    its ``reason``). A connection Redis closed (a restart) is opened again once, at once,
    when it failed before any reply. A NOSCRIPT reply (Redis restarted, SCRIPT FLUSH)
    sends SCRIPT LOAD and those commands again in one more round trip.

    Every call is answered: by the thread, or, should the thread never answer (a DNS
    lookup that hangs; ``backstop_s``, far above any round trip), by the loop with a
    ``StorageError``. Use from one event loop at a time.
    """

    def __init__(self, url: str, *, timeout_s: float, max_batch: int = MAX_BATCH) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.timeout_s = timeout_s
        self.max_batch = max_batch
        self.backstop_s = BACKSTOP_S + BACKSTOP_TIMEOUTS * timeout_s
        pool = redis.ConnectionPool.from_url(
            url,
            max_connections=1,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # the one reconnect is ours (``_round_trip``)
            health_check_interval=0,
            driver_info=None,  # no CLIENT SETINFO round trips on connect
        )
        self._pool = pool
        self._connection: Any = None
        self._turn: list[_Call] = []  # queued in this loop turn (loop thread only)
        self._queue: deque[_Call] = deque()  # handed to the thread (under ``_wake``)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.round_trips = 0
        """Round trips sent (a reconnect or a NOSCRIPT resend counts once more)."""
        self.commands = 0
        """Commands sent; ``commands / round_trips`` is the mean batch."""

    def call(self, command: tuple[Any, ...], script: str | None = None) -> asyncio.Future[Any]:
        """Queue ``command``; the future holds its reply, or a ``StorageError``."""
        if self._closed:
            raise StorageError("the rate-limit storage is closed")
        loop = asyncio.get_running_loop()
        call = _Call(command, script, loop.create_future(), loop)
        call.backstop = loop.call_later(self.backstop_s, self._expire, call)
        self._turn.append(call)
        if len(self._turn) == 1:
            loop.call_soon(self._hand_off)
        return call.future

    def _hand_off(self) -> None:
        """End of a loop turn: what it queued goes to the thread, with one wake-up."""
        calls, self._turn = self._turn, []
        with self._wake:
            self._queue.extend(calls)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name="fair-ratelimit-redis", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def _expire(self, call: _Call) -> None:
        """The backstop: the thread never answered (the loop's own timer, far above any
        round trip, so the loop's lag cannot make it fire first for an answered call)."""
        if call.answered or call.future.done():
            return
        call.expired = True
        call.future.set_exception(
            StorageError(f"no answer after {self.backstop_s:g} s", reason="timeout")
        )

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    break
                take = min(len(self._queue), self.max_batch)
                batch = [self._queue.popleft() for _ in range(take)]
            batch = [c for c in batch if not c.expired]  # answered already: never sent
            if not batch:
                continue
            try:
                results = self._round_trip(batch)
            except Exception as err:  # a bug: still answer every call, and keep serving
                log.exception("rate-limit storage: a round trip failed unexpectedly")
                results = [StorageError(f"internal error: {type(err).__name__}")] * len(batch)
            self._answer(batch, results)
        if self._connection is not None:
            self._connection.disconnect()

    def _answer(self, batch: list[_Call], results: list[Any]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Call, Any]]] = {}
        for call, result in zip(batch, results, strict=True):
            call.answered = True
            by_loop.setdefault(call.loop, []).append((call, result))
        for loop, answers in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(_settle, answers)

    def _round_trip(self, batch: list[_Call]) -> list[Any]:
        """Each call's reply or ``StorageError``, in order (never raises)."""
        results: list[Any] = [None] * len(batch)
        todo = list(range(len(batch)))
        reconnected = reloaded = False
        while todo:
            commands = [batch[i].command for i in todo]
            loads: list[tuple[Any, ...]] = []
            if reloaded:  # the scripts Redis lost go first, in the same write
                bodies = dict.fromkeys(s for i in todo if (s := batch[i].script) is not None)
                loads = [("SCRIPT", "LOAD", body) for body in bodies]
            try:
                replies = self._exchange(loads + commands)[len(loads) :]
            except _Broken as broken:
                got = broken.replies[len(loads) :]
                for i, reply in zip(todo, got, strict=False):
                    results[i] = reply
                if not broken.replies and not reconnected and _stale(broken.error):
                    reconnected = True  # Redis closed this connection: once more, anew
                    continue
                failed = StorageError.of(broken.error)
                for i in todo[len(got) :]:
                    results[i] = failed
                break
            for i, reply in zip(todo, replies, strict=True):
                results[i] = reply
            todo = [i for i in todo if isinstance(results[i], NoScriptError)]
            if reloaded:
                break
            reloaded = True
        return [
            StorageError(f"Redis replied {r}", reason="error")
            if isinstance(r, ResponseError)
            else r
            for r in results
        ]

    def _exchange(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """One write of ``commands``, then their replies in order (an error reply is a
        ``ResponseError`` in its place); ``_Broken`` if the connection fails."""
        replies: list[Any] = []
        try:
            if self._connection is None:
                self._connection = self._pool.make_connection()
            connection = self._connection
            self.round_trips += 1
            self.commands += len(commands)
            connection.send_packed_command(connection.pack_commands(commands), check_health=False)
            for _ in commands:
                try:
                    replies.append(connection.read_response())
                except ResponseError as err:
                    replies.append(err)
        except (RedisError, OSError) as err:  # redis-py disconnected it: the next reconnects
            raise _Broken(replies, err) from err
        return replies

    async def close(self) -> None:
        """Answer what is queued, stop the thread, close the connection."""
        if self._turn:
            self._hand_off()
        with self._wake:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
        elif self._connection is not None:
            self._connection.disconnect()
        self._pool.disconnect()


def _settle(answers: list[tuple[_Call, Any]]) -> None:
    """On the loop: hand each call its reply (or error), unless it was answered already."""
    for call, result in answers:
        if call.backstop is not None:
            call.backstop.cancel()
        if call.future.done():
            continue
        if isinstance(result, StorageError):
            call.future.set_exception(result)
        else:
            call.future.set_result(result)


def _stale(error: Exception) -> bool:
    """A connection error (refused, reset, closed by Redis), not a timeout: worth one
    immediate reconnect."""
    return isinstance(error, RedisConnectionError | OSError) and not isinstance(
        error, RedisTimeoutError | TimeoutError
    )


class RedisStorage:
    """Counters in Redis, shared by every replica; one atomic Lua script per check.

    Checks go to Redis in pipelined round trips (``RoundTrips``): the checks of one
    event-loop turn, and any queued while a round trip is in flight, share one write and
    one connection. Each script stays atomic on the server and exact; nothing is merged.
    A round trip fails when Redis stays silent for ``timeout_s`` (measured on the
    connection's socket, from the write: the frontend's own queueing and its loop's lag
    never count), or on a connection error; each of its checks then raises
    ``StorageError`` and the limiter applies the configured mode to that check alone. A
    check that failed may or may not have been counted. The client reconnects by itself
    once Redis answers again; a Redis restarted without persistence starts counting from
    zero.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        buckets: int = DEFAULT_BUCKETS,
        prefix: str = REDIS_KEY_PREFIX,
        max_batch: int = MAX_BATCH,
    ) -> None:
        if buckets < 1:
            raise ValueError("buckets must be >= 1")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.buckets = buckets
        self.timeout_s = timeout_s
        self._prefix = prefix
        self.round_trips = RoundTrips(url, timeout_s=timeout_s, max_batch=max_batch)
        self._names: dict[tuple[str, str, float], tuple[str, int]] = {}

    def key_name(self, key: str, item: RateLimitItem) -> str:
        """The Redis key of one limit's buckets: ``rl:{<key>}:<unit>:<window µs>:<width µs>``.

        The bucket width is part of the name so that a change of K never misreads buckets.
        """
        return self._name(key, item)[0]

    def _name(self, key: str, item: RateLimitItem) -> tuple[str, int]:
        cache_key = (key, item.unit, item.seconds)
        found = self._names.get(cache_key)
        if found is None:
            width = bucket_width_us(item.seconds, self.buckets)
            name = (
                f"{self._prefix}:{{{_escape_key(key)}}}:{item.unit}:"
                f"{round(item.seconds * 1_000_000)}:{width}"
            )
            found = (name, width)
            if len(self._names) < 100_000:  # a bounded cache of names, not of state
                self._names[cache_key] = found
        return found

    async def acquire(
        self, key: str, items: Sequence[RateLimitItem], costs: Sequence[int], now_us: int
    ) -> Checked:
        keys: list[str] = []
        args: list[int] = [now_us]
        for item, cost in zip(items, costs, strict=True):
            name, width = self._name(key, item)
            keys.append(name)
            args += (item.amount, width, self.buckets, cost)
        reply = await self.round_trips.call(
            ("EVALSHA", _ACQUIRE_SHA, len(keys), *keys, *args), _ACQUIRE_LUA
        )
        if reply[0] == 1:
            return None, _window_states(reply, 1)
        wait = int(reply[2])
        return Rejection(int(reply[1]), None if wait < 0 else wait), _window_states(reply, 3)

    async def adjust(
        self,
        key: str,
        items: Sequence[RateLimitItem],
        deltas: Sequence[int],
        admitted_us: int,
        now_us: int,
    ) -> None:
        keys: list[str] = []
        args: list[int] = [now_us, admitted_us]
        for item, delta in zip(items, deltas, strict=True):
            if delta:
                name, width = self._name(key, item)
                keys.append(name)
                args += (width, self.buckets, delta)
        if keys:
            await self.round_trips.call(
                ("EVALSHA", _ADJUST_SHA, len(keys), *keys, *args), _ADJUST_LUA
            )

    async def ping(self) -> None:
        """Raise ``StorageError`` unless Redis answers within the timeout (readiness)."""
        await self.round_trips.call(("PING",))

    async def close(self) -> None:
        await self.round_trips.close()


def storage_from_uri(
    uri: str = DEFAULT_RATELIMIT_STORAGE,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    buckets: int = DEFAULT_BUCKETS,
) -> MemoryStorage | RedisStorage:
    """``memory://`` (one replica) or ``redis://host:port[/db]`` / ``rediss://`` (shared)."""
    scheme = urlsplit(uri).scheme
    if scheme == "memory":
        return MemoryStorage(buckets=buckets)
    if scheme in ("redis", "rediss", "unix"):
        return RedisStorage(uri, timeout_s=timeout_s, buckets=buckets)
    raise ValueError(
        f"unsupported rate-limit storage {scheme + '://' if scheme else uri!r}: "
        "use memory:// or redis://host:port[/db]"
    )
