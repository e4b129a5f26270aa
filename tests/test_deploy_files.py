"""The deployment files in ``docker/`` (compose and kustomize; the Helm chart has
``test_helm_chart.py``) against the real frontend and Triton.

Both deploy the fleet: two cores (``fair-frontend core``, one leads, the lease in Redis),
shells (``fair-frontend shell``, the tenants' ports), Triton, Redis, Prometheus.

No Docker engine runs here, so the images are not built; what can be checked is: every
YAML and JSON file parses; the metric names (and the labels they are filtered and
grouped by) in the Grafana dashboard and the Prometheus rules exist on a live frontend's
and Triton's metrics pages after some traffic; the Kubernetes probes and the compose
health checks point at the paths and ports the commands serve them on (the shells' and
Triton's answer 200 here; the core's: ``test_fleet_commands_in_the_deploy_files_serve``);
the ports agree with the CLI defaults everywhere; the secrets are wired to the config's
``api_keys_file`` / ``api_keys_env``; the commands in the Dockerfiles, compose and the
manifests parse with the real CLI; every config serves ``llm`` in engine mode; the serve
image's dependency set (no torch, no nvidia-pytriton) is enough to run ``serve``.

Locked down: no key, hash or password ships anywhere under ``docker/`` (the manifests
render only with secrets the operator makes: the tests make their own); the rendered
manifests are valid Kubernetes objects (``kubernetes-validate``); every pod runs non-root
on a read-only root filesystem without privileges; the NetworkPolicies, evaluated over
the rendered objects, let only the cores reach Redis, only the cores and shells reach
Triton, only the shells reach the cores, and only Prometheus the metrics; the Redis start
script (the same in compose, Kubernetes and the chart) makes a real ``redis-server``
require the Secret's password, which the core reads from its file.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import posixpath
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

from fair_frontend.admission import RedisStorage
from fair_frontend.auth import KeyRing, hash_key
from fair_frontend.backends.triton.embedded import EmbeddedTriton, free_port
from fair_frontend.cli import DEMO_KEYS as CLI_DEMO_KEYS
from fair_frontend.cli import _listen, build_parser, is_example_config
from fair_frontend.config import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_METRICS_PORT,
    load_config,
    parse_config,
    resolve_relative_paths,
)
from fair_frontend.core.metrics import exported_families
from fair_frontend.core.plan import rate_limiter
from fair_frontend.fleet import DEFAULT_CORE_PORT
from fair_frontend.kit.testing import fetch
from tests.deploy_support import (
    DEMO_KEYS,
    Endpoint,
    assert_locked_down,
    assert_policy_ports_are_served,
    authenticates,
    connects,
    promql_names,
    reachable,
    secret_files,
    selects,
    workload_pods,
)
from tests.support import (
    ROOT,
    config_dict,
    ids_input,
    make_config,
    required_tool,
    running_frontend,
)

DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "fair_frontend.json"
RULES = DOCKER / "prometheus" / "rules.yml"
PROMETHEUS = DOCKER / "prometheus" / "prometheus.yml"
COMPOSE = DOCKER / "docker-compose.yaml"
CONFIG = DOCKER / "config.yaml"
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
    core_secret: str = field(default_factory=lambda: secrets.token_hex(32))

    def write_k8s(self, folder: Path) -> None:
        folder.mkdir(exist_ok=True)
        for tenant, key in self.keys.items():
            (folder / f"{tenant}.keys").write_text(hash_key(key) + "\n")
        (folder / "redis.password").write_text(self.redis_password + "\n")
        (folder / "core.secret").write_text(self.core_secret + "\n")


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
    shutil.copytree(K8S, folder, ignore=shutil.ignore_patterns("*.keys", "*.password", "*.secret"))
    return folder


def kustomize(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    required_tool("kubectl")
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
    """Every YAML and JSON file but the chart's templates (Go templates, which only render
    as YAML: ``test_helm_chart.py`` parses what they render)."""
    files = sorted(
        p
        for p in DOCKER.rglob("*")
        if p.suffix in (".yaml", ".yml", ".json") and "templates" not in p.parts
    )
    assert {p.relative_to(DOCKER).as_posix() for p in files} >= {
        "docker-compose.yaml",
        "config.yaml",
        "prometheus/prometheus.yml",
        "prometheus/rules.yml",
        "grafana/dashboards/fair_frontend.json",
        "grafana/provisioning/datasources/prometheus.yaml",
        "grafana/provisioning/dashboards/dashboards.yaml",
        "k8s/core.yaml",
        "k8s/shell.yaml",
        "k8s/triton.yaml",
        "k8s/configmap.yaml",
        "k8s/networkpolicy.yaml",
        "k8s/redis.yaml",
        "k8s/kustomization.yaml",
        "helm/fair-frontend/Chart.yaml",
        "helm/fair-frontend/values.yaml",
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
    assert set(config.endpoints) == {"embed", "rerank", "generate", "llm"}
    # The tokenizers it names are the ones the serve image copies, at the paths the config
    # resolves to where it is mounted (/etc/fair-frontend/config.yaml).
    serve = (DOCKER / "Dockerfile.serve").read_text()
    for endpoint in ("embed", "rerank", "llm"):
        raw = yaml.safe_load(CONFIG.read_text())["endpoints"][endpoint]["tokenizer"]
        in_image = posixpath.normpath(posixpath.join("/etc/fair-frontend", raw))
        source = Path(config.endpoints[endpoint].tokenizer or "").relative_to(ROOT)
        assert f"COPY {source} {in_image}\n" in serve, (endpoint, source, in_image)
    # The Helm chart's default config is this same file.
    chart_values = yaml.safe_load((DOCKER / "helm" / "fair-frontend" / "values.yaml").read_text())
    assert yaml.safe_load(chart_values["config"]) == yaml.safe_load(CONFIG.read_text())
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


def _compose_configs() -> list[tuple[str, Path]]:
    """``(service, host file)`` of every config file compose mounts."""
    out = []
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if target == "/etc/fair-frontend/config.yaml":
                out.append((name, (DOCKER / source).resolve()))
    return out


def _mounted(data: dict[str, Any]) -> dict[str, Any]:
    """A config as the containers mount it (/etc/fair-frontend, as docker/config.yaml is
    here): its tokenizers' paths made absolute from that folder."""
    resolve_relative_paths(data, CONFIG.parent)
    return data


