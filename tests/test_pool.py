"""A pool of two real Tritons behind one frontend (``triton.backends``; ``core.pool``).

Two ``tritonserver`` processes of this test's own (one of them gets killed), each serving
``embed`` and the decoupled ``repeat_int32``, on free loopback ports; the frontend in
front of both, in either link mode (``workers``: the shell in the core's process, or two
shell processes streaming over the socket). What users see: load spreads over both, a
Triton killed mid-load costs only the requests running on it (UNAVAILABLE, retryable),
the rest is served by the other one, and the killed one takes work again once restarted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from fair_frontend.config import parse_config
from fair_frontend.embedded import EmbeddedTriton, default_model_repository
from fair_frontend.server import BackgroundServer, FrontendServer, Listen
from fair_frontend.testing import aeventually, ascrape
from tests.support import KEYS, RunningFrontend, config_dict, ids_input, repeat_stream

TEST_MODELS = Path(__file__).resolve().parent / "model_repository"
WIDE = np.full((1, 1024), 3, dtype=np.int32)  # Triton serves a flood of these for seconds
FLOOD = 200


@pytest.fixture
def two_tritons() -> Iterator[list[EmbeddedTriton]]:
    """Two Tritons of this test's own, serving only ``embed`` and ``repeat_int32``."""
    servers = [
        EmbeddedTriton(
            [default_model_repository(), TEST_MODELS],
            extra_args=[
                "--model-control-mode=explicit",
                "--load-model=embed",
                "--load-model=repeat_int32",
            ],
        )
        for _ in range(2)
    ]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


def pool_frontend(tritons: list[EmbeddedTriton], workers: int) -> tuple[FrontendServer, Any]:
    """The test config with ``triton.backends`` naming both (batches over their HTTP, as
    in up mode), and no --triton-url: the pool comes from the config."""
    data = config_dict()
    data["triton"] = {
        "backends": [{"grpc_url": t.grpc_url, "http_url": t.http_url} for t in tritons],
        "max_outage_s": 120.0,
    }
    server = FrontendServer(parse_config(data), [], Listen(), workers=workers)
    return server, BackgroundServer(server)


async def _embed(client: grpcaio.InferenceServerClient, ids: np.ndarray = WIDE) -> Any:
    try:
        return await client.infer(
            "embed", [ids_input(grpcaio, ids)], headers={"x-api-key": KEYS["acme"]}
        )
    except InferenceServerException as err:
        return err


async def served_by(triton: EmbeddedTriton, model: str) -> int:
    """Requests ``triton`` itself says it served of ``model`` (its statistics extension)."""
    client = grpcaio.InferenceServerClient(triton.grpc_url)
    try:
        stats = await client.get_inference_statistics(model)
    finally:
        await client.close()
    return sum(int(s.inference_stats.success.count) for s in stats.model_stats)


def ready(fe: RunningFrontend) -> bool:
    try:
        with urllib.request.urlopen(f"http://{fe.http_url}/v2/health/ready", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


async def _queued(fe: RunningFrontend) -> int:
    runtime = fe.frontend.runtimes.get("embed")
    return 0 if runtime is None else runtime.scheduler.queued_requests


async def _running(fe: RunningFrontend) -> list[int]:
    return list(fe.frontend.runtimes["embed"].running)


async def test_two_tritons_share_the_load_and_one_killed_costs_only_its_own(
    two_tritons: list[EmbeddedTriton], workers: int
) -> None:
    first, second = two_tritons
    server, background = pool_frontend(two_tritons, workers)
    with background:
        fe = RunningFrontend(server, background)
        assert [b.grpc_url for b in server.backends] == [first.grpc_url, second.grpc_url]
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        try:
            # 1. Load spreads over both: batches, and the streams granted to the shells
            # (each shell streams from the Triton its grant names).
            results = await asyncio.gather(*(_embed(client) for _ in range(40)))
            assert not [r for r in results if isinstance(r, InferenceServerException)]
            streams = await asyncio.gather(
                *(repeat_stream(fe.grpc_url, [50] * 4) for _ in range(6))
            )
            assert streams == [(4, None)] * 6
            for triton in two_tritons:
                assert await served_by(triton, "embed") > 0
                assert await served_by(triton, "repeat_int32") > 0

            # 2. The second one SIGKILLed under a flood: the frontend stays ready and
            # serves on the first; only what ran on the second fails, UNAVAILABLE.
            flood = [asyncio.ensure_future(_embed(client)) for _ in range(FLOOD)]

            async def both_busy() -> bool:
                running = await fe.acall(_running(fe))
                assert not all(f.done() for f in flood), "the flood ended before it queued"
                return await fe.acall(_queued(fe)) >= 50 and all(running)

            await aeventually(both_busy, 60, 0.005, what="the flood to queue on both Tritons")
            slots = fe.frontend.runtimes["embed"].max_inflight
            assert second.pid is not None
            os.killpg(second.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            queued_at_kill = await fe.acall(_queued(fe))
            await aeventually(
                lambda: not fe.frontend.pool.backends[1].available,
                10,
                0.01,
                what="the killed Triton to be marked down",
            )
            assert fe.frontend.pool.backends[0].available
            assert await asyncio.to_thread(ready, fe), "one Triton is ready: so is the frontend"
            got = await ascrape(fe.metrics_url)
            up = {
                b: got.sum("fair_triton_backend_available", backend=b) for b in server.triton_urls
            }
            assert up == {first.grpc_url: 1.0, second.grpc_url: 0.0}
            assert got.sum("fair_backend_available") == 1.0
            results = await asyncio.wait_for(asyncio.gather(*flood), 180)
            took_s = time.monotonic() - killed_at
            failed = [r for r in results if isinstance(r, InferenceServerException)]
            ok = [r for r in results if not isinstance(r, InferenceServerException)]
            assert len(ok) + len(failed) == FLOOD  # every request answered
            assert all(e.status() == "StatusCode.UNAVAILABLE" for e in failed), failed[:3]
            # At most what the killed Triton had running: its slots' batches of 32 rows,
            # and the one the early send may have added (dispatch_lead_ms).
            assert len(failed) <= (slots + 1) * 32, (len(failed), slots)
            assert len(ok) >= queued_at_kill  # all that waited was served, by the first
            assert not fe.frontend.pool.backends[1].available, f"after {took_s:.1f} s"

            # 3. Restarted, it rejoins (its probe) and takes work again.
            await asyncio.to_thread(second.restart)
            await aeventually(
                lambda: fe.frontend.pool.backends[1].available,
                30,
                0.05,
                what="the restarted Triton to rejoin",
            )
            results = await asyncio.gather(*(_embed(client) for _ in range(40)))
            assert not [r for r in results if isinstance(r, InferenceServerException)]
            assert await served_by(second, "embed") > 0  # a fresh Triton: counted anew
            streams = await asyncio.gather(
                *(repeat_stream(fe.grpc_url, [20] * 3) for _ in range(4))
            )
            assert streams == [(3, None)] * 4
        finally:
            await client.close()
