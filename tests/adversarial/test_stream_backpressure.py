"""Hostile gRPC streams: bounded by what the client reads, gone when the client is.

Issue 11, item 2. ``ModelStreamInfer`` handles at most ``server.grpc_stream_max_inflight``
requests of a stream at once and buffers at most ``REPLY_BUFFER`` replies the client has
not read; beyond, it stops reading the stream, and gRPC's flow control holds the client
back. So:

- a client that sends and never reads gets only a bounded number of requests admitted,
  its writes stall, the shell's memory stays bounded, and another tenant is served;
- a stream without a valid key ends UNAUTHENTICATED before any message is read;
- a client that vanishes (killed, its connection reset) leaves nothing queued or running
  in the core: each of its requests ends once, dispatched or cancelled;
- a stream whose read fails (a message over gRPC's receive limit) ends, and its queued
  requests are cancelled.

Issue 17, item 6: the answers of one decoupled request are bounded too. A client that
stops reading a stream of many large parts (gRPC, or HTTP SSE ``/generate_stream``) has
at most the one part its shell is writing waiting for it (beyond the transports' own
buffers and the gRPC stream's reply buffer): the shell, which relays the stream from
Triton itself (one hop), stops reading it, and after ``queues.stalled_stream_s`` without
a part taken the request is cancelled in Triton and ends CANCELLED, once. A client that
reads slowly gets every part.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import parse_config
from fair_frontend.kit.testing import aeventually
from fair_frontend.scheduler import Counters
from fair_frontend.server import ShellPool
from fair_frontend.shell.grpc_server import REPLY_BUFFER
from tests.support import (
    KEYS,
    RunningFrontend,
    config_dict,
    identity_request,
    running_frontend,
)

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
HOG = (("authorization", f"Bearer {KEYS['acme']}"),)
QUIET = (("authorization", f"Bearer {KEYS['globex']}"),)
MAX_INFLIGHT = 8  # server.grpc_stream_max_inflight here
REPLY_BYTES = 200_000  # what simple_identity echoes to the hog, per request
HOG_REQUESTS = 600  # 120 MB of replies, were they all held for a client that never reads
# The shells' memory may grow by what the bounds allow (the buffer, the requests in
# flight, gRPC's windows: about 25 MB of these replies), far below what the hog sends.
RSS_GROWTH_LIMIT = 60 << 20
# Replies gRPC itself carries towards the client before flow control stops it (its
# windows grow to a few MiB on loopback): beyond the frontend's own bounds.
IN_TRANSIT = (8 << 20) // REPLY_BYTES
ANSWER_TIMEOUT_S = 10.0  # far above what a refusal takes
SETTLE_S = 60.0  # deadline of a condition polled on the core; met far sooner


REQUEST_BYTES = 512 << 10  # every endpoint's max_request_bytes here
# Over gRPC's own receive limit here (the largest endpoint's bound): reading it fails.
OVER_TRANSPORT_LIMIT = 3 * REQUEST_BYTES + (1 << 20)


def stream_config() -> dict[str, Any]:
    """Test tenants, a small in-flight bound per stream, and every endpoint's requests
    small (so gRPC's own limit is a few MiB)."""
    data = config_dict()
    data["server"] = {**data.get("server", {}), "grpc_stream_max_inflight": MAX_INFLIGHT}
    for endpoint in data["endpoints"].values():
        endpoint["max_request_bytes"] = REQUEST_BYTES
    data["default_endpoint"] = {**data["default_endpoint"], "max_request_bytes": REQUEST_BYTES}
    return data


@pytest.fixture(scope="module")
def streams(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    with running_frontend(parse_config(stream_config()), triton, workers=workers) as running:
        yield running


def _sleeper(tokens: int) -> bytes:
    msg = service_pb2.ModelInferRequest(model_name="sleeper")
    msg.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, tokens])
    msg.raw_input_contents.append(np.ones(tokens, dtype="<i4").tobytes())
    return msg.SerializeToString()


