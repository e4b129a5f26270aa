"""The KServe v2 inference request as the frontend sees it, independent of transport.

Both shells (HTTP and gRPC) decode into ``InferRequest`` and encode from
``InferResponse``; everything between (authentication, admission, scheduling, batching,
forwarding) works on these. Tensors are numpy arrays in their final shape: batching
needs them decoded anyway, and ``np.frombuffer`` makes the decode zero-copy for raw
(binary) data.

Datatypes follow Triton's table: BYTES tensors are numpy object arrays of ``bytes``;
BF16 has no numpy type and travels as raw 2-byte words (it can be batched, not
converted to JSON).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fair_frontend.errors import InvalidArgument
from fair_frontend.quota import Quota

# Triton datatype -> numpy dtype (little-endian, as the protocol requires).
DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BF16": np.dtype("<u2"),  # raw words: batched and forwarded, never converted
    "BYTES": np.dtype(object),
}

# Parameters with a meaning to Triton; never forwarded as custom parameters.
RESERVED_PARAMETERS = frozenset(
    {
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "priority",
        "timeout",
        "headers",
        "binary_data_output",
    }
)
RESERVED_PREFIX = "triton_"
# The one ``triton_`` request parameter Triton itself understands (decoupled streaming);
# perf_analyzer sends it on every request.
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
# The response parameter that marks a decoupled request's last response.
FINAL_RESPONSE = "triton_final_response"
# The frontend's own per-batch parameters (``fair_rows``) travel under this prefix.
FRONTEND_PREFIX = "fair_"
# Triton's shared-memory extension: tensor data in a region registered with the server. A
# frontend on another host cannot read it, and does not list the extension.
SHARED_MEMORY_PARAMETER = "shared_memory_region"
# The parameter a trusted gateway (or a client, checked against its key) names the tenant in.
TENANT_PARAMETER = "tenant"
# The parameter a request names its program in (an agent's run, a chat session: the
# tenant's programs share its turns, ``scheduler.queues.TenantQueue``); the gateway takes
# it out of the request's parameters, so the model never sees it.
PROGRAM_PARAMETER = "program"
# The header a request (or a gateway in front) names its program in.
PROGRAM_HEADER = "x-program-id"
# The parameter and header a request names its SLO class in (``admission.slo``); taken
# out of its parameters like the program.
SLO_CLASS_PARAMETER = "slo_class"
SLO_CLASS_HEADER = "x-slo-class"

ParamValue = bool | int | float | str

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
UINT64_MAX = (1 << 64) - 1
MAX_DIMS = 32  # numpy's limit on array dimensions
# Longest request id and string sequence id, in UTF-8 bytes. Triton sets no limit, but the
# frontend copies a request id into every row's ``fair_rows`` entry and keeps a sequence
# id for the sequence's life: unbounded, a client would choose how much memory they take.
MAX_ID_BYTES = 1024
# Longest model name, in UTF-8 bytes (a Triton model is a directory of its repository,
# whose names file systems cap at 255 bytes; object stores' keys at 1024). A longer name
# is refused before it is echoed in an error, a log line or looked up.
MAX_NAME_BYTES = 1024
# Longest program id (the ``program`` parameter, ``x-program-id``, an OpenAI call's
# ``user``), in UTF-8 bytes: a queue keeps a bounded number of programs, each by its id.
# A longer one is refused (400), never cut: two ids that differ after the cut would merge.
MAX_PROGRAM_BYTES = 1024
# Inputs (or outputs) and parameters one request may name. Triton sets no limit, but each
# costs a decoded structure: counted in the request's bytes first (``json_tensor``), so that
# a body of ten million empty objects is refused before it becomes ten million of anything.
MAX_TENSORS = 1024
MAX_PARAMETERS = 1024


@dataclass(slots=True)
class Tensor:
    """One named tensor; ``data`` already has ``shape`` (object dtype for BYTES)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        if self.datatype == "BYTES":
            return int(sum(len(b) + 4 for b in self.data.flat))
        return int(self.data.nbytes)


