"""The frontend in front of a real Triton: same answers, identity, errors, metadata.

Every test talks to the frontend through the real clients (tritonclient HTTP and gRPC)
and compares with what the same request gets from Triton directly.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from fair_frontend.kit.testing import aeventually
from tests.support import KEYS, RunningFrontend, ids_input

RNG = np.random.default_rng(7)


def _direct(triton, protocol: str):
    if protocol == "grpc":
        return grpcclient.InferenceServerClient(triton.grpc_url)
    return httpclient.InferenceServerClient(triton.http_url.removeprefix("http://"))


def _front(frontend: RunningFrontend, protocol: str):
    if protocol == "grpc":
        return grpcclient.InferenceServerClient(frontend.grpc_url)
    return httpclient.InferenceServerClient(frontend.http_url)


CASES = [
    ("grpc", True),
    ("http", True),  # tritonclient's default: binary tensors
    ("http", False),  # JSON tensors
]


@pytest.mark.parametrize(("protocol", "binary"), CASES)
@pytest.mark.parametrize(("model", "output"), [("embed", "EMBEDDING"), ("generate", "OUTPUT_IDS")])
def test_same_answer_as_triton(triton, frontend, protocol, binary, model, output) -> None:
    mod = grpcclient if protocol == "grpc" else httpclient
    for length in (1, 7, 64):
        ids = RNG.integers(0, 4000, size=(1, length), dtype=np.int32)
        inputs = [ids_input(mod, ids, binary=binary)]
        outputs = None
        if protocol == "http":
            outputs = [httpclient.InferRequestedOutput(output, binary_data=binary)]
        direct = _direct(triton, protocol).infer(model, inputs, outputs=outputs)
        through = _front(frontend, protocol).infer(
            model, inputs, outputs=outputs, headers={"authorization": f"Bearer {KEYS['acme']}"}
        )
        assert through.as_numpy(output).dtype == direct.as_numpy(output).dtype
        assert np.array_equal(through.as_numpy(output), direct.as_numpy(output))
        if protocol == "grpc" and output == "OUTPUT_IDS":
            # No frontend-internal output (OUTPUT_LENGTHS) leaks into the answer.
            names = [o.name for o in through.get_response().outputs]
            assert names == [o.name for o in direct.get_response().outputs]


async def test_concurrent_requests_are_batched_and_answered_right(triton, frontend) -> None:
    """Ragged requests of two tenants share padded batches; each gets its own answer.

    Whether requests sent at once wait together depends on how fast Triton serves the
    first ones: on a loaded machine the client may send each after the last was served,
    and every batch holds one (seen on a fresh clone). So Triton is stopped (SIGSTOP)
    until the core holds all 24: in the batches it could send before Triton answers (as
    few as one, where all 24 came in one read: seen on a fresh clone beside another), or
    queued behind them. Either way they share batches, whatever the machine's speed."""
    lengths = [int(n) for n in RNG.integers(1, 96, size=24)]
    batches = [RNG.integers(0, 4000, size=(1, n), dtype=np.int32) for n in lengths]
    direct = grpcaio.InferenceServerClient(triton.grpc_url)
    front = grpcaio.InferenceServerClient(frontend.grpc_url)
    batches_before = await frontend.acall(frontend.batch_count("embed"))
    before = await frontend.acall(frontend.counters("embed"))
    try:
        expected = await asyncio.gather(
            *(direct.infer("embed", [ids_input(grpcaio, ids)]) for ids in batches)
        )
        tenants = ["acme", "initech"]
        os.kill(triton.pid, signal.SIGSTOP)
        try:
            sends = asyncio.gather(
                *(
                    front.infer(
                        "embed",
                        [ids_input(grpcaio, ids)],
                        headers={"x-api-key": KEYS[tenants[i % 2]]},
                    )
                    for i, ids in enumerate(batches)
                )
            )

            async def held() -> bool:
                now = await frontend.acall(frontend.counters("embed"))
                return bool(now.admitted - before.admitted == len(batches))

            await aeventually(held, 60, what="all 24 in the core")
        finally:
            os.kill(triton.pid, signal.SIGCONT)
        got = await sends
    finally:
        await direct.close()
        await front.close()
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_allclose(
            g.as_numpy("EMBEDDING"), e.as_numpy("EMBEDDING"), rtol=1e-4, atol=1e-5
        )
    batches_sent = await frontend.acall(frontend.batch_count("embed")) - batches_before
    assert batches_sent < len(batches), "concurrent requests should have shared batches"


