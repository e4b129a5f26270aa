"""Stand-ins for the Triton backends people put behind the frontend, for its tests.

The real ones need GPUs and weights this project cannot run (Triton's vLLM backend, a
TensorRT-LLM engine behind its ``tensorrt_llm_bls`` model, an ONNX Runtime or TensorRT
embedding model). What the frontend sees of a model is its config (inputs, outputs, their
types and shapes, batching, decoupled) and its answers; these models have exactly the
config interface of the real ones (``tests/your_models/``, ``docs/YOUR_MODEL.md``) and
answer as they do, with a toy generator in place of the network:

- ``VllmStandIn``: Triton's vLLM backend (``vllm_backend/src/model.py``): the inputs and
  outputs its ``auto_complete_config`` declares, decoupled, ``max_batch_size`` 0; engine
  arguments from ``1/model.json`` (``max_num_seqs``, ``max_model_len``), sampling
  parameters from the ``sampling_parameters`` JSON input or else the request parameters;
  ``stream`` one response per token, else one whole (the prompt first unless
  ``exclude_input_in_output``); ``return_num_input_tokens`` / ``return_num_output_tokens``.
- ``TrtLlmBlsStandIn``: TensorRT-LLM's ``tensorrt_llm_bls`` (``all_models/
  inflight_batcher_llm``): every input of its config, ``max_tokens`` (INT32) required,
  ``stop_words``, a batch dimension (``max_batch_size``: ``triton_max_batch_size``, which
  the engine's in-flight batch matches in TensorRT-LLM's recipe), decoupled; ``stream``
  one response per token (the new text), else one (the generated text).
- ``EmbeddingStandIn``: an exported sentence embedder: ``input_ids`` and
  ``attention_mask`` (INT64 [-1]) -> ``embeddings`` (FP32 [DIM]), the mean of the
  attended tokens' vectors from a seeded table: padding masked out changes nothing.

Each engine stand-in is stricter than the real one in one way the tests use: more
sequences at once than its slots (``max_num_seqs``, the in-flight batch) is an error
(vLLM and TensorRT-LLM would queue them inside, where no fairness applies), so a test
that passes through the frontend shows the frontend never sent more than its
``max_inflight``. Generation takes ``STEP_S`` per token on a thread per request, so
sequences overlap as in an engine.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
# The stand-ins' tokenizer: the shipped llm's (byte-level BPE); the frontend's config
# names the same file, as one names the model's own tokenizer.json.
TOKENIZER = REPO_ROOT / "model_repository" / "llm" / "tokenizer.json"
STEP_S = 0.004  # one decode step (a token) of the toy engine
FIRST_TOKEN = 300  # generated ids cycle over [FIRST_TOKEN, FIRST_TOKEN + CYCLE)
CYCLE = 200
VLLM_DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default
EMBEDDING_DIM = 32
EMBEDDING_VOCAB = 8192
EMBEDDING_SEED = 34
# What one batch of the embedding stand-in takes, as a GPU's batch does: requests that
# arrive while one runs wait in the frontend and go together, padded, in the next.
EMBEDDING_BATCH_S = 0.05


def _config_string(model_config: dict[str, Any], key: str) -> str | None:
    value = (model_config.get("parameters") or {}).get(key)
    return None if value is None else str(value.get("string_value", ""))


class _Slots:
    """The engine's sequences at once; one over ``capacity`` is refused (the test device
    described in the module's docstring)."""

    def __init__(self, capacity: int, what: str) -> None:
        self.capacity = capacity
        self.what = what
        self.running = 0
        self.lock = threading.Lock()

    def take(self) -> str | None:
        """None when a slot was taken, else the error to answer."""
        with self.lock:
            if self.running >= self.capacity:
                return (
                    f"stand-in engine: {self.running + 1} sequences at once, more than "
                    f"{self.what}={self.capacity}"
                )
            self.running += 1
            return None

    def give(self) -> None:
        with self.lock:
            self.running -= 1


class _Generator:
    """Token ids of the toy engine, and their text with the tokenizer."""

    def __init__(self) -> None:
        import tokenizers

        self.tokenizer = tokenizers.Tokenizer.from_file(str(TOKENIZER))

    def prompt_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)

    def piece(self, i: int) -> str:
        return str(self.tokenizer.decode([FIRST_TOKEN + i % CYCLE]))


