"""Everything under deploy/ is checked here: the Containerfile (hadolint, and what the chart
relies on), the Helm chart (helm lint; rendered and validated against the Kubernetes schemas of
the oldest supported and the newest release), the plain manifests (the chart's render, byte for
byte, and valid), the ServiceMonitor and PrometheusRule (against the Prometheus Operator's CRD
models), the alert rules (promtool check and unit tests) and the Grafana dashboard (its queries
and the rules' name only metrics and labels a live daemon serves).

The chart is rendered by a helm binary where one is on PATH, else by helm-python-sdk (a test
dependency); promtool comes from Debian's prometheus package, which .ci/run installs.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from jsonschema import Draft7Validator

import priod
from priod.cli import DAEMON_MODULES
from priod.daemon.config import load_config
from priod.testing import daemon_process
from priod.testing.scrape import Samples, Scraper, free_port
from priod.testing.scripts import import_script

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "priod"
RULES = CHART / "files" / "priod-rules.yaml"
DASHBOARD = CHART / "files" / "priod-dashboard.json"
CONTAINERFILE = DEPLOY / "Containerfile"
RULE_TESTS = Path(__file__).resolve().parent / "promtool" / "priod-rules.test.yaml"

# The chart's kubeVersion floor, and the newest release kubernetes-validate knows.
K8S_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())
# Value sets the chart is rendered with: the defaults, the plain manifests' and the options
# that add or remove objects and fields.
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "plain": {"plain": True},
    "own-priority-class-no-hostpid-no-monitoring": {
        "priorityClass": {"create": True},
        "hostPID": False,
        "serviceMonitor": {"enabled": False},
        "prometheusRule": {"enabled": False},
        "grafanaDashboard": {"enabled": False},
        "resources": {"limits": {"memory": "64Gi"}},
        "imagePullSecrets": [{"name": "registry"}],
    },
    "own-node-label": {"affinity": None, "nodeSelector": {"example.com/gpu-node": "yes"}},
}

# The Prometheus Operator's v1 ServiceMonitor and PrometheusRule, as far as the chart uses them:
# field names, types and patterns as the operator's CRDs (monitoring.coreos.com_*.yaml, v0.7x-
# v0.8x) define them, written out by hand (the CRDs' own schemas are not vendored here), with
# unknown fields refused as the API server's structural pruning would drop them silently.
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
_METADATA = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": _STR_MAP,
        "annotations": _STR_MAP,
    },
    "additionalProperties": False,
}


def _object(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


def _resource(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _object(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _resource(
        "ServiceMonitor",
        _object(
            {
                "jobLabel": {"type": "string"},
                "selector": _object({"matchLabels": _STR_MAP, "matchExpressions": {"type": "array"}}),
                "namespaceSelector": _object(
                    {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}
                ),
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": _object(
                        {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {
                                "type": "array",
                                "items": _object(
                                    {
                                        "sourceLabels": {"type": "array", "items": _LABEL_NAME},
                                        "targetLabel": {"type": "string"},
                                        "action": {"type": "string"},
                                        "regex": {"type": "string"},
                                        "replacement": {"type": "string"},
                                        "separator": {"type": "string"},
                                    }
                                ),
                            },
                        }
                    ),
                },
            },
            ("selector",),
        ),
    ),
    "PrometheusRule": _resource(
        "PrometheusRule",
        _object(
            {
                "groups": {
                    "type": "array",
                    "items": _object(
                        {
                            "name": {"type": "string", "minLength": 1},
                            "interval": _DURATION,
                            "rules": {
                                "type": "array",
                                "items": {
                                    **_object(
                                        {
                                            "alert": {"type": "string"},
                                            "record": {"type": "string"},
                                            "expr": {"type": ["string", "integer"]},
                                            "for": _DURATION,
                                            "keep_firing_for": _DURATION,
                                            "labels": _STR_MAP,
                                            "annotations": _STR_MAP,
                                        },
                                        ("expr",),
                                    ),
                                    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                },
                            },
                        },
                        ("name",),
                    ),
                }
            }
        ),
    ),
}
CRD_MODELS = CRD_SCHEMAS


manifests = import_script(ROOT / "scripts" / "deploy_manifests.py", "priod_deploy_manifests")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """The chart rendered with each value set of VARIANTS."""
    return {name: manifests.render(values) for name, values in VARIANTS.items()}


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


# -- the chart and the plain manifests ----------------------------------------------------------


def test_chart_lints_clean() -> None:
    """helm lint finds nothing above info level (an icon is only recommended)."""
    assert manifests.lint() == []


def test_rendered_chart_is_valid_kubernetes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Every built-in object of every rendering validates, strictly (no unknown field), against
    the Kubernetes schemas of the chart's oldest supported release and the newest."""
    checked = 0
    for variant, docs in rendered.items():
        for doc in docs:
            if doc["kind"] in CRD_MODELS:
                continue
            for version in K8S_VERSIONS:
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    pytest.fail(
                        f"{variant}: {doc['kind']}/{doc['metadata']['name']} is invalid on Kubernetes {version}: {exc.message} at {list(exc.path)}"
                    )
                checked += 1
    kinds = {d["kind"] for docs in rendered.values() for d in docs}
    assert {
        "DaemonSet",
        "Service",
        "ConfigMap",
        "Namespace",
        "PriorityClass",
        "ServiceMonitor",
        "PrometheusRule",
    } <= kinds
    assert checked >= 2 * 12


