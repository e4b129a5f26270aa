"""From Triton requests to rows and back: decoding, per-row metadata, packing.

One Triton request carries ``B >= 1`` rows: ``INPUT_IDS`` ``[B, W]``, and nothing else as
an input. Everything else about the rows travels in request parameters (``Parameters``):

- ``fair_rows``, which the frontend adds: a JSON object of per-row lists, ``tenant``
  (required), ``priority``, ``deadline_us``, ``id``, and, where it padded ragged rows,
  ``length`` (each row's real length) and the model's own per-row values (``generate``:
  ``max_tokens``). Every list present must have one entry per row.
- a direct client's own parameters (``tenant``; ``generate``: ``max_tokens``), which hold
  for every row of its request.

``decode_request`` reads ids, lengths and parameters; without a ``length`` list every row
is as long as ``INPUT_IDS`` is wide, which is exactly what a client sending one request
per row width gets. ``row_metadata`` reads who each row belongs to; ``pack`` pads the rows
of every request in one ``execute`` call into one tensor and remembers where each
request's rows are, so the model runs once and the answer is split back per request.

No row property is a model input on purpose: a load generator such as perf_analyzer fills
every declared input, optional ones too, with random data, and random lengths or counts
are garbage the model would have to refuse.

Every problem with one request raises ``RequestError`` with a message for the client; the
caller answers that request with the error and serves the others.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

INPUT_IDS = "INPUT_IDS"
ROW_META = "ROW_META"
FAIR_ROWS_PARAM = "fair_rows"
# The outputs the frontend's client named (JSON list), when it named any: the frontend may
# add outputs of its own (lengths), which hides the client's choice from Triton's view.
FAIR_OUTPUTS_PARAM = "fair_outputs"
TENANT_PARAM = "tenant"
UNKNOWN_TENANT = "unknown"
LENGTH_COLUMN = "length"  # fair_rows: each row's real length, where the frontend padded
_META_FIELDS = ("tenant", "priority", "deadline_us", "id")
_INTEGER = re.compile(r"[+-]?[0-9]+")


class RequestError(ValueError):
    """A problem with one request; its message is what that request's client reads."""


@dataclass(frozen=True)
class RequestData:
    """What ``model.py`` reads off one ``pb_utils.InferenceRequest``, as plain Python.

    ``requested_outputs`` is Triton's view: a request that names no outputs is reported as
    requesting every declared output.
    """

    inputs: Mapping[str, np.ndarray]
    parameters: str = "{}"
    request_id: str = ""
    requested_outputs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Parameters:
    """A request's parameters: ``values`` as sent (JSON object), and ``rows``, the
    frontend's ``fair_rows`` lists (each checked to hold one entry per row), or None."""

    values: Mapping[str, Any] = field(default_factory=dict)
    rows: Mapping[str, list[Any]] | None = None

    def column(self, name: str) -> list[Any] | None:
        """The ``fair_rows`` list ``name``, one entry per row; None if not sent."""
        return None if self.rows is None else self.rows.get(name)


@dataclass(frozen=True)
class RowMeta:
    """Who a row belongs to and how the frontend scheduled it (echoed by ``ROW_META``)."""

    tenant: str
    priority: int = 0
    deadline_us: int = 0  # unix epoch microseconds; 0 = none
    id: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {
                "tenant": self.tenant,
                "priority": self.priority,
                "deadline_us": self.deadline_us,
                "id": self.id,
            },
            separators=(",", ":"),
        )


@dataclass(frozen=True)
class Rows:
    """The rows of one request: ids ``[B, W]`` int64 in ``[0, vocab)``, lengths ``[B]``.

    ``W`` is trimmed to the longest row, so padding beyond every row costs nothing, and
    every id past a row's length is 0 (the networks mask it anyway).
    """

    ids: np.ndarray
    lengths: np.ndarray

    @property
    def count(self) -> int:
        return int(self.ids.shape[0])


