"""KServe v2 over HTTP: JSON and the binary tensor extension, to and from ``InferRequest``.

Binary extension: the header ``Inference-Header-Content-Length`` gives the length of
the JSON part; raw tensors follow in input order, each input naming its size in
``parameters.binary_data_size``. The tritonclient HTTP client sends and asks for
binary data by default, so both directions matter.

Raw binary requests (Triton's ``EVBufferToRawInput``): a header length of 0 (or no header
and an empty body, where Triton takes the body's length for it) means the whole body is
the model's one input, deduced from the model's configuration (``decode_raw_infer``); every
output then comes back binary.

BYTES outputs asked for as JSON are written as Triton writes them (rapidjson, no encoding
validation): each element's bytes go into the JSON string unchanged, only ``"``, ``\\``
and control characters escaped, so non-UTF-8 bytes reach the client as they left the
model (``json_string_bytes``).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from fair_frontend.errors import InvalidArgument
from fair_frontend.models import ModelInfo
from fair_frontend.protocol import (
    DTYPES,
    INT64_MAX,
    MAX_PARAMETERS,
    MAX_TENSORS,
    Declared,
    InferRequest,
    InferResponse,
    Precheck,
    RequestedOutput,
    Tensor,
    byte_size_mismatch,
    check_id,
    check_shape,
    declared_nbytes,
    dtype_of,
    element_count,
    reject_shared_memory,
    request_prefix,
    shaped,
    split_parameters,
    tensor_from_raw,
    tensor_to_list,
    tensor_to_raw,
)
from fair_frontend.shell.json_tensor import (
    Leaves,
    check_kinds,
    convert,
    count_byte,
    count_members,
    first_byte,
    has_nonfinite,
    is_container,
    scan_leaves,
    without_nonfinite,
)

HEADER_CONTENT_LENGTH = "Inference-Header-Content-Length"
# The name Triton's HTTP server gives a raw binary request's input until the model's
# configuration renames it (``EVBufferToRawInput``); some of its errors say it.
RAW_INPUT = "raw_input"


def parse_header_length(value: str | None, body_length: int) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise InvalidArgument(
            f"{HEADER_CONTENT_LENGTH} must be an integer, got {value!r}"
        ) from None
    if n < 0 or n > body_length:
        raise InvalidArgument(
            f"{HEADER_CONTENT_LENGTH} is {n}, but the request body has {body_length} bytes"
        )
    return n


# ---- request bodies: msgspec, tensor data left as JSON text until the model has seen it --


_Field = msgspec.Raw | msgspec.UnsetType


class _Tensor(msgspec.Struct):
    """An input or output of a request body, each field still JSON text (a view)."""

    name: _Field = msgspec.UNSET
    datatype: _Field = msgspec.UNSET
    shape: _Field = msgspec.UNSET
    parameters: _Field = msgspec.UNSET
    data: _Field = msgspec.UNSET


class _Body(msgspec.Struct):
    """The top level of a request body; any other member is skipped unread."""

    id: _Field = msgspec.UNSET
    parameters: _Field = msgspec.UNSET
    inputs: _Field = msgspec.UNSET
    outputs: _Field = msgspec.UNSET


class _WholeBody(msgspec.Struct):
    """``_Body`` with its inputs and outputs decoded in the same pass (``_top``)."""

    id: _Field = msgspec.UNSET
    parameters: _Field = msgspec.UNSET
    inputs: list[_Tensor] | msgspec.UnsetType = msgspec.UNSET
    outputs: list[_Tensor] | msgspec.UnsetType = msgspec.UNSET


_BODY = msgspec.json.Decoder(_Body)
_WHOLE_BODY = msgspec.json.Decoder(_WholeBody)
_TENSOR = msgspec.json.Decoder(_Tensor)
_TENSORS = msgspec.json.Decoder(list[_Tensor])
_MEMBERS = msgspec.json.Decoder(list[msgspec.Raw])
_PARAMETERS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_VALUE = msgspec.json.Decoder()
# A field that should hold a scalar (a name, a datatype, a parameter's value) or a short
# list (a shape) is decoded only if its JSON text is at most this long, or a string: what
# else it holds is wrong anyway, and decoding it would build a Python object per element.
SMALL_JSON_BYTES = 1024
# A lone UTF-16 surrogate escape (``\ud800`` not followed by a low one; a low one alone),
# not itself escaped (an even run of backslashes before it): text that is not Unicode.
_LONE_SURROGATE = re.compile(
    rb"(?<!\\)(?:\\\\)*(?:(\\u[dD][89abAB][0-9a-fA-F]{2})(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})(\\u[dD][c-fC-F][0-9a-fA-F]{2}))"
)


class _Unread:
    """A field too large to decode for what it should hold (see ``SMALL_JSON_BYTES``);
    it fails every type check, and says what it was in an error message."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __repr__(self) -> str:
        return f"<{self.size} bytes of JSON>"


