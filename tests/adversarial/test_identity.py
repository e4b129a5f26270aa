"""Identity cannot be forged or made ambiguous (issue 11, item 9).

- ``auth.trusted_gateway`` trusted any client that named a tenant without a key. Now the
  request must prove it comes from the gateway: the shared secret (``x-gateway-secret``)
  and/or a peer address in ``trusted_gateway_peers``, the peer taken from the connection,
  never from ``X-Forwarded-For``. Enabling the gateway without either is a config error.
- A request that repeats an identity header (two ``authorization``, two ``x-api-key``,
  two ``x-tenant-id``, or ``authorization`` and ``x-api-key`` with different keys) was
  answered as whichever copy the parser kept last; now it is refused (401) and says why.
- Header bytes that are not UTF-8 in a key were a 500 (the key could not be hashed); now
  they are an unknown key (401).

Over the real stack: the session's Triton, the frontend over HTTP (aiohttp, which keeps
repeated headers) and gRPC (the generated stub, whose metadata may repeat a key). The
``embed`` model's ROW_META output says which tenant Triton was told.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
from multidict import CIMultiDict
from tritonclient.grpc import service_pb2, service_pb2_grpc

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import ConfigError, parse_config
from tests.support import KEYS, RunningFrontend, config_dict, make_config, running_frontend

SECRET = "gateway-test-secret"
Headers = Sequence[tuple[str, str]]


def grpc_request() -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name="embed")
    req.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, 4])
    req.raw_input_contents.append(np.arange(4, dtype=np.int32).tobytes())
    req.outputs.add(name="ROW_META")
    return req


HTTP_BODY = json.dumps(
    {
        "inputs": [
            {"name": "INPUT_IDS", "datatype": "INT32", "shape": [1, 4], "data": [0, 1, 2, 3]}
        ],
        "outputs": [{"name": "ROW_META", "parameters": {"binary_data": False}}],
    }
).encode()


async def grpc_infer(url: str, metadata: Headers) -> tuple[str, str]:
    """(status name, the tenant Triton saw or the error message) for one ModelInfer."""
    async with grpc.aio.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            reply = await stub.ModelInfer(grpc_request(), metadata=tuple(metadata))
        except grpc.aio.AioRpcError as err:
            return err.code().name, str(err.details())
    meta = json.loads(reply.raw_output_contents[0][4:])
    return "OK", str(meta["tenant"])


async def http_infer(url: str, headers: Headers) -> tuple[int, str]:
    """(HTTP status, the tenant Triton saw or the error message); ``headers`` may repeat
    a name: every copy is sent."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://{url}/v2/models/embed/infer", data=HTTP_BODY, headers=CIMultiDict(headers)
        ) as response,
    ):
        doc: dict[str, Any] = await response.json(content_type=None)
    if response.status != 200:
        return response.status, str(doc["error"])
    return 200, str(json.loads(doc["outputs"][0]["data"][0])["tenant"])


