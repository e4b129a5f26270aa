"""Fixtures for the admission tests: a real ``redis-server`` on a free port, and storages.

Every test that takes ``storage`` runs once per storage (``memory``, ``redis``): the same
tests over every storage. The session's ``redis_server`` is flushed before each test;
tests that kill or pause Redis start their own with ``redis_process``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import redis

from fair_frontend.admission import MemoryStorage, RedisStorage, Storage

# Functional tests must never see a storage error: a loaded 2-core machine can stall for
# more than the 50 ms production default. The failure tests use the production timeout.
FUNCTIONAL_TIMEOUT_S = 5.0
START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """A ``redis-server`` this test owns: no persistence, loopback only, a free port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.wait_ready()

    def wait_ready(self) -> None:
        """Poll PING until it answers (no fixed sleeps)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        client = self.client()
        try:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not answer PING in time")
                time.sleep(0.01)  # polling interval, not a wait for readiness
        finally:
            client.close()

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def stop(self) -> None:
        """Terminate the process and wait for it to be gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    server = RedisProcess()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisProcess) -> str:
    return redis_server.url


@pytest.fixture
def redis_process() -> Iterator[RedisProcess]:
    """A Redis of the test's own, to kill, pause or restart; stopped after the test."""
    server = RedisProcess()
    server.start()
    yield server
    server.stop()


StorageFactory = Callable[[], Storage]


@pytest.fixture(params=["memory", "redis"])
def storage_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def new_storage(storage_kind: str, request: pytest.FixtureRequest) -> StorageFactory:
    """Makes fresh storages of this test's kind over clean state (Redis flushed once)."""
    if storage_kind == "memory":
        return MemoryStorage
    server: RedisProcess = request.getfixturevalue("redis_server")
    with server.client() as c:
        c.flushall()
    return lambda: RedisStorage(server.url, timeout_s=FUNCTIONAL_TIMEOUT_S)


@pytest.fixture
async def storage(new_storage: StorageFactory) -> AsyncIterator[Storage]:
    made = new_storage()
    yield made
    await made.close()