def _field(raw: msgspec.Raw | memoryview | msgspec.UnsetType, default: Any) -> Any:
    """A small field's value; ``default`` where absent; ``_Unread`` where too large."""
    if raw is msgspec.UNSET:
        return default
    if len(raw) > SMALL_JSON_BYTES and first_byte(raw) != ord('"'):
        return _Unread(len(raw))
    try:
        return _VALUE.decode(raw)
    except msgspec.ValidationError:  # an integer wider than any type holds
        return _Unread(len(raw))
    except msgspec.DecodeError as err:  # NaN or Infinity (which Triton takes), or bad UTF-8
        try:
            return json.loads(bytes(raw))
        except (ValueError, RecursionError):
            raise InvalidArgument(f"failed to parse the request JSON: {err}") from None


def _is(raw: msgspec.Raw | msgspec.UnsetType, opening: bytes) -> bool:
    """Whether a field holds an array (``b"["``) or an object (``b"{"``). Where it does
    not and holds a string, the string is read: text that is not UTF-8 is a body that
    does not parse, whatever was expected in its place."""
    if raw is msgspec.UNSET:
        return False
    first = first_byte(raw)
    if first == ord('"'):
        _field(raw, None)
    return first == opening[0]


def _structure(decoder: msgspec.json.Decoder[Any], raw: msgspec.Raw) -> Any:
    """A part of the body (valid JSON, known to be of the right kind) decoded; a name in
    it that is not UTF-8 is a body that does not parse."""
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError as err:
        raise InvalidArgument(f"failed to parse the request JSON: {err}") from None


def _tensors(raw: msgspec.Raw, what: str) -> list[_Tensor]:
    """The members of ``inputs`` or ``outputs``, counted before they are decoded (at most
    MAX_TENSORS), then decoded in one pass over the text; ``what[i] must be an object``
    for the first that is not."""
    if count_members(raw, MAX_TENSORS) > MAX_TENSORS:
        raise InvalidArgument(f"the request has more than {MAX_TENSORS} {what}")
    try:
        specs: list[_Tensor] = _structure(_TENSORS, raw)
        return specs
    except msgspec.ValidationError:
        pass
    for i, member in enumerate(_structure(_MEMBERS, raw)):
        if not _is(member, b"{"):
            raise InvalidArgument(
                f"{what}[{i}] must be an object"
                + (" with a string 'name'" if what == "outputs" else "")
            )
    raise AssertionError("a member that is not an object was not found")  # pragma: no cover


def _parameters(
    raw: msgspec.Raw | msgspec.UnsetType, where: str, text: _Text | None = None
) -> dict[str, Any]:
    """A ``parameters`` object: each value a string, number or boolean, except Triton's
    ``headers`` (any JSON, passed over unread)."""
    if raw is msgspec.UNSET or first_byte(raw) == ord("n"):  # absent or null
        return {}
    if not _is(raw, b"{"):
        raise InvalidArgument(f"{where}: 'parameters' must be an object")
    if count_members(raw, MAX_PARAMETERS) > MAX_PARAMETERS:
        raise InvalidArgument(f"{where}: more than {MAX_PARAMETERS} parameters")
    out: dict[str, Any] = {}
    for k, v in _structure(_PARAMETERS, raw).items():
        if k == "headers":
            out[k] = None  # not a model parameter: never decoded
            continue
        value = None if is_container(v) else _field(v if text is None else text(v), None)
        if not isinstance(value, (bool, int, float, str)):
            raise InvalidArgument(f"{where}: parameter '{k}' must be a string, number or boolean")
        out[k] = value
    return out


