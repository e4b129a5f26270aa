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
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2

from fair_frontend.config import CostUnit, Endpoint
from fair_frontend.errors import InvalidArgument
from fair_frontend.protocol import (
    DTYPES,
    INT64_MAX,
    InferRequest,
    ParamValue,
    Tensor,
    check_id,
    request_prefix,
    unexpected_shape,
)
from fair_frontend.sampling import check_sampling, read_sampling_input
from fair_frontend.tokens import count_text_tokens

_INTEGER = re.compile(r"[+-]?[0-9]+")
# Triton's default max_sequence_idle_microseconds (model_config.proto): 1 s.
TRITON_SEQUENCE_IDLE_US = 1_000_000
# The model-config parameter by which a model asks for the frontend's per-row metadata
# (``fair_rows``, ``fair_outputs``): ``parameters { key: "fair_frontend_rows" value {
# string_value: "true" } }``. A model that does not ask gets the client's request
# parameters exactly as sent, as from Triton directly: a model that reads
# ``request.parameters()`` (Triton's qa/L0_parameters echoes them) must not find ours.
ROWS_CONFIG_PARAMETER = "fair_frontend_rows"
# The model-config parameter in which an engine declares its context, prompt plus generated
# tokens (vLLM's name; the shipped llm's config.pbtxt): max_tokens is checked against it.
CONTEXT_CONFIG_PARAMETER = "max_model_len"


def triton_datatype(config_type: int) -> str:
    """``TYPE_INT32`` -> ``INT32``; ``TYPE_STRING`` -> ``BYTES`` (Triton's mapping)."""
    name: str = model_config_pb2.DataType.Name(config_type)
    name = name.removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    dims: tuple[int, ...]  # without the batch dimension
    optional: bool = False


@dataclass(frozen=True)
class ModelInfo:
    """The parts of a Triton model config that scheduling and validation need."""

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
    raw_config: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def from_config(
        cls, cfg: model_config_pb2.ModelConfig, versions: tuple[str, ...] = ("1",)
    ) -> ModelInfo:
        def spec(t: Any, optional: bool = False) -> TensorSpec:
            return TensorSpec(t.name, triton_datatype(t.data_type), tuple(t.dims), optional)

        return cls(
            name=cfg.name,
            max_batch_size=cfg.max_batch_size,
            inputs={t.name: spec(t, t.optional) for t in cfg.input},
            outputs={t.name: spec(t) for t in cfg.output},
            decoupled=cfg.model_transaction_policy.decoupled,
            sequence_batching=cfg.HasField("sequence_batching"),
            platform=cfg.platform or cfg.backend,
            instances=max(1, sum(max(1, g.count) for g in cfg.instance_group)),
            versions=versions or ("1",),
            takes_rows=_config_flag(cfg, ROWS_CONFIG_PARAMETER),
            max_model_len=_config_count(cfg, CONTEXT_CONFIG_PARAMETER),
            raw_config=cfg,
        )

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
    def sequence_idle_s(self) -> float:
        """How long Triton keeps an idle sequence of this model (its sequence batcher's
        ``max_sequence_idle_microseconds``; Triton's default, 1 s, where unset)."""
        cfg = self.raw_config
        idle_us = 0
        if cfg is not None and cfg.HasField("sequence_batching"):
            idle_us = cfg.sequence_batching.max_sequence_idle_microseconds
        return (idle_us or TRITON_SEQUENCE_IDLE_US) / 1e6

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


def _config_flag(cfg: model_config_pb2.ModelConfig, key: str) -> bool:
    """A boolean model-config parameter (a string, as Triton's config keeps them all):
    "true" in any case, surrounding blanks ignored; anything else, or absent, is false."""
    param = cfg.parameters.get(key)
    return param is not None and param.string_value.strip().lower() == "true"


def _config_count(cfg: model_config_pb2.ModelConfig, key: str) -> int | None:
    """A positive integer model-config parameter; None where absent or not one."""
    param = cfg.parameters.get(key)
    if param is None:
        return None
    text = param.string_value.strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


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