def test_the_validator_catches_a_misspelt_field(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The schema check is not vacuous: a DaemonSet with `hostPId` for `hostPID`, or a port
    given as text, is refused."""
    ds = one(rendered["defaults"], "DaemonSet")
    misspelt = copy.deepcopy(ds)
    misspelt["spec"]["template"]["spec"]["hostPId"] = True
    wrong_type = copy.deepcopy(ds)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "9464"
    for bad in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_plain_manifests_are_the_chart_rendered() -> None:
    """deploy/kubernetes/ is exactly what scripts/deploy_manifests.py writes from the chart now
    (run it after changing the chart), and what it holds validates like the chart's render."""
    expected = manifests.plain_texts()
    assert sorted(p.name for p in (DEPLOY / "kubernetes").glob("*.yaml")) == sorted(expected)
    for name, text in expected.items():
        assert (DEPLOY / "kubernetes" / name).read_text() == text, (
            f"deploy/kubernetes/{name} is stale: run python scripts/deploy_manifests.py"
        )
    docs = [d for name in expected for d in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()) if d]
    assert [d["kind"] for d in docs if d["kind"] in CRD_MODELS] == ["ServiceMonitor", "PrometheusRule"]
    for doc in docs:
        if doc["kind"] not in CRD_MODELS:
            kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    # Monitoring objects apart, so a cluster without the operator's CRDs can apply the rest.
    assert not any(
        d["kind"] in CRD_MODELS for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "priod.yaml").read_text()) if d
    )
    assert all("helm.sh/chart" not in d["metadata"].get("labels", {}) for d in docs)


