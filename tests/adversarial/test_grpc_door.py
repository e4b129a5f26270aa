"""Hostile gRPC clients at the door: identity before parsing, sizes bounded per model,
typed contents decoded without a Python object per element.

Issue 11, item 1 on the gRPC transport. ModelInfer takes its request as bytes, so:

- a call without a valid key is refused from its metadata alone: the tests send bytes
  that are not protobuf at all, so UNAUTHENTICATED (not INVALID_ARGUMENT) proves the
  body was never parsed;
- a message larger than the bound of the model it names is refused before it is
  parsed: a valid model name followed by megabytes of garbage gets the size error,
  not a parse error;
- typed numeric contents (``int_contents`` and the rest) are decoded from their packed
  wire bytes in bulk, checked here against the element-wise decode on every dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from fair_frontend import grpc_codec
from fair_frontend.config import parse_config
from fair_frontend.embedded import EmbeddedTriton
from fair_frontend.errors import InvalidArgument
from fair_frontend.protocol import DTYPES
from tests.support import (
    KEYS,
    RunningFrontend,
    config_dict,
    identity_request,
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