async def test_rows_asking_different_max_tokens_share_batches(triton, frontend) -> None:
    """generate, ragged prompts, every request its own ``max_tokens`` (a request parameter),
    all at once: they share batches (the count travels per row in ``fair_rows``, not in
    the batch key), and each gets Triton's answer for it alone: its own count of tokens."""
    counts = list(range(1, 13))  # all different: one batch per count if they could not mix
    widths = [int(n) for n in RNG.integers(1, 40, size=len(counts))]
    prompts = [RNG.integers(0, 4000, size=(1, w), dtype=np.int32) for w in widths]
    direct = grpcaio.InferenceServerClient(triton.grpc_url)
    front = grpcaio.InferenceServerClient(frontend.grpc_url)
    batches_before = await frontend.acall(frontend.batch_count("generate"))
    try:
        expected = [
            await direct.infer("generate", [ids_input(grpcaio, p)], parameters={"max_tokens": n})
            for p, n in zip(prompts, counts, strict=True)
        ]
        got = await asyncio.gather(
            *(
                front.infer(
                    "generate",
                    [ids_input(grpcaio, p)],
                    parameters={"max_tokens": n},
                    headers={"x-api-key": KEYS["hooli"]},
                )
                for p, n in zip(prompts, counts, strict=True)
            )
        )
    finally:
        await direct.close()
        await front.close()
    for n, e, g in zip(counts, expected, got, strict=True):
        assert g.as_numpy("OUTPUT_IDS").shape == (1, n)
        assert np.array_equal(g.as_numpy("OUTPUT_IDS"), e.as_numpy("OUTPUT_IDS"))
        # The model's OUTPUT_LENGTHS (the frontend's cut-back) is not handed back.
        assert [o.name for o in g.get_response().outputs] == ["OUTPUT_IDS"]
    batches_sent = await frontend.acall(frontend.batch_count("generate")) - batches_before
    assert batches_sent < len(counts), "requests of different max_tokens should share batches"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("bad", [0, 257, "lots"])
def test_bad_max_tokens_is_refused_as_triton_refuses_it(triton, frontend, protocol, bad) -> None:
    """400 / INVALID_ARGUMENT with the model's own wording, before it is queued."""
    mod = grpcclient if protocol == "grpc" else httpclient
    ids = np.arange(4, dtype=np.int32).reshape(1, 4)
    batches_before = frontend.call(frontend.batch_count("generate"))
    errors = []
    for client, headers in (
        (_direct(triton, protocol), {}),
        (_front(frontend, protocol), {"x-api-key": KEYS["acme"]}),
    ):
        with pytest.raises(InferenceServerException) as info:
            client.infer(
                "generate", [ids_input(mod, ids)], parameters={"max_tokens": bad}, headers=headers
            )
        errors.append(info.value)
    direct, through = errors
    expected = "StatusCode.INVALID_ARGUMENT" if protocol == "grpc" else "400"
    assert direct.status() == through.status() == expected
    wording = f"parameter 'max_tokens' must be an integer between 1 and 256, got {bad!r}"
    assert wording in direct.message()
    assert wording in through.message()
    assert frontend.call(frontend.batch_count("generate")) == batches_before


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}])
def test_missing_or_unknown_key(frontend, protocol, headers) -> None:
    mod = grpcclient if protocol == "grpc" else httpclient
    ids = np.arange(4, dtype=np.int32).reshape(1, 4)
    with pytest.raises(InferenceServerException) as info:
        _front(frontend, protocol).infer("embed", [ids_input(mod, ids)], headers=dict(headers))
    expected = "StatusCode.UNAUTHENTICATED" if protocol == "grpc" else "401"
    assert info.value.status() == expected
    assert "wrong" not in info.value.message()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_unknown_model(frontend, protocol) -> None:
    mod = grpcclient if protocol == "grpc" else httpclient
    ids = np.arange(4, dtype=np.int32).reshape(1, 4)
    with pytest.raises(InferenceServerException) as info:
        _front(frontend, protocol).infer(
            "no_such_model", [ids_input(mod, ids)], headers={"x-api-key": KEYS["acme"]}
        )
    expected = "StatusCode.INVALID_ARGUMENT" if protocol == "grpc" else "400"
    assert info.value.status() == expected
    assert info.value.message() == "Request for unknown model: 'no_such_model' is not found"


def _x(mod, values: list[int]):
    arr = np.array([values], dtype=np.int32)
    inp = mod.InferInput("X", list(arr.shape), "INT32")
    inp.set_data_from_numpy(arr)
    return inp


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_model_error_reaches_client_and_frontend_keeps_serving(triton, frontend, protocol) -> None:
    mod = grpcclient if protocol == "grpc" else httpclient
    headers = {"x-api-key": KEYS["acme"]}
    with pytest.raises(InferenceServerException) as direct:
        _direct(triton, protocol).infer("raiser", [_x(mod, [1, 13])])
    with pytest.raises(InferenceServerException) as through:
        _front(frontend, protocol).infer("raiser", [_x(mod, [1, 13])], headers=headers)
    assert through.value.status() == direct.value.status()
    assert "refusing the value 13" in through.value.message()
    ok = _front(frontend, protocol).infer("raiser", [_x(mod, [1, 2])], headers=headers)
    assert ok.as_numpy("Y").tolist() == [[1, 2]]


