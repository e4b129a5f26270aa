"""``fair-frontend check-config``: OK means ``serve`` starts with the config.

check-config and every start (``serve``, ``up``, ``core``, and SIGHUP's reload) call one
function (``cli.check_start``): what serve refuses, check-config refuses (exit 2, said
as serve says it); what serve warns of, check-config prints (exit 1); OK (exit 0) only
when serve has nothing to say. The real CLI, as processes, in the environment given
(key variables and files are read where the check runs). Before, check-config said OK
for a config without ``tier_models`` (every tenant refused every model), with a key
variable unset (serve exits 2) and with a misspelt model name.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fair_frontend.config import model_name_warnings, parse_config
from fair_frontend.kit.testing import eventually, free_port
from tests.support import Proc, config_dict, start

UNSET = "FAIR_TEST_CHECK_UNSET_KEYS"


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != UNSET}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fair_frontend.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=_environ(),
    )


def _write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _misspelt() -> dict[str, Any]:
    data = config_dict()
    data["tier_models"]["trial"] = ["embd", "rerank"]
    data["tier_limits"] = {"standard": {"generat": {"requests_per_second": 5}}}
    data["tenants"]["acme"]["limits"] = {"lm": {"tokens_per_minute": 1000}}
    return data


def test_a_clean_config_is_ok(tmp_path: Path) -> None:
    out = _cli("check-config", str(_write(tmp_path, config_dict())))
    assert out.returncode == 0, out
    assert out.stdout.strip().endswith("OK (5 tenants, 4 endpoints)"), out.stdout
    assert out.stderr == ""


def test_a_config_without_tier_models_starts_with_every_tenant_closed(tmp_path: Path) -> None:
    data = config_dict()
    del data["tier_models"]
    out = _cli("check-config", str(_write(tmp_path, data)))
    assert out.returncode == 1, out
    assert "OK" not in out.stdout
    assert "warning: tenants acme, globex, hooli, initech, umbrella may call no model" in (
        out.stderr
    )


def test_an_unset_key_variable_is_refused_as_serve_refuses_it(tmp_path: Path) -> None:
    data = config_dict()
    data["tenants"]["acme"] = {"tier": "enterprise", "api_keys_env": UNSET}
    path = _write(tmp_path, data)
    check = _cli("check-config", str(path))
    assert check.returncode == 2, check
    said = f"tenants.acme.api_keys_env: variable {UNSET} is not set"
    assert said in check.stderr and "OK" not in check.stdout
    serve = _cli(
        *("serve", "--config", str(path), "--triton-url", "127.0.0.1:1"),
        *("--host", "127.0.0.1", "--http-port", str(free_port()), "--metrics-port", "0"),
    )
    assert serve.returncode == 2 and said in serve.stderr, serve
    # A key file that cannot be read, and Redis's password file: the same.
    data["tenants"]["acme"] = {"tier": "enterprise", "api_keys_file": str(tmp_path / "none")}
    unreadable = _cli("check-config", str(_write(tmp_path, data)))
    assert unreadable.returncode == 2 and "api_keys_file: cannot read" in unreadable.stderr
    data = config_dict(
        rate_limiting={
            "storage": "redis://127.0.0.1:1/0",
            "storage_password_file": str(tmp_path / "no-password"),
        }
    )
    password = _cli("check-config", str(_write(tmp_path, data)))
    assert password.returncode == 2, password
    assert "rate_limiting.storage_password_file: cannot read" in password.stderr


def test_a_key_set_that_admits_nobody_is_refused(tmp_path: Path) -> None:
    data = config_dict(tenants={"acme": {"tier": "enterprise"}})
    out = _cli("check-config", str(_write(tmp_path, data)))
    assert out.returncode == 2 and "fair-frontend: no API keys" in out.stderr, out


def test_misspelt_model_names_are_named_with_the_closest_endpoint(tmp_path: Path) -> None:
    warnings = model_name_warnings(parse_config(_misspelt()))
    assert len(warnings) == 3, warnings
    (models,) = [w for w in warnings if w.startswith("tier_models.trial:")]
    assert "'embd' (did you mean 'embed'?)" in models
    assert "endpoints: embed, generate, llm, rerank" in models
    assert any(w.startswith("tier_limits.standard:") and "'generate'?" in w for w in warnings)
    assert any(w.startswith("tenants.acme.limits:") and "'llm'?" in w for w in warnings)
    # "*", and names the endpoints carry, are not named; nor anything without endpoints.
    assert model_name_warnings(parse_config(config_dict())) == []
    assert model_name_warnings(parse_config(config_dict(endpoints={}))) == []
    far = config_dict()
    far["tier_models"]["trial"] = ["a-model-triton-serves"]  # no close name: no guess
    (warning,) = model_name_warnings(parse_config(far))
    assert "did you mean" not in warning and "default_endpoint" in warning

    out = _cli("check-config", str(_write(tmp_path, _misspelt())))
    assert out.returncode == 1, out
    assert "starts, with 3 warning(s)" in out.stdout and "OK" not in out.stdout
    for warning in warnings:
        assert f"warning: {warning}" in out.stderr


@pytest.fixture
def serve_log(tmp_path: Path) -> Proc:
    """``serve`` with the misspelt config, to its start (no Triton answers: it waits)."""
    path = _write(tmp_path, _misspelt())
    args = ["serve", "--config", str(path), "--triton-url", f"127.0.0.1:{free_port()}"]
    args += ["--host", "127.0.0.1", "--http-port", str(free_port())]
    args += ["--grpc-port", str(free_port()), "--metrics-port", str(free_port())]
    return start([*args, "--workers", "1"], tmp_path / "serve.log")


def test_serve_warns_of_what_check_config_warns_of(serve_log: Proc) -> None:
    """The same function at serve's start: its log carries each warning check-config
    prints (serve starts: they are warnings)."""
    warnings = model_name_warnings(parse_config(_misspelt()))
    try:
        eventually(
            lambda: all(w in serve_log.output() for w in warnings),
            60,
            what="serve's start to log the warnings",
        )
        assert serve_log.popen.poll() is None, serve_log.output()
    finally:
        serve_log.stop()
