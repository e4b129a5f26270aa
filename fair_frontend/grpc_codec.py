"""KServe v2 over gRPC: ``ModelInferRequest``/``ModelInferResponse`` <-> ``InferRequest``.

The messages are tritonclient's generated stubs (``tritonclient.grpc.service_pb2``).
Inputs arrive either as ``raw_input_contents`` (what tritonclient and perf_analyzer
send) or typed ``contents``; responses always use raw contents, as Triton does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from fair_frontend.errors import InvalidArgument
from fair_frontend.protocol import (
    DTYPES,
    InferRequest,
    InferResponse,
    ParamValue,
    RequestedOutput,
    Tensor,
    check_shape,
    element_count,
    reject_shared_memory,
    shaped,
    split_parameters,
    tensor_from_raw,
    tensor_to_raw,
)

# Which typed-contents field carries each datatype (KServe v2 gRPC).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


# Request parameters accepted as uint64_param: Triton's (the clients send priority that
# way), and timeout, harmlessly (Triton wants int64 there). Not sequence_id: Triton refuses.
_UINT64_PARAMETERS = frozenset({"priority", "timeout"})


def param_value(p: service_pb2.InferParameter, name: str = "") -> ParamValue:
    which = p.WhichOneof("parameter_choice")
    if which is None:
        raise InvalidArgument(f"parameter '{name}' has no value")
    value: ParamValue = getattr(p, which)
    return value


def _request_parameters(msg: service_pb2.ModelInferRequest) -> dict[str, ParamValue]:
    out: dict[str, ParamValue] = {}
    for name, p in msg.parameters.items():
        if p.WhichOneof("parameter_choice") == "uint64_param" and name not in _UINT64_PARAMETERS:
            # Triton's own check: custom parameters travel as int64, bool, double or string.
            raise InvalidArgument(
                f"invalid value type for '{name}' parameter, expected int64_param, "
                "bool_param, double_param or string_param"
            )
        out[name] = param_value(p, name)
    return out


def set_param(p: service_pb2.InferParameter, value: ParamValue) -> None:
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        if value >= 1 << 63:
            p.uint64_param = value
        else:
            p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


def decode_infer(msg: service_pb2.ModelInferRequest) -> InferRequest:
    req = InferRequest(model=msg.model_name, version=msg.model_version, id=msg.id)
    split_parameters(req, _request_parameters(msg))
    if not msg.inputs:
        raise InvalidArgument("the request must have at least one input")
    raw = msg.raw_input_contents
    if raw and len(raw) != len(msg.inputs):
        raise InvalidArgument(
            f"expected {len(msg.inputs)} raw_input_contents (one per input), got {len(raw)}"
        )
    seen: set[str] = set()
    for i, spec in enumerate(msg.inputs):
        name = spec.name
        if not name:
            raise InvalidArgument(f"inputs[{i}]: missing name")
        if name in seen:
            raise InvalidArgument(f"input '{name}' is given more than once")
        seen.add(name)
        reject_shared_memory(f"input '{name}'", spec.parameters)
        shape = check_shape(name, list(spec.shape))
        if raw:
            if spec.HasField("contents"):
                raise InvalidArgument(
                    f"input '{name}': contents and raw_input_contents are mutually exclusive"
                )
            req.inputs.append(tensor_from_raw(name, spec.datatype, shape, raw[i]))
        else:
            req.inputs.append(_from_contents(name, spec.datatype, shape, spec.contents))
    for out in msg.outputs:
        reject_shared_memory(f"output '{out.name}'", out.parameters)
        cls = 0
        if "classification" in out.parameters:
            p = out.parameters["classification"]
            if p.WhichOneof("parameter_choice") != "int64_param" or p.int64_param < 0:
                # Triton's rule: an int64_param >= 0 (it refuses uint64_param too).
                raise InvalidArgument(
                    f"output '{out.name}': classification must be an int64_param >= 0"
                )
            cls = p.int64_param
        # Named twice: Triton's gRPC server answers it once, as last named.
        req.outputs = [o for o in req.outputs if o.name != out.name]
        req.outputs.append(RequestedOutput(out.name, None, cls))
    return req


def _from_contents(name: str, datatype: str, shape: tuple[int, ...], contents: Any) -> Tensor:
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        if datatype in DTYPES:
            raise InvalidArgument(f"input '{name}': {datatype} must be sent as raw contents")
        raise InvalidArgument(f"input '{name}': unknown datatype {datatype!r}")
    values = getattr(contents, field)
    count = element_count(shape)
    others = [f.name for f, _ in contents.ListFields() if f.name != field]
    if others:
        raise InvalidArgument(
            f"input '{name}': {datatype} data goes in '{field}', the request has "
            f"{', '.join(others)}"
        )
    if len(values) != count:
        raise InvalidArgument(
            f"input '{name}': shape {list(shape)} needs {count} elements, contents have "
            f"{len(values)}"
        )
    if datatype == "BYTES":
        arr = np.empty(count, dtype=object)
        arr[:] = list(values)
    else:
        try:
            arr = np.array(list(values), dtype=DTYPES[datatype])
        except OverflowError:
            raise InvalidArgument(f"input '{name}': value out of range for {datatype}") from None
    return Tensor(name, datatype, shape, shaped(name, arr, shape))


def encode_infer(resp: InferResponse) -> service_pb2.ModelInferResponse:
    msg = service_pb2.ModelInferResponse(
        model_name=resp.model, model_version=resp.version, id=resp.id
    )
    for k, v in resp.parameters.items():
        set_param(msg.parameters[k], v)
    for t in resp.outputs:
        msg.outputs.add(name=t.name, datatype=t.datatype, shape=list(t.shape))
        msg.raw_output_contents.append(tensor_to_raw(t))
    return msg


def encode_request(
    model: str,
    version: str,
    request_id: str,
    inputs: Sequence[Tensor],
    outputs: Sequence[RequestedOutput] | None,
    parameters: Mapping[str, ParamValue],
    sequence: Mapping[str, ParamValue] | None = None,
) -> service_pb2.ModelInferRequest:
    """A ``ModelInferRequest`` with raw contents, for calls made on the generated stub."""
    msg = service_pb2.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for t in inputs:
        msg.inputs.add(name=t.name, datatype=t.datatype, shape=list(t.shape))
        msg.raw_input_contents.append(tensor_to_raw(t))
    for o in outputs or ():
        out = msg.outputs.add(name=o.name)
        if o.classification:
            out.parameters["classification"].int64_param = o.classification
    for k, v in {**parameters, **(sequence or {})}.items():
        set_param(msg.parameters[k], v)
    return msg


def decode_outputs(msg: service_pb2.ModelInferResponse) -> list[Tensor]:
    """A response's outputs (raw contents, as Triton sends them)."""
    raw = msg.raw_output_contents
    out = []
    for i, spec in enumerate(msg.outputs):
        shape = tuple(spec.shape)
        if i < len(raw):
            out.append(tensor_from_raw(spec.name, spec.datatype, shape, raw[i]))
        else:
            out.append(_from_contents(spec.name, spec.datatype, shape, spec.contents))
    return out
