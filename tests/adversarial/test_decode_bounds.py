"""No request costs more than it may use: decoding, prompts, and the bound of each model.

Issue 17, item 3 (and item 7's surrogates), against the real stack in both worker modes:

- two concurrent JSON bodies of the largest size a keyed tenant may send grow the
  frontend's memory (core and shells, their peak RSS from /proc) by a small multiple of
  the bytes, not the ten times a Python object per element cost (1.8 GiB for 2 x 92 MiB);
- a 48 MiB prompt to ``llm``'s generate is refused 400 at once (from its size where the
  model's bound applies, from its bytes where the operator allows such bodies: never
  tokenised), and another tenant's ``embed`` request sent meanwhile is served;
- the bound is the model's own (``models.RequestBounds``): a request over what the model
  can accept is refused from its Content-Length or gRPC message size, before it is read
  or parsed;
- a lone surrogate, or text that is not UTF-8 where text is required, is 400 /
  INVALID_ARGUMENT naming the field, never 500.

Raw sockets for HTTP (a body larger than the server lets in, sent while it answers), the
generated gRPC stub for gRPC.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import parse_config
from fair_frontend.server import ShellPool
from tests.support import (
    ANSWER_TIMEOUT_S,
    KEYS,
    Answer,
    RunningFrontend,
    config_dict,
    connect,
    embed_body,
    read_answer,
    request,
    running_frontend,
    send_head,
)

HOG = {"authorization": f"Bearer {KEYS['acme']}"}
OTHER = {"authorization": f"Bearer {KEYS['globex']}"}
GRPC_KEY = (("authorization", f"Bearer {KEYS['acme']}"),)
MIB = 1 << 20
EMBED_REQUEST_BYTES = 16 * MIB  # embed's max_request_bytes here: ~33 MiB bodies
PROMPT_BYTES = 48 * MIB
# A body the client sends whole even if the server answers first; the answer comes within
# this long (it is refused without being decoded or tokenised, or at the worst decoded).
BIG_ANSWER_TIMEOUT_S = 60.0


def bounds_config(llm_request_bytes: int | None = None) -> dict[str, Any]:
    data = config_dict()
    data["endpoints"]["embed"]["max_request_bytes"] = EMBED_REQUEST_BYTES
    if llm_request_bytes is not None:
        data["endpoints"]["llm"]["max_request_bytes"] = llm_request_bytes
    return data


@pytest.fixture(scope="module")
def fe(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    """The example config: llm's bound is its own (its context, its tokenizer)."""
    with running_frontend(parse_config(bounds_config()), triton, workers=workers) as running:
        yield running


