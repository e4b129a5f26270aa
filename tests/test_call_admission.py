"""Issue 29, items 4 and 5, against a real frontend and Triton in both worker modes: a
call of several parts (an embeddings' inputs, a rerank's documents) is admitted or
refused whole before any part queues; a text is refused from its size against its
model's context before it is tokenised; tokenising is paid for before it happens (a
precharge on the tenant's token limits), so a request refused after it is not free; and
one tenant's large tokenising does not hold another's small one behind all of it.

Clients: the real ``openai`` and ``cohere`` SDKs. What happened is read from the
server's own records: the rate limits' windows in the core (a check of nothing, which
reads them without counting: ``left``), Triton's statistics (polled: Triton counts a
request once its execute() has returned), and a spy on the core's own entry points (the
order in which precharges and calls reached it). The limits below are the tenants' own,
one tenant per test, so the tests of this module do not read each other's counts.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cohere
import openai
import pytest

from fair_frontend.admission import items_from_limits, limit_key
from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import parse_config
from fair_frontend.kit.testing import aeventually, eventually
from fair_frontend.quota import Quota
from fair_frontend.tokens import load_tokenizer, max_token_bytes
from tests.support import (
    KEYS,
    RunningFrontend,
    config_dict,
    llm_served,
    make_config,
    running_frontend,
)

PLENTY = {"tokens_per_day": 10**9, "requests_per_day": 10**7}
EMBED_TOKENS = 1_000  # "umbrella"'s on embed a day: a call of parts refused whole
RERANK_TOKENS = 300  # "hooli"'s on rerank a day
CHARGED_TOKENS = 1_000  # "payer"'s on embed a day: refused after its tokenising
CONTEXT = 4_096  # embed's max_model_len in the shipped config (its network's positions)
EXTRA = {"payer": "payer-test-key", "long": "long-test-key"}
WAIT_S = 60.0
QUERY = "Which rivers flow through Vienna?"


def _config() -> Any:
    data = config_dict()
    for name in ("acme", "globex", "initech"):
        data["tenants"][name]["limits"] = {"embed": PLENTY, "rerank": PLENTY}
    data["tenants"]["umbrella"]["limits"] = {"embed": {"tokens_per_day": EMBED_TOKENS}}
    data["tenants"]["hooli"]["limits"] = {"rerank": {"tokens_per_day": RERANK_TOKENS}}
    data["tenants"]["payer"] = {
        "tier": "standard",
        "api_keys": [EXTRA["payer"]],
        "limits": {"embed": {"tokens_per_day": CHARGED_TOKENS, "requests_per_day": 100}},
    }
    data["tenants"]["long"] = {"tier": "standard", "api_keys": [EXTRA["long"]]}
    data["tenants"]["long"]["limits"] = {"embed": PLENTY, "llm": PLENTY}
    return parse_config(data)


@pytest.fixture(scope="module")
def served(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    with running_frontend(_config(), triton, workers=workers) as running:
        yield running


def key(tenant: str) -> str:
    return EXTRA.get(tenant) or KEYS[tenant]


def oai(served: RunningFrontend, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{served.http_url}/v1", api_key=key(tenant), max_retries=0, timeout=120
    )


def co(served: RunningFrontend, tenant: str) -> cohere.ClientV2:
    return cohere.ClientV2(api_key=key(tenant), base_url=f"http://{served.http_url}", timeout=120)


def quota(served: RunningFrontend, tenant: str, model: str) -> Quota:
    """The tenant's limits on ``model`` as the core counts them now: a check of nothing
    (no request, no token), which counts nothing, on the core's loop."""

    async def probe() -> Quota:
        core = served.frontend
        items = items_from_limits(core.config.limits_for(tenant, model))
        decision = core.limiter.check_now(
            limit_key(tenant, model), items, requests=0, tokens=0, now=time.time()
        )
        assert decision is not None and decision.quota is not None
        return decision.quota

    return served.call(probe())