def _parse_error(
    json_part: memoryview, header_length: int | None, err: Exception
) -> InvalidArgument:
    where = (
        ""
        if header_length is None
        else f" (the first {header_length} bytes, as {HEADER_CONTENT_LENGTH} says)"
    )
    lone = _LONE_SURROGATE.search(json_part)
    if lone is not None:
        escape = (lone.group(1) or lone.group(2)).decode()
        at = lone.start(1) if lone.group(1) else lone.start(2)
        return InvalidArgument(
            f"{_surrogate_field(json_part, at)} is not valid Unicode text: a lone UTF-16 "
            f"surrogate '{escape}' (at byte {at} of the request JSON{where})"
        )
    return InvalidArgument(f"failed to parse the request JSON{where}: {err}")


def _surrogate_field(json_part: memoryview, at: int) -> str:
    """Which field of the request the text at byte ``at`` (a lone surrogate) belongs to:
    read from a copy with every lone surrogate made a plain escape of the same length
    (``\\u0020``), so the rest of the body still parses; "a string" if it is not found."""
    fixed = _LONE_SURROGATE.sub(lambda m: m.group(0)[:-6] + b"\\u0020", bytes(json_part))
    try:
        doc = _BODY.decode(fixed)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return "a string"
    base = _address(fixed)

    def within(raw: Any) -> bool:
        if raw is msgspec.UNSET:
            return False
        lo = _address(raw) - base
        return lo <= at < lo + len(raw)

    try:
        return _field_at(doc, within)
    except (msgspec.DecodeError, msgspec.ValidationError, InvalidArgument):
        return "a string"


def _field_at(doc: _Body, within: Callable[[Any], bool]) -> str:
    if within(doc.id):
        return "'id'"
    if within(doc.parameters):
        return "a request parameter"
    for key, what in (("inputs", "input"), ("outputs", "output")):
        raw = getattr(doc, key)
        if not within(raw) or not _is(raw, b"[") or count_members(raw, MAX_TENSORS) > MAX_TENSORS:
            continue
        for i, member in enumerate(_MEMBERS.decode(raw)):
            if not within(member):
                continue
            if not _is(member, b"{"):
                return f"{key}[{i}]"
            spec = _TENSOR.decode(member)
            name = _field(spec.name, None)
            if within(spec.name) or not isinstance(name, str) or not name:
                return f"{key}[{i}]: 'name'"
            if within(spec.data):
                return f"{what} '{name}': a BYTES element"
            return f"{what} '{name}'"
    return "a string"


def _address(buffer: Any) -> int:
    address: int = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
    return address


