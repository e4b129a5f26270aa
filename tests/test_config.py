"""The config is validated up front and one error lists every problem."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fair_frontend.config import ConfigError, CostUnit, load_config, parse_config
from fair_frontend.core.plan import global_caps, queue_limits

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
    # A token-cost endpoint without a token cap: a full batch in tokens, learned.
    learned = parse_config({"tiers": ["t"], "endpoints": {"e": {"cost": "tokens"}}})
    assert learned.endpoints["e"].effective_quantum(32) is None


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


def test_max_tokens_fields_are_checked_together() -> None:
    config = load_config(EXAMPLE)
    generate = config.endpoints["generate"]
    assert (generate.max_tokens_parameter, generate.max_tokens_default) == ("max_tokens", 16)
    assert generate.max_tokens_limit == 256
    bad = {
        "tiers": ["t"],
        "endpoints": {
            "no_default": {"max_tokens_parameter": "max_tokens"},
            "no_parameter": {"max_tokens_default": 16, "max_tokens_limit": 64},
            "over": {"max_tokens_parameter": "n", "max_tokens_default": 65, "max_tokens_limit": 64},
            "reserved": {"max_tokens_parameter": "fair_rows", "max_tokens_default": 1},
        },
        "default_endpoint": {"max_tokens_parameter": "priority", "max_tokens_default": 1},
    }
    with pytest.raises(ConfigError) as info:
        parse_config(bad)
    text = str(info.value)
    for expected in (
        "endpoints.no_default.max_tokens_default: required with max_tokens_parameter",
        "endpoints.no_parameter.max_tokens_default: needs max_tokens_parameter",
        "endpoints.no_parameter.max_tokens_limit: needs max_tokens_parameter",
        "endpoints.over.max_tokens_default: 65 exceeds max_tokens_limit (64)",
        "endpoints.reserved.max_tokens_parameter: 'fair_rows' is reserved",
        "default_endpoint.max_tokens_parameter: 'priority' is reserved",
    ):
        assert expected in text, expected


def test_lengths_fields_must_not_clash_in_fair_rows() -> None:
    def endpoint(**inputs: str) -> dict[str, object]:
        padding = {name: {"lengths_field": f} for name, f in inputs.items()}
        return {
            "max_tokens_parameter": "max_tokens",
            "max_tokens_default": 16,
            "padding": {"inputs": padding},
        }

    bad = {
        "tiers": ["t"],
        "endpoints": {
            "meta": endpoint(INPUT_IDS="tenant"),
            "count": endpoint(INPUT_IDS="max_tokens"),
            "twice": endpoint(A="length", B="length"),
        },
    }
    with pytest.raises(ConfigError) as info:
        parse_config(bad)
    text = str(info.value)
    assert "endpoints.meta.padding.inputs.INPUT_IDS.lengths_field: 'tenant' is already" in text
    assert "endpoints.count.padding.inputs.INPUT_IDS.lengths_field: 'max_tokens'" in text
    assert "endpoints.twice.padding.inputs.B.lengths_field: 'length' is also" in text


def test_fields_of_the_former_model_inputs_say_what_replaced_them() -> None:
    """Configs written for INPUT_LENGTHS / MAX_TOKENS inputs fail with the migration."""
    old = {
        "tiers": ["t"],
        "endpoints": {
            "generate": {
                "max_tokens_input": "MAX_TOKENS",
                "padding": {"inputs": {"INPUT_IDS": {"lengths_input": "INPUT_LENGTHS"}}},
            }
        },
    }
    with pytest.raises(ConfigError) as info:
        parse_config(old)
    text = str(info.value)
    assert "endpoints.generate.max_tokens_input: removed" in text
    assert "use max_tokens_parameter" in text
    assert "endpoints.generate.padding.inputs.INPUT_IDS.lengths_input: removed" in text
    assert "lengths_field" in text


def test_default_shells_follow_the_cpus_a_container_may_use(tmp_path: Path) -> None:
    """Affinity counts a node's cores; a cgroup quota (a container's CPU limit) bounds it."""
    from fair_frontend.server import usable_cpus

    affinity = usable_cpus(str(tmp_path / "absent"))
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # 1.5 CPUs: 2 may run at once
    assert usable_cpus(str(quota)) == min(affinity, 2)
    quota.write_text("max 100000\n")
    assert usable_cpus(str(quota)) == affinity


def test_engine_mode_fields_are_checked_together(tmp_path: Path) -> None:
    """reserved_slots and light_slots need max_inflight and must leave a slot; max_inflight and
    max_inflight_batches exclude each other; a tokenizer must exist, relative paths
    being from the config file's folder."""
    with pytest.raises(ConfigError) as info:
        parse_config(
            {
                "tiers": ["t"],
                "endpoints": {
                    "a": {"reserved_slots": 2},
                    "b": {"max_inflight": 4, "reserved_slots": 4},
                    "c": {"max_inflight": 4, "max_inflight_batches": 2},
                    "d": {"tokenizer": str(tmp_path / "missing.json")},
                    "f": {"light_slots": 1},
                    "g": {"max_inflight": 4, "light_slots": 5},
                },
            }
        )
    problems = "\n".join(info.value.problems)
    assert "endpoints.a.reserved_slots: needs max_inflight" in problems
    assert "endpoints.b.reserved_slots: 4 must be less than max_inflight (4)" in problems
    assert "endpoints.c: max_inflight" in problems and "exclude each other" in problems
    assert "endpoints.d.tokenizer: no such file" in problems
    assert "endpoints.f.light_slots: needs max_inflight" in problems
    assert "endpoints.g.light_slots: 5 must be less than max_inflight (4)" in problems
    (tmp_path / "tok.json").write_text("{}")
    config_file = tmp_path / "config.yaml"
    config_file.write_text("tiers: [t]\nendpoints:\n  e: {tokenizer: tok.json, max_inflight: 4}\n")
    assert load_config(config_file).endpoints["e"].tokenizer == str(tmp_path / "tok.json")


