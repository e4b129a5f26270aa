"""Hostile gRPC clients at the door: identity before bytes, sizes bounded per model,
typed contents decoded without a Python object per element, and bounds on calls and
connections.

Issue 11, item 1 on the gRPC transport. ModelInfer takes its request as bytes, so:

- a call without a valid key is refused from its metadata alone: the tests send bytes
  that are not protobuf at all, so UNAUTHENTICATED (not INVALID_ARGUMENT) proves the
  body was never parsed;
- a message larger than the bound of the model it names is refused before it is
  parsed: a valid model name followed by megabytes of garbage gets the size error,
  not a parse error;
- typed numeric contents (``int_contents`` and the rest) are decoded from their packed
  wire bytes in bulk, checked here against the element-wise decode on every dtype.

Issue 17, item 2: identity before bytes. A call without a valid key is refused before its
message is received, not only before it is parsed: 8 concurrent 64 MiB calls without a
key cost the frontend's processes a bounded amount of memory (HTTP/2's flow-control
window per call), measured as the kernel's own peak of their resident memory; so do calls
to the side doors and to open methods (which never read their message). And gRPC's own
bounds hold: calls at once per shell, streams per connection, idle time, age, and the
time a new connection has for its handshake.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from fair_frontend import grpc_codec
from fair_frontend.auth import MISSING_KEY
from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import parse_config
from fair_frontend.errors import InvalidArgument
from fair_frontend.kit.testing import perf_analyzer
from fair_frontend.protocol import DTYPES
from fair_frontend.server import ShellPool
from tests.support import (
    KEYS,
    ROOT,
    RunningFrontend,
    config_dict,
    identity_request,
    metric_sum,
    running_frontend,
)

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
KEY = (("authorization", f"Bearer {KEYS['acme']}"),)
SMALL_BYTES = 1000  # simple_identity's max_request_bytes here
NOT_PROTOBUF = b"\xff" * 64  # field 31, wire type 7: no protobuf parser takes it


def door_config() -> dict[str, Any]:
    """Test tenants; simple_identity's requests small, every other model's the default."""
    data = config_dict()
    data["endpoints"]["simple_identity"] = {"max_request_bytes": SMALL_BYTES, "throttle": False}
    return data


@pytest.fixture(scope="module")
def door(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    with running_frontend(parse_config(door_config()), triton, workers=workers) as running:
        yield running


async def _infer_raw(url: str, body: bytes, metadata: Any) -> grpc.aio.AioRpcError | Any:
    """ModelInfer with ``body`` sent as is; the error, or the response."""
    async with grpc.aio.insecure_channel(url) as channel:
        call = channel.unary_unary(
            MODEL_INFER,
            request_serializer=None,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        try:
            return await call(body, metadata=metadata, timeout=30)
        except grpc.aio.AioRpcError as err:
            return err


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer wrong"),), (("x-api-key", "wrong"),)],
    ids=["no-key", "bearer-unknown", "x-api-key-unknown"],
)
async def test_no_valid_key_is_refused_before_the_body_is_parsed(
    door: RunningFrontend, metadata: Any
) -> None:
    err = await _infer_raw(door.grpc_url, NOT_PROTOBUF, metadata)
    assert isinstance(err, grpc.aio.AioRpcError), err
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
    assert "wrong" not in (err.details() or "")


async def test_a_body_that_is_not_protobuf_is_invalid_argument(door: RunningFrontend) -> None:
    """With a valid key it is parsed, and bad bytes are the client's error, said clearly."""
    err = await _infer_raw(door.grpc_url, NOT_PROTOBUF, KEY)
    assert isinstance(err, grpc.aio.AioRpcError), err
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "not a valid ModelInferRequest" in (err.details() or "")


