"""The log writer (``fair_frontend.observability.logs``): the lines of one event-loop turn
go out in one write (a core logs a line per finished request: one write per request was a
write system call each on its hot path); a record where no loop runs goes out at once;
``flush`` (and ``logging.shutdown`` at exit) writes what is held; each line is one JSON
object."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest

from fair_frontend.observability.logs import FLUSH_LINES, JsonFormatter, TurnStreamHandler


class Writes(io.StringIO):
    """A stream that records each write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


@pytest.fixture
def logger() -> Iterator[tuple[logging.Logger, Writes]]:
    stream = Writes()
    handler = TurnStreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("tests.turn_handler")
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    yield log, stream
    log.handlers[:] = []


async def test_the_lines_of_one_turn_go_out_in_one_write_after_the_turn(
    logger: tuple[logging.Logger, Writes],
) -> None:
    log, stream = logger
    for i in range(5):
        log.info("line %d", i, extra={"request_id": f"r{i}"})
    assert stream.writes == []  # held until the turn ends
    await asyncio.sleep(0)  # the turn ends: the handler's flush runs
    assert len(stream.writes) == 1
    docs = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [d["msg"] for d in docs] == [f"line {i}" for i in range(5)]
    assert [d["request_id"] for d in docs] == [f"r{i}" for i in range(5)]
    log.info("next turn")
    await asyncio.sleep(0)
    assert len(stream.writes) == 2 and json.loads(stream.writes[1])["msg"] == "next turn"


async def test_a_full_hold_goes_out_at_once(logger: tuple[logging.Logger, Writes]) -> None:
    log, stream = logger
    for i in range(FLUSH_LINES + 1):
        log.info("line %d", i)
    assert len(stream.writes) == 1  # the FLUSH_LINES-th line wrote them all
    assert stream.getvalue().count("\n") == FLUSH_LINES
    await asyncio.sleep(0)
    assert stream.getvalue().count("\n") == FLUSH_LINES + 1


def test_without_a_loop_a_line_goes_out_at_once_and_flush_writes_what_is_held(
    logger: tuple[logging.Logger, Writes],
) -> None:
    log, stream = logger
    log.info("no loop here")
    assert len(stream.writes) == 1 and json.loads(stream.writes[0])["msg"] == "no loop here"

    async def held() -> None:
        log.info("held")
        log.handlers[0].flush()  # as logging.shutdown does at exit
        assert json.loads(stream.writes[-1])["msg"] == "held"

    asyncio.run(held())
    assert len(stream.writes) == 2  # the turn's own flush found nothing more to write
