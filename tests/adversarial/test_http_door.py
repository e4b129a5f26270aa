"""Hostile HTTP clients at the door: no work before identity, and no body without bounds.

Issue 11, item 1 on the HTTP transport. What a client sends must not cost the frontend
more than its headers entitle it to:

- a request whose headers already fail (no key, an unknown key, an unknown tenant from a
  trusted gateway) is answered from the headers alone: the body is never waited for (the
  tests send none at all, so an answer proves it was not read);
- a request is bounded by the limit of the model it names, not by the largest limit of
  any model: a declared Content-Length over it is refused unread, a chunked body is cut
  off once it passes it, an inflated body stops inflating at it;
- a body that trickles in is answered 408 after ``server.http_body_timeout_s`` and its
  connection closed;
- decoding a large body does not hold the event loop: other clients are served while it
  runs, and binary tensors are views of the body (``np.frombuffer``), not copies.

Issue 17 (item 6, on HTTP): connections are bounded too.

- a connection that sends nothing, or its headers a byte at a time, is closed after
  ``server.header_timeout_s`` (aiohttp alone would keep it for an hour), while an idle
  keep-alive connection between requests is not cut;
- connections over ``server.http_max_connections_per_peer`` from one address, or over
  ``server.http_max_connections`` in all, are closed at once, and counted; a tenant from
  another address is served meanwhile;
- bodies read at once in a shell are bounded over all its connections
  (``server.http_max_reading_bytes``): one that does not fit is refused 503 from its
  headers, before ``100 Continue``.

Clients here speak raw HTTP over sockets, so that lying headers, unfinished bodies and
``Expect: 100-continue`` reach the server exactly as written. Clients of the connection
caps connect from other loopback addresses (127.0.0.2 and up), as other hosts would.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import http.client
import itertools
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import parse_config
from fair_frontend.shell import http_server
from fair_frontend.shell.http_codec import decode_infer
from tests.support import (
    ANSWER_TIMEOUT_S,
    KEYS,
    Answer,
    RunningFrontend,
    config_dict,
    connect,
    embed_body,
    metric_sum,
    read_answer,
    request,
    running_frontend,
    send_head,
)

KEY = {"authorization": f"Bearer {KEYS['acme']}"}
SMALL_BYTES = 2000  # embed's max_request_bytes here: 500 INT32 tokens
BODY_TIMEOUT_S = 2.0
# A body size between embed's limit here (~1 MiB of body) and the largest any model here
# allows (the default endpoint's 64 MiB of tensors, ~129 MiB of body).
BETWEEN_LIMITS = 10 << 20
DOORS = ["infer", "generate", "generate_stream"]


def door_config(**overrides: Any) -> dict[str, Any]:
    """Test tenants; embed's requests small, every other model's at the default limit."""
    data = config_dict(**overrides)
    data["endpoints"]["embed"]["max_request_bytes"] = SMALL_BYTES
    data["server"] = {**data.get("server", {}), "http_body_timeout_s": BODY_TIMEOUT_S}
    return data


@pytest.fixture(scope="module")
def door(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    with running_frontend(parse_config(door_config()), triton, workers=workers) as running:
        yield running


@pytest.fixture(scope="module")
def trusted(triton: EmbeddedTriton) -> Iterator[RunningFrontend]:
    """Behind an authenticating gateway: tenants named by ``x-tenant-id``."""
    auth = {"trusted_gateway": True, "trusted_gateway_peers": ["127.0.0.1"]}
    config = parse_config(door_config(auth=auth))
    with running_frontend(config, triton, workers=1) as running:
        yield running


# ---- raw HTTP ------------------------------------------------------------------------------


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed the connection (EOF), with nothing more sent. The
    client stops sending first, as one does on ``Connection: close`` (until then the
    server reads and discards what still comes, for aiohttp's lingering time)."""
    sock.shutdown(socket.SHUT_WR)
    return sock.recv(1) == b""


def door_path(model: str, door: str) -> str:
    return f"/v2/models/{model}/{door}"


