"""The deployment files in ``docker/`` against the real frontend and Triton.

No Docker engine runs here, so the images are not built; what can be checked is: every
YAML and JSON file parses; the metric names (and the labels they are filtered and
grouped by) in the Grafana dashboard and the Prometheus rules exist on a live frontend's
and Triton's metrics pages after some traffic; the Kubernetes probes and the compose
health checks point at endpoints that answer 200; the ports agree with the CLI defaults
everywhere; the secrets are wired to the config's ``api_keys_file`` / ``api_keys_env``;
the commands in the Dockerfiles, compose and the manifests parse with the real CLI; the
serve image's dependency set (no torch, no nvidia-pytriton) is enough to run ``serve``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from fair_frontend.auth import KeyRing
from fair_frontend.cli import _listen, build_parser
from fair_frontend.config import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_METRICS_PORT,
    Config,
    load_config,
)
from fair_frontend.embedded import EmbeddedTriton, free_port
from tests.support import ROOT, config_dict, ids_input, make_config, running_frontend

DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "fair_frontend.json"
RULES = DOCKER / "prometheus" / "rules.yml"
PROMETHEUS = DOCKER / "prometheus" / "prometheus.yml"
COMPOSE = DOCKER / "docker-compose.yaml"
CONFIG = DOCKER / "config.yaml"
# The demo keys the secrets hold (hashed), by tenant.
DEMO_KEYS = {t: f"{t}-demo-key" for t in ("acme", "globex", "initech", "umbrella")}
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
        "k8s/secret.yaml",
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
    configmap = k8s_object("ConfigMap", "fair-frontend-config")
    assert yaml.safe_load(configmap["data"]["config.yaml"]) == yaml.safe_load(CONFIG.read_text())
    rules = next(d for d in yaml_docs(K8S / "prometheus.yaml") if d["kind"] == "ConfigMap")
    assert yaml.safe_load(rules["data"]["rules.yml"]) == yaml.safe_load(RULES.read_text())


def _authenticates(config: Config, files: dict[str, Path], env: dict[str, str]) -> None:
    """With key files at ``files`` (config path -> real file) and ``env``, every demo key
    authenticates as its tenant, and nothing else does."""
    tenants = {}
    for name, tenant in config.tenants.items():
        update = {}
        if tenant.api_keys_file:
            assert tenant.api_keys_file in files, f"{name}: {tenant.api_keys_file} not provided"
            update["api_keys_file"] = str(files[tenant.api_keys_file])
        tenants[name] = tenant.model_copy(update=update)
    ring = KeyRing.from_config(config.model_copy(update={"tenants": tenants}), environ=env)
    for tenant, key in DEMO_KEYS.items():
        assert ring.tenant_for(key) == tenant
    assert ring.tenant_for("acme-demo-key ") is None and ring.tenant_for("nope") is None


def test_compose_provides_every_key_file_and_variable_the_config_names(tmp_path: Path) -> None:
    config = load_config(CONFIG)
    spec = compose()
    frontend = spec["services"]["frontend"]
    files = {}
    for entry in frontend["secrets"]:
        source = DOCKER / spec["secrets"][entry["source"]]["file"]
        assert source.is_file(), source
        files[entry["target"]] = source
    env = {}
    for name, value in frontend["environment"].items():
        m = re.fullmatch(r"\$\{\w+:-(.*)\}", value)  # ${VAR:-default}: the demo default
        env[name] = m.group(1) if m else value
    _authenticates(config, files, env)


def test_k8s_provides_every_key_file_and_variable_the_config_names(tmp_path: Path) -> None:
    config = load_config(CONFIG)
    secret = k8s_object("Secret", "fair-frontend-keys")
    pod = k8s_object("Deployment", "fair-frontend")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    files = {}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "secret" not in volume:
            continue
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        for item in volume["secret"]["items"]:
            real = tmp_path / item["path"]
            real.write_text(secret["stringData"][item["key"]])
            files[f"{mount['mountPath']}/{item['path']}"] = real
    env = {}
    for var in container["env"]:
        ref = var["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"]
        env[var["name"]] = secret["stringData"][ref["key"]]
    _authenticates(config, files, env)
    # The config file itself comes from the ConfigMap, where the command reads it.
    args = build_parser().parse_args(container["args"])
    config_mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert args.config == f"{config_mount['mountPath']}/config.yaml"


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
    up_listen = _listen(up, load_config(ROOT / "examples" / "config.yaml"))
    assert (up_listen.http_port, up_listen.grpc_port, up_listen.metrics_port) == defaults
    for dockerfile in ("Dockerfile", "Dockerfile.serve"):
        assert _exposed(DOCKER / dockerfile) == set(defaults)

    # Compose: the frontend publishes the defaults, host port = container port.
    spec = compose()
    frontend = spec["services"]["frontend"]
    published = {tuple(int(x) for x in p.split(":")) for p in frontend["ports"]}
    assert published == {(p, p) for p in defaults}
    args = build_parser().parse_args(frontend["command"])
    assert args.command == "serve" and args.http_port is None and args.metrics_port is None
    assert args.config == frontend["volumes"][0].split(":")[1]
    # ... reaches Triton's gRPC port, as the config says, and reads Triton's metrics port.
    triton_args = spec["services"]["triton"]["command"]
    assert args.triton_url == config.triton.url == f"triton:{_flag(triton_args, '--grpc-port')}"
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
    assert k8s_args.triton_url == config.triton.url
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
    (no storage error so far, no tenant backlogged right now) still exists.
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
        names = _names_and_labels(_fetch(f"http://127.0.0.1:{fe.server.metrics_port}/metrics"))
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
        page = _fetch(f"http://127.0.0.1:{fe.server.metrics_port}/metrics")
    for name, labels in _names_and_labels(page).items():
        names.setdefault(name, set()).update(labels)
    for name, labels in _names_and_labels(_fetch(triton.metrics_url)).items():
        names.setdefault(name, set()).update(labels)
    return names


def _fetch(url: str) -> str:
    with _HTTP.open(url, timeout=5) as response:
        text: str = response.read().decode()
        return text


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


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_builds_the_manifests_into_one_namespace() -> None:
    """``kubectl kustomize`` (offline) renders every object, in the fair-frontend namespace."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    expected = [o for o in k8s_objects() if o["kind"] != "Kustomization"]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in rendered) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in expected
    )
    for obj in rendered:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "fair-frontend", obj["metadata"]
