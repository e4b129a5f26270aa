"""Models that keep Triton's own semantics: decoupled (streaming) and sequence-batched.

Each is driven side by side, straight to Triton and through the frontend, with the same
tritonclient calls; the answers must be the same.
"""

from __future__ import annotations

import queue
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.support import KEYS, ids_input

HEADERS = {"x-api-key": KEYS["acme"]}


def _stream(url: str, requests: list[dict[str, Any]], headers: Any = None) -> list[Any]:
    """Send requests on one stream; collect (request id, result or error) until each is
    finished (the empty final response marks it)."""
    got: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: got.put((result, error)), headers=headers)
    try:
        open_ids = {r["request_id"] for r in requests}
        for r in requests:
            try:
                client.async_stream_infer(enable_empty_final_response=True, **r)
            except InferenceServerException:
                # The server ended the stream (e.g. refused its key) before this request
                # was written: the reason arrives through the callback.
                open_ids = {"stream"}
                break
        out = []
        while open_ids:
            result, error = got.get(timeout=60)
            if error is not None:
                out.append(("error", str(error)))
                open_ids.pop()
                continue
            resp = result.get_response()
            rid = resp.id
            final = resp.parameters["triton_final_response"].bool_param
            if resp.outputs:
                out.append((rid, result.as_numpy(resp.outputs[0].name).tolist()))
            if final:
                open_ids.discard(rid)
        return out
    finally:
        client.stop_stream()
        client.close()


def _repeat(values: list[int], rid: str) -> dict[str, Any]:
    arr = np.array(values, dtype=np.int32)
    inp = grpcclient.InferInput("IN", list(arr.shape), "INT32")
    inp.set_data_from_numpy(arr)
    return {"model_name": "repeat_decoupled", "inputs": [inp], "request_id": rid}


def test_decoupled_model_streams_the_same_responses(triton, frontend) -> None:
    requests = [_repeat([1, 2, 3], "a"), _repeat([], "b"), _repeat([7, 8], "c")]
    direct = _stream(triton.grpc_url, requests)
    through = _stream(frontend.grpc_url, requests, headers=HEADERS)
    for rid in "abc":
        assert [v for r, v in through if r == rid] == [v for r, v in direct if r == rid]
    assert [v for r, v in through if r == "a"] == [[1], [2], [3]]


def test_decoupled_model_refuses_model_infer_like_triton(triton, frontend) -> None:
    req = _repeat([1], "x")
    with pytest.raises(InferenceServerException) as direct:
        grpcclient.InferenceServerClient(triton.grpc_url).infer(req["model_name"], req["inputs"])
    with pytest.raises(InferenceServerException) as through:
        grpcclient.InferenceServerClient(frontend.grpc_url).infer(
            req["model_name"], req["inputs"], headers=HEADERS
        )
    assert "decoupled" in through.value.message()
    assert through.value.status() == direct.value.status()


def test_streaming_a_batching_model_is_scheduled_and_answered(triton, frontend) -> None:
    ids = np.arange(12, dtype=np.int32).reshape(1, 12)
    requests = [
        {"model_name": "embed", "inputs": [ids_input(grpcclient, ids)], "request_id": str(i)}
        for i in range(5)
    ]
    direct = dict(_stream(triton.grpc_url, requests))
    through = dict(_stream(frontend.grpc_url, requests, headers=HEADERS))
    assert set(through) == {"0", "1", "2", "3", "4"}
    for rid, value in through.items():
        np.testing.assert_allclose(value, direct[rid], rtol=1e-5, atol=1e-6)


def test_stream_errors_answer_in_stream_and_need_a_key(frontend) -> None:
    no_key = _stream(frontend.grpc_url, [_repeat([1], "k")])
    assert no_key and no_key[0][0] == "error" and "API key" in no_key[0][1]
    bad = _stream(
        frontend.grpc_url,
        [{"model_name": "no_such_model", "inputs": _repeat([1], "m")["inputs"], "request_id": "m"}],
        headers=HEADERS,
    )
    assert bad[0][0] == "error" and "unknown model" in bad[0][1]


def _seq_call(url: str, sequence_id: int, value: int, start: bool, end: bool, headers: Any) -> int:
    arr = np.array([value], dtype=np.int32)
    inp = grpcclient.InferInput("INPUT", [1], "INT32")
    inp.set_data_from_numpy(arr)
    result = grpcclient.InferenceServerClient(url).infer(
        "sequence_sum",
        [inp],
        sequence_id=sequence_id,
        sequence_start=start,
        sequence_end=end,
        headers=headers,
    )
    return int(result.as_numpy("OUTPUT")[0])


def test_sequence_model_keeps_its_state_through_the_frontend(triton, frontend) -> None:
    values = [5, 7, -2, 10]

    def run(url: str, seq: int, headers: Any) -> list[int]:
        return [
            _seq_call(url, seq, v, i == 0, i == len(values) - 1, headers)
            for i, v in enumerate(values)
        ]

    direct = run(triton.grpc_url, 4101, None)
    through = run(frontend.grpc_url, 4102, HEADERS)
    assert direct == [5, 12, 10, 20]
    assert through == direct
