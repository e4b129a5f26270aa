"""The Helm chart (``docker/helm/fair-frontend``): the fleet on Kubernetes.

Rendered offline with the Helm v4 library itself (``helm-python-sdk``: Helm's Go SDK
through a C ABI; no helm binary, no cluster, so ``lookup`` finds nothing), with the
default values and the variants in ``VARIANTS`` (each with the tenants' keys the chart
refuses to render without), and linted. Over the rendered objects: ``helm lint`` is
clean; every object is valid; the commands parse with the real CLI and their ports are
the CLI's defaults; the probes point at the paths the commands serve; the config the
core gets is valid, serves ``llm`` in engine mode and lists one Triton per StatefulSet
pod, the same as the core's ``--triton-url``; the keys, Redis's password and the core
secret are wired where the config and the commands read them; the core is two replicas
with a PodDisruptionBudget, and only the ready one (the leader) gets the shells; the
NetworkPolicies, evaluated over the rendered objects, allow exactly what the chart's
table says; every pod is non-root on a read-only root filesystem without privileges;
the monitoring objects carry docker/'s alert rules and dashboard; KEDA's triggers read
metrics the frontend exports. The chart refuses, naming what to set, to render without
keys and with settings that would break the fleet.

Schemas: built-in kinds are validated against the Kubernetes API's OpenAPI schemas
(``kubernetes-validate``, strict). The CRD kinds (ServiceMonitor and PrometheusRule,
monitoring.coreos.com/v1; ScaledObject, keda.sh/v1alpha1) are not in those schemas and
their CRDs are not vendored here: they are checked against minimal hand-written schemas
(``CRD_SCHEMAS``: the fields the chart sets, no unknown field where it writes), not the
projects' full CRDs.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import secrets
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema  # kubernetes-validate's own dependency
import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest

from fair_frontend.auth import hash_key
from fair_frontend.cli import build_parser
from fair_frontend.config import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_METRICS_PORT,
    Config,
    load_config,
    parse_config,
    resolve_relative_paths,
)
from fair_frontend.core.metrics import STATE_GAUGES, FrontendMetrics
from fair_frontend.fleet import DEFAULT_CORE_PORT
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
    secret_value,
    selects,
    workload_pods,
)
from tests.support import ROOT

DOCKER = ROOT / "docker"
CHART = DOCKER / "helm" / "fair-frontend"
CONFIG = DOCKER / "config.yaml"
RELEASE, NAMESPACE = "fair-frontend", "inference"
FULLNAME = "fair-frontend"  # the release name holds the chart's: no suffix
# The entries of the keys Secret docker/config.yaml reads: files (api_keys_file) and
# tenants (api_keys_env).
KEY_ENTRIES = {"acme": "acme.keys", "initech": "initech.keys", "globex": "globex"}
KEY_ENTRIES["umbrella"] = "umbrella"

# Overrides of the default values, each rendered and checked like the default.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "election-kubernetes": {"core": {"election": "kubernetes"}},
    "external-redis": {
        "redis": {
            "external": {
                "url": "redis://redis.shared.svc:6380/2",
                "passwordSecret": {"name": "shared-redis", "key": "pw"},
                "to": [{"namespaceSelector": {"matchLabels": {"team": "shared"}}}],
            }
        }
    },
    "keda": {
        "triton": {"replicas": 2, "maxReplicas": 5, "autoscaling": {"keda": {"enabled": True}}}
    },
    "monitoring": {
        "monitoring": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "prometheusRule": {"enabled": True},
        }
    },
    "ingress-controller": {
        "networkPolicy": {"gateway": {"ingressControllerNamespace": "ingress-nginx"}},
        "shell": {"autoscaling": {"enabled": False}, "replicas": 4},
        "triton": {"replicas": 3, "nodeSelector": {"nvidia.com/gpu.present": "true"}},
    },
    "prometheus-by-namespace-labels": {
        "networkPolicy": {
            "prometheus": {"namespace": None, "namespaceLabels": {"purpose": "monitoring"}}
        }
    },
    "mutual-tls": {"coreTls": {"coreSecret": "core-tls", "shellSecret": "shell-tls"}},
    "tls-ingress": {
        "ingress": {
            "enabled": True,
            "httpHost": "infer.example.com",
            "grpcHost": "grpc.infer.example.com",
            "tls": {"secretName": "infer-tls"},
        },
        "networkPolicy": {"gateway": {"ingressControllerNamespace": "ingress-nginx"}},
    },
    "existing-secrets": {
        "keys": {"existingSecret": "tenant-keys"},
        "coreSecret": {"existingSecret": "core-secret"},
        "redis": {"auth": {"existingSecret": "redis-auth"}},
    },
}


def merged(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@dataclass
class Release:
    """One rendering of the chart: its objects (NOTES.txt apart) and what it was given."""

    values: dict[str, Any]
    objects: list[dict[str, Any]]
    notes: str
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> its key (plain)

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in self.objects])
        return found[0]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def pod(self, kind: str, name: str) -> dict[str, Any]:
        spec: dict[str, Any] = self.get(kind, name)["spec"]["template"]["spec"]
        return spec

    def container(self, kind: str, name: str) -> dict[str, Any]:
        (container,) = self.pod(kind, name)["containers"]
        return container

    def option(self, path: str) -> Any:
        """A value as the release has it: the chart's default unless overridden."""
        value: Any = self.values
        for part in path.split("."):
            value = value[part]
        return value


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render_raw(chart: helm.Chart, values: dict[str, Any]) -> dict[str, str]:
    return chart.render(values, name=RELEASE, namespace=NAMESPACE)


def parse(rendered: dict[str, str]) -> tuple[list[dict[str, Any]], str]:
    objects, notes = [], ""
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects, notes


def render(chart: helm.Chart, variant: str) -> Release:
    """A variant, with the tenants' keys (hashed, in keys.data) unless it names a Secret."""
    keys = {t: secrets.token_hex(16) for t in KEY_ENTRIES}
    given = VARIANTS[variant]
    if "existingSecret" not in given.get("keys", {}):
        given = merged(
            given, {"keys": {"data": {KEY_ENTRIES[t]: hash_key(k) for t, k in keys.items()}}}
        )
    objects, notes = parse(render_raw(chart, given))
    return Release(chart.merge_values(given), objects, notes, keys)


@functools.cache
def _cached(variant: str) -> Release:
    with helm.Chart.load(CHART) as loaded:
        return render(loaded, variant)


@pytest.fixture(params=list(VARIANTS))
def release(request: pytest.FixtureRequest) -> Release:
    return _cached(request.param)


