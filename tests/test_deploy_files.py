"""The deployment files in ``docker/`` against the real frontend and Triton.

No Docker engine runs here, so the images are not built; what can be checked is: every
YAML and JSON file parses; the metric names (and the labels they are filtered and
grouped by) in the Grafana dashboard and the Prometheus rules exist on a live frontend's
and Triton's metrics pages after some traffic; the Kubernetes probes and the compose
health checks point at endpoints that answer 200; the ports agree with the CLI defaults
everywhere; the secrets are wired to the config's ``api_keys_file`` / ``api_keys_env``;
the commands in the Dockerfiles, compose and the manifests parse with the real CLI; the
serve image's dependency set (no torch, no nvidia-pytriton) is enough to run ``serve``.

Locked down: no key, hash or password ships anywhere under ``docker/`` (the manifests
render only with secrets the operator makes: the tests make their own); the rendered
manifests are valid Kubernetes objects (``kubernetes-validate``); every pod runs non-root
on a read-only root filesystem without privileges; the NetworkPolicies, evaluated over
the rendered objects, let only the frontends reach Triton and Redis and only Prometheus
the metrics; the Redis start script (the same in compose and Kubernetes) makes a real
``redis-server`` require the Secret's password, which the frontend reads from its file.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from fair_frontend.auth import KeyRing, hash_key
from fair_frontend.cli import DEMO_KEYS as CLI_DEMO_KEYS
from fair_frontend.cli import _listen, build_parser, is_example_config
from fair_frontend.config import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_METRICS_PORT,
    Config,
    load_config,
)
from fair_frontend.core.plan import rate_limiter
from fair_frontend.embedded import EmbeddedTriton, free_port
from fair_frontend.testing import fetch
from tests.support import ROOT, config_dict, ids_input, make_config, running_frontend

DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "fair_frontend.json"
RULES = DOCKER / "prometheus" / "rules.yml"
PROMETHEUS = DOCKER / "prometheus" / "prometheus.yml"
COMPOSE = DOCKER / "docker-compose.yaml"
CONFIG = DOCKER / "config.yaml"
# The example config's published demo keys, by tenant: never in a deployment file.
DEMO_KEYS = {t: f"{t}-demo-key" for t in ("acme", "globex", "initech", "umbrella")}
# Where the operator's own secrets go (git ignores them): never read by these tests.
SECRET_FOLDERS = (DOCKER / "secrets", K8S / "secrets")
# Series Prometheus makes itself, not any exporter.
SYNTHETIC = {"up"}
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_objects() -> list[dict[str, Any]]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml_docs(path)]


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    found = [o for o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name)
    return found[0]


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def http_status(url: str) -> int:
    try:
        with _HTTP.open(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


# ---- the operator's secrets, made here: nothing ships with the files ---------------------


@dataclass
class Secrets:
    """Keys and a Redis password of the test's own, as an operator makes them (the keys
    stored hashed, as docker/k8s/secrets/README.md says)."""

    keys: dict[str, str] = field(
        default_factory=lambda: {t: secrets.token_hex(16) for t in DEMO_KEYS}
    )
    redis_password: str = field(default_factory=lambda: secrets.token_hex(32))

    def write_k8s(self, folder: Path) -> None:
        folder.mkdir(exist_ok=True)
        for tenant, key in self.keys.items():
            (folder / f"{tenant}.keys").write_text(hash_key(key) + "\n")
        (folder / "redis.password").write_text(self.redis_password + "\n")


@dataclass
class Rendered:
    """``kubectl kustomize`` of docker/k8s with the test's secrets."""

    objects: list[dict[str, Any]]
    secrets: Secrets

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in self.objects])
        return found[0]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def secret(self, prefix: str) -> dict[str, Any]:
        """A generated Secret (its name carries kustomize's content hash)."""
        (found,) = [
            o
            for o in self.of_kind("Secret")
            if re.fullmatch(rf"{re.escape(prefix)}-[a-z0-9]+", o["metadata"]["name"])
        ]
        return found


def _copy_k8s(to: Path) -> Path:
    """docker/k8s without anything an operator may have put in its secrets folder."""
    folder = to / "k8s"
    shutil.copytree(K8S, folder, ignore=shutil.ignore_patterns("*.keys", "*.password"))
    return folder


def kustomize(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    made = Secrets()
    folder = _copy_k8s(tmp_path_factory.mktemp("k8s"))
    made.write_k8s(folder / "secrets")
    out = kustomize(folder)
    assert out.returncode == 0, out.stderr
    return Rendered([d for d in yaml.safe_load_all(out.stdout) if d], made)


_INTERPOLATION = re.compile(r"\$\{(\w+)(:?[?-])([^}]*)\}")


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?message}`` (``$$`` is a
    literal ``$``); an unset or empty ``:?`` variable raises with its message, as compose
    stops with it."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.groups()
        value = env.get(name, "")
        if op.endswith("?") and not value:
            raise LookupError(f"{name}: {arg}")
        return value or (arg if op.endswith("-") else "")

    return _INTERPOLATION.sub(one, value.replace("$$", "\0")).replace("\0", "$")


# ---- PromQL: which metrics and labels an expression uses ---------------------------------

