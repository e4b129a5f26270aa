"""Streamed tokens are counted in tokens, whatever a response carries.

``llm`` here runs with vLLM's stream interval at 4 (a Triton of this module's own, the
shipped model with that one parameter changed): a generation of 10 tokens comes as 4
responses (1, 4, 4 and 1 tokens: the first at once). The frontend asks the model what
each response carries (``token_count_output``, through ``token_count_input``) and counts
that; a frontend that counted responses would charge 4. The client's view stays the
model's: the count output reaches only a client that asked for it.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio

from fair_frontend.backends.triton.embedded import (
    EmbeddedTriton,
    default_model_repository,
    llm_with_stream_interval,
)
from fair_frontend.kit.testing import aeventually, ascrape
from tests.support import KEYS, RunningFrontend, llm_inputs, make_config, running_frontend

INTERVAL = 4
MAX_TOKENS = 10
PER_RESPONSE = [1, 4, 4, 1]  # the first token at once, then every 4, the rest last
PROMPT = "Tenants share the engine"
SETTLE_S = 60.0


@pytest.fixture(scope="module")
def interval_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    repo = llm_with_stream_interval(tmp_path_factory.mktemp("repo"), INTERVAL)
    with EmbeddedTriton(repo) as triton:
        yield triton


@pytest.fixture(scope="module")
def frontend(interval_triton: EmbeddedTriton) -> Iterator[RunningFrontend]:
    with running_frontend(make_config(), interval_triton, workers=2) as running:
        yield running


def count_flag(value: bool) -> Any:
    flag = grpcaio.InferInput("return_num_output_tokens", [1], "BOOL")
    flag.set_data_from_numpy(np.array([value]))
    return flag


async def stream(url: str, tenant: str | None, *, ask: bool = False) -> list[Any]:
    """One generation's responses as its client sees them (tritonclient's results)."""
    client = grpcaio.InferenceServerClient(url)
    headers = {"x-api-key": KEYS[tenant]} if tenant is not None else None
    inputs = llm_inputs(PROMPT, MAX_TOKENS) + ([count_flag(True)] if ask else [])

    async def one() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": "llm", "inputs": inputs}

    results = []
    try:
        async for result, error in client.stream_infer(one(), headers=headers):
            assert error is None, error
            results.append(result)
    finally:
        await client.close()
    return results


def texts(results: list[Any]) -> list[str]:
    return [b"".join(r.as_numpy("text_output").reshape(-1)).decode() for r in results]


# Per tenant: output tokens, first tokens timed, inter-token times (one per token after
# the first: a response of 4 tokens is 4 tokens, its gap shared, not one slow token).
COUNTS = (
    "fair_output_tokens_total",
    "fair_time_to_first_token_seconds_count",
    "fair_inter_token_seconds_count",
)
ONE_STREAM = [MAX_TOKENS, 1, MAX_TOKENS - 1]


async def counts(fe: RunningFrontend, tenant: str) -> list[float]:
    page = await ascrape(fe.metrics_url)
    return [page.sum(name, tenant=tenant) for name in COUNTS]


async def charged(fe: RunningFrontend, tenant: str, before: list[float]) -> list[float]:
    """The tenant's counts since ``before`` once the stream's shell has reported them (it
    may be just after the client had its last response)."""

    async def counted() -> list[float] | None:
        now = [n - b for n, b in zip(await counts(fe, tenant), before, strict=True)]
        return now if all(n >= e for n, e in zip(now, ONE_STREAM, strict=True)) else None

    return await aeventually(counted, SETTLE_S, what=f"{tenant}'s stream in the metrics")


async def test_a_stream_of_multi_token_responses_is_charged_its_tokens(
    interval_triton: EmbeddedTriton, frontend: RunningFrontend
) -> None:
    direct = await stream(interval_triton.grpc_url, None)
    assert len(direct) == len(PER_RESPONSE) and "".join(texts(direct))

    before = await counts(frontend, "acme")
    got = await stream(frontend.grpc_url, "acme")
    assert texts(got) == texts(direct)  # the same responses, the same text
    # The count the frontend asked for is not the client's: it did not ask.
    assert all(r.as_numpy("num_output_tokens") is None for r in got)
    # 10 tokens charged, not 4 responses; one first token, 9 inter-token times (and not
    # more: read once they were all there).
    assert await charged(frontend, "acme", before) == ONE_STREAM


async def test_a_client_that_asks_for_the_count_gets_the_models(
    frontend: RunningFrontend,
) -> None:
    before = await counts(frontend, "globex")
    got = await stream(frontend.grpc_url, "globex", ask=True)
    assert [int(r.as_numpy("num_output_tokens").sum()) for r in got] == PER_RESPONSE
    assert await charged(frontend, "globex", before) == ONE_STREAM


@pytest.mark.parametrize("ask", [False, True], ids=["count-not-asked", "count-asked"])
async def test_a_grpc_client_gets_tritons_own_messages(
    interval_triton: EmbeddedTriton, frontend: RunningFrontend, ask: bool
) -> None:
    """The shell passes Triton's messages on as Triton serialized them (its parameters,
    ``triton_final_response`` included, as a client of Triton gets them), taking out only
    the count the client did not ask for."""
    direct = await stream(interval_triton.grpc_url, None, ask=ask)
    got = await stream(frontend.grpc_url, "initech", ask=ask)
    assert [r.get_response() for r in got] == [r.get_response() for r in direct]
    assert all("triton_final_response" in r.get_response().parameters for r in got)


def test_openai_usage_counts_tokens_not_responses(frontend: RunningFrontend) -> None:
    body = {"model": "llm", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    request = urllib.request.Request(
        f"http://{frontend.http_url}/v1/completions",
        data=json.dumps(body).encode(),
        # A tenant of its own: no other test's tokens are still on their way to its count.
        headers={"content-type": "application/json", "authorization": f"Bearer {KEYS['hooli']}"},
    )
    with urllib.request.urlopen(request, timeout=SETTLE_S) as r:
        answer = json.load(r)
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert answer["choices"][0]["finish_reason"] == "length"


def test_the_shipped_llm_streams_one_token_per_response() -> None:
    """The shipped default stays vLLM's (1): the other tests' token-by-token streams."""
    config = Path(default_model_repository()) / "llm" / "config.pbtxt"
    assert 'key: "stream_interval", value: { string_value: "1" }' in config.read_text()