def _embed() -> bytes:
    msg = service_pb2.ModelInferRequest(model_name="embed")
    msg.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, 8])
    msg.raw_input_contents.append(np.arange(8, dtype="<i4").tobytes())
    return msg.SerializeToString()


def _open_stream(channel: grpc.aio.Channel, metadata: Any) -> Any:
    method = channel.stream_stream(
        STREAM,
        request_serializer=None,
        response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
    )
    return method(metadata=metadata)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _shell_pids(fe: RunningFrontend) -> list[int]:
    shells = fe.server.shells
    assert shells is None or isinstance(shells, ShellPool)  # none, or this process's
    return [os.getpid()] if shells is None else [p.pid for p in shells.processes.values()]


async def _counters(fe: RunningFrontend, model: str) -> Counters:
    async def read() -> Counters:
        return fe.frontend.runtimes[model].scheduler.counters

    counters: Counters = await fe.acall(read())
    return counters


async def _idle(fe: RunningFrontend, model: str) -> bool:
    async def read() -> bool:
        return bool(fe.frontend.runtimes[model].idle)

    return bool(await fe.acall(read()))


async def test_a_client_that_never_reads_is_held_back_and_others_are_served(
    triton: EmbeddedTriton,
) -> None:
    """Two shell processes, so the shells' memory is theirs alone."""
    config = parse_config(stream_config())
    with running_frontend(config, triton, workers=2) as fe:
        async with (
            grpc.aio.insecure_channel(fe.grpc_url) as hog_channel,
            grpc.aio.insecure_channel(fe.grpc_url) as quiet_channel,
        ):
            hog = _open_stream(hog_channel, HOG)
            # One answered request: the model is known, the shells warm.
            await hog.write(identity_request(b"w" * 10))
            assert not (await hog.read()).error_message
            before = await _counters(fe, "simple_identity")
            pids = _shell_pids(fe)
            rss_before = sum(_rss(p) for p in pids)
            body = identity_request(b"h" * REPLY_BYTES)

            async def flood() -> None:
                for _ in range(HOG_REQUESTS):
                    await hog.write(body)

            writer = asyncio.get_running_loop().create_task(flood())
            try:
                # Another tenant is served meanwhile, each request in turn.
                infer = quiet_channel.unary_unary(
                    MODEL_INFER,
                    request_serializer=None,
                    response_deserializer=service_pb2.ModelInferResponse.FromString,
                )
                for _ in range(20):
                    reply = await infer(_embed(), metadata=QUIET, timeout=30)
                    assert reply.outputs[0].name == "EMBEDDING"
                # The hog's writes stall: the frontend stopped reading its stream.
                done, _ = await asyncio.wait({writer}, timeout=5.0)
                assert not done, "every write of a client that never reads was taken"
                after = await _counters(fe, "simple_identity")
                admitted = after.admitted - before.admitted
                assert admitted <= MAX_INFLIGHT + REPLY_BUFFER + IN_TRANSIT, admitted
                growth = sum(_rss(p) for p in pids) - rss_before
                assert growth < RSS_GROWTH_LIMIT, f"shells grew {growth >> 20} MiB"
            finally:
                writer.cancel()
                hog.cancel()
        await aeventually(
            lambda: _idle(fe, "simple_identity"), SETTLE_S, what="the hog's requests end"
        )


async def test_a_stream_without_a_valid_key_ends_before_a_message_is_read(
    streams: RunningFrontend,
) -> None:
    async with grpc.aio.insecure_channel(streams.grpc_url) as channel:
        for metadata in [(), (("authorization", "Bearer wrong"),)]:
            call = _open_stream(channel, metadata)
            # Nothing is sent: the stream ends on its metadata alone (a server that
            # waited for a message to refuse would never answer this).
            code = await asyncio.wait_for(call.code(), ANSWER_TIMEOUT_S)
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert "wrong" not in (await call.details() or "")