def test_every_deployment_config_serves_llm_in_engine_mode() -> None:
    """docker/config.yaml, the k8s ConfigMap's and what compose mounts (the chart's:
    ``test_helm_chart.py``): ``llm`` is an endpoint in engine mode (``max_inflight``:
    continuous batching in the model, slots granted by the core), open to a tier."""
    configmap = k8s_object("ConfigMap", "fair-frontend-config")["data"]["config.yaml"]
    configs = {
        "docker/config.yaml": load_config(CONFIG),
        # Mounted at /etc/fair-frontend, as docker/config.yaml is here: its tokenizers'
        # paths are relative to that folder.
        "k8s ConfigMap": parse_config(_mounted(yaml.safe_load(configmap)), "configmap"),
    }
    mounted = _compose_configs()
    assert {name for name, _ in mounted} == {"core", "core-standby"}
    for name, path in mounted:
        configs[f"compose {name}"] = load_config(path)
    for where, config in configs.items():
        llm = config.endpoints["llm"]
        assert llm.max_inflight is not None and llm.max_inflight >= 1, where
        assert any("llm" in models for models in config.tier_models.values()), where
    # The negative control: a batching endpoint is not in engine mode.
    assert configs["docker/config.yaml"].endpoints["embed"].max_inflight is None


def test_compose_provides_every_key_file_and_variable_the_config_names(tmp_path: Path) -> None:
    """Every secret and key variable of the cores comes from the operator: ``${VAR:?}``
    (compose stops, naming it, when unset); given them, the config's tenants and Redis
    password resolve in both cores. The shells get the core secret alone: no key, no
    password, no config."""
    config = load_config(CONFIG)
    spec = compose()
    made = Secrets()
    folder = tmp_path / "secrets"
    folder.mkdir()
    for tenant in ("acme", "initech"):
        (folder / f"{tenant}.keys").write_text(hash_key(made.keys[tenant]) + "\n")
    (folder / "redis.password").write_text(made.redis_password + "\n")
    (folder / "core.secret").write_text(made.core_secret + "\n")
    shell = {
        "FAIR_SECRETS": str(folder),
        "FAIR_KEYS_GLOBEX": hash_key(made.keys["globex"]),
        "FAIR_KEYS_UMBRELLA": hash_key(made.keys["umbrella"]),
    }
    core_secret_files = set()
    for name in ("core", "core-standby"):
        core = spec["services"][name]
        # No default: each value stops compose with a message naming what to set.
        values = [
            *(spec["secrets"][e["source"]]["file"] for e in core["secrets"]),
            *core["environment"].values(),
        ]
        for value in values:
            m = _INTERPOLATION.search(value)
            assert m and m.group(2) == ":?" and m.group(1) in m.group(3), value
            with pytest.raises(LookupError, match=m.group(1)):
                interpolate(value, {k: v for k, v in shell.items() if k != m.group(1)})
        files = {}
        for entry in core["secrets"]:
            source = Path(interpolate(spec["secrets"][entry["source"]]["file"], shell))
            assert source.is_file(), source
            files[entry["target"]] = source
        env = {key: interpolate(value, shell) for key, value in core["environment"].items()}
        authenticates(config, files, env, made.keys)
        # Redis's password: the file the core's config names is the Redis service's secret.
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
        # The core secret: where --secret-file says.
        args = build_parser().parse_args(core["command"])
        core_secret_files.add(files[args.secret_file])
    shell_service = spec["services"]["shell"]
    assert "environment" not in shell_service and "volumes" not in shell_service
    (entry,) = shell_service["secrets"]
    args = build_parser().parse_args(shell_service["command"])
    assert entry["target"] == args.secret_file
    core_secret_files.add(Path(interpolate(spec["secrets"][entry["source"]]["file"], shell)))
    (one,) = core_secret_files  # one secret, in every core and shell
    assert one.read_text().strip() == made.core_secret


