"""The chart as the e2e tests see it: rendered with `helm template`, and what its monitoring
objects need from a cluster."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.controlplane import tools_bin_dir

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "phasefleet"
KUBE_VERSION = "--kube-version=1.33.0"
RULE_API = "--api-versions=monitoring.coreos.com/v1/PrometheusRule"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = tools_bin_dir() / "helm"
    if not binary.exists():
        pytest.fail(f"{binary} missing: run `make tools` (e2e/tools/install.sh)")
    return subprocess.run(
        [str(binary), *args], capture_output=True, text=True, check=check, timeout=120
    )


def render(*args: str) -> list[dict[str, Any]]:
    """The chart's objects, rendered for Kubernetes 1.33 in namespace `pf`."""
    out = helm("template", "t", str(CHART), KUBE_VERSION, "-n", "pf", *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def kinds(objects: list[dict[str, Any]]) -> list[str]:
    return [o["kind"] for o in objects]


def rendered_dashboard(*args: str) -> dict[str, Any]:
    """The dashboard JSON as the chart's ConfigMap carries it."""
    config_map = one(render("--set", "dashboard.enabled=true", *args), "ConfigMap")
    return dict(json.loads(config_map["data"]["phasefleet.json"]))


def rule_groups(*args: str) -> list[dict[str, Any]]:
    return list(one(render(RULE_API, *args), "PrometheusRule")["spec"]["groups"])


def pod_monitor_scrape_config(discovery_url: str) -> dict[str, Any]:
    """The chart's PodMonitor as a plain Prometheus scrape config over pod discovery: its pod
    selector and port, the labels the Prometheus Operator gives every PodMonitor target
    (namespace, pod), and the PodMonitor's own relabelings, read from the rendered chart."""
    (monitor,) = [
        d
        for d in render("--api-versions", "monitoring.coreos.com/v1/PodMonitor")
        if d["kind"] == "PodMonitor" and d["metadata"]["name"].endswith("-engines")
    ]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ((label, value),) = monitor["spec"]["selector"]["matchLabels"].items()
    meta_label = "__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in label)
    relabel = [
        {"source_labels": [meta_label], "regex": value, "action": "keep"},
        {
            "source_labels": ["__meta_kubernetes_pod_container_port_name"],
            "regex": endpoint["port"],
            "action": "keep",
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        *(
            {"source_labels": r["sourceLabels"], "target_label": r["targetLabel"]}
            for r in endpoint["relabelings"]
        ),
    ]
    return {
        "job_name": "phasefleet-engines",
        "metrics_path": endpoint["path"],
        "http_sd_configs": [{"url": discovery_url, "refresh_interval": "1s"}],
        "relabel_configs": relabel,
    }


def monitoring_crd(kind: str) -> dict[str, Any]:
    """A schemaless stand-in for the Prometheus Operator's CRD of `kind` (monitoring.coreos.com
    /v1), so the chart sees that API exist."""
    plural = f"{kind.lower()}s"
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }
