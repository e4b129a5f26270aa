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
  response follows); with the config parameter ``stream_interval`` N (vLLM's
  ``--stream-interval``), a response carries up to N tokens: the first token goes at once,
  then every N tokens, and the last with whatever is left (``num_output_tokens``: the
  tokens of that response); non-streaming sends one final response with the whole text, the prompt
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
import logging
import math
import queue
import random
import re
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
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

log = logging.getLogger(__name__)

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
RANDOM_SEED = -1  # vLLM: seed -1 is no seed (a random one)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# ---- engine capacity: config.pbtxt parameters ----------------------------------------------

DEFAULT_MAX_NUM_SEQS = 64  # running sequences (vLLM's max_num_seqs; slots in the KV cache)
# Prompt + generated tokens per sequence (vLLM's max_model_len). Bounds the KV cache:
# 2 layers x K,V x 64 slots x 512 positions x 128 floats = 64 MiB.
DEFAULT_MAX_MODEL_LEN = 512
# Prompt tokens prefilled in one iteration (vLLM's max_num_batched_tokens): a burst of long
# prompts is admitted over several iterations, so running sequences keep getting tokens.
# One request is always admitted, whatever its length, when nothing else is.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_STREAM_INTERVAL = 1  # tokens per streamed response (vLLM's stream_interval)
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

    Ranges are vLLM's (``SamplingParams._verify_args``, and its OpenAI server's bound on
    ``seed``: a signed 64-bit integer), in its words, so that nothing a request sends can
    reach the engine thread as a value it cannot take (``torch.Generator.manual_seed``
    raises on a seed beyond 64 bits): ``max_tokens >= 1``; ``temperature`` finite and
    ``>= 0``; ``top_p`` in (0, 1]; ``top_k`` -1 or 0 (off) or ``>= 1``; ``seed`` within
    [-2^63, 2^63), -1 meaning none (vLLM's); every integer within 64 bits. The frontend
    checks the same rules at its door (``fair_frontend.sampling``) for endpoints that say
    ``sampling_rules: vllm``; this is the same check for a client that calls Triton directly.
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
    except (ValueError, RecursionError):
        params = {}  # Triton builds this string itself; never expected
    if not isinstance(params, dict):
        params = {}
    values: dict[str, tuple[Any, str]] = {}  # key -> (value, where it came from)
    for key in SAMPLING_KEYS:
        if sampled.get(key) is not None:  # vLLM drops None values: the default applies
            values[key] = (sampled[key], f"input '{SAMPLING_PARAMETERS}'")
        elif params.get(key) is not None:
            values[key] = (params[key], f"parameter '{key}'")
    out: dict[str, Any] = {}
    if "max_tokens" in values:
        max_tokens = _int("max_tokens", *values["max_tokens"])
        _require(max_tokens >= 1, "max_tokens", values, f"must be at least 1, got {max_tokens}.")
        out["max_tokens"] = max_tokens
    if "temperature" in values:
        temperature = _float("temperature", *values["temperature"])
        _require(
            temperature >= 0.0, "temperature", values, f"must be non-negative, got {temperature}."
        )
        out["temperature"] = temperature
    if "top_p" in values:
        top_p = _float("top_p", *values["top_p"])
        _require(0.0 < top_p <= 1.0, "top_p", values, f"must be in (0, 1], got {top_p}.")
        out["top_p"] = top_p
    if "top_k" in values:
        top_k = _int("top_k", *values["top_k"])
        _require(top_k >= -1, "top_k", values, f"must be 0 (disable), or at least 1, got {top_k}.")
        out["top_k"] = 0 if top_k == -1 else top_k  # vLLM quietly takes -1 for 0
    if "seed" in values:
        seed = _int("seed", *values["seed"])
        out["seed"] = None if seed == RANDOM_SEED else seed
    if "ignore_eos" in values:
        out["ignore_eos"] = _bool("ignore_eos", *values["ignore_eos"])
    return SamplingParams(**out)


def _require(ok: bool, key: str, values: Mapping[str, tuple[Any, str]], rule: str) -> None:
    if not ok:
        raise RequestError(f"{values[key][1]}: {key} {rule}")


def _json_object(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise RequestError(f"{where} is not valid JSON: {err}") from None
    except RecursionError:
        raise RequestError(f"{where} is not valid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise RequestError(f"{where} must be a JSON object")
    return value


_INTEGER = re.compile(r"[+-]?[0-9]+")


def _int(key: str, value: Any, where: str) -> int:
    """An integer as vLLM's backend reads one (``int(value)``), strictly: an integer, a
    float with no fraction, or a string of decimal digits; within 64 bits."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        try:
            number = int(value.strip())
        except ValueError:  # more digits than Python converts
            number = None
    if number is None:
        raise RequestError(f"{where}: {key} must be an integer, got {_shown(value)}")
    if not INT64_MIN <= number <= INT64_MAX:
        raise RequestError(
            f"{where}: {key} must be an integer in [{INT64_MIN}, {INT64_MAX}] (64 bits), "
            f"got {_shown(number)}."
        )
    return number


def _float(key: str, value: Any, where: str) -> float:
    """A number as vLLM's backend reads one (``float(value)``), strictly: a number or a
    numeric string; finite."""
    number: float | None = None
    try:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            number = float(value.strip())
    except (ValueError, OverflowError):
        number = None
    if number is None:
        raise RequestError(f"{where}: {key} must be a number, got {_shown(value)}")
    if not math.isfinite(number):
        raise RequestError(f"{where}: {key} must be a finite number, got {_shown(value)}.")
    return number


def _bool(key: str, value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise RequestError(f"{where}: {key} must be true or false, got {_shown(value)}")


def _shown(value: Any, limit: int = 64) -> str:
    """A value for an error message, cut short: a client's value may be megabytes."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more digits than Python prints
        return "an integer of more than 4300 digits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


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
    # The most bytes of text one token stands for (``max_token_bytes``): a prompt of ``n``
    # bytes has at least ``n / max_token_bytes`` tokens, known before tokenising it.
    # None: no bound from the length in bytes (every prompt is tokenised).
    max_token_bytes: int | None = None


def max_token_bytes(tokenizer: Any) -> int:
    """The most bytes any one token of a byte-level BPE tokenizer decodes to.

    Its vocabulary's strings are written in GPT-2's byte alphabet, one character per byte
    (``tokenizers.pre_tokenizers.ByteLevel``), so a token's length is its byte count.
    """
    return max(len(token) for token in tokenizer.get_vocab())


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
    _check_prompt_bytes(prompt_value, limits)
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


def _check_prompt_bytes(prompt: Any, limits: Limits) -> None:
    """Refuse, before tokenising it, a prompt whose length in bytes already proves it too
    long: ``n`` bytes are at least ``ceil(n / max_token_bytes)`` tokens, and the context
    must hold the prompt and one generated token. Tokenising megabytes would hold up
    ``execute`` (every other request to the model waits for it) for nothing."""
    if limits.max_token_bytes is None:
        return
    size = len(prompt) if isinstance(prompt, bytes) else len(str(prompt).encode())
    fewest = -(-size // limits.max_token_bytes)
    if fewest >= limits.max_model_len:
        raise RequestError(
            f"input '{TEXT_INPUT}': the prompt has {size} bytes, so at least {fewest} tokens; "
            f"this model's maximum context length is {limits.max_model_len} tokens "
            "(prompt + max_tokens)"
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
    stream_interval: int = DEFAULT_STREAM_INTERVAL
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
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "stream_interval"):
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
            stream_interval=values.get("stream_interval", DEFAULT_STREAM_INTERVAL),
            seed=nets.GENERATE_SEED if shared.seed is None else shared.seed,
            torch_threads=shared.torch_threads,
            device=device,
        )

    @property
    def limits(self) -> Limits:
        return Limits(max_model_len=self.max_model_len)


@dataclass(eq=False)
class _Sequence:
    """One request inside the engine: its tokens so far and where its answers go."""

    request: LlmRequest
    sink: Sink
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    generated: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # deltas not yet sent (all, non-streaming)
    answered: bool = False  # its final answer went out: nothing more is ever sent
    failed: bool = False  # failed in this iteration: it leaves the batch

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.request.sampling.max_tokens

    @property
    def position(self) -> int:
        """Where the last generated token goes in the cache (fed by the next step)."""
        return len(self.request.prompt_ids) + len(self.generated) - 1

    def send(self, answer: Answer) -> None:
        """The one way a sequence's answers leave: in order, none after the final one."""
        if self.answered:
            return
        self.answered = answer.final
        self.sink.send(answer)


_STOP = object()
# What a request held by an engine that died (or sent while it restarts) is answered:
# UNAVAILABLE, the client may retry; "is not ready" is Triton's own wording for a model
# that cannot serve now, which the frontend reads as UNAVAILABLE for this request alone
# (fair_frontend.backends.triton.forwarder: a stream's error carries no code, only its message).
ENGINE_DIED = "llm engine is not ready: it failed and is restarting; this request was aborted"
ENGINE_RESTARTING = "llm engine is not ready: it is restarting after a failure; retry the request"


class Engine:
    """Continuous batching over one ``CausalDecoder`` (see the module docstring).

    Thread model: ``submit`` and ``stop`` from any thread; ``step`` (or ``run``, which
    loops over it) from one engine thread only; ``abort`` once that thread is gone. Unit
    tests call ``step`` directly.

    Failures are blamed where they can be (nothing a request sends may stop the engine,
    and no traceback reaches a client; each is logged here with its traceback):

    - per-sequence work (seeding its generator, sampling its token, detokenising) that
      raises fails that sequence alone;
    - a batched forward pass (prefill or decode) that raises is retried in halves, each
      on its own (the frontend's bisection of failed batches,
      ``fair_frontend.core.dispatch``): a half that succeeds is done, one that fails is
      split again, and only a sequence that fails alone is failed. A decode step over
      slots ``lo..hi`` is one view of the cache, so a half costs no copy; a failure that
      is no one's (every sequence fails alone) fails them all, after ``2n - 1`` passes;
    - anything else that raises inside the forward passes fails the sequences of the
      iteration with a short message; what escapes ``step`` ends ``run``, for the
      supervisor (``EngineSupervisor``) to answer what was held and restart it.
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
        self._admitting: list[_Sequence] = []  # left waiting, not yet running (prefill)
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
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._take(item)
        before = len(self._running)
        self._retire_cancelled()
        decoding = len(self._running)  # sequences that already have a token to feed
        answers: list[tuple[_Sequence, Answer]] = []
        admitted = False
        try:
            with torch.inference_mode():
                admitted = self._admit(answers)
                if decoding:
                    self._decode_slots(0, decoding, answers)
        except Exception as err:  # a bug, blamed on no one: fail this iteration's sequences
            log.error("llm engine step failed", exc_info=err)
            message = f"llm engine step failed ({type(err).__name__}); this request was aborted"
            for seq in [*self._running, *self._admitting]:
                if not seq.failed:
                    self._fail(seq, answers, message)
            self._admitting = []
        if admitted or decoding:
            self.steps += 1
        self._retire()
        if len(self._running) != before:
            self._observer.running(len(self._running))
        for seq, answer in answers:
            seq.send(answer)

    def abort(self, answer: Answer) -> int:
        """Answer every sequence taken and not yet answered with ``answer`` (final) and
        forget them (the supervisor, once the engine thread died: its state is not to be
        trusted). What is still in the inbox stays there, for the next ``run``. Returns
        how many were answered."""
        held = [*self._running, *self._admitting, *self._waiting]
        self._running, self._admitting = [], []
        self._waiting.clear()
        aborted = 0
        for seq in held:
            if not seq.answered:
                seq.send(answer)
                aborted += 1
        self._observer.running(0)
        return aborted

    def _take(self, item: Any) -> None:
        if item is _STOP:
            self._stopping = True
            return
        request, sink = item
        seq = _Sequence(request, sink, None, IncrementalDetokenizer(self._decode))
        if not request.sampling.greedy:
            try:
                generator = torch.Generator(device=self.device)
                seed = request.sampling.seed
                generator.manual_seed(seed if seed is not None else self._entropy.getrandbits(63))
            except Exception as err:  # decode_request bounds the seed: never expected
                log.error("llm engine: cannot seed a request's generator", exc_info=err)
                seq.send(_failure(f"cannot seed this request's sampler ({type(err).__name__})"))
                return
            seq.generator = generator
        self._waiting.append(seq)

    def _retire_cancelled(self) -> None:
        for seq in [s for s in self._waiting if _cancelled(s)]:
            self._waiting.remove(seq)
            self._answer_cancelled(seq)
        for i in reversed(range(len(self._running))):
            seq = self._running[i]
            if _cancelled(seq):
                self._free(i)
                self._answer_cancelled(seq)

    def _answer_cancelled(self, seq: _Sequence) -> None:
        """vLLM: streaming gets a final CANCELLED error; non-streaming its text so far."""
        self._observer.cancelled()
        if seq.request.stream:
            seq.send(Answer(error="Request was cancelled", code=ErrorCode.CANCELLED, final=True))
        else:
            seq.send(self._whole(seq))

    def _admit(self, answers: list[tuple[_Sequence, Answer]]) -> bool:
        """Prefill waiting sequences into free slots; each gets its first token."""
        budget = self.config.max_num_batched_tokens
        batch = self._admitting = []
        while self._waiting and len(self._running) + len(batch) < self.config.max_num_seqs:
            n = len(self._waiting[0].request.prompt_ids)
            if batch and n > budget:
                break
            budget -= n
            batch.append(self._waiting.popleft())
        if not batch:
            return False
        self._prefill(batch, answers)
        self._admitting = []
        return True

    def _prefill(self, batch: list[_Sequence], answers: list[tuple[_Sequence, Answer]]) -> None:
        """One prefill of ``batch`` into the next free slots; a failed one in halves."""
        try:
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
        except Exception as err:
            if len(batch) == 1:
                log.error("llm engine: prefill failed for one request", exc_info=err)
                self._fail(batch[0], answers, f"prefill failed for this request ({_kind(err)})")
                return
            for half in _halves(batch):
                self._prefill(half, answers)
            return
        self._running.extend(batch)
        self._emit(batch, logits, answers)

    def _decode_slots(self, lo: int, hi: int, answers: list[tuple[_Sequence, Answer]]) -> None:
        """ONE forward pass for running slots ``lo..hi-1``; a failed one in halves."""
        seqs = self._running[lo:hi]
        try:
            tokens = torch.tensor(
                [s.generated[-1] for s in seqs], dtype=torch.int64, device=self.device
            )
            pos = torch.tensor([s.position for s in seqs], dtype=torch.int64, device=self.device)
            logits = self.net.step(tokens, pos, [kv[:, lo:hi] for kv in self._cache])
        except Exception as err:
            if hi - lo == 1:
                log.error("llm engine: decode step failed for one request", exc_info=err)
                self._fail(seqs[0], answers, f"decode step failed for this request ({_kind(err)})")
                return
            middle = lo + (hi - lo + 1) // 2
            self._decode_slots(lo, middle, answers)
            self._decode_slots(middle, hi, answers)
            return
        self._emit(seqs, logits, answers)

    def _emit(
        self, seqs: Sequence[_Sequence], logits: Tensor, answers: list[tuple[_Sequence, Answer]]
    ) -> None:
        """Choose each sequence's next token; queue its answer (a delta, or the whole text).

        Sampling is batched; if the batch raises, each row is sampled alone, so that only
        the rows that raise alone fail."""
        logits = logits[:, : self._vocab]
        params = [s.request.sampling for s in seqs]
        generators = [s.generator for s in seqs]
        tokens: list[int | Exception]
        try:
            tokens = list(choose_tokens(logits, params, generators))
        except Exception as err:
            log.warning("llm engine: batched sampling failed; sampling row by row", exc_info=err)
            tokens = []
            for row in range(len(seqs)):
                try:
                    tokens.extend(
                        choose_tokens(logits[row : row + 1], [params[row]], [generators[row]])
                    )
                except Exception as row_err:
                    tokens.append(row_err)
        for seq, token in zip(seqs, tokens, strict=True):
            if isinstance(token, Exception):
                log.error("llm engine: sampling failed for one request", exc_info=token)
                self._fail(
                    seq, answers, f"cannot sample this request's next token ({_kind(token)})"
                )
                continue
            try:
                seq.generated.append(token)
                delta = seq.detokenizer.push(token)
                if seq.done:
                    delta += seq.detokenizer.flush()
            except Exception as err:
                log.error("llm engine: detokenising failed for one request", exc_info=err)
                self._fail(seq, answers, f"cannot detokenise this request's text ({_kind(err)})")
                continue
            seq.text.append(delta)
            if seq.request.stream:
                # The first token at once, then every stream_interval tokens, and the last.
                held = len(seq.text)
                if held >= self.config.stream_interval or seq.done or len(seq.generated) == 1:
                    answers.append((seq, self._delta(seq, "".join(seq.text), held)))
                    seq.text.clear()
            elif seq.done:
                answers.append((seq, self._whole(seq)))

    def _fail(self, seq: _Sequence, answers: list[tuple[_Sequence, Answer]], what: str) -> None:
        """``seq`` failed in this iteration: answered with a short error (last, with the
        others' answers) and out of the batch at the retirement."""
        seq.failed = True
        answers.append((seq, _failure(what)))

    def _delta(self, seq: _Sequence, delta: str, tokens: int) -> Answer:
        r = seq.request
        return Answer(
            text=delta,
            final=seq.done,
            num_input_tokens=len(r.prompt_ids) if r.return_num_input_tokens else None,
            num_output_tokens=tokens if r.return_num_output_tokens else None,
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

    def _retire(self) -> None:
        """Failed and finished sequences leave the batch (their slots are freed)."""
        for i in reversed(range(len(self._running))):
            seq = self._running[i]
            if seq.failed:
                self._free(i)
            elif seq.done:
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


def _failure(what: str) -> Answer:
    """A sequence's own failure: short (its traceback is in the model's log only)."""
    return Answer(error=f"llm engine: {what}", code=ErrorCode.INTERNAL, final=True)


def _kind(err: BaseException) -> str:
    return type(err).__name__


def _cancelled(seq: _Sequence) -> bool:
    """Whether the client went away; a sender that cannot tell has lost its client too."""
    try:
        return bool(seq.sink.is_cancelled())
    except Exception as err:
        log.error("llm engine: a request's cancellation check failed", exc_info=err)
        return True


def _halves(batch: list[_Sequence]) -> list[list[_Sequence]]:
    """The two halves of a batch, in order (the first one the larger)."""
    middle = (len(batch) + 1) // 2
    return [batch[:middle], batch[middle:]]


class EngineSupervisor:
    """Keeps the engine's thread alive: if it dies (anything escaping ``Engine.run``), each
    sequence it held gets one final UNAVAILABLE answer (``ENGINE_DIED``), and a new thread
    runs the same engine, after a pause that doubles while it keeps dying soon after each
    start (``backoff_s``, up to ``max_backoff_s``).

    ``ready`` is False from the death to the restart: the model then answers new requests
    UNAVAILABLE at once (``ENGINE_RESTARTING``) instead of queueing them for a thread that
    is not there. (Triton 2.51's Python backend gives a model no say in its readiness:
    ``pb_utils`` can only unload a model, in explicit model-control mode, for good; later
    Triton versions ask ``is_model_ready``, which the model answers with ``ready``.)
    """

    STABLE_S = 10.0  # a thread that ran this long before dying starts the backoff over

    def __init__(
        self,
        engine: Engine,
        *,
        on_restart: Callable[[], None] = lambda: None,
        backoff_s: float = 0.05,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.engine = engine
        self.restarts = 0
        self._on_restart = on_restart
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="llm-supervisor", daemon=True)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def start(self) -> None:
        self._ready.set()
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine to stop (after ``Engine.stop``)."""
        self._thread.join(timeout)

    def _supervise(self) -> None:
        quick_deaths = 0
        while True:
            died: list[BaseException] = []
            started = time.monotonic()
            worker = threading.Thread(
                target=self._run, args=(died,), name="llm-engine", daemon=True
            )
            worker.start()
            worker.join()
            if not died:
                return  # stopped
            self._ready.clear()
            log.error("llm engine thread died; restarting it", exc_info=died[0])
            self.restarts += 1
            try:
                self._on_restart()
            except Exception as err:
                log.error("llm engine: counting a restart failed", exc_info=err)
            try:
                self.engine.abort(Answer(error=ENGINE_DIED, code=ErrorCode.UNAVAILABLE, final=True))
            except Exception as err:  # a sink that fails: the others were answered
                log.error("llm engine: answering the aborted requests failed", exc_info=err)
            stable = time.monotonic() - started >= self.STABLE_S
            quick_deaths = 1 if stable else quick_deaths + 1
            self._pause(min(self._max_backoff_s, self._backoff_s * 2 ** (quick_deaths - 1)))
            self._ready.set()

    def _pause(self, seconds: float) -> None:
        time.sleep(seconds)

    def _run(self, died: list[BaseException]) -> None:
        try:
            self.engine.run()
        except BaseException as err:  # whatever it was, the engine must come back
            died.append(err)


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
        self._restarts_family = pb.MetricFamily(
            name="fair_llm_engine_restarts_total",
            description="Times the llm engine's thread died and was restarted",
            kind=pb.MetricFamily.COUNTER,
        )
        self.running_gauge = self._running_family.Metric(labels=labels)
        self.cancelled_counter = self._cancelled_family.Metric(labels=labels)
        self.restarts_counter = self._restarts_family.Metric(labels=labels)

    def running(self, count: int) -> None:
        self.running_gauge.set(float(count))

    def cancelled(self) -> None:
        self.cancelled_counter.increment(1.0)

    def finished(self, request: LlmRequest, generated: int) -> None:
        tokens = len(request.prompt_ids) + generated
        self._shell.responses.put(lambda: self._shell.meters.record([(request.tenant, tokens)]))

    def restarted(self) -> None:
        self.restarts_counter.increment(1.0)

    def close(self) -> None:
        self.running_gauge = self.cancelled_counter = self.restarts_counter = None
        self._running_family = self._cancelled_family = self._restarts_family = None


class LlmContract:
    """Base of ``model_repository/llm/1/model.py``'s ``TritonPythonModel`` (decoupled).

    ``execute`` decodes each request, answers a bad one at once with its error (final), and
    hands the others to the engine thread; it returns None without waiting, as a decoupled
    model does. While the engine's thread is down (``EngineSupervisor``: between its death
    and its restart) it answers every request UNAVAILABLE at once. ``finalize`` lets the
    engine finish what it has, then stops its threads.
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
        self.limits = replace(self.config.limits, max_token_bytes=max_token_bytes(self.tokenizer))
        self.supervisor = EngineSupervisor(self.engine, on_restart=self.observer.restarted)
        self.supervisor.start()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def execute(self, requests: list[Any]) -> None:
        pb = self.pb
        for request in requests:
            if not self.supervisor.ready:
                self._refuse(request, ENGINE_RESTARTING, pb.TritonError.UNAVAILABLE)
                continue
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
                log.error("llm: cannot read a request", exc_info=err)
                message = f"cannot read request ({_kind(err)})"
                self._refuse(request, message, pb.TritonError.INTERNAL)
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

    def is_model_ready(self) -> bool:
        """Readiness, for the Triton versions that ask a Python model (not 2.51)."""
        return self.supervisor.ready

    def finalize(self) -> None:
        self.engine.stop()
        self.supervisor.join()
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
