"""The ``embed`` model: token ids -> one 128-float embedding per row (token-cost endpoint).

Input ``INPUT_IDS`` INT32 ``[B, W]`` (each row's real length in the ``fair_rows``
parameter's ``length`` list where the frontend padded; else the full width); output
``EMBEDDING`` FP32 ``[B, 128]``, and ``ROW_META`` on explicit request (see
``rows.wants_row_meta``). Accounting: one row and ``length`` tokens per row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from python_backend import nets
from python_backend.rows import (
    INPUT_IDS,
    ROW_META,
    Packed,
    RequestData,
    RowMeta,
    Rows,
    decode_request,
    pack,
    row_meta_tensor,
    row_metadata,
    wants_row_meta_of,
    width_groups,
)
from python_backend.settings import ModelSettings

EMBEDDING = "EMBEDDING"
INPUTS = (INPUT_IDS,)
OUTPUTS = frozenset({EMBEDDING, ROW_META})
MAX_ROW_TOKENS = nets.MAX_POSITIONS
# Rows x padded width one forward pass may take: a full frontend batch (32 x 128) is one
# pass; a long row batched with short ones is run apart from them (``rows.width_groups``).
TOKEN_BUDGET = 8192


@dataclass(frozen=True)
class EmbedRequest:
    """One request, decoded: its rows, their owners, and whether to echo ``ROW_META``."""

    rows: Rows
    meta: list[RowMeta]
    echo_meta: bool

    def usage(self) -> list[tuple[str, int]]:
        """``(tenant, tokens)`` per row: real input tokens, padding excluded."""
        return [(m.tenant, int(n)) for m, n in zip(self.meta, self.rows.lengths, strict=True)]


class EmbedModel:
    """The encoder behind Triton's ``embed``; one instance per Triton model instance."""

    def __init__(self, settings: ModelSettings | None = None) -> None:
        self.settings = settings or ModelSettings()
        torch.set_num_threads(self.settings.torch_threads)
        self.device = torch.device(self.settings.device)
        seed = nets.EMBED_SEED if self.settings.seed is None else self.settings.seed
        self.net = nets.build_encoder(seed).to(self.device)

    @classmethod
    def from_triton_args(cls, args: Mapping[str, str]) -> EmbedModel:
        """Built from ``initialize``'s ``args`` (config parameters, instance device)."""
        return cls(ModelSettings.from_triton_args(args))

    def decode(self, data: RequestData) -> EmbedRequest:
        """Validate one request; raise ``RequestError`` naming what is wrong."""
        rows, params = decode_request(data, vocab=self.net.vocab, max_row_tokens=MAX_ROW_TOKENS)
        meta = row_metadata(params, rows.count, data.request_id)
        return EmbedRequest(rows, meta, wants_row_meta_of(data, params, OUTPUTS))

    def run(self, requests: Sequence[EmbedRequest]) -> list[dict[str, np.ndarray]]:
        """Outputs per request, in order, from one padded batch of all their rows."""
        packed = pack([r.rows for r in requests])
        vectors = self.embed(packed)
        results = []
        for request, rows in zip(requests, packed.slices, strict=True):
            outputs = {EMBEDDING: vectors[rows]}
            if request.echo_meta:
                outputs[ROW_META] = row_meta_tensor(request.meta)
            results.append(outputs)
        return results

    def embed(self, packed: Packed) -> np.ndarray:
        """``[N, 128]`` float32 for the packed rows (grouped by width, see ``TOKEN_BUDGET``)."""
        out = np.empty((packed.lengths.size, nets.D_MODEL), dtype=np.float32)
        with torch.inference_mode():
            for group in width_groups(packed.lengths, TOKEN_BUDGET):
                lengths = packed.lengths[group]
                ids = packed.ids[group, : int(lengths.max())]
                vectors = self.net(
                    torch.from_numpy(ids).to(self.device),
                    torch.from_numpy(lengths).to(self.device),
                )
                out[group] = vectors.cpu().numpy()
        return out