async def test_a_message_over_its_models_bound_is_refused_before_parsing(
    door: RunningFrontend,
) -> None:
    bound = parse_config(door_config()).endpoint("simple_identity").max_wire_bytes
    # The model's name, then garbage past the bound: refused by size, never parsed.
    head = service_pb2.ModelInferRequest(model_name="simple_identity").SerializeToString()
    err = await _infer_raw(door.grpc_url, head + b"\xff" * (bound + 1), KEY)
    assert isinstance(err, grpc.aio.AioRpcError), err
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "request too large" in (err.details() or "")
    assert str(bound) in (err.details() or "")
    # A well-formed request of that size: the same answer.
    err = await _infer_raw(door.grpc_url, identity_request(b"x" * bound), KEY)
    assert isinstance(err, grpc.aio.AioRpcError), err
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "request too large" in (err.details() or "")
    # Within the bound, the model answers.
    ok = await _infer_raw(door.grpc_url, identity_request(b"y" * 100), KEY)
    assert isinstance(ok, service_pb2.ModelInferResponse), ok
    assert ok.raw_output_contents[0][4:] == b"y" * 100


# ---- identity before bytes: what a refused call costs in memory -----------------------

MIB = 1 << 20
FLOOD_CALLS = 8
FLOOD_BYTES = 64 * MIB
# HTTP/2's initial stream window (gRPC's bandwidth probing off, server.grpc_bdp_probe):
# what a call's message can put into the server before anything reads it.
HTTP2_WINDOW = 64 << 10
# The bound on the growth of the frontend's peak memory while the 8 calls arrive and are
# refused: a quarter of one message. Flow control lets in 8 x 64 KiB (half a MiB, and the
# streams' own state); the rest is the allocator's slack. Reading the messages whole, as
# the frontend did before, costs 512 MiB and more.
RSS_BOUND = FLOOD_BYTES // 4
FLOOD_TIMEOUT_S = 120.0


class PeakRss:
    """How far the peak resident memory of some processes rose over a stretch: the
    kernel's own high-water mark (``VmHWM``, reset by writing 5 to
    ``/proc/PID/clear_refs``), so a peak counts however briefly it lasted, unsampled."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.before = 0

    def __enter__(self) -> PeakRss:
        for pid in self.pids:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        self.before = sum(_status_bytes(pid, "VmRSS") for pid in self.pids)
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    @property
    def growth(self) -> int:
        return sum(_status_bytes(pid, "VmHWM") for pid in self.pids) - self.before


def _status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def frontend_pids(running: RunningFrontend) -> list[int]:
    """The frontend's processes: this one (the core, and the shell with one process) and
    its shell processes."""
    shells = running.server.shells
    assert shells is None or isinstance(shells, ShellPool)  # none, or this process's
    return [os.getpid(), *(p.pid for p in (shells.processes.values() if shells else ()))]


def flood(url: str, method: str, key: str | None) -> list[str]:
    """FLOOD_CALLS concurrent calls of FLOOD_BYTES each, from a process of its own
    (``grpc_flood``: the messages it holds stay out of this process's memory)."""
    cmd = [sys.executable, "-m", "benchmarks.grpc_flood", url, method]
    cmd += [str(FLOOD_CALLS), str(FLOOD_BYTES), *([key] if key else [])]
    done = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=FLOOD_TIMEOUT_S, check=True
    )
    answers: list[str] = json.loads(done.stdout.splitlines()[-1])["answers"]
    return answers


# method, key, every call's answer, and where the refusal is counted (metric, labels)
FLOODS: dict[str, tuple[str, str | None, str, tuple[str, dict[str, str]]]] = {
    "infer-no-key": (
        "ModelInfer",
        None,
        f"UNAUTHENTICATED: {MISSING_KEY}",
        ("fair_requests_total", {"tenant": "-", "outcome": "rejected_auth"}),
    ),
    "infer-unknown-key": (
        "ModelInfer",
        "wrong",
        "UNAUTHENTICATED: unknown API key",
        ("fair_requests_total", {"tenant": "-", "outcome": "rejected_auth"}),
    ),
    "metadata-no-key": (
        "ModelMetadata",
        None,
        f"UNAUTHENTICATED: {MISSING_KEY}",
        ("fair_side_door_calls_total", {"door": "model_metadata", "outcome": "unauthenticated"}),
    ),
    "live-unread": (
        "ServerLive",
        None,
        "OK",
        ("fair_side_door_calls_total", {"door": "live", "outcome": "ok"}),
    ),
}