_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
_STRING = r'"(?:[^"\\]|\\.)*"'
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}")
_MATCHER = re.compile(rf"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*{_STRING}")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def promql_names(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """``({metric: labels its selectors match on}, labels used to group or match)``.

    Enough of PromQL for dashboards and rules: selectors with matchers, ranges,
    aggregations with ``by`` / ``without``, vector matching with ``on`` / ``ignoring`` /
    ``group_left``, functions, numbers, Grafana's ``$variables``.
    """
    expr = re.sub(r"\$\{?\w+\}?", "x", expr)  # Grafana variables: $__rate_interval, $endpoint
    metrics: dict[str, set[str]] = {}
    for m in _SELECTOR.finditer(expr):
        labels = {lm.group(1) for lm in _MATCHER.finditer(m.group(2))}
        if m.group(1):
            metrics.setdefault(m.group(1), set()).update(labels)
    rest = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", expr)
    rest = re.sub(_STRING, " ", rest)
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # ranges, subqueries
    grouping: set[str] = set()
    for m in _GROUPING.finditer(rest):
        grouping.update(x.strip() for x in m.group(2).split(",") if x.strip())
    rest = _GROUPING.sub(" ", rest)
    rest = re.sub(r"(?<![A-Za-z_:])\d+(?:\.\d+)?(?:e[+-]?\d+)?", " ", rest)  # numbers
    for m in _IDENT.finditer(rest):
        name = m.group(0)
        is_call = rest[m.end() :].lstrip().startswith("(")
        if not is_call and name not in _KEYWORDS:
            metrics.setdefault(name, set())
    return metrics, grouping


def test_promql_names_finds_metrics_labels_and_typos() -> None:
    metrics, grouping = promql_names(
        'sum by (tenant) (rate(fair_served_tokens_total{endpoint=~"$endpoint"}'
        "[$__rate_interval]))\n  / ignoring (tenant) group_left\n"
        'sum(rate(fiar_typo_total{outcome!="dispatched", tier="a"}[5m])) / 1e6 > bool 0.5'
    )
    assert metrics == {
        "fair_served_tokens_total": {"endpoint"},
        "fiar_typo_total": {"outcome", "tier"},
    }
    assert grouping == {"tenant"}
    metrics, grouping = promql_names(
        "histogram_quantile(0.99, sum by (tier, le) (rate(fair_queue_wait_seconds_bucket[5m])))"
    )
    assert metrics == {"fair_queue_wait_seconds_bucket": set()} and grouping == {"tier", "le"}
    assert promql_names('up{job="fair-frontend"} == 0')[0] == {"up": {"job"}}


# ---- what the deployment files say -------------------------------------------------------


def dashboard_queries() -> list[tuple[str, str]]:
    """``(where, PromQL)`` of every panel target and templating query of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", ()):
            out.append((panel["title"], target["expr"]))
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
            assert m, f"templating {var['name']}: unexpected query {query!r}"
            out.append((f"variable {var['name']}", f"sum by ({m.group(2)}) ({m.group(1)})"))
    return out


def rule_queries() -> list[tuple[str, str]]:
    out = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            out.append((rule.get("alert") or rule["record"], rule["expr"]))
    return out


def test_every_yaml_and_json_file_parses() -> None:
    files = sorted(p for p in DOCKER.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))
    assert {p.relative_to(DOCKER).as_posix() for p in files} >= {
        "docker-compose.yaml",
        "config.yaml",
        "prometheus/prometheus.yml",
        "prometheus/rules.yml",
        "grafana/dashboards/fair_frontend.json",
        "grafana/provisioning/datasources/prometheus.yaml",
        "grafana/provisioning/dashboards/dashboards.yaml",
        "k8s/frontend.yaml",
        "k8s/triton.yaml",
        "k8s/configmap.yaml",
        "k8s/networkpolicy.yaml",
        "k8s/redis.yaml",
        "k8s/kustomization.yaml",
    }
    for path in files:
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            assert yaml_docs(path), path
    for obj in k8s_objects():
        if obj.get("kind") == "Kustomization":
            for resource in obj["resources"]:
                assert (K8S / resource).is_file(), resource
            continue
        assert obj["apiVersion"] and obj["kind"] and obj["metadata"]["name"], obj
    # The dashboard: panels with PromQL targets, unique ids, on the datasource variable.
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}"


def test_the_config_is_valid_and_the_same_in_the_k8s_configmap() -> None:
    config = load_config(CONFIG)
    assert set(config.endpoints) == {"embed", "generate", "llm"}
    assert config.rate_limiting.storage.startswith("redis://")
    # Redis's password from the secret's file; metrics and statistics for the operator
    # only, on the pod network (where Prometheus scrapes, behind the network policy).
    assert config.rate_limiting.storage_password_file == "/run/secrets/redis/password"
    assert "@" not in config.rate_limiting.storage  # no password in the URI
    assert (config.server.metrics_host, config.server.statistics) == ("0.0.0.0", "operator")
    configmap = k8s_object("ConfigMap", "fair-frontend-config")
    assert yaml.safe_load(configmap["data"]["config.yaml"]) == yaml.safe_load(CONFIG.read_text())
    rules = next(d for d in yaml_docs(K8S / "prometheus.yaml") if d["kind"] == "ConfigMap")
    assert yaml.safe_load(rules["data"]["rules.yml"]) == yaml.safe_load(RULES.read_text())


def _authenticates(
    config: Config, files: dict[str, Path], env: dict[str, str], keys: dict[str, str]
) -> None:
    """With key files at ``files`` (config path -> real file) and ``env``, every tenant's
    key in ``keys`` authenticates as that tenant, and nothing else does."""
    tenants = {}
    for name, tenant in config.tenants.items():
        update = {}
        if tenant.api_keys_file:
            assert tenant.api_keys_file in files, f"{name}: {tenant.api_keys_file} not provided"
            update["api_keys_file"] = str(files[tenant.api_keys_file])
        tenants[name] = tenant.model_copy(update=update)
    ring = KeyRing.from_config(config.model_copy(update={"tenants": tenants}), environ=env)
    assert ring.size == len(keys)
    for tenant, key in keys.items():
        assert ring.tenant_for(key) == tenant
    for tenant, key in DEMO_KEYS.items():
        assert ring.tenant_for(key) is None, f"{tenant}'s demo key opens the deployment"
    assert ring.tenant_for(f"{keys['acme']} ") is None and ring.tenant_for("nope") is None


def test_compose_provides_every_key_file_and_variable_the_config_names(tmp_path: Path) -> None:
    """Every secret and key variable of the frontend comes from the operator: ``${VAR:?}``
    (compose stops, naming it, when unset); given them, the config's tenants and Redis
    password resolve."""
    config = load_config(CONFIG)
    spec = compose()
    frontend = spec["services"]["frontend"]
    made = Secrets()
    folder = tmp_path / "secrets"
    folder.mkdir()
    for tenant in ("acme", "initech"):
        (folder / f"{tenant}.keys").write_text(hash_key(made.keys[tenant]) + "\n")
    (folder / "redis.password").write_text(made.redis_password + "\n")
    shell = {
        "FAIR_SECRETS": str(folder),
        "FAIR_KEYS_GLOBEX": hash_key(made.keys["globex"]),
        "FAIR_KEYS_UMBRELLA": hash_key(made.keys["umbrella"]),
    }
    # No default: each value stops compose with a message naming what to set.
    values = [
        *(spec["secrets"][e["source"]]["file"] for e in frontend["secrets"]),
        *frontend["environment"].values(),
    ]
    for value in values:
        m = _INTERPOLATION.search(value)
        assert m and m.group(2) == ":?" and m.group(1) in m.group(3), value
        with pytest.raises(LookupError, match=m.group(1)):
            interpolate(value, {k: v for k, v in shell.items() if k != m.group(1)})
    files = {}
    for entry in frontend["secrets"]:
        source = Path(interpolate(spec["secrets"][entry["source"]]["file"], shell))
        assert source.is_file(), source
        files[entry["target"]] = source
    env = {name: interpolate(value, shell) for name, value in frontend["environment"].items()}
    _authenticates(config, files, env, made.keys)
    # Redis's password: the file the frontend's config names is the Redis service's secret.
    password_file = config.rate_limiting.storage_password_file
    assert password_file in files
    (redis_secret,) = spec["services"]["redis"]["secrets"]
    assert redis_secret["target"] == "/run/secrets/redis/password"
    assert files[password_file] == Path(
        interpolate(spec["secrets"][redis_secret["source"]]["file"], shell)
    )
    limiting = config.rate_limiting.model_copy(
        update={"storage_password_file": str(files[password_file])}
    )
    assert made.redis_password in urllib.parse.unquote(limiting.storage_url())


def test_k8s_provides_every_key_file_and_variable_the_config_names(
    rendered: Rendered, tmp_path: Path
) -> None:
    config = load_config(CONFIG)
    pod = rendered.get("Deployment", "fair-frontend")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    secrets_by_name = {s["metadata"]["name"]: s for s in rendered.of_kind("Secret")}
    files = {}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "secret" not in volume:
            continue
        secret = secrets_by_name[volume["secret"]["secretName"]]
        for item in volume["secret"]["items"]:
            real = tmp_path / mount["name"] / item["path"]
            real.parent.mkdir(exist_ok=True)
            real.write_bytes(base64.b64decode(secret["data"][item["key"]]))
            files[f"{mount['mountPath']}/{item['path']}"] = real
    env = {}
    for var in container["env"]:
        ref = var["valueFrom"]["secretKeyRef"]
        env[var["name"]] = base64.b64decode(
            secrets_by_name[ref["name"]]["data"][ref["key"]]
        ).decode()
    _authenticates(config, files, env, rendered.secrets.keys)
    # The config file itself comes from the ConfigMap, where the command reads it.
    args = build_parser().parse_args(container["args"])
    config_mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert args.config == f"{config_mount['mountPath']}/config.yaml"
    # Redis's password: the frontend's file is the Secret Redis reads its requirepass from.
    password_file = files[config.rate_limiting.storage_password_file]
    assert password_file.read_text().strip() == rendered.secrets.redis_password
    redis_pod = rendered.get("Deployment", "redis")["spec"]["template"]["spec"]
    (redis_volume,) = [v for v in redis_pod["volumes"] if "secret" in v]
    frontend_volume = next(
        volumes[m["name"]]
        for m in container["volumeMounts"]
        if config.rate_limiting.storage_password_file.startswith(m["mountPath"] + "/")
    )
    assert redis_volume["secret"]["secretName"] == frontend_volume["secret"]["secretName"]


def test_k8s_renders_nothing_without_the_operators_secrets(tmp_path: Path) -> None:
    """No default secret: without the files, ``kubectl kustomize`` (so ``apply -k``)
    stops and names the missing one."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    out = kustomize(_copy_k8s(tmp_path))
    assert out.returncode != 0
    assert re.search(r"secrets/\w+\.(keys|password)", out.stderr), out.stderr


def test_no_demo_key_hash_or_password_ships_under_docker() -> None:
    """Not the example's demo keys, not their hashes, not any other key hash: every
    deployment default makes the operator supply the secrets."""
    forbidden = {}
    for tenant, key in DEMO_KEYS.items():
        digest = hashlib.sha256(key.encode()).hexdigest()
        forbidden.update({key: tenant, digest: tenant})
    checked = 0
    for path in sorted(DOCKER.rglob("*")):
        if not path.is_file() or (path.parent in SECRET_FOLDERS and path.suffix != ".md"):
            continue  # the operator's own secrets, which git ignores
        text = path.read_text(errors="replace")
        checked += 1
        for needle, tenant in forbidden.items():
            assert needle not in text, f"{path.relative_to(ROOT)}: {tenant}'s demo key"
        assert not re.search(r"sha256:[0-9a-f]{64}", text), f"{path}: a key hash ships"
        assert not re.search(r"requirepass\s+[^\s\"$]", text), f"{path}: a Redis password"
    assert checked > 15
    # What git ignores in the secrets folders: everything but their own README.
    for folder in SECRET_FOLDERS:
        assert (folder / ".gitignore").read_text().split() == ["*", "!.gitignore", "!README.md"]
    # The Triton image's default command serves a config the operator mounts, not the
    # example's demo keys.
    up = build_parser().parse_args(_dockerfile_command(DOCKER / "Dockerfile"))
    assert up.config == "/etc/fair-frontend/config.yaml" and not up.demo
    assert not is_example_config(up.config)
    assert "/etc/fair-frontend" not in (DOCKER / "Dockerfile.dockerignore").read_text()


def test_the_cli_knows_the_example_configs_demo_keys() -> None:
    """``up``'s demo mode names, and ``serve`` warns about, exactly the example's keys."""
    example = load_config(ROOT / "examples" / "config.yaml")
    ring = KeyRing.from_config(example)
    assert sorted(CLI_DEMO_KEYS) == sorted(DEMO_KEYS.values())
    assert ring.size == len(CLI_DEMO_KEYS)
    assert all(ring.tenant_for(key) == tenant for tenant, key in DEMO_KEYS.items())


# ---- ports and commands -------------------------------------------------------------------


def _dockerfile_command(path: Path) -> list[str]:
    """ENTRYPOINT + CMD of a Dockerfile (exec form), without the program name."""
    text = path.read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    assert entry == ["fair-frontend"], path
    return list(cmd)


def _exposed(path: Path) -> set[int]:
    m = re.search(r"^EXPOSE (.*)$", path.read_text(), re.M)
    assert m, path
    return {int(p) for p in m.group(1).split()}


def _flag(args: list[str], name: str) -> str:
    for arg in args:
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {args}")


def test_ports_agree_with_the_cli_defaults_everywhere() -> None:
    defaults = (DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT, DEFAULT_METRICS_PORT)
    config = load_config(CONFIG)
    # The CLI, given only --config, listens where the config (= the defaults) says.
    for command in (_dockerfile_command(DOCKER / "Dockerfile.serve"),):
        listen = _listen(build_parser().parse_args(command), config)
        assert (listen.http_port, listen.grpc_port, listen.metrics_port) == defaults
    up = build_parser().parse_args(_dockerfile_command(DOCKER / "Dockerfile"))
    assert up.command == "up" and up.model_repository == "/opt/fair_frontend/model_repository"
    up_listen = _listen(up, config)
    assert (up_listen.http_port, up_listen.grpc_port, up_listen.metrics_port) == defaults
    for dockerfile in ("Dockerfile", "Dockerfile.serve"):
        assert _exposed(DOCKER / dockerfile) == set(defaults)

    # Compose: the frontend publishes the defaults, host port = container port.
    spec = compose()
    frontend = spec["services"]["frontend"]
    published = {}
    for entry in frontend["ports"]:
        *host, outside, inside = entry.split(":")
        published[int(inside)] = (host[0] if host else "0.0.0.0", int(outside))
    # The tenants' ports on every address; the operator's (metrics, statistics) on the
    # host's loopback only.
    assert published == {
        DEFAULT_HTTP_PORT: ("0.0.0.0", DEFAULT_HTTP_PORT),
        DEFAULT_GRPC_PORT: ("0.0.0.0", DEFAULT_GRPC_PORT),
        DEFAULT_METRICS_PORT: ("127.0.0.1", DEFAULT_METRICS_PORT),
    }
    args = build_parser().parse_args(frontend["command"])
    assert args.command == "serve" and args.http_port is None and args.metrics_port is None
    assert args.config == frontend["volumes"][0].split(":")[1]
    # ... reaches Triton's gRPC port, as the config says, and reads Triton's metrics port.
    triton_args = spec["services"]["triton"]["command"]
    assert args.triton_url == [config.triton.url]  # --triton-url repeats (a pool)
    assert config.triton.url == f"triton:{_flag(triton_args, '--grpc-port')}"
    assert config.triton.metrics_url == (
        f"http://triton:{_flag(triton_args, '--metrics-port')}/metrics"
    )
    assert config.rate_limiting.storage.startswith("redis://redis:6379")
    assert "redis" in spec["services"]
    # Prometheus scrapes the frontend's metrics port and Triton's.
    scrape = yaml.safe_load(PROMETHEUS.read_text())
    targets = {
        job["job_name"]: [t for s in job["static_configs"] for t in s["targets"]]
        for job in scrape["scrape_configs"]
    }
    assert targets == {
        "fair-frontend": [f"frontend:{config.server.metrics_port}"],
        "triton": [f"triton:{_flag(triton_args, '--metrics-port')}"],
    }
    assert scrape["rule_files"] == ["/etc/prometheus/rules.yml"]
    prom_volumes = spec["services"]["prometheus"]["volumes"]
    assert "./prometheus/rules.yml:/etc/prometheus/rules.yml:ro" in prom_volumes

    # Kubernetes: container ports, Services and annotations agree.
    fe = k8s_object("Deployment", "fair-frontend")["spec"]["template"]
    (container,) = fe["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == dict(
        zip(("http", "grpc", "metrics"), defaults, strict=True)
    )
    assert fe["metadata"]["annotations"]["prometheus.io/port"] == str(DEFAULT_METRICS_PORT)
    k8s_args = build_parser().parse_args(container["args"])
    assert k8s_args.triton_url == [config.triton.url]
    service = k8s_object("Service", "fair-frontend")
    assert {p["port"] for p in service["spec"]["ports"]} == set(defaults)
    triton = k8s_object("Deployment", "triton")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in triton["ports"]}
    assert ports["grpc"] == int(_flag(triton["args"], "--grpc-port")) == 8001
    assert ports["metrics"] == int(_flag(triton["args"], "--metrics-port"))
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_dockerfiles_copy_only_what_exists_and_their_ignore_files_let_through() -> None:
    for name in ("Dockerfile", "Dockerfile.serve"):
        text = (DOCKER / name).read_text()
        ignore = (DOCKER / f"{name}.dockerignore").read_text().split()
        for m in re.finditer(r"^COPY (?!--from)(\S+)(?: \S+)*? (\S+)$", text, re.M):
            source = m.group(1)
            assert (ROOT / source).exists(), f"{name}: COPY {source}: no such path"
            assert f"!{source}" in ignore or f"!{source}/**" in ignore, (name, source)
    # The compose builds use these Dockerfiles with the repository root as context.
    for service in ("triton", "frontend"):
        build = compose()["services"][service]["build"]
        assert (DOCKER / build["context"]).resolve() == ROOT
        assert (ROOT / build["dockerfile"]).is_file()