def decode_infer(
    model: str,
    version: str,
    body: bytes,
    header_length: int | None,
    *,
    precheck: Precheck | None = None,
) -> InferRequest:
    """Decode an HTTP infer body (JSON, optionally followed by binary tensors).

    In three steps, so that nothing the model could not take is ever converted: the
    structure (every field but tensor data decoded, JSON data scanned for its element
    count and kinds, binary data sliced); then ``precheck`` (the model's checks on the
    inputs as declared); then the tensors."""
    view = memoryview(body)
    json_part = view if header_length is None else view[:header_length]
    binary = view[len(json_part) :] if header_length is not None else memoryview(b"")
    doc, text = _top(json_part, header_length)
    req = InferRequest(model=model, version=version)
    rid = _field(text(doc.id), "")
    if not isinstance(rid, str):
        raise InvalidArgument("'id' must be a string")
    req.id = check_id("request id", rid)  # before any error echoes it
    split_parameters(req, _parameters(doc.parameters, "request", text), http=True)

    # An empty list is Triton's to judge against the model (``validate``): a model whose
    # inputs are all optional takes a request without any.
    if isinstance(doc.inputs, list):
        inputs = doc.inputs
    elif doc.inputs is msgspec.UNSET or not _is(doc.inputs, b"["):
        raise InvalidArgument("the request must have an 'inputs' list")
    else:
        inputs = _tensors(doc.inputs, "inputs")
    offset = 0
    seen: set[str] = set()
    declared: list[Declared] = []
    pending: list[tuple[str, str, tuple[int, ...], memoryview | Leaves]] = []
    for i, spec in enumerate(inputs):
        name = _field(text(spec.name), None)
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"inputs[{i}]: 'name' must be a non-empty string")
        if name in seen:
            raise InvalidArgument(f"input '{name}' is given more than once")
        seen.add(name)
        datatype = _field(text(spec.datatype), None)
        shape = check_shape(name, _field(text(spec.shape), None))
        params = _parameters(spec.parameters, f"input '{name}'", text)
        reject_shared_memory(f"input '{name}'", params)
        size = params.get("binary_data_size")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise InvalidArgument(f"input '{name}': binary_data_size must be an integer >= 0")
            if spec.data is not msgspec.UNSET:
                raise InvalidArgument(f"input '{name}' has both 'data' and binary_data_size")
            if offset + size > len(binary):
                raise InvalidArgument(
                    f"input '{name}': binary_data_size {size} runs past the end of the "
                    f"binary data ({len(binary) - offset} bytes left)"
                )
            raw = binary[offset : offset + size]  # a view: frombuffer reads it in place
            offset += size
            datatype = str(datatype)
            dtype_of(name, datatype)
            declared.append(Declared(name, datatype, shape, len(raw)))
            pending.append((name, datatype, shape, raw))
        else:
            if spec.data is msgspec.UNSET:
                raise InvalidArgument(f"input '{name}' has neither 'data' nor binary_data_size")
            if not isinstance(datatype, str):
                raise InvalidArgument(f"input '{name}': 'datatype' must be a string")
            dtype_of(name, datatype)
            if datatype == "BF16":
                raise InvalidArgument(f"input '{name}': BF16 data must be sent in binary form")
            leaves = scan_leaves(name, text(spec.data))
            check_kinds(name, datatype, shape, leaves)
            declared.append(Declared(name, datatype, shape, declared_nbytes(datatype, shape)))
            pending.append((name, datatype, shape, leaves))
    if offset != len(binary):
        raise InvalidArgument(
            f"{len(binary) - offset} bytes of binary data follow the inputs unclaimed "
            f"(check {HEADER_CONTENT_LENGTH} and binary_data_size)"
        )
    _decode_outputs(req, doc.outputs, text)
    if precheck is not None:
        precheck(req, declared)
    for name, datatype, shape, data in pending:
        if isinstance(data, Leaves):
            arr = convert(name, datatype, dtype_of(name, datatype), data)
            req.inputs.append(Tensor(name, datatype, shape, shaped(name, arr, shape)))
        else:
            req.inputs.append(tensor_from_raw(name, datatype, shape, data, model=model, rid=req.id))
    return req


class _Text:
    """Where the fields' JSON text is read: the body itself. For a body with NaN or
    Infinity (JSON extensions Triton takes; msgspec does not), msgspec parses a copy in
    which they are numbers of the same length (``json_tensor.without_nonfinite``), and a
    field is read from the body at the offsets the copy gave it."""

    def __init__(self, body: memoryview, parsed: Any = None) -> None:
        self.body = body
        self.base = None if parsed is None else _address(parsed)

    def __call__(self, raw: Any) -> Any:
        if self.base is None or raw is msgspec.UNSET:
            return raw
        lo = _address(raw) - self.base
        return self.body[lo : lo + len(raw)]