@dataclass(frozen=True, slots=True)
class Declared:
    """An input as a request declares it, before its data is converted: what the model's
    checks need (``models.check_declared``), so that data no model could take is never
    turned into a tensor. ``nbytes``: the tensor's size once converted, where known
    before converting (numeric data: from the shape; BYTES: its binary form's length)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    nbytes: int | None = None


# Called by a codec with the request (its id, version, parameters decoded) and its inputs
# as declared, before any tensor is converted; raises to refuse the request.
Precheck = Callable[["InferRequest", "list[Declared]"], None]


def declared_nbytes(datatype: str, shape: tuple[int, ...]) -> int | None:
    """A numeric tensor's size from its shape; None for BYTES (its elements' lengths)
    and for a datatype the protocol does not know."""
    dtype = DTYPES.get(datatype)
    if dtype is None or datatype == "BYTES":
        return None
    return element_count(shape) * dtype.itemsize


@dataclass(slots=True)
class RequestedOutput:
    name: str
    binary: bool | None = None  # HTTP only: per-output binary_data; None = request default
    classification: int = 0  # Triton's classification extension: top-k, 0 = off


@dataclass(slots=True)
class InferRequest:
    """A decoded KServe v2 inference request."""

    model: str
    version: str = ""
    id: str = ""
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[RequestedOutput] = field(default_factory=list)  # empty = all outputs
    parameters: dict[str, ParamValue] = field(default_factory=dict)  # custom ones only
    priority: int = 0  # Triton's convention: 0 = default level, 1 = highest
    timeout_us: int | None = None  # relative to arrival
    sequence: dict[str, ParamValue] = field(default_factory=dict)  # sequence_id/_start/_end
    binary_output: bool = False  # HTTP: request-level binary_data_output
    empty_final_response: bool = False  # triton_enable_empty_final_response (decoupled)
    tenant_claim: str | None = None  # the `tenant` parameter, if any

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.inputs)

    def input(self, name: str) -> Tensor | None:
        for t in self.inputs:
            if t.name == name:
                return t
        return None


@dataclass(frozen=True, slots=True)
class Batch:
    """One request to a backend, whole: a batch's rows packed into its tensors, or a
    stream's one request. What a dispatcher (the core's batches) or a shell (its granted
    rows and streams) hands the backend's forwarder, in place of loose arguments."""

    model: str
    version: str
    inputs: Sequence[Tensor]
    outputs: Sequence[RequestedOutput] | None = None  # None: all of the model's outputs
    parameters: Mapping[str, ParamValue] = field(default_factory=dict)
    request_id: str = ""  # the one request's id, where the batch is one request
    sequence: Mapping[str, ParamValue] | None = None  # sequence_id/_start/_end, passed on
    traceparent: str = ""  # the W3C trace context the backend's spans join

    def all_parameters(self) -> dict[str, ParamValue]:
        """The request's parameters with its sequence's, as the backend takes them."""
        return {**self.parameters, **(self.sequence or {})}


@dataclass(slots=True)
class InferResponse:
    model: str
    version: str
    id: str
    outputs: list[Tensor]
    parameters: dict[str, ParamValue] = field(default_factory=dict)
    # The tenant's rate-limit state after this request's check (the answer's headers,
    # ``quota.quota_headers``); None: no limits. A stream's responses all carry its grant's.
    quota: Quota | None = None
    # The response as its client's protocol carries it, Triton's own bytes passed on:
    # generate_stream's events (``triton.sse``: whole, one or more) or a serialized
    # ``ModelStreamInferResponse``. Written as they are (``outputs`` and ``parameters``
    # are empty then).
    wire: bytes = b""


# ---- Triton's own error texts (clients and Triton's QA tests match on them) --------------


def request_prefix(rid: str) -> str:
    """Triton core's prefix on a request's errors (``InferenceRequest::LogRequest``)."""
    return f"[request id: {rid or '<id_unknown>'}] "


