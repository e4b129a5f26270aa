"""Who is the tenant? API keys, and the trusted-gateway mode. May it call this model?

Keys are held only as SHA-256 digests. A presented key is hashed and looked up by
digest, then confirmed with ``hmac.compare_digest``: the lookup's timing depends only
on the digest of what the caller sent, which tells an attacker nothing about stored
keys, and the confirming comparison is constant-time. Keys never appear in logs,
errors or metrics: errors say "unknown API key" without a hint whether it exists.

Headers: ``authorization: Bearer <key>`` or ``x-api-key: <key>``, any header-name case,
whitespace around the value stripped (perf_analyzer's ``-H`` does not trim). A request that
repeats an identity header, or sends two different keys, is refused (401): which one would
win depends on the parser (aiohttp's ``dict()`` keeps the last, a proxy may keep the first),
and an attacker could make a gateway check one and this frontend trust the other.

The trusted gateway (``auth.trusted_gateway``): without a key, a request may name its
tenant (``x-tenant-id`` or the ``tenant`` parameter) only with proof that it comes from the
gateway: the shared secret in ``x-gateway-secret`` (compared as a digest, constant-time),
a peer address in ``trusted_gateway_peers``, or both where both are configured. The peer
is the transport's (the TCP connection's), never a header a client writes
(``X-Forwarded-For`` is not read): the transports put it in the headers mapping under
``PEER_HEADER``, a name no client can send (``identity_headers``).

Model access (``ModelAccess``): a tenant may call the models its tier's ``tier_models``
list opens, or its own ``models`` list instead, plus its ``extra_models``, less its
``denied_models``; ``"*"`` opens (or closes) every model. Closed by default: a model no
list opens, one an operator adds to Triton included, is refused with 403 /
PERMISSION_DENIED naming it. The shells ask before any model lookup, body read or decode,
so a refused call costs no more than its headers, and the answer is the same whether or
not Triton has the model (no existence oracle).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from fair_frontend.config import ALL_MODELS, SHA256_PREFIX, Auth, Config, ConfigError
from fair_frontend.errors import PermissionDenied, Unauthenticated
from fair_frontend.protocol import MAX_NAME_BYTES, clipped

TENANT_HEADER = "x-tenant-id"
GATEWAY_SECRET_HEADER = "x-gateway-secret"
# Set by the transports, never by a client: HTTP/1.1 header names and gRPC metadata keys
# cannot start with ':' (HTTP/2's pseudo-headers never reach the handlers).
PEER_HEADER = ":peer"  # the connection's remote address
REPEATED_HEADER = ":repeated"  # identity headers the request sent more than once
IDENTITY_HEADERS = frozenset({"authorization", "x-api-key", TENANT_HEADER, GATEWAY_SECRET_HEADER})
MISSING_KEY = "missing API key: send 'authorization: Bearer <key>' or 'x-api-key: <key>'"
UNPROVEN_GATEWAY = (
    "missing API key: a tenant named without a key is trusted only from the configured "
    "gateway, and this request does not come from it"
)

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


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
        d = hashlib.sha256(_raw(key)).digest()
        for stored, tenant in self._index.get(d[:8], ()):
            if hmac.compare_digest(stored, d):
                return tenant
        return None


def identity_headers(pairs: Iterable[tuple[str, str]], peer: str | None) -> dict[str, str]:
    """The headers mapping ``Authenticator`` reads, from a transport's (name, value) pairs
    (HTTP headers, gRPC metadata, both of which may repeat a name) and the connection's
    peer address. Names are lower-cased; a repeated identity header is recorded under
    ``REPEATED_HEADER`` (``identify`` refuses it) instead of one copy silently winning."""
    out: dict[str, str] = {}
    repeated: set[str] = set()
    for name, value in pairs:
        key = name.lower()
        if key.startswith(":"):
            continue  # only the transport says what the pseudo-headers hold
        if key in out and key in IDENTITY_HEADERS:
            repeated.add(key)
        out[key] = value
    if repeated:
        out[REPEATED_HEADER] = ", ".join(sorted(repeated))
    if peer:
        out[PEER_HEADER] = peer
    return out


def grpc_peer_address(peer: str | None) -> str | None:
    """The IP address in a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, either
    possibly percent-encoded), or None for another kind (``unix:``)."""
    if not peer:
        return None
    kind, _, rest = unquote(peer).partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or None
    if kind == "ipv6":
        host = rest.rpartition(":")[0] if rest.startswith("[") else rest
        return host.strip("[]") or None
    return None


def _raw(value: str) -> bytes:
    """A header value's bytes: any str encodes (a client's undecodable bytes arrive as
    surrogates, which a plain ``encode()`` refuses with an exception, a 500)."""
    return value.encode("utf-8", "surrogatepass")


def _bearer(value: str) -> str:
    scheme, _, key = value.strip().partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    return ""  # present but malformed: treated as an unknown key


def extract_key(headers: Mapping[str, str]) -> str | None:
    """The API key from lower-cased headers / gRPC metadata, or None. Raises
    ``Unauthenticated`` when ``authorization`` and ``x-api-key`` carry different keys."""
    auth = headers.get("authorization")
    api_key = headers.get("x-api-key")
    key = _bearer(auth) if auth is not None else None
    other = api_key.strip() if api_key is not None else None
    if key is not None and other is not None and not hmac.compare_digest(_raw(key), _raw(other)):
        raise Unauthenticated(
            "ambiguous identity: 'authorization' and 'x-api-key' carry different keys; send one key"
        )
    return key if key is not None else other


@dataclass(frozen=True)
class GatewayTrust:
    """Does this request come from the trusted gateway?

    Proof is what ``auth`` configures: the shared secret (held as its SHA-256 digest, so
    the comparison's time says nothing of it), the peer networks, or both (then both must
    hold). The peer is the transport's, under ``PEER_HEADER``.
    """

    secret_digest: bytes | None
    networks: tuple[IpNetwork, ...]

    @classmethod
    def from_config(
        cls, auth: Auth, environ: Mapping[str, str] | None = None
    ) -> GatewayTrust | None:
        """The trust ``auth`` describes; None where the trusted gateway is off. Raises
        ``ConfigError`` when neither proof is configured or the secret cannot be read
        (``Config`` validation reports the same up front)."""
        if not auth.trusted_gateway:
            return None
        env = os.environ if environ is None else environ
        secret = auth.trusted_gateway_secret
        if auth.trusted_gateway_secret_env:
            secret = env.get(auth.trusted_gateway_secret_env)
            if not secret:
                raise ConfigError(
                    "(auth)",
                    [
                        f"auth.trusted_gateway_secret_env: variable "
                        f"{auth.trusted_gateway_secret_env} is not set"
                    ],
                )
        networks = tuple(ipaddress.ip_network(p, strict=False) for p in auth.trusted_gateway_peers)
        if secret is None and not networks:
            raise ConfigError("(auth)", ["auth.trusted_gateway: needs a secret or peers"])
        return cls(digest_of(secret) if secret is not None else None, networks)

    def vouches_for(self, headers: Mapping[str, str]) -> bool:
        if self.networks and not self._peer_allowed(headers.get(PEER_HEADER)):
            return False
        if self.secret_digest is None:
            return True
        presented = headers.get(GATEWAY_SECRET_HEADER)
        if presented is None:
            return False
        digest = hashlib.sha256(_raw(presented.strip())).digest()
        return hmac.compare_digest(digest, self.secret_digest)

    def _peer_allowed(self, peer: str | None) -> bool:
        if not peer:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a dual-stack listener reports ::ffff:a.b.c.d
        return any(address in network for network in self.networks)


@dataclass(frozen=True, slots=True)
class Identity:
    """A tenant as ``by`` found it from a request's headers (once per request, once per
    stream): good for the request's body and a stream's messages while ``by`` is the
    authenticator in force (a reload makes a new one, and the headers are read again)."""

    tenant: str
    by: Authenticator


class Authenticator:
    """Who is the tenant of this request?"""

    def __init__(
        self, keyring: KeyRing, tenants: set[str], *, gateway: GatewayTrust | None = None
    ) -> None:
        self.keyring = keyring
        self.tenants = tenants
        self.gateway = gateway

    @classmethod
    def from_config(cls, config: Config, keyring: KeyRing) -> Authenticator:
        return cls(keyring, set(config.tenants), gateway=GatewayTrust.from_config(config.auth))

    def identify_by_headers(self, headers: Mapping[str, str]) -> str | None:
        """The tenant, as far as the headers alone tell (before a body is read or decoded):
        raises what ``identify`` would raise for these headers whatever the body says; None
        when only the body can tell (a trusted gateway's ``tenant`` parameter). A tenant
        the gateway names in ``x-tenant-id`` is known or not whatever the body says."""
        _refuse_repeated(headers)
        gateway = self.gateway
        if (
            extract_key(headers) is None
            and TENANT_HEADER not in headers
            and gateway is not None
            and gateway.vouches_for(headers)
        ):
            return None  # the gateway names the tenant in the body, if at all
        return self.identify(headers, None)

    def confirm(
        self, known: Identity | None, headers: Mapping[str, str], tenant_claim: str | None
    ) -> str:
        """``identify``, without reading the headers again where they were read already
        (``known``, by this authenticator): only the body's claim is left to check."""
        claim_agrees = known is not None and (
            tenant_claim is None or tenant_claim.strip() == known.tenant
        )
        if known is not None and known.by is self and claim_agrees:
            return known.tenant
        return self.identify(headers, tenant_claim)

    def identify(self, headers: Mapping[str, str], tenant_claim: str | None) -> str:
        """The tenant, or raise Unauthenticated (401) / PermissionDenied (403).

        ``tenant_claim`` is the request's ``tenant`` parameter; ``x-tenant-id`` is read
        from the headers. With a key, a claim naming another tenant is refused. Without
        a key, a claim is honoured only from a trusted gateway.
        """
        _refuse_repeated(headers)
        header_claim = headers.get(TENANT_HEADER)
        claims = {c.strip() for c in (header_claim, tenant_claim) if c is not None}
        key = extract_key(headers)
        if key is not None:
            tenant = self.keyring.tenant_for(key) if key else None
            if tenant is None:
                raise Unauthenticated("unknown API key")
            if claims - {tenant}:
                # The claims are the client's strings: echoed cut (a tenant parameter is
                # as long as the body lets it be).
                named = ", ".join(clipped(c, MAX_NAME_BYTES) for c in sorted(claims - {tenant}))
                raise PermissionDenied(
                    f"the API key does not belong to the tenant the request names ({named})"
                )
            return tenant
        if self.gateway is not None and claims:
            if not self.gateway.vouches_for(headers):
                raise Unauthenticated(UNPROVEN_GATEWAY)
            if len(claims) > 1:
                raise PermissionDenied("x-tenant-id and the tenant parameter disagree")
            (tenant,) = claims
            if tenant not in self.tenants:
                raise Unauthenticated("unknown tenant")
            return tenant
        raise Unauthenticated(MISSING_KEY)


def _refuse_repeated(headers: Mapping[str, str]) -> None:
    repeated = headers.get(REPEATED_HEADER)
    if repeated:
        raise Unauthenticated(
            f"ambiguous identity: the request repeats {repeated}; send each identity header once"
        )


@dataclass(frozen=True, slots=True)
class ModelGrant:
    """The models one tenant may call: ``opened`` (or every model, ``every``), less
    ``denied`` (or none at all, ``none``)."""

    opened: frozenset[str]
    every: bool
    denied: frozenset[str]
    none: bool

    def allows(self, model: str) -> bool:
        if self.none or model in self.denied:
            return False
        return self.every or model in self.opened


class ModelAccess:
    """May this tenant call this model?

    Resolved once per (re)loaded config from ``tier_models`` and each tenant's
    ``models`` / ``extra_models`` / ``denied_models``: a tenant the config does not name
    may call nothing.
    """

    def __init__(self, grants: Mapping[str, ModelGrant]) -> None:
        self._grants = dict(grants)

    @classmethod
    def from_config(cls, config: Config) -> ModelAccess:
        grants = {}
        for name, tenant in config.tenants.items():
            base = tenant.models
            if base is None:
                base = config.tier_models.get(tenant.tier, [])
            opened = {*base, *tenant.extra_models}
            denied = set(tenant.denied_models)
            grants[name] = ModelGrant(
                opened=frozenset(opened - {ALL_MODELS}),
                every=ALL_MODELS in opened,
                denied=frozenset(denied - {ALL_MODELS}),
                none=ALL_MODELS in denied,
            )
        return cls(grants)

    def allows(self, tenant: str, model: str) -> bool:
        grant = self._grants.get(tenant)
        return grant is not None and grant.allows(model)

    def opens_beyond(self, tenant: str, names: Collection[str]) -> bool:
        """Whether ``tenant`` may call some model not among ``names`` (every model, or
        one its lists name): what bounds the bodies it may send (``shell.door``)."""
        grant = self._grants.get(tenant)
        if grant is None or grant.none:
            return False
        return grant.every or bool(grant.opened - grant.denied - set(names))

    def closed_tenants(self) -> list[str]:
        """The tenants that may call no model at all (a config from before model access,
        without ``tier_models``, closes every one)."""
        return sorted(
            name
            for name, grant in self._grants.items()
            if grant.none or not (grant.every or grant.opened - grant.denied)
        )

    def check(self, tenant: str, model: str) -> None:
        """Raise ``PermissionDenied`` (403) naming the model unless ``tenant`` may call
        it. ``model`` has passed its length check (``check_name``): it is echoed whole."""
        if not self.allows(tenant, model):
            raise PermissionDenied(f"tenant '{tenant}' may not use model '{model}'")
