"""``serve`` (and ``up`` outside its demo mode) refuses a key set that admits nobody.

A frontend where no tenant has a key and no trusted gateway names tenants would answer
every request 401: a deployment whose secrets were not provided (an empty variable, an
empty key file). The real CLI, as a process: its exit code and its message, which names
what to set. It stops before anything starts (no Triton is needed to see it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fair_frontend.auth import KeyRing
from fair_frontend.backends.triton.embedded import free_port
from fair_frontend.cli import key_set_problem, model_access_problem
from fair_frontend.config import parse_config
from tests.support import config_dict


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fair_frontend.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def _config(tmp_path: Path, tenants: dict[str, Any], **more: Any) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config_dict(tenants=tenants, **more)))
    return path


def _keyless(tmp_path: Path, how: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Tenants whose keys were not provided, the ways a deployment gets there."""
    if how == "none":
        return {"acme": {"tier": "enterprise"}}, {}
    if how == "empty-variable":  # compose's ${VAR:-}, a Secret with an empty value
        return {"acme": {"tier": "enterprise", "api_keys_env": "FAIR_TEST_KEYS"}}, {
            "FAIR_TEST_KEYS": " , "
        }
    keys = tmp_path / "acme.keys"
    keys.write_text("# acme's keys, one per line\n\n")
    return {"acme": {"tier": "enterprise", "api_keys_file": str(keys)}}, {}


@pytest.mark.parametrize("how", ["none", "empty-variable", "empty-file"])
def test_serve_refuses_to_start_without_a_single_key(tmp_path: Path, how: str) -> None:
    tenants, env = _keyless(tmp_path, how)
    config = _config(tmp_path, tenants)
    http = free_port()
    out = _cli(
        *("serve", "--config", str(config), "--triton-url", "127.0.0.1:1"),
        *("--host", "127.0.0.1", "--http-port", str(http), "--metrics-port", "0"),
        env={**_environ(), **env},
    )
    assert out.returncode == 2, out
    message = out.stderr
    assert "fair-frontend: no API keys" in message, message
    for named in ("acme", "api_keys", "auth.trusted_gateway", "hash-key"):
        assert named in message, (named, message)
    assert "Traceback" not in message
    assert "serving" not in out.stdout


def test_up_outside_demo_mode_refuses_it_before_starting_triton(tmp_path: Path) -> None:
    tenants, _ = _keyless(tmp_path, "none")
    out = _cli("up", "--config", str(_config(tmp_path, tenants)), env=_environ())
    assert out.returncode == 2 and "no API keys" in out.stderr, out
    assert "starting Triton" not in out.stdout


def test_a_key_or_a_trusted_gateway_is_enough() -> None:
    keyed = parse_config(config_dict(tenants={"acme": {"tier": "enterprise", "api_keys": ["k"]}}))
    assert key_set_problem(keyed, KeyRing.from_config(keyed)) is None
    gateway = parse_config(
        config_dict(
            tenants={"acme": {"tier": "enterprise"}},
            auth={"trusted_gateway": True, "trusted_gateway_peers": ["10.0.0.0/8"]},
        )
    )
    assert key_set_problem(gateway, KeyRing.from_config(gateway)) is None
    empty = parse_config(config_dict(tenants={}))
    problem = key_set_problem(empty, KeyRing.from_config(empty))
    assert problem is not None and "no tenants are configured" in problem


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "FAIR_TEST_KEYS"}


def test_tenants_that_may_call_no_model_are_named_at_start() -> None:
    """Model access is closed by default: a config without ``tier_models`` (written before
    it) refuses every model to every tenant. Said at start, naming them; a tenant with a
    model open, or every model, is not named."""
    tenants = {
        "acme": {"tier": "enterprise", "api_keys": ["a"]},
        "globex": {"tier": "standard", "api_keys": ["g"]},
    }
    before = parse_config(config_dict(tenants=tenants, tier_models={}))
    problem = model_access_problem(before)
    assert problem is not None
    assert "tenants acme, globex may call no model" in problem
    assert "tier_models" in problem and "403" in problem

    tenants["globex"]["denied_models"] = ["*"]  # closed on purpose: still named
    tenants["acme"]["extra_models"] = ["embed"]
    some = parse_config(config_dict(tenants=tenants, tier_models={"standard": ["*"]}))
    problem = model_access_problem(some)
    assert problem is not None and "tenants globex may" in problem and "acme" not in problem

    del tenants["acme"]["extra_models"]  # its tier's one model, denied: none left
    tenants["acme"]["denied_models"] = ["embed"]
    denied = parse_config(config_dict(tenants=tenants, tier_models={"enterprise": ["embed"]}))
    assert "tenants acme, globex may" in (model_access_problem(denied) or "")

    assert model_access_problem(parse_config(config_dict())) is None  # the tests' config
