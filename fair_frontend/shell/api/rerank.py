"""Rerank as clients call it, translated onto the ``rerank`` model's KServe calls.

Two request shapes, one meaning (a query, its documents, how many results to return):

- Cohere v2, ``POST /v2/rerank`` (Cohere's SDK, ``ClientV2.rerank``): ``model``, ``query``,
  ``documents``, ``top_n`` (>= 1; absent: all), ``max_tokens_per_doc`` (>= 1; absent: as
  many as the pair has room for), ``priority`` (>= 0, lower is earlier), ``relevant_spans``
  (refused when enabled: a cross-encoder scores a pair, it finds no spans).
- Jina and vLLM, ``POST /v1/rerank``: ``model``, ``query``, ``documents``, ``top_n`` (absent
  or 0, vLLM's default: all), ``return_documents`` (default true, as Jina's).

Documents are strings, or objects holding a string ``text`` (Cohere v1's and Jina's other
form). Fields neither API defines are ignored, as vLLM's server ignores them; a field of
the wrong type or out of range is refused (``InvalidArgument``, 400) with a message naming
it. ``max_documents`` (default ``MAX_DOCUMENTS``, Cohere's limit) bounds a call.

What a route does, in order:

1. ``decode_cohere(raw)`` or ``decode_jina(raw)`` -> ``RerankCall``, from the body's bytes.
2. ``pair_rows(tokenizer, call.query, call.documents, call.max_tokens_per_doc,
   max_row_tokens)``: one row of token ids per document, ``[CLS] query [SEP] document
   [SEP]`` as the endpoint's tokenizer joins a pair. Tokenising costs time in proportion
   to the text (about 2 s per MiB): run it off the event loop for anything but a small
   call (``asyncio.to_thread``; ``tokens.TokenCounter`` shows how to keep one tenant to
   one thread at a time).
3. ``row_request(ids)`` per row: a KServe ``InferRequest`` for ONE document. Each goes to
   the scheduler as a call of its own, so that one tenant's 1,000-document call and
   another's 3-document call share the model row by row, by fair share, and each row
   costs its tokens.
4. ``row_logit(response)`` per answer, in document order.
5. ``cohere_response(call, logits, tokens)`` or ``jina_response(call, logits, tokens)``:
   results sorted by relevance, ``top_n`` of them, each logit mapped to ``[0, 1]`` with a
   sigmoid (``relevance``), as cross-encoder rerank servers do.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from tokenizers import Encoding, Tokenizer

from fair_frontend.errors import Internal, InvalidArgument
from fair_frontend.protocol import (
    INT64_MAX,
    InferRequest,
    InferResponse,
    RequestedOutput,
    Tensor,
)
from fair_frontend.shell.api.body import (
    ABSENT,
    Body,
    InvalidText,
    NotAnObject,
    NotJson,
    count,
    elements,
    kind,
)
from fair_frontend.tokens import load_tokenizer, max_token_bytes

RERANK_MODEL = "rerank"  # the Triton model (and endpoint) the rows go to
INPUT_IDS = "INPUT_IDS"
SCORE = "SCORE"
# Cohere's limit (its API refuses more than 10,000 documents per call); a route may set less.
MAX_DOCUMENTS = 10_000
# Cohere bills one search unit per query with up to 100 documents.
DOCUMENTS_PER_SEARCH_UNIT = 100
COHERE_API_VERSION = "2"
# Problems an error message lists (10,000 malformed documents make one line, not 10,000).
MAX_PROBLEMS = 5


# ---- requests -----------------------------------------------------------------------------
#
# A body is read from its bytes (``body.Body``): its members as raw JSON, each decoded when
# checked; ``documents`` is counted from its bytes and refused over ``max_documents``
# before one document is decoded. What is wrong is gathered field by field, in the order
# the fields are declared below, a document at a time, into one message of at most
# ``MAX_PROBLEMS`` of them (``Problems``): the first few are written, the rest counted.


class _CohereShape(msgspec.Struct):
    """Cohere's ``POST /v2/rerank`` body (``cohere.v2`` ``rerank``'s parameters)."""

    model: msgspec.Raw = ABSENT
    query: msgspec.Raw = ABSENT
    documents: msgspec.Raw = ABSENT
    top_n: msgspec.Raw = ABSENT
    max_tokens_per_doc: msgspec.Raw = ABSENT
    priority: msgspec.Raw = ABSENT
    relevant_spans: msgspec.Raw = ABSENT


class _JinaShape(msgspec.Struct):
    """Jina's and vLLM's ``POST /v1/rerank`` body."""

    model: msgspec.Raw = ABSENT
    query: msgspec.Raw = ABSENT
    documents: msgspec.Raw = ABSENT
    top_n: msgspec.Raw = ABSENT
    return_documents: msgspec.Raw = ABSENT
    priority: msgspec.Raw = ABSENT  # vLLM's: lower is earlier


class _TextDocumentShape(msgspec.Struct):
    """A document given as an object: its ``text`` (other keys are ignored)."""

    text: msgspec.Raw = ABSENT


class _TextDocument(msgspec.Struct):
    text: str


_DOCUMENTS = msgspec.json.Decoder(list[str | _TextDocument])


class _RelevantSpansShape(msgspec.Struct):
    mode: msgspec.Raw = ABSENT


RELEVANT_SPANS_MODES = ("enabled", "disabled")
_NOT_A_DOCUMENT = "must be a string, or an object with a string 'text'"


@dataclass(frozen=True)
class RerankCall:
    """A rerank request, checked, whichever API it came by."""

    model: str | None  # as the client named it (None: Jina/vLLM let it out)
    query: str
    documents: list[str]
    top_n: int  # results to return: 1..len(documents)
    max_tokens_per_doc: int | None  # None: as many as the pair has room for
    return_documents: bool  # Jina/vLLM: each result carries its document's text
    priority: int | None  # as sent (Cohere, vLLM: 0 is first, larger is later)


class Problems:
    """What is wrong with a body, field by field: the first ``MAX_PROBLEMS`` written, the
    rest only counted (10,000 malformed documents make one short line)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.count = 0

    def add(self, where: str, message: str) -> None:
        """``message`` about ``where``: "is required", or ": input should be ..."."""
        self.count += 1
        if len(self.lines) < MAX_PROBLEMS:
            self.lines.append(
                f"{where}{message}" if message.startswith(":") else f"{where} {message}"
            )

    def raise_any(self) -> None:
        if self.count:
            more = self.count - len(self.lines)
            raise InvalidArgument(
                "; ".join(self.lines) + (f"; and {more} more" if more > 0 else "")
            )


