"""The ``rerank`` model: a cross-encoder, one relevance logit per query+document pair
(token-cost endpoint).

Input ``INPUT_IDS`` INT32 ``[B, W]``: each row is one pair, already joined by the tokenizer
as ``[CLS] query [SEP] document [SEP]`` (``model_repository/rerank/tokenizer.json``;
``fair_frontend.shell.api.rerank.pair_rows``), each row's real length in the ``fair_rows``
parameter's ``length`` list where the frontend padded (else the full width). Output
``SCORE`` FP32 ``[B, 1]``, the logit (a rerank API maps it to ``[0, 1]`` with a sigmoid),
and ``ROW_META`` on explicit request (``rows.wants_row_meta``). Accounting: one row and
``length`` tokens per row, as ``embed``.

Which network scores the pairs is the config parameter ``weights``:

- ``builtin`` (the default): ``nets.CrossEncoder`` from a fixed seed (``nets.RERANK_SEED``,
  or the ``seed`` parameter), vocabulary 4096. Nothing is downloaded.
- ``onnx:<path>``: a cross-encoder exported to ONNX with Hugging Face's signature
  (``input_ids``, ``attention_mask`` and, for BERT-like models, ``token_type_ids`` ->
  ``logits`` ``[B, 1]``), run with onnxruntime (an optional dependency: ``pip install
  fair-frontend[onnx]``). ``<path>`` is relative to the model's directory. Its vocabulary
  is the ``vocab_size`` parameter (required: ids are taken modulo it, as for the builtin);
  ``token_type_ids`` are 0 up to and including the first ``sep_token_id`` of a row and 1
  after it (BERT's segments; the parameter is required when the model takes them);
  padding holds ``pad_token_id`` (default 0) under an attention mask of 0.

``max_model_len`` (default 512, BERT's) is the most tokens one pair may have; the frontend
reads the same parameter (``models.CONTEXT_CONFIG_PARAMETER``) and refuses a longer row
before it queues.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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

SCORE = "SCORE"
INPUTS = (INPUT_IDS,)
OUTPUTS = frozenset({SCORE, ROW_META})
BUILTIN = "builtin"
ONNX_PREFIX = "onnx:"
# BERT's 512 positions: what exported cross-encoders (ms-marco MiniLM, bge-reranker-base)
# take. The builtin's sinusoidal positions go to nets.MAX_POSITIONS.
DEFAULT_MAX_MODEL_LEN = 512
# Rows x padded width one forward pass may take (as embed's): 32 pairs of 256 tokens are one
# pass; a 512-token pair batched with short ones does not make them all 512 wide.
TOKEN_BUDGET = 8192
# An exported cross-encoder's inputs, by Hugging Face's names.
ONNX_IDS, ONNX_MASK, ONNX_TYPES = "input_ids", "attention_mask", "token_type_ids"
ONNX_LOGITS = "logits"
_ONNX_INTEGERS: dict[str, np.dtype[Any]] = {
    "tensor(int64)": np.dtype(np.int64),
    "tensor(int32)": np.dtype(np.int32),
}


@dataclass(frozen=True)
class RerankOptions:
    """The ``rerank`` parameters of ``config.pbtxt`` (besides ``ModelSettings``' ones)."""

    weights: str = BUILTIN
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    vocab_size: int | None = None  # onnx: the exported model's vocabulary (required)
    sep_token_id: int | None = None  # onnx with token_type_ids: where the document starts
    pad_token_id: int = 0

    @property
    def onnx_path(self) -> str | None:
        """The ONNX file named by ``weights``, as written (None for ``builtin``)."""
        return self.weights.removeprefix(ONNX_PREFIX) if self.is_onnx else None

    @property
    def is_onnx(self) -> bool:
        return self.weights.startswith(ONNX_PREFIX)

    @classmethod
    def from_model_config(cls, model_config: Mapping[str, Any]) -> RerankOptions:
        """Read ``weights``, ``max_model_len``, ``vocab_size``, ``sep_token_id`` and
        ``pad_token_id``; one ``ValueError`` lists every problem (the model fails to load
        with it)."""
        raw = {
            key: value.get("string_value", "") if isinstance(value, Mapping) else str(value)
            for key, value in (model_config.get("parameters") or {}).items()
        }
        problems: list[str] = []
        weights = raw.get("weights", BUILTIN).strip()
        onnx = weights.startswith(ONNX_PREFIX)
        if weights != BUILTIN and not onnx:
            problems.append(f"weights={weights!r} must be '{BUILTIN}' or '{ONNX_PREFIX}<path>'")
        elif onnx and not weights.removeprefix(ONNX_PREFIX).strip():
            problems.append(f"weights={weights!r} names no file after '{ONNX_PREFIX}'")
        counts: dict[str, int] = {}
        for name, minimum in (
            ("max_model_len", 1),
            ("vocab_size", 1),
            ("sep_token_id", 0),
            ("pad_token_id", 0),
        ):
            if name not in raw:
                continue
            try:
                counts[name] = int(raw[name])
            except ValueError:
                problems.append(f"{name}={raw[name]!r} is not an integer")
                continue
            if counts[name] < minimum:
                problems.append(f"{name}={counts[name]} must be >= {minimum}")
        length = counts.get("max_model_len", DEFAULT_MAX_MODEL_LEN)
        if onnx and "vocab_size" not in raw:
            problems.append(
                "vocab_size is required with onnx weights (the exported model's vocabulary: "
                "ids are taken modulo it)"
            )
        if not onnx:
            if "vocab_size" in counts and counts["vocab_size"] != nets.VOCAB_SIZE:
                problems.append(
                    f"vocab_size={counts['vocab_size']}: the builtin network's vocabulary is "
                    f"{nets.VOCAB_SIZE}"
                )
            if length > nets.MAX_POSITIONS:
                problems.append(
                    f"max_model_len={length}: the builtin network has {nets.MAX_POSITIONS} "
                    "positions"
                )
        if problems:
            raise ValueError("invalid rerank config parameters: " + "; ".join(problems))
        return cls(
            weights=weights,
            max_model_len=length,
            vocab_size=counts.get("vocab_size"),
            sep_token_id=counts.get("sep_token_id"),
            pad_token_id=counts.get("pad_token_id", 0),
        )


class Scorer(Protocol):
    """What scores padded pairs: the builtin network or an exported one."""

    vocab: int

    def score(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """``ids`` int64 ``[n, w]`` in ``[0, vocab)`` (0 past each row's length), ``lengths``
        int64 ``[n]`` in ``[1, w]`` -> ``[n]`` float32 logits."""
        ...


class BuiltinScorer:
    """``nets.CrossEncoder`` from its seed, on the instance's device."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.net = nets.build_cross_encoder(seed).to(device)
        self.vocab = self.net.vocab

    def score(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            logits = self.net(
                torch.from_numpy(ids).to(self.device), torch.from_numpy(lengths).to(self.device)
            )
        out: np.ndarray = logits.float().cpu().numpy()
        return out


class OnnxScorer:
    """An exported cross-encoder run with onnxruntime.

    Checked when loaded, so that a wrong file fails the model load with a message instead
    of every batch: the inputs must be ``input_ids`` and ``attention_mask`` (and possibly
    ``token_type_ids``, then with ``sep_token_id`` set), integer-typed; the output
    ``logits`` (else the only output) must hold one label per row.
    """

    def __init__(self, path: Path, options: RerankOptions, threads: int, device: str) -> None:
        # onnxruntime is an optional dependency (the `onnx` extra): imported only by a model
        # whose config asks for ONNX weights.
        import onnxruntime

        if not path.is_file():
            raise ValueError(f"weights: no such ONNX file: {path}")
        if options.vocab_size is None:
            raise ValueError("vocab_size is required with onnx weights")
        self.vocab = options.vocab_size
        self.pad = options.pad_token_id
        self.sep = options.sep_token_id
        session_options = onnxruntime.SessionOptions()
        session_options.intra_op_num_threads = threads
        session_options.inter_op_num_threads = 1
        providers: list[Any] = ["CPUExecutionProvider"]
        if device.startswith("cuda"):
            if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
                raise ValueError(
                    "a KIND_GPU instance with onnx weights needs onnxruntime's CUDA provider "
                    "(the onnxruntime-gpu package)"
                )
            device_id = int(device.partition(":")[2] or 0)
            providers = [("CUDAExecutionProvider", {"device_id": device_id}), *providers]
        self.session = onnxruntime.InferenceSession(str(path), session_options, providers=providers)
        inputs = {i.name: i for i in self.session.get_inputs()}
        missing = [n for n in (ONNX_IDS, ONNX_MASK) if n not in inputs]
        strange = sorted(set(inputs) - {ONNX_IDS, ONNX_MASK, ONNX_TYPES})
        if missing or strange:
            raise ValueError(
                f"{path.name}: a cross-encoder takes {ONNX_IDS}, {ONNX_MASK}[, {ONNX_TYPES}]; "
                f"this model takes {sorted(inputs)}"
            )
        self.dtypes: dict[str, np.dtype[Any]] = {}
        for name, spec in inputs.items():
            dtype = _ONNX_INTEGERS.get(spec.type)
            if dtype is None:
                raise ValueError(f"{path.name}: input {name} is {spec.type}, not an integer type")
            self.dtypes[name] = dtype
        if ONNX_TYPES in inputs and self.sep is None:
            raise ValueError(
                f"{path.name} takes {ONNX_TYPES}: set sep_token_id (the [SEP] id of its "
                "tokenizer), from which each row's segments are read"
            )
        outputs = self.session.get_outputs()
        names = [o.name for o in outputs]
        if ONNX_LOGITS not in names and len(outputs) != 1:
            raise ValueError(f"{path.name}: no '{ONNX_LOGITS}' output among {names}")
        out = next((o for o in outputs if o.name == ONNX_LOGITS), outputs[0])
        shape = list(out.shape)  # a dimension may be symbolic (a name) or None
        if len(shape) not in (1, 2) or (
            len(shape) == 2 and isinstance(shape[1], int) and shape[1] != 1
        ):
            raise ValueError(
                f"{path.name}: output {out.name} has shape {shape}; a reranker gives one "
                "logit per row ([batch, 1])"
            )
        self.output = out.name

    def feeds(self, ids: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        """The model's inputs for padded rows (also what a test feeds onnxruntime)."""
        valid = np.arange(ids.shape[1])[None, :] < lengths[:, None]
        feeds = {
            ONNX_IDS: np.where(valid, ids, self.pad).astype(self.dtypes[ONNX_IDS]),
            ONNX_MASK: valid.astype(self.dtypes[ONNX_MASK]),
        }
        if ONNX_TYPES in self.dtypes:
            sep = (ids == self.sep) & valid
            # 1 strictly after the row's first [SEP]: the query's [SEP] is still segment 0.
            after = (np.cumsum(sep, axis=1) - sep) > 0
            feeds[ONNX_TYPES] = (after & valid).astype(self.dtypes[ONNX_TYPES])
        return feeds

    def score(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        (logits,) = self.session.run([self.output], self.feeds(ids, lengths))
        logits = np.asarray(logits, dtype=np.float32)
        if logits.ndim == 2 and logits.shape[1] == 1:
            logits = logits[:, 0]
        if logits.shape != (ids.shape[0],):
            raise RuntimeError(
                f"the ONNX model gave {self.output} of shape {list(logits.shape)} for "
                f"{ids.shape[0]} rows; a reranker gives one logit per row"
            )
        return logits


@dataclass(frozen=True)
class RerankRequest:
    """One request, decoded: its rows (pairs), their owners, whether to echo ``ROW_META``."""

    rows: Rows
    meta: list[RowMeta]
    echo_meta: bool

    def usage(self) -> list[tuple[str, int]]:
        """``(tenant, tokens)`` per row: real input tokens, padding excluded."""
        return [(m.tenant, int(n)) for m, n in zip(self.meta, self.rows.lengths, strict=True)]


class RerankModel:
    """The cross-encoder behind Triton's ``rerank``; one per Triton model instance."""

    def __init__(
        self,
        settings: ModelSettings | None = None,
        options: RerankOptions | None = None,
        model_dir: Path | None = None,
    ) -> None:
        self.settings = settings or ModelSettings()
        self.options = options or RerankOptions()
        torch.set_num_threads(self.settings.torch_threads)
        self.scorer: Scorer
        onnx_path = self.options.onnx_path
        if onnx_path is None:
            seed = nets.RERANK_SEED if self.settings.seed is None else self.settings.seed
            self.scorer = BuiltinScorer(seed, torch.device(self.settings.device))
        else:
            path = Path(onnx_path)
            if not path.is_absolute() and model_dir is not None:
                path = model_dir / path
            self.scorer = OnnxScorer(
                path, self.options, self.settings.torch_threads, self.settings.device
            )

    @classmethod
    def from_triton_args(cls, args: Mapping[str, str]) -> RerankModel:
        """Built from ``initialize``'s ``args`` (config parameters, instance device, and
        the model's directory, which a relative ONNX path is read from)."""
        options = RerankOptions.from_model_config(json.loads(args["model_config"]))
        model_dir = Path(args["model_repository"]) if "model_repository" in args else None
        return cls(ModelSettings.from_triton_args(args), options, model_dir)

    def decode(self, data: RequestData) -> RerankRequest:
        """Validate one request; raise ``RequestError`` naming what is wrong."""
        rows, params = decode_request(
            data, vocab=self.scorer.vocab, max_row_tokens=self.options.max_model_len
        )
        meta = row_metadata(params, rows.count, data.request_id)
        return RerankRequest(rows, meta, wants_row_meta_of(data, params, OUTPUTS))

    def run(self, requests: Sequence[RerankRequest]) -> list[dict[str, np.ndarray]]:
        """Outputs per request, in order, from the padded rows of all of them."""
        packed = pack([r.rows for r in requests])
        logits = self.score(packed)
        results = []
        for request, rows in zip(requests, packed.slices, strict=True):
            outputs = {SCORE: logits[rows].reshape(-1, 1)}
            if request.echo_meta:
                outputs[ROW_META] = row_meta_tensor(request.meta)
            results.append(outputs)
        return results

    def score(self, packed: Packed) -> np.ndarray:
        """``[N]`` float32 logits for the packed rows (grouped by width, ``TOKEN_BUDGET``)."""
        out = np.empty(packed.lengths.size, dtype=np.float32)
        for group in width_groups(packed.lengths, TOKEN_BUDGET):
            lengths = packed.lengths[group]
            ids = np.ascontiguousarray(packed.ids[group, : int(lengths.max())])
            out[group] = self.scorer.score(ids, lengths)
        return out