def test_requirements_script_keeps_pyprojects_pins_minus_the_named_ones() -> None:
    script = DOCKER / "requirements.py"

    def run(*args: str, tomllib: bool = True) -> list[str]:
        code = "" if tomllib else "import sys; sys.modules['tomllib'] = None; "
        code += f"import runpy, sys; sys.argv = ['x', *{list(args)!r}]; "
        code += f"runpy.run_path({str(script)!r}, run_name='__main__')"
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return out.stdout.split()

    import tomllib

    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert run() == pins
    slim = run("--without", "nvidia-pytriton", "torch", "--extras", "tritonclient=grpc")
    assert not any(p.startswith(("torch", "nvidia-pytriton")) for p in slim)
    assert [p for p in slim if p.startswith("tritonclient")] == ["tritonclient[grpc]==2.73.0"]
    assert set(slim) - {"tritonclient[grpc]==2.73.0"} < set(pins)
    assert len(slim) == len(pins) - 2
    # Python 3.10 (the NGC 24.x images) has no tomllib: the fallback reads the same.
    assert run("--without", "nvidia_pytriton", tomllib=False) == [
        p for p in pins if not p.startswith("nvidia-pytriton")
    ]
    refused = subprocess.run(
        [sys.executable, str(script), "--without", "no-such-package"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and "no-such-package" in refused.stderr


# ---- against the live stack ---------------------------------------------------------------


def _names_and_labels(text: str) -> dict[str, set[str]]:
    """Every series name on a metrics page, with the labels its samples carry.

    From the samples, and from the ``# TYPE`` lines too: a family with no samples yet
    (no storage error so far, no tenant backlogged right now) still exists. (Its own
    reading of the page, not ``fair_frontend.testing.parse``, which keeps samples only:
    this check is about series names as the page spells them, with and without samples.)
    """
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            suffixes = ("", "_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            for suffix in suffixes:
                out.setdefault(name + suffix, set())
        elif line and not line.startswith("#"):
            m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s", line)
            assert m, line
            labels = set(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', m.group(2) or ""))
            out.setdefault(m.group(1), set()).update(labels)
    return out


@pytest.fixture(scope="module")
def live_metrics(triton: EmbeddedTriton, workers: int) -> dict[str, set[str]]:
    """Series names and labels of a frontend (throttle, a rate limit, the feedback loop
    on) and of the session's Triton, after traffic on both models."""
    data = config_dict(
        tenants={
            "deploy-a": {"tier": "enterprise", "api_keys": ["deploy-a-key"]},
            "deploy-b": {
                "tier": "trial",
                "api_keys": ["deploy-b-key"],
                "limits": {"embed": {"requests_per_minute": 1}},
            },
        },
        triton={"metrics_url": triton.metrics_url, "metrics_interval_s": 0.2},
    )
    for endpoint in data["endpoints"].values():
        endpoint["throttle"] = True
    with running_frontend(make_config(**data), triton, workers=workers) as fe:
        client = grpcclient.InferenceServerClient(fe.grpc_url)
        try:
            for model in ("embed", "generate"):
                for _ in range(2):
                    client.infer(
                        model,
                        [ids_input(grpcclient, np.full((2, 8), 3, dtype=np.int32))],
                        headers={"x-api-key": "deploy-a-key"},
                    )
            for _ in range(2):  # the second is over the limit: a rate-limit hit
                with contextlib.suppress(InferenceServerException):
                    client.infer(
                        "embed",
                        [ids_input(grpcclient, np.full((1, 8), 3, dtype=np.int32))],
                        headers={"x-api-key": "deploy-b-key"},
                    )
        finally:
            client.close()
        # A streamed generation (engine mode): time to first token, inter-token latency.
        stream = urllib.request.Request(
            f"http://{fe.http_url}/v2/models/llm/generate_stream",
            data=json.dumps(
                {"text_input": "hello", "parameters": {"stream": True, "max_tokens": 3}}
            ).encode(),
            headers={"x-api-key": "deploy-a-key", "content-type": "application/json"},
        )
        with _HTTP.open(stream, timeout=30) as response:
            assert response.read().count(b"data: ") == 3
        names = _names_and_labels(fetch(f"http://127.0.0.1:{fe.server.metrics_port}/metrics"))
    # Rate-limit storage that fails (a Redis where nothing listens), in fail_open mode:
    # the request is served and the storage error counted.
    data["rate_limiting"] = {
        "storage": f"redis://127.0.0.1:{free_port()}/0",
        "on_storage_error": "fail_open",
    }
    with running_frontend(make_config(**data), triton, workers=workers) as fe:
        client = grpcclient.InferenceServerClient(fe.grpc_url)
        try:
            client.infer(
                "embed",
                [ids_input(grpcclient, np.full((1, 8), 3, dtype=np.int32))],
                headers={"x-api-key": "deploy-b-key"},
            )
        finally:
            client.close()
        page = fetch(f"http://127.0.0.1:{fe.server.metrics_port}/metrics")
    for name, labels in _names_and_labels(page).items():
        names.setdefault(name, set()).update(labels)
    for name, labels in _names_and_labels(fetch(triton.metrics_url)).items():
        names.setdefault(name, set()).update(labels)
    return names


def test_live_pages_export_what_the_dashboard_is_built_on(
    live_metrics: dict[str, set[str]],
) -> None:
    """The check below is only as good as the names it collected: make sure it saw both
    exporters, the per-tenant families, histograms and the feedback status."""
    for name in (
        "fair_requests_total",
        "fair_served_tokens_total",
        "fair_queue_wait_seconds_bucket",
        "fair_rate_limit_hits_total",
        "fair_throttle_decisions_total",
        "fair_predicted_wait_seconds_bucket",
        "fair_drr_deficit",
        "fair_service_source",
        "nv_inference_queue_duration_us",
        "fair_model_rows_total",
    ):
        assert name in live_metrics, name
    assert {"tenant", "tier", "endpoint", "outcome"} <= live_metrics["fair_requests_total"]
    assert {"model", "tenant"} <= live_metrics["fair_model_tokens_total"]


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_every_metric_and_label_in_promql_exists(
    source: str, live_metrics: dict[str, set[str]]
) -> None:
    queries = dashboard_queries() if source == "dashboard" else rule_queries()
    assert queries
    used: set[str] = set()
    problems = []
    for where, expr in queries:
        metrics, grouping = promql_names(expr)
        assert metrics, f"{where}: no metric found in {expr!r}"
        available = {"instance", "job"}  # added by Prometheus to every scraped series
        for name, labels in metrics.items():
            used.add(name)
            if name in SYNTHETIC:
                continue
            if name not in live_metrics:
                problems.append(f"{where}: no metric {name}")
                continue
            have = live_metrics[name]
            available |= have
            if have and labels - have - {"instance", "job"}:
                problems.append(f"{where}: {name} has no label {sorted(labels - have)}")
        if grouping - available:
            problems.append(f"{where}: grouping by missing labels {sorted(grouping - available)}")
    assert not problems, "\n".join(problems)
    if source == "dashboard":
        # The panels the dashboard promises.
        assert used >= {
            "fair_served_tokens_total",
            "fair_served_rows_total",
            "fair_queue_wait_seconds_bucket",
            "fair_requests_total",
            "fair_queue_depth",
            "fair_drr_deficit",
            "fair_predicted_wait_seconds_bucket",
            "fair_throttle_decisions_total",
            "fair_batch_rows_bucket",
            "fair_batch_seconds_bucket",
            "fair_service_source",
            "fair_triton_metrics_stale",
            "nv_inference_queue_duration_us",
            "nv_inference_compute_infer_duration_us",
            "nv_inference_pending_request_count",
            "fair_model_rows_total",
            "fair_model_tokens_total",
            "fair_time_to_first_token_seconds_bucket",
            "fair_inter_token_seconds_bucket",
            "fair_output_tokens_total",
        }


@pytest.fixture(scope="module")
def frontend_http(triton: EmbeddedTriton, workers: int) -> Iterator[str]:
    with running_frontend(make_config(), triton, workers=workers) as fe:
        yield f"http://{fe.http_url}"


def test_probes_and_health_checks_point_at_endpoints_that_answer(
    triton: EmbeddedTriton, frontend_http: str
) -> None:
    checked = 0
    for deployment, base in (("fair-frontend", frontend_http), ("triton", triton.http_url)):
        (container,) = k8s_object("Deployment", deployment)["spec"]["template"]["spec"][
            "containers"
        ]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        probes = [
            container[k]
            for k in ("readinessProbe", "livenessProbe", "startupProbe")
            if k in container
        ]
        paths = set()
        for probe in probes:
            get = probe["httpGet"]
            port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
            assert port == DEFAULT_HTTP_PORT, (deployment, get)
            assert http_status(base + get["path"]) == 200, (deployment, get["path"])
            paths.add(get["path"])
            checked += 1
        assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    # A probe on a path nobody serves would fail: the check above can tell.
    assert http_status(frontend_http + "/v2/health/nope") == 404
    assert checked >= 4
    # Compose's and the Dockerfiles' health checks: the same readiness URL.
    spec = compose()
    for service, base in (("frontend", frontend_http), ("triton", triton.http_url)):
        test = " ".join(spec["services"][service]["healthcheck"]["test"])
        (url,) = re.findall(r"http://127\.0\.0\.1:(\d+)(/\S+?)'", test)
        assert int(url[0]) == DEFAULT_HTTP_PORT and http_status(base + url[1]) == 200
    for dockerfile in ("Dockerfile", "Dockerfile.serve"):
        m = re.search(r"http://127\.0\.0\.1:(\d+)(/\S+?)'", (DOCKER / dockerfile).read_text())
        assert m and int(m.group(1)) == DEFAULT_HTTP_PORT
        assert http_status(frontend_http + m.group(2)) == 200


# Imports the serve image does not have: the model side, the dev tools, the extras of
# tritonclient it leaves out.
_ABSENT_IN_SERVE_IMAGE = (
    "torch",
    "pytriton",
    "matplotlib",
    "hypothesis",
    "pytest",
    "geventhttpclient",
    "gevent",
    "cuda",
    "tritonclient.http",
)
_BLOCKER = f"""
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if any(name == n or name.startswith(n + ".") for n in {_ABSENT_IN_SERVE_IMAGE!r}):
            raise ModuleNotFoundError(f"{{name}} is not in the serve image")
        return None
sys.meta_path.insert(0, Absent())
from fair_frontend.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_serve_runs_with_the_serve_images_packages_only(
    triton: EmbeddedTriton, tmp_path: Path
) -> None:
    """``Dockerfile.serve`` installs no torch, no nvidia-pytriton, tritonclient[grpc] only:
    ``fair-frontend serve`` must start and serve with that, importing none of the rest."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(config_dict()))
    http, grpc_port, metrics = free_port(), free_port(), free_port()
    command = [
        *("serve", "--config", str(config), "--triton-url", triton.grpc_url),
        *("--host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc_port)),
        *("--metrics-port", str(metrics), "--log-level", "WARNING"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _BLOCKER, *command],
        cwd=tmp_path,  # not the repository: the installed package, as in the image
        env={**env, "PYTHONPATH": ""},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while http_status_or_none(f"http://127.0.0.1:{http}/v2/health/ready") != 200:
            assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "serve not ready after 60 s"
            time.sleep(0.05)
        body = json.dumps(
            {
                "inputs": [
                    {
                        "name": "INPUT_IDS",
                        "shape": [1, 4],
                        "datatype": "INT32",
                        "data": [1, 2, 3, 4],
                    }
                ]
            }
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{http}/v2/models/embed/infer",
            data=body,
            headers={"authorization": "Bearer acme-test-key"},
        )
        with _HTTP.open(request, timeout=30) as response:
            answer = json.loads(response.read())
        assert answer["outputs"][0]["name"] == "EMBEDDING"
        assert answer["outputs"][0]["shape"] == [1, 128]
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 0, output[-3000:]
    assert "is not in the serve image" not in output, output[-3000:]


def http_status_or_none(url: str) -> int | None:
    try:
        return http_status(url)
    except OSError:
        return None


def test_compose_triton_command_is_the_k8s_one() -> None:
    """One Triton invocation: the compose service and the k8s Deployment run the same."""
    compose_triton = compose()["services"]["triton"]
    k8s_triton = k8s_object("Deployment", "triton")["spec"]["template"]["spec"]["containers"][0]
    assert compose_triton["entrypoint"] == k8s_triton["command"] == ["tritonserver"]
    assert compose_triton["command"] == k8s_triton["args"]
    assert shlex.split(" ".join(k8s_triton["args"]))[0].startswith("--model-repository=")
    repo = _flag(k8s_triton["args"], "--model-repository")
    up = build_parser().parse_args(_dockerfile_command(DOCKER / "Dockerfile"))
    assert repo == up.model_repository


def test_kustomize_builds_the_manifests_into_one_namespace(rendered: Rendered) -> None:
    """``kubectl kustomize`` (offline) renders every object, in the fair-frontend
    namespace, and the two Secrets from the operator's files."""
    expected = [o for o in k8s_objects() if o["kind"] != "Kustomization"]
    made = [o for o in rendered.objects if o["kind"] != "Secret"]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in made) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in expected
    )
    keys, password = rendered.secret("fair-frontend-keys"), rendered.secret("redis-password")
    assert len(rendered.of_kind("Secret")) == 2
    assert set(keys["data"]) == {"acme.keys", "initech.keys", "globex", "umbrella"}
    assert base64.b64decode(password["data"]["password"]).decode().strip() == (
        rendered.secrets.redis_password
    )
    for obj in rendered.objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "fair-frontend", obj["metadata"]


def test_the_rendered_manifests_are_valid_kubernetes_objects(rendered: Rendered) -> None:
    """Against the API's OpenAPI schemas (``kubernetes-validate``, strict: an unknown or
    misspelt field is an error, as ``kubectl apply --validate=strict`` would say)."""
    version = kubernetes_validate.latest_version()
    kinds = set()
    for obj in rendered.objects:
        kubernetes_validate.validate(obj, version, strict=True)
        kinds.add(obj["kind"])
    assert {"NetworkPolicy", "Deployment", "Secret", "Service", "ConfigMap"} <= kinds
    # The validator can tell: a misspelt field is refused.
    broken = json.loads(json.dumps(rendered.get("NetworkPolicy", "triton")))
    broken["spec"]["ingres"] = broken["spec"].pop("ingress")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


# ---- every pod locked down -----------------------------------------------------------------

# Where each pod may write (memory or node-local emptyDirs); the rest is read-only.
WRITABLE = {
    "fair-frontend": {"/tmp"},  # the core's Unix socket to its shell processes
    "redis": {"/tmp", "/data"},  # the generated redis.conf; the working directory
    "triton": {"/dev/shm", "/tmp"},  # the Python backend stubs' shared memory; HOME's caches
    "prometheus": {"/prometheus"},  # the TSDB
}


def test_every_pod_runs_non_root_read_only_without_privileges(rendered: Rendered) -> None:
    deployments = rendered.of_kind("Deployment")
    assert {d["metadata"]["name"] for d in deployments} == set(WRITABLE)
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True, name
        assert context["runAsUser"] > 0 and context.get("runAsGroup", 1) > 0, name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        # Only Prometheus talks to the Kubernetes API (pod discovery).
        assert pod.get("automountServiceAccountToken", True) is (name == "prometheus"), name
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in [*pod["containers"], *pod.get("initContainers", [])]:
            own = container["securityContext"]
            assert own["allowPrivilegeEscalation"] is False, name
            assert own["readOnlyRootFilesystem"] is True, name
            assert own["capabilities"] == {"drop": ["ALL"]}, name
            assert not own.get("privileged") and own.get("runAsUser", 1) != 0, name
            writable = set()
            for mount in container.get("volumeMounts", []):
                volume = volumes[mount["name"]]
                if "emptyDir" in volume:
                    writable.add(mount["mountPath"])
                else:  # secrets and config: read-only
                    assert mount.get("readOnly") is True, (name, mount)
                    assert not {"hostPath", "persistentVolumeClaim"} & set(volume), volume
            assert writable == WRITABLE[name], name


def test_compose_services_drop_privileges_and_keep_the_operators_ports_local() -> None:
    services = compose()["services"]
    for name, service in services.items():
        assert service.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert not service.get("privileged"), name
        for port in service.get("ports", []):
            inside = int(port.split(":")[-1])
            if inside not in (DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT):  # only the tenants'
                assert port.startswith("127.0.0.1:"), (name, port)
    for name in ("frontend", "triton", "redis"):
        assert services[name]["read_only"] is True, name
        assert "/tmp" in services[name]["tmpfs"], name
    assert services["redis"]["user"] == "999:1000"


# What the pods' read-only root filesystems allow, tried for real: Triton (the Python
# backend's stubs, torch models) and the frontend (two shell processes) run in a mount
# namespace whose root is read-only, with fresh tmpfs on /tmp and /dev/shm only (the
# emptyDirs of k8s/), with no capability and no new privileges. Not as another user:
# this machine's Python lives under /root (mode 0700); the images run as 10001.
_READ_ONLY_STACK = """
import json, os, pathlib, sys, urllib.request
import numpy as np, tritonclient.grpc as grpcclient
from fair_frontend.embedded import EmbeddedTriton, default_model_repository
from fair_frontend.server import BackgroundServer, FrontendServer, Listen
from tests.support import KEYS, ids_input, make_config

for where in (pathlib.Path.cwd() / "probe", pathlib.Path("/etc/probe")):
    try:
        where.write_text("x")
        sys.exit(f"{where} is writable: the root is not read-only")
    except OSError:
        pass
triton = EmbeddedTriton(default_model_repository())
triton.start()
try:
    body = json.dumps({"text_input": "hello", "max_tokens": 3}).encode()
    req = urllib.request.Request(triton.http_url + "/v2/models/llm/generate", data=body)
    print("llm", urllib.request.urlopen(req, timeout=60).status)
    config = make_config()
    config = config.model_copy(update={"triton": config.triton.model_copy(
        update={"http_url": triton.http_url})})
    with BackgroundServer(FrontendServer(config, triton.grpc_url, Listen(), workers=2)) as fe:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{fe.grpc_port}")
        ids = np.ones((2, 8), np.int32)
        out = client.infer("embed", [ids_input(grpcclient, ids)],
                           headers={"x-api-key": KEYS["acme"]})
        print("frontend embed", out.as_numpy("EMBEDDING").shape)
        client.close()
finally:
    triton.stop()
"""


def test_triton_and_the_frontend_serve_on_a_read_only_root_without_capabilities() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("setpriv") is None:
        pytest.skip("needs root, unshare and setpriv to make a read-only mount namespace")
    tmp = Path("/tmp")
    if any(p == tmp or tmp in p.parents for p in (ROOT.resolve(), Path(sys.prefix).resolve())):
        # The namespace mounts an empty tmpfs on /tmp (the pod's emptyDir), which would
        # hide a checkout or a virtual environment that lives there.
        pytest.skip(f"the checkout or its venv is under /tmp ({ROOT}, {sys.prefix})")
    setup = (
        "mount -o remount,bind,ro / && "
        "mount -t tmpfs -o mode=1777,size=2g tmpfs /tmp && "
        "mount -t tmpfs -o mode=1777,size=1g tmpfs /dev/shm && "
        'exec setpriv --bounding-set=-all --inh-caps=-all --no-new-privs "$@"'
    )
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/tmp"}
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", setup, "sh",
         "env", "-i", *(f"{k}={v}" for k, v in env.items()),
         sys.executable, "-c", _READ_ONLY_STACK],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    if out.returncode != 0 and re.match(r"(unshare|mount|setpriv): ", out.stderr):
        pytest.skip(f"no read-only mount namespace here: {out.stderr.strip()[:300]}")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "llm 200" in out.stdout and "frontend embed (2, 128)" in out.stdout, out.stdout


# ---- NetworkPolicy: who may connect to whom -------------------------------------------------
#
# A small evaluator of the NetworkPolicy API's rules (networking.k8s.io/v1), enough for
# these manifests and checked on the documentation's own cases below: a connection is
# allowed when the destination pod's ingress allows it AND the source pod's egress does.
# A pod that no policy of a direction selects is open in that direction; once one does,
# only what one of them lists is allowed. A rule's peers (from/to) are ORed; within one
# peer, podSelector and namespaceSelector are ANDed; a podSelector alone means the
# policy's namespace; no peers means every source; no ports means every port; a named
# port is the destination pod's container port of that name.


@dataclass(frozen=True)
class Endpoint:
    """One end of a connection: a pod, or (namespace None) an address outside."""

    name: str
    namespace: str | None
    labels: Mapping[str, str] = field(default_factory=dict)
    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)  # container ports by name
    ip: str = "203.0.113.7"


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions, ANDed; empty: everything)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: Mapping[str, Any], namespace: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(other.ip)
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except", [])
        )
    if other.namespace is None:
        return False  # pod and namespace selectors select pods only
    ns_selector = peer.get("namespaceSelector")
    in_namespace = (
        other.namespace == namespace
        if ns_selector is None
        else selects(ns_selector, other.namespace_labels)
    )
    return in_namespace and selects(peer.get("podSelector") or {}, other.labels)