def simple_served(url: str) -> None:
    """A normal request to `simple` is answered with the right sums (the server serves)."""
    values = list(range(16))
    doc = {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": [values]},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [[1] * 16]},
        ]
    }
    answer = request(url, "/v2/models/simple/infer", json.dumps(doc).encode(), KEY)
    assert answer.status == 200, answer
    outputs = {o["name"]: o["data"] for o in json.loads(answer.body)["outputs"]}
    assert outputs["OUTPUT0"] == [v + 1 for v in values]


# ---- identity before the body --------------------------------------------------------------

NO_GOOD_KEY = {
    "no-key": {},
    "unknown-key": {"authorization": "Bearer not-a-key"},
    "malformed": {"authorization": "Basic abc"},
    "unknown-x-api-key": {"x-api-key": "not-a-key"},
}


@pytest.mark.parametrize("door_name", DOORS)
@pytest.mark.parametrize("headers", NO_GOOD_KEY.values(), ids=NO_GOOD_KEY.keys())
def test_a_request_without_a_good_key_is_refused_before_its_body(
    door: RunningFrontend, door_name: str, headers: dict[str, str]
) -> None:
    """64 MiB declared, none sent: a 401 can only come from the headers."""
    with connect(door.http_url) as sock:
        send_head(sock, door_path("simple", door_name), {**headers, "Content-Length": "67108864"})
        answer = read_answer(sock)
    assert answer.status == 401, answer
    assert "key" in answer.error


def test_an_unknown_tenant_from_a_trusted_gateway_is_refused_before_its_body(
    trusted: RunningFrontend,
) -> None:
    """The tenant the gateway names in ``x-tenant-id`` is checked from the header; only a
    request naming none waits for its body (where a ``tenant`` parameter may name it)."""
    with connect(trusted.http_url) as sock:
        headers = {"x-tenant-id": "nobody", "Content-Length": "67108864"}
        send_head(sock, door_path("simple", "infer"), headers)
        answer = read_answer(sock)
    assert answer.status == 401, answer
    assert "unknown tenant" in answer.error
    named = request(
        trusted.http_url, "/v2/models/embed/infer", embed_body(4), {"x-tenant-id": "acme"}
    )
    assert named.status == 200, named


def test_expect_continue_is_not_granted_to_a_request_refused_by_its_headers(
    door: RunningFrontend,
) -> None:
    """``Expect: 100-continue`` (curl sends it for large bodies): the client is told to
    send its body only once its headers passed; refused, it gets the refusal instead."""
    with connect(door.http_url) as sock:
        headers = {"authorization": "Bearer not-a-key", "Content-Length": "1000"}
        send_head(sock, door_path("simple", "infer"), {**headers, "Expect": "100-continue"})
        first = sock.makefile("rb").readline()
    assert first.split()[1] == b"401", first
    with connect(door.http_url) as sock:
        headers = {**KEY, "Content-Length": str(BETWEEN_LIMITS), "Expect": "100-continue"}
        send_head(sock, door_path("embed", "infer"), headers)
        first = sock.makefile("rb").readline()
    assert first.split()[1] == b"400", first


def test_expect_continue_is_granted_to_a_request_that_passes(door: RunningFrontend) -> None:
    body = embed_body(4)
    with connect(door.http_url) as sock:
        headers = {**KEY, "Content-Length": str(len(body)), "Expect": "100-continue"}
        send_head(sock, door_path("embed", "infer"), headers)
        reader = sock.makefile("rb")
        assert reader.readline().split()[1] == b"100"
        assert reader.readline() == b"\r\n"
        sock.sendall(body)
        answer = read_answer(sock)
    assert answer.status == 200, answer


# ---- each model's own size bound -----------------------------------------------------------


@pytest.mark.parametrize("door_name", DOORS)
def test_a_declared_length_over_the_model_limit_is_refused_unread(
    door: RunningFrontend, door_name: str
) -> None:
    """embed allows ~1 MiB of body; 10 MiB declared (well within other models' limits)
    is refused from Content-Length, with none of it sent."""
    with connect(door.http_url) as sock:
        send_head(
            sock, door_path("embed", door_name), {**KEY, "Content-Length": str(BETWEEN_LIMITS)}
        )
        answer = read_answer(sock)
    assert answer.status == 400, answer
    assert "too large" in answer.error and "'embed'" in answer.error, answer.error
    assert answer.headers.get("connection") == "close"
    simple_served(door.http_url)