def core_args(rel: Release) -> Any:
    return build_parser().parse_args(rel.container("Deployment", f"{FULLNAME}-core")["args"])


def shell_args(rel: Release) -> Any:
    return build_parser().parse_args(rel.container("Deployment", f"{FULLNAME}-shell")["args"])


def rendered_config(rel: Release) -> Config:
    """The config the chart's core reads, its tokenizers' paths made absolute from the
    folder it is mounted in (/etc/fair-frontend, as docker/config.yaml is here: the
    image's tokenizers are at those paths, ``test_deploy_files``)."""
    configmap = rel.get("ConfigMap", f"{FULLNAME}-config")
    data = yaml.safe_load(configmap["data"]["config.yaml"])
    resolve_relative_paths(data, CONFIG.parent)
    return parse_config(data, "the chart's config")


def triton_hosts(rel: Release) -> list[str]:
    """The stable names of the StatefulSet's pods, as many as the core is to know."""
    sts = rel.get("StatefulSet", f"{FULLNAME}-triton")
    keda = rel.of_kind("ScaledObject")
    count = keda[0]["spec"]["maxReplicaCount"] if keda else sts["spec"]["replicas"]
    return [
        f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}.{NAMESPACE}.svc.cluster.local"
        for i in range(count)
    ]


# ---- lint, and what the chart refuses ---------------------------------------------------------


def test_the_chart_lints_clean() -> None:
    """``helm lint --strict`` with the keys given: no warning, no error (the one info
    message, no icon, is not a finding about the chart's content)."""
    report = helm.lint(CHART, {"keys": {"existingSecret": "tenant-keys"}}, strict=True)
    assert report["errors"] == [] and report["total_charts_linted"] == 1
    findings = [m for m in report["messages"] if m["severity"] >= 2]
    assert findings == [], findings
    metadata = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert metadata["apiVersion"] == "v2" and metadata["name"] == "fair-frontend"


def _refusal(chart: helm.Chart, values: dict[str, Any]) -> str:
    with pytest.raises(helm.HelmRenderError) as err:
        render_raw(chart, values)
    return str(err.value)


def test_the_chart_renders_nothing_without_the_tenants_keys(chart: helm.Chart) -> None:
    """No key ships: without keys.existingSecret or keys.data the chart stops, naming the
    entries the config reads and how to give them; with some missing, it names those."""
    message = _refusal(chart, {})
    assert "keys.existingSecret" in message and "keys.data" in message
    for entry in KEY_ENTRIES.values():
        assert entry in message
    assert "hash-key" in message
    partial = {"keys": {"data": {"acme.keys": hash_key("x"), "globex": hash_key("y")}}}
    message = _refusal(chart, partial)
    assert re.search(r"no value for initech\.keys, umbrella\b", message), message
    both = {"keys": {"existingSecret": "k", "data": {"acme.keys": "x"}}}
    assert "not both" in _refusal(chart, both)
    # A config whose keys are all inline (hashes) needs no Secret.
    data = yaml.safe_load(CONFIG.read_text())
    for tenant in data["tenants"].values():
        tenant.pop("api_keys_file", None)
        tenant.pop("api_keys_env", None)
        tenant["api_keys"] = [hash_key(secrets.token_hex(8))]
    objects, _ = parse(render_raw(chart, {"config": yaml.safe_dump(data)}))
    core = next(o for o in objects if o["metadata"]["name"] == f"{FULLNAME}-core")
    volumes = {v["name"] for v in core["spec"]["template"]["spec"]["volumes"]}
    assert "keys" not in volumes and not any(
        o["metadata"]["name"] == f"{FULLNAME}-keys" for o in objects
    )


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"core": {"election": "none"}}, "core.election: none"),
        # null removes a default (Helm merges maps: {} would keep the default's labels)
        ({"networkPolicy": {"gateway": {"podLabels": None}}}, "nobody could reach the shells"),
        (
            {"networkPolicy": {"prometheus": {"namespace": None}}},
            "namespace and namespaceLabels are both empty",
        ),
        (
            {"networkPolicy": {"prometheus": {"podLabels": None, "namespace": ""}}},
            "every pod of the cluster",
        ),
        ({"redis": {"external": {"url": "redis://:pw@r:6379/0"}}}, "holds credentials"),
        ({"redis": {"external": {"url": "http://r:6379"}}}, "redis://host:port/db"),
        (
            {
                "triton": {
                    "replicas": 3,
                    "maxReplicas": 2,
                    "autoscaling": {"keda": {"enabled": True}},
                }
            },
            "triton.maxReplicas (2) is below triton.replicas (3)",
        ),
        ({"config": "tenants: [unclosed"}, "config: not valid YAML"),
        (
            {
                "ingress": {
                    "enabled": True,
                    "httpHost": "a.example.com",
                    "grpcHost": "b.example.com",
                }
            },
            "ingress.tls.secretName is empty",
        ),
        ({"ingress": {"enabled": True, "httpHost": "a.example.com"}}, "grpcHost are both needed"),
        (
            {
                "ingress": {
                    "enabled": True,
                    "httpHost": "a.example.com",
                    "grpcHost": "b.example.com",
                    "tls": {"secretName": "t"},
                }
            },
            "ingressControllerNamespace is empty",
        ),
        (
            {"config": "tenants: {acme: {tier: t, api_keys_file: /etc/keys/acme}}"},
            "tenants.acme.api_keys_file /etc/keys/acme",
        ),
    ],
)
def test_the_chart_refuses_what_would_break_the_fleet(
    chart: helm.Chart, values: dict[str, Any], says: str
) -> None:
    """With two cores and no election both would lead; a gateway or Prometheus selector
    left empty would open the ports to everyone (or no one); a password in a URL ends up
    in the ConfigMap; a key file the chart does not mount would be missing."""
    values = merged({"keys": {"existingSecret": "k"}}, values)
    assert says in _refusal(chart, values)


# ---- the objects -------------------------------------------------------------------------

# Minimal schemas of the CRD kinds the chart writes: the fields it sets, typed, and no
# other field at the levels it writes (a misspelt one is an error, as kubectl's strict
# validation against the real CRD would say).
_META = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
_SELECTOR = {
    "type": "object",
    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
    "additionalProperties": False,
}


def _kind(api: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api},
            "kind": {"const": kind},
            "metadata": _META,
            "spec": spec,
        },
        "additionalProperties": False,
    }


CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _kind(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        {
            "type": "object",
            "required": ["selector", "endpoints"],
            "properties": {
                "jobLabel": {"type": "string"},
                "namespaceSelector": {
                    "type": "object",
                    "properties": {"matchNames": {"type": "array", "items": {"type": "string"}}},
                    "additionalProperties": False,
                },
                "selector": _SELECTOR,
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                        "additionalProperties": False,
                    },
                },
            },
            "additionalProperties": False,
        },
    ),
    "PrometheusRule": _kind(
        "monitoring.coreos.com/v1",
        "PrometheusRule",
        {
            "type": "object",
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string"},
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["expr"],
                                    "properties": {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        "expr": {"type": "string"},
                                        "for": {"type": "string"},
                                        "labels": {"type": "object"},
                                        "annotations": {"type": "object"},
                                    },
                                    "additionalProperties": False,
                                },
                            },
                        },
                        "additionalProperties": False,
                    },
                }
            },
            "additionalProperties": False,
        },
    ),
    "ScaledObject": _kind(
        "keda.sh/v1alpha1",
        "ScaledObject",
        {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                    },
                    "additionalProperties": False,
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer"},
                "cooldownPeriod": {"type": "integer"},
                "advanced": {"type": "object"},
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"const": "prometheus"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "metadata": {
                                "type": "object",
                                "required": ["serverAddress", "query", "threshold"],
                                "properties": {
                                    "serverAddress": {"type": "string"},
                                    "query": {"type": "string"},
                                    "threshold": {"type": "string"},
                                },
                                "additionalProperties": False,
                            },
                        },
                        "additionalProperties": False,
                    },
                },
            },
            "additionalProperties": False,
        },
    ),
}