class _Engine:
    """What both LLM stand-ins share: a slot, then ``count`` tokens, each sent by
    ``emit(i, piece)`` one step apart on a thread of the request's own; ``finish(text)``
    after the last, or ``fail(message)``."""

    pb: ClassVar[Any]  # triton_python_backend_utils
    slots: _Slots
    generator: _Generator

    def _run(
        self,
        sender: Any,
        count: int,
        emit: Callable[[int, str], Any | None],
        finish: Callable[[str], Any | None],
        stops: list[str],
    ) -> None:
        pb = self.pb
        refused = self.slots.take()
        if refused is not None:
            self._fail(sender, refused)
            return
        held = True
        try:
            text = ""
            for i in range(count):
                time.sleep(STEP_S)  # the engine's decode step, not a wait for anything
                if sender.is_cancelled():
                    break
                piece = self.generator.piece(i)
                text += piece
                response = emit(i, piece)
                if response is not None:
                    sender.send(response)
                if any(stop in text for stop in stops):
                    break
            last = finish(text)
            # The sequence is over: its slot is free before the final response leaves, as
            # an engine frees a finished sequence before it reports it. Freed after, the
            # client could send the next sequence on the final response and find the slot
            # still held (a race of this stand-in, not of the frontend).
            self.slots.give()
            held = False
            if last is None:
                sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(last, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            if held:
                self.slots.give()

    def _fail(self, sender: Any, message: str) -> None:
        pb = self.pb
        error = pb.TritonError(message)
        sender.send(
            pb.InferenceResponse(error=error), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )

    def _start(self, target: Callable[[], None]) -> None:
        threading.Thread(target=target, daemon=True).start()


def _scalar(pb: Any, request: Any, name: str) -> Any | None:
    tensor = pb.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    return tensor.as_numpy().reshape(-1)[0]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class VllmStandIn(_Engine):
    """``TritonPythonModel`` base of ``tests/your_models/vllm_model``."""

    def initialize(self, args: dict[str, str]) -> None:
        model_config = json.loads(args["model_config"])
        if not self.pb.using_decoupled_model_transaction_policy(model_config):
            raise ValueError("vLLM Triton backend must use the decoupled transaction policy")
        engine_args = json.loads(
            (Path(args["model_repository"]) / args["model_version"] / "model.json").read_text()
        )
        self.max_model_len = int(engine_args["max_model_len"])
        self.slots = _Slots(int(engine_args["max_num_seqs"]), "max_num_seqs")
        self.generator = _Generator()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                plan = self._plan(request)
            except (ValueError, TypeError, KeyError) as err:
                self._fail(sender, f"Error generating stream: {err}")
                continue
            self._start(functools.partial(self._generate, sender, plan))
        return None

    def _plan(self, request: Any) -> dict[str, Any]:
        pb = self.pb
        prompt = _text(_scalar(pb, request, "text_input"))
        blob = _scalar(pb, request, "sampling_parameters")
        sampling = json.loads(_text(blob) if blob is not None else request.parameters())
        max_tokens = int(sampling.get("max_tokens", VLLM_DEFAULT_MAX_TOKENS))
        prompt_tokens = self.generator.prompt_tokens(prompt)
        if prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_tokens + max_tokens} tokens "
                f"({prompt_tokens} in the messages, {max_tokens} in the completion)."
            )
        stream = bool(_scalar(pb, request, "stream") or False)
        exclude = _scalar(pb, request, "exclude_input_in_output")
        return {
            "prompt": prompt,
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens,
            "stream": stream,
            "prepend": not stream and not bool(exclude),
            "num_input": bool(_scalar(pb, request, "return_num_input_tokens") or False),
            "num_output": bool(_scalar(pb, request, "return_num_output_tokens") or False),
        }

    def _response(self, plan: dict[str, Any], text: str, tokens: int) -> Any:
        pb = self.pb
        out = [pb.Tensor("text_output", np.array([text.encode()], dtype=np.object_))]
        if plan["num_input"]:
            count = np.array([plan["prompt_tokens"]], dtype=np.uint32)
            out.append(pb.Tensor("num_input_tokens", count))
        if plan["num_output"]:
            out.append(pb.Tensor("num_output_tokens", np.array([tokens], dtype=np.uint32)))
        return pb.InferenceResponse(output_tensors=out)

    def _generate(self, sender: Any, plan: dict[str, Any]) -> None:
        def emit(_: int, piece: str) -> Any | None:
            return self._response(plan, piece, 1) if plan["stream"] else None

        def finish(text: str) -> Any | None:
            if plan["stream"]:
                return None
            whole = plan["prompt"] + text if plan["prepend"] else text
            return self._response(plan, whole, plan["max_tokens"])

        self._run(sender, plan["max_tokens"], emit, finish, [])