def test_k8s_provides_every_key_file_and_variable_the_config_names(
    rendered: Rendered, tmp_path: Path
) -> None:
    config = load_config(CONFIG)
    pod = rendered.get("Deployment", "fair-frontend-core")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    secrets_by_name = {s["metadata"]["name"]: s for s in rendered.of_kind("Secret")}
    files = secret_files(rendered.of_kind("Secret"), pod, container, tmp_path / "core")
    env = {}
    for var in container["env"]:
        ref = var["valueFrom"].get("secretKeyRef")
        if ref is None:  # the downward API: POD_IP (--advertise)
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            continue
        env[var["name"]] = base64.b64decode(
            secrets_by_name[ref["name"]]["data"][ref["key"]]
        ).decode()
    authenticates(config, files, env, rendered.secrets.keys)
    # The config file itself comes from the ConfigMap, where the command reads it.
    args = build_parser().parse_args(container["args"])
    config_mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert args.config == f"{config_mount['mountPath']}/config.yaml"
    # Redis's password: the core's file is the Secret Redis reads its requirepass from.
    config_password_file = config.rate_limiting.storage_password_file
    assert config_password_file is not None
    password_file = files[config_password_file]
    assert password_file.read_text().strip() == rendered.secrets.redis_password
    redis_pod = rendered.get("Deployment", "redis")["spec"]["template"]["spec"]
    (redis_volume,) = [v for v in redis_pod["volumes"] if "secret" in v]
    core_volume = next(
        volumes[m["name"]]
        for m in container["volumeMounts"]
        if config_password_file.startswith(m["mountPath"] + "/")
    )
    assert redis_volume["secret"]["secretName"] == core_volume["secret"]["secretName"]
    # The core secret: the core's --secret-file and the shells' hold the same one; the
    # shells hold nothing else (no key, no password, no config).
    assert files[args.secret_file].read_text().strip() == rendered.secrets.core_secret
    shell_pod = rendered.get("Deployment", "fair-frontend-shell")["spec"]["template"]["spec"]
    (shell,) = shell_pod["containers"]
    shell_files = secret_files(rendered.of_kind("Secret"), shell_pod, shell, tmp_path / "shell")
    shell_args = build_parser().parse_args(shell["args"])
    assert list(shell_files) == [shell_args.secret_file]
    assert shell_files[shell_args.secret_file].read_text().strip() == rendered.secrets.core_secret
    assert "env" not in shell and {v["name"] for v in shell_pod["volumes"]} == {
        "core-secret",
        "tmp",
    }