def test_the_rendered_objects_are_valid(release: Release) -> None:
    """Built-in kinds against the API's schemas (strict); CRD kinds against CRD_SCHEMAS."""
    version = kubernetes_validate.latest_version()
    for obj in release.objects:
        if obj["kind"] in CRD_SCHEMAS:
            jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]])
        else:
            kubernetes_validate.validate(obj, version, strict=True)
        assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]
    names = [(o["kind"], o["metadata"]["name"]) for o in release.objects]
    assert len(names) == len(set(names)), names
    # The validators can tell: a misspelt field is refused.
    broken = json.loads(json.dumps(release.get("Deployment", f"{FULLNAME}-core")))
    broken["spec"]["replica"] = broken["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)
    for crd in release.objects:
        if crd["kind"] in CRD_SCHEMAS:
            wrong = json.loads(json.dumps(crd))
            wrong["spec"]["endpoint" if crd["kind"] == "ServiceMonitor" else "trigger"] = []
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(wrong, CRD_SCHEMAS[crd["kind"]])


def test_what_each_variant_renders(release: Release) -> None:
    """The components, and the optional objects exactly where their values ask."""
    kinds = {(o["kind"], o["metadata"]["name"]) for o in release.objects}
    assert {
        ("Deployment", f"{FULLNAME}-core"),
        ("Deployment", f"{FULLNAME}-shell"),
        ("StatefulSet", f"{FULLNAME}-triton"),
        ("Service", FULLNAME),
        ("Service", f"{FULLNAME}-core"),
        ("Service", f"{FULLNAME}-core-metrics"),
        ("Service", f"{FULLNAME}-triton"),
        ("Service", f"{FULLNAME}-triton-headless"),
        ("ConfigMap", f"{FULLNAME}-config"),
        ("PodDisruptionBudget", f"{FULLNAME}-core"),
        ("PodDisruptionBudget", f"{FULLNAME}-shell"),
    } <= kinds
    external = bool(release.option("redis.external.url"))
    assert (("Deployment", f"{FULLNAME}-redis") in kinds) is not external
    kubernetes = release.option("core.election") == "kubernetes"
    for kind in ("ServiceAccount", "Role", "RoleBinding"):
        assert ((kind, f"{FULLNAME}-core") in kinds) is kubernetes
    hpa = release.option("shell.autoscaling.enabled")
    assert (("HorizontalPodAutoscaler", f"{FULLNAME}-shell") in kinds) is hpa
    keda = release.option("triton.autoscaling.keda.enabled")
    assert bool(release.of_kind("ScaledObject")) is keda
    assert bool(release.of_kind("ServiceMonitor")) is release.option(
        "monitoring.serviceMonitor.enabled"
    )
    assert bool(release.of_kind("PrometheusRule")) is release.option(
        "monitoring.prometheusRule.enabled"
    )
    assert ("ConfigMap", f"{FULLNAME}-dashboard") in kinds
    assert len(release.of_kind("NetworkPolicy")) == (5 if external else 6)
    ingresses = {o["metadata"]["name"] for o in release.of_kind("Ingress")}
    assert ingresses == (
        {f"{FULLNAME}-http", f"{FULLNAME}-grpc"} if release.option("ingress.enabled") else set()
    )


def test_the_defaults_keep_the_crd_kinds_off() -> None:
    """ServiceMonitor and PrometheusRule need the Prometheus Operator's CRDs, ScaledObject
    KEDA's: off unless asked (an install fails on a kind the cluster does not know); the
    dashboard is a plain ConfigMap, on."""
    rel = _cached("default")
    assert not {"ServiceMonitor", "PrometheusRule", "ScaledObject"} & {
        o["kind"] for o in rel.objects
    }
    dashboard = rel.get("ConfigMap", f"{FULLNAME}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"


# ---- commands, ports, probes ---------------------------------------------------------------


def test_the_commands_parse_and_listen_on_the_cli_defaults(release: Release) -> None:
    core = release.container("Deployment", f"{FULLNAME}-core")
    args = core_args(release)
    assert args.command == "core"
    assert args.listen == f"0.0.0.0:{DEFAULT_CORE_PORT}"
    assert (int(args.metrics_port), args.metrics_host) == (DEFAULT_METRICS_PORT, "0.0.0.0")
    assert {p["name"]: p["containerPort"] for p in core["ports"]} == {
        "core": DEFAULT_CORE_PORT,
        "metrics": DEFAULT_METRICS_PORT,
    }
    assert args.election == release.option("core.election")
    assert args.lease_s == 3 and args.lease_name == f"{FULLNAME}-core"
    # --advertise: the pod's own address, from the downward API (Kubernetes expands
    # $(POD_IP) in args); the Lease's namespace likewise.
    assert args.advertise == f"$(POD_IP):{DEFAULT_CORE_PORT}"
    env = {e["name"]: e.get("valueFrom", {}) for e in core["env"]}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    config_mount = next(m for m in core["volumeMounts"] if m["name"] == "config")
    assert args.config == f"{config_mount['mountPath']}/config.yaml"

    shell = release.container("Deployment", f"{FULLNAME}-shell")
    sargs = shell_args(release)
    assert sargs.command == "shell" and sargs.host == "0.0.0.0" and sargs.workers == 1
    assert (sargs.http_port, sargs.grpc_port) == (DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT)
    assert {p["name"]: p["containerPort"] for p in shell["ports"]} == {
        "http": DEFAULT_HTTP_PORT,
        "grpc": DEFAULT_GRPC_PORT,
    }
    # The shells dial the core's Service, on the port the core listens on.
    core_service = release.get("Service", f"{FULLNAME}-core")
    (port,) = core_service["spec"]["ports"]
    assert sargs.core == [f"{core_service['metadata']['name']}:{port['port']}"]
    assert port["port"] == DEFAULT_CORE_PORT and port["targetPort"] == "core"
    tenants = release.get("Service", FULLNAME)
    assert {p["name"]: (p["port"], p["targetPort"]) for p in tenants["spec"]["ports"]} == {
        "http": (DEFAULT_HTTP_PORT, "http"),
        "grpc": (DEFAULT_GRPC_PORT, "grpc"),
    }
    # Each Service routes to its own component.
    core_labels = release.get("Deployment", f"{FULLNAME}-core")["spec"]["template"]["metadata"]
    shell_labels = release.get("Deployment", f"{FULLNAME}-shell")["spec"]["template"]["metadata"]
    routes = ((core_service, core_labels, shell_labels), (tenants, shell_labels, core_labels))
    for service, mine, other in routes:
        assert selects({"matchLabels": service["spec"]["selector"]}, mine["labels"])
        assert not selects({"matchLabels": service["spec"]["selector"]}, other["labels"])


def test_the_triton_command_is_the_compose_and_kustomize_one(release: Release) -> None:
    """One Triton invocation everywhere (compose, kustomize, the chart), with each model's
    GPU config; its ports are the ones the core and the shells are given."""
    triton = release.container("StatefulSet", f"{FULLNAME}-triton")
    compose = yaml.safe_load((DOCKER / "docker-compose.yaml").read_text())["services"]["triton"]
    (k8s,) = [
        d
        for d in yaml.safe_load_all((DOCKER / "k8s" / "triton.yaml").read_text())
        if d and d["kind"] == "Deployment"
    ]
    (k8s_triton,) = k8s["spec"]["template"]["spec"]["containers"]
    assert triton["command"] == compose["entrypoint"] == k8s_triton["command"]
    assert triton["args"] == compose["command"] == k8s_triton["args"]
    assert "--model-config-name=gpu" in triton["args"]
    assert {p["name"]: p["containerPort"] for p in triton["ports"]} == {
        "http": 8000,
        "grpc": 8001,
        "metrics": 8002,
    }
    gpus = release.option("triton.gpus")
    assert triton["resources"]["requests"]["nvidia.com/gpu"] == gpus
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == gpus
    pod = release.pod("StatefulSet", f"{FULLNAME}-triton")
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod.get("nodeSelector", {}) == release.option("triton.nodeSelector")


def test_the_probes_point_at_the_paths_the_commands_serve(release: Release) -> None:
    """The core's on its operator port (--metrics-port): live while it runs, ready on the
    leader; the shells' and Triton's on their HTTP port. (That the paths answer: the
    shells' and Triton's in ``test_deploy_files``; the core's and the commands' own in
    ``test_fleet_commands_in_the_deploy_files_serve``.)"""

    def probe(container: dict[str, Any], kind: str) -> tuple[str, int]:
        get = container[kind]["httpGet"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        return get["path"], ports[get["port"]]

    core = release.container("Deployment", f"{FULLNAME}-core")
    metrics = int(core_args(release).metrics_port)
    assert probe(core, "readinessProbe") == ("/v2/health/ready", metrics)
    assert probe(core, "livenessProbe") == ("/v2/health/live", metrics)
    shell = release.container("Deployment", f"{FULLNAME}-shell")
    http = shell_args(release).http_port
    assert probe(shell, "readinessProbe") == ("/v2/health/ready", http)
    assert probe(shell, "livenessProbe") == ("/v2/health/live", http)
    triton = release.container("StatefulSet", f"{FULLNAME}-triton")
    for kind in ("startupProbe", "readinessProbe"):
        assert probe(triton, kind) == ("/v2/health/ready", 8000)
    assert probe(triton, "livenessProbe") == ("/v2/health/live", 8000)


# ---- the core: its config, its Tritons, its pair ---------------------------------------------


def test_the_default_config_is_docker_config_and_serves_llm_in_engine_mode(
    release: Release,
) -> None:
    """values.yaml's config is docker/config.yaml; what the core gets is that, valid, with
    ``llm`` in engine mode (max_inflight), and the chart's own Tritons and Redis."""
    default = yaml.safe_load(release.option("config"))
    assert default == yaml.safe_load(CONFIG.read_text())
    config = rendered_config(release)
    assert config.endpoints["llm"].max_inflight is not None
    assert any("llm" in models for models in config.tier_models.values())
    assert config.endpoints["embed"].max_inflight is None  # the negative control
    # What the chart replaces, and nothing else.
    original = load_config(CONFIG)
    assert config.tenants == original.tenants and config.endpoints == original.endpoints
    assert config.tier_limits == original.tier_limits and config.server == original.server
    assert config.triton.metrics_interval_s == original.triton.metrics_interval_s
    limiting = config.rate_limiting
    external = release.option("redis.external.url")
    assert limiting.storage == (external or f"redis://{FULLNAME}-redis:6379/0")
    assert limiting.on_storage_error == original.rate_limiting.on_storage_error
    assert limiting.storage_password_file == "/run/secrets/redis/password"
    assert config.triton.http_url is None and config.triton.metrics_url is None


def test_the_cores_tritons_are_the_statefulsets_pods(release: Release) -> None:
    """One --triton-url per StatefulSet pod (every pod KEDA may start, when it scales),
    by the pod's stable name behind the headless Service; the config lists the same
    pool with each pod's HTTP and metrics ports, and the CLI's pool keeps them."""
    hosts = triton_hosts(release)
    args = core_args(release)
    assert args.triton_url == [f"{h}:8001" for h in hosts]
    sts = release.get("StatefulSet", f"{FULLNAME}-triton")
    headless = release.get("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True  # the pool probes itself
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert selects({"matchLabels": headless["spec"]["selector"]}, pod_labels)
    assert selects(sts["spec"]["selector"], pod_labels)
    assert {p["port"] for p in headless["spec"]["ports"]} == {8000, 8001, 8002}
    pool = rendered_config(release).triton.pool(args.triton_url)
    assert [(b.grpc_url, b.http_url, b.metrics_url) for b in pool] == [
        (f"{h}:8001", f"http://{h}:8000", f"http://{h}:8002/metrics") for h in hosts
    ]
    keda = release.option("triton.autoscaling.keda.enabled")
    assert ("replicas" in sts["spec"]) is not keda  # KEDA owns the count when it scales
    if not keda:
        assert len(hosts) == release.option("triton.replicas")


def test_the_core_is_a_leader_elected_pair(release: Release) -> None:
    """Two cores, a PodDisruptionBudget that keeps one, replaced whole on an update
    (readiness is leadership: a rolling update would wait for a standby to be ready);
    the shells' Service gets only ready cores, i.e. the leader, while the metrics
    Service lists both (the standby is scraped too)."""
    core = release.get("Deployment", f"{FULLNAME}-core")
    assert core["spec"]["replicas"] == 2
    assert core["spec"]["strategy"] == {"type": "Recreate"}
    pod_labels = core["spec"]["template"]["metadata"]["labels"]
    pdb = release.get("PodDisruptionBudget", f"{FULLNAME}-core")
    assert pdb["spec"]["minAvailable"] == 1 and selects(pdb["spec"]["selector"], pod_labels)
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # the standby
    service = release.get("Service", f"{FULLNAME}-core")
    assert not service["spec"].get("publishNotReadyAddresses")
    metrics = release.get("Service", f"{FULLNAME}-core-metrics")
    assert metrics["spec"]["publishNotReadyAddresses"] is True
    assert selects({"matchLabels": metrics["spec"]["selector"]}, pod_labels)
    shell_pdb = release.get("PodDisruptionBudget", f"{FULLNAME}-shell")
    shell_labels = release.get("Deployment", f"{FULLNAME}-shell")["spec"]["template"]["metadata"]
    assert selects(shell_pdb["spec"]["selector"], shell_labels["labels"])
    # The lease: Kubernetes' needs a ServiceAccount with a Role on that Lease alone (and
    # create), mounted into the cores only; Redis's needs nothing of the API.
    pod = release.pod("Deployment", f"{FULLNAME}-core")
    if release.option("core.election") == "kubernetes":
        assert pod["automountServiceAccountToken"] is True
        account = release.get("ServiceAccount", pod["serviceAccountName"])
        role = release.get("Role", f"{FULLNAME}-core")
        granted = {
            verb: rule.get("resourceNames")
            for rule in role["rules"]
            if rule["apiGroups"] == ["coordination.k8s.io"] and rule["resources"] == ["leases"]
            for verb in rule["verbs"]
        }
        lease = core_args(release).lease_name
        assert granted == {"get": [lease], "update": [lease], "create": None}
        binding = release.get("RoleBinding", f"{FULLNAME}-core")
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
        ]
    else:
        assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod


def test_the_shells_scale_on_cpu(release: Release) -> None:
    shell = release.get("Deployment", f"{FULLNAME}-shell")
    if not release.option("shell.autoscaling.enabled"):
        assert shell["spec"]["replicas"] == release.option("shell.replicas")
        return
    assert "replicas" not in shell["spec"]  # the HPA owns it
    hpa = release.get("HorizontalPodAutoscaler", f"{FULLNAME}-shell")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": shell["metadata"]["name"],
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"
    (container,) = shell["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["cpu"]  # utilisation is of the request


# ---- secrets ------------------------------------------------------------------------------------


def test_the_keys_redis_password_and_core_secret_reach_who_reads_them(tmp_path: Path) -> None:
    """From the Secrets the chart makes: each tenant's key authenticates it in the core
    (files where api_keys_file says, variables api_keys_env names); the core reads
    Redis's password from the Secret Redis reads its requirepass from; the core and the
    shells read one core secret, and the shells nothing else."""
    rel = _cached("default")
    config = rendered_config(rel)
    pod = rel.pod("Deployment", f"{FULLNAME}-core")
    core = rel.container("Deployment", f"{FULLNAME}-core")
    files = secret_files(rel.of_kind("Secret"), pod, core, tmp_path / "core")
    made = {s["metadata"]["name"]: s for s in rel.of_kind("Secret")}
    env = {}
    for var in core["env"]:
        ref = var["valueFrom"].get("secretKeyRef")
        if ref is not None:
            env[var["name"]] = secret_value(made[ref["name"]], ref["key"])
    authenticates(config, files, env, rel.keys)
    password_path = config.rate_limiting.storage_password_file
    assert password_path is not None
    password = files[password_path].read_text()
    assert re.fullmatch(r"[A-Za-z0-9]{64}", password)  # made at install: no '"' or '\'
    redis_pod = rel.pod("Deployment", f"{FULLNAME}-redis")
    (volume,) = [v for v in redis_pod["volumes"] if "secret" in v]
    assert secret_value(made[volume["secret"]["secretName"]], "password") == password
    limiting = config.rate_limiting.model_copy(
        update={"storage_password_file": str(files[password_path])}
    )
    assert password in limiting.storage_url()
    core_secret = files[core_args(rel).secret_file].read_text()
    assert re.fullmatch(r"[A-Za-z0-9]{64}", core_secret)
    shell_pod = rel.pod("Deployment", f"{FULLNAME}-shell")
    shell = rel.container("Deployment", f"{FULLNAME}-shell")
    shell_files = secret_files(rel.of_kind("Secret"), shell_pod, shell, tmp_path / "shell")
    assert list(shell_files) == [shell_args(rel).secret_file]
    assert shell_files[shell_args(rel).secret_file].read_text() == core_secret
    assert "env" not in shell
    # Made at install (offline, lookup finds no Secret to keep): each rendering its own.
    again = _cached("monitoring")
    assert secret_value(again.get("Secret", f"{FULLNAME}-core-secret"), "secret") != core_secret
    # Plain keys in keys.data are warned about; hashed ones are not.
    assert "WARNING" not in rel.notes


def test_named_secrets_are_used_and_none_is_made() -> None:
    rel = _cached("existing-secrets")
    assert rel.of_kind("Secret") == []
    core = rel.pod("Deployment", f"{FULLNAME}-core")
    shell = rel.pod("Deployment", f"{FULLNAME}-shell")
    redis_pod = rel.pod("Deployment", f"{FULLNAME}-redis")

    def secret_names(pod: dict[str, Any]) -> set[str]:
        return {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}

    assert secret_names(core) == {"tenant-keys", "core-secret", "redis-auth"}
    assert secret_names(shell) == {"core-secret"} and secret_names(redis_pod) == {"redis-auth"}
    (container,) = core["containers"]
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for e in container["env"]
        if "secretKeyRef" in e["valueFrom"]
    }
    assert refs == {"tenant-keys"}
    # An external Redis's password: the Secret and entry named, at the path the config reads.
    ext = _cached("external-redis")
    pod = ext.pod("Deployment", f"{FULLNAME}-core")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "redis-password"]
    assert volume["secret"]["secretName"] == "shared-redis"
    assert volume["secret"]["items"] == [{"key": "pw", "path": "password"}]


def test_notes_warn_about_plain_keys(chart: helm.Chart) -> None:
    values = {"keys": {"data": {e: "a-plain-key" for e in KEY_ENTRIES.values()}}}
    _, notes = parse(render_raw(chart, values))
    assert "WARNING: keys.data.acme.keys holds plain keys" in notes
    assert f"{FULLNAME}.{NAMESPACE}.svc:{DEFAULT_HTTP_PORT}" in notes


# ---- every pod locked down ------------------------------------------------------------------

WRITABLE = {
    f"{FULLNAME}-core": {"/tmp"},
    f"{FULLNAME}-shell": {"/tmp"},
    f"{FULLNAME}-triton": {"/dev/shm", "/tmp"},  # the Python backend stubs; HOME's caches
    f"{FULLNAME}-redis": {"/tmp", "/data"},  # the generated redis.conf; the working directory
}


def test_every_pod_runs_non_root_read_only_without_privileges(release: Release) -> None:
    workloads = [o for o in release.objects if o["kind"] in ("Deployment", "StatefulSet")]
    expected = set(WRITABLE) - (
        {f"{FULLNAME}-redis"} if release.option("redis.external.url") else set()
    )
    assert {w["metadata"]["name"] for w in workloads} == expected
    kubernetes = release.option("core.election") == "kubernetes"
    for workload in workloads:
        name = workload["metadata"]["name"]
        token = kubernetes and name == f"{FULLNAME}-core"  # the Lease, nothing else
        assert_locked_down(name, workload["spec"]["template"]["spec"], WRITABLE[name], token)


def test_the_chart_starts_redis_as_kustomize_does() -> None:
    """The same start script (password from the Secret's file into a config file, never
    on a command line; an empty or unquotable one refused), args and readiness probe as
    docker/k8s/redis.yaml, which test_deploy_files runs against a real redis-server."""
    rel = _cached("default")
    mine = rel.container("Deployment", f"{FULLNAME}-redis")
    (k8s,) = [
        d
        for d in yaml.safe_load_all((DOCKER / "k8s" / "redis.yaml").read_text())
        if d and d["kind"] == "Deployment"
    ]
    (theirs,) = k8s["spec"]["template"]["spec"]["containers"]
    for key in ("command", "args", "readinessProbe", "livenessProbe", "securityContext"):
        assert mine[key] == theirs[key], key


# ---- NetworkPolicy ------------------------------------------------------------------------------


def _peers(rel: Release) -> dict[str, Endpoint]:
    """Who is around: the gateway, an ingress controller's pod, Prometheus, and
    everyone who should get nowhere."""
    return {
        "gateway": Endpoint(
            "gateway",
            "edge",
            {"fair-frontend/gateway": "true"},
            {"kubernetes.io/metadata.name": "edge"},
        ),
        "ingress-nginx": Endpoint(
            "ingress-nginx",
            "ingress-nginx",
            {"app.kubernetes.io/name": "ingress-nginx"},
            {"kubernetes.io/metadata.name": "ingress-nginx"},
        ),
        "prometheus": Endpoint(
            "prometheus",
            "monitoring",
            {"app.kubernetes.io/name": "prometheus"},
            {"kubernetes.io/metadata.name": "monitoring", "purpose": "monitoring"},
        ),
        "tenant-pod": Endpoint("tenant-pod", "tenants", {"app": "client"}, {}),
        # A tenant's pod labelled as Prometheus is: the metrics peer is Prometheus's
        # namespace, not a label anyone may put on a pod.
        "stray-prometheus": Endpoint(
            "stray-prometheus",
            "tenants",
            {"app.kubernetes.io/name": "prometheus"},
            {"kubernetes.io/metadata.name": "tenants", "team": "tenants"},
        ),
        # A pod elsewhere labelled as this release's shell: a podSelector alone means the
        # policy's own namespace.
        "impostor": Endpoint(
            "impostor",
            "tenants",
            rel.get("Deployment", f"{FULLNAME}-shell")["spec"]["template"]["metadata"]["labels"],
            {"kubernetes.io/metadata.name": "tenants"},
        ),
        "neighbour": Endpoint("neighbour", NAMESPACE, {"app": "debug"}, {}),
        "internet": Endpoint("internet", None),
    }


def test_network_policies_allow_exactly_the_fleets_paths(release: Release) -> None:
    """Every source to every pod of the release on every port they serve: allowed
    exactly for the gateway -> shells (8000, 8001); shells -> core (8010) and Triton
    (8001); core -> Triton (8000-8002) and Redis; Prometheus -> core and Triton (8002).
    Out of the cluster: DNS for all; the core alone to an external Redis (its port,
    where redis.external.to says) and, electing by Lease, to the API server."""
    policies = release.of_kind("NetworkPolicy")
    pods = workload_pods(release.objects, {})
    peers = _peers(release)
    core, shell, triton = (f"{FULLNAME}-{c}" for c in ("core", "shell", "triton"))
    gateways = ["gateway"]
    if release.option("networkPolicy.gateway.ingressControllerNamespace"):
        gateways.append("ingress-nginx")
    allowed = {
        *((g, shell, port) for g in gateways for port in (DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT)),
        (shell, core, DEFAULT_CORE_PORT),
        *((shell, triton, port) for port in (8000, 8001)),  # the rows and streams granted
        *((core, triton, port) for port in (8000, 8001, 8002)),
        ("prometheus", core, DEFAULT_METRICS_PORT),
        ("prometheus", triton, 8002),
    }
    if not release.option("redis.external.url"):
        allowed.add((core, f"{FULLNAME}-redis", 6379))
    assert reachable(policies, [*pods.values(), *peers.values()], pods.values()) == allowed

    internet = peers["internet"]
    shared = Endpoint("shared-redis", "shared", {"app": "redis"}, {"team": "shared"})
    kubernetes = release.option("core.election") == "kubernetes"
    external = bool(release.option("redis.external.url"))
    for pod in pods.values():
        assert connects(policies, pod, Endpoint("dns", None), 53, "UDP"), pod.name
        is_core = pod.name == core
        for port in (443, 6443):
            assert connects(policies, pod, internet, port) is (is_core and kubernetes)
        assert connects(policies, pod, shared, 6380) is (is_core and external), pod.name
        assert not connects(policies, pod, shared, 6379)
        assert not connects(policies, pod, internet, 6380)  # only where redis.external.to says
    # The negative control: without the policies, anyone reaches Triton and the core.
    assert connects([], peers["tenant-pod"], pods[triton], 8001)
    assert connects([], peers["neighbour"], pods[core], DEFAULT_CORE_PORT)


def test_the_metrics_peer_is_prometheus_in_its_namespace_and_the_gateway_any() -> None:
    """The core's and Triton's metrics ports admit Prometheus's pods in the namespace
    named (``monitoring`` by default), never a pod so labelled in any namespace; the
    gateway's peer does span namespaces, and values.yaml says so where it is set."""
    rel = _cached("default")
    prometheus = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    for name, port in ((f"{FULLNAME}-core", DEFAULT_METRICS_PORT), (f"{FULLNAME}-triton", 8002)):
        rules = rel.get("NetworkPolicy", name)["spec"]["ingress"]
        peers = [r["from"] for r in rules if {"protocol": "TCP", "port": port} in r["ports"]]
        assert [prometheus] in peers, (name, peers)
        for peer in (p for group in peers for p in group):
            assert peer.get("namespaceSelector", {"x": 1}) != {}, (name, peer)  # not "any"
    gateway = rel.get("NetworkPolicy", f"{FULLNAME}-shell")["spec"]["ingress"][0]["from"][0]
    assert gateway["namespaceSelector"] == {}
    values = (CHART / "values.yaml").read_text()
    said = values[: values.index('podLabels: {fair-frontend/gateway: "true"}')]
    assert "in ANY namespace" in said[said.rindex("gateway:") :]


def test_the_policies_ports_are_the_pods_ports(release: Release) -> None:
    assert_policy_ports_are_served(
        release.of_kind("NetworkPolicy"), workload_pods(release.objects, {})
    )


# ---- monitoring ----------------------------------------------------------------------------------


def test_the_chart_carries_dockers_rules_and_dashboard() -> None:
    """files/ holds copies of docker/prometheus/rules.yml and the dashboard (a chart reads
    nothing outside itself); the PrometheusRule and the ConfigMap carry them."""
    assert (CHART / "files" / "rules.yml").read_text() == (
        DOCKER / "prometheus" / "rules.yml"
    ).read_text()
    dashboard = DOCKER / "grafana" / "dashboards" / "fair_frontend.json"
    assert (CHART / "files" / "fair_frontend.json").read_text() == dashboard.read_text()
    rel = _cached("monitoring")
    rule = rel.get("PrometheusRule", FULLNAME)
    assert rule["spec"] == yaml.safe_load((DOCKER / "prometheus" / "rules.yml").read_text())
    board = rel.get("ConfigMap", f"{FULLNAME}-dashboard")
    assert json.loads(board["data"]["fair_frontend.json"]) == json.loads(dashboard.read_text())


def test_the_service_monitor_scrapes_both_cores_and_the_tritons_as_the_rules_expect() -> None:
    """The ServiceMonitor selects the core-metrics Service (both cores: the standby is
    not ready but scraped) and the Tritons', on their metrics ports, with the jobs the
    alert rules and the dashboard name (``job="fair-frontend"``)."""
    rel = _cached("monitoring")
    monitor = rel.get("ServiceMonitor", FULLNAME)
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selected = [
        s
        for s in rel.of_kind("Service")
        if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
    ]
    assert sorted(s["metadata"]["name"] for s in selected) == [
        f"{FULLNAME}-core-metrics",
        f"{FULLNAME}-triton",
    ]
    (endpoint,) = monitor["spec"]["endpoints"]
    jobs = set()
    pods = {
        w["metadata"]["name"]: w for w in rel.objects if w["kind"] in ("Deployment", "StatefulSet")
    }
    for service in selected:
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        (workload,) = [
            w
            for w in pods.values()
            if selects(
                {"matchLabels": service["spec"]["selector"]},
                w["spec"]["template"]["metadata"]["labels"],
            )
        ]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        served = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert served[port["targetPort"]] == port["port"]
        jobs.add(service["metadata"]["labels"][monitor["spec"]["jobLabel"]])
    assert jobs == {"fair-frontend", "triton"}
    core_metrics = rel.get("Service", f"{FULLNAME}-core-metrics")
    assert core_metrics["spec"]["publishNotReadyAddresses"] is True
    named = set()
    for group in rel.get("PrometheusRule", FULLNAME)["spec"]["groups"]:
        for rule in group["rules"]:
            named |= set(re.findall(r'job="([^"]+)"', rule["expr"]))
    assert named and named <= jobs


def _exported_metrics() -> set[str]:
    """Series names the frontend exports: its registry's families (histograms with their
    _bucket, _sum, _count) and the scheduler-state gauges."""
    metrics = FrontendMetrics(load_config(CONFIG))
    names = set(STATE_GAUGES)
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            suffixes = ("", "_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            names |= {name + s for s in suffixes}
    return names


def test_keda_scales_the_tritons_on_the_cores_queue() -> None:
    """The ScaledObject scales the Triton StatefulSet between triton.replicas and
    maxReplicas (the pool the core was given) on the queue depth gauge and the queue
    wait histogram, metrics the frontend exports, selected as the ServiceMonitor labels
    them (this namespace, job fair-frontend)."""
    rel = _cached("keda")
    (scaled,) = rel.of_kind("ScaledObject")
    sts = rel.get("StatefulSet", f"{FULLNAME}-triton")
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": sts["metadata"]["name"],
    }
    assert scaled["spec"]["minReplicaCount"] == 2 and scaled["spec"]["maxReplicaCount"] == 5
    assert len(core_args(rel).triton_url) == 5
    exported = _exported_metrics()
    used = set()
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        metrics, _ = promql_names(trigger["metadata"]["query"])
        for name, labels in metrics.items():
            assert name in exported, name
            assert labels == {"namespace", "job"}, (name, labels)
            used.add(name)
        assert f'namespace="{NAMESPACE}"' in trigger["metadata"]["query"]
        assert 'job="fair-frontend"' in trigger["metadata"]["query"]
        float(trigger["metadata"]["threshold"])
    assert used == {"fair_queue_depth", "fair_queue_wait_seconds_bucket"}
    # The negative control: a misspelt metric would not be exported.
    assert "fair_queue_depths" not in exported


def test_no_demo_key_reaches_the_chart(chart: helm.Chart) -> None:
    """The example's demo keys are not in the chart, and a rendering with them in
    keys.data would carry them: the scan of docker/ (test_deploy_files) covers the
    chart's files; here, the rendered Secret holds exactly what was given."""
    rel = _cached("default")
    secret = rel.get("Secret", f"{FULLNAME}-keys")
    values = set(secret["stringData"].values())
    assert values == {hash_key(k) for k in rel.keys.values()}
    assert not values & {hash_key(k) for k in DEMO_KEYS.values()}


def test_mutual_tls_mounts_each_side_its_own_and_the_shells_never_the_cores_key() -> None:
    """coreTls: the core serves with its certificate and asks the shells for theirs (the
    CA of its Secret); the shells check the core by that CA alone, from the same Secret's
    ca.crt item, and present their own. Off by default: no TLS flag anywhere."""
    rel = _cached("mutual-tls")

    def mounted(kind: str, name: str) -> dict[str, str]:
        """{path in the container: "<secret>/<key>"} of its Secret volumes."""
        pod = rel.pod(kind, name)
        (container,) = pod["containers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        out = {}
        for mount in container["volumeMounts"]:
            secret = volumes[mount["name"]].get("secret")
            for item in (secret or {}).get("items", []):
                out[f"{mount['mountPath']}/{item['path']}"] = (
                    f"{secret['secretName']}/{item['key']}"
                )
        return out

    core, shell = (
        mounted("Deployment", f"{FULLNAME}-core"),
        mounted("Deployment", f"{FULLNAME}-shell"),
    )
    cargs, sargs = core_args(rel), shell_args(rel)
    assert core[cargs.tls_cert] == "core-tls/tls.crt" and core[cargs.tls_key] == "core-tls/tls.key"
    assert core[cargs.tls_client_ca] == "core-tls/ca.crt"
    assert shell[sargs.tls_ca] == "core-tls/ca.crt"
    assert (
        shell[sargs.tls_cert] == "shell-tls/tls.crt" and shell[sargs.tls_key] == "shell-tls/tls.key"
    )
    assert "core-tls/tls.key" not in shell.values()
    plain = _cached("default")
    assert core_args(plain).tls_cert is None and shell_args(plain).tls_ca is None


# ---- TLS in front, key rotation, the documented install ------------------------------


def test_the_ingresses_terminate_tls_for_both_tenant_ports() -> None:
    """ingress.enabled: an HTTP and a gRPC Ingress, each with the TLS Secret for its host,
    routing to the shells' Service on its port (gRPC spoken to the shells)."""
    rel = _cached("tls-ingress")
    service = rel.get("Service", FULLNAME)
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    for kind, host in (("http", "infer.example.com"), ("grpc", "grpc.infer.example.com")):
        spec = rel.get("Ingress", f"{FULLNAME}-{kind}")["spec"]
        assert spec["tls"] == [{"hosts": [host], "secretName": "infer-tls"}]
        (rule,) = spec["rules"]
        assert rule["host"] == host
        (path,) = rule["http"]["paths"]
        assert path["backend"]["service"] == {"name": FULLNAME, "port": {"number": ports[kind]}}
    annotations = rel.get("Ingress", f"{FULLNAME}-grpc")["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
    # The controller's pods reach the shells' ports, and nothing more: the variant is
    # one of test_network_policies_allow_exactly_the_fleets_paths's.
    assert rel.option("networkPolicy.gateway.ingressControllerNamespace") == "ingress-nginx"


def _keys_checksum(values: dict[str, Any]) -> str:
    with helm.Chart.load(CHART) as loaded:
        objects, _ = parse(render_raw(loaded, values))
    (core,) = [
        o
        for o in objects
        if o["metadata"]["name"] == f"{FULLNAME}-core" and o["kind"] == "Deployment"
    ]
    checksum: str = core["spec"]["template"]["metadata"]["annotations"]["checksum/keys"]
    return checksum


def test_rotating_keys_changes_the_cores_pod_template() -> None:
    """A new key (keys.data) or a new keys.revision (a named Secret, rendered offline:
    lookup finds nothing) changes the cores' pod template, so helm upgrade replaces the
    cores, which read the keys as they start; the same values, the same template. It
    changed nothing for a named Secret before: a rotation reached no running core."""
    data = {KEY_ENTRIES[t]: hash_key(t) for t in KEY_ENTRIES}
    base = _keys_checksum({"keys": {"data": data}})
    assert base == _keys_checksum({"keys": {"data": data}})
    rotated = {**data, "acme.keys": hash_key("a new key")}
    assert _keys_checksum({"keys": {"data": rotated}}) != base
    named = {"keys": {"existingSecret": "tenant-keys"}}
    first = _keys_checksum(named)
    assert first == _keys_checksum(named)
    assert _keys_checksum(merged(named, {"keys": {"revision": "2026-12-06"}})) != first


DOCUMENTED = "<!-- install-from-registry -->"


def documented_install() -> str:
    """The fenced block right after the marker in docker/README.md."""
    after = (DOCKER / "README.md").read_text().split(DOCUMENTED, 1)[1].lstrip("\n")
    assert after.startswith("```"), "no fenced block after the marker"
    return after.split("\n", 1)[1].split("\n```", 1)[0]


def set_values(command: str) -> dict[str, Any]:
    """The --set KEY=VALUE pairs of a helm command, as the values they make."""
    values: dict[str, Any] = {}
    for key, value in re.findall(r"--set\s+([\w.]+)=(\S+)", command):
        *parents, last = key.split(".")
        node = values
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return values


def test_the_documented_install_pulls_the_images_make_push_pushed() -> None:
    """docker/README.md's steps as written: `make push IMAGE_REPOSITORY=R` builds and pushes
    both images (make -n: no Docker daemon here), and the helm install's --set values
    render pods that run exactly those images, with the keys Secret the steps create."""
    block = documented_install()
    make = re.search(r"^make push IMAGE_REPOSITORY=(\S+)", block, re.MULTILINE)
    assert make, block
    repository = make.group(1)
    dry = subprocess.run(
        ["make", "-n", "push", f"IMAGE_REPOSITORY={repository}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    built = set(re.findall(r"-t (\S+)", dry))
    pushed = set(re.findall(r"^docker push (\S+)$", dry, re.MULTILINE))
    assert built == pushed and {f"{repository}:serve", f"{repository}:triton"} <= pushed
    assert {"docker/Dockerfile", "docker/Dockerfile.serve"} == set(re.findall(r"-f (\S+)", dry))
    install = block[block.index("helm install") :]
    values = set_values(install)
    secret = re.search(r"create secret generic (\S+)", block)
    assert secret and values["keys"]["existingSecret"] == secret.group(1)
    with helm.Chart.load(CHART) as loaded:
        objects, _ = parse(render_raw(loaded, values))
    images = {
        c["image"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
        and o["metadata"]["name"] != f"{FULLNAME}-redis"
        for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert images == {f"{repository}:serve", f"{repository}:triton"}, images