def test_model_access_lists_are_checked_with_every_problem_listed() -> None:
    bad = {
        "tiers": ["paid", "trial"],
        "tier_models": {
            "paid": ["*"],
            "trail": ["embed"],  # a typo: no such tier
            "trial": ["embed", "", " generate", "m" * 1025],
        },
        "tenants": {
            "a": {"tier": "trial", "models": ["embed"], "extra_models": ["llm"]},
            "b": {"tier": "trial", "extra_models": ["llm"], "denied_models": ["llm", "embed"]},
            "c": {"tier": "trial", "extra_models": ["llm"], "denied_models": ["*"]},
            "d": {"tier": "trial", "denied_models": [""], "models": "embed"},
        },
    }
    with pytest.raises(ConfigError) as info:
        parse_config(bad)
    text = str(info.value)
    for expected in (
        "tier_models.trail: unknown tier (tiers: ['paid', 'trial'])",
        "tier_models.trial[1]: empty model name",
        "tier_models.trial[2]: ' generate' has spaces around it",
        "tier_models.trial[3]: a model name is at most 1024 bytes",
        "tenants.a: models (instead of the tier's list) and extra_models (beside it) exclude",
        "tenants.b.denied_models: ['llm'] also opened by models or extra_models",
        "tenants.c.denied_models: '*' closes every model, but models or extra_models open",
        "tenants.d.denied_models[0]: empty model name",
        "tenants.d.models",  # a string, not a list
    ):
        assert expected in text, expected
    assert "m" * 1025 not in text


def test_model_access_names_need_no_endpoint_and_default_to_closed() -> None:
    """Triton may serve models the config does not name: a list may open them; and a
    config without tier_models is valid (every model closed)."""
    config = parse_config(
        {
            "tiers": ["t"],
            "tier_models": {"t": ["not_an_endpoint"]},
            "tenants": {"a": {"tier": "t", "extra_models": ["*"], "denied_models": ["x"]}},
        }
    )
    assert config.tier_models == {"t": ["not_an_endpoint"]}
    assert config.tenants["a"].models is None
    assert parse_config({"tiers": ["t"]}).tier_models == {}


def test_the_example_config_says_who_may_call_what() -> None:
    config = load_config(EXAMPLE)
    assert set(config.tier_models) == set(config.tiers)
    assert "llm" not in config.tier_models["trial"]


