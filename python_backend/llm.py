"""The ``llm`` model: text in, streamed text out, with continuous batching in one instance.

Shaped like Triton's vLLM backend (``triton-inference-server/vllm_backend``, ``src/model.py``
and ``src/utils/request.py``), so that swapping in a real vLLM or TensorRT-LLM model changes
only the model repository and an endpoint config:

- inputs ``text_input`` STRING [1]; optional ``stream`` BOOL [1] (default false),
  ``sampling_parameters`` STRING [1] (a JSON object), ``exclude_input_in_output`` BOOL [1],
  ``return_num_input_tokens`` / ``return_num_output_tokens`` BOOL [1];
- outputs ``text_output`` STRING [-1]; ``num_input_tokens`` / ``num_output_tokens`` UINT32
  [1], each only when asked for;
- decoupled: streaming sends one response per generated token carrying that token's text,
  the last one flagged final (vLLM flags the response that carries the last token; no empty
  response follows); non-streaming sends one final response with the whole text, the prompt
  first unless ``exclude_input_in_output`` (vLLM's default per mode: prompt included when
  not streaming, excluded when streaming, and ``exclude_input_in_output=false`` with
  ``stream=true`` is an error).

The engine (``Engine``) does iteration-level ("continuous") batching the way vLLM's
scheduler does, on the ``generate`` network (``nets.CausalDecoder``, same seed). One
iteration (``Engine.step``):

1. take new requests from the inbox (``submit`` is thread-safe and returns at once);
2. retire every sequence whose client cancelled;
3. admit waiting requests, first come first served, while fewer than ``max_num_seqs`` run
   and their prompts fit ``max_num_batched_tokens``: one batched prefill, which yields each
   admitted sequence its first token;
4. one decode step for every sequence that was already running: ONE batched forward pass
   (``CausalDecoder.step``), one new token each;
5. send every sequence its token, and retire the finished ones.

KV cache: one tensor per layer ``[2, max_num_seqs, heads, max_model_len, d_head]``, a slot
per running sequence. Running sequences occupy slots ``0..n-1`` (compact): a retiring
sequence's slot takes the last one's cache (a copy of one slot), so a step is always over
the first ``n`` slots and needs no gather. ``CausalDecoder.step`` masks every slot right of
a sequence's own position, so neighbours, stale slots and padding never reach its logits.

No EOS: the tokenizer has no special tokens, and every sequence generates exactly
``max_tokens`` tokens (``ignore_eos`` is accepted and changes nothing); load generators and
benchmarks rely on known output lengths.

Sampling: greedy (argmax) when ``temperature`` is 0 (below 1e-5, as vLLM); otherwise
temperature, then ``top_k``, then ``top_p``, then a draw from the sequence's own
``torch.Generator``, seeded with ``seed`` when given: the same seed gives the same text,
whatever else runs in the batch (up to float rounding of the logits).
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import random
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
from torch import Tensor

from python_backend import nets
from python_backend import tokenizer as tokenizers_
from python_backend.metering import TenantMeters
from python_backend.rows import FAIR_ROWS_PARAM, TENANT_PARAM, UNKNOWN_TENANT, RequestError
from python_backend.settings import ModelSettings

# ---- interface names (vLLM backend's) -------------------------------------------------------

TEXT_INPUT = "text_input"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"
INPUTS = (
    TEXT_INPUT,
    STREAM,
    SAMPLING_PARAMETERS,
    EXCLUDE_INPUT_IN_OUTPUT,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
)
TEXT_OUTPUT = "text_output"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"

# ---- sampling defaults: vLLM's SamplingParams --------------------------------------------------

DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0  # 0 or -1: all tokens
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a smaller temperature means greedy
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")

# ---- engine capacity: config.pbtxt parameters ----------------------------------------------

DEFAULT_MAX_NUM_SEQS = 64  # running sequences (vLLM's max_num_seqs; slots in the KV cache)
# Prompt + generated tokens per sequence (vLLM's max_model_len). Bounds the KV cache:
# 2 layers x K,V x 64 slots x 512 positions x 128 floats = 64 MiB.
DEFAULT_MAX_MODEL_LEN = 512
# Prompt tokens prefilled in one iteration (vLLM's max_num_batched_tokens): a burst of long
# prompts is admitted over several iterations, so running sequences keep getting tokens.
# One request is always admitted, whatever its length, when nothing else is.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
TOKENIZER_FILE = tokenizers_.TOKENIZER_FILE


# ---- request decoding ------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """The sampling parameters of one request (vLLM's names, types and defaults)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    seed: int | None = None
    ignore_eos: bool = False  # accepted; the model has no EOS

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class LlmRequest:
    """One request, decoded and checked against the engine's limits."""

    prompt: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: bool = False
    prepend_input: bool = True  # text_output starts with the prompt (non-streaming default)
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    tenant: str = UNKNOWN_TENANT


def decode_sampling_parameters(sampling_json: str | None, parameters_json: str) -> SamplingParams:
    """Sampling parameters: each key from ``sampling_parameters`` (the input tensor) first,
    then from the request's parameters, then vLLM's default.

    ``sampling_parameters`` must be a JSON object of known keys (vLLM's ``SamplingParams``
    refuses unknown ones too). The request's parameters carry other things as well (the
    frontend's ``fair_rows``, a ``tenant``, Triton's generate extension's ``stream``...), so
    there only the sampling keys are read and everything else is ignored. Values convert
    the way vLLM's ``TritonSamplingParams.from_dict`` does (``int("8")``), but strictly: a
    value that is not a number (or a bool, for ``ignore_eos``) is an error naming the key.
    """
    sampled: dict[str, Any] = {}
    if sampling_json is not None:
        sampled = _json_object(sampling_json, f"input '{SAMPLING_PARAMETERS}'")
        unknown = sorted(set(sampled) - set(SAMPLING_KEYS))
        if unknown:
            raise RequestError(
                f"input '{SAMPLING_PARAMETERS}': unknown key(s) {unknown}; this model takes "
                f"{list(SAMPLING_KEYS)}"
            )
    try:
        params = json.loads(parameters_json or "{}")
    except ValueError:
        params = {}  # Triton builds this string itself; never expected
    if not isinstance(params, dict):
        params = {}
    values: dict[str, tuple[Any, str]] = {}  # key -> (value, where it came from)
    for key in SAMPLING_KEYS:
        if sampled.get(key) is not None:  # vLLM drops None values: the default applies
            values[key] = (sampled[key], f"input '{SAMPLING_PARAMETERS}': {key}")
        elif params.get(key) is not None:
            values[key] = (params[key], f"parameter '{key}'")
    out: dict[str, Any] = {}
    if "max_tokens" in values:
        out["max_tokens"] = _int(*values["max_tokens"], minimum=1)
    if "temperature" in values:
        out["temperature"] = _float(*values["temperature"], minimum=0.0)
    if "top_p" in values:
        top_p = _float(*values["top_p"], minimum=0.0)
        if not 0.0 < top_p <= 1.0:
            raise RequestError(f"{values['top_p'][1]} must be in (0, 1], got {top_p}")
        out["top_p"] = top_p
    if "top_k" in values:
        top_k = _int(*values["top_k"], minimum=-1)
        out["top_k"] = 0 if top_k == -1 else top_k
    if "seed" in values:
        out["seed"] = _int(*values["seed"], minimum=0)
    if "ignore_eos" in values:
        out["ignore_eos"] = _bool(*values["ignore_eos"])
    return SamplingParams(**out)


def _json_object(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise RequestError(f"{where} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise RequestError(f"{where} must be a JSON object")
    return value


def _int(value: Any, where: str, minimum: int) -> int:
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = None
    if number is None:
        raise RequestError(f"{where} must be an integer, got {value!r}")
    if number < minimum:
        raise RequestError(f"{where} must be >= {minimum}, got {number}")
    return number


def _float(value: Any, where: str, minimum: float) -> float:
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number):
        raise RequestError(f"{where} must be a number, got {value!r}")
    if number < minimum:
        raise RequestError(f"{where} must be >= {minimum}, got {number}")
    return number


def _bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise RequestError(f"{where} must be true or false, got {value!r}")


def request_tenant(parameters_json: str) -> str:
    """Whose request this is, for metering only: ``fair_rows``' one tenant (the frontend),
    else a ``tenant`` string parameter, else ``"unknown"``. Never an error: the model does
    not depend on these parameters, so a malformed one only loses the label."""
    try:
        params = json.loads(parameters_json or "{}")
        rows = json.loads(params[FAIR_ROWS_PARAM]) if FAIR_ROWS_PARAM in params else None
    except (ValueError, TypeError):
        return UNKNOWN_TENANT
    if isinstance(rows, dict):
        tenants = rows.get("tenant")
        if isinstance(tenants, list) and tenants and isinstance(tenants[0], str) and tenants[0]:
            return tenants[0]
    tenant = params.get(TENANT_PARAM) if isinstance(params, dict) else None
    return tenant if isinstance(tenant, str) and tenant else UNKNOWN_TENANT


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the engine."""

    max_model_len: int = DEFAULT_MAX_MODEL_LEN


def decode_request(
    inputs: Mapping[str, np.ndarray],
    parameters_json: str,
    encode: Callable[[str], list[int]],
    limits: Limits,
) -> LlmRequest:
    """One request from its input tensors and parameters; ``RequestError`` names the field."""
    raw = inputs.get(TEXT_INPUT)
    if raw is None or raw.size != 1:
        raise RequestError(f"input '{TEXT_INPUT}' is required: one string")
    prompt_value = raw.reshape(-1)[0]
    if isinstance(prompt_value, bytes):
        try:
            prompt = prompt_value.decode("utf-8")
        except UnicodeDecodeError as err:
            raise RequestError(f"input '{TEXT_INPUT}' is not valid UTF-8: {err}") from None
    else:
        prompt = str(prompt_value)
    stream = _flag(inputs, STREAM, default=False)
    # vLLM: exclude_input_in_output absent -> the prompt is prepended unless streaming;
    # streaming with exclude_input_in_output=false is refused.
    if EXCLUDE_INPUT_IN_OUTPUT in inputs:
        prepend_input = not _flag(inputs, EXCLUDE_INPUT_IN_OUTPUT, default=False)
    else:
        prepend_input = not stream
    if prepend_input and stream:
        raise RequestError(
            f"input '{EXCLUDE_INPUT_IN_OUTPUT}': when streaming, "
            f"`{EXCLUDE_INPUT_IN_OUTPUT}` = False is not allowed"
        )
    sampling_raw = inputs.get(SAMPLING_PARAMETERS)
    sampling_json = None
    if sampling_raw is not None:
        value = sampling_raw.reshape(-1)[0] if sampling_raw.size else b""
        try:
            sampling_json = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        except UnicodeDecodeError:
            raise RequestError(f"input '{SAMPLING_PARAMETERS}' is not valid UTF-8") from None
    sampling = decode_sampling_parameters(sampling_json, parameters_json)
    ids = encode(prompt)
    if not ids:
        raise RequestError(f"input '{TEXT_INPUT}' is empty; the prompt needs at least one token")
    if len(ids) >= limits.max_model_len:
        raise RequestError(
            f"input '{TEXT_INPUT}': the prompt has {len(ids)} tokens; this model's maximum "
            f"context length is {limits.max_model_len} tokens (prompt + max_tokens)"
        )
    if len(ids) + sampling.max_tokens > limits.max_model_len:
        raise RequestError(
            f"max_tokens: {sampling.max_tokens} new tokens after a {len(ids)}-token prompt "
            f"exceed this model's maximum context length of {limits.max_model_len} tokens; "
            f"at most {limits.max_model_len - len(ids)} for this prompt"
        )
    return LlmRequest(
        prompt=prompt,
        prompt_ids=tuple(ids),
        sampling=sampling,
        stream=stream,
        prepend_input=prepend_input,
        return_num_input_tokens=_flag(inputs, RETURN_NUM_INPUT_TOKENS, default=False),
        return_num_output_tokens=_flag(inputs, RETURN_NUM_OUTPUT_TOKENS, default=False),
        tenant=request_tenant(parameters_json),
    )


def _flag(inputs: Mapping[str, np.ndarray], name: str, default: bool) -> bool:
    value = inputs.get(name)
    if value is None:
        return default
    if value.size != 1:
        raise RequestError(f"input '{name}' must hold one boolean, got shape {value.shape}")
    return bool(value.reshape(-1)[0])


# ---- incremental detokenisation -------------------------------------------------------------


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence, never splitting a UTF-8 character.

    A byte-level token may hold part of a character; decoding it alone gives U+FFFD. Each
    ``push`` decodes the tokens since the last clean boundary (``prefix``: where the last
    delta's context starts; ``read``: where its text ended) and returns
    ``decode(prefix..new) - decode(prefix..read)``, or "" while the text so far ends in
    U+FFFD (a character may still be incomplete: the bytes are held back). ``flush`` returns
    whatever is held, U+FFFD included. Invariant: the concatenation of every delta and the
    flush equals ``decode(all tokens)``, so a stream's text equals the non-streamed text.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token: int) -> str:
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(before) :]
        return ""

    def flush(self) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(before) :]


# ---- what the engine sends ------------------------------------------------------------------


class ErrorCode(Enum):
    """Error kinds of an answer; the Triton shell maps them to ``pb_utils.TritonError``."""

    INVALID_ARG = "INVALID_ARG"
    CANCELLED = "CANCELLED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


@dataclass(frozen=True)
class Answer:
    """One response to a request: text (or an error), and whether it is the last."""

    text: str | None = None
    final: bool = False
    num_input_tokens: int | None = None  # only when the request asked for it
    num_output_tokens: int | None = None  # streaming: this response's tokens; else all
    error: str | None = None
    code: ErrorCode | None = None


class Sink(Protocol):
    """Where a sequence's answers go (Triton's response sender; a list in unit tests).

    ``send`` must not block the engine for long; ``is_cancelled`` is asked once per
    iteration per sequence and must be cheap.
    """

    def send(self, answer: Answer) -> None: ...

    def is_cancelled(self) -> bool: ...


class EngineObserver(Protocol):
    """What the engine reports (Triton metrics in the model; nothing in unit tests)."""

    def running(self, count: int) -> None:
        """The number of running sequences changed to ``count``."""

    def cancelled(self) -> None:
        """A sequence left because its client cancelled."""

    def finished(self, request: LlmRequest, generated: int) -> None:
        """A sequence completed all its tokens."""


class _NoObserver:
    def running(self, count: int) -> None:
        pass

    def cancelled(self) -> None:
        pass

    def finished(self, request: LlmRequest, generated: int) -> None:
        pass


# ---- the engine ----------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineConfig:
    """Capacity of one engine (``config.pbtxt`` parameters of the same names)."""

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    seed: int = nets.GENERATE_SEED  # the network's weights
    torch_threads: int = 1
    device: str = "cpu"

    @classmethod
    def from_model_config(
        cls, model_config: Mapping[str, Any], device: str = "cpu"
    ) -> EngineConfig:
        """Read the engine's parameters; one error lists every bad one."""
        raw = {
            key: value.get("string_value", "") if isinstance(value, Mapping) else str(value)
            for key, value in (model_config.get("parameters") or {}).items()
        }
        shared = ModelSettings.from_model_config(model_config)
        values: dict[str, int] = {}
        problems = []
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            if name not in raw:
                continue
            try:
                values[name] = int(raw[name])
            except ValueError:
                problems.append(f"{name}={raw[name]!r} is not an integer")
                continue
            if values[name] < 1:
                problems.append(f"{name}={values[name]} must be >= 1")
        max_model_len = values.get("max_model_len", DEFAULT_MAX_MODEL_LEN)
        if max_model_len > nets.MAX_POSITIONS:
            problems.append(f"max_model_len={max_model_len} exceeds {nets.MAX_POSITIONS}")
        if problems:
            raise ValueError("invalid model config parameters: " + "; ".join(problems))
        return cls(
            max_num_seqs=values.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS),
            max_model_len=max_model_len,
            max_num_batched_tokens=values.get(
                "max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS
            ),
            seed=nets.GENERATE_SEED if shared.seed is None else shared.seed,
            torch_threads=shared.torch_threads,
            device=device,
        )

    @property
    def limits(self) -> Limits:
        return Limits(max_model_len=self.max_model_len)


