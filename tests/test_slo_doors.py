"""A request's SLO class reaches its ``Call`` (issue 33, item 2): the gateway takes the
``slo_class`` parameter (or ``x-slo-class``, which wins) out of the request, refuses a
name the config does not know with 400 before anything is queued, and puts the class
on the ``Call`` it submits; the model never sees it. An older shell's ``Call`` frame,
without the field, still decodes.
"""

from __future__ import annotations

from typing import Any, cast

import msgspec
import numpy as np
import pytest

from fair_frontend.auth import KeyRing
from fair_frontend.backends.protocol import BackendServer
from fair_frontend.errors import FrontendError, InvalidArgument, Unavailable
from fair_frontend.protocol import SLO_CLASS_HEADER, SLO_CLASS_PARAMETER, InferRequest, Tensor
from fair_frontend.shell.gateway import Gateway
from fair_frontend.shell.link import CoreLink
from fair_frontend.wire.records import Call
from tests.support import KEYS, make_config
from tests.test_programs_doors import Recording

CLASSES = {
    "chat": {"kind": "interactive", "ttft_ms": 500, "itl_ms": 50},
    "bulk": {"kind": "batch", "deadline_s": 600},
}


async def submitted(parameters: dict[str, Any], headers: dict[str, str]) -> list[Call]:
    """The calls the gateway submitted for one streamed request; raises what it refused
    the request with, where it never submitted it."""
    config = make_config(slo_classes=CLASSES)
    link = Recording()
    gateway = Gateway(config, KeyRing.from_config(config), cast(CoreLink, link),
                      cast(BackendServer, object()))  # fmt: skip
    values = Tensor("IN", "INT32", (2,), np.array([1, 2], dtype=np.int32))
    request = InferRequest("rep", id="s1", inputs=[values], parameters=parameters)
    try:
        async for _ in gateway.stream_infer(request, {"x-api-key": KEYS["acme"], **headers}):
            pass
    except Unavailable:
        pass  # the recording link's refusal: the call was submitted
    return link.calls


@pytest.mark.parametrize(
    ("parameters", "headers", "slo"),
    [
        ({}, {}, ""),
        ({SLO_CLASS_PARAMETER: "bulk", "custom": 1}, {}, "bulk"),
        ({"custom": 1}, {SLO_CLASS_HEADER: "chat"}, "chat"),
        ({SLO_CLASS_PARAMETER: "bulk"}, {SLO_CLASS_HEADER: " chat "}, "chat"),
    ],
)
async def test_the_gateway_puts_the_class_on_the_call(
    parameters: dict[str, Any], headers: dict[str, str], slo: str
) -> None:
    (call,) = await submitted(parameters, headers)
    assert call.slo_class == slo and call.tenant == "acme"
    assert SLO_CLASS_PARAMETER not in call.request.parameters  # the model never sees it


@pytest.mark.parametrize(
    ("parameters", "headers", "says"),
    [
        ({SLO_CLASS_PARAMETER: "gold"}, {}, "parameter 'slo_class': unknown SLO class 'gold'"),
        ({}, {SLO_CLASS_HEADER: "gold"}, "header 'x-slo-class': unknown SLO class 'gold'"),
        ({SLO_CLASS_PARAMETER: 3}, {}, "parameter 'slo_class' must be a string"),
    ],
)
async def test_an_unknown_class_is_refused_400_before_it_is_submitted(
    parameters: dict[str, Any], headers: dict[str, str], says: str
) -> None:
    with pytest.raises(FrontendError) as err:
        await submitted(parameters, headers)
    assert isinstance(err.value, InvalidArgument) and err.value.http_status == 400
    assert says in err.value.message
    if "unknown" in says:
        assert "the classes are bulk, chat" in err.value.message


def test_an_older_shells_call_frame_decodes_without_a_class() -> None:
    call = Call(1, "acme", 1, 0.0, 0.0, 1, 1, 0, None, InferRequest("m"), slo_class="bulk")
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(call))
    assert fields[-1] == "bulk"
    older = msgspec.msgpack.encode(fields[:-1])
    assert msgspec.msgpack.decode(older, type=Call).slo_class == ""