def _port_matches(
    ports: list[Mapping[str, Any]] | None, port: int, protocol: str, named: Mapping[str, int]
) -> bool:
    if not ports:
        return True
    for entry in ports:
        if entry.get("protocol", "TCP") != protocol:
            continue
        if "port" not in entry:
            return True
        first = entry["port"]
        if isinstance(first, str):
            if named.get(first) == port:
                return True
            continue
        if first <= port <= entry.get("endPort", first):
            return True
    return False


def _policy_types(policy: Mapping[str, Any]) -> list[str]:
    spec = policy["spec"]
    return list(spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])])


def _side_allows(
    policies: list[dict[str, Any]],
    direction: str,
    subject: Endpoint,
    other: Endpoint,
    port: int,
    protocol: str,
    destination: Endpoint,
) -> bool:
    if subject.namespace is None:
        return True  # outside the cluster: no policy here applies to it
    applying = [
        p
        for p in policies
        if p["metadata"]["namespace"] == subject.namespace
        and direction in _policy_types(p)
        and selects(p["spec"].get("podSelector") or {}, subject.labels)
    ]
    if not applying:
        return True
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for policy in applying:
        for rule in policy["spec"].get(rules_key) or []:
            peers = rule.get(peers_key)
            namespace = policy["metadata"]["namespace"]
            if peers and not any(_peer_matches(p, namespace, other) for p in peers):
                continue
            if _port_matches(rule.get("ports"), port, protocol, destination.ports):
                return True
    return False


