"""Turning queued requests into one Triton request, and its answer back into one per item.

Which requests may share a batch is decided by ``batch_key``: the same model version,
input names, datatypes and non-batch shapes (a padded dimension excepted), the same
requested outputs and the same custom parameters (the endpoint's per-row max tokens
parameter excepted). Requests that differ in any of these cannot be one Triton request
without changing what the model sees.

Per-row metadata travels in the ``fair_rows`` parameter, a JSON object of per-row lists:
tenant, priority, deadline and id always; each row's true length where a padded input
names a ``lengths_field``; each row's tokens to generate under the name of the endpoint's
``max_tokens_parameter``, which is taken out of the request parameters (``validate`` has
checked it and filled in the default). Nothing per row is added as a model input: a model
input is something a load generator such as perf_analyzer fills with random data.

Only a model that asks for it (``ModelInfo.takes_rows``, its config's
``fair_frontend_rows`` parameter) gets ``fair_rows`` (and ``fair_outputs``); every other
model gets the client's request parameters exactly as sent, as from Triton directly. Such
a model cannot be told per-row values, so rows that would need them do not share a batch:
the tokens to generate stay a request parameter (part of ``batch_key`` like any other),
and rows of a padded input with a ``lengths_field`` are batched only with rows of the
same width (nothing padded, nothing the model would mistake for tokens).

Ragged rows are right-padded to the longest row only where the endpoint declares how
(``padding.inputs``); padded outputs are cut back by the model's lengths output
(``padding.outputs``), which the frontend asks for and never hands back to a client.

Padding must not let one row decide what its neighbours cost: a row 16M wide would pad
every row of its batch to 16M. So the padded width is part of ``batch_key``, coarsely
(``width_class``): rows narrow enough that a full batch of them, all padded to the
widest, stays within the largest request the model takes (``RequestBounds.payload_bytes``)
share class 0, the usual case, where nothing changes; a wider row shares a batch only
with rows of its power-of-two class, each padded to less than twice its own width.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from fair_frontend.protocol import (
    DTYPES,
    Batch,
    InferRequest,
    ParamValue,
    RequestedOutput,
    Tensor,
)

if TYPE_CHECKING:
    from fair_frontend.endpoint import EndpointPlan

ROWS_PARAMETER = "fair_rows"
OUTPUTS_PARAMETER = "fair_outputs"


class Item(Protocol):
    """What ``pack`` reads of each request in a batch (``core.dispatch.CoreRequest``)."""

    @property
    def request(self) -> InferRequest: ...

    @property
    def lengths(self) -> list[int] | None: ...

    @property
    def deadline_us(self) -> int:
        """Unix epoch microseconds, 0 = none."""
        ...

    rows: int
    tenant: str
    priority: int


def batch_key(req: InferRequest, plan: EndpointPlan) -> Hashable:
    """What requests must have in common to share a batch (module docstring), under the
    endpoint's ``plan`` (its padded inputs, rows and bounds)."""
    if plan.info.batching and not req.inputs:
        # No inputs (all the model's inputs are optional): nothing to stack rows along, so
        # Triton could not split the answer between requests: each goes alone.
        return object()
    padded = plan.padded
    rows = plan.key_rows
    max_bytes = plan.bounds.payload_bytes
    inputs = tuple(
        sorted(
            (t.name, t.datatype, t.shape[2:], width_class(t, rows, max_bytes))
            if t.name in padded and len(t.shape) >= 2
            else (t.name, t.datatype, t.shape[1:], 0)
            for t in req.inputs
        )
    )
    outputs = tuple((o.name, o.classification) for o in req.outputs)
    # Travels per row in fair_rows (batching models that take it; the others get it as
    # the client sent it).
    per_row = plan.per_row_parameter
    params = tuple(sorted((k, v) for k, v in req.parameters.items() if k != per_row))
    return (req.version, inputs, outputs, params)