def chunked(data: bytes, size: int = 1 << 16) -> Iterator[bytes]:
    for at in range(0, len(data), size):
        part = data[at : at + size]
        yield f"{len(part):x}\r\n".encode() + part + b"\r\n"


@pytest.mark.parametrize("door_name", DOORS)
def test_a_chunked_body_is_cut_off_at_the_model_limit(
    door: RunningFrontend, door_name: str
) -> None:
    """No length declared: what was read is counted, and the request refused once it
    passes embed's limit, without waiting for a last chunk that never comes."""
    with connect(door.http_url) as sock:
        send_head(sock, door_path("embed", door_name), {**KEY, "Transfer-Encoding": "chunked"})
        for part in chunked(b"x" * (3 << 19)):  # 1.5 MiB, and no terminating chunk
            sock.sendall(part)
        answer = read_answer(sock)
    assert answer.status == 400, answer
    assert "too large" in answer.error and "'embed'" in answer.error, answer.error


def test_an_inflated_body_stops_at_the_model_limit(door: RunningFrontend) -> None:
    """8 MiB of JSON in a few KiB of gzip: inflating stops at embed's limit (not at the
    largest of any model's), and says so."""
    body = gzip.compress(embed_body(4, pad="x" * (8 << 20)))
    answer = request(
        door.http_url, door_path("embed", "infer"), body, {**KEY, "Content-Encoding": "gzip"}
    )
    assert answer.status == 400, answer
    assert "too large" in answer.error and "gzip" in answer.error, answer.error
    assert "'embed'" in answer.error, answer.error


def test_a_body_within_the_limit_of_its_model_is_served(door: RunningFrontend) -> None:
    """The bound is embed's own, not a smaller one: a body just under it is read whole
    (and then judged by its tensors: 600 tokens are over embed's 2000 bytes)."""
    limit = parse_config(door_config()).endpoint("embed").max_wire_bytes
    body = embed_body(4, pad="x" * (limit - len(embed_body(4, pad="")) - 16))
    assert len(body) < limit
    answer = request(door.http_url, door_path("embed", "infer"), body, KEY)
    assert answer.status == 200, answer
    too_many = request(door.http_url, door_path("embed", "infer"), embed_body(600), KEY)
    assert too_many.status == 400 and "2400 bytes" in too_many.error, too_many


# ---- slow bodies ---------------------------------------------------------------------------


def trickle_until_answered(sock: socket.socket, deadline_s: float) -> None:
    """Send the body a byte at a time, a tenth of a second apart, until the server says
    something (or ``deadline_s`` passes): the slowloris client, never idle for long."""
    until = time.monotonic() + deadline_s
    while time.monotonic() < until:
        sock.sendall(b" ")
        readable, _, _ = select.select([sock], [], [], 0.1)
        if readable:
            return


@pytest.mark.parametrize("door_name", DOORS)
def test_a_trickled_body_is_answered_408_and_its_connection_closed(
    door: RunningFrontend, door_name: str
) -> None:
    with connect(door.http_url) as sock:
        send_head(sock, door_path("simple", door_name), {**KEY, "Content-Length": "100000"})
        trickle_until_answered(sock, ANSWER_TIMEOUT_S)
        answer = read_answer(sock)
        assert answer.status == 408, answer
        assert "body" in answer.error and f"{BODY_TIMEOUT_S:g}" in answer.error, answer.error
        assert answer.headers.get("connection") == "close"
        assert closed_by_server(sock)
    simple_served(door.http_url)


# ---- slow headers: the header deadline -----------------------------------------------------

HEADER_TIMEOUT_S = 1.5
# A request head sent a byte every TRICKLE_PAUSE_S: it would take 20 s, far past the
# deadline (and within the client's own ANSWER_TIMEOUT_S).
TRICKLE_PAUSE_S = 0.1
SLOW_HEAD = (
    b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: test\r\n"
    + b"X-Padding: " + b"p" * 120 + b"\r\n"
    + b"Content-Length: 2\r\n\r\n"
)  # fmt: skip


