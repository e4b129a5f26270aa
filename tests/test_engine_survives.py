"""The ``llm`` engine survives anything a request sends, through the frontend (issue 17).

The reproduction: the trial tenant sends ``POST /v2/models/llm/generate`` with ``"seed":
18446744073709551616``; the seed reached ``torch.Generator.manual_seed`` on the engine
thread, which died, and every ``llm`` request of every tenant hung from then on. Now the
frontend refuses it at the door (400 / INVALID_ARGUMENT naming ``seed`` and its rule),
and another tenant's request is served right after; over HTTP generate and over a gRPC
stream, in both worker modes. Then a sample of generated sampling parameters: 200 or 400
every time, never a 500 or a hang, and the engine serves after each. Every client here
has a deadline: on the old code these requests hang.
"""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcaio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.sampling_strategies import SHORT_PARAMS, SHORT_SAMPLING
from tests.support import KEYS

DEADLINE_S = 30.0  # a request not answered by then means the engine is stuck
SEED_BEYOND_64_BITS = b'{"text_input": "hi", "seed": 18446744073709551616}'


def generate(url: str, tenant: str, body: bytes | dict[str, Any]) -> tuple[int, Any]:
    """POST the frontend's /v2/models/llm/generate: (status, JSON body)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(url, timeout=DEADLINE_S)
    try:
        conn.request(
            "POST",
            "/v2/models/llm/generate",
            body=raw,
            headers={"authorization": f"Bearer {KEYS[tenant]}"},
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def served(url: str, tenant: str) -> None:
    status, body = generate(url, tenant, {"text_input": "Next", "max_tokens": 3, "temperature": 0})
    assert status == 200, body
    assert body["text_output"].startswith("Next")


def test_a_seed_beyond_64_bits_is_400_over_http_and_llm_serves_the_next_tenant(
    frontend: Any,
) -> None:
    status, body = generate(frontend.http_url, "umbrella", SEED_BEYOND_64_BITS)
    assert status == 400, body
    assert "seed" in body["error"] and "64 bits" in body["error"], body
    served(frontend.http_url, "acme")
    # As a float (what a JSON number past 64 bits becomes) and in sampling_parameters.
    for bad in (
        {"text_input": "hi", "parameters": {"seed": 1.8446744073709552e19}},
        {"text_input": "hi", "sampling_parameters": json.dumps({"seed": 2**64})},
    ):
        status, body = generate(frontend.http_url, "umbrella", bad)
        assert status == 400 and "seed" in body["error"], body
    served(frontend.http_url, "globex")


async def stream_once(url: str, tenant: str, sampling: dict[str, Any]) -> tuple[int, Any]:
    """One request on a gRPC stream: (tokens received, the error that ended it or None)."""
    client = grpcaio.InferenceServerClient(url)
    text = grpcaio.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hi"], dtype=object))
    flag = grpcaio.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([True]))
    params = grpcaio.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=object))

    async def one() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": "llm", "inputs": [text, flag, params]}

    tokens = 0
    try:
        async for result, error in client.stream_infer(one(), headers={"x-api-key": KEYS[tenant]}):
            if error is not None:
                return tokens, error
            response = result.get_response()
            tokens += bool(response.outputs)  # a token (an empty final response has none)
            # Triton marks the last response final (the llm's last token, as Triton sends
            # it); a stream of replies built by the frontend may not mark it, and ends.
            if response.parameters["triton_final_response"].bool_param:
                break
    finally:
        await client.close()
    return tokens, None


async def test_a_seed_beyond_64_bits_is_invalid_argument_on_a_grpc_stream(frontend: Any) -> None:
    tokens, error = await asyncio.wait_for(
        stream_once(frontend.grpc_url, "umbrella", {"seed": 2**64, "temperature": 1}), DEADLINE_S
    )
    # A stream carries a request's error as a message (Triton's ModelStreamInfer: no
    # status code per request): the door's, naming the key and the rule.
    assert tokens == 0 and error is not None
    assert error.message().startswith("input 'sampling_parameters': seed must be an integer in")
    tokens, error = await asyncio.wait_for(
        stream_once(frontend.grpc_url, "initech", {"max_tokens": 4, "temperature": 0}), DEADLINE_S
    )
    assert (tokens, error) == (4, None)


@given(doc=st.none() | SHORT_SAMPLING, params=SHORT_PARAMS)
@settings(max_examples=20, deadline=None)
def test_generated_sampling_parameters_through_the_frontend_get_200_or_400(
    frontend: Any, doc: dict[str, Any] | None, params: dict[str, Any]
) -> None:
    """What the engine cannot take is refused at the door (400, naming the key); what it
    can is served (200). Never 500 (the model refusing what the door let through comes
    back as INTERNAL over the gRPC stream), never a hang; the engine serves after each."""
    body: dict[str, Any] = {"text_input": "Hi", "parameters": params}
    if doc is not None:
        body["sampling_parameters"] = json.dumps(doc)
    status, answer = generate(frontend.http_url, "hooli", body)
    assert status in (200, 400), answer
    if status == 400:
        assert "Traceback" not in answer["error"]
    served(frontend.http_url, "initech")
