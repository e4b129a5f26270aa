"""Failures: Triton killed and restarted, key reload under load, shutdown. Nothing lost.

Every request sent gets exactly one answer; these tests count answers by kind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
import yaml
from tritonclient.utils import InferenceServerException

from fair_frontend.config import parse_config
from fair_frontend.embedded import EmbeddedTriton, default_model_repository, free_port
from fair_frontend.server import Listen
from fair_frontend.testing import aeventually, ascrape
from tests.support import KEYS, config_dict, ids_input, make_config, running_frontend

IDS = np.full((1, 256), 3, dtype=np.int32)


@pytest.fixture
def own_triton() -> Iterator[EmbeddedTriton]:
    """A Triton of this test's own (it gets killed), serving only embed."""
    server = EmbeddedTriton(
        default_model_repository(),
        extra_args=["--model-control-mode=explicit", "--load-model=embed"],
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def _send(
    client: grpcaio.InferenceServerClient, tenant: str, ids: np.ndarray = IDS, **kw: Any
) -> Any:
    try:
        return await client.infer(
            "embed", [ids_input(grpcaio, ids)], headers={"x-api-key": KEYS[tenant]}, **kw
        )
    except InferenceServerException as err:
        return err


def _kill(triton: EmbeddedTriton) -> None:
    assert triton.pid is not None
    os.killpg(triton.pid, signal.SIGKILL)


async def test_triton_killed_mid_load_then_back(own_triton: EmbeddedTriton, workers: int) -> None:
    with running_frontend(make_config(), own_triton, workers=workers) as fe:
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        try:
            assert (await _send(client, "acme")).as_numpy("EMBEDDING").shape == (1, 128)
            # Rows of 1,024 tokens: Triton serves the flood for seconds, so it queues
            # whatever the speed of the intake.
            wide = np.full((1, 1024), 3, dtype=np.int32)
            flood = [asyncio.ensure_future(_send(client, "acme", wide)) for _ in range(200)]

            async def flood_queued() -> bool:
                if await fe.acall(_depth(fe)) >= 100:
                    return True
                assert not all(f.done() for f in flood), "the flood was answered before it queued"
                return False

            await aeventually(flood_queued, 60, 0.005, what="the flood to queue 100 requests")
            killed_at = time.monotonic()
            _kill(own_triton)
            # The batch in flight fails fast; the rest stays queued while Triton is away.
            first_error = None
            while first_error is None and time.monotonic() - killed_at < 5:
                done = [f.result() for f in flood if f.done()]
                errors = [r for r in done if isinstance(r, InferenceServerException)]
                if errors:
                    first_error = time.monotonic() - killed_at
                    break
                await asyncio.sleep(0.01)
            assert first_error is not None and first_error < 1.0, first_error
            assert all(e.status() == "StatusCode.UNAVAILABLE" for e in _errors(flood))
            await aeventually(
                lambda: not fe.frontend.backend.available,
                10,
                0.01,
                what="Triton, killed, to be marked unavailable",
            )
            queued = await fe.acall(_depth(fe))
            assert queued > 50, "queued requests must wait for Triton, not fail"
            assert not client_ready(fe)
            # A request with a deadline expires at its deadline while Triton is away.
            expired = await _send(client, "globex", timeout=200_000)
            assert isinstance(expired, InferenceServerException)
            assert expired.message() == "Request timeout expired"

            await asyncio.to_thread(own_triton.restart)
            results = await asyncio.wait_for(asyncio.gather(*flood), 120)
            # Ready again once the shell's own channel to Triton has reconnected (its
            # back-off after an outage is at most 1 s).
            await aeventually(
                lambda: client_ready(fe), 10, 0.05, what="ready after Triton came back"
            )
        finally:
            await client.close()
    ok = [r for r in results if not isinstance(r, InferenceServerException)]
    unavailable = [r for r in results if isinstance(r, InferenceServerException)]
    assert len(ok) + len(unavailable) == 200
    assert len(ok) >= queued  # everything still queued at the kill was served after
    assert all(e.status() == "StatusCode.UNAVAILABLE" for e in unavailable)


async def test_an_outage_longer_than_max_outage_is_answered_not_held(
    own_triton: EmbeddedTriton,
    workers: int,
) -> None:
    data = config_dict()
    data["triton"] = {"max_outage_s": 1.0}
    with running_frontend(parse_config(data), own_triton, workers=workers) as fe:
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        try:
            assert not isinstance(await _send(client, "acme"), InferenceServerException)
            _kill(own_triton)
            # A first call alone finds the dead connection (or is held: it never reached
            # Triton); the calls after it are held (had they come together, they would
            # have shared its batch and its fate)...
            started = time.monotonic()
            first = await _send(client, "acme")
            assert isinstance(first, InferenceServerException)
            held = await asyncio.gather(*(_send(client, "acme") for _ in range(10)))
            waited = time.monotonic() - started
            # ...until the outage outlasts max_outage_s: then answered, not lost.
            assert all(isinstance(r, InferenceServerException) for r in held)
            assert all(r.status() == "StatusCode.UNAVAILABLE" for r in held)
            assert any("has been unavailable" in r.message() for r in held)
            assert waited < 10, waited
            # While the outage lasts, new work is refused at once.
            t0 = time.monotonic()
            refused = await _send(client, "acme")
            assert isinstance(refused, InferenceServerException)
            assert "has been unavailable" in refused.message()
            assert time.monotonic() - t0 < 1.0
            # Triton back: served again.
            await asyncio.to_thread(own_triton.restart)

            async def served() -> bool:
                return not isinstance(await _send(client, "acme"), InferenceServerException)

            await aeventually(served, 30, 0.1, what="served again once Triton is back")
        finally:
            await client.close()


def _errors(futures: list[asyncio.Future[Any]]) -> list[InferenceServerException]:
    return [
        f.result() for f in futures if f.done() and isinstance(f.result(), InferenceServerException)
    ]


async def _depth(fe: Any) -> int:
    runtime = fe.frontend.runtimes.get("embed")
    return 0 if runtime is None else runtime.scheduler.queued_requests


def client_ready(fe: Any) -> bool:
    try:
        with urllib.request.urlopen(f"http://{fe.http_url}/v2/health/ready", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


# ---- the CLI: up mode restarts Triton; SIGHUP reloads keys; SIGTERM drains -----------------


def _cli(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fair_frontend.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait_ready(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"not ready in {timeout}s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _ports() -> list[str]:
    http, grpc, metrics = free_port(), free_port(), free_port()
    return [
        "--host",
        "127.0.0.1",
        "--http-port",
        str(http),
        "--grpc-port",
        str(grpc),
        "--metrics-port",
        str(metrics),
    ]


def _tritonserver_children(pid: int) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(pid), "-f", "tritonserver"], capture_output=True, text=True
    ).stdout.split()
    return [int(p) for p in out]


async def test_up_mode_restarts_a_dead_triton(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(config_dict()))
    ports = _ports()
    log = tmp_path / "up.log"
    proc = _cli(["up", "--config", str(config), *ports], log)
    try:
        http = int(ports[ports.index("--http-port") + 1])
        grpc = f"127.0.0.1:{ports[ports.index('--grpc-port') + 1]}"
        _wait_ready(http, proc, log)
        client = grpcaio.InferenceServerClient(grpc)
        try:
            assert not isinstance(await _send(client, "acme"), InferenceServerException)
        finally:
            await client.close()
        (first,) = _tritonserver_children(proc.pid)
        os.killpg(first, signal.SIGKILL)
        client = grpcaio.InferenceServerClient(grpc)
        answers: list[Any] = []
        try:
            # The first one may be sent on the dead connection (answered UNAVAILABLE);
            # then requests are held until the restarted Triton is ready, and served.
            deadline = time.monotonic() + 120
            while True:
                answers.append(await _send(client, "acme", timeout=60_000_000))
                if not isinstance(answers[-1], InferenceServerException):
                    break
                assert answers[-1].status() == "StatusCode.UNAVAILABLE", answers[-1]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
        finally:
            await client.close()
        assert len(answers) <= 2, [str(a) for a in answers]
        (second,) = _tritonserver_children(proc.pid)
        assert second != first
        assert "restarting it" in log.read_text()
    finally:
        assert _stop(proc) == 0, log.read_text()[-3000:]


async def test_sighup_reloads_keys_without_dropping_a_request(
    triton: Any, tmp_path: Path, workers: int
) -> None:
    data = config_dict()
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    ports = _ports()
    log = tmp_path / "serve.log"
    serve = ["serve", "--config", str(config), "--triton-url", triton.grpc_url, *ports]
    proc = _cli([*serve, "--workers", str(workers)], log)
    grpc = f"127.0.0.1:{ports[ports.index('--grpc-port') + 1]}"
    try:
        _wait_ready(int(ports[ports.index("--http-port") + 1]), proc, log)
        client = grpcaio.InferenceServerClient(grpc)
        try:
            assert isinstance(await _send_key(client, "brand-new-key"), InferenceServerException)
            load = [asyncio.ensure_future(_send(client, "acme")) for _ in range(300)]
            # A new tenant with a new key, and acme's key rotated to a second one as well.
            data["tenants"]["newco"] = {"tier": "standard", "api_keys": ["brand-new-key"]}
            data["tenants"]["acme"]["api_keys"].append("acme-rotated-key")
            config.write_text(yaml.safe_dump(data))
            proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while isinstance(await _send_key(client, "brand-new-key"), InferenceServerException):
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                await asyncio.sleep(0.05)
            assert not isinstance(await _send_key(client, "acme-rotated-key"), Exception)
            results = await asyncio.wait_for(asyncio.gather(*load), 120)
        finally:
            await client.close()
        assert not [r for r in results if isinstance(r, InferenceServerException)]
        # A broken config is refused; the running one stays.
        config.write_text("tiers: [\n")
        proc.send_signal(signal.SIGHUP)
        client = grpcaio.InferenceServerClient(grpc)
        try:
            deadline = time.monotonic() + 30
            while "reload refused" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                await asyncio.sleep(0.05)
            assert not isinstance(await _send_key(client, "brand-new-key"), Exception)
            # So is one that admits nobody (a Secret emptied under a running frontend): it
            # would refuse every tenant 401, as start does (exit 2).
            for tenant in data["tenants"].values():
                tenant["api_keys"] = []
            config.write_text(yaml.safe_dump(data))
            proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while "reload refused, keeping the running config: no API keys" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                await asyncio.sleep(0.05)
            assert not isinstance(await _send_key(client, "brand-new-key"), Exception)
        finally:
            await client.close()
        assert "brand-new-key" not in log.read_text()
    finally:
        assert _stop(proc) == 0


async def _send_key(client: grpcaio.InferenceServerClient, key: str) -> Any:
    try:
        return await client.infer(
            "embed", [ids_input(grpcaio, IDS)], headers={"authorization": f"Bearer {key}"}
        )
    except InferenceServerException as err:
        return err


async def test_sigterm_finishes_what_is_queued(triton: Any, tmp_path: Path, workers: int) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(config_dict()))
    ports = _ports()
    log = tmp_path / "serve.log"
    serve = ["serve", "--config", str(config), "--triton-url", triton.grpc_url, *ports]
    proc = _cli([*serve, "--workers", str(workers)], log)
    grpc = f"127.0.0.1:{ports[ports.index('--grpc-port') + 1]}"
    _wait_ready(int(ports[ports.index("--http-port") + 1]), proc, log)
    client = grpcaio.InferenceServerClient(grpc)
    try:
        # Rows of 1,024 tokens (4 per batch of the example's max_batch_tokens): Triton
        # serves the flood for seconds, so it queues whatever the speed of the intake.
        wide = np.full((1, 1024), 3, dtype=np.int32)
        flood = [asyncio.ensure_future(_send(client, "initech", wide)) for _ in range(300)]
        # SIGTERM with plenty queued: what was accepted is served; what arrives after is
        # refused with UNAVAILABLE (answered, not dropped).
        metrics = f"http://127.0.0.1:{ports[ports.index('--metrics-port') + 1]}/metrics"

        async def queued_60() -> float:
            # Scraped off the loop: the flood's calls keep going out meanwhile.
            depth = (await ascrape(metrics, timeout=5)).sum("fair_queue_depth")
            assert depth >= 60 or not all(f.done() for f in flood), (
                "the flood was served before it queued"
            )
            return depth if depth >= 60 else 0

        queued = await aeventually(queued_60, 60, 0.01, what="the flood to queue 60 requests")
        done_before = sum(f.done() for f in flood)
        proc.send_signal(signal.SIGTERM)
        results = await asyncio.wait_for(asyncio.gather(*flood), 120)
        code = await asyncio.to_thread(proc.wait, 60)
    finally:
        await client.close()
        if proc.poll() is None:  # the test failed before its SIGTERM: leave nothing behind
            _stop(proc)
    assert code == 0, log.read_text()[-3000:]
    refused = [r for r in results if isinstance(r, InferenceServerException)]
    served = len(results) - len(refused)
    assert served >= done_before + queued
    for r in refused:
        assert r.status() == "StatusCode.UNAVAILABLE"
        assert r.message() == "the frontend is shutting down"


# ---- ports held by someone else --------------------------------------------------------------


@pytest.mark.parametrize("listener", ["grpc_port", "metrics_grpc_port"])
def test_a_grpc_port_another_server_holds_is_a_start_error(
    triton: EmbeddedTriton, workers: int, listener: str
) -> None:
    """A gRPC server of the same user bound with SO_REUSEPORT (gRPC's default) holds the
    port: the frontend refuses to start, as Triton does, instead of sharing the port and
    silently taking part of the other server's connections (which it did: the shells'
    port sharing was open to any process, and one-process mode kept gRPC's default)."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = Listen(**{listener: taken.getsockname()[1]})
        with (
            pytest.raises(OSError, match="in use"),
            running_frontend(make_config(), triton, workers=workers, listen=listen),
        ):
            pass
