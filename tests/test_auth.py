"""Tenant identity: keys, headers, spoofing, the trusted gateway; model access."""

from __future__ import annotations

from typing import Any

import pytest

from fair_frontend.auth import (
    PEER_HEADER,
    Authenticator,
    Identity,
    KeyRing,
    ModelAccess,
    extract_key,
    hash_key,
)
from fair_frontend.config import ConfigError, parse_config
from fair_frontend.errors import PermissionDenied, Unauthenticated
from fair_frontend.protocol import MAX_NAME_BYTES

CONFIG = {
    "tiers": ["paid", "trial"],
    "tenants": {
        "acme": {"tier": "paid", "api_keys": ["acme-key"]},
        "globex": {"tier": "paid", "api_keys": [hash_key("globex-key")]},
        "initech": {"tier": "trial", "api_keys_env": "INITECH_KEYS"},
    },
}


GATEWAY = {"trusted_gateway": True, "trusted_gateway_peers": ["10.0.0.0/8"]}
FROM_GATEWAY = {PEER_HEADER: "10.1.2.3"}  # what a transport adds for the gateway's connection


def authenticator(trusted: bool = False) -> Authenticator:
    config = parse_config({**CONFIG, "auth": GATEWAY if trusted else {}})
    ring = KeyRing.from_config(config, environ={"INITECH_KEYS": "k1, k2"})
    return Authenticator.from_config(config, ring)


@pytest.mark.parametrize(
    ("headers", "tenant"),
    [
        ({"authorization": "Bearer acme-key"}, "acme"),
        ({"authorization": "  bearer   acme-key  "}, "acme"),  # perf_analyzer's -H keeps spaces
        ({"x-api-key": " globex-key"}, "globex"),  # stored hashed
        ({"x-api-key": "k2"}, "initech"),  # from the environment
    ],
)
def test_keys_identify_tenants(headers: dict[str, str], tenant: str) -> None:
    assert authenticator().identify(headers, None) == tenant


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer nope"}, {"authorization": "Basic acme-key"}, {"x-api-key": ""}],
)
def test_missing_or_unknown_keys_are_unauthenticated(headers: dict[str, str]) -> None:
    with pytest.raises(Unauthenticated) as info:
        authenticator().identify(headers, None)
    assert "acme-key" not in info.value.message


def test_a_key_cannot_claim_another_tenant() -> None:
    auth = authenticator()
    with pytest.raises(PermissionDenied):
        auth.identify({"x-api-key": "acme-key"}, "globex")
    with pytest.raises(PermissionDenied):
        auth.identify({"x-api-key": "acme-key", "x-tenant-id": "globex"}, None)
    # Naming itself is fine.
    assert auth.identify({"x-api-key": "acme-key", "x-tenant-id": "acme"}, "acme") == "acme"


class CountingKeys(dict[str, str]):
    """Headers that count how often identity reads them."""

    reads = 0

    def get(self, key: str, default: Any = None) -> Any:
        self.reads += 1
        return super().get(key, default)


def test_headers_read_once_stand_for_the_body_and_a_streams_messages() -> None:
    """The transport identifies a request (or a stream) from its headers once; the body's
    claim is the only thing left to check, and only the authenticator that read them
    vouches for them: after a reload (a new one) the headers are read again."""
    auth = authenticator()
    headers = CountingKeys({"authorization": "Bearer acme-key"})
    known = Identity(auth.identify(headers, None), auth)
    reads = headers.reads
    assert auth.confirm(known, headers, None) == "acme"
    assert auth.confirm(known, headers, " acme") == "acme"
    assert headers.reads == reads  # neither read the headers (nor hashed the key) again
    with pytest.raises(PermissionDenied):  # the body naming another tenant: as identify
        auth.confirm(known, headers, "globex")
    reloaded = authenticator()
    assert reloaded.confirm(known, headers, None) == "acme"
    assert headers.reads > reads  # a new authenticator reads them itself
    revoked = Authenticator(KeyRing({}), {"acme"})
    with pytest.raises(Unauthenticated):  # a key a reload revoked stops a stream's next
        revoked.confirm(known, headers, None)


def test_claims_are_ignored_without_a_trusted_gateway() -> None:
    with pytest.raises(Unauthenticated):
        authenticator().identify({"x-tenant-id": "acme"}, None)


def test_trusted_gateway_names_the_tenant() -> None:
    auth = authenticator(trusted=True)
    assert auth.identify({"x-tenant-id": "acme", **FROM_GATEWAY}, None) == "acme"
    assert auth.identify(FROM_GATEWAY, "globex") == "globex"
    with pytest.raises(Unauthenticated):
        auth.identify({"x-tenant-id": "nobody", **FROM_GATEWAY}, None)
    with pytest.raises(PermissionDenied):
        auth.identify({"x-tenant-id": "acme", **FROM_GATEWAY}, "globex")