@dataclass
class _Sequence:
    """One request inside the engine: its tokens so far and where its answers go."""

    request: LlmRequest
    sink: Sink
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    generated: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # non-streaming: deltas collected

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.request.sampling.max_tokens

    @property
    def position(self) -> int:
        """Where the last generated token goes in the cache (fed by the next step)."""
        return len(self.request.prompt_ids) + len(self.generated) - 1


_STOP = object()


class Engine:
    """Continuous batching over one ``CausalDecoder`` (see the module docstring).

    Thread model: ``submit`` and ``stop`` from any thread; ``step`` (or ``run``, which
    loops over it) from one engine thread only. Unit tests call ``step`` directly.
    """

    def __init__(
        self,
        config: EngineConfig,
        decode: Callable[[list[int]], str],
        vocab: int,
        observer: EngineObserver | None = None,
        net: nets.CausalDecoder | None = None,
    ) -> None:
        self.config = config
        self._decode = decode
        self.device = torch.device(config.device)
        self.net = (net or nets.build_decoder(config.seed)).to(self.device)
        self._vocab = min(vocab, self.net.vocab)  # tokens the tokenizer can decode
        self._observer: EngineObserver = observer or _NoObserver()
        blocks = self.net._blocks()
        shape = (
            2,
            config.max_num_seqs,
            blocks[0].attn.n_heads,
            config.max_model_len,
            blocks[0].attn.d_head,
        )
        self._cache = [torch.zeros(shape, device=self.device) for _ in blocks]
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # running[i] owns cache slot i
        self._stopping = False
        self._entropy = random.Random()  # seeds of requests that send none (like vLLM)
        self.steps = 0  # iterations that ran the network

    # -- any thread

    def submit(self, request: LlmRequest, sink: Sink) -> None:
        """Queue a request; it joins the running batch at the next iteration."""
        self._inbox.put((request, sink))

    def stop(self) -> None:
        """Finish what was submitted, then let ``run`` return."""
        self._inbox.put(_STOP)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        """Whether anything is submitted, waiting or running."""
        return bool(self._running or self._waiting or not self._inbox.empty())

    # -- engine thread

    def run(self) -> None:
        """Iterate while there is work; block on the inbox when there is none."""
        torch.set_num_threads(self.config.torch_threads)
        while True:
            if not self._running and not self._waiting:
                if self._stopping:
                    return
                self._take(self._inbox.get())  # idle: wait for work
            self.step()

    def step(self) -> None:
        """One iteration: take, retire cancelled, admit + prefill, decode, retire, send.

        Answers go out last, after the observer has seen this iteration's retirements: a
        client that got its final response reads metrics that already count it out.
        """
        while True:
            try:
                self._take(self._inbox.get_nowait())
            except queue.Empty:
                break
        before = len(self._running)
        self._retire_cancelled()
        decoding = list(self._running)  # sequences that already have a token to feed
        answers: list[tuple[_Sequence, Answer]] = []
        try:
            with torch.inference_mode():
                admitted = self._admit(answers)
                if decoding:
                    self._decode_step(len(decoding), answers)
        except Exception:  # a bug or out of memory: fail these sequences, keep the engine
            message = f"llm engine step failed: {traceback.format_exc(limit=3)}"
            for seq in self._running:
                seq.sink.send(Answer(error=message, code=ErrorCode.INTERNAL, final=True))
            self._running.clear()
            self._observer.running(0)
            return
        if admitted or decoding:
            self.steps += 1
        self._retire_finished()
        if len(self._running) != before:
            self._observer.running(len(self._running))
        for seq, answer in answers:
            seq.sink.send(answer)

    def _take(self, item: Any) -> None:
        if item is _STOP:
            self._stopping = True
            return
        request, sink = item
        generator = None
        if not request.sampling.greedy:
            generator = torch.Generator(device=self.device)
            seed = request.sampling.seed
            generator.manual_seed(seed if seed is not None else self._entropy.getrandbits(63))
        self._waiting.append(
            _Sequence(request, sink, generator, IncrementalDetokenizer(self._decode))
        )

    def _retire_cancelled(self) -> None:
        for seq in [s for s in self._waiting if s.sink.is_cancelled()]:
            self._waiting.remove(seq)
            self._answer_cancelled(seq)
        for i in reversed(range(len(self._running))):
            seq = self._running[i]
            if seq.sink.is_cancelled():
                self._free(i)
                self._answer_cancelled(seq)

    def _answer_cancelled(self, seq: _Sequence) -> None:
        """vLLM: streaming gets a final CANCELLED error; non-streaming its text so far."""
        self._observer.cancelled()
        if seq.request.stream:
            seq.sink.send(
                Answer(error="Request was cancelled", code=ErrorCode.CANCELLED, final=True)
            )
        else:
            seq.sink.send(self._whole(seq))

    def _admit(self, answers: list[tuple[_Sequence, Answer]]) -> bool:
        """Prefill waiting sequences into free slots; each gets its first token."""
        budget = self.config.max_num_batched_tokens
        batch: list[_Sequence] = []
        while self._waiting and len(self._running) + len(batch) < self.config.max_num_seqs:
            n = len(self._waiting[0].request.prompt_ids)
            if batch and n > budget:
                break
            budget -= n
            batch.append(self._waiting.popleft())
        if not batch:
            return False
        lengths = [len(s.request.prompt_ids) for s in batch]
        width = max(lengths)
        ids = torch.zeros((len(batch), width), dtype=torch.int64)
        for row, seq in enumerate(batch):
            ids[row, : lengths[row]] = torch.tensor(seq.request.prompt_ids, dtype=torch.int64)
        lengths_t = torch.tensor(lengths, dtype=torch.int64, device=self.device)
        logits, cache = self.net.prefill(ids.to(self.device), lengths_t, width=width)
        first = len(self._running)
        for slots, kv in zip(self._cache, cache, strict=True):
            slots[:, first : first + len(batch), :, :width] = kv
        self._running.extend(batch)
        self._emit(batch, logits, answers)
        return True

    def _decode_step(self, count: int, answers: list[tuple[_Sequence, Answer]]) -> None:
        """ONE forward pass for the first ``count`` running sequences."""
        seqs = self._running[:count]
        tokens = torch.tensor(
            [s.generated[-1] for s in seqs], dtype=torch.int64, device=self.device
        )
        pos = torch.tensor([s.position for s in seqs], dtype=torch.int64, device=self.device)
        logits = self.net.step(tokens, pos, [kv[:, :count] for kv in self._cache])
        self._emit(seqs, logits, answers)

    def _emit(
        self, seqs: Sequence[_Sequence], logits: Tensor, answers: list[tuple[_Sequence, Answer]]
    ) -> None:
        """Choose each sequence's next token; queue its answer (a delta, or the whole text)."""
        tokens = choose_tokens(
            logits[:, : self._vocab],
            [s.request.sampling for s in seqs],
            [s.generator for s in seqs],
        )
        for seq, token in zip(seqs, tokens, strict=True):
            seq.generated.append(token)
            delta = seq.detokenizer.push(token)
            if seq.done:
                delta += seq.detokenizer.flush()
            if seq.request.stream:
                answers.append((seq, self._delta(seq, delta)))
            else:
                seq.text.append(delta)
                if seq.done:
                    answers.append((seq, self._whole(seq)))

    def _delta(self, seq: _Sequence, delta: str) -> Answer:
        r = seq.request
        return Answer(
            text=delta,
            final=seq.done,
            num_input_tokens=len(r.prompt_ids) if r.return_num_input_tokens else None,
            num_output_tokens=1 if r.return_num_output_tokens else None,
        )

    def _whole(self, seq: _Sequence) -> Answer:
        r = seq.request
        text = "".join(seq.text)
        return Answer(
            text=r.prompt + text if r.prepend_input else text,
            final=True,
            num_input_tokens=len(r.prompt_ids) if r.return_num_input_tokens else None,
            num_output_tokens=len(seq.generated) if r.return_num_output_tokens else None,
        )

    def _retire_finished(self) -> None:
        for i in reversed(range(len(self._running))):
            seq = self._running[i]
            if seq.done:
                self._free(i)
                self._observer.finished(seq.request, len(seq.generated))

    def _free(self, i: int) -> None:
        """Remove running[i]; the last sequence moves into its slot (slots stay compact)."""
        last = len(self._running) - 1
        if i != last:
            for kv in self._cache:
                kv[:, i] = kv[:, last]
            self._running[i] = self._running[last]
        self._running.pop()


