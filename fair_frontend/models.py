"""What the frontend knows of each Triton model, and the checks made before queueing.

A request is validated against the model's config before it enters a queue: a bad
item must never reach a batch, where it would fail every other tenant's rows with it.
Messages follow Triton's wording where Triton has the check, so clients that match on
them keep working.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fair_frontend.config import WIRE_FRAMING_BYTES, CostUnit, Endpoint
from fair_frontend.errors import InvalidArgument
from fair_frontend.protocol import (
    DTYPES,
    INT64_MAX,
    Declared,
    InferRequest,
    ParamValue,
    Tensor,
    check_id,
    element_count,
    request_prefix,
    unexpected_shape,
)
from fair_frontend.sampling import check_sampling, read_sampling_input
from fair_frontend.tokens import count_text_tokens, max_token_bytes
from fair_frontend.wire.records import ModelDescribed, TensorDescribed

if TYPE_CHECKING:
    from fair_frontend.endpoint import EndpointPlan

_INTEGER = re.compile(r"[+-]?[0-9]+")
# The model-config parameter by which a model asks for the frontend's per-row metadata
# (``fair_rows``, ``fair_outputs``): ``parameters { key: "fair_frontend_rows" value {
# string_value: "true" } }``. A model that does not ask gets the client's request
# parameters exactly as sent, as from Triton directly: a model that reads
# ``request.parameters()`` (Triton's qa/L0_parameters echoes them) must not find ours.
ROWS_CONFIG_PARAMETER = "fair_frontend_rows"
# The model-config parameter in which an engine declares its context, prompt plus generated
# tokens (vLLM's name; the shipped llm's config.pbtxt): max_tokens is checked against it.
CONTEXT_CONFIG_PARAMETER = "max_model_len"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    dims: tuple[int, ...]  # without the batch dimension
    optional: bool = False


@dataclass(frozen=True)
class ModelInfo:
    """What scheduling and validation need of a model, in the frontend's own words: its
    backend describes it (``backends.triton.model_config.model_info`` reads Triton's model
    config into one). The backend's own description is not kept: a client that asks for
    it (KServe's model config call) is answered by the backend."""

    name: str
    max_batch_size: int
    inputs: Mapping[str, TensorSpec]
    outputs: Mapping[str, TensorSpec]
    decoupled: bool = False
    sequence_batching: bool = False
    platform: str = ""
    instances: int = 1  # model instances Triton runs (sum of instance_group counts)
    versions: tuple[str, ...] = ("1",)  # ready versions, from the model's metadata
    # The model asked for ``fair_rows`` (ROWS_CONFIG_PARAMETER): only then may per-row
    # values (lengths of padded rows, tokens to generate) differ within a batch.
    takes_rows: bool = False
    # Its context in tokens (CONTEXT_CONFIG_PARAMETER), where its config declares one.
    max_model_len: int | None = None
    # How long the backend keeps an idle sequence of a stateful model (Triton: its sequence
    # batcher's max_sequence_idle_microseconds, 1 s where unset).
    sequence_idle_s: float = 1.0
    # ``bounds``' answer, kept with the endpoint it was computed for.
    _bounds: list[tuple[Endpoint, RequestBounds]] = field(
        default_factory=list, init=False, compare=False, repr=False
    )

    def bounds(self, endpoint: Endpoint) -> RequestBounds:
        """What one request to this model may take under ``endpoint`` (``request_bounds``),
        computed once per endpoint policy (a reload makes a new one)."""
        kept = self._bounds[0] if self._bounds else None
        if kept is None or kept[0] is not endpoint:
            kept = (endpoint, request_bounds(self, endpoint))
            self._bounds[:] = [kept]
        return kept[1]

    def described(self) -> ModelDescribed:
        """This description as it crosses the link (the core answers a shell's
        ``InfoQuery`` with it): its fields, each as it is (the record names them: one
        list of them, ``ModelDescribed``), its tensors as records."""
        fields: dict[str, Any] = {f: getattr(self, f) for f in ModelDescribed.__struct_fields__}
        for io in ("inputs", "outputs"):
            fields[io] = tuple(
                TensorDescribed(t.name, t.datatype, t.dims, t.optional)
                for t in getattr(self, io).values()
            )
        return ModelDescribed(**fields)

    @staticmethod
    def of(described: ModelDescribed) -> ModelInfo:
        """The description a shell was sent (``described``), as the core holds it."""
        fields: dict[str, Any] = {
            f: getattr(described, f) for f in ModelDescribed.__struct_fields__
        }
        for io in ("inputs", "outputs"):
            fields[io] = {
                t.name: TensorSpec(t.name, t.datatype, tuple(t.dims), t.optional)
                for t in getattr(described, io)
            }
        fields["versions"] = tuple(described.versions)
        return ModelInfo(**fields)

    @staticmethod
    def version_for(requested: str, info: ModelInfo | None) -> str | None:
        """The version a request's statistics are counted under: its own, else the model's
        latest; None (not counted) for a version the model does not have, or a model not
        looked up. The version string is the client's choice: counting under each one
        would let a client add statistics entries without end (Triton keeps none for a
        version it does not serve either)."""
        if info is None:
            return None
        if not requested:
            return info.latest_version
        return requested if requested in info.versions else None

    @property
    def latest_version(self) -> str:
        return max(self.versions, key=lambda v: int(v) if v.isdigit() else -1)

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 0

    @property
    def passthrough(self) -> bool:
        """Requests that keep Triton's own semantics and go one at a time, unbatched."""
        return self.decoupled or self.sequence_batching


# ---- what one request to a model may take ------------------------------------------------

# The longest form one element of each datatype takes on the wire, of all the forms a client
# may send it in: binary (its size), gRPC typed contents (a varint: 10 bytes for a negative
# integer), JSON text (the longest number Python's json writes, with tritonclient's ", ").
WIRE_ELEMENT_BYTES: dict[str, int] = {
    "BOOL": 7,  # "false, "
    "UINT8": 5,
    "UINT16": 7,
    "UINT32": 12,
    "UINT64": 22,
    "INT8": 10,
    "INT16": 10,
    "INT32": 13,
    "INT64": 22,
    "FP16": 26,  # "-2.2250738585072014e-308, ": a double's repr, whatever the width
    "FP32": 26,
    "FP64": 26,
    "BF16": 2,  # binary only
}
# JSON nesting: "[", "]" and ", " around an element, per dimension, at most.
WIRE_NESTING_BYTES = 4
# A BYTES element: JSON writes a byte of text as at most 6 ("\u00XX"), and puts quotes and
# ", " around it; binary forms, a 4-byte length.
WIRE_TEXT_EXPANSION = 6
WIRE_TEXT_FRAMING = 4


@dataclass(frozen=True, slots=True)
class RequestBounds:
    """What one request to a model may take: the bound every decode is held to.

    ``payload_bytes``: its input tensors (``InferRequest.nbytes``); ``wire_bytes``: its
    HTTP body or gRPC message, refused from its declared size before it is read or
    parsed. ``derived``: from the model (``request_bounds``); else the endpoint's
    ``max_request_bytes`` (or its default). ``max_model_len`` and ``max_token_bytes``:
    the engine's context and the longest text one token of the endpoint's tokenizer
    covers, where known; ``text_bytes``, their product: the most text one element of a
    text input holds."""

    payload_bytes: int
    wire_bytes: int
    derived: bool
    max_model_len: int | None = None
    max_token_bytes: int | None = None

    @property
    def text_bytes(self) -> int | None:
        if self.max_model_len is None or self.max_token_bytes is None:
            return None
        return self.max_model_len * self.max_token_bytes


def request_bounds(info: ModelInfo, endpoint: Endpoint) -> RequestBounds:
    """The most one request to ``info``'s model can carry, from the model's own limits:
    ``max_batch_size`` rows (one where it does not batch) of every input, each element at
    its datatype's size, or for BYTES (text inputs of an endpoint whose tokenizer and
    context are known) the context's worth of the longest tokens; on the wire, each
    element in its longest form (``WIRE_ELEMENT_BYTES``), and ``WIRE_FRAMING_BYTES`` for
    the rest. A variable dimension, or a BYTES input without a text bound, leaves it
    unbounded: then, as where the operator sets ``max_request_bytes``, the endpoint's
    configured bound (``Endpoint.max_wire_bytes``), which is also the ceiling."""
    context = endpoint.max_model_len or info.max_model_len
    token_bytes = max_token_bytes(endpoint.tokenizer) if endpoint.tokenizer else None
    configured = RequestBounds(
        endpoint.request_bytes_ceiling, endpoint.max_wire_bytes, False, context, token_bytes
    )
    if endpoint.max_request_bytes is not None:
        return configured
    text = configured.text_bytes
    rows = max(info.max_batch_size, 1)
    payload = wire = 0
    for spec in info.inputs.values():
        dtype = DTYPES.get(spec.datatype)
        if dtype is None or any(d < 0 for d in spec.dims):
            return configured
        elements = rows * element_count(spec.dims)
        nesting = WIRE_NESTING_BYTES * (len(spec.dims) + int(info.batching))
        if spec.datatype == "BYTES":
            if text is None:
                return configured
            payload += elements * (4 + text)
            wire += elements * (WIRE_TEXT_EXPANSION * text + WIRE_TEXT_FRAMING + nesting)
        else:
            payload += elements * dtype.itemsize
            wire += elements * (WIRE_ELEMENT_BYTES[spec.datatype] + nesting)
    if payload > configured.payload_bytes:
        return configured
    wire = min(wire + WIRE_FRAMING_BYTES, configured.wire_bytes)
    return RequestBounds(payload, wire, True, context, token_bytes)


@dataclass(slots=True)
class Checked:
    """A validated request: its rows, tokens and per-row token lengths."""

    rows: int
    tokens: int
    lengths: list[int] | None  # per row, of the endpoint's token input (None if absent)
    max_tokens: int = 0  # of ``tokens``, the output tokens asked for (all rows together)


def _dims_match(expected: tuple[int, ...], got: tuple[int, ...]) -> bool:
    return len(expected) == len(got) and all(
        e == -1 or e == g for e, g in zip(expected, got, strict=True)
    )


def missing_inputs_message(info: ModelInfo, rid: str, names: list[str], missing: list[str]) -> str:
    """Triton core's answer to a request without all of its model's required inputs
    (``InferenceRequest::ValidateRequestInputs``), word for word: its two wordings (all
    inputs required, or some optional), names as ``['A','B']``."""

    def listed(items: list[str]) -> str:
        return "[" + ",".join(f"'{n}'" for n in items) + "]"

    total = len(info.inputs)
    required = sum(1 for s in info.inputs.values() if not s.optional)
    expected = (
        f"expected {total} inputs"
        if required == total
        else f"expected number of inputs between {required} and {total}"
    )
    return (
        f"{request_prefix(rid)}{expected} but got {len(names)} inputs for model "
        f"'{info.name}'. Got input(s) {listed(names)}, but missing required input(s) "
        f"{listed(missing)}. Please provide all required input(s)."
    )


_VERSION = re.compile(r"\s*[+-]?[0-9]")  # what std::stol, which Triton uses, can read


def check_version(version: str) -> None:
    """A version string Triton can read as a number, refused in Triton's words (its gRPC
    answer; the frontend's batches go to Triton over HTTP, whose router would say only
    "Not Found")."""
    if version and not _VERSION.match(version):
        raise InvalidArgument(
            f"failed to get model version from specified version string '{version}' "
            "(details: stol), version should be an integral value > 0"
        )


class RefusedByModel(InvalidArgument):
    """A request ``check_declared`` refused. ``version``: what its failure is counted
    under in the model's statistics (``ModelInfo.version_for``), as a refusal of
    ``validate`` is (Triton counts the requests its own checks refuse)."""

    def __init__(self, message: str, version: str | None) -> None:
        super().__init__(message)
        self.version = version


def check_declared(
    info: ModelInfo, endpoint: Endpoint, req: InferRequest, declared: list[Declared]
) -> None:
    """The checks of ``validate`` that need only what a request declares (its id and
    version, its inputs' names, datatypes and shapes, sizes where known), with the same
    messages in the same order: made by the codecs before they convert any tensor, so
    that data the model could not take is refused before it costs a tensor. Raises
    ``RefusedByModel``."""
    try:
        check_id("request id", req.id)
        check_version(req.version)
        _check_inputs(info, endpoint, req.id, declared)
        limit = info.bounds(endpoint).payload_bytes
        # BYTES data not yet converted: at least its 4-byte lengths.
        nbytes = sum(
            d.nbytes if d.nbytes is not None else 4 * element_count(d.shape) for d in declared
        )
        if nbytes > limit:
            raise _too_large(nbytes, info.name, limit)
    except InvalidArgument as err:
        raise RefusedByModel(err.message, ModelInfo.version_for(req.version, info)) from None


def _too_large(nbytes: int, model: str, limit: int) -> InvalidArgument:
    return InvalidArgument(
        f"request too large: {nbytes} bytes of input data, the limit for '{model}' is {limit}"
    )


def _check_inputs(
    info: ModelInfo, endpoint: Endpoint, rid: str, declared: list[Declared]
) -> tuple[int, list[str]]:
    """Inputs (as declared) against the model: names, then the required ones (those the
    endpoint fills in with its defaults count as given), datatypes, shapes, batch sizes.
    Returns the rows (0 where the model does not batch) and the defaults to fill in."""
    model = info.name
    names = [d.name for d in declared]
    for d in declared:
        if d.name not in info.inputs:
            raise InvalidArgument(f"unexpected inference input '{d.name}' for model '{model}'")
    rows = 0
    if info.batching and declared:
        rows = declared[0].shape[0] if declared[0].shape else 0
    defaults = [n for n in endpoint.input_defaults if n in info.inputs and n not in names]
    given = names + defaults
    missing = [n for n, s in info.inputs.items() if not s.optional and n not in given]
    if missing:
        raise InvalidArgument(missing_inputs_message(info, rid, given, missing))
    for d in declared:
        spec = info.inputs[d.name]
        if d.datatype != spec.datatype:
            raise InvalidArgument(
                f"inference input '{d.name}' data-type is '{d.datatype}', but model "
                f"'{model}' expects '{spec.datatype}'"
            )
        expected = (-1, *spec.dims) if info.batching else spec.dims
        if not _dims_match(expected, d.shape):
            raise InvalidArgument(
                unexpected_shape(rid, d.name, model, expected, d.shape, info.batching)
            )
        if info.batching and d.shape[0] != rows:
            raise InvalidArgument(
                f"input '{d.name}' batch size {d.shape[0]} does not match other inputs "
                f"({rows}) for '{model}'"
            )
    if info.batching:
        if rows < 1 and given:
            raise InvalidArgument(f"empty batch: inputs of model '{model}' have batch size 0")
        if rows > info.max_batch_size:
            raise InvalidArgument(
                f"inference request batch-size must be <= {info.max_batch_size} for '{model}'"
            )
    return rows, defaults


def validate(
    req: InferRequest, plan: EndpointPlan, *, text_tokens: list[int] | None = None
) -> Checked:
    """Check a request against its model and endpoint (``plan``); fill configured
    defaults; count rows and tokens.

    ``text_tokens``: the tokens of each element of a text token input, counted by the
    caller off the event loop (``prompt_texts``, then ``tokens.TokenCounter``); counted
    here where not given."""
    info, endpoint = plan.info, plan.endpoint
    model = info.name
    check_id("request id", req.id)  # copied into every row's fair_rows entry
    check_version(req.version)
    declared = [Declared(t.name, t.datatype, t.shape) for t in req.inputs]
    rows, defaults = _check_inputs(info, endpoint, req.id, declared)
    # Fill the endpoint's defaults for optional inputs left out (the model's own defaults),
    # so that rows with and without them share a batch.
    for name in defaults:
        spec = info.inputs[name]
        values = endpoint.input_defaults[name]
        arr = np.asarray(values, dtype=DTYPES[spec.datatype]).reshape(spec.dims)
        if info.batching:
            arr = np.broadcast_to(arr, (rows, *spec.dims)).copy()
        req.inputs.append(Tensor(name, spec.datatype, tuple(arr.shape), arr))
    for out in req.outputs:
        if out.name not in info.outputs:
            raise InvalidArgument(f"unexpected inference output '{out.name}' for model '{model}'")
        if out.classification and info.outputs[out.name].datatype == "BYTES":
            # Triton 2.51 crashes (the whole server, every tenant's requests with it) on
            # classification of a BYTES output: it must never get there.
            raise InvalidArgument(
                f"output '{out.name}' of model '{model}' is BYTES: classification "
                "(class_count) needs a numeric output"
            )
    if len({o.name for o in req.outputs}) != len(req.outputs):
        # The codecs keep one of each, as Triton does (HTTP the first, gRPC the last).
        raise InvalidArgument("an output is requested more than once")

    lengths = _row_lengths(req, info, endpoint, max(rows, 1), text_tokens)
    tokens = sum(lengths) if lengths is not None else 0
    sampling: dict[str, Any] | None = None
    if endpoint.sampling_rules is not None or endpoint.max_tokens_parameter is not None:
        sampling = read_sampling_input(req, endpoint.sampling_parameters_input)  # parsed once
    checked: dict[str, int | float | bool] = {}
    if endpoint.sampling_rules is not None:
        text_prompt = lengths is not None and endpoint.tokenizer is not None and not info.batching
        checked = check_sampling(
            sampling,
            req.parameters,
            endpoint.sampling_rules,
            input_name=endpoint.sampling_parameters_input,
            keys=endpoint.sampling_keys,
            max_model_len=info.bounds(endpoint).max_model_len,
            prompt_tokens=lengths[0] if text_prompt and lengths else None,
        )
    max_tokens = 0
    if endpoint.max_tokens_parameter is not None:
        write_back = info.batching and info.takes_rows
        per_row = _max_tokens(req, endpoint, sampling, checked, write_back=write_back)
        max_tokens = max(rows, 1) * per_row
        tokens += max_tokens
        if tokens > INT64_MAX:
            # Token counts travel and are counted as 64-bit integers (the records between
            # processes, Redis): a wider sum would be refused there, or wrap.
            raise InvalidArgument(
                f"request too large: {max(rows, 1)} rows of {per_row} tokens to generate "
                f"(parameter '{endpoint.max_tokens_parameter}') make {tokens} tokens, more "
                f"than a signed 64-bit integer holds"
            )
    if endpoint.cost is CostUnit.TOKENS and lengths is None:
        raise InvalidArgument(
            f"model '{model}' counts cost in tokens of input '{endpoint.token_input}', "
            "which the request does not have"
        )
    bounds = info.bounds(endpoint)
    nbytes = req.nbytes
    if nbytes > bounds.payload_bytes:
        raise _too_large(nbytes, model, bounds.payload_bytes)
    if lengths is not None and bounds.max_model_len is not None:
        longest = max(lengths, default=0)
        if longest > bounds.max_model_len:
            raise InvalidArgument(
                f"input '{endpoint.token_input}': the prompt has {longest} tokens; the "
                f"context of model '{model}' is {bounds.max_model_len} tokens "
                "(max_model_len)"
            )
    if endpoint.max_request_tokens is not None and tokens > endpoint.max_request_tokens:
        raise InvalidArgument(
            f"request too large: {tokens} tokens, the limit for '{model}' is "
            f"{endpoint.max_request_tokens}"
        )
    return Checked(rows=max(rows, 1), tokens=tokens, lengths=lengths, max_tokens=max_tokens)


def _row_lengths(
    req: InferRequest,
    info: ModelInfo,
    endpoint: Endpoint,
    rows: int,
    text_tokens: list[int] | None = None,
) -> list[int] | None:
    """Per-row token counts: the token input's elements per row (every row of a client's
    request is as long as the tensor is wide; only the frontend pads); for text, each
    element's tokens (``text_tokens``, or counted here)."""
    t = req.input(endpoint.token_input)
    if t is None:
        return None
    if t.datatype == "BYTES" and endpoint.tokenizer is not None:
        counts = text_tokens
        if counts is None:
            texts = prompt_texts(req, info, endpoint)
            counts = count_text_tokens(endpoint.tokenizer, texts or [])
        per_row = max(1, len(counts) // rows) if counts else 1
        return [sum(counts[i * per_row : (i + 1) * per_row]) for i in range(rows)]
    width = math.prod(t.shape[1:]) if info.batching else math.prod(t.shape)
    return [width] * rows


def prompt_texts(req: InferRequest, info: ModelInfo, endpoint: Endpoint) -> list[str] | None:
    """The elements of a text token input (a BYTES ``token_input`` of an endpoint with a
    tokenizer) as text, for their tokens to be counted; None where there are none to
    count. Refused (400) without tokenising: text that is not UTF-8, and a row whose
    bytes alone prove it longer than the model's context (a token covers at most the
    tokenizer's longest token, ``RequestBounds.max_token_bytes``), in O(1) per element."""
    t = req.input(endpoint.token_input)
    if t is None or t.datatype != "BYTES" or endpoint.tokenizer is None:
        return None
    elements = list(t.data.flat)
    bounds = info.bounds(endpoint)
    context, token_bytes = bounds.max_model_len, bounds.max_token_bytes
    if context is not None and token_bytes is not None and elements:
        rows = max(t.shape[0], 1) if info.batching and t.shape else 1
        per_row = max(1, len(elements) // rows)
        for i in range(0, len(elements), per_row):
            size = sum(len(e) for e in elements[i : i + per_row])
            at_least = -(-size // token_bytes)
            if at_least > context:
                raise InvalidArgument(
                    f"input '{t.name}': the prompt is too long: its {size} bytes are at "
                    f"least {at_least} tokens (a token of this model's tokenizer covers at "
                    f"most {token_bytes} bytes); the context of model '{info.name}' is "
                    f"{context} tokens (max_model_len)"
                )
    texts = []
    for e in elements:
        if isinstance(e, (bytes, np.bytes_)):
            try:
                texts.append(bytes(e).decode("utf-8"))
            except UnicodeDecodeError as err:
                raise InvalidArgument(f"input '{t.name}' is not valid UTF-8 text: {err}") from None
        else:
            texts.append(str(e))
    return texts


def _max_tokens(
    req: InferRequest,
    endpoint: Endpoint,
    sampling: dict[str, Any] | None,
    checked: dict[str, int | float | bool],
    *,
    write_back: bool,
) -> int:
    """The tokens each row of the request asks to generate, checked as the model checks it:
    from the sampling parameters input (``sampling``, its JSON object) if the endpoint names
    one and it has the key, else the request parameter, else the endpoint's default; as the
    endpoint's sampling rules converted it where they did (``checked``). ``write_back``
    (batching models): written into the request's parameters as an integer (``pack`` moves
    it into each row's ``fair_rows`` entry). A model that takes requests one at a time gets
    its parameters exactly as the client sent them."""
    name = endpoint.max_tokens_parameter
    assert name is not None and endpoint.max_tokens_default is not None  # config checks both
    value: ParamValue | None = checked.get(name)
    if value is None:
        value = _sampling_value(sampling, name)
    if value is None:
        value = req.parameters.get(name)
    if value is None:
        n = endpoint.max_tokens_default
    else:
        parsed = integer_parameter(value)
        limit = endpoint.max_tokens_limit if endpoint.max_tokens_limit is not None else INT64_MAX
        if parsed is None or not 1 <= parsed <= limit:
            bounds = f"between 1 and {limit}"
            raise InvalidArgument(f"parameter '{name}' must be an integer {bounds}, got {value!r}")
        n = parsed
    if write_back:
        req.parameters[name] = n
    return n


def _sampling_value(sampling: dict[str, Any] | None, name: str) -> ParamValue | None:
    """``name`` in the sampling parameters input's object, if sent."""
    if sampling is None:
        return None
    value = sampling.get(name)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)  # a float or a list: refused by the integer check, with its value


def integer_parameter(value: ParamValue) -> int | None:
    """An integer request parameter: int64 (not a boolean), or a string of decimal digits
    (as Triton's vLLM backend takes its ``int()``); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        return int(value)
    return None