def left(served: RunningFrontend, tenant: str, model: str) -> tuple[int | None, int]:
    """(requests, tokens) the tenant has left on ``model`` (None: no requests limit)."""
    q = quota(served, tenant, model)
    assert q.tokens is not None
    return (None if q.requests is None else q.requests.remaining), q.tokens.remaining


def inferences(triton: EmbeddedTriton, model: str) -> int:
    """Rows Triton has run of ``model``, from its own statistics."""
    with urllib.request.urlopen(f"{triton.http_url}/v2/models/{model}/stats", timeout=10) as r:
        return int(json.loads(r.read())["model_stats"][0]["inference_count"])


def settled(triton: EmbeddedTriton, model: str, expected: int) -> int:
    """Triton's rows of ``model`` once they reach ``expected`` (polled), as it has them."""
    eventually(lambda: inferences(triton, model) >= expected, WAIT_S, what="Triton counted")
    return inferences(triton, model)


# ---- item 5: a call of parts is admitted or refused whole -----------------------------------


def test_an_embeddings_call_over_the_tokens_left_is_refused_whole_and_reaches_no_triton(
    served: RunningFrontend, triton: EmbeddedTriton
) -> None:
    """umbrella has 1,000 tokens a day on embed. A call of four inputs of 100 tokens is
    served whole; then one of eight (800 > the 600 left, each input alone would fit) is
    refused whole: 429, nothing of it counted, and none of its inputs reaches Triton
    (Triton's rows grow by the calls served, exactly). A call of two that fits then is
    served whole."""
    client = oai(served, "umbrella")
    row = [7] * 100
    base = inferences(triton, "embed")
    _, tokens = left(served, "umbrella", "embed")
    served_call = client.embeddings.create(model="embed", input=[row] * 4)
    assert [d.index for d in served_call.data] == [0, 1, 2, 3]
    assert left(served, "umbrella", "embed")[1] == tokens - 400
    over = [row] * ((tokens - 400) // 100 + 2)
    with pytest.raises(openai.RateLimitError) as refused:
        client.embeddings.create(model="embed", input=over)
    assert refused.value.status_code == 429
    assert refused.value.response.headers["x-ratelimit-remaining-tokens"] == str(tokens - 400)
    assert left(served, "umbrella", "embed")[1] == tokens - 400  # nothing of it counted
    after = client.embeddings.create(model="embed", input=[row] * 2)
    assert len(after.data) == 2
    assert settled(triton, "embed", base + 6) == base + 6, "a part of the refused call ran"


def test_a_rerank_call_over_the_tokens_left_is_refused_whole_and_reaches_no_triton(
    served: RunningFrontend, triton: EmbeddedTriton
) -> None:
    """hooli has 300 rerank tokens a day: a call of two documents is served, one of
    twenty (more than the rest, each document alone would fit) is refused whole by
    Cohere's SDK's TooManyRequestsError, counted nowhere, run nowhere; one document then
    fits and is served. The texts are under a kilobyte: tokenised inline, no precharge."""
    client = co(served, "hooli")
    base = inferences(triton, "rerank")
    _, tokens = left(served, "hooli", "rerank")
    first = client.rerank(model="rerank", query=QUERY, documents=["The Danube.", "The Rhine."])
    assert first.meta is not None and first.meta.tokens is not None
    used = int(first.meta.tokens.input_tokens or 0)
    assert left(served, "hooli", "rerank")[1] == tokens - used
    documents = [f"River number {i} in Europe." for i in range(20)]
    with pytest.raises(cohere.errors.TooManyRequestsError):
        client.rerank(model="rerank", query=QUERY, documents=documents)
    assert left(served, "hooli", "rerank")[1] == tokens - used
    last = client.rerank(model="rerank", query=QUERY, documents=["The Seine."])
    assert len(last.results) == 1
    assert settled(triton, "rerank", base + 3) == base + 3, "a part of the refused call ran"


# ---- item 4: bounded before tokenising, paid for, and fair ------------------------------------


def test_a_text_longer_than_the_context_is_refused_untokenised_and_unpaid(
    served: RunningFrontend,
) -> None:
    """A 200 KiB text is at least 6,400 tokens (the tokenizer's tokens cover at most 32
    bytes): over embed's context of 4,096, refused from its size with 400 naming the
    input, before any precharge (nothing counted: not even the request) and before the
    pool (one process: its pieces are counted; none started)."""
    client = oai(served, "long")
    tokenizer = served.server.config.endpoints["embed"].tokenizer
    widest = max_token_bytes(tokenizer)
    text = "x" * (200 << 10)
    before = left(served, "long", "embed")
    pool = served.gateway.tokens if served.server.gateway is not None else None
    started = sum(pool.started.values()) if pool is not None else 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="embed", input=["a short one", text])
    least = -(-len(text) // (widest or 1))
    assert isinstance(refused.value.body, dict)
    message = refused.value.body["message"]
    assert f"input[1] is at least {least} tokens" in message, message
    assert f"takes at most {CONTEXT}" in message, message
    assert left(served, "long", "embed") == before  # refused before it paid anything
    if pool is not None:
        assert sum(pool.started.values()) == started, "it was tokenised"


def test_a_call_refused_after_its_tokenising_has_paid_for_it(served: RunningFrontend) -> None:
    """payer has 1,000 tokens a day. Its 4,000-byte text is at least 125 tokens (32 bytes
    a token at most), 2,000 as tokenised: the precharge counts the request and 125
    tokens, tokenising runs, and its admission (1,875 more, 875 left) refuses it with
    429. The request and the 125 tokens stay counted: the 429 says so in its quota
    headers, and so do the core's windows."""
    client = oai(served, "payer")
    tokenizer = served.server.config.endpoints["embed"].tokenizer
    widest = max_token_bytes(tokenizer)
    assert widest is not None
    text = "a " * 2000
    least = -(-len(text) // widest)
    requests, tokens = left(served, "payer", "embed")
    assert requests is not None and least <= tokens < 2000
    with pytest.raises(openai.RateLimitError) as refused:
        client.embeddings.create(model="embed", input=[text])
    headers = refused.value.response.headers
    assert headers["x-ratelimit-remaining-tokens"] == str(tokens - least)
    assert left(served, "payer", "embed") == (requests - 1, tokens - least)


def test_a_text_over_the_context_by_its_tokens_is_refused_after_paying_for_them(
    served: RunningFrontend,
) -> None:
    """10,000 bytes of "a " are at least 313 tokens by their size, 5,001 tokenised: over
    embed's 4,096, found once tokenised. 400 naming the input and its count; what the
    precharge counted stays (the request, and the tokens it had at least)."""
    client = oai(served, "long")
    tokenizer = served.server.config.endpoints["embed"].tokenizer
    widest = max_token_bytes(tokenizer)
    assert widest is not None
    text = "a " * 5000
    requests, tokens = left(served, "long", "embed")
    assert requests is not None
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="embed", input=["short", text])
    assert isinstance(refused.value.body, dict)
    message = refused.value.body["message"]
    count = len(load_tokenizer(tokenizer).encode(text, add_special_tokens=False).ids)
    assert count > CONTEXT
    assert f"input[1] is {count} tokens; model 'embed' takes at most {CONTEXT}" in message
    least = sum(-(-len(t) // widest) for t in ("short", text))  # every input's, at least
    assert left(served, "long", "embed") == (requests - 1, tokens - least)


def test_a_kserve_text_prompt_pays_for_its_tokenising_too(
    served: RunningFrontend, triton: EmbeddedTriton
) -> None:
    """Triton's generate extension, a text prompt of 1,200 bytes to llm: at least 38
    tokens by its size, 601 tokenised, over llm's context of 512: 400 from the shell
    once tokenised, with the request and the 38 tokens counted before it was."""
    llm_served(triton)
    tokenizer = served.server.config.endpoints["llm"].tokenizer
    widest = max_token_bytes(tokenizer)
    assert widest is not None
    prompt = "a " * 600
    requests, tokens = left(served, "long", "llm")
    assert requests is not None
    body = {"text_input": prompt, "sampling_parameters": json.dumps({"max_tokens": 4})}
    req = urllib.request.Request(
        f"http://{served.http_url}/v2/models/llm/generate",
        data=json.dumps(body).encode(),
        headers={"x-api-key": key("long"), "content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=60)
    assert refused.value.code == 400
    assert "the prompt has" in json.loads(refused.value.read())["error"]
    assert left(served, "long", "llm") == (requests - 1, tokens - -(-len(prompt) // widest))


class Spy:
    """The order in which precharges and calls reached the core (on its loop): the
    tenant of each, as ``precharge`` or ``call``."""

    def __init__(self, served: RunningFrontend) -> None:
        self.core = served.frontend
        self.seen: list[tuple[str, str]] = []
        self._precharge = self.core.precharge
        self._submit_group = self.core.submit_group

    async def install(self) -> None:
        async def precharge(tenant: str, model: str, **kw: int) -> Any:
            self.seen.append(("precharge", tenant))
            return await self._precharge(tenant, model, **kw)

        def submit_group(group: Any, route: Any) -> Any:
            self.seen.append(("call", group.tenant))
            return self._submit_group(group, route)

        self.core.precharge = precharge
        self.core.submit_group = submit_group

    async def remove(self) -> None:
        del self.core.precharge
        del self.core.submit_group

    def first(self, what: str, tenant: str) -> int:
        return self.seen.index((what, tenant))


async def test_a_tenants_large_tokenising_does_not_hold_another_tenants_small_one(
    served: RunningFrontend,
) -> None:
    """acme and globex each send a rerank of 100 documents of 15 KiB (1.5 MiB to
    tokenise each, some 24 pieces); once the core has their precharges (their
    tokenising is under way), initech sends a rerank of two short documents (one piece).
    Served in turns piece by piece, initech's call reaches the core before either large
    one: it waited for a piece per thread, not for a whole call. (With a thread per
    tenant's whole job, as before, two large calls held both of a 2-core shell's
    threads and the small one waited for one of them to end.)"""
    spy = Spy(served)
    await served.acall(spy.install())
    big = ["The Danube flows east. " * 650 + f"({i})" for i in range(100)]
    small = ["The Danube flows through Vienna.", "Paris lies on the Seine."]

    def rerank(tenant: str, documents: list[str]) -> int:
        reply = co(served, tenant).rerank(model="rerank", query=QUERY, documents=documents)
        return len(reply.results)

    loop = asyncio.get_running_loop()
    try:
        with ThreadPoolExecutor(3) as pool:
            large = [loop.run_in_executor(pool, rerank, t, big) for t in ("acme", "globex")]
            await aeventually(
                lambda: {t for w, t in spy.seen if w == "precharge"} >= {"acme", "globex"},
                WAIT_S,
                0.005,
                what="the large calls' precharges",
            )
            assert await loop.run_in_executor(pool, rerank, "initech", small) == 2
            assert await asyncio.gather(*large) == [100, 100]
    finally:
        await served.acall(spy.remove())
    quiet = spy.first("call", "initech")
    assert quiet < spy.first("call", "acme") and quiet < spy.first("call", "globex"), spy.seen


def test_the_shipped_configs_give_embed_and_rerank_their_networks_context() -> None:
    """examples/config.yaml (and so every test config made from it): embed 4,096 tokens
    (its encoder's positions), rerank 512 (the model config's own)."""
    config = make_config()
    assert config.endpoints["embed"].max_model_len == CONTEXT
    assert config.endpoints["rerank"].max_model_len == 512
