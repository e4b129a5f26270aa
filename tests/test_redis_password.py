"""The rate limits' Redis behind a password (``requirepass``).

The frontend reads the password from a variable or a file (``rate_limiting.
storage_password_env`` / ``storage_password_file``) and puts it in the storage's URI at
start; it never appears in a log line or an error. Against a real ``redis-server
--requirepass`` on a free port: with the password the limits are counted in Redis;
without it (or with a wrong one) the configured ``on_storage_error`` mode applies and the
log says why ("Authentication"), not what the password is.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
from redis.connection import parse_url
from tritonclient.utils import InferenceServerException

from fair_frontend.admission import RedisStorage
from fair_frontend.backends.triton.embedded import EmbeddedTriton, free_port
from fair_frontend.config import ConfigError, RateLimiting, parse_config, url_with_password
from fair_frontend.core.plan import rate_limiter
from tests.support import KEYS, config_dict, ids_input, required_tool, running_frontend

# Characters a URI must escape, so the test sees the encoding work.
PASSWORD = "pa:ss@w/rd%41#?x y"
WRONG = "not-the-password-9f3a"
TENANT = "acme"
START_TIMEOUT_S = 10.0


class LockedRedis:
    """A ``redis-server`` of this module's, on a free loopback port, with a password."""

    def __init__(self, password: str) -> None:
        binary = required_tool("redis-server")
        self.port = free_port()
        self.password = password
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--requirepass", password],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        with self.client() as client:
            while True:
                assert self.proc.poll() is None, "redis-server exited"
                try:
                    if client.ping():
                        break
                except redis.ConnectionError:
                    pass
                assert time.monotonic() < deadline, "redis-server did not answer PING"
                time.sleep(0.01)  # polling interval, not a wait for readiness

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, socket_timeout=5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def locked_redis() -> Iterator[LockedRedis]:
    server = LockedRedis(PASSWORD)
    try:
        yield server
    finally:
        server.stop()


# ---- the config: where the password comes from -------------------------------------------


def test_storage_url_carries_the_password_escaped_and_keeps_a_user(tmp_path: Path) -> None:
    env = RateLimiting(storage="redis://redis:6379/0", storage_password_env="REDIS_PW")
    url = env.storage_url({"REDIS_PW": PASSWORD})
    parsed = parse_url(url)  # what redis-py connects with
    assert parsed["password"] == PASSWORD and parsed["host"] == "redis"
    assert parsed["port"] == 6379 and parsed["db"] == 0
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")  # a Secret's file; the newline is not the password's
    file = RateLimiting(storage="rediss://ops@redis:6380/2", storage_password_file=str(secret))
    parsed = parse_url(file.storage_url())
    assert (parsed["username"], parsed["password"], parsed["db"]) == ("ops", PASSWORD, 2)
    unix = parse_url(url_with_password("unix:///run/redis.sock?db=1", PASSWORD))
    assert (unix["path"], unix["password"]) == ("/run/redis.sock", PASSWORD)
    assert RateLimiting(storage="redis://redis:6379").storage_url() == "redis://redis:6379"


