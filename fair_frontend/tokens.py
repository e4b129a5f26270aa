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
- ``TokenCounter``: what is tokenised runs on a pool of threads, one per core, in pieces
  fed from one queue per tenant, round robin, so one tenant's long texts neither stall
  the shell's event loop nor make another tenant's short ones wait behind all of them.
- A tenant pays for the tokenising it causes: before a request's texts go to the pool,
  the tokens they have at least (``at_least_tokens``) are counted against its limits
  (``records.Precharge``), so a request refused after its tokenising was not free.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
from tokenizers import Tokenizer

from fair_frontend.protocol import InferRequest, RequestedOutput, Tensor

if TYPE_CHECKING:
    from fair_frontend.config import Endpoint
    from fair_frontend.models import ModelInfo

T = TypeVar("T")

# Texts up to this many bytes (all of a request's together) are counted where they are:
# a hop to a thread costs more than tokenising them (a few hundred microseconds).
INLINE_TOKENIZE_BYTES = 1024
# The most threads a process tokenises on (one per core it may use, up to this many).
MAX_TOKENIZE_THREADS = 8
# Text per piece of a tokenising job (about 0.1 s of a core here): what another tenant's
# job may wait behind, per thread, at most (a single text longer than this is one piece;
# a text is bounded by its model's context before it is tokenised).
PIECE_BYTES = 64 << 10
# The tokenizers library's own threads (rayon, for a batch of texts): off, so that a
# piece takes one core, and the pool's size is what tokenising takes of the machine.
# Read by the library at each call; set here, before any text is tokenised.
os.environ["TOKENIZERS_PARALLELISM"] = "false"
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


