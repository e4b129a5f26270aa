"""The API routes at the door (issue 29, items 1 and 3, and item 6's names): the same door
as the KServe routes (``shell.door``), the model read from the body.

Before, ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v2/rerank`` and
``/v1/rerank`` read the whole body against the largest body any model takes (129 MiB here),
parsed it with ``json.loads``, and only then looked at its model: a 31 MiB chat naming a
model the tenant may not call cost the shell 807 MiB before its 404, and a 1 MiB model name
came back whole in that 404. Now:

- a body naming a model the tenant may not call (or one that does not exist) is refused
  404 ``model_not_found`` from its first bytes: the answer comes while most of its declared
  length is unsent, and none of that length was held against the shell's reading bound
  (``server.http_max_reading_bytes``: bodies that would not fit beside each other are all
  let in, each then refused);
- a body is bounded by the model it names: over that model's bound (smaller than the
  largest), it is refused before the rest is read, declared or chunked;
- a model named after a long array is still found, checked, and served or refused; until
  it is found the body is read only within the largest body a model of this tenant takes;
- a name over 1 KiB is refused 400 on every route without being echoed, in the answer or
  the request log;
- the door's scan and the route's decoder agree on the model (JSON keeps the last of two
  ``"model"`` members, the scan the first: two different ones are refused);
- ``Expect: 100-continue`` is granted only once the headers passed (a declared length over
  what the tenant's models take is refused with no 100);
- a large body is decoded off the event loop, and the model it names late found there too.

Real stack: the session's Triton, the frontend in both worker modes; raw HTTP over sockets
(declared lengths that are never sent, chunked bodies, two members of one name: no SDK
sends these).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import select
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import Config, parse_config
from fair_frontend.kit.testing import eventually
from fair_frontend.observability.logs import REQUEST_LOGGER, JsonFormatter
from fair_frontend.shell import door as shell_door
from fair_frontend.shell.api import openai as openai_api
from fair_frontend.shell.api import rerank as rerank_api
from fair_frontend.shell.door import SCAN_BYTES
from tests.support import (
    ANSWER_TIMEOUT_S,
    KEYS,
    Answer,
    RunningFrontend,
    config_dict,
    connect,
    metric_sum,
    read_answer,
    request,
    running_frontend,
    send_head,
)

SMALL_REQUEST_BYTES = 64 << 10  # embed's, rerank's and llm's max_request_bytes here
BODY_TIMEOUT_S = 5.0
TIER_MODELS = {
    "enterprise": ["*"],  # acme: every model (an unknown one is looked up)
    "standard": ["embed", "rerank", "llm", "generate"],  # initech: generate takes 129 MiB
    "trial": ["embed", "rerank"],  # umbrella: only models with small bodies
}


def api_door_config() -> Config:
    """embed, rerank and llm take small bodies (about 1.1 MiB), every other model the
    default (about 129 MiB: generate, and any model ``"*"`` opens); the shell reads at once
    no more than the largest body (two bodies over half of it do not fit at once)."""
    data = config_dict()
    data["tier_models"] = TIER_MODELS
    for name in ("embed", "rerank", "llm"):
        data["endpoints"][name]["max_request_bytes"] = SMALL_REQUEST_BYTES
    data["server"] = {"http_body_timeout_s": BODY_TIMEOUT_S}
    data["server"]["http_max_reading_bytes"] = parse_config(data).max_wire_bytes()
    return parse_config(data)


CONFIG = api_door_config()
LARGEST = CONFIG.max_wire_bytes()  # any model's; initech's and acme's reach
SMALL_BOUND = CONFIG.endpoint("embed").max_wire_bytes  # embed's, rerank's, llm's; umbrella's reach


@pytest.fixture(scope="module")
def fe(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    with running_frontend(CONFIG, triton, workers=workers) as running:
        yield running


@dataclass(frozen=True)
class Route:
    path: str
    field: str  # a member a body of it carries beside "model" (a long one, in these tests)
    model: str  # a model it serves here
    valid: dict[str, Any]  # what a valid body of it carries beside "model"
    cohere: bool = False  # Cohere's error body, {"message": ...}; else OpenAI's envelope


RERANK_CALL = {"query": "Which rivers flow through Vienna?", "documents": ["The Danube."]}
ROUTES = {
    "chat": Route(
        "/v1/chat/completions", "messages", "llm",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    ),
    "completions": Route("/v1/completions", "prompt", "llm", {"prompt": "hi", "max_tokens": 1}),
    "embeddings": Route("/v1/embeddings", "input", "embed", {"input": "hi"}),
    "cohere": Route("/v2/rerank", "documents", "rerank", RERANK_CALL, cohere=True),
    "jina": Route("/v1/rerank", "documents", "rerank", RERANK_CALL),
}  # fmt: skip
KSERVE = ["infer", "generate", "generate_stream"]


def key(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}", "content-type": "application/json"}


def error(route: Route, answer: Answer) -> tuple[str, Any]:
    """(message, OpenAI's code or None) of an error answer, in the route's envelope."""
    doc = json.loads(answer.body)
    if route.cohere:
        assert set(doc) == {"message"}, doc
        return str(doc["message"]), None
    return str(doc["error"]["message"]), doc["error"]["code"]


def opening(model: str, route: Route, pad: int = 4096) -> bytes:
    """The first bytes of a body naming ``model`` first, then a long string member."""
    return f'{{"model": {json.dumps(model)}, "{route.field}": "'.encode() + b"x" * pad


def sent_then_answered(url: str, path: str, headers: dict[str, str], first: bytes) -> Answer:
    """Send a request's headers and only ``first`` of its body, then read the answer: it
    can only have come before the rest of the body (which is never sent)."""
    with connect(url) as sock:
        send_head(sock, path, headers)
        sock.sendall(first)
        return read_answer(sock)


# ---- a model the tenant may not call: refused from its first bytes ------------------------

CLOSED = {
    "exists-closed": ("initech", "simple"),  # Triton serves it; initech's tier does not open it
    "unknown-closed": ("initech", "no-such-model"),  # refused by access, no lookup
    "unknown-open": ("acme", "no-such-model"),  # open to acme: looked up, and not found
}


@pytest.mark.parametrize("case", CLOSED.values(), ids=CLOSED.keys())
@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
def test_a_model_the_tenant_may_not_call_is_refused_before_its_body_is_read(
    fe: RunningFrontend, route: Route, case: tuple[str, str]
) -> None:
    """31 MiB declared (within what the tenant's models take), 4 KiB sent: the 404 comes
    with 30.99 MiB unsent, and the connection is closed (the rest is never read). Before,
    the body was awaited whole (here: 408 once the body timeout passed)."""
    tenant, model = case
    headers = {**key(tenant), "Content-Length": str(31 << 20)}
    answer = sent_then_answered(fe.http_url, route.path, headers, opening(model, route))
    assert answer.status == 404, answer
    message, code = error(route, answer)
    assert model in message, message
    assert code == (None if route.cohere else "model_not_found")
    assert answer.headers.get("connection") == "close"


def test_bodies_for_a_closed_model_are_not_held_against_the_reading_bound(
    fe: RunningFrontend, workers: int
) -> None:
    """Bodies of just over half the shell's reading bound, declared with ``Expect:
    100-continue``, naming a model the tenant may not call: before, each was held whole
    from its headers, so the second in a shell was refused 503 (by the pigeonhole, one of
    workers + 1). Now each holds only what the scan reads until its model is refused: all
    are let in, each is answered 404 from its first bytes, each refusal counted."""
    limit = CONFIG.http_max_reading_bytes()
    declared = limit // 2 + 1
    assert declared <= LARGEST  # within initech's reach: only its model refuses it
    route = ROUTES["chat"]
    refused_before = metric_sum(fe, "fair_requests_total", tenant="initech")
    socks: list[socket.socket] = []
    try:
        for _ in range(workers + 1):
            sock = connect(fe.http_url)
            socks.append(sock)
            headers = {**key("initech"), "Content-Length": str(declared)}
            send_head(sock, route.path, {**headers, "Expect": "100-continue"})
            reader = sock.makefile("rb")
            status = reader.readline().split()
            assert status[1] == b"100", status  # let in, its declared length not held
            assert reader.readline() == b"\r\n"
        for sock in socks:  # all of them waiting for their bodies at once
            sock.sendall(opening("simple", route))
            answer = read_answer(sock)
            assert answer.status == 404, answer
            assert error(route, answer)[1] == "model_not_found"
    finally:
        for sock in socks:
            sock.close()
    eventually(
        lambda: (
            metric_sum(fe, "fair_requests_total", tenant="initech") >= refused_before + workers + 1
        ),
        ANSWER_TIMEOUT_S,
        what="the door's refusals counted",
    )


# ---- each model's own bound ------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
def test_a_declared_length_over_the_named_models_bound_is_refused_before_the_rest(
    fe: RunningFrontend, route: Route
) -> None:
    """10 MiB declared: within what initech's models take (generate's 129 MiB), over what
    the named model takes (about 1.1 MiB): refused once the model is read, with the rest
    unsent. Before, the body was awaited whole against the largest bound."""
    headers = {**key("initech"), "Content-Length": str(10 << 20)}
    answer = sent_then_answered(fe.http_url, route.path, headers, opening(route.model, route))
    assert answer.status == 400, answer
    message, _ = error(route, answer)
    assert "too large" in message and f"'{route.model}'" in message, message
    assert f"{10 << 20} bytes" in message and str(SMALL_BOUND) in message, message
    assert answer.headers.get("connection") == "close"


def chunked_until_answered(sock: socket.socket, first: bytes, most: int) -> Answer:
    """A chunked body: ``first``, then more of the string it opened, until the server
    answers or ``most`` bytes are sent, and never its last chunk (an answer comes from
    what was read, not from its end)."""
    data = first
    sent = 0
    while sent < most:
        sock.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        sent += len(data)
        data = b"x" * (64 << 10)
        readable, _, _ = select.select([sock], [], [], 0)
        if readable:
            break
    return read_answer(sock)


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
def test_a_chunked_body_is_cut_off_at_the_named_models_bound(
    fe: RunningFrontend, route: Route
) -> None:
    with connect(fe.http_url) as sock:
        send_head(sock, route.path, {**key("initech"), "Transfer-Encoding": "chunked"})
        answer = chunked_until_answered(sock, opening(route.model, route), 4 * SMALL_BOUND)
    assert answer.status == 400, answer
    message, _ = error(route, answer)
    assert "too large" in message and f"'{route.model}'" in message, message


# ---- a model named late ----------------------------------------------------------------------


def messages(total: int) -> list[dict[str, str]]:
    one = {"role": "user", "content": "y" * 200}
    return [one] * (total // 230 + 1)


def test_a_model_named_after_a_long_array_is_found_and_checked(fe: RunningFrontend) -> None:
    """OpenAI's SDK writes ``messages`` before ``model``: past the scan's first bytes,
    the body is read within the tenant's reach and its model found whole. A model the
    tenant may not call: 404; one it may call, with the body over that model's bound:
    400 naming the model's limit; a rerank whose model follows 40 KiB of documents: served."""
    late = json.dumps({"messages": messages(4 * SCAN_BYTES), "model": "simple"}).encode()
    assert late.index(b'"model"') > 4 * SCAN_BYTES
    closed = request(fe.http_url, "/v1/chat/completions", late, key("initech"))
    assert closed.status == 404, closed
    assert error(ROUTES["chat"], closed)[1] == "model_not_found"

    over = json.dumps({"messages": messages(SMALL_BOUND + 1000), "model": "llm"}).encode()
    assert SMALL_BOUND < len(over) < LARGEST
    big = request(fe.http_url, "/v1/chat/completions", over, key("initech"))
    assert big.status == 400, big
    message, _ = error(ROUTES["chat"], big)
    assert "too large" in message and "the body limit for 'llm'" in message, message

    documents = [f"document {i} about the rivers and the cities of Europe" for i in range(800)]
    served = json.dumps({"query": "Vienna?", "documents": documents, "model": "rerank"})
    assert served.index('"model"') > SCAN_BYTES
    answer = request(fe.http_url, "/v2/rerank", served.encode(), key("umbrella"))
    assert answer.status == 200, answer
    assert len(json.loads(answer.body)["results"]) == len(documents)


def test_a_body_naming_no_model_early_is_read_only_within_the_tenants_reach(
    fe: RunningFrontend,
) -> None:
    """umbrella's models take about 1.1 MiB: a chunked body whose model has not come by
    then is refused once it passes that, not read on to the largest body (129 MiB)."""
    first = b'{"input": [' + b"1," * (SCAN_BYTES)
    with connect(fe.http_url) as sock:
        send_head(sock, "/v1/embeddings", {**key("umbrella"), "Transfer-Encoding": "chunked"})
        answer = chunked_until_answered(sock, first, 4 * SMALL_BOUND)
    assert answer.status == 400, answer
    message, _ = error(ROUTES["embeddings"], answer)
    assert "largest body of any model this key may call" in message, message
    assert str(SMALL_BOUND) in message, message


def test_the_door_and_the_decoder_agree_on_the_model(fe: RunningFrontend) -> None:
    """JSON keeps the last of two members of one name, the door's scan the first: a body
    naming embed (open to umbrella) and then llm (not) would pass the door for one and be
    served for the other. Refused, naming ``model``; the same name twice is served."""
    twice = b'{"model": "embed", "input": "hello", "model": "llm"}'
    answer = request(fe.http_url, "/v1/embeddings", twice, key("umbrella"))
    assert answer.status == 400, answer
    doc = json.loads(answer.body)["error"]
    assert doc["param"] == "model" and "more than once" in doc["message"], doc
    same = b'{"model": "embed", "input": "hello", "model": "embed"}'
    assert request(fe.http_url, "/v1/embeddings", same, key("umbrella")).status == 200


def test_jina_and_vllm_may_leave_the_model_out(fe: RunningFrontend) -> None:
    for extra in ({}, {"model": None}, {"model": ""}):
        body = json.dumps({"query": "Vienna?", "documents": ["a", "b"], **extra}).encode()
        answer = request(fe.http_url, "/v1/rerank", body, key("umbrella"))
        assert answer.status == 200, (extra, answer)
    body = json.dumps({"query": "Vienna?", "documents": ["a", "b"]}).encode()
    answer = request(fe.http_url, "/v2/rerank", body, key("umbrella"))  # Cohere requires it
    assert answer.status == 400 and "model" in error(ROUTES["cohere"], answer)[0], answer


# ---- names over 1 KiB: refused, never echoed -------------------------------------------------

LONG_NAME = "n" * (1 << 20)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    """Every log line of this process (the request log at INFO): in one-process mode,
    the shell's too."""
    lines = _Lines()
    logger = logging.getLogger()
    level = logging.getLogger(REQUEST_LOGGER).level
    logging.getLogger(REQUEST_LOGGER).setLevel(logging.INFO)
    logger.addHandler(lines)
    try:
        yield lines.lines
    finally:
        logger.removeHandler(lines)
        logging.getLogger(REQUEST_LOGGER).setLevel(level)


def assert_unechoed(answer: Answer) -> None:
    assert answer.status == 400, answer.status
    assert b"nnnnnnnnnnnnnnnn" not in answer.body and len(answer.body) < 2048, answer.body[:300]
    assert b"too long" in answer.body, answer.body


@pytest.mark.parametrize("tenant", ["umbrella", "acme"])
@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
def test_a_1_mib_model_name_is_refused_unechoed(
    fe: RunningFrontend, route: Route, tenant: str, workers: int, log_lines: list[str]
) -> None:
    """A body valid but for its model's name. Before, a tenant the name is not open to
    (umbrella) got it back whole in a 404; one every model is open to (acme), a 400 from
    the gateway once the body was parsed. Now both, from the door, before the name is in."""
    body = json.dumps({"model": LONG_NAME, **route.valid}).encode()
    answer = request(fe.http_url, route.path, body, key(tenant))
    assert_unechoed(answer)
    if not route.cohere:
        assert json.loads(answer.body)["error"]["param"] == "model"
    if workers == 1:  # the shells of two-shell mode log in their own processes
        assert log_lines and max(len(line) for line in log_lines) < 8192


@pytest.mark.parametrize("door", KSERVE)
@pytest.mark.parametrize("size", [2048, 1 << 20])
def test_a_long_model_name_in_the_path_is_refused_unechoed(
    fe: RunningFrontend, door: str, size: int
) -> None:
    """KServe's routes name the model in the path: over 1 KiB, 400 (over aiohttp's 8 KiB
    request line, aiohttp's own 400): the name is not echoed either way."""
    with connect(fe.http_url) as sock:
        # Refused at 8 KiB and the connection closed: the rest of a 1 MiB head may meet a
        # closed socket (a loaded machine's server answers before the client has sent it
        # all). The answer came before the close and is read all the same.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            send_head(
                sock,
                f"/v2/models/{'n' * size}/{door}",
                {**key("umbrella"), "Content-Length": "0"},
            )
        answer = read_answer(sock)
    assert answer.status == 400, answer.status
    assert b"nnnnnnnnnnnnnnnn" not in answer.body and len(answer.body) < 2048, answer.body[:300]


# ---- the headers first -----------------------------------------------------------------------


def first_line_after(url: str, path: str, headers: dict[str, str]) -> tuple[bytes, Any]:
    sock = connect(url)
    send_head(sock, path, {**headers, "Expect": "100-continue"})
    reader = sock.makefile("rb")
    return reader.readline().split()[1], (sock, reader)


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
def test_expect_continue_is_granted_only_once_the_headers_passed(
    fe: RunningFrontend, route: Route
) -> None:
    """A bad key, or a declared length over what the tenant's models take (umbrella's,
    about 1.1 MiB: before, the largest of any model's, 129 MiB): refused, no 100. A body
    within them: 100, then read."""
    bad = {"authorization": "Bearer not-a-key", "Content-Length": "1000"}
    status, (sock, _) = first_line_after(fe.http_url, route.path, bad)
    sock.close()
    assert status == b"401"
    over = {**key("umbrella"), "Content-Length": str(10 << 20)}
    status, (sock, _) = first_line_after(fe.http_url, route.path, over)
    sock.close()
    assert status == b"400"
    body = json.dumps({"model": "no-such-model", **route.valid}).encode()
    fits = {**key("umbrella"), "Content-Length": str(len(body))}
    status, (sock, reader) = first_line_after(fe.http_url, route.path, fits)
    with sock:
        assert status == b"100"
        assert reader.readline() == b"\r\n"
        sock.sendall(body)
        answer = read_answer(sock)
    assert answer.status == 404, answer