def test_k8s_renders_nothing_without_the_operators_secrets(tmp_path: Path) -> None:
    """No default secret: without the files, ``kubectl kustomize`` (so ``apply -k``)
    stops and names the missing one."""
    required_tool("kubectl")
    out = kustomize(_copy_k8s(tmp_path))
    assert out.returncode != 0
    assert re.search(r"secrets/\w+\.(keys|password|secret)", out.stderr), out.stderr


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
    entry_line = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    cmd_line = re.search(r"^CMD (\[.*\])$", text, re.M)
    assert entry_line is not None and cmd_line is not None
    entry, cmd = json.loads(entry_line.group(1)), json.loads(cmd_line.group(1))
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
    assert _exposed(DOCKER / "Dockerfile") == set(defaults)
    # The serve image runs serve, the core (which the shells reach on its port) and shells.
    assert _exposed(DOCKER / "Dockerfile.serve") == {*defaults, DEFAULT_CORE_PORT}

    # Compose: the shells publish the tenants' ports on every address, the leading core's
    # operator port (metrics, statistics) is on the host's loopback only; host port =
    # container port.
    spec = compose()

    def published(service: str) -> dict[int, tuple[str, int]]:
        out = {}
        for entry in spec["services"][service].get("ports", []):
            *host, outside, inside = entry.split(":")
            out[int(inside)] = (host[0] if host else "0.0.0.0", int(outside))
        return out

    assert published("shell") == {
        DEFAULT_HTTP_PORT: ("0.0.0.0", DEFAULT_HTTP_PORT),
        DEFAULT_GRPC_PORT: ("0.0.0.0", DEFAULT_GRPC_PORT),
    }
    assert published("core") == {DEFAULT_METRICS_PORT: ("127.0.0.1", DEFAULT_METRICS_PORT)}
    assert published("core-standby") == {}
    shell = build_parser().parse_args(spec["services"]["shell"]["command"])
    assert shell.command == "shell"
    assert (shell.http_port, shell.grpc_port) == (DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT)
    triton_args = spec["services"]["triton"]["command"]
    advertised = []
    for name in ("core", "core-standby"):
        service = spec["services"][name]
        args = build_parser().parse_args(service["command"])
        assert args.command == "core" and args.config == service["volumes"][0].split(":")[1]
        assert args.listen == f"0.0.0.0:{DEFAULT_CORE_PORT}"
        assert int(args.metrics_port) == DEFAULT_METRICS_PORT == config.server.metrics_port
        assert args.metrics_host == "0.0.0.0"
        assert {int(p) for p in service["expose"]} == {DEFAULT_CORE_PORT, DEFAULT_METRICS_PORT}
        # Reaches Triton's gRPC port, as the config says, and reads its metrics port.
        assert args.triton_url == [config.triton.url]  # --triton-url repeats (a pool)
        # One lease in Redis for both; each says where it is, by its compose name.
        assert (args.election, args.lease_name) == ("redis", "fair-frontend-core")
        assert args.advertise == f"{name}:{DEFAULT_CORE_PORT}"
        advertised.append(args.advertise)
    assert shell.core == advertised  # the shells know both cores and find the leader
    assert config.triton.url == f"triton:{_flag(triton_args, '--grpc-port')}"
    assert config.triton.metrics_url == (
        f"http://triton:{_flag(triton_args, '--metrics-port')}/metrics"
    )
    assert config.rate_limiting.storage.startswith("redis://redis:6379")
    assert "redis" in spec["services"]
    # Prometheus scrapes both cores' metrics ports and Triton's.
    scrape = yaml.safe_load(PROMETHEUS.read_text())
    targets = {
        job["job_name"]: [t for s in job["static_configs"] for t in s["targets"]]
        for job in scrape["scrape_configs"]
    }
    assert targets == {
        "fair-frontend": [f"{c.split(':')[0]}:{config.server.metrics_port}" for c in advertised],
        "triton": [f"triton:{_flag(triton_args, '--metrics-port')}"],
    }
    assert scrape["rule_files"] == ["/etc/prometheus/rules.yml"]
    prom_volumes = spec["services"]["prometheus"]["volumes"]
    assert "./prometheus/rules.yml:/etc/prometheus/rules.yml:ro" in prom_volumes

    # Kubernetes: container ports, Services and annotations agree with the commands.
    core_pod = k8s_object("Deployment", "fair-frontend-core")["spec"]["template"]
    (core,) = core_pod["spec"]["containers"]
    core_args = build_parser().parse_args(core["args"])
    assert {p["name"]: p["containerPort"] for p in core["ports"]} == {
        "core": DEFAULT_CORE_PORT,
        "metrics": DEFAULT_METRICS_PORT,
    }
    assert core_args.listen == f"0.0.0.0:{DEFAULT_CORE_PORT}"
    assert int(core_args.metrics_port) == DEFAULT_METRICS_PORT
    assert core_args.advertise == f"$(POD_IP):{DEFAULT_CORE_PORT}"
    assert core_pod["metadata"]["annotations"]["prometheus.io/port"] == str(DEFAULT_METRICS_PORT)
    assert core_args.triton_url == [config.triton.url]
    core_service = k8s_object("Service", "fair-frontend-core")
    assert [p["port"] for p in core_service["spec"]["ports"]] == [DEFAULT_CORE_PORT]
    shell_pod = k8s_object("Deployment", "fair-frontend-shell")["spec"]["template"]
    (shell_container,) = shell_pod["spec"]["containers"]
    shell_args = build_parser().parse_args(shell_container["args"])
    assert shell_args.core == [f"fair-frontend-core:{DEFAULT_CORE_PORT}"]
    assert {p["name"]: p["containerPort"] for p in shell_container["ports"]} == {
        "http": shell_args.http_port,
        "grpc": shell_args.grpc_port,
    }
    assert (shell_args.http_port, shell_args.grpc_port) == (DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT)
    service = k8s_object("Service", "fair-frontend")
    assert {p["port"] for p in service["spec"]["ports"]} == {DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT}
    # The tenants' Service routes to the shells, the core's to the cores.
    for svc, pod, other in ((service, shell_pod, core_pod), (core_service, core_pod, shell_pod)):
        assert selects({"matchLabels": svc["spec"]["selector"]}, pod["metadata"]["labels"])
        assert not selects({"matchLabels": svc["spec"]["selector"]}, other["metadata"]["labels"])
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
    for service in ("triton", "core", "core-standby", "shell"):
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
    reading of the page, not ``fair_frontend.kit.testing.parse``, which keeps samples only:
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
        "fair_service_gap",
        "fair_jain_index",
        "fair_goodput",
        "fair_service_source",
        "nv_inference_queue_duration_us",
        "fair_model_rows_total",
    ):
        assert name in live_metrics, name
    assert {"tenant", "tier", "endpoint", "outcome"} <= live_metrics["fair_requests_total"]
    assert {"model", "tenant"} <= live_metrics["fair_model_tokens_total"]


