"""The OpenAI routes (``/v1/...``) with the real ``openai`` SDK against a real frontend and
Triton: chat and completions (whole and streamed, ``include_usage``, ``stop``), embeddings,
models, OpenAI's error envelope and the statuses its SDK branches on, service tiers, and
usage as the frontend counted it (responses, KServe response parameters, request log).

Answers are checked against what the same model says over the KServe routes (greedy
decoding: the same text), and usage against the tokenizer the frontend counts with.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np
import openai
import pytest
import tritonclient.http as httpclient
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam
from tokenizers import Tokenizer

from fair_frontend.config import parse_config
from fair_frontend.kit.testing import aeventually, eventually
from fair_frontend.observability.logs import REQUEST_LOGGER
from fair_frontend.shell.api.openai import CHAT_ANSWER, CHAT_TEMPLATE
from tests.support import KEYS, RunningFrontend, config_dict, running_frontend

MAX_TOKENS = 8


def _config() -> Any:
    data = config_dict()
    data["endpoints"]["embed"]["tokenizer"] = data["endpoints"]["llm"]["tokenizer"]
    # Model access as the example has it (trial: no llm); limits for the 429 tests.
    data["tier_models"] = {
        "enterprise": ["embed", "generate", "llm"],
        "standard": ["embed", "generate", "llm"],
        "trial": ["embed", "generate"],
    }
    data["tenants"]["initech"]["limits"] = {"llm": {"requests_per_minute": 1}}
    data["tenants"]["hooli"]["limits"] = {"llm": {"requests_per_day": 1}}
    # The request log's lines are read here, in the core's process, in both modes (where
    # shell processes write them, the default: tests/test_one_hop.py).
    data["observability"] = {"request_log": "core"}
    return parse_config(data)


@pytest.fixture(scope="module")
def api(triton: Any, workers: int) -> Iterator[RunningFrontend]:
    with running_frontend(_config(), triton, workers=workers) as running:
        yield running


def client(running: RunningFrontend, tenant: str = "acme", **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{running.http_url}/v1", api_key=KEYS[tenant], max_retries=0, **kw
    )


def tokenizer(running: RunningFrontend) -> Tokenizer:
    path = running.server.config.endpoints["llm"].tokenizer
    assert path is not None
    return Tokenizer.from_file(path)


def chat_prompt(messages: list[ChatCompletionMessageParam]) -> str:
    return "".join(CHAT_TEMPLATE.format(**m) for m in messages) + CHAT_ANSWER


def kserve_text(running: RunningFrontend, prompt: str, max_tokens: int) -> str:
    """The same model's greedy answer over Triton's generate extension, through the
    frontend (not streamed: the whole text, the prompt excluded)."""
    body = {
        "text_input": prompt,
        "exclude_input_in_output": True,
        "sampling_parameters": json.dumps({"max_tokens": max_tokens, "temperature": 0}),
    }
    req = urllib.request.Request(
        f"http://{running.http_url}/v2/models/llm/generate",
        data=json.dumps(body).encode(),
        headers={"x-api-key": KEYS["acme"], "content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return str(json.loads(resp.read())["text_output"])


MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three rivers of Europe."},
]


def test_chat_answers_as_the_model_does_with_usage_as_counted(api: RunningFrontend) -> None:
    reply = client(api).chat.completions.create(
        model="llm",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    prompt = chat_prompt(MESSAGES)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == kserve_text(api, prompt, MAX_TOKENS)
    assert reply.choices[0].finish_reason == "length"  # no EOS: it runs to max_tokens
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(tokenizer(api).encode(prompt).ids)
    assert reply.usage.completion_tokens == MAX_TOKENS
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + MAX_TOKENS
    assert reply.service_tier == "default"


def test_chat_stream_with_usage_chunk_and_done(api: RunningFrontend) -> None:
    stream = client(api).chat.completions.create(
        model="llm",
        messages=MESSAGES,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)  # the SDK ends at "data: [DONE]"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == kserve_text(api, chat_prompt(MESSAGES), MAX_TOKENS)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and not any(finals[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == MAX_TOKENS
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_cuts_the_text_and_the_generation(api: RunningFrontend) -> None:
    # Long enough that the engine cannot finish before the cancel reaches it (the stop
    # string comes a third of the way in): with 48 tokens, a loaded machine (three test
    # runs at once) counted all 48 produced.
    long = 400
    whole = kserve_text(api, chat_prompt(MESSAGES), long)
    stop = whole[len(whole) // 3 : len(whole) // 3 + 3]
    for stream in (False, True):
        asked: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
        made = client(api).chat.completions.create(
            model="llm",
            messages=MESSAGES,
            max_tokens=long,
            temperature=0,
            stop=[stop],
            stream=stream,
            **asked,
        )
        text: str | None  # a whole reply's content may be None
        if stream:
            assert isinstance(made, openai.Stream)
            chunks = list(made)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            assert isinstance(made, ChatCompletion)
            text = made.choices[0].message.content
            reason = made.choices[0].finish_reason
            usage = made.usage
        assert text == whole[: whole.find(stop)]
        assert reason == "stop"
        # The generation was cancelled there: fewer tokens than asked for were relayed.
        assert usage is not None and usage.completion_tokens < long


def test_completions_whole_and_streamed(api: RunningFrontend) -> None:
    prompt = "The quick brown fox"
    expected = kserve_text(api, prompt, MAX_TOKENS)
    whole = client(api).completions.create(
        model="llm", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    assert whole.object == "text_completion"
    assert whole.choices[0].text == expected
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(tokenizer(api).encode(prompt).ids)
    parts = client(api).completions.create(
        model="llm", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in parts if c.choices) == expected


def test_embeddings_texts_ids_and_base64_match_the_model(api: RunningFrontend) -> None:
    texts = ["a short one", "a somewhat longer sentence to embed here"]
    got = client(api).embeddings.create(model="embed", input=texts)
    ids = [tokenizer(api).encode(t, add_special_tokens=False).ids for t in texts]
    triton = httpclient.InferenceServerClient(api.http_url)
    for i, row in enumerate(ids):
        data = np.array([row], dtype=np.int32)
        inp = httpclient.InferInput("INPUT_IDS", list(data.shape), "INT32")
        inp.set_data_from_numpy(data)
        direct = triton.infer("embed", [inp], headers={"x-api-key": KEYS["acme"]})
        np.testing.assert_allclose(
            got.data[i].embedding, direct.as_numpy("EMBEDDING")[0], rtol=1e-5
        )
        assert got.data[i].index == i
    assert got.usage.prompt_tokens == sum(len(r) for r in ids)
    by_ids = client(api).embeddings.create(model="embed", input=ids[1])
    # The same row, batched beside another (a call's inputs queue together) or alone:
    # equal within float32's rounding of a differently shaped batch.
    np.testing.assert_allclose(by_ids.data[0].embedding, got.data[1].embedding, rtol=1e-5)
    packed = client(api).embeddings.with_raw_response.create(
        model="embed", input=texts[0], encoding_format="base64"
    )
    raw = json.loads(packed.http_response.text)["data"][0]["embedding"]
    floats = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    np.testing.assert_allclose(floats, got.data[0].embedding, rtol=1e-5)  # (alone, as above)
    short = client(api).embeddings.create(model="embed", input=texts[0], dimensions=16)
    assert len(short.data[0].embedding) == 16
    assert np.linalg.norm(short.data[0].embedding) == pytest.approx(1.0, rel=1e-5)


def test_models_lists_what_the_tenant_may_call(api: RunningFrontend) -> None:
    ids = {m.id for m in client(api).models.list()}
    assert {"embed", "generate", "llm"} <= ids
    trial = {m.id for m in client(api, "umbrella").models.list()}
    assert "llm" not in trial and "embed" in trial
    assert client(api).models.retrieve("llm").id == "llm"
    with pytest.raises(openai.NotFoundError):
        client(api, "umbrella").models.retrieve("llm")


def _code(err: openai.APIStatusError) -> Any:
    body = err.body
    return body.get("code") if isinstance(body, dict) else None


def test_errors_in_openais_envelope_and_statuses(api: RunningFrontend) -> None:
    bad = openai.OpenAI(base_url=f"http://{api.http_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as auth:
        bad.chat.completions.create(model="llm", messages=MESSAGES)
    assert _code(auth.value) == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as missing:
        client(api).chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert _code(missing.value) == "model_not_found"
    with pytest.raises(openai.NotFoundError) as closed:  # as OpenAI: exists or not, alike
        client(api, "umbrella").chat.completions.create(model="llm", messages=MESSAGES)
    assert _code(closed.value) == "model_not_found"
    other = client(api, default_headers={"x-tenant-id": "globex"})  # acme's key
    with pytest.raises(openai.PermissionDeniedError):
        other.chat.completions.create(model="llm", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as two:
        client(api).chat.completions.create(model="llm", messages=MESSAGES, n=2)
    assert isinstance(two.value.body, dict) and two.value.body["param"] == "n"
    bad_value: dict[str, Any]  # each a value of the right type the frontend refuses
    for bad_value in ({"temperature": 9}, {"max_tokens": -1}, {"stop": ["x"] * 5}):
        with pytest.raises(openai.BadRequestError):
            client(api).chat.completions.create(model="llm", messages=MESSAGES, **bad_value)
    with pytest.raises(openai.BadRequestError):  # embeddings of a model that makes none
        client(api).embeddings.create(model="llm", input="x")


def test_429_rate_limit_exceeded_is_retryable(api: RunningFrontend) -> None:
    initech = client(api, "initech")
    first = initech.chat.completions.with_raw_response.create(
        model="llm",
        messages=MESSAGES,
        max_tokens=1,
    )
    assert first.headers["x-ratelimit-limit-requests"] == "1"
    assert first.headers["x-ratelimit-remaining-requests"] == "0"
    assert first.headers["x-ratelimit-reset-requests"].endswith("s")
    with pytest.raises(openai.RateLimitError) as limited:
        initech.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=1)
    assert _code(limited.value) == "rate_limit_exceeded"
    headers = limited.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-should-retry" not in headers


def test_429_insufficient_quota_when_a_day_allowance_is_used(api: RunningFrontend) -> None:
    hooli = client(api, "hooli")
    hooli.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as used_up:
        hooli.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=1)
    assert _code(used_up.value) == "insufficient_quota"
    # OpenAI's SDKs retry every 429 unless told not to.
    assert used_up.value.response.headers["x-should-retry"] == "false"


def test_service_tier_and_priority(api: RunningFrontend) -> None:
    acme = client(api)
    fast = acme.chat.completions.create(
        model="llm",
        messages=MESSAGES,
        max_tokens=1,
        service_tier="priority",
    )
    assert fast.service_tier == "priority"
    flex = acme.chat.completions.create(
        model="llm",
        messages=MESSAGES,
        max_tokens=1,
        service_tier="flex",
    )
    assert flex.service_tier == "flex"
    # A level beyond the configured ones is clamped, not refused.
    huge = acme.chat.completions.create(
        model="llm",
        messages=MESSAGES,
        max_tokens=1,
        extra_body={"priority": 10**9},
    )
    assert huge.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        acme.chat.completions.create(
            model="llm",
            messages=MESSAGES,
            max_tokens=1,
            service_tier="gold",  # type: ignore[call-overload]  # a tier the SDK knows none of: refused
        )


def test_kserve_usage_parameters_when_asked(api: RunningFrontend) -> None:
    triton = httpclient.InferenceServerClient(api.http_url)
    data = np.arange(1, 13, dtype=np.int32).reshape(1, -1)
    inp = httpclient.InferInput("INPUT_IDS", list(data.shape), "INT32")
    inp.set_data_from_numpy(data)
    headers = {"x-api-key": KEYS["acme"]}
    asked = triton.infer("embed", [inp], headers=headers, parameters={"include_usage": True})
    params = asked.get_response()["parameters"]
    assert params["usage_prompt_tokens"] == 12
    assert params["usage_total_tokens"] == 12
    plain = triton.infer("embed", [inp], headers=headers)
    assert "parameters" not in plain.get_response() or not any(
        k.startswith("usage_") for k in plain.get_response()["parameters"]
    )


def test_request_log_carries_usage_for_billing(
    api: RunningFrontend, workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=REQUEST_LOGGER):
        reply = client(api, "globex").chat.completions.create(
            model="llm",
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
        )
        ours = _records(caplog, reply.id)
    assert len(ours) == 1, "one record per request, written by the core"
    record = vars(ours[0])  # the record's fields, its ``extra`` among them
    assert reply.usage is not None
    assert record["tenant"] == "globex"
    assert record["tokens_out"] == MAX_TOKENS
    assert record["tokens_in"] == reply.usage.prompt_tokens
    assert record["service_ms"] > 0


def _records(caplog: pytest.LogCaptureFixture, request_id: str) -> list[logging.LogRecord]:
    """The request's log records, once the core has written one: a stream's end reaches
    the core just after its client got the last token (a condition waited for, bounded)."""

    def found() -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "request_id", "") == request_id]

    return eventually(found, 10, 0.01, what=f"the request log's record of {request_id}")


class Slots:
    """The core's record of one model's engine slots, in the order its loop handled them:
    each request queued, dispatched (given a slot) and ended, by tenant. A spy on the
    model's scheduler (``enqueue``, ``next_batch``) and the runtime's ``on_done``, put in
    and taken out on the core's loop (the core runs in this process)."""

    def __init__(self, fe: RunningFrontend, model: str) -> None:
        self.fe = fe
        self.model = model
        self.steps: list[tuple[str, Any]] = []  # ("queued" | "dispatched" | "ended", req)
        self._restore: Callable[[], None] = lambda: None

    async def install(self) -> None:
        await self.fe.frontend.model_info(self.model)  # its runtime, made before any call
        runtime = self.fe.frontend.runtimes[self.model]
        scheduler = runtime.scheduler
        enqueue, next_batch, on_done = scheduler.enqueue, scheduler.next_batch, runtime.on_done

        def spied_enqueue(req: Any, now: float) -> None:
            enqueue(req, now)
            self.steps.append(("queued", req))

        def spied_next_batch(now: float) -> list[Any]:
            batch: list[Any] = next_batch(now)
            self.steps += [("dispatched", req) for req in batch]
            return batch

        def spied_on_done(req: Any, outcome: Any, err: Any, version: str) -> None:
            on_done(req, outcome, err, version)
            self.steps.append(("ended", req))

        scheduler.enqueue, scheduler.next_batch, runtime.on_done = (
            spied_enqueue,
            spied_next_batch,
            spied_on_done,
        )

        def restore() -> None:
            del scheduler.enqueue, scheduler.next_batch
            runtime.on_done = on_done

        self._restore = restore

    async def remove(self) -> None:
        self._restore()

    def held(self, tenant: str) -> int:
        """The most slots ``tenant`` held at once."""
        most, held = 0, set()
        for what, req in list(self.steps):
            if req.tenant == tenant:
                if what == "dispatched":
                    held.add(id(req))
                elif what == "ended":
                    held.discard(id(req))
                most = max(most, len(held))
        return most

    def ends_while_waiting(self, tenant: str, other: str) -> list[int]:
        """For each request of ``tenant``: how many of ``other``'s requests ended between
        its being queued and its dispatch (the turnovers it waited for)."""
        steps = list(self.steps)
        counts = []
        for i, (what, req) in enumerate(steps):
            if what == "queued" and req.tenant == tenant:
                end = next(
                    (j for j, (w, r) in enumerate(steps) if w == "dispatched" and r is req),
                    len(steps),
                )
                counts.append(sum(1 for w, r in steps[i:end] if w == "ended" and r.tenant == other))
        return counts