def test_extract_key_reads_either_header_but_not_two_keys() -> None:
    assert extract_key({"authorization": "Bearer a", "x-api-key": "a"}) == "a"
    assert extract_key({"x-api-key": "b"}) == "b"
    assert extract_key({}) is None
    with pytest.raises(Unauthenticated):
        extract_key({"authorization": "Bearer a", "x-api-key": "b"})


def test_key_sources_report_problems_without_secrets(tmp_path: object) -> None:
    config = parse_config(
        {
            "tiers": ["t"],
            "tenants": {
                "a": {"tier": "t", "api_keys_file": "/nonexistent/keys", "api_keys_env": "NOPE"},
                "b": {"tier": "t", "api_keys": ["same"]},
                "c": {"tier": "t", "api_keys_env": "C_KEYS"},
            },
        }
    )
    with pytest.raises(ConfigError) as info:
        KeyRing.from_config(config, environ={"C_KEYS": "same"})
    text = str(info.value)
    assert "api_keys_file: cannot read" in text
    assert "NOPE is not set" in text
    assert "also given to tenant 'b'" in text
    assert "same" not in text.replace("the same", "")


def test_keys_file(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# rotated 2026-11\nfile-key-1\n" + hash_key("file-key-2") + "\n\n")
    config = parse_config(
        {"tiers": ["t"], "tenants": {"a": {"tier": "t", "api_keys_file": str(keys)}}}
    )
    ring = KeyRing.from_config(config, environ={})
    assert ring.tenant_for("file-key-1") == "a"
    assert ring.tenant_for("file-key-2") == "a"
    assert ring.tenant_for("# rotated 2026-11") is None


# ---- model access -----------------------------------------------------------------------------

ACCESS = {
    "tiers": ["paid", "standard", "trial", "closed"],
    "tier_models": {
        "paid": ["*"],
        "standard": ["embed", "generate"],
        "trial": ["embed"],
        # "closed" has no entry: its tenants may call nothing.
    },
    "tenants": {
        "acme": {"tier": "paid"},
        "initech": {"tier": "standard"},
        "umbrella": {"tier": "trial"},
        "hooli": {"tier": "standard", "extra_models": ["llm"]},  # widens its tier's list
        "pied": {"tier": "standard", "denied_models": ["generate"]},  # narrows it
        "globex": {"tier": "paid", "models": ["embed"]},  # replaces it: narrower
        "soylent": {"tier": "trial", "models": ["*"], "denied_models": ["llm"]},
        "suspended": {"tier": "paid", "denied_models": ["*"]},
        "cyberdyne": {"tier": "closed"},
    },
}
MODELS = ("embed", "generate", "llm", "added_later")
ALLOWED = {
    "acme": {"embed", "generate", "llm", "added_later"},
    "initech": {"embed", "generate"},
    "umbrella": {"embed"},
    "hooli": {"embed", "generate", "llm"},
    "pied": {"embed"},
    "globex": {"embed"},
    "soylent": {"embed", "generate", "added_later"},
    "suspended": set(),
    "cyberdyne": set(),
}


def test_each_tenant_may_call_what_its_tier_and_its_own_entry_open() -> None:
    access = ModelAccess.from_config(parse_config(ACCESS))
    for tenant, allowed in ALLOWED.items():
        assert {m for m in MODELS if access.allows(tenant, m)} == allowed, tenant
    assert not access.allows("nobody", "embed")  # a tenant the config does not name


def test_a_refusal_is_permission_denied_naming_tenant_and_model() -> None:
    access = ModelAccess.from_config(parse_config(ACCESS))
    access.check("umbrella", "embed")
    with pytest.raises(PermissionDenied) as info:
        access.check("umbrella", "generate")
    assert info.value.message == "tenant 'umbrella' may not use model 'generate'"
    assert info.value.http_status == 403


def test_model_access_is_closed_by_default() -> None:
    """No tier_models at all: every model refused, whatever Triton serves."""
    access = ModelAccess.from_config(parse_config({**ACCESS, "tier_models": {}}))
    assert not any(access.allows(t, m) for t in ("acme", "initech") for m in MODELS)


def test_a_long_tenant_claim_is_echoed_cut() -> None:
    claim = "x" * 100_000
    with pytest.raises(PermissionDenied) as info:
        authenticator().identify({"x-api-key": "acme-key"}, claim)
    assert len(info.value.message) < 2 * MAX_NAME_BYTES
    assert "100000 characters" in info.value.message