def test_a_missing_password_is_a_start_error_naming_the_field_not_the_value(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as unset:
        RateLimiting(storage="redis://r:1", storage_password_env="REDIS_PW").storage_url({})
    assert "rate_limiting.storage_password_env: variable REDIS_PW is not set" in str(unset.value)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, why in ((tmp_path / "absent", "cannot read"), (empty, "is empty")):
        with pytest.raises(ConfigError) as err:
            RateLimiting(storage="redis://r:1", storage_password_file=str(path)).storage_url()
        assert "rate_limiting.storage_password_file" in str(err.value) and why in str(err.value)


@pytest.mark.parametrize(
    ("limiting", "problem"),
    [
        (
            {"storage": "redis://r:1", "storage_password_env": "A", "storage_password_file": "/f"},
            "storage_password_env and storage_password_file exclude each other",
        ),
        (
            {"storage": "memory://", "storage_password_env": "A"},
            "only a Redis storage",
        ),
        (
            {"storage": f"redis://:{WRONG}@r:1", "storage_password_file": "/f"},
            "already holds a password",
        ),
        ({"storage": "redis://r:1", "storage_password_env": " "}, "storage_password_env: empty"),
    ],
)
def test_the_password_fields_are_checked_up_front(limiting: dict[str, str], problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(config_dict(rate_limiting=limiting))
    assert problem in str(err.value)
    assert WRONG not in str(err.value)  # the URI's password is never echoed


# ---- against a real redis-server with requirepass ---------------------------------------


def _limited(storage: dict[str, str]) -> dict[str, object]:
    """The test tenants, acme limited to 2 embed requests a minute, Redis as storage."""
    data = config_dict(rate_limiting={"timeout_ms": 5000, **storage})
    data["tenants"][TENANT]["limits"] = {"embed": {"requests_per_minute": 2}}
    return data


def _codes(url: str, count: int) -> list[str]:
    client = grpcclient.InferenceServerClient(url)
    codes = []
    try:
        for _ in range(count):
            try:
                client.infer(
                    "embed",
                    [ids_input(grpcclient, np.ones((1, 8), np.int32))],
                    headers={"x-api-key": KEYS[TENANT]},
                )
                codes.append("OK")
            except InferenceServerException as err:
                codes.append(str(err.status()).removeprefix("StatusCode."))
    finally:
        client.close()
    return codes


@pytest.mark.parametrize("source", ["env", "file"])
def test_the_frontend_counts_limits_in_a_redis_behind_a_password(
    triton: EmbeddedTriton,
    workers: int,
    locked_redis: LockedRedis,
    source: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with locked_redis.client() as admin:
        admin.flushall()
    if source == "env":
        monkeypatch.setenv("FAIR_TEST_REDIS_PASSWORD", PASSWORD)
        field = {"storage_password_env": "FAIR_TEST_REDIS_PASSWORD"}
    else:
        (tmp_path / "password").write_text(PASSWORD + "\n")
        field = {"storage_password_file": str(tmp_path / "password")}
    data = _limited({"storage": locked_redis.url, "on_storage_error": "fail_closed", **field})
    caplog.set_level(logging.INFO)
    with running_frontend(parse_config(data), triton, workers=workers) as running:
        assert _codes(running.grpc_url, 3) == ["OK", "OK", "RESOURCE_EXHAUSTED"]
        assert running.frontend.limiter.storage_errors == 0
    with locked_redis.client() as admin:
        assert admin.keys("rl:*"), "the limits were not counted in Redis"
    assert PASSWORD not in caplog.text


@pytest.mark.parametrize(
    ("mode", "given"), [("fail_closed", None), ("fail_open", WRONG)], ids=["missing", "wrong"]
)
def test_without_the_password_the_mode_applies_and_the_log_says_authentication(
    triton: EmbeddedTriton,
    workers: int,
    locked_redis: LockedRedis,
    mode: str,
    given: str | None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    storage: dict[str, str] = {"storage": locked_redis.url, "on_storage_error": mode}
    if given is not None:
        monkeypatch.setenv("FAIR_TEST_REDIS_PASSWORD", given)
        storage["storage_password_env"] = "FAIR_TEST_REDIS_PASSWORD"
    caplog.set_level(logging.INFO)
    with running_frontend(parse_config(_limited(storage)), triton, workers=workers) as running:
        codes = _codes(running.grpc_url, 3)
        errors = running.frontend.limiter.storage_errors
    # Redis refused every check: fail_closed answers 503, fail_open admits (uncounted).
    assert codes == ["UNAVAILABLE"] * 3 if mode == "fail_closed" else ["OK"] * 3
    assert errors == 3
    failures = [r.getMessage() for r in caplog.records if "rate-limit storage" in r.getMessage()]
    assert failures and all("Authentication" in line for line in failures), failures
    assert PASSWORD not in caplog.text and WRONG not in caplog.text


async def test_the_limiter_reaches_a_locked_redis_only_with_its_password(
    locked_redis: LockedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limiter the config builds (``core.plan.rate_limiter``) holds the password:
    its storage answers; the same URI without it is refused by Redis."""
    monkeypatch.setenv("FAIR_TEST_REDIS_PASSWORD", PASSWORD)
    limiting = RateLimiting(
        storage=locked_redis.url, storage_password_env="FAIR_TEST_REDIS_PASSWORD", timeout_ms=5000
    )
    limiter = rate_limiter(limiting)
    bare = RedisStorage(locked_redis.url, timeout_s=5.0)
    try:
        assert isinstance(limiter.storage, RedisStorage)
        await limiter.storage.ping()
        with pytest.raises(Exception, match="Authentication"):
            await bare.ping()
    finally:
        await limiter.close()
        await bare.close()