def test_the_doors_bounds_derive_from_the_queue_and_the_largest_request() -> None:
    """Unset, gRPC's calls at once follow the global queue cap (a call beyond it would be
    refused there) and HTTP's bodies read at once four of the largest request; set, the
    reading bound must fit that request, or it could never be read."""
    config = parse_config({"tiers": ["t"], "queues": {"max_queued": 500}})
    assert config.grpc_max_concurrent_calls() == 500 + 1000
    assert config.http_max_reading_bytes() == 4 * config.max_wire_bytes()
    largest = config.max_wire_bytes()
    exact = parse_config({"tiers": ["t"], "server": {"http_max_reading_bytes": largest}})
    assert exact.http_max_reading_bytes() == largest
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": ["t"], "server": {"http_max_reading_bytes": largest - 1}})
    assert "server.http_max_reading_bytes" in str(info.value)
    assert f"({largest} bytes)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": ["t"], "server": {"header_timeout_s": 0, "http_max_connections": 0}})
    assert "server.header_timeout_s" in str(info.value)
    assert "server.http_max_connections" in str(info.value)


def test_a_pool_of_tritons_from_the_config_or_repeated_urls() -> None:
    """``triton.backends`` lists the pool; a repeated --triton-url replaces it (keeping what
    the list says of a URL it names); without either, one Triton as before pools, the
    first URL with the section's http_url and metrics_url."""
    pooled = parse_config(
        {
            "tiers": ["t"],
            "triton": {
                "backends": [
                    {
                        "grpc_url": "a:8001",
                        "http_url": "http://a:8000",
                        "metrics_url": "http://a:8002/metrics",
                    },
                    {"grpc_url": "b:8001"},
                ]
            },
        }
    ).triton
    assert [b.grpc_url for b in pooled.pool()] == ["a:8001", "b:8001"]
    assert pooled.first_metrics_url() == "http://a:8002/metrics"
    chosen = pooled.pool(["b:8001", "a:8001", "c:8001"])
    assert [(b.grpc_url, b.http_url) for b in chosen] == [
        ("b:8001", None),
        ("a:8001", "http://a:8000"),
        ("c:8001", None),
    ]
    single = parse_config(
        {"tiers": ["t"], "triton": {"http_url": "http://h:8000", "metrics_url": "http://h:8002"}}
    ).triton
    (one,) = single.pool(["h:8001"])
    assert (one.grpc_url, one.http_url, one.metrics_url) == (
        "h:8001",
        "http://h:8000",
        "http://h:8002",
    )
    two = single.pool(["h:8001", "k:8001"])
    assert [(b.grpc_url, b.http_url) for b in two] == [
        ("h:8001", "http://h:8000"),
        ("k:8001", None),
    ]
    assert [b.grpc_url for b in single.pool()] == ["localhost:8001"]  # triton.url


def test_a_pool_names_each_url_once_and_in_one_place() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(
            {
                "tiers": ["t"],
                "triton": {
                    "metrics_url": "http://h:8002/metrics",
                    "backends": [{"grpc_url": "a:8001"}, {"grpc_url": "a:8001"}, {"grpc_url": " "}],
                },
            }
        )
    text = str(info.value)
    for expected in ("set them on each backend", "listed twice", "grpc_url: empty"):
        assert expected in text, text


def test_serve_needs_a_triton_url_or_backends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fair_frontend.cli import main

    path = tmp_path / "c.yaml"
    path.write_text("tiers: [t]\ntenants: {a: {tier: t, api_keys: [some-key]}}\n")
    # ``main`` sets the process's logging up as a command does: the root logger's handler
    # writes to this test's captured stderr, which is closed after it (later tests' lines,
    # a thread's among them, would go to a closed file): the suite's logging restored.
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        assert main(["serve", "--config", str(path)]) == 2
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert "--triton-url HOST:PORT (repeat it for a pool)" in capsys.readouterr().err


def test_a_repeated_triton_url_is_the_pool_the_server_serves_from() -> None:
    from fair_frontend.cli import build_parser
    from fair_frontend.server import FrontendServer, Listen

    args = build_parser().parse_args(
        ["serve", "--config", "c.yaml", "--triton-url", "a:8001", "--triton-url", "b:8001"]
    )
    assert args.triton_url == ["a:8001", "b:8001"]
    config = parse_config({"tiers": ["t"], "triton": {"http_url": "http://a:8000"}})
    server = FrontendServer(config, args.triton_url, Listen())
    assert server.triton_urls == ["a:8001", "b:8001"] and server.triton_url == "a:8001"
    assert [b.http_url for b in server.backends] == ["http://a:8000", None]
    assert FrontendServer(config, "a:8001", Listen()).triton_urls == ["a:8001"]  # as before