def integer(value: Any) -> int | None:
    """An integer parameter value: a JSON integer (not a boolean) or a string of decimal
    digits (as Triton's vLLM backend takes its ``int()``); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        return int(value)
    return None


def decode_request(
    data: RequestData, *, vocab: int, max_row_tokens: int
) -> tuple[Rows, Parameters]:
    """The rows (ids and lengths) and parameters of one request."""
    raw = input_ids(data.inputs)
    params = read_parameters(data.parameters, int(raw.shape[0]))
    rows = decode_rows(
        raw, params.column(LENGTH_COLUMN), vocab=vocab, max_row_tokens=max_row_tokens
    )
    return rows, params


def input_ids(inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """``INPUT_IDS`` as sent, checked to be ``[B, W]`` with ``B, W >= 1``."""
    raw = inputs.get(INPUT_IDS)
    if raw is None:
        raise RequestError(f"input '{INPUT_IDS}' is required")
    if raw.ndim != 2:
        raise RequestError(f"input '{INPUT_IDS}' must be [batch, tokens], got shape {raw.shape}")
    if raw.shape[0] < 1 or raw.shape[1] < 1:
        raise RequestError(f"input '{INPUT_IDS}' must hold at least one token per row")
    return raw


def decode_rows(
    raw: np.ndarray, lengths_in: Sequence[Any] | None, *, vocab: int, max_row_tokens: int
) -> Rows:
    """Token ids (modulo ``vocab``, never negative) and lengths of one request's rows.

    ``lengths_in``: the ``fair_rows`` ``length`` list (one per row, in ``[1, W]``), or None:
    then every row is as long as ``INPUT_IDS`` is wide, exactly what the frontend would
    send for that row alone, which is what makes the answers match.
    """
    count, width = raw.shape
    if lengths_in is None:
        lengths = np.full(count, width, dtype=np.int64)
    else:
        for i, n in enumerate(lengths_in):
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= width:
                raise RequestError(
                    f"parameter '{FAIR_ROWS_PARAM}': {LENGTH_COLUMN}[{i}] is {n!r}; lengths "
                    f"must be integers between 1 and the width of '{INPUT_IDS}' ({width})"
                )
        lengths = np.array(lengths_in, dtype=np.int64)
    longest = int(lengths.max())
    if longest > max_row_tokens:
        i = int(np.argmax(lengths))
        raise RequestError(
            f"input '{INPUT_IDS}': row {i} has {longest} tokens; this model accepts at most "
            f"{max_row_tokens} per row"
        )
    # np.mod with a positive modulus is never negative: perf_analyzer's random INT32 data
    # (including negative values) maps onto valid ids.
    ids = np.mod(raw[:, :longest].astype(np.int64), vocab)
    ids[np.arange(longest) >= lengths[:, None]] = 0  # canonical padding, whatever was sent
    return Rows(ids=ids, lengths=lengths)


def read_parameters(parameters_json: str, count: int) -> Parameters:
    """The request parameters, and the ``fair_rows`` lists checked against ``count`` rows."""
    try:
        values = json.loads(parameters_json or "{}")
    except ValueError as err:
        raise RequestError(f"request parameters are not valid JSON: {err}") from None
    if not isinstance(values, dict):
        raise RequestError("request parameters must be a JSON object")
    if FAIR_ROWS_PARAM not in values:
        return Parameters(values)
    return Parameters(values, _row_lists(values[FAIR_ROWS_PARAM], count))


def _row_lists(value: Any, count: int) -> dict[str, list[Any]]:
    where = f"parameter '{FAIR_ROWS_PARAM}'"
    if not isinstance(value, str):
        raise RequestError(f"{where} must be a string holding a JSON object")
    try:
        table = json.loads(value)
    except ValueError as err:
        raise RequestError(f"{where} is not valid JSON: {err}") from None
    if not isinstance(table, dict):
        raise RequestError(f"{where} must be a JSON object of per-row lists {_META_FIELDS}")
    if "tenant" not in table:
        raise RequestError(f"{where} has no 'tenant' list")
    for name, column in table.items():
        if not isinstance(column, list):
            raise RequestError(f"{where}: '{name}' must be a list, one entry per row")
        if len(column) != count:
            raise RequestError(
                f"{where}: '{name}' has {len(column)} entries, but the request has {count} rows"
            )
    return table


def row_metadata(params: Parameters, count: int, request_id: str) -> list[RowMeta]:
    """Per-row metadata: the frontend's ``fair_rows``, else a direct client's ``tenant``.

    From ``fair_rows``: ``tenant`` (required), ``priority``, ``deadline_us``, ``id`` (each
    optional; default 0, 0, the request id). Without it, all rows belong to the ``tenant``
    string parameter, else to ``"unknown"``.
    """
    if params.rows is not None:
        return _fair_rows_meta(params.rows, count, request_id)
    tenant = params.values.get(TENANT_PARAM, UNKNOWN_TENANT)
    if not isinstance(tenant, str) or not tenant:
        raise RequestError(f"parameter '{TENANT_PARAM}' must be a non-empty string")
    return [RowMeta(tenant=tenant, id=request_id) for _ in range(count)]


def _fair_rows_meta(columns: Mapping[str, list[Any]], count: int, request_id: str) -> list[RowMeta]:
    where = f"parameter '{FAIR_ROWS_PARAM}'"
    rows = []
    for i in range(count):
        tenant = columns["tenant"][i]
        if not isinstance(tenant, str) or not tenant:
            raise RequestError(f"{where}: tenant[{i}] must be a non-empty string")
        priority = columns["priority"][i] if "priority" in columns else 0
        deadline = columns["deadline_us"][i] if "deadline_us" in columns else 0
        for name, v in (("priority", priority), ("deadline_us", deadline)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise RequestError(f"{where}: {name}[{i}] must be a non-negative integer")
        row_id = columns["id"][i] if "id" in columns else request_id
        if not isinstance(row_id, str):
            raise RequestError(f"{where}: id[{i}] must be a string")
        rows.append(RowMeta(tenant=tenant, priority=priority, deadline_us=deadline, id=row_id))
    return rows


def wants_row_meta_of(data: RequestData, params: Parameters, declared: frozenset[str]) -> bool:
    """Whether ``ROW_META`` was asked for: the frontend says so in ``fair_outputs``;
    otherwise Triton's view of the requested outputs decides (``wants_row_meta``)."""
    named = params.values.get(FAIR_OUTPUTS_PARAM)
    if isinstance(named, str):
        try:
            names = json.loads(named)
        except ValueError as err:
            raise RequestError(
                f"parameter '{FAIR_OUTPUTS_PARAM}' is not valid JSON: {err}"
            ) from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise RequestError(f"parameter '{FAIR_OUTPUTS_PARAM}' must be a JSON list of names")
        return ROW_META in names
    return wants_row_meta(data.requested_outputs, declared)