def test_a_compressed_body_is_refused_naming_its_encoding(fe: RunningFrontend) -> None:
    """The API routes read JSON as it is (KServe's inflate theirs)."""
    headers = {**key("umbrella"), "Content-Encoding": "gzip"}
    answer = request(fe.http_url, "/v1/embeddings", b"\x1f\x8b...", headers)
    assert answer.status == 400, answer
    assert "Content-Encoding 'gzip'" in error(ROUTES["embeddings"], answer)[0]


# ---- large bodies off the event loop ---------------------------------------------------------


@pytest.fixture(scope="module")
def in_process(triton: EmbeddedTriton) -> Iterator[RunningFrontend]:
    """One process: its HTTP shell runs in this one, where a test can hold its decode."""
    with running_frontend(CONFIG, triton, workers=1) as running:
        yield running


@dataclass
class Gate:
    """Holds every call of a wrapped function that ``when`` picks until ``opened``."""

    when: Callable[..., bool]
    entered: threading.Event
    opened: threading.Event

    def wrap(self, work: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any, **kwargs: Any) -> Any:
            if self.when(*args, **kwargs):
                self.entered.set()
                self.opened.wait(ANSWER_TIMEOUT_S * 2)
            return work(*args, **kwargs)

        return held


def held_meanwhile(
    running: RunningFrontend,
    monkeypatch: pytest.MonkeyPatch,
    where: tuple[Any, str],
    when: Callable[..., bool],
    path: str,
    body: bytes,
) -> Answer:
    """Send ``body`` to ``path`` while ``where``'s function is held where ``when`` picks
    its call: a small request sent meanwhile must be answered (were the held call on the
    event loop, the whole shell would wait with it). The large request's answer."""
    module, name = where
    gate = Gate(when, threading.Event(), threading.Event())
    monkeypatch.setattr(module, name, gate.wrap(getattr(module, name)))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(request, running.http_url, path, body, key("acme"))
        try:
            assert gate.entered.wait(ANSWER_TIMEOUT_S), f"{name} was never called"
            simple_served(running.http_url)
            assert not pending.done()
        finally:
            gate.opened.set()
        return pending.result(ANSWER_TIMEOUT_S)


