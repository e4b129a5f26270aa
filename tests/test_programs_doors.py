"""A request's program reaches its ``Call`` from every client surface (issue 33, item 1).

Without Triton: the KServe decoders (HTTP, gRPC, generate) keep the ``program``
parameter for the gateway, an OpenAI chat call's ``user`` becomes that parameter, and
the gateway takes it (or ``x-program-id``, which wins) out of the request, checks its
length and puts it on the ``Call`` it submits; the model never sees it. An older
shell's ``Call`` frame, without the field, still decodes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

import msgspec
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc._utils import _get_inference_request

from fair_frontend import grpc_codec
from fair_frontend.auth import KeyRing
from fair_frontend.backends.protocol import BackendServer
from fair_frontend.endpoint import plan
from fair_frontend.errors import FrontendError, InvalidArgument, Unavailable
from fair_frontend.models import ModelInfo, TensorSpec
from fair_frontend.protocol import (
    MAX_PROGRAM_BYTES,
    PROGRAM_HEADER,
    PROGRAM_PARAMETER,
    InferRequest,
    Tensor,
    take_program,
)
from fair_frontend.shell import http_codec
from fair_frontend.shell.api import openai
from fair_frontend.shell.gateway import Gateway
from fair_frontend.shell.generate_codec import decode_generate
from fair_frontend.shell.link import CoreLink, Inbox
from fair_frontend.wire.records import Call
from tests.support import KEYS, make_config

# ---- the decoders keep the parameter; take_program reads it ------------------------------


def _http(parameters: dict[str, Any]) -> InferRequest:
    inp = httpclient.InferInput("X", [1], "INT32")
    inp.set_data_from_numpy(np.zeros(1, np.int32), binary_data=False)
    body, size = httpclient.InferenceServerClient.generate_request_body(
        [inp], parameters=parameters
    )
    return http_codec.decode_infer("m", "", body, size)


def _grpc(parameters: dict[str, Any]) -> InferRequest:
    inp = grpcclient.InferInput("X", [1], "INT32")
    inp.set_data_from_numpy(np.zeros(1, np.int32))
    msg = _get_inference_request(
        model_name="m",
        inputs=[inp],
        model_version="",
        request_id="",
        outputs=None,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        parameters=parameters,
    )
    return grpc_codec.decode_infer(msg)


def _generate(parameters: dict[str, Any]) -> InferRequest:
    info = ModelInfo("llm", 0, {"text_input": TensorSpec("text_input", "BYTES", (1,))}, {})
    body = json.dumps({"text_input": "hi", "parameters": parameters}).encode()
    return decode_generate("llm", "", body, info)


@pytest.mark.parametrize("decode", [_http, _grpc, _generate], ids=["http", "grpc", "generate"])
def test_a_kserve_program_parameter_reaches_the_gateway(decode: Any) -> None:
    """Each KServe decoder leaves ``program`` among the request's parameters, beside the
    model's own, and ``take_program`` takes it out: the model never sees it."""
    req = decode({PROGRAM_PARAMETER: "agent-7", "custom": "x", "tenant": "acme"})
    assert req.parameters[PROGRAM_PARAMETER] == "agent-7"
    assert take_program(req, {}) == "agent-7"
    assert PROGRAM_PARAMETER not in req.parameters and req.parameters["custom"] == "x"


def test_the_header_names_the_program_first_and_the_parameter_still_leaves() -> None:
    req = InferRequest("m", parameters={PROGRAM_PARAMETER: "from-body"})
    assert take_program(req, {PROGRAM_HEADER: " run-1 "}) == "run-1"
    assert req.parameters == {}
    assert take_program(InferRequest("m"), {}) == ""


@pytest.mark.parametrize(
    ("parameters", "headers", "says"),
    [
        ({PROGRAM_PARAMETER: 7}, {}, "parameter 'program' must be a string"),
        (
            {PROGRAM_PARAMETER: "é" * MAX_PROGRAM_BYTES},
            {},
            f"parameter 'program' is too long: {2 * MAX_PROGRAM_BYTES} bytes",
        ),
        ({}, {PROGRAM_HEADER: "x" * (MAX_PROGRAM_BYTES + 1)}, "header 'x-program-id' is too long"),
    ],
)
def test_a_program_id_over_the_bound_is_refused_400(
    parameters: dict[str, Any], headers: Mapping[str, str], says: str
) -> None:
    """An id over ``MAX_PROGRAM_BYTES`` is refused, not cut (two ids differing past the
    cut would merge), and never echoed."""
    with pytest.raises(InvalidArgument) as err:
        take_program(InferRequest("m", parameters=dict(parameters)), headers)
    assert err.value.http_status == 400 and says in err.value.message
    assert "xxxx" not in err.value.message and "éé" not in err.value.message
    at_bound = InferRequest("m", parameters={PROGRAM_PARAMETER: "y" * MAX_PROGRAM_BYTES})
    assert len(take_program(at_bound, {})) == MAX_PROGRAM_BYTES


