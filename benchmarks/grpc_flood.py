"""A client process for the gRPC door's memory test and benchmark
(``tests/adversarial/test_grpc_door.py``, ``bench_door.py``).

``python -m benchmarks.grpc_flood URL METHOD CALLS SIZE [KEY]``: CALLS concurrent
calls of METHOD on one channel, each carrying SIZE bytes (to ModelInfer a well-formed
``embed`` request with SIZE bytes of tensor data, as a user sends it; to any other method
SIZE bytes that no protobuf parser takes, so an answer other than a parse error proves the
message was never parsed), with ``authorization: Bearer KEY`` when KEY is given. Prints
one JSON line: ``{"answers": ["OK" or "CODE: details", ...]}``.

A process of its own, so that the messages it holds (CALLS x SIZE bytes) stay out of the
memory of the frontend the test measures.
"""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
from tritonclient.grpc import service_pb2

SERVICE = "/inference.GRPCInferenceService/"
TIMEOUT_S = 60.0


def message(method: str, size: int) -> bytes:
    if method != "ModelInfer":
        return b"\xff" * size  # field 31, wire type 7: no protobuf parser takes it
    msg = service_pb2.ModelInferRequest(model_name="embed")
    msg.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, size // 4])
    msg.raw_input_contents.append(bytes(size))
    return msg.SerializeToString()


async def flood(url: str, method: str, calls: int, size: int, key: str | None) -> list[str]:
    body = message(method, size)
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    async with grpc.aio.insecure_channel(url, options=options) as channel:
        call = channel.unary_unary(SERVICE + method, request_serializer=None)

        async def one() -> str:
            try:
                await call(body, metadata=metadata, timeout=TIMEOUT_S)
                return "OK"
            except grpc.aio.AioRpcError as err:
                return f"{err.code().name}: {err.details()}"

        return list(await asyncio.gather(*(one() for _ in range(calls))))


def main(argv: list[str]) -> None:
    url, method, calls, size = argv[0], argv[1], int(argv[2]), int(argv[3])
    key = argv[4] if len(argv) > 4 else None
    answers = asyncio.run(flood(url, method, calls, size, key))
    print(json.dumps({"answers": answers}))


if __name__ == "__main__":
    main(sys.argv[1:])