async def test_a_valid_stream_answers_each_request_in_stream(streams: RunningFrontend) -> None:
    """More requests than the stream's in-flight bound, read as they come: all answered,
    bad ones in-stream, and the stream ends when the client is done."""
    async with grpc.aio.insecure_channel(streams.grpc_url) as channel:
        call = _open_stream(channel, HOG)
        count = MAX_INFLIGHT * 4
        for i in range(count):
            await call.write(identity_request(str(i).encode()) if i % 5 else b"\xff" * 8)
        await call.done_writing()

        async def every_reply() -> list[Any]:
            return [reply async for reply in call]

        # A stream whose reading failed (a message it could not parse) and never ended
        # would hang here: the deadline turns that into a failure.
        replies = await asyncio.wait_for(every_reply(), SETTLE_S)
    assert len(replies) == count
    errors = [r.error_message for r in replies if r.error_message]
    assert len(errors) == len(range(0, count, 5))
    assert all("not a valid ModelInferRequest" in e for e in errors)
    echoed = sorted(
        int(r.infer_response.raw_output_contents[0][4:]) for r in replies if not r.error_message
    )
    assert echoed == [i for i in range(count) if i % 5]


async def _warm(channel: grpc.aio.Channel) -> None:
    """One short sleeper request answered on a stream: the model is known to the core
    (its counters exist) before a test reads them."""
    warm = _open_stream(channel, HOG)
    await warm.write(_sleeper(4))
    assert not (await warm.read()).error_message
    await warm.done_writing()


CLIENT = textwrap.dedent(
    """
    import sys, threading, grpc
    url, key, body_file, count = sys.argv[1:5]
    body = open(body_file, "rb").read()
    channel = grpc.insecure_channel(url)
    stream = channel.stream_stream("{stream}", request_serializer=None,
                                   response_deserializer=None)
    done = threading.Event()
    def requests():
        for _ in range(int(count)):
            yield body
        print("sent", flush=True)
        done.wait()  # never half-closes: the process is killed
    replies = stream(requests(), metadata=(("x-api-key", key),))
    done.wait()
    """
).format(stream=STREAM)


async def test_a_vanished_client_leaves_nothing_running_in_the_core(
    streams: RunningFrontend, tmp_path: Path
) -> None:
    """Killed with requests queued and in Triton: they end, each once (run or cancelled:
    how many ran before the kill depends on the machine's speed), and the model's runtime
    in the core is idle again."""
    count = 160  # five batches of sleeper, over a second each: most still queued at the kill
    body_file = tmp_path / "body"
    body_file.write_bytes(_sleeper(2000))
    # The model is known before the counters are read.
    async with grpc.aio.insecure_channel(streams.grpc_url) as channel:
        await _warm(channel)
    before = await _counters(streams, "sleeper")
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, streams.grpc_url, KEYS["acme"], str(body_file), str(count)],
        stdout=subprocess.PIPE,
    )
    try:

        async def all_admitted() -> bool:
            return (await _counters(streams, "sleeper")).admitted - before.admitted >= count

        await aeventually(all_admitted, SETTLE_S, what="the client's requests admitted")
    finally:
        client.kill()
        client.wait(30)
    await aeventually(
        lambda: _idle(streams, "sleeper"), SETTLE_S, what="the vanished client's requests end"
    )
    after = await _counters(streams, "sleeper")
    assert after.admitted - before.admitted == count
    ended = (
        after.dispatched
        - before.dispatched
        + after.cancelled
        - before.cancelled
        + after.expired
        - before.expired
    )
    assert ended == count


