"""The floor of a Python gRPC frontend: a KServe v2 server that answers and does nothing.

grpc.aio on uvloop with tritonclient's generated servicer, as the frontend's shells use
it; ModelInfer answers every request with a fixed ``EMBEDDING`` of the ``embed`` model's
shape, without decoding it. perf_analyzer measured against it gives the CPU one call
costs in grpc.aio itself on this machine: what no shell can go below.

    .venv/bin/python -m benchmarks.echo_server PORT   (serves until killed)
"""

from __future__ import annotations

import sys
from typing import Any

import grpc
import uvloop
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

WIDTH = 128  # embed's EMBEDDING dims


def _config() -> Any:
    cfg = model_config_pb2.ModelConfig(name="embed", max_batch_size=32)
    cfg.input.add(name="INPUT_IDS", data_type=model_config_pb2.TYPE_INT32, dims=[-1])
    cfg.output.add(name="EMBEDDING", data_type=model_config_pb2.TYPE_FP32, dims=[WIDTH])
    return cfg


class Echo(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self) -> None:
        self.config = _config()
        self.output = bytes(4 * WIDTH)

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=True)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerMetadataResponse(name="echo", version="0")

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        meta = service_pb2.ModelMetadataResponse(name="embed", versions=["1"], platform="python")
        meta.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[-1, -1])
        meta.outputs.add(name="EMBEDDING", datatype="FP32", shape=[-1, WIDTH])
        return meta

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        return service_pb2.ModelConfigResponse(config=self.config)

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        rows = request.inputs[0].shape[0] if request.inputs else 1
        reply = service_pb2.ModelInferResponse(model_name="embed", model_version="1")
        reply.outputs.add(name="EMBEDDING", datatype="FP32", shape=[rows, WIDTH])
        reply.raw_output_contents.append(self.output * rows)
        return reply


async def serve(port: int) -> None:
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Echo(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1])))