def bearer(tenant: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {KEYS[tenant]}")


# ---- config ---------------------------------------------------------------------------------


def test_a_trusted_gateway_without_proof_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(config_dict(auth={"trusted_gateway": True}))
    text = str(info.value)
    assert "trusted_gateway_secret" in text and "trusted_gateway_peers" in text


def test_gateway_proof_is_validated() -> None:
    auth = {
        "trusted_gateway": True,
        "trusted_gateway_peers": ["10.0.0.0/8", "gateway.internal"],
        "trusted_gateway_secret_env": "FAIR_TEST_UNSET_GATEWAY_SECRET",
    }
    with pytest.raises(ConfigError) as info:
        parse_config(config_dict(auth=auth))
    text = str(info.value)
    assert "'gateway.internal' is not an address or CIDR network" in text
    assert "FAIR_TEST_UNSET_GATEWAY_SECRET is not set" in text


# ---- the shared secret ------------------------------------------------------------------------


async def test_a_named_tenant_needs_the_gateway_secret(triton: EmbeddedTriton) -> None:
    config = make_config(auth={"trusted_gateway": True, "trusted_gateway_secret": SECRET})
    with running_frontend(config, triton) as fe:
        claim = ("x-tenant-id", "globex")
        for headers in ([claim], [claim, ("x-gateway-secret", "guessed")]):
            status, message = await http_infer(fe.http_url, headers)
            assert status == 401, message
            assert "does not come from" in message
            code, message = await grpc_infer(fe.grpc_url, headers)
            assert code == "UNAUTHENTICATED", message
        proven = [claim, ("x-gateway-secret", SECRET)]
        assert await http_infer(fe.http_url, proven) == (200, "globex")
        assert await grpc_infer(fe.grpc_url, proven) == ("OK", "globex")
        # Keys still work beside the gateway, and a key cannot be overruled by a claim.
        assert await http_infer(fe.http_url, [bearer("acme")]) == (200, "acme")
        status, _ = await http_infer(fe.http_url, [bearer("acme"), *proven])
        assert status == 403


# ---- the peer address -------------------------------------------------------------------------


async def test_a_named_tenant_needs_a_trusted_peer(triton: EmbeddedTriton, workers: int) -> None:
    """The peer is the connection's: an ``X-Forwarded-For`` naming a trusted address does
    not make a client on another address the gateway. Run with the shell in the core's
    process and in shell processes of their own (where the peer comes from the inherited
    listening socket)."""
    claim = ("x-tenant-id", "initech")
    forged = [claim, ("x-forwarded-for", "10.1.2.3"), ("x-real-ip", "10.1.2.3")]
    elsewhere = make_config(auth={"trusted_gateway": True, "trusted_gateway_peers": ["10.0.0.0/8"]})
    with running_frontend(elsewhere, triton, workers=workers) as fe:
        status, message = await http_infer(fe.http_url, forged)
        assert status == 401, message
        code, message = await grpc_infer(fe.grpc_url, forged)
        assert code == "UNAUTHENTICATED", message
    loopback = make_config(
        auth={"trusted_gateway": True, "trusted_gateway_peers": ["127.0.0.1/32", "::1"]}
    )
    with running_frontend(loopback, triton, workers=workers) as fe:
        assert await http_infer(fe.http_url, [claim]) == (200, "initech")
        assert await grpc_infer(fe.grpc_url, [claim]) == ("OK", "initech")


# ---- repeated identity headers ----------------------------------------------------------------

REPEATED: list[tuple[str, list[tuple[str, str]]]] = [
    ("two authorization", [bearer("globex"), bearer("acme")]),
    ("two x-api-key", [("x-api-key", KEYS["globex"]), ("x-api-key", KEYS["acme"])]),
    ("authorization and x-api-key", [("x-api-key", KEYS["globex"]), bearer("acme")]),
    ("two x-tenant-id", [bearer("acme"), ("x-tenant-id", "globex"), ("x-tenant-id", "acme")]),
]


@pytest.fixture(scope="module")
def plain(triton: EmbeddedTriton) -> Iterator[RunningFrontend]:
    """A frontend with keys only (no trusted gateway), shared by this module's cases."""
    with running_frontend(make_config(), triton) as fe:
        yield fe


@pytest.mark.parametrize(("case", "headers"), REPEATED, ids=[c for c, _ in REPEATED])
async def test_repeated_identity_headers_are_refused(
    plain: RunningFrontend, case: str, headers: list[tuple[str, str]]
) -> None:
    """Each case was answered as the copy the parser kept (the last): a request whose
    gateway checked the first key ran as the second's tenant."""
    status, message = await http_infer(plain.http_url, headers)
    assert status == 401, message
    assert "ambiguous identity" in message
    assert KEYS["acme"] not in message and KEYS["globex"] not in message
    code, message = await grpc_infer(plain.grpc_url, headers)
    assert code == "UNAUTHENTICATED", message
    assert "ambiguous identity" in message


async def test_the_same_key_in_both_headers_is_not_ambiguous(plain: RunningFrontend) -> None:
    same = [bearer("acme"), ("x-api-key", KEYS["acme"])]
    assert await http_infer(plain.http_url, same) == (200, "acme")
    assert await grpc_infer(plain.grpc_url, same) == ("OK", "acme")


# ---- bytes that are not UTF-8 -----------------------------------------------------------------


def test_a_key_that_is_not_utf8_is_an_unknown_key(plain: RunningFrontend) -> None:
    """aiohttp hands undecodable header bytes on as surrogates; hashing them raised."""
    host, port = plain.http_url.split(":")
    head = (
        b"POST /v2/models/embed/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"authorization: Bearer k\xff\xfe\r\n"
        b"content-length: " + str(len(HTTP_BODY)).encode() + b"\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + HTTP_BODY)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.split(b"\r\n", 1)[0] == b"HTTP/1.1 401 Unauthorized", reply[:200]


# ---- model access for a tenant the gateway names --------------------------------------------


async def test_a_tenant_the_gateway_names_gets_its_own_model_access(triton: EmbeddedTriton) -> None:
    """Named in the ``x-tenant-id`` header (checked from the headers) or in the body's
    ``tenant`` parameter (checked once the body is decoded): either way the tenant's own
    list applies, here the trial tier's, which opens ``embed`` only."""
    config = make_config(
        auth={"trusted_gateway": True, "trusted_gateway_secret": SECRET},
        tier_models={"enterprise": ["*"], "standard": ["*"], "trial": ["embed"]},
    )
    proof = {"x-gateway-secret": SECRET}
    body = json.loads(HTTP_BODY)
    async with aiohttp.ClientSession() as session:

        async def post(model: str, headers: dict[str, str], doc: Any) -> tuple[int, str]:
            url = f"http://{fe.http_url}/v2/models/{model}/infer"
            async with session.post(url, json=doc, headers=headers) as response:
                answer = await response.json(content_type=None)
                return response.status, str(answer.get("error", "served"))

        with running_frontend(config, triton) as fe:
            refused = (403, "tenant 'umbrella' may not use model 'generate'")
            header = {**proof, "x-tenant-id": "umbrella"}
            assert await post("generate", header, body) == refused
            in_body = {**body, "parameters": {"tenant": "umbrella"}}
            assert await post("generate", proof, in_body) == refused
            assert await post("embed", proof, in_body) == (200, "served")
            acme = await post("generate", {**proof, "x-tenant-id": "acme"}, body)
            assert acme[0] != 403, acme  # open to acme's tier (served or refused for its input)