def wants_row_meta(requested: frozenset[str], declared: frozenset[str]) -> bool:
    """Whether the client explicitly asked for ``ROW_META``.

    Triton reports a request that names no outputs as requesting every declared output, so
    "all declared outputs" cannot be told apart from "nothing named" and is read as the
    default answer, which has no ``ROW_META``. To get it, name ``ROW_META`` and leave out at
    least one other declared output (e.g. ask for ``ROW_META`` alone).
    """
    return ROW_META in requested and requested != declared


def row_meta_tensor(meta: Sequence[RowMeta]) -> np.ndarray:
    """``[B, 1]`` TYPE_STRING tensor (numpy object array of bytes), one JSON per row."""
    out = np.empty((len(meta), 1), dtype=np.object_)
    for i, m in enumerate(meta):
        out[i, 0] = m.to_json().encode()
    return out


@dataclass(frozen=True)
class Packed:
    """The rows of several requests right-padded (with 0) into one ``[N, W]`` tensor.

    Request ``k`` owns rows ``slices[k]``. ``W`` is the longest row of all.
    """

    ids: np.ndarray
    lengths: np.ndarray
    slices: list[slice]


def pack(parts: Sequence[Rows]) -> Packed:
    """Pad every request's rows to the longest row of all and stack them, in order."""
    total = sum(p.count for p in parts)
    width = max(int(p.lengths.max()) for p in parts)
    ids = np.zeros((total, width), dtype=np.int64)
    lengths = np.empty(total, dtype=np.int64)
    slices = []
    start = 0
    for p in parts:
        stop = start + p.count
        ids[start:stop, : p.ids.shape[1]] = p.ids
        lengths[start:stop] = p.lengths
        slices.append(slice(start, stop))
        start = stop
    return Packed(ids=ids, lengths=lengths, slices=slices)


def width_groups(lengths: np.ndarray, token_budget: int) -> list[np.ndarray]:
    """Row indices grouped so that rows of very different lengths are not padded together.

    Rows are taken longest first; a group closes when one more row would make its padded
    size (rows x its longest row) exceed ``token_budget`` (a row longer than the budget
    gets a group of its own). A frontend batch within the budget stays one group, so it
    runs in one forward pass; a 2048-token row dynamically batched with short ones does
    not make them all 2048 wide. Grouping only changes float rounding, never the math.
    """
    order = np.argsort(-lengths, kind="stable")
    groups: list[np.ndarray] = []
    start = 0
    while start < order.size:
        longest = int(lengths[order[start]])
        size = max(1, token_budget // longest)
        groups.append(order[start : start + size])
        start += size
    return groups
