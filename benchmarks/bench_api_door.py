"""One door for the API routes (issue 29): what a request to ``/v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings``, ``/v2/rerank`` and ``/v1/rerank`` costs the shell
that carries it, and what it does to another tenant beside it, for each checkout given,
in one run (before and after).

Each checkout (``--checkout NAME=PATH``, repeatable, measured in that order; default: this
tree) gets a stack of its own, started from its path: an embedded Triton on its
``model_repository`` (its ``python_backend`` on the stub's path) and, for each case, a
fresh ``fair-frontend serve`` of its package (``PYTHONPATH`` and cwd at the checkout, the
same venv), so every case starts from the same memory, with its ``examples/config.yaml``
as shipped: the demo tenants and keys, tiers, model access and limits. Then the next
checkout. The bodies are the same bytes for every checkout. ``--workers 1`` by default,
what ``fair-frontend up`` runs on a machine of 2 cores (the issue's measurements): one
process that is shell and core; ``--workers 2``: the shells are processes of their own, and
their figures are the shells' (the core's are kept beside).

Cases (the issue's, and the largest body each route takes):

- ``rerank_malformed``: ``/v2/rerank``, 400,000 documents that are not documents (``1``,
  0.8 MiB), trial key (umbrella);
- ``chat_forbidden``: ``/v1/chat/completions``, 31 MiB naming ``llm``, which the trial
  tier may not call (``model`` first in the body), otherwise valid: one message of small
  text parts (1.2M of them; no cap bounds their count);
- ``embeddings_ids_24m``: ``/v1/embeddings``, 24M token ids (46 MiB), trial key;
- ``embeddings_texts_2x8mib``: two tenants (acme, globex) each sending one 8 MiB text at
  once (the tokenizer's threads);
- ``model_name_1mib_embeddings``, ``model_name_1mib_rerank``: a 1 MiB model name; the
  answer is checked for an echo of it (``!echo`` after the status in the table);
- ``surrogate_chat``, ``surrogate_embeddings``: a lone surrogate (``\\ud800``) in a chat
  message and in an embeddings text (acme);
- ``largest_chat`` (``MAX_MESSAGES`` messages) and ``largest_completions`` (one prompt):
  bodies at ``llm``'s own bound (``models.request_bounds`` of the shipped config, computed
  with this tree's code), read whole and refused for the context; ``largest_embeddings_texts``
  and ``largest_embeddings_ids``: ``MAX_EMBEDDING_INPUTS`` inputs of ``--embed-tokens``
  each (within ``embed``'s context, where it has one); ``largest_rerank_cohere`` and
  ``largest_rerank_jina``: ``MAX_DOCUMENTS`` documents of ``--doc-tokens`` each. The
  embeddings and reranks are bodies a client may send, answered 200 (acme).

Figures per case and checkout:

- **memory**: the growth of the shell's peak resident memory during one request (the
  kernel's high-water mark, ``VmHWM`` after writing 5 to ``/proc/PID/clear_refs``, summed
  over the shell processes; ``VmRSS`` sampled every 5 ms as a check), over the bytes of the
  body (of both bodies where two tenants send): target <= 4x. Not figured for a body under
  64 KiB (the allocator's noise is larger than the body).
- **CPU**: the shell's (and, with ``--workers 2``, the core's) CPU time per request
  (per-thread ``schedstat``, nanoseconds; ``stat`` where a thread ended meanwhile), on a
  quiet frontend, median of the reps (ten times as many for a body under 64 KiB); the
  status code answered.
- **another tenant**: ``initech`` (standard tier) runs a probe in a process of its own: a
  KServe call (tritonclient gRPC ``embed``, 128 token ids) and an API call
  (``/v1/embeddings``, a 2 KB text), each kind every 50 ms on its own, over two kept-alive
  connections per shell taken in turn (so that some share the request's shell); its
  latencies alone for ``--solo`` seconds, then while the case's request is sent again and
  again (the next at most every 0.1 s, for ``--window`` seconds and at least once).
  Figures: worst during over worst alone, and p99 during over p99 alone, per kind (a call
  that overlaps the window counts; one that failed counts at the time it took): target
  <= 2x.

    .venv/bin/python -m benchmarks.bench_api_door                          # this tree
    .venv/bin/python -m benchmarks.bench_api_door --checkout before=/work/before \\
        --checkout after=.                                                 # before and after
    .venv/bin/python -m benchmarks.bench_api_door --quick ...              # smoke run
        [--cases NAME,...] [--workers 1] [--reps 3] [--window 8] [--solo 8]
        [--embed-tokens 512] [--doc-tokens 128]

Results: ``results/api_door.json`` and ``results/api_door.png`` (``api_door_quick.*`` for
a quick run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks.bench_hostile import Agent
from benchmarks.harness import (
    FrontendProcess,
    child_pids,
    frontend,
    progress,
    triton,
    write_result,
)
from fair_frontend.backends.triton.model_config import model_info
from fair_frontend.config import resolve_relative_paths

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
# The demo tenants' keys (examples/config.yaml, where they are published).
KEYS = {
    "acme": "acme-demo-key",  # enterprise, weight 2
    "globex": "globex-demo-key",  # enterprise
    "initech": "initech-demo-key",  # standard: the probe
    "umbrella": "umbrella-demo-key",  # trial: no llm
}
PROBE_TENANT = "initech"
PROBE_INTERVAL_S = 0.05  # a call of each kind every 50 ms: within initech's embed limits
PROBE_TOKENS = 128  # the KServe call's token ids
PROBE_TEXT_BYTES = 2048  # the API call's text
PROBE_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 600.0  # one case's request (a large body on an old checkout is slow)
PROBE_TAIL_S = 1.0  # after the window, before the probe stops
SENDER_PERIOD_S = 0.1  # a case's requests: the next starts at most this often
SAMPLE_INTERVAL_S = 0.005
SEND_CHUNK = MIB
SMALL_BODY = 64 << 10  # a body smaller: more reps for its CPU, no growth per byte
READ_CAP = 256 * MIB  # of an answer (the largest embeddings answers are a few MiB)
ECHO_PROBE = 1024  # bytes of a long name that, found in the answer, count as its echo

# Caps of the routes (fair_frontend.shell.api: OpenAI's and Cohere's own limits).
MAX_MESSAGES = 4096
MAX_EMBEDDING_INPUTS = 2048
MAX_DOCUMENTS = 10_000
DEFAULT_CONTEXT = 512  # a model's context where neither its config nor the endpoint says
LLM_WIRE_FALLBACK = 1_245_244  # llm's bound with the shipped config (request_bounds)
# fmt: off
WORDS = (
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be",
    "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have",
    "an", "they", "you", "were", "her", "she", "there", "one", "all", "we", "their", "can",
    "has", "more", "would", "will", "if", "no", "other", "fair", "share", "tenant", "model",
)
# fmt: on


@dataclass(frozen=True)
class Sizes:
    """How large each case's body is (full size, or ``--quick``'s)."""

    rerank_malformed_docs: int
    chat_forbidden_bytes: int
    embeddings_ids: int
    text_bytes: int
    name_bytes: int
    embed_inputs: int
    rerank_docs: int
    reps: int
    solo_s: float
    window_s: float


FULL = Sizes(
    rerank_malformed_docs=400_000,
    chat_forbidden_bytes=31 * MIB,
    embeddings_ids=24_000_000,
    text_bytes=8 * MIB,
    name_bytes=MIB,
    embed_inputs=MAX_EMBEDDING_INPUTS,
    rerank_docs=MAX_DOCUMENTS,
    reps=3,
    solo_s=8.0,
    window_s=8.0,
)
QUICK = Sizes(
    rerank_malformed_docs=40_000,
    chat_forbidden_bytes=3 * MIB,
    embeddings_ids=2_400_000,
    text_bytes=MIB,
    name_bytes=MIB,
    embed_inputs=64,
    rerank_docs=200,
    reps=1,
    solo_s=2.5,
    window_s=2.5,
)


@dataclass(frozen=True)
class Case:
    """One request (``senders``: one per tenant, sent at once), its body built on demand so
    that only one case's bodies are held at a time."""

    name: str
    path: str
    senders: tuple[str, ...]
    build: Callable[[], bytes]
    what: str
    echo: bytes | None = None  # bytes the answer must not carry (a long name)