def test_daemonset_is_what_a_gpu_node_daemon_needs(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DaemonSet runs on GPU nodes under the nvidia runtime with every GPU visible and none
    claimed, binds its socket in a hostPath directory, runs as the image's non-root user with
    nothing it does not need, is probed through the metrics port (TCP connects and /healthz; test_probes_...), shares the host's PID namespace for CUDA IPC, and has a
    critical priority class."""
    docs = rendered["defaults"]
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["affinity"]["nodeAffinity"] and pod["priorityClassName"] == "system-node-critical"
    assert pod["hostPID"] is True and pod["automountServiceAccountToken"] is False
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "nvidia.com/gpu" not in json.dumps(pod["containers"] + pod["initContainers"]).replace(
        '"nvidia.com/gpu.present"', ""
    )
    assert "nvidia.com/gpu" not in json.dumps(
        [x.get("resources", {}) for x in pod["containers"] + pod["initContainers"]]
    )
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]

    socket_dir = next(v for v in pod["volumes"] if v["name"] == "socket-dir")
    assert socket_dir["hostPath"] == {"path": "/run/priod", "type": "DirectoryOrCreate"}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    sock = c["args"][c["args"].index("--socket") + 1]
    assert Path(sock).parent == Path(mounts["socket-dir"]) and env["PRIOD_SOCKET"] == sock
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}

    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    (init,) = pod["initContainers"]  # root, but only to chown the socket directory
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert (
        f"chown {pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']} /run/priod"
        in init["command"][-1]
    )

    # The daemon's config serves metrics on the port the container, the Service and the
    # ServiceMonitor name.
    config = next(d for d in by_kind(docs, "ConfigMap") if "priod.toml" in d["data"])["data"]["priod.toml"]
    port = tomllib.loads(config)["metrics"]["port"]
    cfg_file = tmp_path / "priod.toml"
    cfg_file.write_text(config)
    monkeypatch.delenv("PRIOD_CONFIG", raising=False)
    for key in [k for k in os.environ if k.startswith("PRIOD_")]:
        monkeypatch.delenv(key)
    cfg = load_config(str(cfg_file))  # the daemon accepts the file as the chart writes it
    assert (cfg.metrics.address, cfg.metrics.port) == ("0.0.0.0", port)
    assert c["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
    svc = one(docs, "Service")
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics" and svc["spec"]["publishNotReadyAddresses"] is True
    sm = one(docs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "priod"  # job="priod" in rules and dashboard

    other = rendered["own-priority-class-no-hostpid-no-monitoring"]
    assert (
        one(other, "DaemonSet")["spec"]["template"]["spec"]["priorityClassName"]
        == one(other, "PriorityClass")["metadata"]["name"]
    )
    assert one(other, "DaemonSet")["spec"]["template"]["spec"]["hostPID"] is False
    assert not by_kind(other, "ServiceMonitor") and not by_kind(other, "PrometheusRule")


def _matches(expr: dict[str, Any], labels: dict[str, str]) -> bool:
    """One nodeSelectorRequirement against a node's labels, as the scheduler reads it."""
    key, op, values = expr["key"], expr["operator"], expr.get("values", [])
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt"):
        if key not in labels:
            return False
        n, bound = int(labels[key]), int(values[0])
        return n > bound if op == "Gt" else n < bound
    raise AssertionError(f"unknown operator {op}")


def schedulable(pod: dict[str, Any], labels: dict[str, str], taints: list[dict[str, str]] | None = None) -> bool:
    """Whether the scheduler may place ``pod`` on a node with these labels and NoSchedule
    taints: every nodeSelector label, one of the required nodeSelectorTerms (each with all its
    matchExpressions), and a toleration for every taint."""
    if any(labels.get(k) != v for k, v in (pod.get("nodeSelector") or {}).items()):
        return False
    required = (pod.get("affinity") or {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is not None and not any(
        all(_matches(e, labels) for e in term.get("matchExpressions", [])) for term in required["nodeSelectorTerms"]
    ):
        return False
    tolerations = pod.get("tolerations") or []
    return all(
        any(
            t.get("key") in (None, taint["key"])
            and t.get("effect") in (None, taint["effect"])
            and (t.get("operator") == "Exists" or t.get("value") == taint.get("value"))
            for t in tolerations
        )
        for taint in taints or []
    )


GPU_TAINT = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
NODES: dict[str, tuple[dict[str, str], bool]] = {
    # name: (labels, a GPU node: priod must run there)
    "nfd-only": ({"kubernetes.io/os": "linux", "feature.node.kubernetes.io/pci-10de.present": "true"}, True),
    "gfd": (
        {
            "feature.node.kubernetes.io/pci-10de.present": "true",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": "NVIDIA-H200",
        },
        True,
    ),
    "labelled-by-hand": ({"kubernetes.io/os": "linux", "nvidia.com/gpu.present": "true"}, True),
    "tegra": ({"feature.node.kubernetes.io/cpu-model.vendor_id": "NVIDIA"}, True),
    "cpu-only": ({"kubernetes.io/os": "linux", "feature.node.kubernetes.io/pci-8086.present": "true"}, False),
    "gpu-absent": ({"nvidia.com/gpu.present": "false", "feature.node.kubernetes.io/pci-10de.present": "false"}, False),
    "no-labels": ({}, False),
}


def test_default_affinity_finds_gpu_nodes_without_gpu_feature_discovery(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """With the defaults (and in the plain manifests) a pod goes to every GPU node, whichever
    of the common labels it has: Node Feature Discovery's PCI vendor label alone (no GPU feature
    discovery), GFD's or the GPU operator's nvidia.com/gpu.present, the label set by hand, the
    Tegra CPU vendor; tainted or not. No node without such a label gets one. The old default, a
    nodeSelector on GFD's label, left the NFD-only node without priod. The `affinity` value
    turns it off for a nodeSelector of one's own."""
    for variant in ("defaults", "plain"):
        pod = one(rendered[variant], "DaemonSet")["spec"]["template"]["spec"]
        assert not pod.get("nodeSelector"), variant
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert len(terms) >= 3
        for name, (labels, gpu) in NODES.items():
            for taints in ([], GPU_TAINT):
                assert schedulable(pod, labels, taints) == gpu, (variant, name, taints)
    old_default = {"nodeSelector": {"nvidia.com/gpu.present": "true"}, "tolerations": pod["tolerations"]}
    assert not schedulable(old_default, NODES["nfd-only"][0])

    own = one(rendered["own-node-label"], "DaemonSet")["spec"]["template"]["spec"]
    assert "affinity" not in own and own["nodeSelector"] == {"example.com/gpu-node": "yes"}
    assert schedulable(own, {"example.com/gpu-node": "yes"}, GPU_TAINT)
    assert not schedulable(own, NODES["gfd"][0])


def test_no_cpu_limit_by_default(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The daemon's container asks for CPU but has no CPU limit (a CFS quota would throttle the
    event loop that paces urgent copies; values.yaml says why), in the chart's defaults, the
    plain manifests and with a memory limit set; a limit given in the values is still applied."""
    for variant in ("defaults", "plain", "own-priority-class-no-hostpid-no-monitoring"):
        (c,) = one(rendered[variant], "DaemonSet")["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["requests"]["cpu"], variant
        assert "cpu" not in c["resources"].get("limits", {}), variant
    (c,) = one(rendered["own-priority-class-no-hostpid-no-monitoring"], "DaemonSet")["spec"]["template"]["spec"][
        "containers"
    ]
    assert c["resources"]["limits"] == {"memory": "64Gi"}
    pinned = one(manifests.render({"resources": {"limits": {"cpu": "4", "memory": "8Gi"}}}), "DaemonSet")
    assert pinned["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "4", "memory": "8Gi"}


def test_probes_start_no_process_and_liveness_checks_the_event_loop(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Startup and readiness connect to the metrics port (the kubelet's own TCP connect); liveness
    GETs /healthz there, which answers only while the daemon's event loop turns. No probe starts
    a process in the container or writes a line to the daemon's log (an exec of `priod status`
    did both: 8 Python starts and 16 log lines a minute per node)."""
    for variant in ("defaults", "plain"):
        (c,) = one(rendered[variant], "DaemonSet")["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert "metrics" in ports
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["tcpSocket"] == {"port": "metrics"} and "exec" not in c[probe], (variant, probe)
        live = c["livenessProbe"]
        assert live["httpGet"] == {"path": "/healthz", "port": "metrics"} and "exec" not in live, variant
        # Up to three minutes to restart a hung daemon.
        assert live["periodSeconds"] * live["failureThreshold"] <= 180 and live["timeoutSeconds"] >= 3


def _kubelet_tcp_probe(port: int) -> bool:
    """What the kubelet's tcpSocket probe does (pkg/probe/tcp): connect, with SO_LINGER at one
    second, and close."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 1))
        return True
    except OSError:
        return False


def test_probes_of_the_metrics_port_leave_the_daemon_log_alone(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """Against a live daemon configured as the chart configures it: the metrics port accepts the
    kubelet's TCP probe once the daemon serves on its socket, the liveness probe's GET answers
    200, and a few minutes' worth of all three adds not one line to the daemon's log."""
    (c,) = one(rendered["defaults"], "DaemonSet")["spec"]["template"]["spec"]["containers"]
    live = c["livenessProbe"]["httpGet"]
    port = free_port()
    with daemon_process({"PRIOD_METRICS__PORT": str(port), "PRIOD_LOG__LEVEL": '"info"'}) as d:
        deadline = time.monotonic() + 30
        while not _kubelet_tcp_probe(port):
            assert time.monotonic() < deadline, "the metrics port never opened"
            time.sleep(0.05)
        time.sleep(0.2)
        before = d.log()
        for _ in range(20):
            assert _kubelet_tcp_probe(port)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{live['path']}", timeout=10) as r:
                assert r.status == 200
        time.sleep(0.5)
        assert d.log() == before


def test_config_checksum_rolls_pods_on_change() -> None:
    """A changed `config` value changes the pod template (its checksum annotation), so the
    DaemonSet rolls instead of leaving daemons on the old settings."""

    def checksum(values: dict[str, Any]) -> str:
        ds = one(manifests.render(values), "DaemonSet")
        return str(ds["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    assert checksum({}) != checksum({"config": "[scheduler]\nmax_block_us = 500.0\n"})


# -- Prometheus Operator objects and rules ------------------------------------------------------


def _crd_problems(doc: dict[str, Any]) -> list[str]:
    """Where ``doc`` departs from the hand-written operator schema (CRD_SCHEMAS)."""
    validator = Draft7Validator(CRD_SCHEMAS[doc["kind"]])
    return [f"{'.'.join(map(str, e.absolute_path)) or '.'}: {e.message}" for e in validator.iter_errors(doc)]


def test_monitoring_objects_match_the_operator_crds(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The ServiceMonitor and PrometheusRule fit the Prometheus Operator's v1 CRDs as far as the
    chart uses them (CRD_SCHEMAS: fields, types, duration and label-name patterns, nothing
    unknown); a misspelt field, a bad duration and a missing selector are caught."""
    docs = [d for variant in ("defaults", "plain") for d in rendered[variant] if d["kind"] in CRD_MODELS]
    assert sorted(d["kind"] for d in docs) == ["PrometheusRule", "PrometheusRule", "ServiceMonitor", "ServiceMonitor"]
    for doc in docs:
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert _crd_problems(doc) == [], doc["kind"]
    sm = copy.deepcopy(next(d for d in docs if d["kind"] == "ServiceMonitor"))
    sm["spec"]["endpoints"][0]["intervall"] = "15s"
    assert _crd_problems(sm) == ["spec.endpoints.0: Additional properties are not allowed ('intervall' was unexpected)"]
    del sm["spec"]["endpoints"][0]["intervall"]
    sm["spec"]["endpoints"][0]["interval"] = "15 s"
    assert [p.split(":")[0] for p in _crd_problems(sm)] == ["spec.endpoints.0.interval"]
    del sm["spec"]["selector"]
    assert "spec: 'selector' is a required property" in _crd_problems(sm)


def test_prometheus_rule_carries_the_rule_file(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The PrometheusRule's spec is files/priod-rules.yaml as it stands (the file promtool
    checks), with the six alerts the runbook names."""
    rules = yaml.safe_load(RULES.read_text())
    assert one(rendered["defaults"], "PrometheusRule")["spec"] == rules
    alerts = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    assert alerts == [
        "PriodDown",
        "PriodUrgentLatencyHigh",
        "PriodDirectLatencyHigh",
        "PriodDeadlineMissesRising",
        "PriodRefusalsRising",
        "PriodSimEngineOnGpuNode",
    ]


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not found (Debian: apt-get install prometheus; .ci/run installs it)")
    return path


def test_rules_pass_promtool() -> None:
    """promtool accepts the rule file and its unit tests pass: each alert fires on the series it
    is for (labels and annotations as written) and not on a healthy twin."""
    promtool = _promtool()
    for cmd in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)]):
        r = subprocess.run([promtool, *cmd], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "SUCCESS" in r.stdout + r.stderr


# -- the container image ------------------------------------------------------------------------


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Containerfile, continuation lines joined, comments dropped."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.M)]


def _image_installs_what_serve_imports(run: str) -> None:
    """The extras the image's pip line installs (its ARG defaults filled in) pull every module
    `priod serve` needs beyond the client's (cli.DAEMON_MODULES), by pyproject.toml's own lists:
    an image without them would crash-loop every DaemonSet pod."""
    # The final venv's pip line: the wheel the build stage made, with the extras.
    found = re.search(r'/opt/priod/bin/pip install --no-cache-dir "[^"\[]*\[([^\]]*)\]"', run)
    assert found, run
    defaults = dict(re.findall(r"^ARG (\w+)=(\S*)$", CONTAINERFILE.read_text(), re.M))
    extras = [re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], e).strip() for e in found.group(1).split(",")]
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pulled = {
        re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower().replace("_", "-") for e in extras for req in optional[e]
    }
    needed = {m.replace("_", "-") for m in DAEMON_MODULES}
    assert needed <= pulled, f"the image installs extras {extras}, which miss {sorted(needed - pulled)}"


def test_containerfile_lints_clean_and_fits_the_chart(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """hadolint finds nothing; the image is built on an NVIDIA CUDA runtime base, installs
    priod from the checkout with its cuda extra, and runs as the uid and gid the chart declares
    (the socket's group client pods join) with the socket path the chart mounts."""
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    r = subprocess.run([hadolint, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

    ins = _instructions(CONTAINERFILE.read_text())
    assert ins[0][0] == "ARG"
    base = ins[0][1]
    assert re.fullmatch(r"BASE=nvidia/cuda:[0-9.]+-runtime-ubuntu[0-9.]+", base), base
    assert [a for i, a in ins if i == "FROM"] == ["${BASE} AS build", "${BASE}"]
    run = " ".join(a for i, a in ins if i == "RUN")
    assert "ARG CUDA_EXTRA=cuda" in CONTAINERFILE.read_text()
    _image_installs_what_serve_imports(run)
    users = [a for i, a in ins if i == "USER"]
    pod = one(rendered["defaults"], "DaemonSet")["spec"]["template"]["spec"]
    assert users == [f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"]
    last = dict(ins)  # the last of each instruction
    assert json.loads(last["ENTRYPOINT"]) == ["priod"]
    cmd = json.loads(last["CMD"])
    assert cmd == ["serve", "--socket", pod["containers"][0]["args"][-1]]


# -- dashboard and rules against a live daemon --------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SELECTOR = re.compile(r"(?<![\w:$.])([A-Za-z_:][\w:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(?!\w)(\s*\()?")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan"})
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "node", "service", "endpoint", "container"})
"""Labels Prometheus and the chart's ServiceMonitor add to every series at scrape."""
GENERATED = frozenset({"up"})
"""Series Prometheus makes itself for each target."""


def promql_selectors(expr: str) -> dict[str, set[str]]:
    """Every metric name ``expr`` selects, with the label names it matches on. Functions and
    aggregations (names before a parenthesis), grouping clauses, strings and range or
    subquery brackets are not metric names; ``label_values(m{...}, label)`` selects ``m``."""
    expr = re.sub(r"\blabel_values\s*\((.*),\s*\w+\s*\)", r"\1", expr)
    found: dict[str, set[str]] = {}
    for name, matchers in _SELECTOR.findall(expr):
        found.setdefault(name, set()).update(_MATCHER.findall(_STRING.sub('""', matchers)))
    bare = _GROUPING.sub(" ", _SELECTOR.sub(r"\1", _STRING.sub('""', expr)))
    bare = re.sub(r"\[[^\]]*\]", " ", bare)
    for name, call in _IDENT.findall(bare):
        if not call and name.lower() not in _KEYWORDS:
            found.setdefault(name, set())
    return found


def test_promql_selectors_finds_names_and_labels() -> None:
    """The name extractor the live check relies on: metric names with their matchers, not
    functions, grouping labels, durations, numbers or Grafana variables."""
    expr = (
        'histogram_quantile(0.99, sum by (gpu, le) (rate(priod_request_duration_seconds_bucket{job="priod", gpu=~"$gpu", priority="urgent"}[$__rate_interval])))'
        " > 1e-3 and ignoring (engine) priod_nvidia_device_nodes > 0 or vector(0) / up"
    )
    assert promql_selectors(expr) == {
        "priod_request_duration_seconds_bucket": {"job", "gpu", "priority"},
        "priod_nvidia_device_nodes": set(),
        "up": set(),
    }
    assert promql_selectors('label_values(priod_build_info{job="priod"}, node)') == {"priod_build_info": {"job"}}
    assert promql_selectors('process_resident_memory_bytes{job="priod"} / 2^30') == {
        "process_resident_memory_bytes": {"job"}
    }
    assert promql_selectors('rate(priod_copied_bytes_total{code!~"a,b}"}[5m:1m])') == {
        "priod_copied_bytes_total": {"code"}
    }


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every query in the dashboard: panel targets and variables."""
    dash = json.loads(DASHBOARD.read_text())
    out = [(f"panel {p['title']!r}", t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    out += [(f"variable {v['name']}", v["query"]["query"]) for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def rule_queries() -> list[tuple[str, str]]:
    rules = yaml.safe_load(RULES.read_text())
    return [(f"rule {r.get('alert') or r.get('record')}", r["expr"]) for g in rules["groups"] for r in g["rules"]]


def test_dashboard_has_the_panels_an_operator_needs() -> None:
    """The dashboard shows what the runbook asks of it, each panel with a query on the data
    source variable, in a grid without overlaps."""
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    titles = {p["title"] for p in panels}
    assert {
        "Urgent copy latency by GPU (p50, p99, p99.9)",
        "Copy latency p99 by class and GPU",
        "Bytes/s by class and direction",
        "Queue depth by class and direction",
        "Refusals by code",
        "Deadline misses by class",
        "Urgent copies: express vs DMA",
        "Engine = sim on a GPU node",
    } <= titles
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        assert g["x"] + g["w"] <= 24
        cells |= mine
    for p in panels:
        assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]
        assert p["datasource"]["uid"] == "${datasource}" and all(
            t["datasource"]["uid"] == "${datasource}" for t in p["targets"]
        )


@pytest.fixture(scope="module")
def live_scrape() -> Iterator[Samples]:
    """One scrape of a sim daemon after copies of two classes in both directions, a missed
    deadline and a refusal, so that every family has its series."""
    port = free_port()
    env = {"PRIOD_METRICS__PORT": str(port), "PRIOD_LOG__LEVEL": '"warning"'}
    with daemon_process(env) as d:

        async def work() -> None:
            async with priod.connect(d.socket_path, copy_path="daemon") as c:
                host, dev = await c.alloc_host(1 << 20), await c.alloc_device(1 << 20)
                for _ in range(3):
                    await c.copy(dev, host, 65536, priority="urgent")
                await c.copy(host, dev, priority="bulk")
                await c.copy(dev, host, 65536, priority="normal", deadline_ms=0.001)
                with pytest.raises(priod.InvalidRequest):
                    await c.copy(dev, host, priority="no-such-class")
                await asyncio.sleep(1.5)  # one gauge refresh with the client still connected

        asyncio.run(work())
        yield Scraper(port)()


def test_dashboard_and_rules_name_metrics_the_daemon_serves(live_scrape: Samples) -> None:
    """Every metric the dashboard's and the rules' queries select is served by a live daemon
    (histograms by their _bucket, _count and _sum series), and every label they match on is
    one of that metric's labels or a label the scrape adds."""
    labels: dict[str, set[str]] = {}
    for name, ls in live_scrape:
        labels.setdefault(name, set()).update(k for k, _ in ls)
    queries = dashboard_queries() + rule_queries()
    used: set[str] = set()
    problems = []
    for where, expr in queries:
        selected = promql_selectors(expr)
        if not selected:
            problems.append(f"{where}: selects no metric: {expr}")
        for name, matched in selected.items():
            used.add(name)
            if name in GENERATED:
                continue
            if name not in labels:
                problems.append(f"{where}: {name} is not served")
            elif matched - labels[name] - TARGET_LABELS:
                problems.append(f"{where}: {name} has no label {sorted(matched - labels[name] - TARGET_LABELS)}")
    assert problems == []
    # Not vacuous: the queries cover the families the panels and alerts are about.
    assert {
        "priod_request_duration_seconds_bucket",
        "priod_request_duration_seconds_count",
        "priod_queue_wait_seconds_bucket",
        "priod_copied_bytes_total",
        "priod_queued_requests",
        "priod_queued_bytes",
        "priod_refused_requests_total",
        "priod_deadline_misses_total",
        "priod_engine_info",
        "priod_nvidia_device_nodes",
        "priod_engine_busy_seconds_total",
        "priod_urgent_path_latency_seconds",
        "process_cpu_seconds_total",
        "up",
    } <= used
    assert len(queries) >= 25


def test_the_live_check_catches_an_old_name(live_scrape: Samples) -> None:
    """The live check fails on what it is for: a name from before the renames, and a label
    (lane) the daemon no longer has."""
    served = {name for name, _ in live_scrape}
    assert "priod_bytes_copied_total" not in served and "priod_copied_bytes_total" in served
    lane_labels = {k for name, ls in live_scrape if name == "priod_queued_requests" for k, _ in ls}
    assert promql_selectors('sum(priod_queued_requests{lane="gpu0/h2d"})')["priod_queued_requests"] - lane_labels == {
        "lane"
    }