def _top(json_part: memoryview, header_length: int | None) -> tuple[_Body | _WholeBody, _Text]:
    """The top level of a body, and where its fields are read. Where it holds few JSON
    objects (so few that decoding each costs nothing worth bounding), in one pass with its
    inputs and outputs (each pass over a large body holds the interpreter for a while:
    0.37 s for 87 MiB here); else, or where a field has the wrong type, with inputs and
    outputs left as text, counted before they are decoded (``_tensors``)."""
    try:
        return _parse_top(json_part), _Text(json_part)
    except msgspec.ValidationError:
        raise InvalidArgument("the request JSON must be an object") from None
    except (msgspec.DecodeError, RecursionError) as err:
        # DecodeError: malformed JSON, bad UTF-8 or escapes, NaN or Infinity;
        # RecursionError: arrays nested thousands deep.
        if has_nonfinite(json_part):
            parsed = without_nonfinite(json_part)
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                return _parse_top(parsed), _Text(json_part, parsed)
        raise _parse_error(json_part, header_length, err) from None


def _parse_top(text: Any) -> _Body | _WholeBody:
    if count_byte(text, ord("{"), MAX_TENSORS) <= MAX_TENSORS:
        with contextlib.suppress(msgspec.ValidationError):
            whole: _WholeBody = _WHOLE_BODY.decode(text)
            return whole
    doc: _Body = _BODY.decode(text)
    return doc


def _decode_outputs(
    req: InferRequest, raw: list[_Tensor] | msgspec.Raw | msgspec.UnsetType, text: _Text
) -> None:
    if raw is msgspec.UNSET:
        return
    if isinstance(raw, list):
        outputs = raw
    elif not _is(raw, b"["):
        raise InvalidArgument("'outputs' must be a list")
    else:
        outputs = _tensors(raw, "outputs")
    for i, spec in enumerate(outputs):
        name = _field(text(spec.name), None)
        if not isinstance(name, str):
            raise InvalidArgument(f"outputs[{i}] must be an object with a string 'name'")
        params = _parameters(spec.parameters, f"output '{name}'", text)
        reject_shared_memory(f"output '{name}'", params)
        binary_flag = params.get("binary_data")
        if binary_flag is not None and not isinstance(binary_flag, bool):
            raise InvalidArgument(f"output '{name}': binary_data must be a boolean")
        cls = params.get("classification", 0)
        if isinstance(cls, bool) or not isinstance(cls, int) or not 0 <= cls <= INT64_MAX:
            raise InvalidArgument(
                f"output '{name}': classification must be an integer >= 0 that fits "
                "in a signed 64-bit integer"
            )
        if all(o.name != name for o in req.outputs):
            # Named twice: Triton's HTTP server answers it once, as first named.
            req.outputs.append(RequestedOutput(name, binary_flag, cls))


def is_raw_binary(header_length: int | None, body_length: int) -> bool:
    """Whether Triton reads this body as one raw input: its header length is 0, given or
    taken from the body's length when the header is absent (``GetInferenceHeaderLength``)."""
    return (body_length if header_length is None else header_length) == 0


def decode_raw_infer(model: str, version: str, body: bytes, info: ModelInfo) -> InferRequest:
    """A raw binary request: the whole body is the model's one input, as Triton core's
    ``InferenceRequest::Normalize`` deduces it. Name and datatype come from the model's
    configuration; the shape is its dims (after a batch dimension of 1 where the model
    batches), with the one variable-sized dimension, if any, taken from the byte count.
    BYTES only for a one-element input, the body then that element. Errors carry
    Triton's own text: clients and Triton's QA tests match on it."""
    prefix = request_prefix("")
    if len(info.inputs) != 1:
        raise InvalidArgument(
            f"{prefix}Raw request must only have 1 input (found 1) to be deduced but got "
            f"{len(info.inputs)} inputs in '{model}' model configuration"
        )
    spec = next(iter(info.inputs.values()))
    shape = [1] if info.max_batch_size != 0 else []
    dynamic_axis = -1
    elements = 1
    for dim in spec.dims:
        if dim == -1:
            if dynamic_axis != -1:
                raise InvalidArgument(
                    f"{prefix}The shape of the raw input '{spec.name}' can not be deduced "
                    "because there are more than one variable-sized dimension"
                )
            dynamic_axis = len(shape)
        else:
            elements *= dim
        shape.append(dim)
    if spec.datatype == "BYTES":
        if dynamic_axis != -1 or elements != 1:
            raise InvalidArgument(
                f"{prefix}For BYTE datatype raw input '{spec.name}', the model must have "
                "input shape [1]"
            )
        # Triton prepends the body's length: one element, the whole body.
        data = np.empty(1, dtype=object)
        data[0] = bytes(body)
        tensor = Tensor(spec.name, spec.datatype, tuple(shape), data.reshape(shape))
    else:
        itemsize = DTYPES[spec.datatype].itemsize
        if dynamic_axis != -1:
            # Triton's integer division: a body that is no whole number of elements gets
            # the shape rounded down, then the byte size mismatch below. A fixed zero
            # dimension would divide by zero there; the shape is then all zeros here.
            shape[dynamic_axis] = len(body) // elements // itemsize if elements else 0
        expected = element_count(tuple(shape)) * itemsize
        if len(body) != expected:
            # Triton checks the size while the input still has its raw name.
            raise InvalidArgument(byte_size_mismatch("", RAW_INPUT, model, expected, len(body)))
        tensor = tensor_from_raw(spec.name, spec.datatype, tuple(shape), memoryview(body))
    req = InferRequest(model=model, version=version, inputs=[tensor])
    req.binary_output = True  # Triton answers a raw request's outputs in binary
    return req


