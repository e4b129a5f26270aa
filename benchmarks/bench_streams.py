"""Can HTTP/2's own limit on streams per connection bound a gRPC client's burst?

If a server advertises ``SETTINGS_MAX_CONCURRENT_STREAMS`` (grpc's
``grpc.max_concurrent_streams``), a client with more calls than that on one connection
should hold the excess until streams free up: the burst would wait in its own client, not
in the shell's queue ahead of other tenants. Measured here with the clients users have:
tritonclient's asyncio gRPC client (grpc-core underneath, as perf_analyzer's C++ client),
a burst of calls on one channel (``--times`` the limit), against a grpc.aio server whose
handler takes 10 ms, with the limit set to 64 and to 1,024, after a warm call (the server's
SETTINGS already read).

    .venv/bin/python -m benchmarks.bench_streams [--times 5]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
from collections import Counter
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcaio
import uvloop
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from benchmarks.echo_server import Echo
from benchmarks.harness import progress, write_result
from fair_frontend.backends.triton.embedded import free_port


class Slow(Echo):
    async def ModelInfer(self, request: Any, context: Any) -> Any:
        await asyncio.sleep(0.01)
        return await super().ModelInfer(request, context)


def serve(port: int, limit: int) -> None:
    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_concurrent_streams", limit)])
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Slow(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main())


async def burst(port: int, calls: int) -> Counter[str]:
    client = grpcaio.InferenceServerClient(f"127.0.0.1:{port}")
    ids = np.zeros((1, 128), dtype=np.int32)
    inp = grpcaio.InferInput("INPUT_IDS", [1, 128], "INT32")
    inp.set_data_from_numpy(ids)

    async def one() -> str:
        try:
            await client.infer("embed", [inp])
            return "ok"
        except InferenceServerException as err:
            return f"{err.status()}: {err.message()[:90]}"

    try:
        for _ in range(200):
            try:
                await client.is_server_ready()
                break
            except InferenceServerException:
                await asyncio.sleep(0.05)
        return Counter(await asyncio.gather(*(one() for _ in range(calls))))
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--times", type=int, default=5, help="burst / the limit")
    args = parser.parse_args()
    out: dict[str, Any] = {"times": args.times, "limits": {}}
    for limit in (64, 1024):
        calls = args.times * limit
        port = free_port()
        server = multiprocessing.get_context("spawn").Process(target=serve, args=(port, limit))
        server.start()
        try:
            counts = uvloop.run(burst(port, calls))
        finally:
            server.terminate()
            server.join()
        failed = calls - counts["ok"]
        out["limits"][str(limit)] = {
            "calls": calls,
            "counts": dict(counts),
            "failed_fraction": failed / calls,
        }
        progress(
            f"max_concurrent_streams {limit}, {calls} calls: {counts['ok']} ok, {failed} failed"
        )
        for what, n in counts.items():
            if what != "ok":
                print(f"    {n} x {what}", file=sys.stderr)
    write_result("streams", out)


if __name__ == "__main__":
    main()