async def test_a_failing_row_does_not_fail_its_batch_neighbours(frontend) -> None:
    client = grpcaio.InferenceServerClient(frontend.grpc_url)
    values = [[i, i + 1] for i in range(20)]
    values[5] = [13, 13]
    try:
        results = await asyncio.gather(
            *(
                client.infer("raiser", [_x(grpcaio, v)], headers={"x-api-key": KEYS["initech"]})
                for v in values
            ),
            return_exceptions=True,
        )
    finally:
        await client.close()
    for v, r in zip(values, results, strict=True):
        if 13 in v:
            assert isinstance(r, InferenceServerException)
        else:
            # tritonclient's exception shows its message and status only when asked.
            assert not isinstance(r, BaseException), (str(r), getattr(r, "status", lambda: "")())
            assert r.as_numpy("Y").tolist() == [v]


def test_tenant_priority_and_deadline_reach_the_model(frontend) -> None:
    ids = np.arange(5, dtype=np.int32).reshape(1, 5)
    client = grpcclient.InferenceServerClient(frontend.grpc_url)
    result = client.infer(
        "embed",
        [ids_input(grpcclient, ids)],
        outputs=[grpcclient.InferRequestedOutput("ROW_META")],
        headers={"x-api-key": KEYS["globex"]},
        priority=2,
        timeout=30_000_000,
        request_id="meta-1",
    )
    meta = json.loads(result.as_numpy("ROW_META")[0][0])
    assert meta["tenant"] == "globex"
    assert meta["priority"] == 2
    assert meta["id"] == "meta-1"
    assert meta["deadline_us"] > 0
    assert [o.name for o in result.get_response().outputs] == ["ROW_META"]


def test_health_and_metadata(triton, frontend) -> None:
    key = {"x-api-key": KEYS["acme"]}  # model doors are keyed; health and server metadata open
    for client in (_front(frontend, "grpc"), _front(frontend, "http")):
        assert client.is_server_live()
        assert client.is_server_ready()
        assert client.is_model_ready("embed", headers=key)
        assert not client.is_model_ready("no_such_model", headers=key)
    direct = _direct(triton, "http").get_model_config("generate")
    through = _front(frontend, "http").get_model_config("generate", headers=key)
    assert through == direct
    direct_md = _direct(triton, "grpc").get_model_metadata("embed")
    through_md = _front(frontend, "grpc").get_model_metadata("embed", headers=key)
    assert through_md == direct_md
    assert _front(frontend, "http").get_model_metadata("embed", headers=key) == _direct(
        triton, "http"
    ).get_model_metadata("embed")
    meta = _front(frontend, "http").get_server_metadata()
    assert "binary_tensor_data" in meta["extensions"]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_key_cannot_pose_as_another_tenant(frontend, protocol) -> None:
    mod = grpcclient if protocol == "grpc" else httpclient
    ids = np.arange(4, dtype=np.int32).reshape(1, 4)
    client = _front(frontend, protocol)
    denied = "StatusCode.PERMISSION_DENIED" if protocol == "grpc" else "403"
    for kwargs in (
        {"headers": {"x-api-key": KEYS["umbrella"]}, "parameters": {"tenant": "acme"}},
        {"headers": {"x-api-key": KEYS["umbrella"], "x-tenant-id": "acme"}},
    ):
        with pytest.raises(InferenceServerException) as info:
            client.infer("embed", [ids_input(mod, ids)], **kwargs)
        assert info.value.status() == denied
        assert KEYS["umbrella"] not in info.value.message()
    # Naming itself is fine; naming a tenant without a key is not trusted by default.
    ok = client.infer(
        "embed",
        [ids_input(mod, ids)],
        headers={"x-api-key": KEYS["umbrella"]},
        parameters={"tenant": "umbrella"},
    )
    assert ok.as_numpy("EMBEDDING").shape == (1, 128)
    with pytest.raises(InferenceServerException) as info:
        client.infer("embed", [ids_input(mod, ids)], headers={"x-tenant-id": "acme"})
    assert info.value.status() == ("StatusCode.UNAUTHENTICATED" if protocol == "grpc" else "401")


def test_trusted_gateway_names_the_tenant(triton, workers: int) -> None:
    from tests.support import make_config, running_frontend

    config = make_config(auth={"trusted_gateway": True, "trusted_gateway_peers": ["127.0.0.1"]})
    ids = np.arange(4, dtype=np.int32).reshape(1, 4)
    with running_frontend(config, triton, workers=workers) as fe:
        client = grpcclient.InferenceServerClient(fe.grpc_url)
        result = client.infer(
            "embed",
            [ids_input(grpcclient, ids)],
            outputs=[grpcclient.InferRequestedOutput("ROW_META")],
            headers={"x-tenant-id": "globex"},
        )
        assert json.loads(result.as_numpy("ROW_META")[0][0])["tenant"] == "globex"
        with pytest.raises(InferenceServerException) as info:
            client.infer("embed", [ids_input(grpcclient, ids)], headers={"x-tenant-id": "nobody"})
        assert info.value.status() == "StatusCode.UNAUTHENTICATED"
