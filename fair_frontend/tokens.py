"""Token counts of text: an endpoint's own tokenizer (``tokenizer.json``, the `tokenizers`
library's format, which Hugging Face models ship and vLLM and TensorRT-LLM read).

A text prompt (a BYTES input) is one tensor element, but many tokens: without its
tokenizer a 100K-token prompt would count as one token for limits and cost. Loaded once
per file and process; encoding runs in Rust, without the GIL.

Tokenising is not cheap (about 2 s per MiB of text with the shipped tokenizer on these
CPUs), so a prompt is never tokenised before it is bounded, nor on an event loop:

- ``max_token_bytes``: the most text one token of a tokenizer covers, computed once per
  tokenizer from its vocabulary. A text of ``n`` bytes is then at least
  ``n / max_token_bytes`` tokens: a prompt longer than the model's context is refused
  from its length alone (``models.prompt_texts``), and a text input's size is bounded by
  the context (``models.request_bounds``).
- ``TokenCounter``: what is tokenised runs on a small pool of threads, at most one job per
  tenant at a time, so one tenant's long prompts neither stall the shell's event loop nor
  fill the pool for the others.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
from tokenizers import Tokenizer

from fair_frontend.protocol import InferRequest, Tensor

T = TypeVar("T")

# Texts up to this many bytes (all of a request's together) are counted where they are:
# a hop to a thread costs more than tokenising them (a few hundred microseconds).
INLINE_TOKENIZE_BYTES = 1024
TOKENIZE_THREADS = 2
# Pre-tokenizers that keep every byte of the text in some token (others, such as
# Whitespace and BertPreTokenizer, drop whitespace: a text could then be fewer tokens than
# its length divided by the longest token).
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Punctuation", "Digits", "Split"})


@functools.lru_cache(maxsize=16)
def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer in ``path`` (read once per process)."""
    return Tokenizer.from_file(path)


@functools.lru_cache(maxsize=16)
def max_token_bytes(path: str) -> int | None:
    """The most bytes of text one token of the tokenizer in ``path`` stands for; None
    where no such bound holds for every text (a normalizer, which may shrink or drop
    text; a pre-tokenizer that drops whitespace; an unknown-token that swallows a run of
    text). Byte-level vocabularies (GPT-2, Llama 3, Qwen...) hold one byte per
    character of a token; others are counted in the UTF-8 of their tokens, which can only
    overstate it (a safe direction: the bound is then lower)."""
    return _max_token_bytes(json.loads(load_tokenizer(path).to_str()))


def _max_token_bytes(doc: dict[str, Any]) -> int | None:
    if doc.get("normalizer") is not None:
        return None
    pre = doc.get("pre_tokenizer")
    steps = (pre or {}).get("pretokenizers", [pre]) if pre else []
    byte_level = False
    for step in steps:
        kind = (step or {}).get("type")
        if kind not in _KEEPING_PRE_TOKENIZERS:
            return None
        if kind == "Split" and str(step.get("behavior", "")).lower() == "removed":
            return None
        byte_level = byte_level or kind == "ByteLevel"
    model = doc.get("model") or {}
    kind = model.get("type")
    vocab = model.get("vocab") or {}
    tokens: Iterable[str] = (
        (entry[0] for entry in vocab) if isinstance(vocab, list) else vocab.keys()
    )
    if kind == "BPE":
        if model.get("unk_token") is not None and model.get("fuse_unk"):
            return None  # unknown characters fused into one token: any length
        floor = 4 if model.get("unk_token") is not None else 1  # one character per unk
    elif kind == "WordPiece":
        floor = 4 * int(model.get("max_input_chars_per_word") or 100)  # a word -> [UNK]
    elif kind == "Unigram" and model.get("byte_fallback"):
        floor = 4
    else:
        return None  # WordLevel (a whole word per token, or [UNK]), Unigram without fallback
    longest = max((len(t) if byte_level else len(t.encode("utf-8")) for t in tokens), default=0)
    added = (len(str(a.get("content", "")).encode("utf-8")) for a in doc.get("added_tokens", []))
    return max(longest, floor, *added)