def simple_served(url: str) -> None:
    doc = {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": [[1] * 16]},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [[2] * 16]},
        ]
    }
    answer = request(url, "/v2/models/simple/infer", json.dumps(doc).encode(), key("acme"))
    assert answer.status == 200, answer


HELD = {
    "decode": (openai_api, "decode_chat", {"model": "llm", "messages": messages(300 << 10)}),
    "late model": (shell_door, "model_of", {"messages": messages(300 << 10), "model": "llm"}),
}


@pytest.mark.parametrize("held", HELD.values(), ids=HELD.keys())
def test_a_large_body_is_decoded_off_the_event_loop(
    in_process: RunningFrontend, monkeypatch: pytest.MonkeyPatch, held: tuple[Any, str, Any]
) -> None:
    """A 300 KiB chat body: its decode (and, where its model comes last, the search for
    it) runs on a worker thread. The test holds it midway; a small request sent meanwhile
    is answered. Were it on the loop, the hold would stop the whole shell."""
    module, name, doc = held
    body = json.dumps(doc).encode()
    assert (256 << 10) < len(body) < SMALL_BOUND
    answer = held_meanwhile(
        in_process,
        monkeypatch,
        (module, name),
        lambda raw, *_: len(raw) > 256 << 10,
        "/v1/chat/completions",
        body,
    )
    assert answer.status in (200, 400), answer  # its prompt is judged after: any answer