def validate(req: InferRequest, info: ModelInfo, endpoint: Endpoint) -> Checked:
    """Check a request against its model; fill configured defaults; count rows and tokens."""
    model = info.name
    check_id("request id", req.id)  # copied into every row's fair_rows entry
    check_version(req.version)
    names = [t.name for t in req.inputs]
    for t in req.inputs:
        if t.name not in info.inputs:
            raise InvalidArgument(f"unexpected inference input '{t.name}' for model '{model}'")
    # Fill the endpoint's defaults for optional inputs left out (the model's own defaults),
    # so that rows with and without them share a batch.
    rows = 0
    if info.batching and req.inputs:
        rows = req.inputs[0].shape[0] if req.inputs[0].shape else 0
    for name, values in endpoint.input_defaults.items():
        spec = info.inputs.get(name)
        if spec is None or name in names:
            continue
        arr = np.asarray(values, dtype=DTYPES[spec.datatype]).reshape(spec.dims)
        if info.batching:
            arr = np.broadcast_to(arr, (rows, *spec.dims)).copy()
        req.inputs.append(Tensor(name, spec.datatype, tuple(arr.shape), arr))
        names.append(name)
    missing = [n for n, s in info.inputs.items() if not s.optional and n not in names]
    if missing:
        raise InvalidArgument(missing_inputs_message(info, req.id, names, missing))
    for t in req.inputs:
        spec = info.inputs[t.name]
        if t.datatype != spec.datatype:
            raise InvalidArgument(
                f"inference input '{t.name}' data-type is '{t.datatype}', but model "
                f"'{model}' expects '{spec.datatype}'"
            )
        expected = (-1, *spec.dims) if info.batching else spec.dims
        if not _dims_match(expected, t.shape):
            raise InvalidArgument(
                unexpected_shape(req.id, t.name, model, expected, t.shape, info.batching)
            )
        if info.batching and t.shape[0] != rows:
            raise InvalidArgument(
                f"input '{t.name}' batch size {t.shape[0]} does not match other inputs "
                f"({rows}) for '{model}'"
            )
    if info.batching:
        if rows < 1 and req.inputs:
            raise InvalidArgument(f"empty batch: inputs of model '{model}' have batch size 0")
        if rows > info.max_batch_size:
            raise InvalidArgument(
                f"inference request batch-size must be <= {info.max_batch_size} for '{model}'"
            )
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

    lengths = _row_lengths(req, info, endpoint, max(rows, 1))
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
            max_model_len=info.max_model_len,
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
    nbytes = req.nbytes
    if nbytes > endpoint.max_request_bytes:
        raise InvalidArgument(
            f"request too large: {nbytes} bytes of input data, the limit for '{model}' is "
            f"{endpoint.max_request_bytes}"
        )
    if endpoint.max_request_tokens is not None and tokens > endpoint.max_request_tokens:
        raise InvalidArgument(
            f"request too large: {tokens} tokens, the limit for '{model}' is "
            f"{endpoint.max_request_tokens}"
        )
    return Checked(rows=max(rows, 1), tokens=tokens, lengths=lengths, max_tokens=max_tokens)


def _row_lengths(
    req: InferRequest, info: ModelInfo, endpoint: Endpoint, rows: int
) -> list[int] | None:
    """Per-row token counts: the token input's elements per row (every row of a client's
    request is as long as the tensor is wide; only the frontend pads)."""
    t = req.input(endpoint.token_input)
    if t is None:
        return None
    if t.datatype == "BYTES" and endpoint.tokenizer is not None:
        # Text: each element's tokens, with the endpoint's own tokenizer.
        counts = count_text_tokens(endpoint.tokenizer, t.data.flat)
        per_row = max(1, len(counts) // rows) if counts else 1
        return [sum(counts[i * per_row : (i + 1) * per_row]) for i in range(rows)]
    width = math.prod(t.shape[1:]) if info.batching else math.prod(t.shape)
    return [width] * rows


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