def test_the_metrics_reference_is_what_a_live_page_exports(
    live_metrics: dict[str, set[str]], triton: EmbeddedTriton
) -> None:
    """The README's metrics reference (``metrics.exported_families``) against the live
    pages: each family in it is on the frontend's page, with the labels its samples
    carry where it has any; and each family of the frontend's page (not Triton's) is in
    it."""
    tritons = _names_and_labels(fetch(triton.metrics_url))
    documented = set()
    for name, kind, labels, _ in exported_families():
        series = name + "_bucket" if kind == "histogram" else name
        assert series in live_metrics, name
        seen = live_metrics[series] - ({"le"} if kind == "histogram" else set())
        assert not seen or seen == set(labels), (name, seen, labels)
        documented.add(name.removesuffix("_total"))
    suffixes = ("_total", "_created", "_bucket", "_sum", "_count")
    frontends = {n for n in live_metrics if n not in tritons and n.startswith(("fair_", "gen_ai_"))}
    for name in frontends:
        base = next((name.removesuffix(s) for s in suffixes if name.endswith(s)), name)
        assert base in documented or name in documented, name


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
            "fair_vtc_counter",
            "fair_service_gap",
            "fair_jain_index",
            "fair_goodput",
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


# Where each probe of the fleet points, by the contract of the commands: the core's on its
# operator port (live while it runs; ready on the leader only), the shells' on their HTTP
# port (ready while connected to a leading core), Triton's on its HTTP port.
CORE_PROBES = {"readinessProbe": "/v2/health/ready", "livenessProbe": "/v2/health/live"}
SHELL_PROBES = {"readinessProbe": "/v2/health/ready", "livenessProbe": "/v2/health/live"}


def _probe_port(container: dict[str, Any], probe: dict[str, Any]) -> int:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    port = probe["httpGet"]["port"]
    return int(ports[port] if isinstance(port, str) else port)


def test_probes_and_health_checks_point_at_endpoints_that_answer(
    triton: EmbeddedTriton, frontend_http: str
) -> None:
    """The shells' and Triton's probes answer 200 here: the shells' paths on the HTTP
    server of ``serve``'s shells (the same server as ``fair-frontend shell``'s; the
    command itself: ``test_fleet_commands_in_the_deploy_files_serve``), Triton's on a
    real Triton. The core's point at its operator port (--metrics-port)."""
    checked = 0
    (shell,) = k8s_object("Deployment", "fair-frontend-shell")["spec"]["template"]["spec"][
        "containers"
    ]
    (tri,) = k8s_object("Deployment", "triton")["spec"]["template"]["spec"]["containers"]
    for container, base in ((shell, frontend_http), (tri, triton.http_url)):
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            if kind not in container:
                continue
            get = container[kind]["httpGet"]
            assert _probe_port(container, container[kind]) == DEFAULT_HTTP_PORT, get
            assert http_status(base + get["path"]) == 200, (container["name"], get["path"])
            checked += 1
        assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert {k: shell[k]["httpGet"]["path"] for k in SHELL_PROBES} == SHELL_PROBES
    # A probe on a path nobody serves would fail: the check above can tell.
    assert http_status(frontend_http + "/v2/health/nope") == 404
    assert checked >= 5
    (core,) = k8s_object("Deployment", "fair-frontend-core")["spec"]["template"]["spec"][
        "containers"
    ]
    core_args = build_parser().parse_args(core["args"])
    assert {k: core[k]["httpGet"]["path"] for k in CORE_PROBES} == CORE_PROBES
    for kind in CORE_PROBES:
        assert _probe_port(core, core[kind]) == int(core_args.metrics_port)
    # Compose's health checks: the shells' and Triton's readiness URL; the cores' liveness
    # on the operator port (a standby is never ready: its readiness would keep it, and
    # the shells that wait on it, from starting).
    spec = compose()
    for service, base in (("shell", frontend_http), ("triton", triton.http_url)):
        test = " ".join(spec["services"][service]["healthcheck"]["test"])
        (url,) = re.findall(r"http://127\.0\.0\.1:(\d+)(/\S+?)'", test)
        assert int(url[0]) == DEFAULT_HTTP_PORT and url[1] == "/v2/health/ready"
        assert http_status(base + url[1]) == 200
    for service in ("core", "core-standby"):
        test = " ".join(spec["services"][service]["healthcheck"]["test"])
        (url,) = re.findall(r"http://127\.0\.0\.1:(\d+)(/\S+?)'", test)
        assert (int(url[0]), url[1]) == (DEFAULT_METRICS_PORT, "/v2/health/live")
        depends = spec["services"]["shell"]["depends_on"][service]
        assert depends == {"condition": "service_healthy"}
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


