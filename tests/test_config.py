"""The config is validated up front and one error lists every problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from fair_frontend.config import ConfigError, CostUnit, load_config, parse_config

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "config.yaml"


def test_example_config_loads() -> None:
    config = load_config(EXAMPLE)
    assert config.tiers[0] == "enterprise"
    assert config.endpoints["embed"].cost is CostUnit.TOKENS
    assert config.endpoints["generate"].cost is CostUnit.REQUESTS


def test_every_problem_is_listed_at_once() -> None:
    bad = {
        "tiers": ["gold", "gold"],
        "endpoints": {"e": {"cost": "bogus", "max_batch_size": -1}},
        "tenants": {
            "a": {"tier": "platinum", "weight": 0, "api_keys": ["sha256:xyz"]},
            "b": {"tier": "gold", "api_keys": ["shared"]},
            "c": {"tier": "gold", "api_keys": ["shared"]},
        },
        "tier_limits": {"bronze": {}},
        "unknown_field": 1,
    }
    with pytest.raises(ConfigError) as info:
        parse_config(bad)
    text = str(info.value)
    for expected in (
        "endpoints.e.cost",
        "endpoints.e.max_batch_size",
        "tenants.a.weight",
        "unknown_field",
        "duplicate names",
        "tenants.a.tier: unknown tier 'platinum'",
        "tenants.a.api_keys[0]",
        "the same key is given to tenant 'b'",
        "tier_limits.bronze: unknown tier",
    ):
        assert expected in text, expected
    # Secrets are never echoed, not even a plain key that clashes.
    assert "shared" not in text


def test_tier_limits_are_overridden_field_by_field() -> None:
    config = parse_config(
        {
            "tiers": ["paid", "trial"],
            "tier_limits": {"trial": {"gen": {"requests_per_minute": 10, "tokens_per_month": 200}}},
            "tenants": {
                "t": {"tier": "trial", "limits": {"gen": {"requests_per_minute": 20}}},
                "u": {"tier": "trial"},
            },
        }
    )
    assert config.limits_for("t", "gen").items() == [
        ("requests", "minute", 20),
        ("tokens", "month", 200),
    ]
    assert config.limits_for("u", "gen").items() == [
        ("requests", "minute", 10),
        ("tokens", "month", 200),
    ]
    assert config.limits_for("u", "other").items() == []


def test_quantum_follows_the_batching_policy() -> None:
    config = parse_config(
        {
            "tiers": ["t"],
            "endpoints": {
                "gen": {"cost": "requests", "max_batch_size": 8},
                "emb": {"cost": "tokens", "max_batch_size": 32, "max_batch_tokens": 4096},
                "fixed": {"cost": "tokens", "quantum": 7},
            },
        }
    )
    assert config.endpoints["gen"].effective_quantum(8) == 1
    assert config.endpoints["emb"].effective_quantum(32) == 4096
    assert config.endpoints["fixed"].effective_quantum(32) == 7


def test_default_priority_resolution() -> None:
    config = parse_config(
        {
            "tiers": ["t"],
            "priority_levels": 9,
            "endpoints": {"e": {"default_priority": 3}},
            "tenants": {"a": {"tier": "t", "default_priority": 2}, "b": {"tier": "t"}},
        }
    )
    assert config.default_priority("a", "e") == 2
    assert config.default_priority("b", "e") == 3
    assert config.default_priority("b", "other") == 5


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [a\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)