def choose_tokens(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """The next token of each row: argmax for greedy rows; for the others temperature,
    top-k, top-p (nucleus), then one draw from the row's own generator."""
    tokens: list[int] = logits.argmax(dim=-1).tolist()  # ties: the lowest id
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    rows = logits[sampled].float()
    temperature = torch.tensor([params[i].temperature for i in sampled], device=rows.device)
    rows = rows / temperature.unsqueeze(1)
    for j, i in enumerate(sampled):
        k = params[i].top_k
        if 0 < k < rows.shape[1]:
            kth = torch.topk(rows[j], k).values[-1]
            rows[j] = rows[j].masked_fill(rows[j] < kth, float("-inf"))
    probs = torch.softmax(rows, dim=-1)
    top_p = torch.tensor([params[i].top_p for i in sampled], device=rows.device)
    if bool((top_p < 1.0).any()):
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(dim=-1) - ordered  # mass of the more likely tokens
        ordered = ordered.masked_fill(before > top_p.unsqueeze(1), 0.0)  # keeps the top one
        probs = torch.zeros_like(probs).scatter(1, order, ordered)
    for j, i in enumerate(sampled):
        tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]))
    return tokens


# ---- Triton shell -----------------------------------------------------------------------------


class _ResponseThread:
    """Sends responses off the engine thread, in order (vLLM's ``_response_loop``).

    After each non-final send of a streaming request it asks the sender whether the client
    cancelled and keeps the answer on the sink, which the engine reads at its next
    iteration (an IPC round trip per send, here, instead of one per sequence per step in
    the engine).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="llm-responses", daemon=True)
        self._thread.start()

    def put(self, job: Callable[[], None]) -> None:
        self._queue.put(job)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # one failed send must not stop the others
                traceback.print_exc()


class TritonSink:
    """A sequence's ``Sink`` over Triton's response sender (``pb`` is pb_utils)."""

    def __init__(self, shell: LlmContract, request: Any, decoded: LlmRequest) -> None:
        self._shell = shell
        self._sender = request.get_response_sender()
        self._stream = decoded.stream
        self._cancelled = False

    def send(self, answer: Answer) -> None:
        self._shell.responses.put(lambda: self._send_now(answer))

    def _send_now(self, answer: Answer) -> None:
        pb = self._shell.pb
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if answer.final else 0
        self._sender.send(self._shell.response(answer), flags=flags)
        if not answer.final:
            self._cancelled = self._sender.is_cancelled()

    def is_cancelled(self) -> bool:
        if self._stream:
            return self._cancelled  # refreshed after every send (response thread)
        return bool(self._sender.is_cancelled())  # nothing is sent until the end


class _TritonObserver:
    """Engine events as Triton metrics, plus per-tenant metering (``TenantMeters``)."""

    def __init__(self, shell: LlmContract, model: str) -> None:
        pb = shell.pb
        self._shell = shell
        labels = {"model": model}
        self._running_family = pb.MetricFamily(
            name="fair_llm_running_sequences",
            description="Sequences in the llm engine's running batch",
            kind=pb.MetricFamily.GAUGE,
        )
        self._cancelled_family = pb.MetricFamily(
            name="fair_llm_cancelled_total",
            description="Sequences that left the llm engine because their client cancelled",
            kind=pb.MetricFamily.COUNTER,
        )
        self.running_gauge = self._running_family.Metric(labels=labels)
        self.cancelled_counter = self._cancelled_family.Metric(labels=labels)

    def running(self, count: int) -> None:
        self.running_gauge.set(float(count))

    def cancelled(self) -> None:
        self.cancelled_counter.increment(1.0)

    def finished(self, request: LlmRequest, generated: int) -> None:
        tokens = len(request.prompt_ids) + generated
        self._shell.responses.put(lambda: self._shell.meters.record([(request.tenant, tokens)]))

    def close(self) -> None:
        self.running_gauge = self.cancelled_counter = None
        self._running_family = self._cancelled_family = None


class LlmContract:
    """Base of ``model_repository/llm/1/model.py``'s ``TritonPythonModel`` (decoupled).

    ``execute`` decodes each request, answers a bad one at once with its error (final), and
    hands the others to the engine thread; it returns None without waiting, as a decoupled
    model does. ``finalize`` lets the engine finish what it has, then stops its threads.
    """

    pb: ClassVar[Any]  # triton_python_backend_utils

    def initialize(self, args: dict[str, str]) -> None:
        pb = self.pb
        model_config = json.loads(args["model_config"])
        if not pb.using_decoupled_model_transaction_policy(model_config):
            raise ValueError(
                "llm must be configured with model_transaction_policy { decoupled: true }"
            )
        device = "cpu"
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args.get('model_instance_device_id', '0')}"
        self.config = EngineConfig.from_model_config(model_config, device=device)
        params = model_config.get("parameters") or {}
        name = (params.get("tokenizer") or {}).get("string_value") or TOKENIZER_FILE
        path = Path(args["model_repository"]) / name
        self.tokenizer = tokenizers_.load(path)
        torch.set_num_threads(self.config.torch_threads)
        settings = ModelSettings.from_model_config(model_config)
        self.meters = TenantMeters(pb, args["model_name"], settings.max_metric_tenants)
        self.responses = _ResponseThread()
        self.observer = _TritonObserver(self, args["model_name"])
        self.engine = Engine(
            self.config,
            decode=self.tokenizer.decode,
            vocab=self.tokenizer.get_vocab_size(),
            observer=self.observer,
        )
        self.limits = self.config.limits
        self.thread = threading.Thread(target=self.engine.run, name="llm-engine", daemon=True)
        self.thread.start()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def execute(self, requests: list[Any]) -> None:
        pb = self.pb
        for request in requests:
            try:
                inputs = {}
                for name in INPUTS:
                    tensor = pb.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        inputs[name] = tensor.as_numpy()
                decoded = decode_request(inputs, request.parameters(), self.encode, self.limits)
            except RequestError as err:
                self._refuse(request, str(err), pb.TritonError.INVALID_ARG)
                continue
            except Exception as err:  # a bug: still only this request
                self._refuse(request, f"cannot read request: {err!r}", pb.TritonError.INTERNAL)
                continue
            self.engine.submit(decoded, TritonSink(self, request, decoded))
        return None

    def _refuse(self, request: Any, message: str, code: Any) -> None:
        response = self.pb.InferenceResponse(error=self.pb.TritonError(message, code))
        request.get_response_sender().send(
            response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )

    def response(self, answer: Answer) -> Any:
        """A ``pb_utils.InferenceResponse`` for an engine answer."""
        pb = self.pb
        if answer.error is not None:
            code = getattr(pb.TritonError, (answer.code or ErrorCode.INTERNAL).value)
            return pb.InferenceResponse(error=pb.TritonError(answer.error, code))
        tensors = [
            pb.Tensor(TEXT_OUTPUT, np.array([(answer.text or "").encode()], dtype=np.object_))
        ]
        if answer.num_input_tokens is not None:
            tensors.append(
                pb.Tensor(NUM_INPUT_TOKENS, np.array([answer.num_input_tokens], dtype=np.uint32))
            )
        if answer.num_output_tokens is not None:
            tensors.append(
                pb.Tensor(NUM_OUTPUT_TOKENS, np.array([answer.num_output_tokens], dtype=np.uint32))
            )
        return pb.InferenceResponse(output_tensors=tensors)

    def finalize(self) -> None:
        self.engine.stop()
        self.thread.join()
        self.responses.close()  # every answer sent
        self.observer.close()
        self.meters.close()


# ---- step times --------------------------------------------------------------------------


def measure_step_times(
    counts: Sequence[int], prompt_tokens: int = 32, steps: int = 50, threads: int = 1
) -> dict[int, float]:
    """Median seconds of one decode step with ``n`` running sequences, for each ``n``.

    Each sequence has a ``prompt_tokens``-token prompt and runs ``steps`` steps, so the
    attention reads ``prompt_tokens`` to ``prompt_tokens + steps`` cached positions.
    """

    class Discard:
        def send(self, answer: Answer) -> None:
            pass

        def is_cancelled(self) -> bool:
            return False

    torch.set_num_threads(threads)
    results = {}
    net = nets.build_decoder()
    for n in counts:
        engine = Engine(EngineConfig(max_num_seqs=max(counts)), lambda ids: "", 3000, net=net)
        request = LlmRequest(
            prompt="",
            prompt_ids=tuple(range(1, prompt_tokens + 1)),
            sampling=SamplingParams(max_tokens=steps + 2, temperature=0.0),
            stream=True,
            prepend_input=False,
        )
        for _ in range(n):
            engine.submit(request, Discard())
        engine.step()  # prefill
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        results[n] = float(np.median(times))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="llm engine: median decode step time")
    parser.add_argument("--sequences", default="1,16,64", help="running sequences, comma list")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.sequences.split(",")]
    for n, seconds in measure_step_times(counts, threads=args.threads).items():
        print(f"{n:4d} sequences: {seconds * 1e3:6.2f} ms per step")


if __name__ == "__main__":
    main()