def test_an_endpoint_names_its_fairness_policy_and_an_unknown_name_lists_the_known() -> None:
    config = parse_config(
        {
            "tiers": ["t"],
            "endpoints": {
                "baseline": {"fairness": "fifo"},
                "llm": {"max_inflight": 8, "cost": "tokens"},
                "llm_drr": {"max_inflight": 8, "cost": "tokens", "fairness": "drr"},
                "engine": {"max_inflight": 8},
                "emb": {"cost": "tokens"},
            },
        }
    )
    policies = {name: ep.fairness_policy() for name, ep in config.endpoints.items()}
    # Unset: what it meant before the field existed (vtc for an engine in token cost).
    assert policies == {
        "baseline": "fifo",
        "llm": "vtc",
        "llm_drr": "drr",
        "engine": "drr",
        "emb": "drr",
    }
    assert config.default_endpoint.fairness_policy() == "drr"
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": ["t"], "endpoints": {"e": {"fairness": "wfq"}}})
    assert "endpoints.e.fairness: unknown fairness policy 'wfq' (known: drr, fifo, vtc)" in str(
        info.value
    )


def test_programs_per_tenant_reaches_the_schedulers_caps() -> None:
    """``queues.programs_per_tenant`` (issue 33: programs inside tenants) is what every
    scheduler's caps read, 64 unless set, at least 1."""
    assert global_caps(parse_config({"tiers": ["t"]}).queues).programs_per_tenant == 64
    config = parse_config({"tiers": ["t"], "queues": {"programs_per_tenant": 8}})
    caps = global_caps(config.queues)
    assert caps.programs_per_tenant == 8
    caps.programs_per_tenant = 3
    caps.configure(queue_limits(config.queues))  # a reload sets it again
    assert caps.programs_per_tenant == 8
    with pytest.raises(ConfigError, match="programs_per_tenant"):
        parse_config({"tiers": ["t"], "queues": {"programs_per_tenant": 0}})


def test_the_program_parameter_is_no_models_max_tokens_parameter() -> None:
    """The gateway takes ``program`` out of a request (its program, issue 33): a model's
    max_tokens cannot be read there."""
    bad = {
        "tiers": ["t"],
        "endpoints": {"e": {"max_tokens_parameter": "program", "max_tokens_default": 16}},
    }
    with pytest.raises(ConfigError, match="max_tokens_parameter: 'program' is reserved"):
        parse_config(bad)


def test_slo_classes_are_checked_with_every_problem_listed() -> None:
    """Each kind has its own targets; a tier's or tenant's class must be configured; the
    policy gets the targets in seconds, a tenant's own class before its tier's."""
    with pytest.raises(ConfigError) as info:
        parse_config(
            {
                "tiers": ["gold"],
                "slo_classes": {
                    "chat": {"kind": "interactive"},
                    "bulk": {"kind": "batch", "deadline_s": 60, "ttft_ms": 5},
                    "late": {"kind": "batch"},
                },
                "tier_slo_classes": {"gold": "platinum", "silver": "chat"},
                "tenants": {"a": {"tier": "gold", "slo_class": "zz"}},
            }
        )
    text = str(info.value)
    for says in (
        "slo_classes.chat: an interactive class needs ttft_ms",
        "slo_classes.bulk: ttft_ms and itl_ms are an interactive class's",
        "slo_classes.late: a batch class needs deadline_s",
        "tier_slo_classes.gold: unknown SLO class 'platinum'",
        "tier_slo_classes.silver: unknown tier",
        "tenants.a.slo_class: unknown SLO class 'zz'",
    ):
        assert says in text, text
    cfg = parse_config(
        {
            "tiers": ["gold", "free"],
            "slo_classes": {
                "chat": {"kind": "interactive", "ttft_ms": 500, "itl_ms": 40},
                "bulk": {"kind": "batch", "deadline_s": 600},
            },
            "tier_slo_classes": {"free": "bulk"},
            "tenants": {
                "g": {"tier": "gold"},
                "f": {"tier": "free"},
                "fc": {"tier": "free", "slo_class": "chat"},
            },
        }
    )
    chat = cfg.slo_classes_by_name()["chat"]
    assert chat.ttft_s == 0.5 and chat.itl_s == 0.04 and chat.interactive
    assert cfg.slo_classes_by_name()["bulk"].deadline_s == 600
    assert [cfg.slo_class_of(t) for t in ("g", "f", "fc", "nobody")] == [None, "bulk", "chat", None]
