"""Who is the tenant? API keys, and the trusted-gateway mode.

Keys are held only as SHA-256 digests. A presented key is hashed and looked up by
digest, then confirmed with ``hmac.compare_digest``: the lookup's timing depends only
on the digest of what the caller sent, which tells an attacker nothing about stored
keys, and the confirming comparison is constant-time. Keys never appear in logs,
errors or metrics: errors say "unknown API key" without a hint whether it exists.

Headers: ``authorization: Bearer <key>`` or ``x-api-key: <key>``, any header-name case,
whitespace around the value stripped (perf_analyzer's ``-H`` does not trim).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from pathlib import Path

from fair_frontend.config import SHA256_PREFIX, Config, ConfigError
from fair_frontend.errors import PermissionDenied, Unauthenticated

TENANT_HEADER = "x-tenant-id"
MISSING_KEY = "missing API key: send 'authorization: Bearer <key>' or 'x-api-key: <key>'"


def digest_of(stored: str) -> bytes:
    """The SHA-256 digest a configured key entry stands for ("sha256:<hex>" or plain)."""
    stored = stored.strip()
    if stored.startswith(SHA256_PREFIX):
        return bytes.fromhex(stored[len(SHA256_PREFIX) :])
    return hashlib.sha256(stored.encode()).digest()


def hash_key(key: str) -> str:
    """The config form of a key: ``sha256:<hex>`` (``fair-frontend hash-key`` prints it)."""
    return SHA256_PREFIX + hashlib.sha256(key.encode()).hexdigest()


class KeyRing:
    """Which tenant does this API key belong to?

    Indexed by the first 8 bytes of each digest (the "selector"); the full digest is
    then confirmed with ``hmac.compare_digest`` (the "verifier"), so no comparison of
    secret material exits early.
    """

    def __init__(self, digests: Mapping[bytes, str]) -> None:
        self._index: dict[bytes, list[tuple[bytes, str]]] = {}
        for d, tenant in digests.items():
            self._index.setdefault(d[:8], []).append((d, tenant))
        self.size = len(digests)

    @classmethod
    def from_config(cls, config: Config, environ: Mapping[str, str] | None = None) -> KeyRing:
        """Collect every tenant's keys: inline, from its key file and from its env variable."""
        env = os.environ if environ is None else environ
        digests: dict[bytes, str] = {}
        problems: list[str] = []
        for name, tenant in config.tenants.items():
            entries = list(tenant.api_keys)
            if tenant.api_keys_file:
                try:
                    lines = Path(tenant.api_keys_file).read_text().splitlines()
                except OSError as err:
                    problems.append(f"tenants.{name}.api_keys_file: cannot read: {err.strerror}")
                    lines = []
                entries += [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
            if tenant.api_keys_env:
                value = env.get(tenant.api_keys_env)
                if value is None:
                    problems.append(
                        f"tenants.{name}.api_keys_env: variable {tenant.api_keys_env} is not set"
                    )
                else:
                    entries += [k for k in value.split(",") if k.strip()]
            for entry in entries:
                try:
                    d = digest_of(entry)
                except ValueError:
                    problems.append(f"tenants.{name}: a key entry is not valid 'sha256:<hex>'")
                    continue
                other = digests.setdefault(d, name)
                if other != name:
                    problems.append(f"tenants.{name}: a key is also given to tenant {other!r}")
        if problems:
            raise ConfigError("(API keys)", problems)
        return cls(digests)

    def digests(self) -> dict[bytes, str]:
        """Every stored digest and its tenant (to hand the keyring to a shell process)."""
        return {d: tenant for entries in self._index.values() for d, tenant in entries}

    def tenant_for(self, key: str) -> str | None:
        d = hashlib.sha256(key.encode()).digest()
        for stored, tenant in self._index.get(d[:8], ()):
            if hmac.compare_digest(stored, d):
                return tenant
        return None


def extract_key(headers: Mapping[str, str]) -> str | None:
    """The API key from lower-cased headers / gRPC metadata, or None."""
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return ""  # present but malformed: treated as an unknown key
    key = headers.get("x-api-key")
    if key is not None:
        return key.strip()
    return None


class Authenticator:
    """Who is the tenant of this request?"""

    def __init__(self, keyring: KeyRing, tenants: set[str], *, trusted_gateway: bool) -> None:
        self.keyring = keyring
        self.tenants = tenants
        self.trusted_gateway = trusted_gateway

    def identify_by_headers(self, headers: Mapping[str, str]) -> str | None:
        """The tenant, as far as the headers alone tell (before a body is read or decoded):
        raises what ``identify`` would raise for these headers whatever the body says; None
        when only the body can tell (a trusted gateway's ``tenant`` parameter)."""
        if extract_key(headers) is None and self.trusted_gateway:
            return None  # the gateway may name the tenant in the body too
        return self.identify(headers, None)

    def identify(self, headers: Mapping[str, str], tenant_claim: str | None) -> str:
        """The tenant, or raise Unauthenticated (401) / PermissionDenied (403).

        ``tenant_claim`` is the request's ``tenant`` parameter; ``x-tenant-id`` is read
        from the headers. With a key, a claim naming another tenant is refused. Without
        a key, a claim is honoured only from a trusted gateway.
        """
        header_claim = headers.get(TENANT_HEADER)
        claims = {c.strip() for c in (header_claim, tenant_claim) if c is not None}
        key = extract_key(headers)
        if key is not None:
            tenant = self.keyring.tenant_for(key) if key else None
            if tenant is None:
                raise Unauthenticated("unknown API key")
            if claims - {tenant}:
                raise PermissionDenied(
                    f"the API key does not belong to the tenant the request names "
                    f"({', '.join(sorted(claims - {tenant}))})"
                )
            return tenant
        if self.trusted_gateway and claims:
            if len(claims) > 1:
                raise PermissionDenied("x-tenant-id and the tenant parameter disagree")
            (tenant,) = claims
            if tenant not in self.tenants:
                raise Unauthenticated("unknown tenant")
            return tenant
        raise Unauthenticated(MISSING_KEY)