@contextlib.contextmanager
def _reading() -> Iterator[None]:
    """What reading a body raises about the whole of it, as the 400 it is."""
    try:
        yield
    except NotJson as err:
        raise InvalidArgument(f"the request body is not valid JSON: {err.detail}") from None
    except NotAnObject:
        raise InvalidArgument("the request body must be a JSON object") from None
    except InvalidText as err:
        why = f"the request body is not valid Unicode text: {err.reason}"
        raise InvalidArgument(why) from None


class _Fields:
    """One body's members, each read as one type (a problem noted where it is not one)."""

    def __init__(self, body: Body, shape: type[msgspec.Struct], problems: Problems) -> None:
        self.body = body
        self.problems = problems
        self.fields = body.object(shape)

    def raw(self, name: str) -> msgspec.Raw:
        raw: msgspec.Raw = getattr(self.fields, name)
        return raw

    def string(self, name: str, *, required: bool = True) -> str | None:
        raw = self.raw(name)
        if kind(raw) == "absent" or (kind(raw) == "null" and not required):
            if required:
                self.problems.add(name, "is required")
            return None
        return _text(self.body, raw, name, self.problems, ": input should be a valid string")

    def integer(self, name: str) -> int | None:
        raw = self.raw(name)
        if kind(raw) in ("absent", "null"):
            return None
        if kind(raw) != "integer":
            self.problems.add(name, ": input should be a valid integer")
            return None
        value: int = self.body.scalar(raw, name)
        return value

    def boolean(self, name: str, default: bool) -> bool:
        raw = self.raw(name)
        if kind(raw) == "absent":
            return default
        if kind(raw) != "boolean":
            self.problems.add(name, ": input should be a valid boolean")
            return default
        return bool(self.body.scalar(raw, name))

    def documents(self, max_documents: int) -> list[str]:
        """Each document's text; none decoded where there are more than ``max_documents``."""
        raw = self.raw("documents")
        if kind(raw) == "absent":
            self.problems.add("documents", "is required")
            return []
        if kind(raw) != "array":
            self.problems.add("documents", ": input should be a valid list")
            return []
        n = count(raw, max_documents)
        if n > max_documents:
            n = count(raw, 2**62)  # the whole count, for the message: a scan, nothing built
            self.problems.add("documents", f": {n} documents; at most {max_documents} per call")
            return []
        if self.body.marker is None:
            try:  # all well formed: at once
                given = _DOCUMENTS.decode(raw)
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass  # one at a time, to name each one that is not
            else:
                return [d if isinstance(d, str) else d.text for d in given]
        texts = []
        for i, item in enumerate(elements(raw)):
            where = f"documents[{i}]"
            if kind(item) == "object":
                item = self.body.object(_TextDocumentShape, item).text
            text = _text(self.body, item, where, self.problems, _NOT_A_DOCUMENT)
            texts.append(text or "")
        return texts

    def relevant_spans(self) -> str | None:
        """``relevant_spans.mode``; None where absent."""
        raw = self.raw("relevant_spans")
        if kind(raw) in ("absent", "null"):
            return None
        if kind(raw) != "object":
            self.problems.add(
                "relevant_spans",
                ": input should be a valid dictionary or instance of RelevantSpans",
            )
            return None
        mode = self.body.object(_RelevantSpansShape, raw).mode
        if kind(mode) == "absent":
            self.problems.add("relevant_spans.mode", "is required")
            return None
        where, wrong = "relevant_spans.mode", ": input should be 'enabled' or 'disabled'"
        value = _text(self.body, mode, where, self.problems, wrong)
        if value is not None and value not in RELEVANT_SPANS_MODES:
            self.problems.add(where, wrong)
            return None
        return value


