"""The ``generate`` model: greedy decoding of ``max_tokens`` new tokens (request-cost endpoint).

Input ``INPUT_IDS`` INT32 ``[B, W]`` (each row's real length in the ``fair_rows``
parameter's ``length`` list where the frontend padded; else the full width). How many
tokens to generate is the request parameter ``max_tokens`` (default 16, 1..256), as
Triton's vLLM backend and the generate extension take it: one count for every row of a
request. The frontend, whose batches hold rows of several clients, sends each row's own
count in ``fair_rows`` (``max_tokens`` list) instead.

Outputs ``OUTPUT_IDS`` INT32 ``[B, T]``: the generated tokens only (no prompt, no EOS),
``T`` the request's largest count, each row right-padded with 0 after its own count;
``OUTPUT_LENGTHS`` INT32 ``[B, 1]`` (each row's count) only when the counts came per row
in ``fair_rows``, the one case where they can differ within a request: a direct client
gets exactly ``OUTPUT_IDS`` even when it names no outputs (Triton accepts a declared
output being absent from the response). ``ROW_META`` on explicit request.

Greedy decoding is deterministic per row: a row's first ``n`` tokens do not depend on how
many steps the batch runs or on its neighbours (``nets.CausalDecoder`` masks everything
right of each row's position), so rows with different counts share one decode loop of
``max(max_tokens)`` steps and each keeps its own prefix.
Accounting: one row and ``length + max_tokens`` tokens per row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from python_backend import nets
from python_backend.rows import (
    FAIR_ROWS_PARAM,
    INPUT_IDS,
    ROW_META,
    Parameters,
    RequestData,
    RequestError,
    RowMeta,
    Rows,
    decode_request,
    integer,
    pack,
    row_meta_tensor,
    row_metadata,
    wants_row_meta_of,
)
from python_backend.settings import ModelSettings

MAX_TOKENS_PARAM = "max_tokens"  # request parameter, and fair_rows list
OUTPUT_IDS = "OUTPUT_IDS"
OUTPUT_LENGTHS = "OUTPUT_LENGTHS"
INPUTS = (INPUT_IDS,)
OUTPUTS = frozenset({OUTPUT_IDS, OUTPUT_LENGTHS, ROW_META})
DEFAULT_MAX_TOKENS = 16
MAX_MAX_TOKENS = 256
MAX_PROMPT_TOKENS = nets.MAX_POSITIONS - MAX_MAX_TOKENS  # prompt + new tokens fit positions


@dataclass(frozen=True)
class GenerateRequest:
    """One request, decoded: rows, tokens to generate per row, owners, echo flag."""

    rows: Rows
    max_tokens: np.ndarray  # [B] int64 in [1, MAX_MAX_TOKENS]
    per_row: bool  # the counts came per row (fair_rows): answer OUTPUT_LENGTHS
    meta: list[RowMeta]
    echo_meta: bool

    def usage(self) -> list[tuple[str, int]]:
        """``(tenant, tokens)`` per row: real prompt tokens plus generated tokens."""
        rows = zip(self.meta, self.rows.lengths, self.max_tokens, strict=True)
        return [(m.tenant, int(n + t)) for m, n, t in rows]


def decode_max_tokens(params: Parameters, count: int) -> tuple[np.ndarray, bool]:
    """Tokens to generate per row, and whether they came per row.

    The ``fair_rows`` list ``max_tokens`` (the frontend's batches), else the request
    parameter ``max_tokens`` for every row, else the default; each in range.
    """
    column = params.column(MAX_TOKENS_PARAM)
    if column is not None:
        where = f"parameter '{FAIR_ROWS_PARAM}': {MAX_TOKENS_PARAM}"
        values = [_count(v, f"{where}[{i}]") for i, v in enumerate(column)]
        return np.array(values, dtype=np.int64), True
    if MAX_TOKENS_PARAM in params.values:
        n = _count(params.values[MAX_TOKENS_PARAM], f"parameter '{MAX_TOKENS_PARAM}'")
        return np.full(count, n, dtype=np.int64), False
    return np.full(count, DEFAULT_MAX_TOKENS, dtype=np.int64), False


def _count(value: Any, where: str) -> int:
    n = integer(value)
    if n is None or not 1 <= n <= MAX_MAX_TOKENS:
        raise RequestError(
            f"{where} must be an integer between 1 and {MAX_MAX_TOKENS}, got {value!r}"
        )
    return n


class GenerateModel:
    """The decoder behind Triton's ``generate``; one instance per Triton model instance."""

    def __init__(self, settings: ModelSettings | None = None) -> None:
        self.settings = settings or ModelSettings()
        torch.set_num_threads(self.settings.torch_threads)
        self.device = torch.device(self.settings.device)
        seed = nets.GENERATE_SEED if self.settings.seed is None else self.settings.seed
        self.net = nets.build_decoder(seed).to(self.device)

    @classmethod
    def from_triton_args(cls, args: Mapping[str, str]) -> GenerateModel:
        """Built from ``initialize``'s ``args`` (config parameters, instance device)."""
        return cls(ModelSettings.from_triton_args(args))

    def decode(self, data: RequestData) -> GenerateRequest:
        """Validate one request; raise ``RequestError`` naming what is wrong."""
        rows, params = decode_request(data, vocab=self.net.vocab, max_row_tokens=MAX_PROMPT_TOKENS)
        max_tokens, per_row = decode_max_tokens(params, rows.count)
        meta = row_metadata(params, rows.count, data.request_id)
        echo = wants_row_meta_of(data, params, OUTPUTS)
        return GenerateRequest(rows, max_tokens, per_row, meta, echo)

    def run(self, requests: Sequence[GenerateRequest]) -> list[dict[str, np.ndarray]]:
        """Outputs per request, in order, from one decode loop over all their rows."""
        packed = pack([r.rows for r in requests])
        steps = max(int(r.max_tokens.max()) for r in requests)
        tokens = self.greedy(packed.ids, packed.lengths, steps)
        results = []
        for request, rows in zip(requests, packed.slices, strict=True):
            counts = request.max_tokens
            out = tokens[rows, : int(counts.max())].astype(np.int32)
            out[np.arange(out.shape[1]) >= counts[:, None]] = 0
            outputs = {OUTPUT_IDS: out}
            if request.per_row:
                outputs[OUTPUT_LENGTHS] = counts.astype(np.int32).reshape(-1, 1)
            if request.echo_meta:
                outputs[ROW_META] = row_meta_tensor(request.meta)
            results.append(outputs)
        return results

    def greedy(self, ids: np.ndarray, lengths: np.ndarray, steps: int) -> np.ndarray:
        """``[N, steps]`` int64: argmax tokens after each row's ``lengths[i]`` prompt tokens."""
        out = np.empty((ids.shape[0], steps), dtype=np.int64)
        with torch.inference_mode():
            pos = torch.from_numpy(lengths).to(self.device).clone()  # advanced in place
            logits, cache = self.net.prefill(
                torch.from_numpy(ids).to(self.device), pos, width=ids.shape[1] + steps
            )
            for step in range(steps):
                token = logits.argmax(dim=-1)  # ties: the lowest id, deterministically
                out[:, step] = token.cpu().numpy()
                if step + 1 < steps:
                    logits = self.net.step(token, pos, cache)
                    pos += 1
        return out