def byte_size_mismatch(rid: str, name: str, model: str, expected: int, got: int) -> str:
    """Triton core's answer to tensor data of the wrong size for its shape and datatype
    (``InferenceRequest::Normalize``)."""
    return (
        f"{request_prefix(rid)}input byte size mismatch for input '{name}' for model "
        f"'{model}'. Expected {expected}, got {got}"
    )


def unexpected_shape(
    rid: str, name: str, model: str, expected: tuple[int, ...], got: tuple[int, ...], batching: bool
) -> str:
    """Triton core's answer to an input whose shape the model does not take
    (``InferenceRequest::Normalize``); ``expected`` with the batch dimension (-1) where the
    model batches. Word for word, the trailing ". " where there is no note included."""

    def dims(shape: tuple[int, ...]) -> str:
        return "[" + ",".join(str(d) for d in shape) + "]"

    note = (
        "NOTE: Setting a non-zero max_batch_size in the model config requires a batch "
        "dimension to be prepended to each input shape. If you want to specify the full "
        "shape including the batch dim in your input dims config, try setting "
        "max_batch_size to zero. See the model configuration docs for more info on "
        "max_batch_size."
        if batching
        else ""
    )
    return (
        f"{request_prefix(rid)}unexpected shape for input '{name}' for model '{model}'. "
        f"Expected {dims(expected)}, got {dims(got)}. {note}"
    )


# ---- parameters -------------------------------------------------------------------------


# Triton's answers to a request parameter named ``triton_...``: over HTTP every such name is
# refused (``ParseJsonTritonParams``), over gRPC all but the ones Triton knows
# (``TRITON_RESERVED_REQUEST_PARAMS``, in ``SetInferenceRequestMetadata``).
RESERVED_TRITON_HTTP = (
    "parameter keys starting with 'triton_' are reserved for Triton usage and should not "
    "be specified."
)
RESERVED_TRITON_GRPC = (
    "parameter keys starting with 'triton_' are reserved for Triton usage. Only the "
    f"following keys starting with 'triton_' are allowed: {EMPTY_FINAL_RESPONSE}"
)


def split_parameters(
    req: InferRequest, params: dict[str, ParamValue], *, http: bool = False
) -> None:
    """Sort request parameters into the fields of ``req``, validating reserved ones.
    ``http``: the parameters of an HTTP infer body, where Triton takes no ``triton_`` name
    at all (gRPC takes ``triton_enable_empty_final_response``)."""
    for name, value in params.items():
        if name == "priority":
            req.priority = _non_negative_int(name, value)
        elif name == "timeout":
            req.timeout_us = _non_negative_int(name, value)
        elif name == "sequence_id":
            req.sequence[name] = _sequence_id(value)
        elif name in ("sequence_start", "sequence_end"):
            if not isinstance(value, bool):
                raise InvalidArgument(f"parameter '{name}' must be a boolean, got {value!r}")
            req.sequence[name] = value
        elif name == "binary_data_output":
            if not isinstance(value, bool):
                raise InvalidArgument("parameter 'binary_data_output' must be a boolean")
            req.binary_output = value
        elif name == "headers":
            continue  # Triton's HTTP header forwarding map: not a model parameter
        elif name.startswith(RESERVED_PREFIX) and (http or name != EMPTY_FINAL_RESPONSE):
            raise InvalidArgument(RESERVED_TRITON_HTTP if http else RESERVED_TRITON_GRPC)
        elif name == EMPTY_FINAL_RESPONSE:
            if not isinstance(value, bool):
                raise InvalidArgument(
                    f"invalid value type for '{name}' parameter, expected bool_param."
                )
            req.empty_final_response = value
        elif name.startswith(FRONTEND_PREFIX):
            raise InvalidArgument(
                f"parameter '{name}' is reserved: names starting with '{FRONTEND_PREFIX}' "
                "belong to the frontend"
            )
        elif name == TENANT_PARAMETER:
            if not isinstance(value, str):
                raise InvalidArgument(f"parameter '{TENANT_PARAMETER}' must be a string")
            req.tenant_claim = value
        else:
            if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
                # Forwarded as gRPC int64_param: a wider JSON integer cannot travel on.
                raise InvalidArgument(
                    f"parameter '{name}' is out of range: integer parameters must fit in "
                    f"a signed 64-bit integer, got {value}"
                )
            req.parameters[name] = value