async def test_a_stream_whose_read_fails_ends_and_cancels_its_requests(
    streams: RunningFrontend,
) -> None:
    """A message over gRPC's receive limit fails the stream's read: the stream ends, and
    its requests still queued are cancelled in the core, not left to run for nobody."""
    count = MAX_INFLIGHT - 1  # a slot left: the stream reads its next message
    async with grpc.aio.insecure_channel(streams.grpc_url) as channel:
        await _warm(channel)
        before = await _counters(streams, "sleeper")
        # Another tenant's full batch of long requests: the stream's wait behind it.
        blocker = _open_stream(channel, QUIET)
        for _ in range(32):
            await blocker.write(_sleeper(4000))
        await blocker.done_writing()

        async def blocker_in_triton() -> bool:
            return (await _counters(streams, "sleeper")).dispatched - before.dispatched >= 32

        await aeventually(blocker_in_triton, SETTLE_S, what="the other tenant's batch sent")
        call = _open_stream(channel, HOG)
        for _ in range(count):
            await call.write(_sleeper(100))

        async def all_admitted() -> bool:
            admitted = (await _counters(streams, "sleeper")).admitted - before.admitted
            return admitted >= 32 + count

        await aeventually(all_admitted, SETTLE_S, what="the stream's requests admitted")
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await call.write(b"\x00" * OVER_TRANSPORT_LIMIT)
        code = await asyncio.wait_for(call.code(), SETTLE_S)
        assert code != grpc.StatusCode.OK
        assert len([r async for r in blocker]) == 32
    await aeventually(lambda: _idle(streams, "sleeper"), SETTLE_S, what="the stream's requests end")
    after = await _counters(streams, "sleeper")
    assert after.cancelled - before.cancelled == count, "the stream's requests ran for nobody"
    assert after.dispatched - before.dispatched == 32


# ---- a decoupled request whose client stops reading ---------------------------------------

FLOOD_PARTS = 600
PART_BYTES = 128 << 10  # 75 MiB in all, were every part held for a client that reads none
STALLED_S = 3.0  # queues.stalled_stream_s here
# Parts the frontend may have taken from Triton for a client that reads none: the one the
# shell's relay holds, the gRPC stream's reply buffer, and what the transports carry
# before their flow control stops them (a few MiB of kernel and gRPC buffers); far below
# FLOOD_PARTS.
HELD_PARTS = 1 + REPLY_BUFFER + (16 << 20) // PART_BYTES
OUTPUT_TOKENS = "fair_output_tokens_total"  # one per streamed part (token_output: OUT)


def flood_config() -> dict[str, Any]:
    data = stream_config()
    data["endpoints"]["flood_decoupled"] = {"token_output": "OUT", "throttle": False}
    data["queues"] = {"stalled_stream_s": STALLED_S}
    return data


