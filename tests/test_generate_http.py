"""Triton's generate extension on the frontend's HTTP port, side by side with Triton's own.

The same body goes straight to Triton and through the frontend; status, content type and
body bytes must be the same (for ``/generate_stream`` the whole event stream), except
where the frontend adds what Triton lacks (the API key).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.request
from typing import Any

import pytest

from fair_frontend.kit.testing import scrape
from tests.support import KEYS, llm_served, make_config, metric_sum, running_frontend

KEY = {"x-api-key": KEYS["hooli"]}
SSE = "text/event-stream; charset=utf-8"
ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream for model "
    "that generates various number of responses"
)


def _hostport(url: str) -> str:
    return url.split("//", 1)[-1]


def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
    """(status, content type, body bytes) of one POST; ``body`` as JSON unless bytes."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(_hostport(url), timeout=60)
    try:
        conn.request("POST", path, body=raw, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type"), resp.read()
    finally:
        conn.close()


def both(triton: Any, frontend: Any, path: str, body: Any) -> tuple[Any, Any]:
    return post(triton.http_url, path, body), post(frontend.http_url, path, body, KEY)


SIXTEEN = list(range(1, 17))
ANSWERS = [
    ("repeat_decoupled", {"IN": [5]}),
    ("repeat_decoupled", {"IN": 7, "id": "req-1"}),
    ("repeat_decoupled", {"parameters": {"IN": [9]}}),  # an input named in parameters
    ("simple", {"INPUT0": SIXTEEN, "INPUT1": [1] * 16}),
    ("simple_nobatch", {"INPUT0": SIXTEEN, "INPUT1": [2] * 16, "parameters": {"a": 1.5}}),
    ("simple_identity", {"INPUT0": ["a", 'b"\u00e9\n\u0001\\']}),
    ("simple_identity", {"INPUT0": "one"}),
    ("generate", {"INPUT_IDS": [1, 2, 3], "parameters": {"max_tokens": 4}}),
    ("generate", {"INPUT_IDS": 7, "max_tokens": 1}),  # a scalar: one element, one token
]


@pytest.mark.parametrize(("model", "body"), ANSWERS)
def test_generate_answers_as_triton_does(triton, frontend, model: str, body: Any) -> None:
    direct, through = both(triton, frontend, f"/v2/models/{model}/generate", body)
    assert direct[0] == 200, direct
    assert through == direct
    assert through[1] == "application/json"
    doc = json.loads(through[2])
    assert doc["model_name"] == model and doc["model_version"] == "1"


@pytest.mark.parametrize(("model", "body"), ANSWERS)
def test_generate_stream_sends_the_same_events(triton, frontend, model: str, body: Any) -> None:
    path = f"/v2/models/{model}/versions/1/generate_stream"
    direct, through = both(triton, frontend, path, body)
    assert direct[:2] == (200, SSE), direct
    assert through == direct
    assert through[2].startswith(b"data: {") and through[2].endswith(b"}\n\n")


def test_a_decoupled_model_streams_one_event_per_response(triton, frontend) -> None:
    path = "/v2/models/repeat_decoupled/generate_stream"
    direct, through = both(triton, frontend, path, {"IN": [1, 2, 3]})
    assert through == direct
    events = through[2].split(b"\n\n")
    assert events[-1] == b""
    assert [json.loads(e.removeprefix(b"data: "))["OUT"] for e in events[:-1]] == [1, 2, 3]
    # No response at all: an empty 200 event stream, as Triton's.
    assert both(triton, frontend, path, {"IN": []}) == ((200, SSE, b""),) * 2


@pytest.mark.parametrize("values", [[1, 2, 3], []])
def test_generate_refuses_other_than_one_response_like_triton(triton, frontend, values) -> None:
    direct, through = both(triton, frontend, "/v2/models/repeat_decoupled/generate", {"IN": values})
    # Triton's quirk: the status went out with the first response, the error at the end.
    assert direct == (200, "application/json", b'{"error":"' + ONE_RESPONSE.encode() + b'"}')
    assert through == direct


ERRORS = [
    # unknown model and version: generate looks up the model's metadata first (404)
    ("no_such_model", {"IN": [1]}),
    ("repeat_decoupled/versions/7", {"IN": [1]}),
    # missing input (Triton core's message, request id prefix included)
    ("simple", {"INPUT0": SIXTEEN}),
    ("repeat_decoupled", {"id": "r9", "x": 1}),
    # wrong types: Triton's JSON accessors answer 500
    ("repeat_decoupled", {"IN": ["a"]}),
    ("repeat_decoupled", {"IN": [1.5]}),
    ("repeat_decoupled", {"IN": [[1, 2]]}),
    ("simple_identity", {"INPUT0": [1]}),
    ("simple_identity", {"INPUT0": [["a", "b"]]}),
    ("repeat_decoupled", {"IN": [1], "id": 5}),
    # shapes and keys Triton rejects
    ("simple", {"INPUT0": 1, "INPUT1": 2}),
    ("repeat_decoupled", {"IN": [1], "x": [1]}),
    ("repeat_decoupled", {"IN": [1], "x": None}),
    ("repeat_decoupled", {"IN": [1], "parameters": 5}),
    ("repeat_decoupled", {"IN": [1], "parameters": {"a": {}}}),
    # bodies that are not a JSON object
    ("repeat_decoupled", b""),
    ("repeat_decoupled", b"[1]"),
]


@pytest.mark.parametrize(("model", "body"), ERRORS)
@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_errors_have_tritons_status_and_message(triton, frontend, model, body, route) -> None:
    direct, through = both(triton, frontend, f"/v2/models/{model}/{route}", body)
    assert direct[0] >= 400, direct
    assert through == direct


def test_a_body_that_is_not_json_is_refused_as_triton_does(triton, frontend) -> None:
    direct, through = both(triton, frontend, "/v2/models/simple/generate", b"not json")
    assert through[:2] == direct[:2] == (500, "application/json")
    prefix = "failed to parse the request JSON buffer: "
    assert json.loads(direct[2])["error"].startswith(prefix)
    assert json.loads(through[2])["error"].startswith(prefix)


def test_a_model_error_starts_the_stream_as_an_event(triton, frontend) -> None:
    direct, through = both(triton, frontend, "/v2/models/raiser/generate_stream", {"X": [13]})
    assert direct[:2] == (400, SSE)
    # The same event, with the model's message. The status is the one the core's
    # forwarder gives a failed batch (500 where Triton says 400, as on /infer).
    assert through[1:] == direct[1:]
    assert through[0] >= 400
    assert b"refusing the value 13" in through[2]


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_no_api_key_is_refused_before_the_body(frontend, route: str) -> None:
    status, ctype, body = post(
        frontend.http_url, f"/v2/models/repeat_decoupled/{route}", b"not even json"
    )
    assert (status, ctype) == (401, "application/json")
    assert "API key" in json.loads(body)["error"]


def _cancelled(frontend: Any, tenant: str) -> float:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        frontend.metrics_url, timeout=10
    ) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if (
            line.startswith("fair_requests_total{")
            and f'tenant="{tenant}"' in line
            and 'outcome="cancelled"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_client_that_leaves_mid_stream_cancels_its_request(frontend) -> None:
    before = _cancelled(frontend, "hooli")
    conn = http.client.HTTPConnection(_hostport(frontend.http_url), timeout=60)
    body = json.dumps({"IN": list(range(200_000))}).encode()
    conn.request("POST", "/v2/models/repeat_decoupled/generate_stream", body=body, headers=KEY)
    resp = conn.getresponse()
    assert (resp.status, resp.getheader("Content-Type")) == (200, SSE)
    assert (
        resp.readline() == b'data: {"OUT":0,"model_name":"repeat_decoupled","model_version":"1"}\n'
    )
    conn.sock.close()  # leave with ~200k responses still to come
    conn.close()
    # The frontend counts it, once, as cancelled (polled: the close reaches it
    # asynchronously); a request still streaming would never be counted.
    deadline = time.monotonic() + 30
    while _cancelled(frontend, "hooli") < before + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _cancelled(frontend, "hooli") == before + 1
    # ... and serves the next one.
    status, ctype, out = post(
        frontend.http_url, "/v2/models/repeat_decoupled/generate_stream", {"IN": [4, 2]}, KEY
    )
    assert (status, ctype) == (200, SSE)
    assert out.count(b"data: ") == 2


def test_llm_streams_the_same_events_as_triton(triton, frontend) -> None:
    llm_served(triton)
    body = {
        "text_input": "The quick brown fox",
        "parameters": {"stream": True, "max_tokens": 8, "temperature": 0},
    }
    direct, through = both(triton, frontend, "/v2/models/llm/generate_stream", body)
    assert direct[:2] == (200, SSE), direct
    assert through == direct


LLM_STREAM = {
    "text_input": "Tenants share the engine",
    "parameters": {"stream": True, "max_tokens": 6, "temperature": 0},
}


def test_llm_streams_are_tritons_own_events_on_kept_alive_connections(triton) -> None:
    """A generate_stream client of ``llm`` (an endpoint that counts tokens from the model's
    own count) reads Triton's events as Triton wrote them, read from Triton's
    generate_stream: one connection serves stream after stream, and its events, counts
    taken out, are the client's, the same bytes as Triton's own answer."""
    llm_served(triton)
    path = "/v2/models/llm/generate_stream"
    with running_frontend(make_config(), triton, workers=1) as fe:
        events = fe.gateway.tritons[0].events
        assert events is not None
        before = metric_sum(fe, "fair_output_tokens_total", tenant="hooli")
        for _ in range(3):
            direct, through = both(triton, fe, path, LLM_STREAM)
            assert direct[:2] == (200, SSE), direct
            assert through == direct
            assert direct[2].count(b"data: ") == 6 and b"num_output_tokens" not in direct[2]
        assert (events.streams, events.connections) == (3, 1)
        # An OpenAI chat stream reads the same events (its text taken from each).
        status, ctype, chat = post(
            fe.http_url,
            "/v1/chat/completions",
            {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "stream": True,
             "max_tokens": 6, "temperature": 0},
            KEY,
        )  # fmt: skip
        assert (status, ctype.split(";")[0]) == (200, "text/event-stream"), chat
        assert chat.endswith(b"data: [DONE]\n\n"), chat
        assert (events.streams, events.connections) == (4, 1)
        texts = [
            json.loads(line[6:])["choices"][0]["delta"].get("content", "")
            for line in chat.split(b"\n\n")
            if line.startswith(b"data: {")
        ]
        assert "".join(texts)
        # Every token counted from the count the shell asked the model for (and took out
        # where the client did not ask for it): 3 streams and the chat, 6 tokens each.
        deadline = time.monotonic() + 30
        while metric_sum(fe, "fair_output_tokens_total", tenant="hooli") < before + 24:
            assert time.monotonic() < deadline, "the streams' tokens never reached the core"
            time.sleep(0.02)
        assert metric_sum(fe, "fair_output_tokens_total", tenant="hooli") == before + 24


def test_an_llm_client_that_asks_for_the_count_gets_it(triton, frontend) -> None:
    body = {**LLM_STREAM, "return_num_output_tokens": True}
    direct, through = both(triton, frontend, "/v2/models/llm/generate_stream", body)
    assert through == direct
    assert direct[2].count(b'"num_output_tokens":1,') == 6


def test_an_llm_client_that_leaves_mid_stream_cancels_it_in_triton(triton, frontend) -> None:
    llm_served(triton)
    triton_cancelled = scrape(triton.metrics_url).sum("fair_llm_cancelled_total")
    before = _cancelled(frontend, "hooli")
    conn = http.client.HTTPConnection(_hostport(frontend.http_url), timeout=60)
    body = {**LLM_STREAM, "parameters": {"stream": True, "max_tokens": 480}}
    conn.request("POST", "/v2/models/llm/generate_stream", body=json.dumps(body), headers=KEY)
    resp = conn.getresponse()
    assert (resp.status, resp.getheader("Content-Type")) == (200, SSE)
    assert resp.readline().startswith(b'data: {"model_name":"llm"')
    conn.sock.close()  # leave with thousands of tokens still to come
    conn.close()
    deadline = time.monotonic() + 30
    while (
        _cancelled(frontend, "hooli") < before + 1
        or scrape(triton.metrics_url).sum("fair_llm_cancelled_total") < triton_cancelled + 1
    ):
        assert time.monotonic() < deadline, "the stream was not cancelled in Triton"
        time.sleep(0.02)
    assert _cancelled(frontend, "hooli") == before + 1
    # ... and the next one is served.
    status, ctype, out = post(frontend.http_url, "/v2/models/llm/generate_stream", LLM_STREAM, KEY)
    assert (status, ctype) == (200, SSE) and out.count(b"data: ") == 6


def test_an_llm_client_that_reads_slowly_gets_every_token_once_and_in_order(
    triton, frontend
) -> None:
    """A client with a small receive window that reads a little at a time: Triton's events
    wait in the shell (the relay writes only as the client's socket takes them) and
    reach it whole, each once and in order: the bytes Triton itself answers."""
    llm_served(triton)
    body = {**LLM_STREAM, "parameters": {"stream": True, "max_tokens": 480, "temperature": 0}}
    path = "/v2/models/llm/generate_stream"
    direct = post(triton.http_url, path, body)
    assert direct[:2] == (200, SSE) and direct[2].count(b"data: ") == 480
    host, port = _hostport(frontend.http_url).rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: the window
    sock.settimeout(60)
    sock.connect((host, int(port)))
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.sock = sock
    try:
        conn.request("POST", path, body=json.dumps(body), headers=KEY)
        resp = conn.getresponse()
        assert (resp.status, resp.getheader("Content-Type")) == (200, SSE)
        got = []
        while piece := resp.read(256):
            got.append(piece)
            time.sleep(0.002)  # the client's pace (not a wait for the server)
    finally:
        conn.close()
    assert b"".join(got) == direct[2]