@pytest.fixture(scope="module")
def slow_heads(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    data = door_config()
    data["server"]["header_timeout_s"] = HEADER_TIMEOUT_S
    with running_frontend(parse_config(data), triton, workers=workers) as running:
        yield running


def trickle_head(sock: socket.socket, head: bytes) -> int:
    """Send ``head`` a byte every ``TRICKLE_PAUSE_S`` until the server closes the
    connection; the bytes sent by then (all of them: it never did)."""
    for sent in range(len(head)):
        try:
            sock.sendall(head[sent : sent + 1])
        except (BrokenPipeError, ConnectionResetError):
            return sent
        readable, _, _ = select.select([sock], [], [], TRICKLE_PAUSE_S)
        if readable:
            try:
                if sock.recv(1) == b"":
                    return sent + 1
            except ConnectionResetError:
                return sent + 1
    return len(head)


def test_headers_sent_a_byte_at_a_time_are_cut_off(slow_heads: RunningFrontend) -> None:
    """The slowloris client: never idle, never done. Its connection is closed once its
    headers are late, counted; a tenant is served meanwhile."""
    timeouts = metric_sum(slow_heads, "fair_connections_refused_total", reason="header_timeout")
    with connect(slow_heads.http_url) as sock:
        sent = trickle_head(sock, SLOW_HEAD)
        simple_served(slow_heads.http_url)
    assert sent < len(SLOW_HEAD), "the server read a whole head sent a byte at a time"
    after = metric_sum(slow_heads, "fair_connections_refused_total", reason="header_timeout")
    assert after - timeouts >= 1


def test_a_connection_that_sends_nothing_is_closed(slow_heads: RunningFrontend) -> None:
    with connect(slow_heads.http_url) as sock:
        simple_served(slow_heads.http_url)
        try:
            assert sock.recv(1) == b""
        except ConnectionResetError:
            pass
        except TimeoutError:
            pytest.fail(f"a silent connection was still open after {ANSWER_TIMEOUT_S} s")


def test_a_later_requests_head_sent_slowly_is_cut_off(slow_heads: RunningFrontend) -> None:
    """On a keep-alive connection, the next request's deadline runs from its first byte:
    a head trickled after a served request is cut off too."""
    with connect(slow_heads.http_url) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: test\r\n\r\n")
        answer = read_answer(sock)
        assert answer.status == 200, answer
        assert trickle_head(sock, SLOW_HEAD) < len(SLOW_HEAD)


def test_an_idle_keep_alive_connection_is_not_cut_by_the_header_deadline(
    slow_heads: RunningFrontend,
) -> None:
    """Between requests a connection may idle longer than the header deadline (its
    keep-alive timeout governs): the next request on it is served."""
    with connect(slow_heads.http_url) as sock:
        for _ in range(2):
            body = json.dumps({"inputs": [
                {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": [[1] * 16]},
                {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [[2] * 16]},
            ]}).encode()  # fmt: skip
            send_head(sock, "/v2/models/simple/infer", {**KEY, "Content-Length": str(len(body))})
            sock.sendall(body)
            answer = read_answer(sock)
            assert answer.status == 200, answer
            time.sleep(HEADER_TIMEOUT_S * 2)  # the client idles: the scenario, not a wait


# ---- connection caps -----------------------------------------------------------------------

MAX_CONNECTIONS = 6
MAX_PER_PEER = 3


@pytest.fixture(scope="module")
def capped(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    data = door_config()
    data["server"]["http_max_connections"] = MAX_CONNECTIONS
    data["server"]["http_max_connections_per_peer"] = MAX_PER_PEER
    with running_frontend(parse_config(data), triton, workers=workers) as running:
        yield running


def open_served(url: str, source: str) -> socket.socket | None:
    """A keep-alive connection from ``source`` that was served a health check, left
    open; None when the server closed it unanswered (refused)."""
    sock = connect(url, source)
    try:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: test\r\n\r\n")
        answer = read_answer(sock)
    except (ConnectionError, http.client.HTTPException):
        sock.close()
        return None
    assert answer.status == 200, answer
    return sock


def open_until_refused(url: str, sources: Iterator[str], most: int) -> list[socket.socket]:
    """Connections opened (from ``sources`` in turn) and kept until one is refused, at
    most ``most`` + 1 tried; the ones served."""
    held: list[socket.socket] = []
    for _ in range(most + 1):
        sock = open_served(url, next(sources))
        if sock is None:
            return held
        held.append(sock)
    for sock in held:
        sock.close()
    pytest.fail(f"{most + 1} connections were all served: no cap")


def test_connections_over_the_per_peer_cap_are_closed_while_others_are_served(
    capped: RunningFrontend, workers: int
) -> None:
    """One address holds at most MAX_PER_PEER connections per shell (with two shells the
    kernel chooses the shell of each): one more is closed at once, unanswered, counted;
    a tenant from another address is served meanwhile."""
    refused = metric_sum(
        capped, "fair_connections_refused_total", reason="max_connections_per_peer"
    )
    held = open_until_refused(
        capped.http_url, itertools.repeat("127.0.0.2"), MAX_PER_PEER * workers
    )
    try:
        assert MAX_PER_PEER <= len(held) <= MAX_PER_PEER * workers
        simple_served(capped.http_url)
    finally:
        for sock in held:
            sock.close()
    after = metric_sum(capped, "fair_connections_refused_total", reason="max_connections_per_peer")
    assert after - refused >= 1


def test_connections_over_the_shell_cap_are_closed(capped: RunningFrontend, workers: int) -> None:
    """MAX_CONNECTIONS per shell in all (each from an address of its own, under the
    per-peer cap): one more is closed at once, counted; once they close, a tenant is
    served again."""
    refused = metric_sum(capped, "fair_connections_refused_total", reason="max_connections")
    sources = (f"127.0.0.{n}" for n in itertools.count(10))
    held = open_until_refused(capped.http_url, sources, MAX_CONNECTIONS * workers)
    try:
        assert MAX_CONNECTIONS <= len(held) <= MAX_CONNECTIONS * workers
    finally:
        for sock in held:
            sock.close()
    after = metric_sum(capped, "fair_connections_refused_total", reason="max_connections")
    assert after - refused >= 1
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while open_served(capped.http_url, "127.0.0.1") is None:  # the closes are seen
        assert time.monotonic() < deadline, "connections stayed refused after closing"
    simple_served(capped.http_url)


# ---- bodies read at once ---------------------------------------------------------------------

READING_REQUEST_BYTES = 2000  # every model's max_request_bytes here


def reading_config() -> dict[str, Any]:
    """Every model's requests small, and the shell's reading bound the smallest allowed:
    the largest body a model accepts (two bodies over half of it do not fit at once).
    Bodies may take their time (the test holds some while it opens others)."""
    data = door_config()
    for endpoint in data["endpoints"].values():
        endpoint["max_request_bytes"] = READING_REQUEST_BYTES
    data["default_endpoint"]["max_request_bytes"] = READING_REQUEST_BYTES
    data["server"]["http_body_timeout_s"] = ANSWER_TIMEOUT_S
    data["server"]["http_max_reading_bytes"] = parse_config(data).max_wire_bytes()
    return data


@pytest.fixture(scope="module")
def reading(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    with running_frontend(parse_config(reading_config()), triton, workers=workers) as running:
        yield running


def test_bodies_read_at_once_are_bounded_across_connections(
    reading: RunningFrontend, workers: int
) -> None:
    """Bodies of just over half the shell's reading bound, declared with ``Expect:
    100-continue``: each shell grants one (100 Continue: its bytes are now held), the
    next body in that shell is refused 503 from its headers, unread; by the pigeonhole,
    within workers + 1 of them. Once the held bodies are read, bodies are read again."""
    limit = parse_config(reading_config()).http_max_reading_bytes()
    body = embed_body(4, pad="x" * (limit // 2 + 1))
    assert len(body) > limit // 2
    headers = {**KEY, "Content-Length": str(len(body)), "Expect": "100-continue"}
    held: list[socket.socket] = []
    refusal: Answer | None = None
    try:
        for _ in range(workers + 1):
            sock = connect(reading.http_url)
            send_head(sock, door_path("embed", "infer"), headers)
            reader = sock.makefile("rb")
            status = reader.readline().split()[1]
            if status == b"100":
                assert reader.readline() == b"\r\n"
                held.append(sock)
                continue
            with sock:
                refusal = read_answer_after(status, reader)
            break
        assert refusal is not None, f"{workers + 1} bodies were all granted at once"
        assert refusal.status == 503, refusal
        assert "Exceeds maximum queue size" in refusal.error, refusal.error
        assert "server.http_max_reading_bytes" in refusal.error, refusal.error
        assert refusal.headers.get("connection") == "close"
        for sock in held:
            sock.sendall(body)
            answer = read_answer(sock)
            assert answer.status == 200, answer
    finally:
        for sock in held:
            sock.close()
    served = request(reading.http_url, door_path("embed", "infer"), body, KEY)
    assert served.status == 200, served


def read_answer_after(status: bytes, reader: Any) -> Answer:
    """The rest of an answer whose status line was read (``status``: its code)."""
    headers: dict[str, str] = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = reader.read(int(headers.get("content-length", "0")))
    return Answer(int(status), headers, body)


# ---- decoding off the event loop -----------------------------------------------------------


@pytest.fixture(scope="module")
def in_process(triton: EmbeddedTriton) -> Iterator[RunningFrontend]:
    """One process: its HTTP shell runs in this one, where a test can watch it decode."""
    with running_frontend(parse_config(door_config()), triton, workers=1) as running:
        yield running


@dataclass
class Gate:
    """Holds every decode of a body over ``size`` bytes until ``opened``."""

    size: int
    entered: threading.Event
    opened: threading.Event

    def wrap(self, decode: Callable[..., Any]) -> Callable[..., Any]:
        def held(
            model: str, version: str, body: bytes, header_length: int | None, **kw: Any
        ) -> Any:
            if len(body) > self.size:
                self.entered.set()
                self.opened.wait(ANSWER_TIMEOUT_S * 2)
            return decode(model, version, body, header_length, **kw)

        return held


def test_a_large_body_decodes_while_other_clients_are_served(
    in_process: RunningFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large JSON body is decoded off the event loop. The test holds its decode
    midway (a real decode of a large body holds it for as long as it parses); a small
    request sent meanwhile is answered all the same. Were the decode on the loop, the
    hold would stop the whole shell and the small request would get no answer."""
    gate = Gate(1 << 19, threading.Event(), threading.Event())
    monkeypatch.setattr(http_server, "decode_infer", gate.wrap(http_server.decode_infer))
    big = embed_body(4, pad="x" * (3 << 18))  # 768 KiB: within embed's limit
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(request, in_process.http_url, door_path("embed", "infer"), big, KEY)
        try:
            assert gate.entered.wait(ANSWER_TIMEOUT_S), "the large request was never decoded"
            simple_served(in_process.http_url)
            assert not pending.done()
        finally:
            gate.opened.set()
        answer = pending.result(ANSWER_TIMEOUT_S)
    assert answer.status == 200, answer


def test_binary_tensors_are_views_of_the_body() -> None:
    """Binary inputs are read in place (``np.frombuffer`` on the body): no copy of the
    payload, no Python object per element."""
    ids = np.arange(1000, dtype=np.int32)
    head = {
        "inputs": [
            {
                "name": "INPUT_IDS",
                "shape": [1, 1000],
                "datatype": "INT32",
                "parameters": {"binary_data_size": ids.nbytes},
            }
        ]
    }
    header = json.dumps(head).encode()
    body = header + ids.tobytes()
    req = decode_infer("embed", "", body, len(header))
    (tensor,) = req.inputs
    assert tensor.data.tolist() == [ids.tolist()]
    assert np.shares_memory(tensor.data, np.frombuffer(body, dtype=np.uint8))