# ---- the fleet's commands, run -----------------------------------------------------------


def _localized(args: list[str], values: Mapping[str, str | list[str]]) -> list[str]:
    """A deploy file's command with the values of some flags replaced (ports, paths,
    addresses of this machine); a list value replaces every occurrence of a repeated
    flag. Every flag named must be in the command."""
    out: list[str] = []
    seen: dict[str, int] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in values:
            value = values[arg]
            n = seen.get(arg, 0)
            seen[arg] = n + 1
            out += [arg, value[n] if isinstance(value, list) else value]
            i += 2
        else:
            out.append(arg)
            i += 1
    assert set(seen) == set(values), (set(values) - set(seen), args)
    return out


def _start(
    command: list[str], folder: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``fair-frontend COMMAND`` with the serve image's packages only (``_BLOCKER``), and
    ``env`` added to the environment."""
    inherited = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    return subprocess.Popen(
        [sys.executable, "-c", _BLOCKER, *command],
        cwd=folder,  # not the repository: the installed package, as in the image
        env={**inherited, **(env or {}), "PYTHONPATH": ""},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _until(
    what: str, check: Any, procs: Mapping[str, subprocess.Popen[bytes]], timeout: float
) -> Any:
    """Poll ``check()`` until it returns something true; fail naming ``what`` (with the
    output of a process that died) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited: {proc.communicate()[0].decode()[-3000:]}"
        assert time.monotonic() < deadline, f"{what} after {timeout} s"
        time.sleep(0.05)  # polling interval, not a wait for readiness


def test_fleet_commands_in_the_deploy_files_serve(
    triton: EmbeddedTriton, rendered: Rendered, tmp_path: Path
) -> None:
    """Compose's fleet, as its files say, on this machine: Redis from the manifest's start
    script with a password; the two cores (``core``, ``core-standby``) and the shell with
    compose's commands (ports, paths and addresses made local), the serve image's
    packages only, docker/config.yaml with its Triton, Redis and key files moved here.
    Then: one core leads (its readiness 200 on the operator port), the other stands by
    (503), both live; the shell is ready and live on its HTTP port and serves a batch and
    a streamed generation (engine mode) with a tenant's key, and refuses a demo key;
    when the leader stops, the standby leads within the lease and the shell serves
    again. The kustomize and chart commands are the same commands (checked to parse)."""
    made = Secrets()
    spec = compose()
    # Redis, with the password, from the k8s manifest's script (the same as compose's).
    (tmp_path / "password").write_text(made.redis_password + "\n")
    redis_port = free_port()
    procs: dict[str, subprocess.Popen[bytes]] = {
        "redis": _start_redis(_redis_container(rendered), tmp_path, redis_port)
    }
    # docker/config.yaml, pointed at this machine's Triton and Redis and the key files here
    # (its tokenizers where the image has them, relative to its folder: docker/ here).
    data = _mounted(yaml.safe_load(CONFIG.read_text()))
    data["triton"].update(
        url=triton.grpc_url, http_url=triton.http_url, metrics_url=triton.metrics_url
    )
    data["rate_limiting"].update(
        storage=f"redis://127.0.0.1:{redis_port}/0",
        storage_password_file=str(tmp_path / "password"),
    )
    for tenant in ("acme", "initech"):
        key_file = tmp_path / f"{tenant}.keys"
        key_file.write_text(hash_key(made.keys[tenant]) + "\n")
        data["tenants"][tenant]["api_keys_file"] = str(key_file)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    secret = tmp_path / "core.secret"
    secret.write_text(made.core_secret + "\n")
    core_env = {
        "FAIR_KEYS_GLOBEX": hash_key(made.keys["globex"]),
        "FAIR_KEYS_UMBRELLA": hash_key(made.keys["umbrella"]),
    }
    cores: dict[str, tuple[str, int]] = {}  # compose name -> (listen address, metrics port)
    for name in ("core", "core-standby"):
        cores[name] = (f"127.0.0.1:{free_port()}", free_port())
    http, grpc_port = free_port(), free_port()
    try:
        for name, (listen, metrics) in cores.items():
            command = _localized(
                spec["services"][name]["command"],
                {
                    "--config": str(config),
                    "--triton-url": triton.grpc_url,
                    "--listen": listen,
                    "--secret-file": str(secret),
                    "--advertise": listen,
                    "--metrics-port": str(metrics),
                    "--metrics-host": "127.0.0.1",
                },
            )
            procs[name] = _start(command, tmp_path, core_env)
        shell_command = _localized(
            spec["services"]["shell"]["command"],
            {
                "--core": [listen for listen, _ in cores.values()],
                "--secret-file": str(secret),
                "--host": "127.0.0.1",
                "--http-port": str(http),
                "--grpc-port": str(grpc_port),
            },
        )
        procs["shell"] = _start(shell_command, tmp_path)

        def health(name: str, path: str) -> int | None:
            return http_status_or_none(f"http://127.0.0.1:{cores[name][1]}/v2/health/{path}")

        def leader() -> str | None:
            ready = [name for name in cores if name in procs and health(name, "ready") == 200]
            return ready[0] if len(ready) == 1 else None

        first = _until("no single core leads", leader, procs, 60)
        (standby,) = [name for name in cores if name != first]
        # The standby may still be starting (it started beside the leader): live, once up.
        _until("the standby is not live", lambda: health(standby, "live") == 200, procs, 60)
        assert health(standby, "ready") == 503
        assert health(first, "live") == 200
        shell_url = f"http://127.0.0.1:{http}"
        _until(
            "the shell is not ready",
            lambda: http_status_or_none(shell_url + "/v2/health/ready") == 200,
            procs,
            60,
        )
        assert http_status(shell_url + "/v2/health/live") == 200

        def embed(key: str) -> int:
            body = json.dumps(
                {"inputs": [{"name": "INPUT_IDS", "shape": [1, 4], "datatype": "INT32",
                             "data": [1, 2, 3, 4]}]}
            ).encode()  # fmt: skip
            request = urllib.request.Request(
                f"{shell_url}/v2/models/embed/infer",
                data=body,
                headers={"authorization": f"Bearer {key}"},
            )
            try:
                with _HTTP.open(request, timeout=30) as response:
                    return int(response.status)
            except urllib.error.HTTPError as err:
                return int(err.code)

        assert embed(made.keys["acme"]) == 200
        assert embed(DEMO_KEYS["acme"]) == 401
        stream = urllib.request.Request(
            f"{shell_url}/v2/models/llm/generate_stream",
            data=json.dumps(
                {"text_input": "hello", "parameters": {"stream": True, "max_tokens": 3}}
            ).encode(),
            headers={
                "authorization": f"Bearer {made.keys['globex']}",
                "content-type": "application/json",
            },
        )
        with _HTTP.open(stream, timeout=30) as response:
            assert response.read().count(b"data: ") == 3
        # The leader goes: the standby takes the lease, the shell follows it.
        procs[first].send_signal(signal.SIGTERM)
        procs.pop(first).communicate(timeout=60)
        lease_s = float(_flag_value(spec["services"][standby]["command"], "--lease-s"))
        _until("the standby did not take over", lambda: leader() == standby, procs, lease_s + 15)
        _until(
            "the shell did not follow the new leader",
            lambda: (
                http_status_or_none(shell_url + "/v2/health/ready") == 200
                and embed(made.keys["initech"]) == 200
            ),
            procs,
            30,
        )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def _flag_value(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_compose_triton_command_is_the_k8s_one() -> None:
    """One Triton invocation: the compose service and the k8s Deployment run the same
    (and the Helm chart's StatefulSet: ``test_helm_chart.py``), with each model's GPU
    config (``--model-config-name``)."""
    compose_triton = compose()["services"]["triton"]
    k8s_triton = k8s_object("Deployment", "triton")["spec"]["template"]["spec"]["containers"][0]
    assert compose_triton["entrypoint"] == k8s_triton["command"] == ["tritonserver"]
    assert compose_triton["command"] == k8s_triton["args"]
    assert shlex.split(" ".join(k8s_triton["args"]))[0].startswith("--model-repository=")
    repo = _flag(k8s_triton["args"], "--model-repository")
    up = build_parser().parse_args(_dockerfile_command(DOCKER / "Dockerfile"))
    assert repo == up.model_repository
    assert _flag(k8s_triton["args"], "--model-config-name") == "gpu"


def test_kustomize_builds_the_manifests_into_one_namespace(rendered: Rendered) -> None:
    """``kubectl kustomize`` (offline) renders every object, in the fair-frontend
    namespace, and the three Secrets from the operator's files."""
    expected = [o for o in k8s_objects() if o["kind"] != "Kustomization"]
    made = [o for o in rendered.objects if o["kind"] != "Secret"]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in made) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in expected
    )
    keys, password = rendered.secret("fair-frontend-keys"), rendered.secret("redis-password")
    core_secret = rendered.secret("fair-frontend-core-secret")
    assert len(rendered.of_kind("Secret")) == 3
    assert set(keys["data"]) == {"acme.keys", "initech.keys", "globex", "umbrella"}
    assert base64.b64decode(password["data"]["password"]).decode().strip() == (
        rendered.secrets.redis_password
    )
    assert base64.b64decode(core_secret["data"]["secret"]).decode().strip() == (
        rendered.secrets.core_secret
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
    "fair-frontend-core": {"/tmp"},  # Unix sockets, if any: the root is read-only
    "fair-frontend-shell": {"/tmp"},
    "redis": {"/tmp", "/data"},  # the generated redis.conf; the working directory
    "triton": {"/dev/shm", "/tmp"},  # the Python backend stubs' shared memory; HOME's caches
    "prometheus": {"/prometheus"},  # the TSDB
}