def _header_or_parameter(
    req: InferRequest, headers: Mapping[str, str], header: str, parameter: str
) -> tuple[str, str] | None:
    """What the request names by ``header`` (first) or its ``parameter`` (taken out of its
    parameters either way: the model never sees it), and where it was named (for a
    refusal); None: neither. InvalidArgument (400) where the parameter is not a string."""
    asked = req.parameters.pop(parameter, None)
    value = headers.get(header)
    if value is not None:
        return value.strip(), f"header '{header}'"
    if asked is None:
        return None
    if not isinstance(asked, str):
        raise InvalidArgument(f"parameter '{parameter}' must be a string")
    return asked, f"parameter '{parameter}'"


def take_program(req: InferRequest, headers: Mapping[str, str]) -> str:
    """The program ``req`` names ("": none), its ``program`` parameter taken out of its
    parameters (the model never sees it): ``x-program-id`` where the headers have it (a
    gateway in front, or a client, names it for this frontend), else the parameter (an
    OpenAI call's ``user`` arrives as one). InvalidArgument (400) where it is not a
    string or is longer than ``MAX_PROGRAM_BYTES``: the refusal says how long, never
    what it is."""
    named = _header_or_parameter(req, headers, PROGRAM_HEADER, PROGRAM_PARAMETER)
    if named is None:
        return ""
    value, where = named
    size = len(value.encode("utf-8", errors="surrogatepass"))
    if size > MAX_PROGRAM_BYTES:
        raise InvalidArgument(
            f"{where} is too long: {size} bytes, the limit is {MAX_PROGRAM_BYTES} bytes"
        )
    return value


def take_slo_class(req: InferRequest, headers: Mapping[str, str], known: Collection[str]) -> str:
    """The SLO class ``req`` names ("": none), its ``slo_class`` parameter taken out of its
    parameters (the model never sees it): ``x-slo-class`` where the headers have it, else
    the parameter. InvalidArgument (400) where it is not a string or not one of ``known``
    (the configured classes); the refusal names them, and the asked name only if short."""
    named = _header_or_parameter(req, headers, SLO_CLASS_HEADER, SLO_CLASS_PARAMETER)
    if named is None:
        return ""
    value, where = named
    if value and value not in known:
        shown = repr(value) if len(value) <= 64 else "(a name too long to be one)"
        names = ", ".join(sorted(known)) if known else "none are configured"
        raise InvalidArgument(f"{where}: unknown SLO class {shown}: the classes are {names}")
    return value


def reject_shared_memory(where: str, params: Container[str]) -> None:
    """A tensor that points into shared memory cannot be served here: say so, by name."""
    if SHARED_MEMORY_PARAMETER in params:
        raise InvalidArgument(
            f"{where}: parameter '{SHARED_MEMORY_PARAMETER}' asks for shared memory, which "
            "this server does not support (send the data in the request)"
        )


def check_id(what: str, value: str) -> str:
    """``value`` (a request or sequence id) if it is at most ``MAX_ID_BYTES`` long."""
    size = len(value.encode("utf-8", errors="surrogatepass"))
    if size > MAX_ID_BYTES:
        raise InvalidArgument(
            f"{what} is too long: {size} bytes, the limit is {MAX_ID_BYTES} bytes"
        )
    return value