def connects(
    policies: list[dict[str, Any]], source: Endpoint, to: Endpoint, port: int, protocol: str = "TCP"
) -> bool:
    """May ``source`` open a connection to ``to`` on ``port``?"""
    return _side_allows(policies, "Egress", source, to, port, protocol, to) and _side_allows(
        policies, "Ingress", to, source, port, protocol, to
    )


def test_the_evaluator_follows_the_documented_rules() -> None:
    """The cases of the NetworkPolicy documentation, so a pass below means something."""
    ns = {"kubernetes.io/metadata.name": "default"}
    db = Endpoint("db", "default", {"role": "db"}, ns, {"pg": 5432})
    front = Endpoint("front", "default", {"role": "frontend"}, ns)
    other_ns = Endpoint("x", "other", {"role": "frontend"}, {"project": "myproject"})
    outside = Endpoint("outside", None, ip="172.17.1.5")

    def policy(spec: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"namespace": "default"}, "spec": spec}

    assert connects([], outside, db, 5432)  # no policy: open
    deny = policy({"podSelector": {}, "policyTypes": ["Ingress"]})
    assert not connects([deny], front, db, 5432)
    allow = policy(
        {
            "podSelector": {"matchLabels": {"role": "db"}},
            "ingress": [
                {
                    "from": [
                        {"ipBlock": {"cidr": "172.17.0.0/16", "except": ["172.17.1.0/24"]}},
                        {"namespaceSelector": {"matchLabels": {"project": "myproject"}}},
                        {"podSelector": {"matchLabels": {"role": "frontend"}}},
                    ],
                    "ports": [{"protocol": "TCP", "port": "pg"}],
                }
            ],
        }
    )
    assert connects([deny, allow], front, db, 5432)  # a podSelector peer: same namespace
    assert connects([deny, allow], other_ns, db, 5432)  # a namespaceSelector peer
    assert not connects([deny, allow], front, db, 5433)  # the named port only
    assert not connects([deny, allow], front, db, 5432, "UDP")
    assert not connects([deny, allow], outside, db, 5432)  # in the except range
    assert connects([deny, allow], Endpoint("o2", None, ip="172.17.2.1"), db, 5432)
    # namespaceSelector AND podSelector in one peer: both must hold.
    both = policy(
        {
            "podSelector": {"matchLabels": {"role": "db"}},
            "ingress": [
                {
                    "from": [
                        {
                            "namespaceSelector": {"matchLabels": {"project": "myproject"}},
                            "podSelector": {
                                "matchExpressions": [
                                    {"key": "role", "operator": "In", "values": ["client"]}
                                ]
                            },
                        }
                    ]
                }
            ],
        }
    )
    assert not connects([both], other_ns, db, 5432)
    client = Endpoint("c", "other", {"role": "client"}, {"project": "myproject"})
    assert connects([both], client, db, 5432)
    egress_only = policy(
        {"podSelector": {"matchLabels": {"role": "frontend"}}, "policyTypes": ["Egress"]}
    )
    assert not connects([egress_only], front, db, 5432) and connects([egress_only], db, front, 1)


