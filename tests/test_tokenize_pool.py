"""The tokenising pool (``tokens.TokenCounter``): pieces fed from one queue per tenant,
round robin, on a pool as large as the cores; and the tokenizer's own threads off.

The jobs here are gated (each waits until the test opens its gate), so the order in which
pieces start is decided by the pool alone, never by how fast this machine runs them: the
tests read the order the pool started them in, not times.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from fair_frontend.kit.testing import aeventually
from fair_frontend.tokens import (
    MAX_TOKENIZE_THREADS,
    TokenCounter,
    load_tokenizer,
    tokenize_threads,
)
from tests.support import ROOT

TOKENIZER = str(ROOT / "model_repository" / "llm" / "tokenizer.json")
WAIT_S = 30.0


class Gates:
    """Jobs that record when they start and wait for the test to let them end."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._gates: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def job(self, label: str) -> str:
        with self._lock:
            self.started.append(label)
            gate = self._gates.setdefault(label, threading.Event())
        if not gate.wait(WAIT_S):
            raise TimeoutError(f"{label} was never let go")
        return label

    def open(self, label: str) -> None:
        with self._lock:
            self._gates.setdefault(label, threading.Event()).set()

    async def running(self, count: int) -> None:
        await aeventually(lambda: len(self.started) >= count, WAIT_S, 0.005, what="pieces started")


@pytest.fixture
def pool() -> Iterator[TokenCounter]:
    counter = TokenCounter(threads=1)
    try:
        yield counter
    finally:
        counter.close()


async def test_another_tenant_waits_for_one_piece_not_for_a_whole_job(
    pool: TokenCounter,
) -> None:
    """One thread: tenant a's job of six pieces has started; b's one piece goes next,
    after a's first, not after all six."""
    gates = Gates()
    a = asyncio.ensure_future(pool.map("a", [(gates.job, f"a{i}") for i in range(6)]))
    await gates.running(1)
    b = asyncio.ensure_future(pool.map("b", [(gates.job, "b0")]))
    await asyncio.sleep(0)
    gates.open("a0")
    await gates.running(2)
    assert gates.started == ["a0", "b0"]
    for label in ["b0", *(f"a{i}" for i in range(1, 6))]:
        gates.open(label)
    assert await b == ["b0"]
    assert await a == [f"a{i}" for i in range(6)]  # a's own order kept
    assert gates.started == ["a0", "b0", "a1", "a2", "a3", "a4", "a5"]
    assert pool.started == {"a": 6, "b": 1}
    assert len(pool) == 0


async def test_tenants_take_turns_piece_by_piece(pool: TokenCounter) -> None:
    gates = Gates()
    jobs = {t: [(gates.job, f"{t}{i}") for i in range(3)] for t in ("a", "b", "c")}
    calls = [asyncio.ensure_future(pool.map(t, jobs[t])) for t in ("a", "b", "c")]
    order = ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]
    for n, label in enumerate(order, start=1):
        await gates.running(n)
        gates.open(label)
    await asyncio.gather(*calls)
    assert gates.started == order


async def test_negative_control_one_fifo_queue_serves_the_whole_job_first() -> None:
    """The same arrival through one queue for everyone (every job under one name): b's
    piece waits behind all six of a's. The order the round robin prevents."""
    counter = TokenCounter(threads=1)
    gates = Gates()
    try:
        a = asyncio.ensure_future(counter.map("all", [(gates.job, f"a{i}") for i in range(6)]))
        await gates.running(1)
        b = asyncio.ensure_future(counter.map("all", [(gates.job, "b0")]))
        for n, label in enumerate([f"a{i}" for i in range(6)], start=1):
            await gates.running(n)
            gates.open(label)
        await gates.running(7)
        gates.open("b0")
        await asyncio.gather(a, b)
        assert gates.started.index("b0") == 6
    finally:
        counter.close()


async def test_a_tenant_alone_has_every_thread() -> None:
    counter = TokenCounter(threads=3)
    gates = Gates()
    try:
        job = asyncio.ensure_future(counter.map("a", [(gates.job, f"a{i}") for i in range(5)]))
        await gates.running(3)  # three at once: nobody else waits
        assert len(counter) == 2
        for i in range(5):
            gates.open(f"a{i}")
        assert await job == [f"a{i}" for i in range(5)]
    finally:
        counter.close()


async def test_a_cancelled_job_drops_its_pieces_not_started(pool: TokenCounter) -> None:
    gates = Gates()
    a = asyncio.ensure_future(pool.map("a", [(gates.job, f"a{i}") for i in range(5)]))
    await gates.running(1)
    a.cancel()
    b = asyncio.ensure_future(pool.map("b", [(gates.job, "b0")]))
    gates.open("a0")  # the running piece ends (a thread cannot be stopped)
    await gates.running(2)
    gates.open("b0")
    assert await b == ["b0"]
    assert gates.started == ["a0", "b0"]  # a1..a4 never ran
    assert len(pool) == 0
    with pytest.raises(asyncio.CancelledError):
        await a


async def test_a_failed_piece_fails_its_job_and_drops_the_rest(pool: TokenCounter) -> None:
    gates = Gates()

    def bad() -> None:
        raise ValueError("not a text")

    job = asyncio.ensure_future(pool.map("a", [(bad,), (gates.job, "a1"), (gates.job, "a2")]))
    with pytest.raises(ValueError, match="not a text"):
        await job
    assert await pool.map("b", [(len, "abc")]) == [3]  # the pool goes on
    assert gates.started == [] and len(pool) == 0


async def test_counts_are_the_tokenizers_piece_by_piece() -> None:
    counter = TokenCounter(threads=2, piece_bytes=64)
    texts = [f"text number {i} " * (1 + i % 7) for i in range(40)]
    try:
        counts = await counter.count("a", TOKENIZER, texts)
    finally:
        counter.close()
    expected = [len(e.ids) for e in load_tokenizer(TOKENIZER).encode_batch(texts, False)]
    assert counts == expected
    assert counter.started["a"] > 1  # in several pieces


def test_the_pool_is_as_large_as_the_cores_this_process_may_use() -> None:
    cores = len(os.sched_getaffinity(0))
    assert tokenize_threads() == max(1, min(cores, MAX_TOKENIZE_THREADS))
    counter = TokenCounter()
    try:
        assert counter.threads == tokenize_threads()
    finally:
        counter.close()


def test_the_tokenizer_runs_a_batch_on_the_calling_thread_only() -> None:
    """With ``fair_frontend.tokens`` imported, a large ``encode_batch`` starts no threads
    of its own (the tokenizers library's rayon pool, which would run a piece on every
    core): the process has as many threads after as before. In a fresh interpreter (the
    pool is made on the first parallel batch, once per process)."""
    script = f"""
import os
import fair_frontend.tokens as tokens
def threads():
    return len(os.listdir("/proc/self/task"))
tok = tokens.load_tokenizer({TOKENIZER!r})
before = threads()
tok.encode_batch(["some words to split here " * 200] * 256, add_special_tokens=False)
print(before, threads(), os.environ.get("TOKENIZERS_PARALLELISM"))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split()
    before, after, setting = int(out[0]), int(out[1]), out[2]
    assert setting == "false"
    assert after == before, f"the tokenizer started {after - before} threads of its own"