# ---- bodies --------------------------------------------------------------------------------


def words(n_bytes: int, seed: int = 1) -> bytes:
    """About ``n_bytes`` of plain English-like ASCII text (no JSON escapes)."""
    rng = random.Random(seed)
    chunk = " ".join(rng.choice(WORDS) for _ in range(4096)).encode()
    out = chunk * (n_bytes // len(chunk) + 1)
    return out[:n_bytes].rstrip(b" ") or b"a"


def words_of_tokens(tokenizer: str | None, tokens: int, seed: int = 1) -> bytes:
    """A text of ``tokens`` tokens with ``tokenizer`` (about 3.4 bytes a token where there
    is none to count with)."""
    text = words(tokens * 8 + 64, seed)
    if tokenizer is None:
        return words(int(tokens * 3.4), seed)
    from tokenizers import Tokenizer

    enc = Tokenizer.from_file(tokenizer).encode(text.decode(), add_special_tokens=False)
    if len(enc.offsets) <= tokens:
        return text
    return text[: enc.offsets[tokens - 1][1]]


def json_list(items: list[bytes]) -> bytes:
    return b"[" + b",".join(items) + b"]"


def repeated(item: bytes, count: int) -> bytes:
    """``[item,item,...]`` without a list of ``count`` objects."""
    return b"[" + (item + b",") * (count - 1) + item + b"]"


def rerank_malformed(docs: int) -> bytes:
    return b'{"model":"rerank","query":"what is fair?","documents":' + repeated(b"1", docs) + b"}"


def chat_forbidden(size: int) -> bytes:
    """A valid chat body but for its model: one message of many small text parts (a
    count no limit bounds), so that a door which parses before it checks the model
    builds them all."""
    part = b'{"type":"text","text":"hi"}'
    head = b'{"model":"llm","messages":[{"role":"user","content":'
    count = max(1, (size - len(head) - 4) // (len(part) + 1))
    return head + repeated(part, count) + b"}]}"


def embeddings_ids(count: int) -> bytes:
    return b'{"model":"embed","input":' + repeated(b"0", count) + b"}"


def embeddings_text(size: int, seed: int) -> bytes:
    return b'{"model":"embed","input":"' + words(size, seed) + b'"}'


def long_name_embeddings(size: int) -> bytes:
    return b'{"model":"' + b"m" * size + b'","input":"hello"}'


def long_name_rerank(size: int) -> bytes:
    return b'{"model":"' + b"m" * size + b'","query":"q","documents":["d"]}'


SURROGATE_CHAT = (
    b'{"model":"llm","max_tokens":4,"messages":[{"role":"user","content":"a\\ud800b"}]}'
)
SURROGATE_EMBEDDINGS = b'{"model":"embed","input":"a\\ud800b"}'


def largest_chat(size: int) -> bytes:
    """``MAX_MESSAGES`` messages whose texts fill ``size``."""
    head = b'{"model":"llm","max_tokens":16,"messages":['
    shell = len(b'{"role":"user","content":""},')
    each = max(1, (size - len(head) - 2) // MAX_MESSAGES - shell)
    text = words(each)
    msg = b'{"role":"user","content":"' + text + b'"}'
    return head + b",".join([msg] * MAX_MESSAGES) + b"]}"


def largest_completions(size: int) -> bytes:
    head = b'{"model":"llm","max_tokens":16,"prompt":"'
    return head + words(size - len(head) - 2) + b'"}'


def largest_embeddings_texts(inputs: int, text: bytes) -> bytes:
    items = [b'"' + text + b'"'] * inputs
    return b'{"model":"embed","input":' + json_list(items) + b"}"


def largest_embeddings_ids(inputs: int, per_input: int) -> bytes:
    rng = np.random.default_rng(3)
    ids = rng.integers(1000, 30_000, size=(inputs, per_input))
    rows = [b"[" + ",".join(map(str, row)).encode() + b"]" for row in ids.tolist()]
    return b'{"model":"embed","input":' + json_list(rows) + b"}"


def largest_rerank(docs: int, doc: bytes) -> bytes:
    items = [b'"' + doc + b'"'] * docs
    return b'{"model":"rerank","query":"which is fair?","documents":' + json_list(items) + b"}"


@dataclass(frozen=True)
class Bounds:
    """What this tree's code says the largest bodies are (``models.request_bounds`` on the
    shipped config and model repository), and the per-input lengths used."""

    llm_wire_bytes: int
    embed_context: int
    rerank_context: int
    embed_tokenizer: str | None
    rerank_tokenizer: str | None
    note: str = ""


def compute_bounds(config: dict[str, Any], repo: Path) -> Bounds:
    """The bounds from this tree's code (``fair_frontend.models``), for the shipped
    config and model repository; the shipped figures where that code cannot say."""
    endpoints = config.get("endpoints", {})
    embed_tok = endpoints.get("embed", {}).get("tokenizer")
    rerank_tok = endpoints.get("rerank", {}).get("tokenizer")
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2

        from fair_frontend.config import Config
        from fair_frontend.models import request_bounds

        cfg = Config.model_validate(config)

        def info(name: str) -> Any:
            text = (repo / name / "config.pbtxt").read_text()
            return model_info(text_format.Parse(text, model_config_pb2.ModelConfig()))

        def context(name: str) -> int:
            found = cfg.endpoint(name).max_model_len or info(name).max_model_len
            return int(found or DEFAULT_CONTEXT)

        llm = request_bounds(info("llm"), cfg.endpoint("llm"))
        return Bounds(llm.wire_bytes, context("embed"), context("rerank"), embed_tok, rerank_tok)
    except Exception as err:  # an older or newer tree: the shipped figures
        note = f"computed bounds unavailable ({type(err).__name__}: {err}); shipped figures"
        return Bounds(
            LLM_WIRE_FALLBACK, DEFAULT_CONTEXT, DEFAULT_CONTEXT, embed_tok, rerank_tok, note
        )


def make_cases(sizes: Sizes, bounds: Bounds, args: argparse.Namespace) -> list[Case]:
    # Within the models' context with room to spare (a tokenizer's special tokens).
    embed_tokens = min(args.embed_tokens, bounds.embed_context * 9 // 10)
    doc_tokens = min(args.doc_tokens, bounds.rerank_context * 9 // 10 - 16)
    llm_body = bounds.llm_wire_bytes - 1024
    name_echo = b"m" * ECHO_PROBE
    return [
        Case(
            "rerank_malformed",
            "/v2/rerank",
            ("umbrella",),
            lambda: rerank_malformed(sizes.rerank_malformed_docs),
            f"{sizes.rerank_malformed_docs:,} documents that are not documents, trial key",
        ),
        Case(
            "chat_forbidden",
            "/v1/chat/completions",
            ("umbrella",),
            lambda: chat_forbidden(sizes.chat_forbidden_bytes),
            "one message of small text parts naming llm, which the trial tier may not call",
        ),
        Case(
            "embeddings_ids_24m",
            "/v1/embeddings",
            ("umbrella",),
            lambda: embeddings_ids(sizes.embeddings_ids),
            f"{sizes.embeddings_ids:,} token ids, trial key",
        ),
        Case(
            "embeddings_texts_2x8mib",
            "/v1/embeddings",
            ("acme", "globex"),
            lambda: embeddings_text(sizes.text_bytes, 1),
            f"two tenants, one {sizes.text_bytes / MIB:g} MiB text each at once",
        ),
        Case(
            "model_name_1mib_embeddings",
            "/v1/embeddings",
            ("umbrella",),
            lambda: long_name_embeddings(sizes.name_bytes),
            "a 1 MiB model name (the answer must not echo it)",
            echo=name_echo,
        ),
        Case(
            "model_name_1mib_rerank",
            "/v2/rerank",
            ("umbrella",),
            lambda: long_name_rerank(sizes.name_bytes),
            "a 1 MiB model name (the answer must not echo it)",
            echo=name_echo,
        ),
        Case(
            "surrogate_chat",
            "/v1/chat/completions",
            ("acme",),
            lambda: SURROGATE_CHAT,
            "a lone surrogate in a chat message",
        ),
        Case(
            "surrogate_embeddings",
            "/v1/embeddings",
            ("acme",),
            lambda: SURROGATE_EMBEDDINGS,
            "a lone surrogate in an embeddings text",
        ),
        Case(
            "largest_chat",
            "/v1/chat/completions",
            ("acme",),
            lambda: largest_chat(llm_body),
            f"{MAX_MESSAGES} messages filling llm's bound ({bounds.llm_wire_bytes:,} bytes)",
        ),
        Case(
            "largest_completions",
            "/v1/completions",
            ("acme",),
            lambda: largest_completions(llm_body),
            f"one prompt filling llm's bound ({bounds.llm_wire_bytes:,} bytes)",
        ),
        Case(
            "largest_embeddings_texts",
            "/v1/embeddings",
            ("acme",),
            lambda: largest_embeddings_texts(
                sizes.embed_inputs, words_of_tokens(bounds.embed_tokenizer, embed_tokens)
            ),
            f"{sizes.embed_inputs} texts of {embed_tokens} tokens",
        ),
        Case(
            "largest_embeddings_ids",
            "/v1/embeddings",
            ("acme",),
            lambda: largest_embeddings_ids(sizes.embed_inputs, embed_tokens),
            f"{sizes.embed_inputs} inputs of {embed_tokens} token ids",
        ),
        Case(
            "largest_rerank_cohere",
            "/v2/rerank",
            ("acme",),
            lambda: largest_rerank(
                sizes.rerank_docs, words_of_tokens(bounds.rerank_tokenizer, doc_tokens, 2)
            ),
            f"{sizes.rerank_docs:,} documents of {doc_tokens} tokens",
        ),
        Case(
            "largest_rerank_jina",
            "/v1/rerank",
            ("acme",),
            lambda: largest_rerank(
                sizes.rerank_docs, words_of_tokens(bounds.rerank_tokenizer, doc_tokens, 2)
            ),
            f"{sizes.rerank_docs:,} documents of {doc_tokens} tokens",
        ),
    ]


# ---- one HTTP request, as a client that keeps sending -------------------------------------


@dataclass
class Reply:
    status: int | None  # None: no answer (``error`` says what the client saw)
    body: bytes = b""
    bytes_sent: int = 0  # of the body, before the answer or the server's close
    seconds: float = 0.0
    error: str = ""

    @property
    def label(self) -> str:
        return str(self.status) if self.status is not None else f"no answer ({self.error})"


async def read_reply(reader: asyncio.StreamReader) -> tuple[int | None, bytes]:
    """The status and body of an HTTP/1.1 answer (Content-Length, else to EOF)."""
    line = await reader.readline()
    parts = line.split()
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        return None, b""
    status = int(parts[1])
    length = None
    while True:
        header = await reader.readline()
        if header in (b"\r\n", b"\n", b""):
            break
        name, _, value = header.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        if length is not None:
            return status, await reader.readexactly(min(length, READ_CAP))
        return status, await reader.read(READ_CAP)
    return status, b""


async def post(http: str, path: str, key: str, body: bytes) -> Reply:
    """One request on a connection of its own (``Connection: close``): the body sent in
    1 MiB writes until it is all sent or the server answers or closes; then the answer."""
    host, port = http.rsplit(":", 1)
    started = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(host, int(port), limit=READ_CAP)
    except OSError as err:
        return Reply(None, error=f"connect {type(err).__name__}")
    answer = asyncio.ensure_future(read_reply(reader))
    sent = 0
    try:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {http}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        writer.write(head.encode())
        view = memoryview(body)
        with contextlib.suppress(OSError):
            for lo in range(0, len(view), SEND_CHUNK):
                if answer.done():
                    break  # answered before the whole body: the rest is not wanted
                writer.write(view[lo : lo + SEND_CHUNK])
                await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
                sent += len(view[lo : lo + SEND_CHUNK])
        try:
            status, data = await asyncio.wait_for(asyncio.shield(answer), REQUEST_TIMEOUT_S)
        except TimeoutError:
            return Reply(None, b"", sent, time.monotonic() - started, "timeout")
        except (OSError, ValueError, asyncio.IncompleteReadError) as err:
            return Reply(None, b"", sent, time.monotonic() - started, type(err).__name__)
        error = "" if status is not None else "closed before an answer"
        return Reply(status, data, sent, time.monotonic() - started, error)
    except TimeoutError:
        return Reply(None, b"", sent, time.monotonic() - started, "the server stopped reading")
    finally:
        answer.cancel()
        writer.transport.abort()


# ---- the frontend's processes, from /proc ----------------------------------------------------


def status_bytes(pid: int, field_name: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field_name}:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak(pid: int) -> bool:
    """Set the process's ``VmHWM`` to its ``VmRSS`` now (``clear_refs`` 5)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def cpu_ns(pid: int) -> tuple[int, int]:
    """(the sum of the live threads' on-CPU nanoseconds from ``schedstat``: precise; the
    process's user + system time from ``stat``, exited threads included: 10 ms ticks)."""
    precise = 0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                precise += int((task / "schedstat").read_text().split()[0])
    coarse = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        coarse = (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return precise, coarse


def cpu_delta_ms(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Milliseconds of CPU between two ``cpu_ns`` readings: the precise figure, unless the
    coarse one is 20 ms more (a thread that ended took its time out of ``task/``)."""
    precise = (after[0] - before[0]) / 1e6
    coarse = (after[1] - before[1]) / 1e6
    return coarse if coarse > precise + 20 else precise


@dataclass(frozen=True)
class Processes:
    """The frontend's processes: its shells and its core (with one worker, one process
    that is both: then ``core`` is None)."""

    shells: tuple[int, ...]
    core: int | None

    @classmethod
    def of(cls, fe: FrontendProcess) -> Processes:
        pid = fe.process.pid
        shells = []
        for child in child_pids(pid):
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
                if b"fair_frontend.shell" in cmdline:
                    shells.append(child)
        if not shells:
            return cls((pid,), None)
        return cls(tuple(shells), pid)

    @property
    def all(self) -> tuple[int, ...]:
        return self.shells + ((self.core,) if self.core is not None else ())


class RssSampler:
    """The shells' summed ``VmRSS`` every ``SAMPLE_INTERVAL_S`` in a thread of the driver,
    and the core's: peaks the kernel's high-water mark should match."""

    def __init__(self, procs: Processes) -> None:
        self.procs = procs
        self.shells_peak = 0
        self.core_peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            shells = sum(status_bytes(p, "VmRSS") for p in self.procs.shells)
            self.shells_peak = max(self.shells_peak, shells)
            if self.procs.core is not None:
                self.core_peak = max(self.core_peak, status_bytes(self.procs.core, "VmRSS"))
            self.samples += 1
            self._stop.wait(SAMPLE_INTERVAL_S)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def settle(procs: Processes, deadline_s: float = 20.0) -> None:
    """Wait (polled, with a deadline) until the frontend's processes are idle: less than
    5 ms of CPU in 200 ms, so the last request's work does not count against the next."""
    stop = time.monotonic() + deadline_s
    while time.monotonic() < stop:
        before = [cpu_ns(p) for p in procs.all]
        await asyncio.sleep(0.2)
        after = [cpu_ns(p) for p in procs.all]
        if sum(cpu_delta_ms(b, a) for b, a in zip(before, after, strict=True)) < 5:
            return


# ---- the cost of one request (quiet machine) -----------------------------------------------


async def send_case(http: str, case: Case, body: bytes) -> list[Reply]:
    """The case's request(s), one per sender, at once."""
    return list(
        await asyncio.gather(
            *(post(http, case.path, KEYS[tenant], body) for tenant in case.senders)
        )
    )


async def cost_rep(http: str, case: Case, body: bytes, procs: Processes) -> dict[str, Any]:
    """One request (or one per sender): the shells' and the core's peak growth, CPU, the
    answers."""
    await settle(procs)
    hwm = all(reset_peak(p) for p in procs.all)
    rss0 = {p: status_bytes(p, "VmRSS") for p in procs.all}
    cpu0 = {p: cpu_ns(p) for p in procs.all}
    with RssSampler(procs) as sampler:
        replies = await send_case(http, case, body)
    cpu1 = {p: cpu_ns(p) for p in procs.all}
    peak = {p: status_bytes(p, "VmHWM") for p in procs.all}
    shells0 = sum(rss0[p] for p in procs.shells)
    out: dict[str, Any] = {
        "statuses": [r.label for r in replies],
        "seconds": max(r.seconds for r in replies),
        "bytes_sent": sum(r.bytes_sent for r in replies),
        "shells_rss_before": shells0,
        "shells_growth_sampled": max(0, sampler.shells_peak - shells0),
        "shells_cpu_ms": sum(cpu_delta_ms(cpu0[p], cpu1[p]) for p in procs.shells),
        "samples": sampler.samples,
        "answer_bytes": max(len(r.body) for r in replies),
        "answer_head": replies[0].body[:300].decode("utf-8", "replace"),
    }
    if hwm:
        out["shells_growth_hwm"] = sum(max(0, peak[p] - rss0[p]) for p in procs.shells)
    if procs.core is not None:
        core = procs.core
        out["core_growth"] = max(0, (peak[core] if hwm else sampler.core_peak) - rss0[core])
        out["core_cpu_ms"] = cpu_delta_ms(cpu0[core], cpu1[core])
    if case.echo is not None:
        out["echoed"] = any(case.echo in r.body for r in replies)
    return out


# ---- another tenant beside it: the probe (a process of its own) ------------------------------


async def probe_main(http: str, grpc_url: str, connections: int) -> None:
    """The probe agent, as ``initech``: a KServe call and an API call, each kind every
    ``PROBE_INTERVAL_S`` on its own (the next at once when one ran late), each kind taking
    its ``connections`` kept-alive connections in turn (with several shells, some of them are
    on the shell that carries the case's request: the worst is the figure); says ``ready``
    after warming up, and when stdin closes, writes its samples and exits."""
    import aiohttp
    import tritonclient.grpc.aio as grpcaio

    key = KEYS[PROBE_TENANT]
    ids = np.random.default_rng(7).integers(1, 4000, size=(1, PROBE_TOKENS), dtype=np.int32)
    tensor = grpcaio.InferInput("INPUT_IDS", list(ids.shape), "INT32")
    tensor.set_data_from_numpy(ids)
    grpc_clients = [grpcaio.InferenceServerClient(grpc_url) for _ in range(connections)]
    api_body = json.dumps({"model": "embed", "input": words(PROBE_TEXT_BYTES, 5).decode()})
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    sessions = [
        aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1))
        for _ in range(connections)
    ]
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    url = f"http://{http}/v1/embeddings"

    async def kserve(i: int) -> str:
        client = grpc_clients[i % connections]
        await client.infer("embed", [tensor], headers={"authorization": f"Bearer {key}"})
        return "ok"

    async def api(i: int) -> str:
        async with sessions[i % connections].post(url, data=api_body, headers=headers) as resp:
            await resp.read()
            return "ok" if resp.status == 200 else f"status {resp.status}"

    calls = {"kserve": kserve, "api": api}
    samples: list[dict[str, Any]] = []
    in_flight: dict[str, float] = {}  # kind -> when its call now in flight started

    async def one(kind: str, i: int) -> None:
        t0 = in_flight[kind] = time.monotonic()
        try:
            outcome = await asyncio.wait_for(calls[kind](i), PROBE_TIMEOUT_S)
        except TimeoutError:
            outcome = "timeout"
        except Exception as err:  # what the client raises is an outcome to report
            outcome = f"{type(err).__name__}: {str(err)[:80]}"
        del in_flight[kind]
        samples.append({"t": t0, "latency_s": time.monotonic() - t0, "kind": kind, "o": outcome})

    async def paced(kind: str) -> None:
        i = 0
        while True:
            started = time.monotonic()
            await one(kind, i)
            await asyncio.sleep(max(0.0, started + PROBE_INTERVAL_S - time.monotonic()))
            i += 1

    async def run() -> None:
        for i in range(4 * connections):  # every connection opened and warm
            for kind in calls:
                await one(kind, i)
        samples.clear()
        print(json.dumps({"ready": True}), flush=True)
        # Each kind on its own: a call held up does not hold up the other kind's.
        await asyncio.gather(*(paced(kind) for kind in calls))

    task = asyncio.ensure_future(run())
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # EOF: stop
    task.cancel()
    now = time.monotonic()
    for kind, t0 in in_flight.items():  # unanswered yet: at least this long
        samples.append({"t": t0, "latency_s": now - t0, "kind": kind, "o": "in flight at stop"})
    print(json.dumps({"samples": samples}), flush=True)
    os._exit(0)


async def start_probe(http: str, grpc_url: str, connections: int) -> Agent:
    cmd = [sys.executable, "-m", "benchmarks.bench_api_door", "--probe", http, grpc_url]
    cmd.append(str(connections))
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        limit=256 * MIB,
    )
    return Agent("probe", proc)


def probe_stats(
    samples: list[dict[str, Any]], kind: str, t0: float, t1: float, *, within: bool = False
) -> dict[str, Any]:
    """The probe's calls of ``kind`` that overlap [t0, t1] (``within``: that lie wholly in
    it, for the solo window, which ends where the case begins): how many, p50, p99 and
    worst (ms; a failed call at the time it took), the failures by outcome."""
    window = [
        s
        for s in samples
        if s["kind"] == kind
        and (
            t0 <= s["t"] and s["t"] + s["latency_s"] <= t1
            if within
            else s["t"] < t1 and s["t"] + s["latency_s"] > t0
        )
    ]
    ms = sorted(s["latency_s"] * 1e3 for s in window)
    failures = Counter(s["o"] for s in window if s["o"] != "ok")
    return {
        "n": len(ms),
        "p50_ms": float(np.percentile(ms, 50)) if ms else None,
        "p99_ms": float(np.percentile(ms, 99)) if ms else None,
        "worst_ms": ms[-1] if ms else None,
        "failures": dict(failures),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


async def beside(
    http: str, grpc_url: str, case: Case, body: bytes, sizes: Sizes, connections: int
) -> dict[str, Any]:
    """The probe alone for ``solo_s``, then while the case's request(s) go again and
    again for ``window_s`` (each sender's next at most every ``SENDER_PERIOD_S``, at least
    one): the probe's figures in both windows, and the answers the case's requests got."""
    probe = await start_probe(http, grpc_url, connections)
    statuses: Counter[str] = Counter()
    samples: list[dict[str, Any]] = []
    try:
        if not ((await probe.ready()) or {}).get("ready"):
            progress("  the probe did not start: its figures will be missing")
        s0 = time.monotonic()
        await asyncio.sleep(sizes.solo_s)
        s1 = t0 = time.monotonic()

        async def sender(tenant: str) -> None:
            while True:
                started = time.monotonic()
                reply = await post(http, case.path, KEYS[tenant], body)
                statuses[reply.label] += 1
                if time.monotonic() - t0 >= sizes.window_s:
                    return
                await asyncio.sleep(max(0.0, started + SENDER_PERIOD_S - time.monotonic()))

        await asyncio.gather(*(sender(t) for t in case.senders))
        t1 = time.monotonic()
        # The probe's calls held up by the last request are answered after it: a moment
        # for them (one still unanswered at the stop counts at its time so far).
        await asyncio.sleep(PROBE_TAIL_S)
    finally:
        final = await probe.stop()
        samples = (final or {}).get("samples", [])
    out: dict[str, Any] = {"window_s": t1 - t0, "statuses": dict(statuses)}
    for kind in ("kserve", "api"):
        solo = probe_stats(samples, kind, s0, s1, within=True)
        during = probe_stats(samples, kind, t0, t1)
        out[kind] = {
            "solo": solo,
            "during": during,
            "worst_ratio": ratio(during["worst_ms"], solo["worst_ms"]),
            "p99_ratio": ratio(during["p99_ms"], solo["p99_ms"]),
        }
    worst = [out[k]["worst_ratio"] for k in ("kserve", "api") if out[k]["worst_ratio"]]
    out["worst_ratio"] = max(worst) if worst else None
    return out


# ---- a checkout's stack ----------------------------------------------------------------------


def shipped_config(root: Path) -> dict[str, Any]:
    """The checkout's example config as shipped (its tenants, keys, model access and
    limits), its relative paths made absolute."""
    example = root / "examples" / "config.yaml"
    data: dict[str, Any] = yaml.safe_load(example.read_text())
    resolve_relative_paths(data, example.parent)
    return data


@contextlib.contextmanager
def on_path(root: Path) -> Iterator[None]:
    """``PYTHONPATH`` at ``root`` while Triton starts: its Python stubs import the
    checkout's ``python_backend``."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(root)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def describe(root: Path) -> str:
    """The checkout's commit, ``+changes`` where its tree differs from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


@dataclass
class CaseResult:
    body_bytes: int
    reps: list[dict[str, Any]] = field(default_factory=list)
    beside: dict[str, Any] = field(default_factory=dict)
    frontend_exit: int | None = None
    tracebacks: int = 0
    error: str = ""

    def summary(self) -> dict[str, Any]:
        reps = self.reps
        if not reps:
            return {"error": self.error or "no request measured"}
        exact = "shells_growth_hwm" in reps[0]
        growth = max(r["shells_growth_hwm" if exact else "shells_growth_sampled"] for r in reps)
        statuses = Counter(s for r in reps for s in r["statuses"])
        out: dict[str, Any] = {
            "status": statuses.most_common(1)[0][0],
            "statuses": dict(statuses),
            "body_bytes": self.body_bytes,
            "shells_growth_mib": growth / MIB,
            "shells_growth_sampled_mib": max(r["shells_growth_sampled"] for r in reps) / MIB,
            # Under SMALL_BODY, the growth is the allocator's own noise, not the body's.
            "growth_per_body_byte": growth / self.body_bytes
            if self.body_bytes >= SMALL_BODY
            else None,
            "shells_cpu_ms": statistics.median(r["shells_cpu_ms"] for r in reps),
            "seconds": statistics.median(r["seconds"] for r in reps),
            "bytes_sent_before_answer": statistics.median(r["bytes_sent"] for r in reps),
            "frontend_exit": self.frontend_exit,
            "tracebacks_in_log": self.tracebacks,
        }
        if "core_growth" in reps[0]:
            out["core_growth_mib"] = max(r["core_growth"] for r in reps) / MIB
            out["core_cpu_ms"] = statistics.median(r["core_cpu_ms"] for r in reps)
        if "echoed" in reps[0]:
            out["echoed"] = any(r["echoed"] for r in reps)
        if self.beside:
            out["latency_worst_ratio"] = self.beside.get("worst_ratio")
            for kind in ("kserve", "api"):
                b = self.beside.get(kind)
                if b:
                    out[f"{kind}_worst_ms"] = b["during"]["worst_ms"]
                    out[f"{kind}_solo_worst_ms"] = b["solo"]["worst_ms"]
                    out[f"{kind}_worst_ratio"] = b["worst_ratio"]
                    out[f"{kind}_p99_ratio"] = b["p99_ratio"]
        if self.error:
            out["error"] = self.error
        return out


async def run_case(
    case: Case, root: Path, tri: Any, args: argparse.Namespace, sizes: Sizes
) -> CaseResult:
    """A fresh frontend of the checkout (each case from the same memory): the cost of
    ``reps`` requests (a small body more, for its CPU), then the probe beside it."""
    body = case.build()
    result = CaseResult(body_bytes=len(body) * len(case.senders))
    config = shipped_config(root)
    with frontend(
        config, tri.grpc_url, workers=args.workers, source=root, http_url=tri.http_url
    ) as fe:
        procs = Processes.of(fe)
        reps = sizes.reps * (10 if len(body) < SMALL_BODY else 1)
        try:
            for i in range(reps):
                rep = await cost_rep(fe.http_url, case, body, procs)
                result.reps.append(rep)
                if i == 0 or i == reps - 1:
                    growth = rep.get("shells_growth_hwm", rep["shells_growth_sampled"])
                    per_byte = (
                        f" ({growth / result.body_bytes:.2f}x the body)"
                        if result.body_bytes >= SMALL_BODY
                        else ""
                    )
                    progress(
                        f"  cost {i + 1}/{reps}: {rep['statuses']} in {rep['seconds']:.2f} s, "
                        f"shell(s) +{growth / MIB:,.1f} MiB{per_byte}, "
                        f"CPU {rep['shells_cpu_ms']:,.1f} ms shell(s), "
                        f"{_f1(rep.get('core_cpu_ms'))} ms core"
                    )
            await settle(procs)
            connections = 2 * args.workers
            result.beside = await beside(fe.http_url, fe.grpc_url, case, body, sizes, connections)
            b = result.beside
            progress(
                f"  beside it ({b['window_s']:.1f} s, {b['statuses']}): "
                + "; ".join(
                    f"{k} worst {_ms(b[k]['during']['worst_ms'])} ms "
                    f"(alone {_ms(b[k]['solo']['worst_ms'])}), "
                    f"p99 {_ms(b[k]['during']['p99_ms'])} (alone {_ms(b[k]['solo']['p99_ms'])})"
                    for k in ("kserve", "api")
                )
            )
        except Exception as err:  # a checkout that breaks is a finding: the next case goes on
            result.error = f"{type(err).__name__}: {err}"
            progress(f"  failed: {result.error}")
        result.frontend_exit = fe.process.poll()
        with contextlib.suppress(OSError):
            result.tracebacks = fe.log_path.read_text(errors="replace").count("Traceback")
        if result.frontend_exit is not None:
            progress(f"  THE FRONTEND EXITED ({result.frontend_exit})")
    return result


async def run_checkout(
    name: str, root: Path, cases: list[Case], args: argparse.Namespace, sizes: Sizes
) -> dict[str, Any]:
    progress(f"checkout {name}: {root} ({describe(root)})")
    out: dict[str, Any] = {"path": str(root), "commit": describe(root), "cases": {}}
    with contextlib.ExitStack() as stack:
        with on_path(root):
            tri = stack.enter_context(triton(root / "model_repository"))
        for i, case in enumerate(cases, 1):
            progress(f"{name} [{i}/{len(cases)}] {case.name}: {case.path}, {case.what}")
            result = await run_case(case, root, tri, args, sizes)
            out["cases"][case.name] = {
                "summary": result.summary(),
                "reps": [{k: v for k, v in r.items() if k != "answer_head"} for r in result.reps],
                "answer_head": result.reps[0]["answer_head"] if result.reps else "",
                "beside": result.beside,
            }
    return out


# ---- report ----------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _f1(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def report(results: dict[str, Any]) -> None:
    """The table: a row per case and checkout."""
    print()
    print(
        "Per case and checkout: the status; the body; the shell(s)' peak growth (MiB, and x the "
        "body: target <= 4);\nCPU per request (ms, shell(s) / core); another tenant's worst "
        "latency during / alone (ms) and its ratio (target <= 2),\nKServe then API; the p99 "
        "ratios, KServe / API"
    )
    columns = [
        ("case", 27, "<"),
        ("checkout", 10, "<"),
        ("status", 9, "<"),
        ("body MiB", 9, ">"),
        ("growth", 8, ">"),
        ("x body", 9, ">"),
        ("CPU ms", 9, ">"),
        ("core", 7, ">"),
        ("KServe worst", 13, ">"),
        ("x", 7, ">"),
        ("API worst", 13, ">"),
        ("x", 7, ">"),
        ("p99 x", 13, ">"),
    ]

    def row(cells: list[str]) -> str:
        return " ".join(f"{c:{a}{w}}" for c, (_, w, a) in zip(cells, columns, strict=True))

    head = row([name for name, _, _ in columns])
    print(head)
    print("-" * len(head))
    for case in results["cases"]:
        for checkout, data in results["checkouts"].items():
            s = data["cases"].get(case, {}).get("summary", {})
            if "status" not in s:
                print(f"{case:<27} {checkout:<10} {s.get('error', '-')}")
                continue
            print(
                row(
                    [
                        case,
                        checkout,
                        s["status"] + ("!echo" if s.get("echoed") else ""),
                        f"{s['body_bytes'] / MIB:.2f}",
                        f"{s['shells_growth_mib']:,.1f}",
                        _x(s["growth_per_body_byte"]),
                        _f1(s["shells_cpu_ms"]),
                        _f1(s.get("core_cpu_ms")),
                        f"{_ms(s.get('kserve_worst_ms'))}/{_ms(s.get('kserve_solo_worst_ms'))}",
                        _x(s.get("kserve_worst_ratio")),
                        f"{_ms(s.get('api_worst_ms'))}/{_ms(s.get('api_solo_worst_ms'))}",
                        _x(s.get("api_worst_ratio")),
                        f"{_x(s.get('kserve_p99_ratio'))}/{_x(s.get('api_p99_ratio'))}",
                    ]
                )
            )


def _two_lines(name: str) -> str:
    """``name`` broken at the underscore nearest its middle."""
    cuts = [i for i, c in enumerate(name) if c == "_"]
    if not cuts:
        return name
    cut = min(cuts, key=lambda i: abs(i - len(name) / 2))
    return name[:cut] + "\n" + name[cut + 1 :]


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        progress("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(results["cases"])
    checkouts = list(results["checkouts"])
    panels = [
        ("growth_per_body_byte", "shells' peak growth / body bytes", 4.0),
        ("latency_worst_ratio", "another tenant: worst during / worst alone", 2.0),
        ("shells_cpu_ms", "shells' CPU per request (ms)", None),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 11), sharex=True)
    x = np.arange(len(cases))
    width = 0.8 / max(len(checkouts), 1)
    for ax, (key, title, target) in zip(axes, panels, strict=True):
        for i, checkout in enumerate(checkouts):
            summaries = [
                results["checkouts"][checkout]["cases"].get(c, {}).get("summary", {}) for c in cases
            ]
            values = [s.get(key) if s.get(key) is not None else np.nan for s in summaries]
            at = x + (i - (len(checkouts) - 1) / 2) * width
            ax.bar(at, [max(v, 1e-3) for v in values], width, color=f"C{i}", label=checkout)
            for xi, v, s in zip(at, values, summaries, strict=True):
                if not np.isnan(v):
                    ax.annotate(
                        s.get("status", ""),
                        (xi, max(v, 1e-3)),
                        ha="center",
                        va="bottom",
                        fontsize=6,
                    )
        if target is not None:
            ax.axhline(target, color="k", ls="--", lw=0.8, label=f"target {target:g}")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    axes[-1].set_xticks(x, [_two_lines(c) for c in cases], fontsize=7, rotation=30)
    fig.suptitle("API routes' door (issue 29): per case and checkout (labels: status)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    progress(f"plot written to {path}")


# ---- the run ---------------------------------------------------------------------------------


def parse_checkouts(given: list[str] | None) -> dict[str, Path]:
    if not given:
        return {"current": ROOT}
    out: dict[str, Path] = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--checkout NAME=PATH, got {item!r}")
        root = Path(path).resolve()
        if not (root / "fair_frontend").is_dir():
            raise SystemExit(f"--checkout {name}: no fair_frontend package in {root}")
        out[name] = root
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    sizes = QUICK if args.quick else FULL
    if args.reps is not None:
        sizes = dataclasses.replace(sizes, reps=args.reps)
    if args.window is not None:
        sizes = dataclasses.replace(sizes, window_s=args.window)
    if args.solo is not None:
        sizes = dataclasses.replace(sizes, solo_s=args.solo)
    checkouts = parse_checkouts(args.checkout)
    bounds = compute_bounds(shipped_config(ROOT), ROOT / "model_repository")
    if bounds.note:
        progress(bounds.note)
    cases = make_cases(sizes, bounds, args)
    if args.cases:
        wanted = args.cases.split(",")
        unknown = set(wanted) - {c.name for c in cases}
        if unknown:
            raise SystemExit(f"unknown cases: {', '.join(sorted(unknown))}")
        cases = [c for c in cases if c.name in wanted]
    out: dict[str, Any] = {
        "quick": args.quick,
        "workers": args.workers,
        "sizes": dataclasses.asdict(sizes),
        "bounds": dataclasses.asdict(bounds),
        "probe": {"tenant": PROBE_TENANT, "interval_s": PROBE_INTERVAL_S},
        "cases": {
            c.name: {"path": c.path, "senders": list(c.senders), "what": c.what} for c in cases
        },
        "checkouts": {},
    }
    for name, root in checkouts.items():
        out["checkouts"][name] = await run_checkout(name, root, cases, args, sizes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--checkout",
        action="append",
        metavar="NAME=PATH",
        help="a checkout to measure (repeatable, in this order); default: this tree",
    )
    parser.add_argument("--quick", action="store_true", help="smaller bodies, short windows")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="the frontend's shell processes (default 1: what `up` runs on 2 cores)",
    )
    parser.add_argument("--reps", type=int, help="requests measured for memory and CPU")
    parser.add_argument("--window", type=float, help="seconds of the probe beside the case")
    parser.add_argument("--solo", type=float, help="seconds of the probe alone")
    parser.add_argument(
        "--embed-tokens", type=int, default=512, help="tokens per input, largest_embeddings_*"
    )
    parser.add_argument(
        "--doc-tokens", type=int, default=128, help="tokens per document, largest_rerank_*"
    )
    parser.add_argument("--probe", nargs=3, help=argparse.SUPPRESS)  # HTTP GRPC CONNECTIONS
    args = parser.parse_args()
    if args.probe:
        import uvloop

        http, grpc_url, connections = args.probe
        uvloop.run(probe_main(http, grpc_url, int(connections)))
        return
    results = asyncio.run(main_async(args))
    report(results)
    name = "api_door_quick" if args.quick else "api_door"
    path = write_result(name, results)
    plot(results, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