def _pods(rendered: Rendered) -> dict[str, Endpoint]:
    namespaces = {
        n["metadata"]["name"]: {
            **(n["metadata"].get("labels") or {}),
            "kubernetes.io/metadata.name": n["metadata"]["name"],
        }
        for n in rendered.of_kind("Namespace")
    }
    pods = {}
    for deployment in rendered.of_kind("Deployment"):
        template = deployment["spec"]["template"]
        namespace = deployment["metadata"]["namespace"]
        ports = {
            p["name"]: p["containerPort"]
            for c in template["spec"]["containers"]
            for p in c.get("ports", [])
            if "name" in p
        }
        pods[deployment["metadata"]["name"]] = Endpoint(
            deployment["metadata"]["name"],
            namespace,
            template["metadata"]["labels"],
            namespaces[namespace],
            ports,
        )
    return pods


def _outsiders(namespace_labels: Mapping[str, str]) -> list[Endpoint]:
    """Everyone who is not the platform: tenants' pods in another namespace (one even
    labelled as a frontend), another workload in the namespace, an address outside."""
    return [
        Endpoint("tenant-pod", "tenants", {"app": "client"}, {"kubernetes.io/metadata.name": "t"}),
        Endpoint(
            "impostor",
            "tenants",
            {"app.kubernetes.io/name": "fair-frontend"},
            {"kubernetes.io/metadata.name": "tenants"},
        ),
        Endpoint(
            "neighbour", "fair-frontend", {"app.kubernetes.io/name": "debug"}, namespace_labels
        ),
        Endpoint("internet", None),
    ]


