"""The shell's reader of Triton's generate_stream (``fair_frontend.backends.triton.sse``) and
what the gateway reads of the events (their token counts, an error event).

The wire's failure modes (a kept-alive connection Triton closed while it was idle, a
connection lost mid-body, a refused connection) cannot be made to happen on cue with the
real Triton, so these tests put a small HTTP server of their own in its place, speaking
exactly the bytes Triton's HTTP server writes (recorded from Triton 2.51: one chunk per
event). The real Triton's events, byte for byte, are ``tests/test_generate_http.py``'s.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fair_frontend.backends.triton.embedded import free_port
from fair_frontend.backends.triton.sse import Events, TritonEvents, _EventConnection, error_message
from fair_frontend.backends.triton.watchdog import NoProgress
from fair_frontend.errors import FrontendError, StalledStream, Unavailable
from fair_frontend.shell.process import forwarders
from fair_frontend.shell.relay import _EventCounts
from fair_frontend.wire.records import Settings

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
CHUNKED = HEAD + b"Transfer-Encoding: chunked\r\n\r\n"


def event(text: str, tokens: int = 1) -> bytes:
    return (
        b'data: {"model_name":"llm","model_version":"1","num_output_tokens":%d,'
        b'"text_output":"%s"}\n\n' % (tokens, text.encode())
    )


def chunked(*events: bytes) -> bytes:
    """Triton's answer: each event one chunk, then the last chunk."""
    return CHUNKED + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.paused = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


async def _read_all(conn: _EventConnection) -> list[bytes]:
    got = []
    while (data := await conn.take()) is not None:
        got.append(data)
    return got


@settings(max_examples=200, deadline=None)
@given(
    texts=st.lists(st.text(alphabet="ab \u00e9{}:,", max_size=12), min_size=1, max_size=8),
    cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=12),
)
def test_events_come_whole_however_the_bytes_are_cut(texts: list[str], cuts: list[int]) -> None:
    """Each read returns whole events only, every event once and in order, and the end of
    the body is found, wherever TCP cut Triton's chunks."""
    events = [event(t) for t in texts]
    wire = chunked(*events)

    async def run() -> list[bytes]:
        conn = _EventConnection()
        conn.connection_made(_Transport())
        loop = asyncio.get_running_loop()
        at = 0
        for cut in sorted(set(cuts)):
            if at < cut < len(wire):
                loop.call_soon(conn.data_received, wire[at:cut])
                at = cut
        loop.call_soon(conn.data_received, wire[at:])
        assert await conn.head() == 200
        got = await _read_all(conn)
        assert conn.done and conn.keep_alive
        return got

    got = asyncio.run(run())
    assert all(g.endswith(b"\n\n") for g in got)
    assert b"".join(got) == b"".join(events)


def test_a_reader_that_falls_behind_pauses_the_connection_until_it_catches_up() -> None:
    async def run() -> None:
        conn = _EventConnection()
        transport = _Transport()
        conn.connection_made(transport)
        conn.data_received(CHUNKED)
        big = event("x" * 1000)
        for _ in range(400):  # ~440 KB held, past HIGH_WATER
            conn.data_received(b"%x\r\n%s\r\n" % (len(big), big))
        assert transport.paused
        assert await conn.take() is not None
        assert not transport.paused

    asyncio.run(run())


# ---- against a stand-in for Triton's HTTP server ------------------------------------------


@asynccontextmanager
async def stand_in(
    answer: Callable[[int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool | None]],
) -> AsyncIterator[str]:
    """An HTTP server on a free loopback port; ``answer(n, reader, writer)`` serves the
    n-th request (0-based) after its head and body were read."""
    count = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                n = count
                count += 1
                if await answer(n, reader, writer) is False:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.close()


async def collect(client: TritonEvents, **kw: Any) -> list[Events]:
    stream = client.stream("llm", "", b'{"text_input":"hi"}', **kw)
    try:
        return [e async for e in stream]
    finally:
        await stream.aclose()


