"""The link's frames, however TCP cuts them: ``Framed.data_received`` takes the records of a
byte stream in order, each once, whatever the sizes of the reads it comes in; heartbeats
(empty frames) carry nothing. A frame over the bound, or one that does not decode, ends
the connection, and what came before it is taken first, in every cut of the stream alike:
which records of a shell the core counts (a report of rows served, a cancel) must not
depend on how the kernel happened to split the bytes.
"""

from __future__ import annotations

import itertools
from typing import Any

import hypothesis.strategies as st
from hypothesis import example, given, settings

from fair_frontend.wire.framing import HEARTBEAT, Framed, encode, to_core
from fair_frontend.wire.records import Cancel, Hello

MAX_FRAME = 64  # this test's bound on a frame from the peer


class _Transport:
    def __init__(self) -> None:
        self.closed = False

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


class Recorder(Framed):
    decoder = to_core
    max_frame = MAX_FRAME

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Any] = []
        self.connection_made(_Transport())  # type: ignore[arg-type]

    def received(self, record: Any) -> None:
        assert not self.closed, "a record taken after the connection was closed"
        self.records.append(record)


GOOD = st.one_of(
    st.builds(Cancel, st.integers(min_value=0, max_value=2**63 - 1)),
    st.builds(Hello, st.integers(0, 64), st.integers(1, 2**22), st.integers(0, 9)),
)
# What a stream may hold: records, heartbeats, and (rarely) a frame over the bound or
# bytes that are no record.
ITEM = st.one_of(
    GOOD.map(lambda r: ("record", r)),
    st.just(("beat", None)),
    st.just(("too_large", None)),
    st.binary(min_size=1, max_size=8).map(lambda b: ("garbage", b)),
)


def _frames(items: list[tuple[str, Any]]) -> tuple[bytes, list[Any], bool]:
    """The stream's bytes, the records a reader must take from it, and whether it must
    close the connection (at the first bad frame: nothing after it is taken)."""
    data = b""
    expected: list[Any] = []
    bad = False
    for kind, value in items:
        if kind == "record":
            data += encode(value)
            if not bad:
                expected.append(value)
        elif kind == "beat":
            data += HEARTBEAT
        elif kind == "too_large":
            data += (MAX_FRAME + 1).to_bytes(4, "big") + bytes(MAX_FRAME + 1)
            bad = True
        else:
            data += len(value).to_bytes(4, "big") + b"\xc1" + value[1:]  # 0xc1: never msgpack
            bad = True
    return data, expected, bad


def _cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


@settings(max_examples=300, deadline=None)
@given(items=st.lists(ITEM, max_size=12), cuts=st.lists(st.integers(0, 10_000), max_size=12))
@example(  # a good record and a frame over the bound in one read: the record is taken
    items=[("record", Cancel(7)), ("too_large", None)], cuts=[]
)
@example(  # the same, the bad frame's header in a read of its own
    items=[("record", Cancel(7)), ("too_large", None)], cuts=[6]
)
@example(items=[("record", Cancel(1)), ("garbage", b"x"), ("record", Cancel(2))], cuts=[])
def test_every_cut_of_a_stream_gives_the_same_records(
    items: list[tuple[str, Any]], cuts: list[int]
) -> None:
    data, expected, bad = _frames(items)
    reader = Recorder()
    for chunk in _cut(data, cuts):
        if reader.closed:
            break
        reader.data_received(chunk)
    assert reader.records == expected
    assert reader.closed == bad
    assert reader.transport is not None and reader.transport.closed == bad  # type: ignore[attr-defined]
    # Nothing is left to read again: the stream ended on a frame's end, or was cut off.
    assert reader._buffer == bytearray()