def wire_key(req: InferRequest, plan: EndpointPlan) -> bytes:
    """``batch_key`` as it crosses to the core (``Call.key``): a digest of it, equal for
    requests that may share a batch. A request that goes alone (no inputs) gets a key of
    its own, never equal to another's."""
    key = batch_key(req, plan)
    if type(key) is object:
        return b"alone:" + os.urandom(16)
    return hashlib.blake2b(repr(key).encode(), digest_size=16).digest()


def width_class(t: Tensor, max_rows: int, max_bytes: int) -> int:
    """Which rows a padded input's rows may be batched with: 0 for rows whose full batch,
    padded to this width, stays within ``max_bytes``; else the power of two the width
    rounds up to (its bit length), so that rows of one class are padded to less than
    twice their width."""
    width = t.shape[1]
    row_element_bytes = max(1, DTYPES[t.datatype].itemsize * math.prod(t.shape[2:]))
    if max_rows * width * row_element_bytes <= max_bytes:
        return 0
    return (width - 1).bit_length()


@dataclass(slots=True)
class Packed:
    inputs: list[Tensor]
    outputs: list[RequestedOutput] | None  # None: all outputs
    parameters: dict[str, ParamValue]
    stripped: frozenset[str]  # outputs added for the frontend's own use
    sequence: dict[str, ParamValue]  # a stateful model's sequence_id/_start/_end

    def batch(self, model: str, first: InferRequest, rows: int, traceparent: str = "") -> Batch:
        """This batch as its backend's request (``rows`` calls, ``first`` the first of
        them): the first's version, and its id where the batch is that one call alone."""
        return Batch(
            model,
            first.version,
            self.inputs,
            self.outputs,
            self.parameters,
            request_id=first.id if rows == 1 else "",
            sequence=self.sequence,
            traceparent=traceparent,
        )


def pack(items: Sequence[Item], plan: EndpointPlan) -> Packed:
    """One Triton request for the whole batch."""
    info, endpoint = plan.info, plan.endpoint
    first = items[0].request
    columns: dict[str, list[object]] = {}  # fair_rows lists beyond the metadata
    if not info.batching:
        assert len(items) == 1, "a non-batching model takes one request at a time"
        inputs = list(first.inputs)
    else:
        by_name: dict[str, Tensor] = {}
        for t0 in first.inputs:
            pad = endpoint.padding.inputs.get(t0.name)
            if pad is None or len(t0.shape) < 2:
                by_name[t0.name] = _concat([it.request for it in items], t0.name, t0.datatype)
            else:
                by_name[t0.name], lengths = _pad_concat(items, t0, pad.pad_value)
                if pad.lengths_field is not None:
                    columns[pad.lengths_field] = list(lengths)
        inputs = list(by_name.values())
    params: dict[str, ParamValue] = dict(first.parameters)
    per_row = endpoint.max_tokens_parameter
    if per_row is not None and info.batching and info.takes_rows:
        # validate() wrote every request's value (or the default) as an integer.
        params.pop(per_row, None)
        columns[per_row] = [
            it.request.parameters.get(per_row, endpoint.max_tokens_default)
            for it in items
            for _ in range(it.rows)
        ]
    # The lengths outputs are the frontend's: the model emits them for its batches only,
    # so a client never gets them, as from Triton directly, even where it named them.
    stripped = {o.lengths_output for o in endpoint.padding.outputs.values()}
    outputs: list[RequestedOutput] | None = None
    if first.outputs:
        # The cut-back needs the lengths output wherever the padded output is asked for.
        outputs = list(first.outputs)
        asked = {o.name for o in outputs}
        for name, pout in endpoint.padding.outputs.items():
            if name in asked and pout.lengths_output not in asked:
                outputs.append(RequestedOutput(pout.lengths_output))
                asked.add(pout.lengths_output)
    if info.takes_rows:
        params[ROWS_PARAMETER] = rows_parameter(items, columns)
    named = [o.name for o in first.outputs]
    if info.takes_rows and named and set(named) != set(info.outputs):
        # What the client named, before the frontend's own additions (lengths outputs),
        # as Triton would report it to the model had the client called it directly (all
        # declared outputs named reads as none named there, so it is left out here too).
        params[OUTPUTS_PARAMETER] = json.dumps(named)
    # Sequence-batched models go one request per batch (EndpointPolicy), so the one
    # request's sequence parameters are the batch's.
    sequence = dict(first.sequence) if len(items) == 1 else {}
    return Packed(inputs, outputs, params, frozenset(stripped), sequence)