def test_network_policies_let_only_the_frontend_reach_triton_and_redis(
    rendered: Rendered,
) -> None:
    policies = rendered.of_kind("NetworkPolicy")
    pods = _pods(rendered)
    fe, triton, redis_pod, prom = (
        pods["fair-frontend"],
        pods["triton"],
        pods["redis"],
        pods["prometheus"],
    )
    triton_ports = (8000, 8001, 8002)
    expected: list[tuple[Endpoint, Endpoint, int, bool]] = [
        *((fe, triton, port, True) for port in triton_ports),
        (fe, redis_pod, 6379, True),
        (prom, triton, 8002, True),  # Prometheus scrapes Triton's metrics...
        (prom, fe, 8002, True),  # ... and the frontend's operator listener
        (prom, triton, 8001, False),
        (prom, fe, 8000, False),
        (prom, redis_pod, 6379, False),
        (triton, redis_pod, 6379, False),
        (redis_pod, triton, 8001, False),
        (triton, fe, 8000, False),
        (fe, Endpoint("internet", None), 443, False),  # no way out but the platform's
        (triton, Endpoint("internet", None), 443, False),
    ]
    grafana = Endpoint(
        "grafana",
        "monitoring",
        {"app.kubernetes.io/name": "grafana"},
        {"kubernetes.io/metadata.name": "monitoring"},
    )
    expected.append((grafana, prom, 9090, True))
    for outsider in _outsiders(fe.namespace_labels):
        # The tenants' ports, from anywhere; a workload added to the namespace has no way
        # out at all (the default deny covers its egress too) until a policy gives one.
        tenant = outsider.namespace != fe.namespace
        expected += [
            (outsider, fe, DEFAULT_HTTP_PORT, tenant),
            (outsider, fe, DEFAULT_GRPC_PORT, tenant),
            (outsider, fe, DEFAULT_METRICS_PORT, False),  # the operator's: Prometheus only
            *((outsider, triton, port, False) for port in triton_ports),
            (outsider, redis_pod, 6379, False),
            (outsider, prom, 9090, False),
        ]
    wrong = [
        f"{src.name} -> {dst.name}:{port}: {'allowed' if not ok else 'denied'}"
        for src, dst, port, ok in expected
        if connects(policies, src, dst, port) is not ok
    ]
    assert not wrong, "\n".join(wrong)
    # Every pod resolves names (DNS), and nothing in the namespace is left unselected.
    for pod in pods.values():
        assert connects(policies, pod, Endpoint("dns", None), 53, "UDP"), pod.name
    (deny,) = [p for p in policies if p["metadata"]["name"] == "default-deny"]
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    # The negative control: without the policies, the tenants reach Triton and Redis.
    tenant = _outsiders(fe.namespace_labels)[0]
    assert connects([], tenant, triton, 8001) and connects([], tenant, redis_pod, 6379)