@pytest.mark.parametrize("case", FLOODS.values(), ids=FLOODS.keys())
def test_unkeyed_messages_are_refused_before_they_are_received(
    door: RunningFrontend, case: tuple[str, str | None, str, tuple[str, dict[str, str]]]
) -> None:
    """8 concurrent 64 MiB calls without a valid key: each refused as ever (status and
    text, counted), and the frontend's peak memory grows by far less than one message.
    An open method (ServerLive) answers without reading its message at all: the bytes
    it carries are no protobuf, and it still answers."""
    method, key, answer, (metric, labels) = case
    counted = metric_sum(door, metric, **labels)
    with PeakRss(frontend_pids(door)) as peak:
        answers = flood(door.grpc_url, method, key)
    assert answers == [answer] * FLOOD_CALLS
    assert peak.growth < RSS_BOUND, (
        f"the frontend's peak memory grew by {peak.growth / MIB:.1f} MiB while "
        f"{FLOOD_CALLS} x {FLOOD_BYTES // MIB} MiB unkeyed calls were refused"
    )
    assert metric_sum(door, metric, **labels) - counted == FLOOD_CALLS


# ---- gRPC's own bounds: calls, streams per connection, idle, age, handshake -------------

STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
CALLS_BOUND = 3
STREAMS_BOUND = 4
IDLE_S = 1.0
AGE_S = 1.0
HANDSHAKE_S = 1.0
# How long a test waits for what should happen (a GOAWAY, a connection closed): far
# above the bound it tests, so a slow machine does not fail it.
WAIT_S = 20.0
# How long a call the client holds is watched not to finish (it must not, ever).
HELD_S = 2.0


def bounded_config(**server: Any) -> dict[str, Any]:
    data = door_config()
    data["server"] = {**data.get("server", {}), **server}
    return data