ANSWERS = {
    "embeddings' answer": (
        (openai_api, "embeddings_body"),
        "/v1/embeddings",
        {"model": "embed", "input": [[1, 2, 3]] * 100},
    ),
    "rerank's rows": (
        (rerank_api, "row_request"),
        "/v2/rerank",
        {"model": "rerank", "query": "q", "documents": ["d"] * 100},
    ),
    "rerank's answer": (
        (rerank_api, "cohere_response"),
        "/v2/rerank",
        {"model": "rerank", "query": "q", "documents": ["d"] * 100},
    ),
}


@pytest.mark.parametrize("held", ANSWERS.values(), ids=ANSWERS.keys())
def test_a_call_of_many_parts_is_made_and_answered_off_the_event_loop(
    in_process: RunningFrontend, monkeypatch: pytest.MonkeyPatch, held: tuple[Any, str, Any]
) -> None:
    """100 embeddings or rerank documents: the requests of their parts and the JSON of
    their answer are made on a worker thread (2,048 embeddings of 128 numbers take about
    0.4 s to write, 10,000 rerank rows 0.3 s to make)."""
    where, path, doc = held
    answer = held_meanwhile(
        in_process, monkeypatch, where, lambda *_, **__: True, path, json.dumps(doc).encode()
    )
    assert answer.status == 200, answer