def test_the_policies_ports_are_the_pods_ports(rendered: Rendered) -> None:
    """A policy that names a port the pod does not serve would silently cut it off."""
    pods = _pods(rendered)
    by_label = {p.labels["app.kubernetes.io/name"]: p for p in pods.values()}
    for policy in rendered.of_kind("NetworkPolicy"):
        selector = policy["spec"]["podSelector"].get("matchLabels")
        if not selector:
            continue
        pod = by_label[selector["app.kubernetes.io/name"]]
        for rule in policy["spec"].get("ingress", []):
            for entry in rule.get("ports", []):
                assert entry["port"] in pod.ports.values(), (policy["metadata"]["name"], entry)


# ---- Redis: the password from the Secret, the same start script in compose and k8s -------


def _redis_container(rendered: Rendered) -> dict[str, Any]:
    (container,) = rendered.get("Deployment", "redis")["spec"]["template"]["spec"]["containers"]
    return container


def test_redis_starts_the_same_in_compose_and_k8s(rendered: Rendered) -> None:
    container = _redis_container(rendered)
    service = compose()["services"]["redis"]
    unescape = lambda value: value.replace("$$", "$")  # noqa: E731 - compose's escape
    assert [unescape(v) for v in service["entrypoint"]] == container["command"]
    assert service["command"] == container["args"]
    probe = container["readinessProbe"]["exec"]["command"]
    assert [unescape(v) for v in service["healthcheck"]["test"][1:]] == probe
    assert "requirepass" in container["command"][2]


def _start_redis(container: dict[str, Any], folder: Path, port: int) -> subprocess.Popen[bytes]:
    """The manifest's start script, its paths moved into ``folder``, on a free port."""
    script = container["command"][2]
    script = script.replace("/run/secrets/redis/password", str(folder / "password"))
    script = script.replace("/tmp/redis.conf", str(folder / "redis.conf"))
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    return subprocess.Popen(
        [*container["command"][:2], script, container["command"][3],
         "--port", str(port), "--bind", "127.0.0.1", *container["args"]],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip


async def test_the_shipped_redis_requires_the_secrets_password_and_the_frontend_has_it(
    rendered: Rendered, tmp_path: Path
) -> None:
    """Redis started by the manifest's script from the Secret's file refuses every
    command without the password; the frontend's limiter, reading the same file through
    rate_limiting.storage_password_file, is let in; the password is on no command line."""
    container = _redis_container(rendered)
    password = rendered.secrets.redis_password
    (tmp_path / "password").write_text(password + "\n")
    port = free_port()
    proc = _start_redis(container, tmp_path, port)
    try:
        deadline = time.monotonic() + 10
        with redis.Redis(port=port, password=password, socket_timeout=5) as client:
            while True:
                assert proc.poll() is None, proc.communicate()[0].decode()
                try:
                    if client.ping():
                        break
                except redis.ConnectionError:
                    pass
                assert time.monotonic() < deadline, "redis did not start"
                time.sleep(0.01)  # polling interval, not a wait for readiness
        anonymous = redis.Redis(port=port, socket_timeout=5)
        with anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.set("rl:{x}:requests:1:1", 1)
        # Its readiness probe, on the same file, says ready.
        probe = container["readinessProbe"]["exec"]["command"]
        script = probe[2].replace("/run/secrets/redis/password", str(tmp_path / "password"))
        script = script.replace("redis-cli", f"redis-cli -p {port}")
        ready = subprocess.run([*probe[:2], script], capture_output=True, timeout=10)
        assert ready.returncode == 0, ready
        (tmp_path / "password").write_text("wrong\n")  # ... and can tell
        assert subprocess.run([*probe[:2], script], capture_output=True, timeout=10).returncode
        (tmp_path / "password").write_text(password + "\n")
        # Never on a command line: the server's, and the script's.
        for pid in [proc.pid, *_children(proc.pid)]:
            assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert oct((tmp_path / "redis.conf").stat().st_mode & 0o777) == "0o600"
        # The frontend's limiter from the shipped config, the password file moved here.
        limiting = load_config(CONFIG).rate_limiting.model_copy(
            update={
                "storage": f"redis://127.0.0.1:{port}/0",
                "storage_password_file": str(tmp_path / "password"),
                "timeout_ms": 5000,
            }
        )
        limiter = rate_limiter(limiting)
        try:
            await limiter.storage.ping()  # type: ignore[attr-defined]
        finally:
            await limiter.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _children(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError):
            if re.search(rf"^PPid:\s+{pid}$", status.read_text(), re.M):
                found.append(int(status.parent.name))
    return found


@pytest.mark.parametrize(
    ("content", "why"),
    [("\n", "is empty"), ('with"quote\n', "may not hold"), ("back\\slash\n", "may not hold")],
)
def test_the_shipped_redis_refuses_an_empty_or_unquotable_password(
    rendered: Rendered, tmp_path: Path, content: str, why: str
) -> None:
    """Redis with an empty requirepass would let everyone in: the script stops instead."""
    (tmp_path / "password").write_text(content)
    proc = _start_redis(_redis_container(rendered), tmp_path, free_port())
    output = proc.communicate(timeout=10)[0].decode()
    assert proc.returncode == 1 and why in output, output
    assert not (tmp_path / "redis.conf").exists()