class TrtLlmBlsStandIn(_Engine):
    """``TritonPythonModel`` base of ``tests/your_models/tensorrt_llm_bls``."""

    def initialize(self, args: dict[str, str]) -> None:
        model_config = json.loads(args["model_config"])
        if not self.pb.using_decoupled_model_transaction_policy(model_config):
            raise ValueError("this stand-in is the decoupled form (decoupled_mode: true)")
        capacity = int(model_config["max_batch_size"])
        self.slots = _Slots(capacity, "max_batch_size (the engine's in-flight batch)")
        self.generator = _Generator()

    def execute(self, requests: list[Any]) -> None:
        pb = self.pb
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb.get_input_tensor_by_name(request, "text_input").as_numpy()
            if prompt.shape[0] != 1:
                self._fail(sender, "stand-in: one sequence per request")
                continue
            max_tokens = int(_scalar(pb, request, "max_tokens") or 0)  # required: Triton checks
            stream = bool(_scalar(pb, request, "stream") or False)
            words = pb.get_input_tensor_by_name(request, "stop_words")
            stops = [] if words is None else [_text(w) for w in words.as_numpy().reshape(-1)]
            self._start(functools.partial(self._generate, sender, max_tokens, stream, stops))
        return None

    def _generate(self, sender: Any, count: int, stream: bool, stops: list[str]) -> None:
        def emit(_: int, piece: str) -> Any | None:
            return self._response(piece) if stream else None

        def finish(text: str) -> Any | None:
            return None if stream else self._response(text)

        self._run(sender, count, emit, finish, [w for w in stops if w])

    def _response(self, text: str) -> Any:
        pb = self.pb
        out = [
            pb.Tensor("text_output", np.array([[text.encode()]], dtype=np.object_)),
            pb.Tensor("batch_index", np.array([[0]], dtype=np.int32)),
        ]
        return pb.InferenceResponse(output_tensors=out)


class EmbeddingStandIn:
    """``TritonPythonModel`` base of ``tests/your_models/embedding_onnx``: one response per
    request, the rows of a batch at once, as ONNX Runtime runs them."""

    pb: ClassVar[Any]

    def initialize(self, args: dict[str, str]) -> None:
        rng = np.random.default_rng(EMBEDDING_SEED)
        self.table = rng.standard_normal((EMBEDDING_VOCAB, EMBEDDING_DIM)).astype(np.float32)

    def execute(self, requests: list[Any]) -> list[Any]:
        pb = self.pb
        time.sleep(EMBEDDING_BATCH_S)  # the batch's compute, not a wait for anything
        responses = []
        for request in requests:
            ids = pb.get_input_tensor_by_name(request, "input_ids").as_numpy()
            mask = pb.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            if ids.shape != mask.shape:
                error = pb.TritonError(
                    f"input_ids {list(ids.shape)} and attention_mask {list(mask.shape)} differ"
                )
                responses.append(pb.InferenceResponse(error=error))
                continue
            responses.append(
                pb.InferenceResponse([pb.Tensor("embeddings", embed(self.table, ids, mask))])
            )
        return responses


def embed(table: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean of the attended tokens' vectors, per row ([B, L] -> [B, DIM])."""
    vectors = table[ids % table.shape[0]]  # [B, L, DIM]
    weights = (mask > 0).astype(np.float32)[..., None]
    total = (vectors * weights).sum(axis=1)
    return (total / np.maximum(weights.sum(axis=1), 1.0)).astype(np.float32)