@pytest.fixture(scope="module")
def open_llm(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    """An operator who lets llm's bodies be 64 MiB of tensors (129 MiB on the wire)."""
    config = parse_config(bounds_config(llm_request_bytes=64 * MIB))
    with running_frontend(config, triton, workers=workers) as running:
        yield running


# ---- the frontend's memory -------------------------------------------------------------------


def frontend_pids(fe: RunningFrontend) -> list[int]:
    """The core's process (this one) and the shell processes, if any."""
    shells = fe.server.shells
    assert shells is None or isinstance(shells, ShellPool)  # none, or this process's
    pids = [] if shells is None else [p.pid for p in shells.processes.values()]
    return [os.getpid(), *pids]


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def reset_peaks(pids: list[int]) -> dict[int, int]:
    """Each process's peak RSS reset to its RSS now (``clear_refs`` 5); returns the RSS."""
    for pid in pids:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    return {pid: status_kib(pid, "VmRSS") for pid in pids}


def peak_growth_bytes(before: dict[int, int]) -> int:
    return sum(status_kib(pid, "VmHWM") - rss for pid, rss in before.items()) * 1024


def json_ids_body(size: int) -> bytes:
    """An embed request of about ``size`` bytes: "0," per token, as many tokens as fit."""
    head = b'{"inputs": [{"name": "INPUT_IDS", "datatype": "INT32", "shape": [1, %d], "data": ['
    count = (size - len(head) - 40) // 2
    return head % count + b",".join([b"0"] * count) + b"]}]}"


def send_whole(url: str, path: str, body: bytes, headers: dict[str, str]) -> Answer:
    """Headers, then the whole body (a refusal may come first and the server close the
    connection: the answer is read all the same)."""
    with connect(url) as sock:
        sock.settimeout(BIG_ANSWER_TIMEOUT_S)
        send_head(sock, path, {**headers, "Content-Length": str(len(body))})
        # Answered and closed before the end: the answer is in the buffer all the same.
        with contextlib.suppress(OSError):
            sock.sendall(body)
        return read_answer(sock)


def test_two_largest_json_bodies_cost_a_small_multiple_of_their_bytes(
    fe: RunningFrontend,
) -> None:
    """Two concurrent JSON bodies at embed's bound (33 MiB each: a 16M-token tensor of
    64 MiB, over its 16 MiB limit), from a keyed tenant: both refused 400, and the
    frontend's peak memory grows by less than 4 x the bytes sent (the body, its chunks
    as read, the scanner's windows). Before, each element was a Python object: about 10 x
    (1.8 GiB for 2 x 92 MiB)."""
    limit = parse_config(bounds_config()).endpoint("embed").max_wire_bytes
    body = json_ids_body(limit - 1024)
    pids = frontend_pids(fe)
    before = reset_peaks(pids)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(
            pool.map(
                lambda _: send_whole(fe.http_url, "/v2/models/embed/infer", body, HOG), range(2)
            )
        )
    growth = peak_growth_bytes(before)
    for answer in answers:
        assert answer.status == 400, answer
        assert "request too large" in answer.error and "embed" in answer.error
    sent = 2 * len(body)
    assert growth < 4 * sent, f"peak RSS grew {growth / MIB:.0f} MiB for {sent / MIB:.0f} MiB"
    assert request(fe.http_url, "/v2/models/embed/infer", embed_body(8), OTHER).status == 200


# ---- a prompt far over the context -----------------------------------------------------------


def huge_prompt_and_another_tenant(fe: RunningFrontend) -> str:
    """A 48 MiB prompt to llm's generate, and another tenant's embed request sent once the
    prompt is on its way: the embed request is served, the prompt refused 400 (its
    message returned)."""
    body = json.dumps({"text_input": "a" * PROMPT_BYTES}).encode()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(send_whole, fe.http_url, "/v2/models/llm/generate", body, HOG)
        other = request(fe.http_url, "/v2/models/embed/infer", embed_body(8), OTHER)
        answer = big.result(BIG_ANSWER_TIMEOUT_S)
    assert other.status == 200, other
    assert answer.status == 400, answer
    return str(json.loads(answer.body)["error"])


def test_a_huge_prompt_over_the_models_bound_is_refused_from_its_size(
    fe: RunningFrontend,
) -> None:
    """llm's bound is its own (two texts of at most 512 tokens of 32 bytes): the prompt is
    refused from its Content-Length, never read. Before, it was read (the bound was
    129 MiB for every model) and tokenised on the shell's event loop: no answer within a
    minute, and other tenants' requests waited up to 51 s."""
    said = huge_prompt_and_another_tenant(fe)
    assert "request too large" in said and "llm" in said, said


def test_a_huge_prompt_the_operator_lets_in_is_refused_from_its_bytes(
    open_llm: RunningFrontend,
) -> None:
    """With llm's bodies allowed to 129 MiB, the prompt is read and decoded, then refused
    without being tokenised: its bytes are at least 1.5M tokens of the tokenizer's
    longest, against a 512-token context."""
    said = huge_prompt_and_another_tenant(open_llm)
    assert "text_input" in said and "at least" in said and "max_model_len" in said, said


# ---- the model's own bound, before the bytes ---------------------------------------------------


def test_http_body_over_the_models_bound_is_refused_unread(fe: RunningFrontend) -> None:
    """``simple`` takes at most 8 x 2 x 16 INT32 (its bound on the wire: about 1 MiB of
    framing and 5 KiB of JSON numbers): a declared 2 MiB is refused from the headers, the
    body never sent. Before, every model was held to 129 MiB: the server waited for it."""
    with connect(fe.http_url) as sock:
        send_head(sock, "/v2/models/simple/infer", {**HOG, "Content-Length": str(2 * MIB)})
        answer = read_answer(sock)
    assert answer.status == 400, answer
    assert "request too large" in answer.error and "'simple'" in answer.error


def test_grpc_message_over_the_models_bound_is_refused_before_parsing(
    fe: RunningFrontend,
) -> None:
    """A 2 MiB ModelInfer to ``simple``: INVALID_ARGUMENT from its size (the shell knows
    the model once it served it once, on this channel)."""
    channel = grpc.insecure_channel(fe.grpc_url)
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(simple_request(1), metadata=GRPC_KEY, timeout=ANSWER_TIMEOUT_S)
        big = simple_request(1)
        big.raw_input_contents[0] = bytes(2 * MIB)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(big, metadata=GRPC_KEY, timeout=ANSWER_TIMEOUT_S)
    finally:
        channel.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the message is" in (err.value.details() or ""), err.value.details()


def simple_request(rows: int) -> service_pb2.ModelInferRequest:
    msg = service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        msg.inputs.add(name=name, datatype="INT32", shape=[rows, 16])
        msg.raw_input_contents.append(np.ones((rows, 16), dtype=np.int32).tobytes())
    return msg


# ---- text that is not Unicode ------------------------------------------------------------------


def test_a_lone_surrogate_in_json_bytes_data_is_400(fe: RunningFrontend) -> None:
    body = b'{"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 2], '
    body += b'"data": [["ok", "\\ud800"]]}]}'
    answer = request(fe.http_url, "/v2/models/simple_identity/infer", body, HOG)
    assert answer.status == 400, answer
    assert "input 'INPUT0'" in answer.error and "surrogate" in answer.error


def test_a_lone_surrogate_in_a_generate_prompt_is_400(fe: RunningFrontend) -> None:
    body = b'{"text_input": "hi \\udc00", "max_tokens": 2}'
    answer = request(fe.http_url, "/v2/models/llm/generate", body, HOG)
    assert answer.status == 400, answer
    assert "text_input" in answer.error and "surrogate" in answer.error


def test_text_that_is_not_utf8_over_grpc_is_invalid_argument(fe: RunningFrontend) -> None:
    """gRPC: a prompt of surrogate (and stray) bytes to llm's stream is refused by the
    frontend naming the input; a string field holding them does not parse at all."""
    msg = service_pb2.ModelInferRequest(model_name="llm")
    msg.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    prompt = "\ud800".encode("utf-8", "surrogatepass") + b"\xff"
    msg.raw_input_contents.append(struct.pack("<I", len(prompt)) + prompt)
    channel = grpc.insecure_channel(fe.grpc_url)
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        replies = list(stub.ModelStreamInfer(iter([msg]), metadata=GRPC_KEY, timeout=30))
        # A string parameter whose bytes are a surrogate's: written by hand (protobuf's
        # Python writer refuses to), field 4 (parameters) {key "p" value {string_param}}.
        raw = simple_request(1).SerializeToString() + _string_parameter(b"p", b"\xed\xa0\x80")
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda b: b,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as err:
            call(raw, metadata=GRPC_KEY, timeout=30)
    finally:
        channel.close()
    assert len(replies) == 1 and "text_input" in replies[0].error_message, replies
    assert "is not valid UTF-8 text" in replies[0].error_message  # the frontend's words
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value


def _string_parameter(key: bytes, value: bytes) -> bytes:
    def field(number: int, payload: bytes) -> bytes:
        return bytes([(number << 3) | 2]) + _varint(len(payload)) + payload

    entry = field(1, key) + field(2, field(3, value))  # InferParameter.string_param = 3
    return field(4, entry)  # ModelInferRequest.parameters = 4


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)