def test_an_openai_chat_calls_user_is_its_program() -> None:
    config = make_config()
    raw = json.dumps(
        {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "user": "session-42"}
    ).encode()
    gen = openai.decode_chat(raw, {}, config)
    info = ModelInfo(
        "llm",
        0,
        {"text_input": TensorSpec("text_input", "BYTES", (1,))},
        {"text_output": TensorSpec("text_output", "BYTES", (1,))},
        decoupled=True,
    )
    req = openai.engine_request(gen, plan(config, "llm", info))
    assert take_program(req, {}) == "session-42"
    assert PROGRAM_PARAMETER not in req.parameters
    anonymous = json.dumps({"model": "llm", "messages": [{"role": "user", "content": "hi"}]})
    req = openai.engine_request(
        openai.decode_chat(anonymous.encode(), {}, config), plan(config, "llm", info)
    )
    assert PROGRAM_PARAMETER not in req.parameters and take_program(req, {}) == ""


# ---- the gateway puts it on the Call ------------------------------------------------------

REPEAT = ModelInfo(
    name="rep",
    max_batch_size=0,
    inputs={"IN": TensorSpec("IN", "INT32", (-1,))},
    outputs={"OUT": TensorSpec("OUT", "INT32", (1,))},
    decoupled=True,
)


class Recording:
    """A ``CoreLink`` that keeps the call submitted and refuses it (no core here)."""

    accepting = True

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def new_id(self) -> int:
        return len(self.calls) + 1

    def submit(self, call: Call) -> Inbox:
        self.calls.append(call)
        raise Unavailable("no core in this test")

    async def model_info(self, model: str) -> ModelInfo:
        return REPEAT

    def queue_full(self, tenant: str, model: str, nbytes: int = 0) -> str | None:
        return None

    def overloaded(self, tier: str, model: str) -> Any:
        return None

    def tally(self, entry: Any) -> None:
        pass


async def submitted(parameters: dict[str, Any], headers: dict[str, str]) -> Call:
    config = make_config()
    link = Recording()
    gateway = Gateway(config, KeyRing.from_config(config), cast(CoreLink, link),
                      cast(BackendServer, object()))  # fmt: skip
    values = Tensor("IN", "INT32", (2,), np.array([1, 2], dtype=np.int32))
    request = InferRequest("rep", id="s1", inputs=[values], parameters=parameters)
    with pytest.raises(FrontendError):
        async for _ in gateway.stream_infer(request, {"x-api-key": KEYS["acme"], **headers}):
            pass
    (call,) = link.calls
    return call


@pytest.mark.parametrize(
    ("parameters", "headers", "program"),
    [
        ({}, {}, ""),
        ({PROGRAM_PARAMETER: "agent-1", "custom": 1}, {}, "agent-1"),
        ({"custom": 1}, {PROGRAM_HEADER: "chat-9"}, "chat-9"),
        ({PROGRAM_PARAMETER: "agent-1"}, {PROGRAM_HEADER: "chat-9"}, "chat-9"),
    ],
)
async def test_the_gateway_puts_the_program_on_the_call(
    parameters: dict[str, Any], headers: dict[str, str], program: str
) -> None:
    call = await submitted(parameters, headers)
    assert call.program == program and call.tenant == "acme"
    assert PROGRAM_PARAMETER not in call.request.parameters  # the model never sees it


def test_an_older_shells_call_frame_decodes_without_a_program() -> None:
    """``Call.program`` is among the last fields (before ``slo_class``), with a default: a
    frame from a shell that sends neither decodes, as no program."""
    call = Call(1, "acme", 1, 0.0, 0.0, 1, 1, 0, None, InferRequest("m"), program="p")
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(call))
    assert fields[-2] == "p"
    older = msgspec.msgpack.encode(fields[:-2])
    assert msgspec.msgpack.decode(older, type=Call).program == ""