def text_of(element: object) -> str:
    """A BYTES element as text (invalid UTF-8 is replaced, as a model would see it)."""
    if isinstance(element, bytes):
        return element.decode("utf-8", errors="replace")
    if isinstance(element, np.bytes_):
        return bytes(element).decode("utf-8", errors="replace")
    return str(element)


def count_tokens(tokenizer: Tokenizer, texts: Iterable[str]) -> list[int]:
    """Tokens of each text, without special tokens (what the prompt itself costs)."""
    batch = list(texts)
    if not batch:
        return []
    encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
    return [len(e.ids) for e in encodings]


def count_text_tokens(path: str, texts: Iterable[object]) -> list[int]:
    """Tokens of each BYTES element with the tokenizer in ``path``."""
    return count_tokens(load_tokenizer(path), [text_of(t) for t in texts])


def output_tokens(
    outputs: Sequence[Tensor], name: str, tokenizer: str | None, request: InferRequest
) -> int:
    """Output tokens in a response that came in one piece: the elements of a numeric
    output (token ids), the tokens of a text output (BYTES, with the endpoint's tokenizer;
    without one, one per element). A prompt echoed at the start of the text (Triton's vLLM
    backend does unless told ``exclude_input_in_output``) is not counted."""
    out = next((t for t in outputs if t.name == name), None)
    if out is None:
        return 0
    if out.datatype != "BYTES":
        return int(out.data.size)
    if tokenizer is None:
        return int(out.data.size)
    texts = [text_of(e) for e in out.data.flat]
    prompts = [text_of(e) for t in request.inputs if t.datatype == "BYTES" for e in t.data.flat]
    for i, text in enumerate(texts):
        for prompt in prompts:
            if prompt and text.startswith(prompt):
                texts[i] = text[len(prompt) :]
                break
    return sum(count_text_tokens(tokenizer, texts))


class TokenCounter:
    """Counts the tokens of requests' texts off the event loop.

    Small texts (``inline_bytes`` in all) are counted at once; larger ones on a pool of
    ``threads`` threads, one job per tenant at a time: a tenant whose job runs waits for
    it before its next starts, so it holds at most one of the threads and the others
    stay free for the other tenants. A job runs to its end even if its request is
    cancelled (a thread cannot be stopped), and its tenant's turn is held until then."""

    def __init__(
        self, threads: int = TOKENIZE_THREADS, inline_bytes: int = INLINE_TOKENIZE_BYTES
    ) -> None:
        self.inline_bytes = inline_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        # Per tenant: its turn, and how many of its requests hold or wait for it.
        self._turns: dict[str | None, tuple[asyncio.Semaphore, list[int]]] = {}

    async def count(self, tenant: str | None, path: str, texts: list[str]) -> list[int]:
        """Tokens of each of ``texts`` with the tokenizer in ``path``."""
        if sum(len(t) for t in texts) <= self.inline_bytes:
            return count_tokens(load_tokenizer(path), texts)
        counts: list[int] = await self.run(tenant, count_tokens, load_tokenizer(path), texts)
        return counts

    async def run(self, tenant: str | None, job: Callable[..., T], *args: Any) -> T:
        """``job(*args)`` on the pool, in ``tenant``'s turn (one job per tenant at a time):
        any tokenising a request needs (the rerank routes' pairs, the embeddings' ids)."""
        turn, users = self._turns.setdefault(tenant, (asyncio.Semaphore(1), [0]))
        users[0] += 1
        try:
            await turn.acquire()
        except BaseException:
            self._leave(tenant, users)
            raise
        loop = asyncio.get_running_loop()
        try:
            running = loop.run_in_executor(self._pool, job, *args)
        except BaseException:
            turn.release()
            self._leave(tenant, users)
            raise

        def finished(_: object) -> None:
            turn.release()
            self._leave(tenant, users)

        running.add_done_callback(finished)
        # Cancelled here, the job still ends (and frees the turn) in its thread.
        return await asyncio.shield(running)

    def _leave(self, tenant: str | None, users: list[int]) -> None:
        users[0] -= 1
        if not users[0]:
            self._turns.pop(tenant, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