@contextlib.asynccontextmanager
async def slots(fe: RunningFrontend, model: str = "llm") -> AsyncIterator[Slots]:
    spy = Slots(fe, model)
    await fe.acall(spy.install())
    try:
        yield spy
    finally:
        await fe.acall(spy.remove())


async def test_a_flood_of_chats_does_not_hold_up_another_tenants_first_token(
    triton: Any,
) -> None:
    """4 engine slots, 2 reserved: acme floods 12 long streamed chats (200 tokens); globex's
    streamed chat of 4 tokens, sent once acme streams, is answered, and waited for no
    generation of acme's to end (the engine bound), through the OpenAI route as through
    KServe's: in the core's order, acme never held more than its 2 slots, and none of
    acme's requests ended between globex's being queued and its dispatch (without the
    reservation acme holds all 4 and globex waits for one of them to end)."""
    data = config_dict()
    data["endpoints"]["llm"].update(max_inflight=4, reserved_slots=2)
    with running_frontend(parse_config(data), triton) as fe:
        base = f"http://{fe.http_url}/v1"
        acme = openai.AsyncOpenAI(base_url=base, api_key=KEYS["acme"], max_retries=0)
        globex = openai.AsyncOpenAI(base_url=base, api_key=KEYS["globex"], max_retries=0)
        tokens: list[str] = []

        async def chat(who: openai.AsyncOpenAI, n: int, log: list[str] | None) -> str:
            stream = await who.chat.completions.create(
                model="llm",
                messages=MESSAGES,
                max_tokens=n,
                stream=True,
            )
            text = []
            async for c in stream:
                if c.choices and c.choices[0].delta.content:
                    text.append(c.choices[0].delta.content)
                    if log is not None:
                        log.append(c.choices[0].delta.content)
            return "".join(text)

        async with slots(fe) as spy:
            hogs = [asyncio.ensure_future(chat(acme, 200, tokens)) for _ in range(12)]
            try:
                await aeventually(lambda: len(tokens) >= 6, 60, 0.005, what="acme streaming")
                quiet = await asyncio.wait_for(chat(globex, 4, None), 60)
            finally:
                for h in hogs:
                    h.cancel()
                await asyncio.gather(*hogs, return_exceptions=True)
                await acme.close()
                await globex.close()
    assert quiet
    assert spy.held("acme") == 2, "acme held more than its share of the slots"
    assert spy.ends_while_waiting("globex", "acme") == [0], "globex waited for acme's turnover"