def check_name(what: str, value: str) -> str:
    """``value`` (a model name) if it is at most ``MAX_NAME_BYTES`` long and valid Unicode
    text. The refusal says how long it is, never what it is."""
    size = len(value.encode("utf-8", errors="surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise InvalidArgument(
            f"{what} is too long: {size} bytes, the limit is {MAX_NAME_BYTES} bytes"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # JSON can spell one ("\ud800"): no model has such a name, and none can be asked of
        # Triton (it would fail encoding the call, a 500).
        raise InvalidArgument(
            f"{what} is not valid Unicode text: it holds a lone surrogate (a \\ud800-\\udfff "
            "escape not in a pair)"
        ) from None
    return value


def clipped(value: str, limit: int = MAX_ID_BYTES) -> str:
    """A client's string as it may be echoed (a log line, an error) before its own length
    check has run or where it failed: at most ``limit`` characters, the cut said."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}... ({len(value)} characters)"


def _sequence_id(value: ParamValue) -> ParamValue:
    """A string of at most ``MAX_ID_BYTES``, or an integer Triton can take on (it travels
    on as gRPC int64_param)."""
    if isinstance(value, str):
        return check_id("parameter 'sequence_id'", value)
    n = _non_negative_int("sequence_id", value)
    if n > INT64_MAX:
        raise InvalidArgument(
            f"parameter 'sequence_id' is out of range: an integer id must fit in a signed "
            f"64-bit integer, got {n} (or send the id as a string)"
        )
    return n


def _non_negative_int(name: str, value: ParamValue) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"parameter '{name}' must be an integer, got {value!r}")
    if value < 0:
        raise InvalidArgument(f"parameter '{name}' must be >= 0, got {value}")
    if value > UINT64_MAX:
        raise InvalidArgument(
            f"parameter '{name}' is out of range: it must fit in an unsigned 64-bit integer"
        )
    return value


# ---- BYTES codec: 4-byte little-endian length + bytes, per element ----------------------


def serialize_bytes(arr: np.ndarray) -> bytes:
    parts = []
    for item in arr.flat:
        b = item if isinstance(item, bytes) else str(item).encode()
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def deserialize_bytes(buf: bytes | memoryview, count: int, where: str) -> np.ndarray:
    view = memoryview(buf)
    if 4 * count > len(view):
        # Checked before allocating: a shape may claim far more elements than were sent.
        raise InvalidArgument(
            f"{where}: {count} BYTES elements need at least {4 * count} bytes (a 4-byte "
            f"length each), got {len(view)}"
        )
    out = np.empty(count, dtype=object)
    offset = 0
    for i in range(count):
        if offset + 4 > len(view):
            raise InvalidArgument(f"{where}: BYTES data ends after {i} of {count} elements")
        (n,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + n > len(view):
            raise InvalidArgument(f"{where}: BYTES element {i} claims {n} bytes past the end")
        out[i] = bytes(view[offset : offset + n])
        offset += n
    if offset != len(view):
        raise InvalidArgument(
            f"{where}: {len(view) - offset} bytes left over after {count} BYTES elements"
        )
    return out


# ---- raw (binary) tensor data ------------------------------------------------------------


def element_count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in shape
    ):
        raise InvalidArgument(f"input '{name}': shape must be a list of integers, got {shape!r}")
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"input '{name}': shape {list(shape)} has a negative dimension")
    if len(shape) > MAX_DIMS or any(d > INT64_MAX for d in shape):
        raise InvalidArgument(
            f"input '{name}': shape {list(shape)} is out of range (at most {MAX_DIMS} "
            "dimensions, each a signed 64-bit integer)"
        )
    return tuple(shape)


def shaped(name: str, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``data.reshape(shape)``; a shape numpy cannot hold (e.g. ``[0, 2**62]``) is the
    client's error, not ours."""
    try:
        return data.reshape(shape)
    except ValueError as err:
        raise InvalidArgument(f"input '{name}': shape {list(shape)} is unusable: {err}") from None


def dtype_of(name: str, datatype: Any) -> np.dtype[Any]:
    try:
        return DTYPES[datatype]
    except (KeyError, TypeError):
        raise InvalidArgument(
            f"input '{name}': unknown datatype {datatype!r} (expected one of {', '.join(DTYPES)})"
        ) from None


def tensor_from_raw(
    name: str,
    datatype: str,
    shape: tuple[int, ...],
    raw: bytes | memoryview,
    *,
    model: str | None = None,
    rid: str = "",
) -> Tensor:
    """Decode one tensor's raw bytes (binary extension / gRPC raw contents). ``model`` (and
    the request id ``rid``): a request's input, whose wrong size gets Triton's own answer;
    None for tensors that are not a client's (Triton's outputs)."""
    dtype = dtype_of(name, datatype)
    count = element_count(shape)
    if datatype == "BYTES":
        data = deserialize_bytes(raw, count, f"input '{name}'")
    else:
        expected = count * dtype.itemsize
        if len(raw) != expected:
            if model is not None:
                raise InvalidArgument(byte_size_mismatch(rid, name, model, expected, len(raw)))
            raise InvalidArgument(
                f"input '{name}': expected {expected} bytes for {datatype} shape "
                f"{list(shape)}, got {len(raw)}"
            )
        data = np.frombuffer(raw, dtype=dtype)
    return Tensor(name, datatype, shape, shaped(name, data, shape))


def tensor_to_raw(t: Tensor) -> bytes:
    if t.datatype == "BYTES":
        return serialize_bytes(t.data)
    return np.ascontiguousarray(t.data, dtype=DTYPES[t.datatype]).tobytes()


def tensor_from_list(name: str, datatype: str, shape: tuple[int, ...], values: Any) -> Tensor:
    """Decode JSON tensor data (flat or nested lists, row-major)."""
    dtype = dtype_of(name, datatype)
    if datatype == "BF16":
        raise InvalidArgument(f"input '{name}': BF16 data must be sent in binary form")
    count = element_count(shape)
    flat = _flatten(values, name)
    if len(flat) != count:
        raise InvalidArgument(
            f"input '{name}': shape {list(shape)} needs {count} elements, data has {len(flat)}"
        )
    if datatype == "BYTES":
        arr = np.empty(count, dtype=object)
        for i, v in enumerate(flat):
            if isinstance(v, str):
                arr[i] = v.encode()
            elif isinstance(v, (bytes, bytearray)):
                arr[i] = bytes(v)
            else:
                raise InvalidArgument(f"input '{name}': BYTES element {i} is not a string")
    else:
        _check_json_elements(name, datatype, flat)
        if dtype.kind in "iu" and count:
            # numpy would wrap out-of-range integers: check the range first.
            info = np.iinfo(dtype)
            if min(flat) < info.min or max(flat) > info.max:
                raise InvalidArgument(f"input '{name}': value out of range for {datatype}")
        try:
            arr = np.array(flat, dtype=dtype)
        except (ValueError, OverflowError, TypeError) as err:
            raise InvalidArgument(f"input '{name}': data is not {datatype}: {err}") from None
    return Tensor(name, datatype, shape, shaped(name, arr, shape))


def _check_json_elements(name: str, datatype: str, flat: list[Any]) -> None:
    if datatype == "BOOL":
        ok = all(isinstance(v, bool) for v in flat)
    elif datatype.startswith(("INT", "UINT")):
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in flat)
    else:
        ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat)
    if not ok:
        raise InvalidArgument(f"input '{name}': JSON data holds values that are not {datatype}")


def _flatten(values: Any, name: str) -> list[Any]:
    if not isinstance(values, list):
        raise InvalidArgument(f"input '{name}': 'data' must be a list")
    return leaves(values)


def leaves(value: Any) -> list[Any]:
    """The non-list elements of nested lists, row-major, without recursion (a deeply
    nested body cannot exhaust the stack); a non-list is its own one leaf."""
    if not isinstance(value, list):
        return [value]
    out: list[Any] = []
    stack = [iter(value)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, list):
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


def tensor_to_list(t: Tensor) -> list[Any]:
    """JSON form of an output: flat, row-major; BYTES as text where it decodes."""
    if t.datatype == "BYTES":
        return [
            b.decode("utf-8", errors="replace") if isinstance(b, bytes) else str(b)
            for b in t.data.flat
        ]
    if t.datatype == "BF16":
        raise InvalidArgument(f"output '{t.name}': BF16 can only be returned in binary form")
    return t.data.reshape(-1).tolist()
