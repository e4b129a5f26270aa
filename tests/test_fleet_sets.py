"""Cores that own disjoint sets of endpoints (``fair_frontend.shell.router``): two cores
(each its own process, each leading its set), one shell (``fair-frontend shell --core
embed=A --core B``) that sends ``embed`` to core A and every other model to core B. Each
core schedules only its own: its counters say so."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
import yaml

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.kit.testing import aeventually, ascrape, eventually, free_port
from tests.support import KEYS, Proc, config_dict, http_status, ids_input, repeat_stream, start

HEADERS = {"x-api-key": KEYS["acme"]}
SECRET = "sets-test-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def two_sets(
    triton: EmbeddedTriton, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[int], int, Proc]]:
    tmp = tmp_path_factory.mktemp("sets")
    data = config_dict()
    data["triton"] = {"backends": [{"grpc_url": triton.grpc_url}]}
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    secret = tmp / "secret"
    secret.write_text(SECRET)
    procs: list[Proc] = []
    ports, metrics = [free_port(), free_port()], [free_port(), free_port()]
    try:
        for i in (0, 1):
            args = ["core", "--config", str(config), "--listen", f"127.0.0.1:{ports[i]}",
                    "--secret-file", str(secret), "--metrics-port", str(metrics[i]),
                    "--metrics-host", "127.0.0.1"]  # fmt: skip
            procs.append(start(args, tmp / f"core{i}.log"))
        grpc_port, http = free_port(), free_port()
        args = ["shell", "--secret-file", str(secret), "--host", "127.0.0.1",
                "--http-port", str(http), "--grpc-port", str(grpc_port),
                "--core", f"embed=127.0.0.1:{ports[0]}",
                "--core", f"127.0.0.1:{ports[1]}"]  # fmt: skip
        shell = start(args, tmp / "shell.log")
        procs.append(shell)
        eventually(
            lambda: http_status(f"http://127.0.0.1:{http}/v2/health/ready") == 200,
            60,
            what="the shell, connected to both sets, to be ready",
        )
        yield metrics, grpc_port, shell
    finally:
        for proc in reversed(procs):
            proc.stop()


async def test_a_shell_sends_each_model_to_the_core_of_its_set(
    two_sets: tuple[list[int], int, Proc],
) -> None:
    metrics, grpc_port, _ = two_sets
    url = f"127.0.0.1:{grpc_port}"
    client = grpcaio.InferenceServerClient(url)
    try:
        ids = np.full((1, 8), 3, dtype=np.int32)
        results = await asyncio.gather(
            *(
                client.infer(
                    "embed", [ids_input(grpcaio, ids)], headers={"x-api-key": KEYS["acme"]}
                )
                for _ in range(5)
            )
        )
        assert len(results) == 5
    finally:
        await client.close()
    assert await repeat_stream(url, [0, 0]) == (2, None)

    async def counted(core: int, endpoint: str) -> float:
        page = await ascrape(f"http://127.0.0.1:{metrics[core]}/metrics")
        return page.sum("fair_requests_total", endpoint=endpoint, outcome="dispatched")

    # A core counts a request once it has recorded its end: a moment after its client
    # had the answer (a stream's, once its shell's record of the end arrives).
    async def each_counted_by_its_own() -> bool:
        return await counted(0, "embed") == 5 and await counted(1, "repeat_int32") == 1

    await aeventually(each_counted_by_its_own, 30, what="each core to count its own set's")
    assert await counted(1, "embed") == 0 and await counted(0, "repeat_int32") == 0


def test_two_sets_naming_one_model_are_refused(tmp_path: Path) -> None:
    proc = start(
        ["shell", "--core", "embed=h:1",
         "--core", "embed,llm=h:2"],
        tmp_path / "shell.log",
        env={"FAIR_FRONTEND_CORE_SECRET": SECRET},
    )  # fmt: skip
    assert proc.popen.wait(60) == 2
    assert "embed named for two sets of cores" in proc.output()