def test_kserve_usage_parameters_on_grpc_streams(api: RunningFrontend) -> None:
    """On a gRPC stream the final response carries the usage; the others do not."""
    import queue

    import tritonclient.grpc as grpcclient

    from tests.support import llm_inputs

    results: queue.Queue[Any] = queue.Queue()
    grpc = grpcclient.InferenceServerClient(api.grpc_url)
    grpc.start_stream(
        lambda result, error: results.put((result, error)), headers={"x-api-key": KEYS["acme"]}
    )
    inputs = [_sync_input(grpcclient, i) for i in llm_inputs("Once upon a time", MAX_TOKENS)]
    grpc.async_stream_infer("llm", inputs, parameters={"include_usage": True})
    got = [results.get(timeout=30) for _ in range(MAX_TOKENS)]
    grpc.stop_stream()
    assert all(e is None for _, e in got)
    params = [r.get_response().parameters for r, _ in got]
    assert params[-1]["usage_completion_tokens"].int64_param == MAX_TOKENS
    assert params[-1]["usage_prompt_tokens"].int64_param == len(
        tokenizer(api).encode("Once upon a time").ids
    )
    assert not any("usage_total_tokens" in p for p in params[:-1])


def _sync_input(mod: Any, aio_input: Any) -> Any:
    """tritonclient.grpc's input of the same name, type and data as a grpc.aio one."""
    made = mod.InferInput(aio_input.name(), aio_input.shape(), aio_input.datatype())
    made._raw_content = aio_input._raw_content
    return made