def tokenize_threads() -> int:
    """Threads to tokenise on: the cores this process may run on (its CPU affinity, where
    the platform tells it), at least 1, at most ``MAX_TOKENIZE_THREADS``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_TOKENIZE_THREADS))


def utf8_size(text: str) -> int:
    """The bytes of ``text`` in UTF-8 (a lone surrogate counted as 3), without a copy
    where it is ASCII."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def at_least_tokens(size: int, widest: int | None) -> int:
    """The fewest tokens a text of ``size`` bytes can be, for a tokenizer whose tokens
    cover at most ``widest`` bytes (``max_token_bytes``; None: no bound, 0)."""
    return -(-size // widest) if widest else 0


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


def ask_token_counts(
    request: InferRequest, info: ModelInfo, endpoint: Endpoint
) -> tuple[InferRequest, str | None, bool]:
    """``request`` as it goes to the model where the endpoint counts streamed tokens from
    an output (``token_count_output``, asked for with ``token_count_input``): with that
    input true and, where the client names the outputs it wants, that output among them;
    the output to count from (None: this model gives none); and whether the client did
    not ask for it itself (then it is taken out of the replies, ``without_output``)."""
    name, flag = endpoint.token_count_output, endpoint.token_count_input
    if name is None or flag is None or flag not in info.inputs:
        return request, None, False
    given = request.input(flag)
    asked = given is not None and given.data.size > 0 and bool(given.data.flat[0])
    named = not request.outputs or any(o.name == name for o in request.outputs)
    if asked and named:
        return request, name, False
    data = np.array([[True]] if info.max_batch_size > 0 else [True])
    inputs = [t for t in request.inputs if t.name != flag]
    inputs.append(Tensor(flag, "BOOL", data.shape, data))
    outputs = request.outputs if named else [*request.outputs, RequestedOutput(name)]
    return dataclasses.replace(request, inputs=inputs, outputs=outputs), name, True


def counted_tokens(outputs: Sequence[Tensor], name: str) -> int | None:
    """The tokens a response says it carries (``token_count_output``), None without it."""
    out = next((t for t in outputs if t.name == name), None)
    if out is None or not out.data.size:
        return None
    return max(0, int(out.data.sum()))


def without_output(outputs: list[Tensor], name: str) -> list[Tensor]:
    return [t for t in outputs if t.name != name]


class TokenCounter:
    """Tokenises requests' texts off the event loop, fairly between tenants.

    Small texts (``inline_bytes`` in all) are counted at once. Larger work is split into
    pieces (``pieces``: about ``piece_bytes`` of text each, whole texts) and runs on a
    pool of ``threads`` threads (``tokenize_threads``: the cores this process may use,
    at most ``MAX_TOKENIZE_THREADS``), fed from one queue per tenant, served round
    robin: whenever a thread is free it takes the next piece of the next tenant in turn.
    So another tenant's small job waits for at most one piece per thread of a tenant's
    large one, not for all of it, however many tenants send large ones; a tenant alone
    gets every thread. A piece runs to its end even if its request is cancelled (a
    thread cannot be stopped); the pieces of a cancelled job that have not started are
    dropped. The tokenizers' own threads are off (``TOKENIZERS_PARALLELISM``), so the
    pool's size is the parallelism: one piece, one core."""

    def __init__(
        self,
        threads: int | None = None,
        inline_bytes: int = INLINE_TOKENIZE_BYTES,
        piece_bytes: int = PIECE_BYTES,
    ) -> None:
        self.inline_bytes = inline_bytes
        self.piece_bytes = piece_bytes
        self.threads = threads or tokenize_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tokenize")
        self._idle = self.threads
        # Per tenant, its pieces waiting; the dict's order is the round (the tenant served
        # next first; the one served last goes to the back when the next piece is taken,
        # behind any tenant that joined meanwhile).
        self._waiting: dict[str | None, deque[_Piece]] = {}
        self._served: object = _NOBODY  # the tenant whose piece started last
        # Pieces started per tenant, ever (what a test or an operator reads of the pool).
        self.started: Counter[str | None] = Counter()

    async def count(self, tenant: str | None, path: str, texts: list[str]) -> list[int]:
        """Tokens of each of ``texts`` with the tokenizer in ``path``."""
        if sum(len(t) for t in texts) <= self.inline_bytes:
            return count_tokens(load_tokenizer(path), texts)
        tokenizer = load_tokenizer(path)
        pieces = self.pieces(texts)
        counts = await self.map(tenant, [(count_tokens, tokenizer, piece) for piece in pieces])
        return [n for piece in counts for n in piece]

    def pieces(self, texts: Sequence[str], sizes: Sequence[int] | None = None) -> list[list[str]]:
        """``texts`` in order, in runs of about ``piece_bytes`` (whole texts; a longer
        text is a piece alone). ``sizes``: each text's size, where known (its length)."""
        out: list[list[str]] = []
        run: list[str] = []
        size = 0
        for i, text in enumerate(texts):
            n = len(text) if sizes is None else sizes[i]
            if run and size + n > self.piece_bytes:
                out.append(run)
                run, size = [], 0
            run.append(text)
            size += n
        if run:
            out.append(run)
        return out

    async def run(self, tenant: str | None, job: Callable[..., T], *args: Any) -> T:
        """``job(*args)`` on the pool as one piece, in ``tenant``'s turn."""
        (result,) = await self.map(tenant, [(job, *args)])
        return cast(T, result)

    async def map(self, tenant: str | None, jobs: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Each ``(job, *args)`` of ``jobs`` run as a piece, in ``tenant``'s turns: their
        results in order. The first failure is raised, and the pieces not started yet
        are dropped then (so they are if the caller is cancelled)."""
        if not jobs:
            return []
        work = _Work(asyncio.get_running_loop().create_future(), len(jobs))
        queue = self._waiting.get(tenant)
        if queue is None:
            queue = self._waiting[tenant] = deque()
        queue.extend(_Piece(job[0], job[1:], work, i) for i, job in enumerate(jobs))
        self._feed()
        try:
            return await work.done
        finally:
            if not work.done.done():
                work.done.cancel()  # its pieces not started are dropped

    def _feed(self) -> None:
        """Start the next tenant's next piece while a thread is free."""
        waiting = self._waiting
        while self._idle and waiting:
            tenant = next(iter(waiting))
            if tenant == self._served and len(waiting) > 1:
                # The tenant served last goes to the back of the round now, behind those
                # that joined since: a newcomer waits for no second piece of it.
                waiting[tenant] = waiting.pop(tenant)
                tenant = next(iter(waiting))
            queue = waiting[tenant]
            piece = queue.popleft()
            if not queue:
                del waiting[tenant]
            self._served = tenant
            if piece.work.done.done():
                continue  # its job was cancelled, or failed at an earlier piece
            self._idle -= 1
            self.started[tenant] += 1
            running = asyncio.get_running_loop().run_in_executor(self._pool, piece.job, *piece.args)
            running.add_done_callback(functools.partial(self._finished, piece))

    def _finished(self, piece: _Piece, running: asyncio.Future[Any]) -> None:
        self._idle += 1
        work = piece.work
        if running.cancelled():  # the pool was shut down
            work.fail(RuntimeError("the tokenising pool was shut down"))
        elif (error := running.exception()) is not None:
            work.fail(error)
        else:
            work.finished(piece.index, running.result())
        self._feed()

    def __len__(self) -> int:
        """Pieces waiting for a thread."""
        return sum(len(q) for q in self._waiting.values())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_NOBODY = object()


class _Work:
    """One job's pieces together: their results, in order, once all have come (``done``),
    or the first failure."""

    __slots__ = ("done", "left", "results")

    def __init__(self, done: asyncio.Future[list[Any]], pieces: int) -> None:
        self.done = done
        self.left = pieces
        self.results: list[Any] = [None] * pieces

    def finished(self, index: int, result: Any) -> None:
        self.results[index] = result
        self.left -= 1
        if not self.left and not self.done.done():
            self.done.set_result(self.results)

    def fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)


class _Piece:
    """One piece of a tokenising job: ``job(*args)``, the ``index``-th of its ``work``."""

    __slots__ = ("args", "index", "job", "work")

    def __init__(
        self, job: Callable[..., Any], args: tuple[Any, ...], work: _Work, index: int
    ) -> None:
        self.job = job
        self.args = args
        self.work = work
        self.index = index
