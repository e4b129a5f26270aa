"""The rerank routes with real clients against a real frontend and Triton: Cohere's SDK on
``/v2/rerank``, a plain HTTP client on Jina's/vLLM's ``/v1/rerank``. Scores are checked
against the ``rerank`` model's own answers over KServe (the same rows), usage against the
rows' lengths, errors against the statuses the SDK maps; and fairness: a 1,000-document
call of one tenant does not hold up another's 3-document call beyond one batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import cohere
import pytest
import tritonclient.http as httpclient

from fair_frontend.config import parse_config
from fair_frontend.kit.testing import aeventually
from fair_frontend.observability.logs import REQUEST_LOGGER
from fair_frontend.shell.api.rerank import pair_rows
from tests.support import KEYS, RunningFrontend, config_dict, running_frontend

QUERY = "Which rivers flow through Vienna?"
DOCUMENTS = [
    "The Danube flows through Vienna, Bratislava and Budapest.",
    "Paris lies on the Seine.",
    "Vienna is the capital of Austria.",
    "Bananas are rich in potassium.",
]


def _config() -> Any:
    data = config_dict()
    data["tenants"]["initech"]["limits"] = {"rerank": {"requests_per_minute": 1}}
    return parse_config(data)


@pytest.fixture(scope="module")
def served(triton: Any, workers: int) -> Iterator[RunningFrontend]:
    with running_frontend(_config(), triton, workers=workers) as running:
        yield running


def cohere_client(served: RunningFrontend, tenant: str = "acme") -> cohere.ClientV2:
    return cohere.ClientV2(api_key=KEYS[tenant], base_url=f"http://{served.http_url}")


def logits_over_kserve(served: RunningFrontend, documents: list[str]) -> list[float]:
    """The model's own logit for each pair, one KServe infer per row through the
    frontend (the rows as the frontend's tokenizer joins them)."""
    endpoint = served.server.config.endpoints["rerank"]
    rows = pair_rows(endpoint.tokenizer or "", QUERY, documents, None, 512)
    client = httpclient.InferenceServerClient(served.http_url)
    out = []
    for row in rows:
        data = row.reshape(1, -1)
        inp = httpclient.InferInput("INPUT_IDS", list(data.shape), "INT32")
        inp.set_data_from_numpy(data)
        result = client.infer("rerank", [inp], headers={"x-api-key": KEYS["acme"]})
        out.append(float(result.as_numpy("SCORE").reshape(-1)[0]))
    return out


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_cohere_sdk_rerank_ranks_by_the_models_scores(served: RunningFrontend) -> None:
    reply = cohere_client(served).rerank(model="rerank", query=QUERY, documents=DOCUMENTS, top_n=3)
    logits = logits_over_kserve(served, DOCUMENTS)
    expected = sorted(range(len(DOCUMENTS)), key=lambda i: -logits[i])[:3]
    assert [r.index for r in reply.results] == expected
    for r in reply.results:
        assert r.relevance_score == pytest.approx(sigmoid(logits[r.index]), rel=1e-5)
    assert reply.meta is not None and reply.meta.billed_units is not None
    assert reply.meta.billed_units.search_units == 1
    rows = pair_rows(
        served.server.config.endpoints["rerank"].tokenizer or "", QUERY, DOCUMENTS, None, 512
    )
    assert reply.meta.tokens is not None
    assert reply.meta.tokens.input_tokens == sum(len(r) for r in rows)


def test_max_tokens_per_doc_cuts_each_document(served: RunningFrontend) -> None:
    long_doc = "Vienna " * 200
    short = cohere_client(served).rerank(
        model="rerank", query=QUERY, documents=[long_doc], max_tokens_per_doc=8
    )
    whole = cohere_client(served).rerank(model="rerank", query=QUERY, documents=[long_doc])
    assert short.meta and short.meta.tokens and whole.meta and whole.meta.tokens
    cut, uncut = short.meta.tokens.input_tokens, whole.meta.tokens.input_tokens
    assert cut is not None and uncut is not None
    assert cut < uncut


def post(served: RunningFrontend, path: str, body: Any, key: str = KEYS["acme"]) -> tuple[int, Any]:
    req = urllib.request.Request(
        f"http://{served.http_url}{path}",
        data=json.dumps(body).encode(),
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_jina_rerank_with_documents_and_usage(served: RunningFrontend) -> None:
    status, doc = post(
        served, "/v1/rerank", {"model": "rerank", "query": QUERY, "documents": DOCUMENTS,
                               "top_n": 2, "return_documents": True},
    )  # fmt: skip
    assert status == 200, doc
    logits = logits_over_kserve(served, DOCUMENTS)
    best = sorted(range(len(DOCUMENTS)), key=lambda i: -logits[i])[:2]
    assert [r["index"] for r in doc["results"]] == best
    assert [r["document"]["text"] for r in doc["results"]] == [DOCUMENTS[i] for i in best]
    assert doc["usage"]["total_tokens"] > len(DOCUMENTS)


def test_rerank_errors_as_the_sdk_maps_them(served: RunningFrontend) -> None:
    with pytest.raises(cohere.errors.UnauthorizedError):
        cohere.ClientV2(api_key="nope", base_url=f"http://{served.http_url}").rerank(
            model="rerank", query=QUERY, documents=DOCUMENTS
        )
    with pytest.raises(cohere.errors.BadRequestError):
        cohere_client(served).rerank(model="rerank", query=QUERY, documents=[])
    with pytest.raises(cohere.errors.BadRequestError):  # a model that does not rerank
        cohere_client(served).rerank(model="embed", query=QUERY, documents=DOCUMENTS)
    with pytest.raises(cohere.errors.NotFoundError):
        cohere_client(served).rerank(model="no-such", query=QUERY, documents=DOCUMENTS)
    initech = cohere_client(served, "initech")
    initech.rerank(model="rerank", query=QUERY, documents=DOCUMENTS)
    with pytest.raises(cohere.errors.TooManyRequestsError) as limited:
        # No retry: the SDK would wait out Retry-After (a minute) and succeed.
        initech.rerank(
            model="rerank", query=QUERY, documents=DOCUMENTS, request_options={"max_retries": 0}
        )
    assert limited.value.headers is not None
    assert int(limited.value.headers["retry-after"]) >= 1
    status, doc = post(served, "/v1/rerank", {"model": "rerank", "query": QUERY, "documents": 5})
    assert status == 400 and doc["error"]["type"] == "invalid_request_error"
    status, doc = post(
        served, "/v1/rerank", {"model": "rerank", "query": "q " * 5000, "documents": ["d"]}
    )
    assert status == 400, doc  # a query that leaves no room for a document


async def test_a_1000_document_rerank_does_not_hold_up_a_3_document_one(
    triton: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """acme's 1,000 documents go to the scheduler as 1,000 rows; globex's 3, sent once
    acme's are being served, wait in the core's queue no longer than two of acme's
    batches take (the one running, and the one sent ahead of it by
    ``dispatch_lead_ms``): they go in the next batch formed, while acme's call is still
    far from done. Without one row per document globex would wait for acme's whole call
    (about 30 batches of 32). Times from the core's request log: each row's queue wait
    (admission to dispatch) and service time (dispatch to answer: its batch's time)."""
    with (
        caplog.at_level(logging.INFO, logger=REQUEST_LOGGER),
        running_frontend(parse_config(config_dict()), triton) as fe,
    ):
        # Long enough that Triton, not the shell, is the bottleneck: acme's rows queue.
        docs = [f"document {i} " + "about the Danube and the Rhine " * 24 for i in range(1000)]
        body = {"model": "rerank", "query": QUERY, "documents": docs}
        hog = asyncio.ensure_future(asyncio.to_thread(post, fe, "/v2/rerank", body))
        try:
            await aeventually(lambda: _batches(fe) >= 2, 60, 0.002, what="acme served")
            quiet = {"model": "rerank", "query": QUERY, "documents": DOCUMENTS[:3]}
            status, answer = await asyncio.to_thread(post, fe, "/v2/rerank", quiet, KEYS["globex"])
            hog_done = hog.done()
        finally:
            hog_status, hogged = await hog
    assert status == 200 and len(answer["results"]) == 3
    assert hog_status == 200 and len(hogged["results"]) == 1000
    assert not hog_done, "globex waited for acme's whole call"
    rows = [r for r in caplog.records if getattr(r, "endpoint", "") == "rerank"]
    fields = [vars(r) for r in rows]  # each record's own, its ``extra`` among them
    waits = [f["queued_ms"] for f in fields if f["tenant"] == "globex"]
    batch_ms = [f["service_ms"] for f in fields if f["tenant"] == "acme"]
    assert len(waits) == 3 and len(batch_ms) == 1000
    assert max(waits) <= 2 * max(batch_ms), (waits, max(batch_ms))


def _batches(fe: RunningFrontend) -> int:
    """Batches the core has sent to the rerank model (read from this thread: one int)."""
    runtime = fe.frontend.runtimes.get("rerank")
    return 0 if runtime is None else int(runtime.batches_sent)