def test_every_pod_runs_non_root_read_only_without_privileges(rendered: Rendered) -> None:
    deployments = rendered.of_kind("Deployment")
    assert {d["metadata"]["name"] for d in deployments} == set(WRITABLE)
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        # Only Prometheus talks to the Kubernetes API (pod discovery; the cores' lease is
        # in Redis).
        assert_locked_down(
            name, deployment["spec"]["template"]["spec"], WRITABLE[name], name == "prometheus"
        )


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
            else:  # ... and only on the shells
                assert name == "shell", (name, port)
    for name in ("core", "core-standby", "shell", "triton", "redis"):
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
from fair_frontend.backends.triton.embedded import EmbeddedTriton, default_model_repository
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


# ---- NetworkPolicy: who may connect to whom (the evaluator: tests/deploy_support.py) ---


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
        n["metadata"]["name"]: n["metadata"].get("labels") or {}
        for n in rendered.of_kind("Namespace")
    }
    return workload_pods(rendered.objects, namespaces)


def _outsiders(namespace_labels: Mapping[str, str]) -> list[Endpoint]:
    """Everyone who is not the platform: tenants' pods in another namespace (one even
    labelled as a core), another workload in the namespace, an address outside."""
    return [
        Endpoint("tenant-pod", "tenants", {"app": "client"}, {"kubernetes.io/metadata.name": "t"}),
        Endpoint(
            "impostor",
            "tenants",
            {"app.kubernetes.io/name": "fair-frontend", "app.kubernetes.io/component": "core"},
            {"kubernetes.io/metadata.name": "tenants"},
        ),
        Endpoint(
            "neighbour", "fair-frontend", {"app.kubernetes.io/name": "debug"}, namespace_labels
        ),
        Endpoint("internet", None),
    ]


