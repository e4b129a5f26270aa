"""The OpenAI routes of the HTTP shell: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, ``/v1/models``. Each reads and checks its body, translates it
(``fair_frontend.shell.api.openai``) and calls the same ``Gateway`` as the KServe routes: the
same identity, model access, validation, fair scheduling and limits, and one counted,
logged outcome per request (``Gateway.rejected`` for what is refused before the gateway).

Every route enters through the shell's door (``shell.door``), as the KServe routes do:
the key and the global queue from the headers before a byte of the body is read; the
model from the body's top-level ``"model"``, found by a scan of its first bytes as they
arrive; the name's length and the tenant's access to it checked before the rest of the
body is read, and the rest read against that model's own bound; then the body decoded
through the route's seam (``openai.decode_chat`` ..., ``rerank.decode_cohere`` ...), off
the event loop when large. Nothing is parsed for a model the tenant may not call.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import re
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any, TypeVar

from aiohttp import web

from fair_frontend.auth import Identity
from fair_frontend.errors import FrontendError, InvalidArgument, QuotaExhausted
from fair_frontend.protocol import InferRequest, InferResponse
from fair_frontend.quota import Quota, quota_headers
from fair_frontend.shell.api import openai, rerank
from fair_frontend.shell.door import Door
from fair_frontend.shell.gateway import Gateway, Precharge
from fair_frontend.tokens import (
    at_least_tokens,
    load_tokenizer,
    max_token_bytes,
    text_of,
    utf8_size,
)
from fair_frontend.usage import Usage

_R = TypeVar("_R", bound=web.StreamResponse)
_T = TypeVar("_T")


class ApiRoutes:
    """OpenAI's routes on ``shell``'s app (an ``HttpShell``: its body reading and door)."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell

    @property
    def gateway(self) -> Gateway:
        gateway: Gateway = self.shell.gateway
        return gateway

    def add(self, router: web.UrlDispatcher, expect: Callable[..., Any]) -> None:
        router.add_post("/v1/chat/completions", self.chat, expect_handler=expect)
        router.add_post("/v1/completions", self.completions, expect_handler=expect)
        router.add_post("/v1/embeddings", self.embeddings, expect_handler=expect)
        router.add_post("/v2/rerank", self.cohere_rerank, expect_handler=expect)
        router.add_post("/v1/rerank", self.jina_rerank, expect_handler=expect)
        router.add_get("/v1/models", self.models)
        router.add_get("/v1/models/{model}", self.model)

    @property
    def door(self) -> Door:
        door: Door = self.shell.door
        return door

    # ---- completions -------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, openai.decode_chat, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, openai.decode_completion, "text_completion")

    async def _generate(
        self, request: web.Request, decode: Callable[..., openai.Generation], operation: str
    ) -> web.StreamResponse:
        gateway = self.gateway
        try:
            async with self.door.body(request) as p:
                gen = await p.decode(decode, p.headers, gateway.config)
                p.named(gen.model)
                gen.service_tier = openai.tier_used(gen, gateway.config, p.tenant)
                plan = await gateway.plan(p.model)
                req = openai.engine_request(gen, plan)
        except FrontendError as err:
            return error_response(err)
        usage = Usage()
        output = plan.token_output
        assert output is not None  # engine_request checked it
        replies = gateway.stream_infer(
            req, p.headers, p.known, usage=usage, operation=operation, wire="events"
        )
        try:
            if gen.stream:
                return await self._stream(request, gen, replies, usage, output)
            return await self._whole(gen, replies, usage, output)
        except FrontendError as err:
            return error_response(err)
        finally:
            # Closing cancels the request in the core (a stop string, a client gone):
            # its stream to Triton ends and its engine slot is free at once.
            await replies.aclose()

    async def _whole(
        self,
        gen: openai.Generation,
        replies: AsyncGenerator[InferResponse, None],
        usage: Usage,
        output: str,
    ) -> web.Response:
        scanner = openai.StopScanner(gen.stop)
        parts = []
        quota = None
        async for resp in replies:
            quota = resp.quota
            parts.append(scanner.feed(_text(resp, output)))
            if scanner.stopped:
                break
        parts.append(scanner.flush())
        body = openai.completion_body(gen, "".join(parts), openai.finish_reason(scanner), usage)
        return _with_quota(web.json_response(body), quota)

    async def _stream(
        self,
        request: web.Request,
        gen: openai.Generation,
        replies: AsyncGenerator[InferResponse, None],
        usage: Usage,
        output: str,
    ) -> web.StreamResponse:
        """Server-sent events as OpenAI sends them. A request refused before its first
        token gets a plain error (its status); an error later is one ``error`` event,
        under the 200 already sent, and the stream ends without ``[DONE]``."""
        try:
            first: InferResponse | None = await anext(replies)
        except StopAsyncIteration:
            first = None
        out = EventStream(headers={"Cache-Control": "no-cache"})
        _with_quota(out, first.quota if first is not None else None)
        out.content_type = "text/event-stream"
        await out.prepare(request)
        scanner = openai.StopScanner(gen.stop)
        around = openai.token_events(gen)
        # What is ready goes in one write, before waiting for more: the role chunk with
        # the first tokens, the last tokens with the finish, usage, [DONE] and the body's
        # end.
        ready = [openai.sse(openai.chunk(gen, "" if gen.chat else None, first=True))]
        try:
            pending = [first] if first is not None else []
            while True:
                if pending:
                    resp: InferResponse | None = pending.pop()
                else:
                    if ready:
                        await out.write(b"".join(ready))
                        ready.clear()
                    resp = await anext(replies, None)
                if resp is None:
                    break
                quoted = _quoted(resp.wire, output) if resp.wire and not scanner.stops else None
                if quoted is not None:  # Triton's own JSON of the text, as it came
                    if quoted:
                        ready.append(b'%s"%s"%s' % (around[0], quoted, around[1]))
                    continue
                text = scanner.feed(_text(resp, output))
                if text:
                    ready.append(openai.token_event(around, text))
                if scanner.stopped:
                    break
            rest = scanner.flush()
            if rest:
                ready.append(openai.token_event(around, rest))
        except FrontendError as err:
            ready.append(openai.sse(openai.envelope(err)[1]))
            await out.write_eof(b"".join(ready))
            return out
        reason = openai.finish_reason(scanner)
        ready.append(openai.sse(openai.chunk(gen, None, reason)))
        if gen.include_usage:
            ready.append(openai.sse(openai.chunk(gen, None, usage=usage)))
        ready.append(openai.SSE_DONE)
        await out.write_eof(b"".join(ready))
        return out

    # ---- embeddings ----------------------------------------------------------------------

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """One request per input (``openai.row_request``): the fair batches take each
        input as its own row, so a tenant's list of 2,048 waits its turn row by row beside
        another's single input. The first counts against the request limits, all of them
        against the token limits."""
        gateway = self.gateway
        try:
            async with self.door.body(request) as p:
                plan = await gateway.plan(p.model)
                info = plan.info
                context = plan.bounds.max_model_len
                call = await p.decode(openai.decode_embeddings, context)
                p.named(call.model)
                headers, known, model, started = p.headers, p.known, p.model, p.started
                name = openai.embedding_input(plan)
                companions = openai.embedding_companions(plan)
                output = openai.embedding_output(info, model)
                rows: Sequence[Any] | None = call.ids  # int32 arrays, or lists from texts
                paid: Precharge | None = None
                if rows is None:
                    # A row of n token ids is 4n bytes of the request's tensors at least.
                    most = plan.bounds.payload_bytes // 4
                    tenant = known.tenant if known is not None else None
                    texts = call.texts or []
                    rows, paid = await _token_ids(
                        gateway, tenant, plan.tokenizer, texts, model, most
                    )
        except FrontendError as err:
            return error_response(err)
        datatype = info.inputs[name].datatype
        rid = f"embd-{uuid.uuid4().hex}"
        reqs = await _off_loop(
            len(rows) > OFF_LOOP_PARTS,
            lambda: [
                openai.row_request(model, name, datatype, row, output, f"{rid}-{i}", companions)
                for i, row in enumerate(rows)
            ],
        )
        try:
            answers, usage = await self._parts(reqs, headers, known, "embeddings", started, paid)
            vectors = [next(t.data for t in a.outputs if t.name == output) for a in answers]
            numbers = sum(int(v.size) for v in vectors)
            response = await _json_answer(
                numbers > OFF_LOOP_NUMBERS, lambda: openai.embeddings_body(call, vectors, usage)
            )
            return _with_quota(response, answers[-1].quota)
        except FrontendError as err:
            return error_response(err)

    async def _parts(
        self,
        reqs: list[InferRequest],
        headers: Mapping[str, str],
        known: Identity | None,
        operation: str,
        started: float,
        paid: Precharge | None = None,
    ) -> tuple[list[InferResponse], Usage]:
        """``reqs`` (the parts of one API call, a row each) as one call of parts, admitted
        or refused whole before any part queues (``Gateway.infer_group``): their answers
        in order, and what they used together. The call counts once against the requests
        limits, every part against the tokens limits (less what its precharge counted,
        ``paid``, where its texts were tokenised: ``_token_ids``); the first failure cancels the
        others and is raised (the call gets one answer; ``reqs`` is never empty). Traced,
        the call is one span (``operation``, from ``started``) over its parts'
        (``Gateway.operation``)."""
        gateway = self.gateway
        usages = [Usage() for _ in reqs]
        with gateway.operation(operation, reqs[0].model, headers, started) as span:
            answers = await gateway.infer_group(reqs, headers, known, usages=usages, paid=paid)
            used = Usage(
                sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
            )
            if span is not None:
                span.set_attribute("gen_ai.usage.input_tokens", used.prompt_tokens)
        return answers, used

    # ---- rerank ---------------------------------------------------------------------------

    async def cohere_rerank(self, request: web.Request) -> web.StreamResponse:
        """Cohere's v2 rerank; errors as Cohere answers them, ``{"message": ...}``."""
        return await self._rerank(request, rerank.decode_cohere, cohere=True)

    async def jina_rerank(self, request: web.Request) -> web.StreamResponse:
        """Jina's and vLLM's rerank; errors in OpenAI's envelope, as vLLM answers them."""
        return await self._rerank(request, rerank.decode_jina, cohere=False)

    async def _rerank(
        self, request: web.Request, decode: Callable[..., rerank.RerankCall], *, cohere: bool
    ) -> web.StreamResponse:
        """One call per document (``rerank.row_request``): the fair batches take a
        1,000-document call row by row, beside another tenant's 3-document call. Cohere
        requires ``model``; Jina and vLLM default it to ``rerank.RERANK_MODEL``."""
        gateway = self.gateway
        answer_error = cohere_error if cohere else error_response
        default = None if cohere else rerank.RERANK_MODEL
        try:
            async with self.door.body(request, default) as p:
                call = await p.decode(decode)
                p.named(call.model, default)
                headers, known, model, started = p.headers, p.known, p.model, p.started
                plan = await gateway.plan(model)
                info, tokenizer = plan.info, plan.tokenizer
                if rerank.SCORE not in info.outputs or rerank.INPUT_IDS not in info.inputs:
                    raise openai.unsupported(model, "does not rerank (it gives no SCORE)")
                if tokenizer is None:
                    raise openai.unsupported(model, "has no tokenizer to join query and document")
                longest = (
                    info.max_model_len or plan.endpoint.max_model_len or openai.DEFAULT_ROW_TOKENS
                )
                rows, paid = await _pair_rows(gateway, p.tenant, model, tokenizer, call, longest)
        except FrontendError as err:
            return answer_error(err)
        rid = rerank.new_response_id()
        levels = gateway.config.priority_levels
        # Cohere and vLLM: 0 is the first; Triton's: 1 is the highest, 0 the default.
        level = 0 if call.priority is None else min(call.priority + 1, levels)
        many = len(rows) > OFF_LOOP_PARTS
        reqs = await _off_loop(
            many,
            lambda: [
                rerank.row_request(ids, model=model, request_id=f"{rid}-{i}", priority=level)
                for i, ids in enumerate(rows)
            ],
        )
        try:
            answers, usage = await self._parts(reqs, headers, known, "rerank", started, paid)
            logits = [rerank.row_logit(a) for a in answers]
            tokens = usage.prompt_tokens

            def body() -> dict[str, Any]:
                if cohere:
                    return rerank.cohere_response(call, logits, tokens, response_id=rid)
                return rerank.jina_response(call, logits, tokens, model=model, response_id=rid)

            return _with_quota(await _json_answer(many, body), answers[-1].quota)
        except FrontendError as err:
            return answer_error(err)

    # ---- models ----------------------------------------------------------------------------

    def _listed(self, request: web.Request) -> list[str]:
        """The configured models the caller's tenant may call (401/403 without a valid
        key)."""
        gateway = self.gateway
        tenant = gateway.auth.identify(_headers(request), None)
        return [m for m in sorted(gateway.config.endpoints) if gateway.access.allows(tenant, m)]

    async def models(self, request: web.Request) -> web.Response:
        try:
            names = self._listed(request)
        except FrontendError as err:
            return error_response(err)
        return web.json_response({"object": "list", "data": [openai.model_entry(m) for m in names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        try:
            if name not in self._listed(request):
                raise openai.ModelNotFound(name)
        except FrontendError as err:
            return error_response(err)
        return web.json_response(openai.model_entry(name))


# What is done on a worker thread rather than the event loop, above these: the requests of
# an API call's parts and its answer (10,000 rerank rows take about 0.3 s to make; the JSON
# of 2,048 embeddings of 128 numbers about 0.4 s to write), which on the loop would hold
# every other client of this shell that long.
OFF_LOOP_PARTS = 64
OFF_LOOP_NUMBERS = 2048


async def _off_loop(large: bool, work: Callable[[], _T]) -> _T:
    """``work()``: on a worker thread when ``large``, here otherwise (where the hop to a
    thread would cost more than the work)."""
    return await asyncio.to_thread(work) if large else work()


async def _json_answer(large: bool, build: Callable[[], Any]) -> web.Response:
    """The JSON answer ``build`` makes, made and written off the loop when ``large``."""
    text = await _off_loop(large, lambda: json.dumps(build()))
    return web.json_response(text=text)


def error_response(err: FrontendError) -> web.Response:
    """OpenAI's error envelope with its status (``openai.envelope``) and Retry-After."""
    status, body = openai.envelope(err)
    return web.Response(
        status=status,
        body=json.dumps(body).encode(),
        content_type="application/json",
        headers=error_headers(err),
    )


def error_headers(err: FrontendError) -> dict[str, str]:
    """An error's headers: ``Retry-After``, the tenant's quota where the core checked it
    (``x-ratelimit-*``), and ``x-should-retry: false`` for an allowance used up (OpenAI's
    SDKs retry every other 429)."""
    headers = quota_headers(err.quota) if err.quota is not None else {}
    if err.retry_after_header is not None:
        headers["Retry-After"] = err.retry_after_header
    if isinstance(err, QuotaExhausted):
        headers["x-should-retry"] = "false"
    return headers


def cohere_error(err: FrontendError) -> web.Response:
    """Cohere's error body, ``{"message": ...}``, with the status its SDK maps to its
    errors (400, 401, 403, 404, 429 ``TooManyRequestsError``, 503) and Retry-After."""
    status, body = openai.envelope(err)
    return web.Response(
        status=status,
        body=json.dumps({"message": body["error"]["message"]}).encode(),
        content_type="application/json",
        headers=error_headers(err),
    )


class EventStream(web.StreamResponse):
    """A stream of server-sent events whose head goes out with its first event, in one
    write (aiohttp's ``web.Response`` holds its head so; a ``StreamResponse`` writes it at
    ``prepare``): a stream is prepared once its first event is there."""

    _send_headers_immediately = False


def _with_quota(response: _R, quota: Quota | None) -> _R:
    """``response`` with the tenant's ``x-ratelimit-*`` headers (a call of several parts:
    the state after its last part's check)."""
    if quota is not None:
        response.headers.update(quota_headers(quota))
    return response


def _headers(request: web.Request) -> dict[str, str]:
    from fair_frontend.auth import identity_headers

    return identity_headers(request.headers.items(), request.remote)


def _text(resp: InferResponse, output: str) -> str:
    """The text a response carries in ``output``: one or more of Triton's generate events
    (``InferResponse.wire``: the texts of those that came together, as one), else its
    tensors."""
    if resp.wire:
        return "".join(_event_text(e, output) for e in resp.wire.split(b"\n\n") if e)
    for t in resp.outputs:
        if t.name == output:
            return "".join(text_of(e) for e in t.data.flat)
    return ""


def _quoted(events: bytes, output: str) -> bytes | None:
    """``output``'s text in Triton's generate events (``InferResponse.wire``) as JSON
    writes it inside a string, those of all the events joined (a chunk's text, quotes
    added), where each event carries it as a string of ASCII: no decoding and encoding
    again per token. Else None: ``_text`` decodes them (a list, text that is not UTF-8,
    whose replacement characters JSON then writes as Python does)."""
    found = _string_pattern(output).findall(events)
    if len(found) != events.count(b"\n\n"):
        return None
    joined = b"".join(found)
    return joined if joined.isascii() else None


@functools.cache
def _string_pattern(output: str) -> re.Pattern[bytes]:
    """``"output":"..."``: the string's bytes, escapes and all (in a string, a quote is
    escaped: the key's text there is not the key)."""
    return re.compile(re.escape(json.dumps(output).encode()) + rb':"((?:[^"\\]|\\.)*)"')


def _event_text(event: bytes, output: str) -> str:
    """``output`` of one of Triton's generate events (``data: {...}``): a string, or the
    strings of a list, joined (text that is not UTF-8 replaced, as ``text_of`` does)."""
    value = json.loads(event[len(b"data: ") :].decode("utf-8", errors="replace")).get(output, "")
    return "".join(map(str, value)) if isinstance(value, list) else str(value)


async def _token_ids(
    gateway: Gateway,
    tenant: str | None,
    tokenizer: str | None,
    texts: list[str],
    model: str,
    most_tokens: int,
) -> tuple[list[list[int]], Precharge | None]:
    """Each text's token ids with the endpoint's tokenizer, none longer than the model's
    context (``max_model_len``) or ``most_tokens``, and what was charged for them before.

    Nothing is tokenised that its bytes prove too long: each token covers at most
    ``tokens.max_token_bytes`` of text, so a text of more bytes than the context holds
    of them is refused untokenised (``at least N tokens``). A call of more than a little
    text (``INLINE_TOKENIZE_BYTES``) then pays before its tokenising: the tokens its
    texts have at least are counted against its tenant's limits (``Gateway.precharge``:
    a 429 there tokenises nothing, and a call refused after its tokenising has paid for
    it), and it is tokenised off the event loop in its tenant's turns
    (``TokenCounter.map``, a piece of texts at a time)."""
    if tokenizer is None:
        raise openai.ParamError(
            "input", f"model '{model}' takes token ids only (it has no tokenizer): send them"
        )
    most = await _context(gateway, model, most_tokens)
    widest = max_token_bytes(tokenizer)
    sizes = [utf8_size(t) for t in texts]
    for i, size in enumerate(sizes):
        least = at_least_tokens(size, widest)
        if least > most:
            raise openai.ParamError(
                "input",
                f"input[{i}] is at least {least} tokens; model '{model}' takes at most "
                f"{most} in one input",
            )
    pool = gateway.tokens
    paid = None
    if sum(sizes) <= pool.inline_bytes:
        rows = _encode(tokenizer, texts, 0)
    else:
        least = sum(at_least_tokens(size, widest) for size in sizes)
        paid = await gateway.precharge(tenant, model, least)
        pieces = pool.pieces(texts, sizes)
        starts = itertools.accumulate((len(p) for p in pieces[:-1]), initial=0)
        jobs = [(_encode, tokenizer, p, start) for p, start in zip(pieces, starts, strict=True)]
        done = await pool.map(tenant, jobs)
        rows = [ids for piece in done for ids in piece]
    for i, ids in enumerate(rows):
        if len(ids) > most:
            raise openai.ParamError(
                "input", f"input[{i}] is {len(ids)} tokens; model '{model}' takes at most {most}"
            )
    return rows, paid


def _encode(tokenizer: str, texts: list[str], first: int) -> list[list[int]]:
    """Token ids of ``texts`` (inputs ``first`` on); a text that is not valid Unicode (a
    lone surrogate, which JSON can spell) refused naming its input."""
    try:
        encoded = load_tokenizer(tokenizer).encode_batch(texts, add_special_tokens=False)
    except TypeError:  # the tokenizer takes valid Unicode only: find the text that is not
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise openai.ParamError(
                    "input", f"input[{first + i}] is not valid Unicode text: {err.reason}"
                ) from None
        raise
    return [e.ids for e in encoded]


async def _context(gateway: Gateway, model: str, most: int) -> int:
    """The most tokens one row of ``model`` takes: its context (``max_model_len``, the
    endpoint's or the model config's), and at most ``most``."""
    context = (await gateway.plan(model)).bounds.max_model_len
    return most if context is None else min(most, context)


async def _pair_rows(
    gateway: Gateway,
    tenant: str | None,
    model: str,
    tokenizer: str,
    call: rerank.RerankCall,
    longest: int,
) -> tuple[list[Any], Precharge | None]:
    """A rerank's rows (``rerank.pair_rows``: the query and each document, joined), none
    longer than ``longest``, and what was charged for them before. A query whose bytes
    prove it leaves no room for a document is refused untokenised; documents are cut to
    what the row has room for (as text first: their tails are never tokenised). A call
    of more than a little text pays before its tokenising (the tokens its rows have at
    least, against its tenant's limits: ``Gateway.precharge``) and is tokenised in its
    tenant's turns, some documents at a time (``TokenCounter.map``)."""
    widest = max_token_bytes(tokenizer)
    specials = rerank.pair_tokenizer(tokenizer).num_special_tokens_to_add(is_pair=True)
    room = longest - specials  # for the query and a document together
    query = at_least_tokens(utf8_size(call.query), widest)
    if query >= room:
        raise InvalidArgument(
            f"query: at least {query} tokens; this model reads at most {longest} tokens per "
            f"query and document together, so a query may have at most {room - 1}"
        )
    per_doc = room if call.max_tokens_per_doc is None else call.max_tokens_per_doc
    # What a document's row can take of it, as text: its kept tokens' most, and one more.
    cut = (min(room, per_doc) + 1) * widest if widest else None
    sizes = [len(d) if cut is None else min(len(d), cut) for d in call.documents]
    pool = gateway.tokens
    args = (tokenizer, call.query)
    if len(call.query) + sum(sizes) <= pool.inline_bytes:
        return rerank.pair_rows(*args, call.documents, call.max_tokens_per_doc, longest), None
    # Each row is the specials, the query and as much of its document as fits: at least
    # this much of each, whatever the query's own count turns out to be.
    # (A document's characters are at most its bytes: a lower bound of its tokens too.)
    least = sum(
        specials + min(query + at_least_tokens(size, widest), room, query + per_doc)
        for size in sizes
    )
    paid = await gateway.precharge(tenant, model, least)
    pieces = pool.pieces(call.documents, sizes)
    starts = itertools.accumulate((len(p) for p in pieces[:-1]), initial=0)
    jobs = [
        (_pair_piece, *args, p, call.max_tokens_per_doc, longest, start)
        for p, start in zip(pieces, starts, strict=True)
    ]
    done = await pool.map(tenant, jobs)
    return [row for piece in done for row in piece], paid


def _pair_piece(
    tokenizer: str,
    query: str,
    documents: list[str],
    max_tokens_per_doc: int | None,
    longest: int,
    first: int,
) -> list[Any]:
    """``rerank.pair_rows`` of a piece of a call's documents (its ``first`` on): a
    document that is not valid Unicode named by its index in the call."""
    try:
        return rerank.pair_rows(tokenizer, query, documents, max_tokens_per_doc, longest)
    except InvalidArgument:
        for i, text in enumerate(documents):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise InvalidArgument(
                    f"documents[{first + i}] is not valid Unicode text: {err.reason}"
                ) from None
        raise