@pytest.fixture(scope="module")
def call_bound(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    config = parse_config(bounded_config(grpc_max_concurrent_calls=CALLS_BOUND))
    with running_frontend(config, triton, workers=workers) as running:
        yield running


@pytest.fixture(scope="module")
def connection_bounds(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    server = {
        "grpc_max_streams_per_connection": STREAMS_BOUND,
        "grpc_max_connection_idle_s": IDLE_S,
        "header_timeout_s": HANDSHAKE_S,
    }
    with running_frontend(parse_config(bounded_config(**server)), triton, workers=workers) as fe:
        yield fe


@pytest.fixture(scope="module")
def aging(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    server = {"grpc_max_connection_age_s": AGE_S, "grpc_max_connection_idle_s": None}
    with running_frontend(parse_config(bounded_config(**server)), triton, workers=workers) as fe:
        yield fe


class OpenStream:
    """A keyed ModelStreamInfer stream kept open: one ``simple_identity`` request at a
    time, each answered before ``ask`` returns."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._requests: asyncio.Queue[bytes | None] = asyncio.Queue()
        call = channel.stream_stream(
            STREAM_INFER,
            request_serializer=None,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        self.call = call(self._send(), metadata=KEY)

    async def _send(self) -> AsyncIterator[bytes]:
        while (raw := await self._requests.get()) is not None:
            yield raw

    async def ask(self, payload: bytes) -> None:
        await self._requests.put(identity_request(payload))
        reply = await asyncio.wait_for(self.call.read(), WAIT_S)
        assert reply is not grpc.aio.EOF, await self.call.code()
        assert not reply.error_message, reply.error_message
        assert reply.infer_response.raw_output_contents[0][4:] == payload

    async def close(self) -> None:
        await self._requests.put(None)
        assert await asyncio.wait_for(self.call.code(), WAIT_S) == grpc.StatusCode.OK


async def _infer_on(channel: grpc.aio.Channel, payload: bytes) -> Any:
    call = channel.unary_unary(
        MODEL_INFER,
        request_serializer=None,
        response_deserializer=service_pb2.ModelInferResponse.FromString,
    )
    try:
        return await call(identity_request(payload), metadata=KEY, timeout=WAIT_S)
    except grpc.aio.AioRpcError as err:
        return err


async def test_calls_over_the_shell_bound_are_refused_before_their_message(
    call_bound: RunningFrontend,
) -> None:
    """server.grpc_max_concurrent_calls: with the bound's worth of streams open on one
    connection (one shell), one more call there is refused UNAVAILABLE 'Exceeds maximum
    queue size', counted; once a stream ends, calls are served again."""
    refused_before = metric_sum(call_bound, "fair_requests_total", outcome="rejected_queue_full")
    async with grpc.aio.insecure_channel(call_bound.grpc_url) as channel:
        streams = [OpenStream(channel) for _ in range(CALLS_BOUND)]
        for stream in streams:
            await stream.ask(b"open")
        err = await _infer_on(channel, b"one too many")
        assert isinstance(err, grpc.aio.AioRpcError), err
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert "Exceeds maximum queue size" in (err.details() or ""), err
        assert "server.grpc_max_concurrent_calls" in (err.details() or ""), err
        await streams.pop().close()
        ok = await _infer_on(channel, b"room again")
        assert isinstance(ok, service_pb2.ModelInferResponse), ok
        for stream in streams:
            await stream.close()
    refused = metric_sum(call_bound, "fair_requests_total", outcome="rejected_queue_full")
    assert refused - refused_before == 1


async def test_streams_over_the_connection_bound_are_held(
    connection_bounds: RunningFrontend,
) -> None:
    """server.grpc_max_streams_per_connection: with the bound's worth of streams open on
    one connection, gRPC's client holds the next call (the server announced the bound);
    another connection is served meanwhile, and the held call goes once a stream ends."""
    url = connection_bounds.grpc_url
    async with grpc.aio.insecure_channel(url) as channel:
        streams = [OpenStream(channel) for _ in range(STREAMS_BOUND)]
        for stream in streams:
            await stream.ask(b"open")
        held = asyncio.ensure_future(_infer_on(channel, b"held"))
        # A connection of its own (channels of one process share one by default).
        own = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(url, options=own) as other:
            served = await _infer_on(other, b"other connection")
            assert isinstance(served, service_pb2.ModelInferResponse), served
        await streams[0].ask(b"the open streams still serve")
        done, _ = await asyncio.wait({held}, timeout=HELD_S)
        assert not done, f"a call over the bound was not held: {held.result()}"
        await streams.pop().close()
        answer = await asyncio.wait_for(held, WAIT_S)
        assert isinstance(answer, service_pb2.ModelInferResponse), answer
        assert answer.raw_output_contents[0][4:] == b"held"
        for stream in streams:
            await stream.close()


async def _until_state(channel: grpc.aio.Channel, state: grpc.ChannelConnectivity) -> None:
    """Wait (WAIT_S at most) for the channel to reach ``state``: IDLE once the server's
    GOAWAY took its connection."""
    deadline = time.monotonic() + WAIT_S
    current = channel.get_state()
    while current != state:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"the channel stayed {current}, never {state}"
        try:
            await asyncio.wait_for(channel.wait_for_state_change(current), remaining)
        except TimeoutError:
            continue
        current = channel.get_state()


async def test_an_idle_connection_is_closed(connection_bounds: RunningFrontend) -> None:
    """server.grpc_max_connection_idle_s: a connection without a call is closed by the
    server (GOAWAY: the channel goes IDLE); the client's next call reconnects."""
    async with grpc.aio.insecure_channel(connection_bounds.grpc_url) as channel:
        first = await _infer_on(channel, b"before")
        assert isinstance(first, service_pb2.ModelInferResponse), first
        assert channel.get_state() == grpc.ChannelConnectivity.READY
        await _until_state(channel, grpc.ChannelConnectivity.IDLE)
        again = await _infer_on(channel, b"after")
        assert isinstance(again, service_pb2.ModelInferResponse), again


async def test_an_aged_connection_closes_after_its_calls(aging: RunningFrontend) -> None:
    """server.grpc_max_connection_age_s: past its age a connection takes no new calls
    (GOAWAY: the channel goes IDLE), but a stream open on it goes on being served to its
    end; new calls go over a new connection."""
    async with grpc.aio.insecure_channel(aging.grpc_url) as channel:
        stream = OpenStream(channel)
        await stream.ask(b"young")
        await _until_state(channel, grpc.ChannelConnectivity.IDLE)
        await stream.ask(b"aged, still in flight")
        fresh = await _infer_on(channel, b"new connection")
        assert isinstance(fresh, service_pb2.ModelInferResponse), fresh
        await stream.close()


def test_a_connection_without_a_handshake_is_closed(connection_bounds: RunningFrontend) -> None:
    """server.header_timeout_s on gRPC: a connection that never sends HTTP/2's preface
    is closed (gRPC's own limit would be 120 s). The server's own preface (its SETTINGS)
    comes first, then the end."""
    host, port = connection_bounds.grpc_url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        received = 0
        try:
            while chunk := sock.recv(4096):
                received += len(chunk)
                assert received < 1 << 16, "the server sends more than its preface"
        except ConnectionResetError:
            pass
        except TimeoutError:
            pytest.fail(f"the connection was still open after {WAIT_S} s")


def test_perf_analyzer_at_concurrency_64_on_one_connection(door: RunningFrontend) -> None:
    """The default bounds never hurt a legitimate client: perf_analyzer's plain command,
    64 calls at once on its one gRPC connection, runs without an error (it exits
    non-zero on any). A fixed number of requests (``--request-count``), not windows until
    stable: whether latency is stable on a shared machine is not the question here."""
    try:
        result = perf_analyzer(
            "embed",
            door.grpc_url,
            protocol="grpc",
            concurrency=64,
            shapes=["INPUT_IDS:128"],
            headers=[f"authorization:Bearer {KEYS['acme']}"],
            extra=["--request-count", "640"],
            timeout_s=240,
        )
    except subprocess.TimeoutExpired as err:
        # Seen once (a fresh clone at load 7 on 2 cores): what the core held then tells
        # a request it never answered from a client that never finished.
        runtime = door.frontend.runtimes.get("embed")
        counters = runtime.scheduler.counters if runtime is not None else None
        state = (
            {"queued": runtime.scheduler.queued_requests, "inflight": runtime.inflight}
            if runtime is not None
            else {}
        )
        pytest.fail(f"perf_analyzer did not finish: {err}; the core's embed: {counters} {state}")
    assert result["throughput"] > 0


# ---- typed contents: bulk decode against the element-wise one ------------------------

INT32 = st.integers(-(2**31), 2**31 - 1)
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "bool_contents": st.booleans(),
    "int_contents": INT32 | st.sampled_from([-(2**31), -1, 0, 127, 128, 2**31 - 1]),
    "int64_contents": st.integers(-(2**63), 2**63 - 1) | st.sampled_from([-(2**63), 2**63 - 1]),
    "uint_contents": st.integers(0, 2**32 - 1) | st.sampled_from([0, 2**32 - 1]),
    "uint64_contents": st.integers(0, 2**64 - 1) | st.sampled_from([2**63, 2**64 - 1]),
    "fp32_contents": st.floats(width=32, allow_nan=True),
    "fp64_contents": st.floats(allow_nan=True),
}
NAIVE_DTYPES = {
    "bool_contents": np.bool_,
    "int_contents": np.int32,
    "int64_contents": np.int64,
    "uint_contents": np.uint32,
    "uint64_contents": np.uint64,
    "fp32_contents": np.float32,
    "fp64_contents": np.float64,
}


@st.composite
def field_and_values(draw: st.DrawFn) -> tuple[str, list[Any]]:
    field = draw(st.sampled_from(sorted(FIELD_VALUES)))
    return field, draw(st.lists(FIELD_VALUES[field], max_size=300))


@settings(max_examples=300, deadline=None)
@given(case=field_and_values())
def test_packed_contents_decode_like_the_element_wise_decode(case: tuple[str, list[Any]]) -> None:
    field, values = case
    contents = service_pb2.InferTensorContents()
    getattr(contents, field).extend(values)
    naive = np.array(list(getattr(contents, field)), dtype=NAIVE_DTYPES[field])
    bulk = grpc_codec.packed_array(contents, field)
    assert bulk.dtype == naive.dtype
    assert bulk.shape == naive.shape
    # Bit for bit (NaN payloads included).
    assert bulk.tobytes() == naive.tobytes()


@settings(max_examples=50, deadline=None)
@given(width=st.sampled_from([4, 8]), data=st.data())
def test_varints_across_decode_windows(width: int, data: st.DataObject) -> None:
    """Fields longer than a decode window: every varint is cut at the right place."""
    top = 2**32 if width == 4 else 2**64
    values = data.draw(st.lists(st.integers(0, top - 1), min_size=1, max_size=20))
    contents = service_pb2.InferTensorContents()
    field = "uint_contents" if width == 4 else "uint64_contents"
    repeats = (grpc_codec._VARINT_WINDOW // len(values)) + 3
    getattr(contents, field).extend(values * repeats)
    bulk = grpc_codec.packed_array(contents, field)
    assert bulk.tolist() == values * repeats


NARROW = {"INT8": "int_contents", "INT16": "int_contents", "UINT8": "uint_contents"}
NARROW.update({"UINT16": "uint_contents"})


@settings(max_examples=200, deadline=None)
@given(datatype=st.sampled_from(sorted(NARROW)), data=st.data())
def test_narrow_types_in_wide_fields_are_range_checked(datatype: str, data: st.DataObject) -> None:
    info = np.iinfo(DTYPES[datatype])
    wide = INT32 if NARROW[datatype] == "int_contents" else st.integers(0, 2**32 - 1)
    values = data.draw(st.lists(wide | st.integers(info.min, info.max), min_size=1, max_size=8))
    msg = service_pb2.ModelInferRequest(model_name="m")
    tensor = msg.inputs.add(name="X", datatype=datatype, shape=[len(values)])
    getattr(tensor.contents, NARROW[datatype]).extend(values)
    if all(info.min <= v <= info.max for v in values):
        decoded = grpc_codec.decode_infer(msg).inputs[0].data
        assert decoded.dtype == DTYPES[datatype]
        assert decoded.tolist() == values
    else:
        with pytest.raises(InvalidArgument, match=f"out of range for {datatype}"):
            grpc_codec.decode_infer(msg)


@settings(max_examples=200, deadline=None)
@given(
    model=st.text(max_size=40),
    version=st.text(max_size=5),
    request_id=st.text(max_size=20),
    raw=st.lists(st.binary(max_size=50), max_size=3),
)
def test_model_name_is_read_without_parsing(
    model: str, version: str, request_id: str, raw: list[bytes]
) -> None:
    msg = service_pb2.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    msg.parameters["priority"].uint64_param = 1
    msg.raw_input_contents.extend(raw)
    wire = msg.SerializeToString()
    # An empty name is not written at all (proto3): nothing to read.
    assert grpc_codec.peek_model_name(wire) == (model or None)
    assert grpc_codec.peek_model_name(NOT_PROTOBUF) is None