def _text(body: Body, raw: msgspec.Raw, where: str, problems: Problems, wrong: str) -> str | None:
    """A string member (``wrong`` noted where it is not one; not valid text noted too)."""
    try:
        text = body.string(raw, where)
    except InvalidText as err:
        problems.add(where, f"is not valid Unicode text: {err.reason}")
        return None
    if text is None:
        problems.add(where, wrong)
    return text


def decode_cohere(raw: bytes, *, max_documents: int = MAX_DOCUMENTS) -> RerankCall:
    """A Cohere v2 rerank body, from its bytes -> ``RerankCall``; ``InvalidArgument``
    naming the fields that are malformed or out of range."""
    with _reading():
        return _cohere(Body(raw), max_documents)


def _cohere(body: Body, max_documents: int) -> RerankCall:
    problems = Problems()
    fields = _Fields(body, _CohereShape, problems)
    model = fields.string("model")
    query = fields.string("query")
    documents = fields.documents(max_documents)
    top_n = fields.integer("top_n")
    max_tokens_per_doc = fields.integer("max_tokens_per_doc")
    priority = fields.integer("priority")
    spans = fields.relevant_spans()
    problems.raise_any()
    assert query is not None
    if spans == "enabled":
        raise InvalidArgument(
            "relevant_spans: not supported by this model (it scores each document whole)"
        )
    if max_tokens_per_doc is not None and max_tokens_per_doc < 1:
        raise InvalidArgument(f"max_tokens_per_doc must be at least 1, got {max_tokens_per_doc}")
    _documents(documents)
    return RerankCall(
        model=model,
        query=_query(query),
        documents=documents,
        top_n=_top_n(top_n, len(documents), zero_is_all=False),
        max_tokens_per_doc=max_tokens_per_doc,
        return_documents=False,
        priority=_priority(priority),
    )


def decode_jina(raw: bytes, *, max_documents: int = MAX_DOCUMENTS) -> RerankCall:
    """A Jina/vLLM ``/v1/rerank`` body, from its bytes -> ``RerankCall``;
    ``InvalidArgument`` naming the fields that are malformed."""
    with _reading():
        return _jina(Body(raw), max_documents)


def _jina(body: Body, max_documents: int) -> RerankCall:
    problems = Problems()
    fields = _Fields(body, _JinaShape, problems)
    model = fields.string("model", required=False)
    query = fields.string("query")
    documents = fields.documents(max_documents)
    top_n = fields.integer("top_n")
    return_documents = fields.boolean("return_documents", True)
    priority = fields.integer("priority")
    problems.raise_any()
    assert query is not None
    _documents(documents)
    return RerankCall(
        model=model,
        query=_query(query),
        documents=documents,
        top_n=_top_n(top_n, len(documents), zero_is_all=True),
        max_tokens_per_doc=None,
        return_documents=return_documents,
        priority=_priority(priority),
    )


def parse_cohere(body: Any, *, max_documents: int = MAX_DOCUMENTS) -> RerankCall:
    """``decode_cohere`` of a body given as bytes, text, or the object ``json.loads`` made
    of it (written as JSON again)."""
    return decode_cohere(_encoded(body), max_documents=max_documents)


def parse_jina(body: Any, *, max_documents: int = MAX_DOCUMENTS) -> RerankCall:
    """``decode_jina`` of a body given as bytes, text, or the object ``json.loads`` made
    of it (written as JSON again)."""
    return decode_jina(_encoded(body), max_documents=max_documents)