async def test_a_stream_ends_cleanly_and_its_connection_serves_the_next() -> None:
    async def answer(n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(chunked(event("a"), event("b", 4)))
        await w.drain()

    async with stand_in(answer) as url:
        client = TritonEvents(url)
        for _ in range(3):
            got = await collect(client)
            assert [e.error for e in got] == [None] * len(got)
            assert b"".join(e.data for e in got) == event("a") + event("b", 4)
        assert client.connections == 1  # kept alive
        await client.close()


async def test_a_kept_alive_connection_closed_by_triton_sends_the_stream_again() -> None:
    """Triton closed the idle connection as the next request went out on it: nothing of
    the answer came, so the request goes once more on a new connection."""

    async def answer(n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        if n == 1:
            return False  # read the second request, close without a byte
        w.write(chunked(event("a")))
        await w.drain()
        return True

    async with stand_in(answer) as url:
        client = TritonEvents(url)
        assert b"".join(e.data for e in await collect(client)) == event("a")
        got = await collect(client)
        assert [e.error for e in got] == [None]
        assert got[0].data == event("a")
        assert client.connections == 2
        await client.close()


async def test_a_connection_lost_mid_stream_ends_it_unavailable() -> None:
    async def answer(n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(CHUNKED + b"%x\r\n%s\r\n" % (len(event("a")), event("a")))
        await w.drain()
        return False

    async with stand_in(answer) as url:
        got = await collect(TritonEvents(url))
    assert got[0].data == event("a")
    assert isinstance(got[-1].error, Unavailable) and not got[-1].error.never_sent


async def test_a_triton_not_listening_is_never_sent() -> None:
    got = await collect(TritonEvents(f"127.0.0.1:{free_port()}"))
    assert len(got) == 1
    assert isinstance(got[0].error, Unavailable) and got[0].error.never_sent


async def test_an_error_before_any_event_has_tritons_status_and_message() -> None:
    body = b'data: {"error":"the prompt is too long"}\n\n'

    async def answer(n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await w.drain()

    async with stand_in(answer) as url:
        got = await collect(TritonEvents(url))
    assert len(got) == 1 and got[0].error is not None
    assert (got[0].error.http_status, got[0].error.message) == (400, "the prompt is too long")


async def test_a_stopped_stream_ends_with_its_reason_and_closes_the_connection() -> None:
    closed = asyncio.Event()

    async def answer(n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(CHUNKED + b"%x\r\n%s\r\n" % (len(event("a")), event("a")))
        await w.drain()
        await r.read()  # the client's close: Triton cancels the request then
        closed.set()
        return False

    async with stand_in(answer) as url:
        stream = TritonEvents(url).stream("llm", "", b"{}", stalled_s=None)
        heard: list[FrontendError] = []
        stream.on_stop = heard.append
        items = aiter(stream)
        assert (await anext(items)).data == event("a")
        reason = StalledStream(1.0)
        stream.stop(reason)
        assert heard == [reason]
        assert (await anext(items)).error is reason
        await asyncio.wait_for(closed.wait(), 10)
        await stream.aclose()


# ---- what the gateway reads of the events --------------------------------------------------


def test_the_count_is_read_and_taken_out_wherever_the_key_stands() -> None:
    read = _EventCounts("num_output_tokens")
    events = (
        event("a", 4)
        + b'data: {"num_output_tokens":[3],"text_output":"b"}\n\n'
        # the key's text inside a string is not the key (its quotes are escaped there)
        + b'data: {"model_name":"llm","num_output_tokens":1,'
        b'"text_output":"\\"num_output_tokens\\":9"}\n\n'
        + b'data: {"text_output":"no count: one token"}\n\n'
    )
    assert read(events, hide=False) == (4 + 3 + 1 + 1, events)
    assert read(events, hide=True) == (
        9,
        b'data: {"model_name":"llm","model_version":"1","text_output":"a"}\n\n'
        b'data: {"text_output":"b"}\n\n'
        b'data: {"model_name":"llm","text_output":"\\"num_output_tokens\\":9"}\n\n'
        b'data: {"text_output":"no count: one token"}\n\n',
    )


# An event as Triton writes it: its outputs in order, the count among them (bare or a
# one-element list, any value, first, between or last), texts that may spell the key.
_texts = st.sampled_from(["a", " b", '\\"num_output_tokens\\":1,', "1,", "", "\\n"])
_counts = st.one_of(
    st.none(),
    st.integers(-2, 40).map(str),
    st.integers(0, 9).map(lambda n: f"[{n}]"),
    st.just("1"),
)


@st.composite
def _events(draw: st.DrawFn) -> bytes:
    out = []
    for _ in range(draw(st.integers(1, 6))):
        fields = ['"model_name":"llm"', f'"text_output":"{draw(_texts)}"']
        count = draw(_counts)
        if count is not None:
            fields.insert(draw(st.integers(0, 2)), f'"num_output_tokens":{count}')
        out.append(("data: {" + ",".join(fields) + "}\n\n").encode())
    return b"".join(out)


@settings(max_examples=300)
@given(_events(), st.booleans())
def test_a_token_per_event_is_read_as_the_patterns_read_it(events: bytes, hide: bool) -> None:
    """The one-per-event path (two scans) reads and strips exactly as the patterns do,
    whatever the events: it is taken only where it can be."""
    read = _EventCounts("num_output_tokens")
    assert read(events, hide) == read.general(events, hide)
    n, _ = read(events, hide)
    each = [json.loads(e[len(b"data: ") :]) for e in events.split(b"\n\n") if e]
    assert n == sum(max(0, int(str(e.get("num_output_tokens", 1)).strip("[]"))) for e in each)


def test_an_error_event_gives_its_message() -> None:
    assert error_message(b'data: {"error":"Request was cancelled"}\n\n') == "Request was cancelled"
    assert error_message(b"data: {not json\n\n") == "{not json"


async def test_a_shell_process_streams_from_each_tritons_http_address() -> None:
    """The core's settings carry each Triton's HTTP address to the shell processes, which
    read generate_stream's events there (and only where a Triton has one)."""
    sent = Settings({}, {}, "a:1", ["a:1", "b:1"], ["a:2", ""])
    made = forwarders(sent, 5.0)
    try:
        assert [f.events is not None for f in made] == [True, False]
        assert isinstance(made[0].events, TritonEvents) and made[0].events.port == 2
    finally:
        for f in made:
            await f.close()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_request_json_cannot_carry_goes_over_grpc(bad: float) -> None:
    import numpy as np

    from fair_frontend.protocol import Tensor
    from fair_frontend.shell.generate_codec import encode_generate_request

    text = Tensor("text_input", "BYTES", (1,), np.array([b"hi"], dtype=object))
    assert encode_generate_request([text], {"a": 1}, "r") == b'{"id":"r","a":1,"text_input":"hi"}'
    assert encode_generate_request([text], {"a": bad}, "") is None
    raw = Tensor("text_input", "BYTES", (1,), np.array([b"\xff"], dtype=object))
    assert encode_generate_request([raw], {}, "") is None
    nul = Tensor("text_input", "BYTES", (1,), np.array([b"a\x00"], dtype=object))
    assert encode_generate_request([nul], {}, "") is None


def test_a_grpc_response_left_serialized_gives_its_count_and_drops_it() -> None:
    """What the shell reads of Triton's ModelStreamInfer messages it passes on: the count
    output alone (one integer read as it is, a longer one summed, a negative one as 0),
    and that output taken out with its raw contents, nothing else."""
    import struct

    from tritonclient.grpc import service_pb2

    from fair_frontend.grpc_codec import drop_output, output_tokens_said

    msg = service_pb2.ModelInferResponse(model_name="llm")
    msg.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    msg.raw_output_contents.append(b"\x01\x00\x00\x00a")
    count = msg.outputs.add(name="num_output_tokens", datatype="INT32", shape=[1])
    msg.raw_output_contents.append(struct.pack("<i", 4))
    assert output_tokens_said(msg, "num_output_tokens") == 4
    msg.raw_output_contents[1] = struct.pack("<i", -3)
    assert output_tokens_said(msg, "num_output_tokens") == 0
    count.datatype = "UINT64"
    msg.raw_output_contents[1] = struct.pack("<Q", 2**40)
    assert output_tokens_said(msg, "num_output_tokens") == 2**40
    count.datatype, count.shape[:] = "INT32", [2]
    msg.raw_output_contents[1] = struct.pack("<ii", 2, 3)
    assert output_tokens_said(msg, "num_output_tokens") == 5
    assert output_tokens_said(msg, "text_output_length") is None
    drop_output(msg, "num_output_tokens")
    assert [o.name for o in msg.outputs] == ["text_output"]
    assert list(msg.raw_output_contents) == [b"\x01\x00\x00\x00a"]
    assert output_tokens_said(msg, "num_output_tokens") is None


async def test_a_consumer_that_holds_an_event_past_stalled_s_has_the_stream_stopped() -> None:
    """Its client stopped reading: after ``stalled_s`` the request is cancelled in Triton
    (the connection closed) and the slot's owner hears of it at once, not at the next read."""
    closed = asyncio.Event()

    async def answer(n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(CHUNKED)
        for _ in range(50):
            w.write(b"%x\r\n%s\r\n" % (len(event("a")), event("a")))
        await w.drain()
        await r.read()
        closed.set()
        return False

    async with stand_in(answer) as url:
        stream = TritonEvents(url).stream("llm", "", b"{}", stalled_s=0.3)
        heard: list[FrontendError] = []
        stream.on_stop = heard.append
        items = aiter(stream)
        assert (await anext(items)).data.startswith(event("a"))
        await asyncio.wait_for(closed.wait(), 10)  # held, not read: stopped in ~0.3-0.4 s
        assert len(heard) == 1 and isinstance(heard[0], StalledStream)
        assert (await anext(items)).error is heard[0]
        await stream.aclose()


async def test_a_triton_silent_for_request_timeout_s_ends_the_stream() -> None:
    async def answer(n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(CHUNKED)  # the head, then nothing
        await w.drain()
        await r.read()
        return False

    async with stand_in(answer) as url:
        got = await collect(TritonEvents(url, request_timeout_s=0.3))
    assert len(got) == 1 and isinstance(got[0].error, NoProgress)