def test_network_policies_let_only_the_fleet_reach_its_parts(rendered: Rendered) -> None:
    """Every source (each pod, Grafana, the outsiders) to every pod on every port the
    pods serve: allowed exactly where networkpolicy.yaml's table says."""
    policies = rendered.of_kind("NetworkPolicy")
    pods = _pods(rendered)
    core, shell, triton = pods["fair-frontend-core"], pods["fair-frontend-shell"], pods["triton"]
    redis_pod, prom = pods["redis"], pods["prometheus"]
    grafana = Endpoint(
        "grafana",
        "monitoring",
        {"app.kubernetes.io/name": "grafana"},
        {"kubernetes.io/metadata.name": "monitoring"},
    )
    outsiders = _outsiders(core.namespace_labels)
    # The tenants' ports are open to anyone outside the namespace (Grafana's pod too).
    tenants = [o for o in [*outsiders, grafana] if o.namespace != core.namespace]
    allowed = {
        *((t.name, "fair-frontend-shell", port) for t in tenants for port in (8000, 8001)),
        ("fair-frontend-shell", "fair-frontend-core", DEFAULT_CORE_PORT),
        # what the core grants a shell: rows over HTTP or gRPC, streams over either
        *(("fair-frontend-shell", "triton", port) for port in (8000, 8001)),
        *(("fair-frontend-core", "triton", port) for port in (8000, 8001, 8002)),
        ("fair-frontend-core", "redis", 6379),
        ("prometheus", "fair-frontend-core", DEFAULT_METRICS_PORT),
        ("prometheus", "triton", 8002),
        ("grafana", "prometheus", 9090),
    }
    assert reachable(policies, [*pods.values(), grafana, *outsiders], pods.values()) == allowed
    # No way out but DNS (and Prometheus's to the API server), for every pod.
    internet = Endpoint("internet", None)
    for pod in pods.values():
        assert connects(policies, pod, Endpoint("dns", None), 53, "UDP"), pod.name
        assert connects(policies, pod, internet, 443) is (pod is prom), pod.name
    (deny,) = [p for p in policies if p["metadata"]["name"] == "default-deny"]
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    # The negative control: without the policies, the tenants reach Triton and Redis.
    tenant = outsiders[0]
    assert connects([], tenant, triton, 8001) and connects([], tenant, redis_pod, 6379)
    assert ("tenant-pod", "fair-frontend-core", 8010) in reachable([], outsiders, [core])
    assert shell.ports == {"http": 8000, "grpc": 8001}


def test_the_policies_ports_are_the_pods_ports(rendered: Rendered) -> None:
    """A policy that names a port the pod does not serve would silently cut it off."""
    assert_policy_ports_are_served(rendered.of_kind("NetworkPolicy"), _pods(rendered))


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
    required_tool("redis-server")  # the script runs it from PATH
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
            assert isinstance(limiter.storage, RedisStorage)
            await limiter.storage.ping()
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