def encode_infer(resp: InferResponse, req: InferRequest) -> tuple[bytes, int | None]:
    """Encode a response; returns (body, JSON header length or None when all JSON)."""
    binary_flags = {o.name: o.binary for o in req.outputs}
    doc: dict[str, Any] = {"model_name": resp.model, "model_version": resp.version}
    if resp.id:
        doc["id"] = resp.id
    if resp.parameters:
        doc["parameters"] = resp.parameters
    chunks: list[bytes] = []
    outs: list[bytes] = []
    for t in resp.outputs:
        flag = binary_flags.get(t.name)
        # Triton: binary_data_output is the default for "all outputs" only; an output
        # named in the request is binary only if its own binary_data says so.
        binary = bool(flag) if req.outputs else req.binary_output
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if binary or t.datatype == "BF16":
            raw = tensor_to_raw(t)
            entry["parameters"] = {"binary_data_size": len(raw)}
            if raw:
                # Triton sends its header length only with binary data after the JSON:
                # outputs of no bytes alone leave the answer all JSON.
                chunks.append(raw)
            outs.append(_compact(entry))
        elif t.datatype == "BYTES":
            # Spliced in as bytes: json.dumps would have to decode the elements first.
            data = b",".join(json_string_bytes(_element_bytes(b)) for b in t.data.flat)
            outs.append(_compact(entry)[:-1] + b',"data":[' + data + b"]}")
        else:
            entry["data"] = tensor_to_list(t)
            outs.append(_compact(entry))
    header = _compact(doc)[:-1] + b',"outputs":[' + b",".join(outs) + b"]}"
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)


def _compact(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _element_bytes(item: Any) -> bytes:
    return item if isinstance(item, bytes) else str(item).encode()


# rapidjson's escapes (``Writer::WriteString``): the two-character ones where JSON has them,
# ``\u00XX`` (upper-case hex) for the other control characters; every other byte as is.
_JSON_ESCAPES = {
    **{c: b"\\u%04X" % c for c in range(0x20)},
    0x08: b"\\b",
    0x09: b"\\t",
    0x0A: b"\\n",
    0x0C: b"\\f",
    0x0D: b"\\r",
    0x22: b'\\"',
    0x5C: b"\\\\",
}
_NEEDS_ESCAPE = re.compile(rb'[\x00-\x1f"\\]')


def json_string_bytes(value: bytes) -> bytes:
    """``value`` as a JSON string, written as Triton writes a BYTES element (rapidjson
    without encoding validation): the bytes unchanged, valid UTF-8 or not, but for the
    escapes JSON requires. A client reading the body as Latin-1 or bytes (as Triton's QA
    ``L0_string_io`` does) gets back exactly what the model produced."""
    body = _NEEDS_ESCAPE.sub(lambda m: _JSON_ESCAPES[m.group()[0]], value)
    return b'"' + body + b'"'


def encode_error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()
