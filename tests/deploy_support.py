"""What the deployment tests share (``test_deploy_files``: docker/k8s and compose;
``test_helm_chart``: docker/helm): an evaluator of NetworkPolicies over rendered objects,
the pods a set of workloads makes, a check that mounted key files and variables
authenticate each tenant, a check that a pod is locked down, and which metrics and labels a
PromQL expression uses.

The evaluator follows the NetworkPolicy API's rules (networking.k8s.io/v1), enough for
these manifests, and is checked on the documentation's own cases
(``test_deploy_files.test_the_evaluator_follows_the_documented_rules``): a connection is
allowed when the destination pod's ingress allows it AND the source pod's egress does.
A pod that no policy of a direction selects is open in that direction; once one does,
only what one of them lists is allowed. A rule's peers (from/to) are ORed; within one
peer, podSelector and namespaceSelector are ANDed; a podSelector alone means the
policy's namespace; no peers means every source; no ports means every port; a named
port is the destination pod's container port of that name.
"""

from __future__ import annotations

import base64
import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fair_frontend.auth import KeyRing
from fair_frontend.config import Config

# The example config's published demo keys, by tenant: never in a deployment file.
DEMO_KEYS = {t: f"{t}-demo-key" for t in ("acme", "globex", "initech", "umbrella")}
# The kinds whose pod template the tests look into.
WORKLOADS = ("Deployment", "StatefulSet")


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


def workload_pods(
    objects: Iterable[Mapping[str, Any]], namespace_labels: Mapping[str, Mapping[str, str]]
) -> dict[str, Endpoint]:
    """A pod of each Deployment and StatefulSet in ``objects``, by workload name, with its
    template's labels and container ports; ``namespace_labels``: each namespace's labels
    (``kubernetes.io/metadata.name`` is added, as the API server does)."""
    pods = {}
    for workload in objects:
        if workload["kind"] not in WORKLOADS:
            continue
        template = workload["spec"]["template"]
        namespace = workload["metadata"]["namespace"]
        ports = {
            p["name"]: p["containerPort"]
            for c in template["spec"]["containers"]
            for p in c.get("ports", [])
            if "name" in p
        }
        pods[workload["metadata"]["name"]] = Endpoint(
            workload["metadata"]["name"],
            namespace,
            template["metadata"]["labels"],
            {**namespace_labels.get(namespace, {}), "kubernetes.io/metadata.name": namespace},
            ports,
        )
    return pods


def authenticates(
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
    for owner, key in keys.items():
        assert ring.tenant_for(key) == owner
    for owner, key in DEMO_KEYS.items():
        assert ring.tenant_for(key) is None, f"{owner}'s demo key opens the deployment"
    assert ring.tenant_for(f"{keys['acme']} ") is None and ring.tenant_for("nope") is None


def assert_locked_down(name: str, pod: Mapping[str, Any], writable: set[str], token: bool) -> None:
    """A pod spec runs non-root, with seccomp RuntimeDefault, no host namespaces, and
    each container without privilege escalation or capabilities on a read-only root
    filesystem, writing only to emptyDirs mounted at ``writable``; it mounts a
    service-account token only where ``token`` (it talks to the Kubernetes API)."""
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True, name
    assert context["runAsUser"] > 0 and context.get("runAsGroup", 1) > 0, name
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    assert pod.get("automountServiceAccountToken", True) is token, name
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for container in [*pod["containers"], *pod.get("initContainers", [])]:
        own = container["securityContext"]
        assert own["allowPrivilegeEscalation"] is False, name
        assert own["readOnlyRootFilesystem"] is True, name
        assert own["capabilities"] == {"drop": ["ALL"]}, name
        assert not own.get("privileged") and own.get("runAsUser", 1) != 0, name
        written = set()
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "emptyDir" in volume:
                written.add(mount["mountPath"])
            else:  # secrets and config: read-only
                assert mount.get("readOnly") is True, (name, mount)
                assert not {"hostPath", "persistentVolumeClaim"} & set(volume), volume
        assert written == writable, name


def reachable(
    policies: list[dict[str, Any]],
    sources: Iterable[Endpoint],
    destinations: Iterable[Endpoint],
    ports: Iterable[int] | None = None,
) -> set[tuple[str, str, int]]:
    """Every ``(source, destination, port)`` the policies allow, over ``ports`` (default:
    every port any destination serves) and TCP; a source never counts as reaching
    itself."""
    destinations = list(destinations)
    if ports is None:
        ports = {port for d in destinations for port in d.ports.values()}
    ports = sorted(set(ports))
    return {
        (source.name, to.name, port)
        for source in sources
        for to in destinations
        for port in ports
        if source.name != to.name and connects(policies, source, to, port)
    }


def assert_policy_ports_are_served(
    policies: list[dict[str, Any]], pods: Mapping[str, Endpoint]
) -> None:
    """Each ingress port a policy opens is a port of every pod the policy selects (a policy
    naming a port nobody serves would silently cut the real one off)."""
    for policy in policies:
        selected = [
            pod
            for pod in pods.values()
            if pod.namespace == policy["metadata"]["namespace"]
            and selects(policy["spec"]["podSelector"], pod.labels)
        ]
        if not policy["spec"]["podSelector"]:
            continue  # the namespace-wide ones (deny, DNS)
        assert selected, policy["metadata"]["name"]
        for rule in policy["spec"].get("ingress", []):
            for entry in rule.get("ports", []):
                for pod in selected:
                    assert entry["port"] in pod.ports.values(), (
                        policy["metadata"]["name"],
                        pod.name,
                        entry,
                    )


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


def secret_value(secret: Mapping[str, Any], key: str) -> str:
    """One entry of a rendered Secret, from ``stringData`` or (base64) ``data``."""
    if key in secret.get("stringData", {}):
        return str(secret["stringData"][key])
    return base64.b64decode(secret["data"][key]).decode()


def secret_files(
    secrets: Iterable[Mapping[str, Any]],
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    folder: Path,
) -> dict[str, Path]:
    """Every file a container's Secret volumes hold (from the rendered ``secrets``), at
    its path in the container, written under ``folder``: {path in the container: file
    here}."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    by_name = {s["metadata"]["name"]: s for s in secrets}
    files = {}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "secret" not in volume:
            continue
        secret = by_name[volume["secret"]["secretName"]]
        for item in volume["secret"]["items"]:
            real = folder / mount["name"] / item["path"]
            real.parent.mkdir(parents=True, exist_ok=True)
            real.write_text(secret_value(secret, item["key"]))
            files[f"{mount['mountPath']}/{item['path']}"] = real
    return files