def _encoded(body: Any) -> bytes:
    if isinstance(body, (bytes, bytearray, memoryview)):
        return bytes(body)
    if isinstance(body, str):
        return body.encode("utf-8", "surrogatepass")
    return json.dumps(body).encode()


def _documents(documents: Sequence[str]) -> None:
    if not documents:
        raise InvalidArgument("documents must hold at least one document")


def _query(query: str) -> str:
    if not query:
        raise InvalidArgument("query must not be empty")
    return query


def _top_n(top_n: int | None, documents: int, *, zero_is_all: bool) -> int:
    if top_n is None or (zero_is_all and top_n == 0):
        return documents
    if top_n < 1:
        lowest = "0 (all) or more" if zero_is_all else "at least 1"
        raise InvalidArgument(f"top_n must be {lowest}, got {top_n}")
    return min(top_n, documents)


def _priority(priority: int | None) -> int | None:
    if priority is not None and not 0 <= priority <= INT64_MAX:
        raise InvalidArgument(f"priority must be between 0 and {INT64_MAX}, got {priority}")
    return priority


# ---- token ids --------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def pair_tokenizer(path: str) -> Tokenizer:
    """The tokenizer in ``path`` as pairs are tokenised with it: a copy of
    ``tokens.load_tokenizer``'s (left as it is for token counts) that reads special tokens
    in a client's text as plain text, so that a document holding "[SEP]" cannot move the
    model's segment boundary; the template still adds the real ones."""
    tokenizer = Tokenizer.from_str(load_tokenizer(path).to_str())
    tokenizer.encode_special_tokens = True
    return tokenizer


