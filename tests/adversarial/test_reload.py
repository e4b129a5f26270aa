"""A reload applies a change or says loudly that it did not (issue 11, item 9).

Before, a reload (SIGHUP) replaced the running config object but applied only tenants,
keys and limits: a new global queue cap, a new ``on_storage_error``, a ``tier_guard`` or
an endpoint's policy were silently ignored (or half-applied: the shells validated against
the new endpoints while the core scheduled with the old). Now the queue caps and the
storage-error mode apply at once, and every change that needs a restart is kept at its
running value, logged as an error and returned in the reload's notes.

Real stack: the session's Triton, the frontend, gRPC requests through tritonclient's
generated stub; Redis is an address where none listens (the storage is down).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import Config, ConfigError
from fair_frontend.kit.testing import free_port
from tests.support import (
    KEYS,
    KServe,
    Reply,
    RunningFrontend,
    config_dict,
    make_config,
    running_frontend,
)


async def reload(fe: RunningFrontend, config: Config) -> list[str]:
    """Reload on the frontend's loop, as SIGHUP does; the Triton section kept as running."""
    config = config.model_copy(update={"triton": fe.server.config.triton})

    async def apply() -> list[str]:
        notes: list[str] = fe.server.reload(config)
        return notes

    return list(await fe.acall(apply()))


async def infer(fe: RunningFrontend, tenant: str = "acme", tokens: int = 64) -> Reply:
    kserve = KServe()
    try:
        urls = (fe.grpc_url, fe.http_url)
        return await kserve.infer("grpc", urls, KEYS[tenant], "embed", 1, tokens)
    finally:
        await kserve.close()


async def test_a_new_global_byte_cap_applies_at_once(triton: EmbeddedTriton) -> None:
    with running_frontend(make_config(), triton) as fe:
        assert (await infer(fe)).ok
        tight = make_config(queues={"max_queued_bytes": 64})  # a 256-byte request exceeds it
        assert await reload(fe, tight) == []
        refused = await infer(fe)
        assert refused.code == "UNAVAILABLE", refused
        assert "Exceeds maximum queue size" in refused.message
        assert "max_queued_bytes=64" in refused.message
        assert await reload(fe, make_config()) == []
        assert (await infer(fe)).ok


async def test_a_new_storage_error_mode_applies_at_once(triton: EmbeddedTriton) -> None:
    nobody = f"redis://127.0.0.1:{free_port()}/0"  # no Redis listens there

    def limited(mode: str) -> Config:
        storage = {"storage": nobody, "on_storage_error": mode}
        limits = {"enterprise": {"embed": {"requests_per_minute": 1000}}}
        return make_config(rate_limiting=storage, tier_limits=limits)

    with running_frontend(limited("fail_open"), triton) as fe:
        assert (await infer(fe)).ok  # Redis is down: admitted unchecked
        assert await reload(fe, limited("fail_closed")) == []
        refused = await infer(fe)
        assert refused.code == "UNAVAILABLE", refused
        assert "rate-limit storage unavailable" in refused.message


def value_of(config: Config, key: str) -> Any:
    """A dotted key's value (``rate_limiting.storage``)."""
    value: Any = config
    for name in key.split("."):
        value = getattr(value, name)
    return value


RESTART_ONLY: list[tuple[str, dict[str, Any]]] = [
    ("tier_guard", {"tier_guard": {"min_share": {"trial": 0.1}}}),
    ("observability", {"observability": {"ema_alpha": 0.5}}),
    ("scheduling", {"scheduling": "fifo"}),
    ("rate_limiting.storage", {"rate_limiting": {"storage": "redis://127.0.0.1:1/0"}}),
]


@pytest.mark.parametrize(("key", "change"), RESTART_ONLY, ids=[k for k, _ in RESTART_ONLY])
async def test_a_change_that_needs_a_restart_is_kept_and_reported(
    triton: EmbeddedTriton, caplog: pytest.LogCaptureFixture, key: str, change: dict[str, Any]
) -> None:
    """The rest of the same reload (a new tenant) applies; the key is named in an error
    log line and in the notes, and the running config keeps its value."""
    with running_frontend(make_config(), triton) as fe:
        running = value_of(fe.frontend.config, key)
        data = config_dict(**change)
        data["tenants"]["newco"] = {"tier": "trial", "api_keys": ["newco-test-key"]}
        with caplog.at_level(logging.ERROR, logger="fair_frontend"):
            notes = await reload(fe, Config.model_validate(data))
        assert notes == [f"{key} changed: restart the frontend to apply"]
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any(key in line and "restart" in line for line in errors), errors
        assert value_of(fe.frontend.config, key) == running
        assert value_of(fe.server.config, key) == running  # what the shells are given
        kserve = KServe()
        try:
            reply = await kserve.infer(
                "grpc", (fe.grpc_url, fe.http_url), "newco-test-key", "embed", 1, 4
            )
        finally:
            await kserve.close()
        assert reply.ok, reply


async def test_a_live_change_that_does_not_fit_a_kept_value_refuses_the_reload(
    triton: EmbeddedTriton,
) -> None:
    """Fewer priority levels apply at once, but an endpoint's default_priority (kept
    until a restart) above them would leave an invalid config running: refused whole."""
    endpoints = config_dict()["endpoints"]
    endpoints["embed"]["default_priority"] = 8
    with running_frontend(make_config(endpoints=endpoints), triton) as fe:
        fewer = make_config(priority_levels=5)  # its endpoints set no default_priority
        with pytest.raises(ConfigError, match="exceeds priority_levels"):
            await reload(fe, fewer)
        assert fe.frontend.config.priority_levels == 10
        assert (await infer(fe)).ok