def rows_parameter(
    items: Sequence[Item], columns: Mapping[str, Sequence[object]] | None = None
) -> str:
    """``fair_rows``: per-row tenant, priority, deadline and id, then ``columns`` (per-row
    lists the caller built, one entry per row of ``items`` in order)."""
    meta: dict[str, list[object]] = {"tenant": [], "priority": [], "deadline_us": [], "id": []}
    for it in items:
        for _ in range(it.rows):
            meta["tenant"].append(it.tenant)
            meta["priority"].append(it.priority)
            meta["deadline_us"].append(it.deadline_us)
            meta["id"].append(it.request.id)
    for name, values in (columns or {}).items():
        meta[name] = list(values)
    return json.dumps(meta, separators=(",", ":"))


def _concat(reqs: Sequence[InferRequest], name: str, datatype: str) -> Tensor:
    parts = []
    for r in reqs:
        t = r.input(name)
        assert t is not None, "batch_key guarantees every request has the same inputs"
        parts.append(t.data)
    data = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    return Tensor(name, datatype, tuple(data.shape), data)


def _pad_concat(items: Sequence[Item], t0: Tensor, pad_value: float) -> tuple[Tensor, list[int]]:
    """Right-pad every row of a ragged input to the longest and stack; each row's width."""
    tensors = [it.request.input(t0.name) for it in items]
    total = sum(t.shape[0] for t in tensors if t is not None)
    width = max(t.shape[1] for t in tensors if t is not None)
    rest = t0.shape[2:]
    data = np.full((total, width, *rest), pad_value, dtype=DTYPES[t0.datatype])
    lengths: list[int] = []
    row = 0
    for t in tensors:
        assert t is not None, "batch_key guarantees every request has the same inputs"
        n, w = t.shape[0], t.shape[1]
        data[row : row + n, :w] = t.data
        lengths.extend([w] * n)
        row += n
    return Tensor(t0.name, t0.datatype, tuple(data.shape), data), lengths


def unpack(
    outputs: Sequence[Tensor],
    items: Sequence[Item],
    plan: EndpointPlan,
    stripped: frozenset[str],
) -> list[list[Tensor]]:
    """Split a batch's outputs into each item's outputs, in the item's requested order."""
    info, endpoint = plan.info, plan.endpoint
    by_name = {t.name: t for t in outputs}
    if not info.batching:
        return [[t for t in outputs if t.name not in stripped]]
    result: list[list[Tensor]] = []
    row = 0
    for it in items:
        lo, hi = row, row + it.rows
        row = hi
        if it.request.outputs:
            # A model may leave out an output, even one asked for (Triton omits it too).
            names = [
                o.name for o in it.request.outputs if o.name in by_name and o.name not in stripped
            ]
        else:
            names = [t.name for t in outputs if t.name not in stripped]
        mine = []
        for name in names:
            t = by_name[name]
            data = t.data[lo:hi]
            pad = endpoint.padding.outputs.get(name)
            if pad is not None and pad.lengths_output in by_name and data.ndim >= 2:
                lens = by_name[pad.lengths_output].data[lo:hi].reshape(-1)
                data = data[:, : int(lens.max()) if lens.size else 0]
            mine.append(Tensor(name, t.datatype, tuple(data.shape), data))
        result.append(mine)
    return result