def pair_rows(
    tokenizer_path: str,
    query: str,
    documents: Sequence[str],
    max_tokens_per_doc: int | None,
    max_row_tokens: int,
) -> list[np.ndarray]:
    """One INT32 row of token ids per document: the query and the document joined by the
    tokenizer's pair template (``[CLS] query [SEP] document [SEP]``), in document order.

    Each document is cut to ``max_tokens_per_doc`` tokens (None: no cut of its own), and
    further to what leaves the row within ``max_row_tokens`` (the model's ``max_model_len``);
    the query is never cut: a query that leaves no room for a document is refused
    (``InvalidArgument``), from its length in bytes alone where that proves it. Text that
    is not valid Unicode (a lone surrogate, which JSON can spell) is refused too.

    Pure and thread-safe: call it off the event loop for a large call. A document far
    longer than its cut is cut as text first, at the most text its kept tokens can span
    (``tokens.max_token_bytes``) plus one token, so its tail is never tokenised; the last
    word before that text cut may then tokenise differently than within the whole text.
    """
    tokenizer = pair_tokenizer(tokenizer_path)
    specials = tokenizer.num_special_tokens_to_add(is_pair=True)
    room = max_row_tokens - specials  # for the query and the document together
    widest = max_token_bytes(tokenizer_path)  # None: no bound from bytes to tokens
    if widest is not None:
        at_least = -(-len(query.encode("utf-8", "surrogatepass")) // widest)
        if at_least >= room:
            raise _query_too_long(at_least, room, max_row_tokens, exact=False)
    (q,) = _encode(tokenizer, [query], "query")
    if len(q.ids) >= room:
        raise _query_too_long(len(q.ids), room, max_row_tokens, exact=True)
    per_doc = room - len(q.ids)
    if max_tokens_per_doc is not None:
        per_doc = min(per_doc, max_tokens_per_doc)
    texts = list(documents)
    if widest is not None:
        cut = (per_doc + 1) * widest  # characters: each is at least one byte
        texts = [t[:cut] if len(t) > cut else t for t in texts]
    rows = []
    for d in _encode(tokenizer, texts, "documents"):
        d.truncate(per_doc)
        row = tokenizer.post_process(q, d, add_special_tokens=True)
        rows.append(np.asarray(row.ids, dtype=np.int32))
    return rows


def _encode(tokenizer: Tokenizer, texts: list[str], field: str) -> list[Encoding]:
    try:
        encodings: list[Encoding] = tokenizer.encode_batch(texts, add_special_tokens=False)
        return encodings
    except TypeError:  # the tokenizer takes valid Unicode only: find the text that is not
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                where = field if field == "query" else f"{field}[{i}]"
                raise InvalidArgument(f"{where} is not valid Unicode text: {err.reason}") from None
        raise


def _query_too_long(tokens: int, room: int, max_row_tokens: int, *, exact: bool) -> InvalidArgument:
    count = f"{tokens} tokens" if exact else f"at least {tokens} tokens"
    return InvalidArgument(
        f"query: {count}; this model reads at most {max_row_tokens} tokens per query and "
        f"document together, so a query may have at most {room - 1}"
    )


# ---- KServe calls -----------------------------------------------------------------------


def row_request(
    ids: np.ndarray,
    *,
    model: str = RERANK_MODEL,
    request_id: str = "",
    priority: int = 0,
    timeout_us: int | None = None,
) -> InferRequest:
    """The KServe request that scores ONE pair: ``INPUT_IDS`` INT32 ``[1, n]``, asking for
    ``SCORE`` only. ``priority`` and ``timeout_us`` are the request's own fields (Triton's
    convention: priority 0 = the default level, 1 = the highest)."""
    data = np.ascontiguousarray(ids, dtype=np.int32).reshape(1, -1)
    return InferRequest(
        model=model,
        id=request_id,
        inputs=[Tensor(INPUT_IDS, "INT32", (1, int(data.shape[1])), data)],
        outputs=[RequestedOutput(SCORE)],
        priority=priority,
        timeout_us=timeout_us,
    )


def row_logit(response: InferResponse) -> float:
    """The one logit of a ``row_request``'s answer; ``Internal`` if the model gave none."""
    out = next((t for t in response.outputs if t.name == SCORE), None)
    if out is None or out.data.size != 1:
        got = "none" if out is None else f"shape {list(out.shape)}"
        raise Internal(f"model '{response.model}' gave no single {SCORE} ({got})")
    logit = float(out.data.reshape(-1)[0])
    if not math.isfinite(logit):
        raise Internal(f"model '{response.model}' gave a {SCORE} that is not finite ({logit})")
    return logit


# ---- responses ----------------------------------------------------------------------------


def relevance(logit: float) -> float:
    """The logit as a relevance score in ``[0, 1]``: the sigmoid, computed without
    overflow at either end."""
    if logit >= 0:
        return 1.0 / (1.0 + math.exp(-logit))
    e = math.exp(logit)
    return e / (1.0 + e)


def ranking(logits: Sequence[float], top_n: int) -> list[int]:
    """Indices of the ``top_n`` most relevant documents, most relevant first; equal logits
    in document order. Sorted by logit, not by relevance: the sigmoid rounds large logits
    to the same 1.0."""
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    return order[: max(0, top_n)]


def new_response_id() -> str:
    return str(uuid.uuid4())


def cohere_response(
    call: RerankCall,
    logits: Sequence[float],
    input_tokens: int,
    *,
    response_id: str | None = None,
) -> dict[str, Any]:
    """Cohere v2's rerank response (``cohere.v2.types.V2RerankResponse``): ``results``
    ``{index, relevance_score}`` most relevant first, ``call.top_n`` of them; ``meta`` with
    the API version, the search units Cohere would bill (one per 100 documents) and the
    input tokens (``input_tokens``: the sum of the rows' lengths)."""
    _check_logits(call, logits)
    results = [
        {"index": i, "relevance_score": relevance(logits[i])} for i in ranking(logits, call.top_n)
    ]
    units = -(-len(call.documents) // DOCUMENTS_PER_SEARCH_UNIT)
    return {
        "id": response_id or new_response_id(),
        "results": results,
        "meta": {
            "api_version": {"version": COHERE_API_VERSION},
            "billed_units": {"search_units": units},
            "tokens": {"input_tokens": input_tokens, "output_tokens": 0},
        },
    }


def jina_response(
    call: RerankCall,
    logits: Sequence[float],
    total_tokens: int,
    *,
    model: str = RERANK_MODEL,
    response_id: str | None = None,
) -> dict[str, Any]:
    """Jina's and vLLM's rerank response: ``results`` ``{index, relevance_score}`` most
    relevant first, ``call.top_n`` of them, each with ``document: {text}`` when
    ``call.return_documents``; ``usage.total_tokens``. ``model``: the name to report (the
    client's, where it named one)."""
    _check_logits(call, logits)
    results = []
    for i in ranking(logits, call.top_n):
        result: dict[str, Any] = {"index": i, "relevance_score": relevance(logits[i])}
        if call.return_documents:
            result["document"] = {"text": call.documents[i]}
        results.append(result)
    return {
        "id": response_id or new_response_id(),
        "model": call.model or model,
        "usage": {"total_tokens": total_tokens},
        "results": results,
    }


def _check_logits(call: RerankCall, logits: Sequence[float]) -> None:
    if len(logits) != len(call.documents):
        raise Internal(f"{len(logits)} scores for {len(call.documents)} documents")