@pytest.fixture(scope="module")
def floods(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    with running_frontend(parse_config(flood_config()), triton, workers=workers) as running:
        yield running


def _flood(count: int, size: int) -> bytes:
    msg = service_pb2.ModelInferRequest(model_name="flood_decoupled")
    for name, value in (("COUNT", count), ("SIZE", size)):
        msg.inputs.add(name=name, datatype="INT32", shape=[1])
        msg.raw_input_contents.append(np.array([value], dtype="<i4").tobytes())
    return msg.SerializeToString()


def _sample(fe: RunningFrontend, name: str, **labels: str) -> float:
    value = fe.frontend.registry.get_sample_value(name, labels)
    return float(value or 0.0)


def _parts(fe: RunningFrontend) -> float:
    """Parts of acme's flood_decoupled streams the core has taken from Triton."""
    labels = {"tenant": "acme", "tier": "enterprise", "endpoint": "flood_decoupled"}
    return _sample(fe, OUTPUT_TOKENS, **labels)


def _outcomes(fe: RunningFrontend) -> dict[str, float]:
    labels = {"tenant": "acme", "tier": "enterprise", "endpoint": "flood_decoupled"}
    return {
        o: _sample(fe, "fair_requests_total", outcome=o, **labels)
        for o in ("dispatched", "cancelled", "failed")
    }


async def _ends_cancelled(fe: RunningFrontend, parts_before: float, outcomes: Any) -> None:
    """The stalled request: a bounded number of parts taken from Triton, then cancelled
    there (its stream closed, the runtime idle) after stalled_stream_s, one outcome."""
    await aeventually(
        lambda: _idle(fe, "flood_decoupled"), SETTLE_S, what="the stalled request ends"
    )
    held = _parts(fe) - parts_before
    assert 0 < held <= HELD_PARTS, f"{held} parts taken from Triton for a client that reads none"
    after = _outcomes(fe)
    assert {o: after[o] - outcomes[o] for o in after} == {
        "dispatched": 0.0,
        "cancelled": 1.0,
        "failed": 0.0,
    }


async def test_a_grpc_client_that_stops_reading_a_stream_holds_a_window_then_is_cancelled(
    floods: RunningFrontend,
) -> None:
    """Before: the core relayed all 600 parts (75 MiB) into the answer queue of a client
    that read none, and the request ended dispatched."""
    async with grpc.aio.insecure_channel(floods.grpc_url) as channel:
        await _warm_flood(channel, floods)
        parts, outcomes = _parts(floods), _outcomes(floods)
        call = _open_stream(channel, HOG)
        await call.write(_flood(FLOOD_PARTS, PART_BYTES))
        first = await call.read()  # one part, then the client reads no more
        assert not first.error_message
        started = time.monotonic()
        await _ends_cancelled(floods, parts, outcomes)
        assert time.monotonic() - started >= STALLED_S * 0.9  # not before the stall bound
        call.cancel()


async def test_an_sse_client_that_stops_reading_holds_a_window_then_is_cancelled(
    floods: RunningFrontend,
) -> None:
    """The same over HTTP ``/generate_stream`` (server-sent events), from a raw socket
    whose receive buffer is small: it reads the response's head and stops."""
    async with grpc.aio.insecure_channel(floods.grpc_url) as channel:
        await _warm_flood(channel, floods)
    parts, outcomes = _parts(floods), _outcomes(floods)
    host, port = floods.http_url.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=16 << 10)
    try:
        body = json.dumps({"COUNT": FLOOD_PARTS, "SIZE": PART_BYTES}).encode()
        writer.write(
            f"POST /v2/models/flood_decoupled/generate_stream HTTP/1.1\r\nHost: x\r\n"
            f"x-api-key: {KEYS['acme']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_TIMEOUT_S)
        assert head.startswith(b"HTTP/1.1 200"), head
        await _ends_cancelled(floods, parts, outcomes)
    finally:
        writer.close()


async def test_a_client_that_reads_slowly_gets_every_part_once(floods: RunningFrontend) -> None:
    """Far more parts than the window, taken a few at a time with pauses: every part
    arrives, in order of arrival, then the end; the request ends dispatched."""
    count = 320
    async with grpc.aio.insecure_channel(floods.grpc_url) as channel:
        await _warm_flood(channel, floods)
        outcomes = _outcomes(floods)
        call = _open_stream(channel, HOG)
        await call.write(_flood(count, 1000))
        await call.done_writing()
        replies = []
        async for reply in call:
            replies.append(reply)
            if len(replies) % 7 == 0:
                await asyncio.sleep(0.02)  # the client is busy: the buffers fill meanwhile
    assert not [r.error_message for r in replies if r.error_message]
    assert len([r for r in replies if r.infer_response.outputs]) == count
    await aeventually(lambda: _idle(floods, "flood_decoupled"), SETTLE_S, what="the request ends")
    after = _outcomes(floods)
    assert after["dispatched"] - outcomes["dispatched"] == 1
    assert after["cancelled"] == outcomes["cancelled"]


async def _warm_flood(channel: grpc.aio.Channel, fe: RunningFrontend) -> None:
    """One short flood answered on a stream: the model is known to the core."""
    warm = _open_stream(channel, HOG)
    await warm.write(_flood(2, 10))
    await warm.done_writing()
    replies = [r async for r in warm]
    assert replies and not [r.error_message for r in replies if r.error_message]
    # Its outcome is counted once its shell tells the core (the core hears of a stream's
    # end from the shell that relayed it): settled before the caller reads the counts.
    await aeventually(
        lambda: _idle(fe, "flood_decoupled"), SETTLE_S, what="the warm stream counted"
    )
