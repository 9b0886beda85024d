"""Proof that the e2e control plane is real Kubernetes: scheduling with taints and extended
resources, garbage collection, CEL validation, server-side apply conflicts."""

from __future__ import annotations

import json
import time
from typing import Any

from e2e.harness.controlplane import ControlPlane
from e2e.harness.wait import wait_for


def gpu_deployment(name: str, tolerate: bool, replicas: int = 2) -> str:
    pod_spec: dict[str, Any] = {
        "containers": [
            {
                "name": "engine",
                "image": "phasefleet/engine:test",
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            }
        ]
    }
    if tolerate:
        pod_spec["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    return json.dumps(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": name}},
                "template": {"metadata": {"labels": {"app": name}}, "spec": pod_spec},
            },
        }
    )


def pods(cluster: ControlPlane, namespace: str, app: str) -> list[dict[str, Any]]:
    return list(cluster.get_json("pods", "-n", namespace, "-l", f"app={app}")["items"])


def test_version_is_stamped(cluster: ControlPlane) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.33.13"
    assert version["serverVersion"]["minor"] == "33"
    assert version["clientVersion"]["gitVersion"] == "v1.33.13"
    helm = cluster.helm("version", "--short").stdout
    assert helm.startswith("v3.18.6")


def test_gpu_pods_schedule_on_tolerated_fake_gpu_nodes(
    cluster: ControlPlane, namespace: str
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=gpu_deployment("gpu", tolerate=True))

    def all_running() -> list[dict[str, Any]] | None:
        items = pods(cluster, namespace, "gpu")
        running = [p for p in items if p["status"].get("phase") == "Running"]
        return items if len(items) == 2 and len(running) == 2 else None

    items = wait_for(all_running, what="2 GPU pods Running")
    assert {p["spec"]["nodeName"] for p in items} <= {"kwok-gpu-0", "kwok-gpu-1"}


def test_gpu_pods_without_toleration_stay_pending(cluster: ControlPlane, namespace: str) -> None:
    cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=gpu_deployment("plain", tolerate=False)
    )

    def unschedulable() -> list[dict[str, Any]] | None:
        items = pods(cluster, namespace, "plain")
        conditions = [
            c
            for p in items
            for c in p["status"].get("conditions", [])
            if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
        ]
        return conditions if len(items) == 2 and len(conditions) == 2 else None

    conditions = wait_for(unschedulable, what="2 pods marked Unschedulable")
    assert all("untolerated taint" in c["message"] for c in conditions), conditions
    time.sleep(2)
    assert all(p["status"]["phase"] == "Pending" for p in pods(cluster, namespace, "plain"))
    assert all(not p["spec"].get("nodeName") for p in pods(cluster, namespace, "plain"))


def test_deleting_owner_garbage_collects_dependent(cluster: ControlPlane, namespace: str) -> None:
    cluster.kubectl("create", "configmap", "owner", "-n", namespace)
    owner_uid = cluster.get_json("configmap", "owner", "-n", namespace)["metadata"]["uid"]
    dependent = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "dependent",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}
            ],
        },
        "data": {"k": "v"},
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(dependent))
    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)

    def dependent_gone() -> bool:
        got = cluster.kubectl("get", "configmap", "dependent", "-n", namespace, check=False)
        return got.returncode != 0 and "NotFound" in got.stderr

    wait_for(dependent_gone, what="dependent ConfigMap garbage-collected")


WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.e2e.phasefleet.dev"},
    "spec": {
        "group": "e2e.phasefleet.dev",
        "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {
                                    "minReplicas": {"type": "integer"},
                                    "replicas": {"type": "integer"},
                                },
                                "x-kubernetes-validations": [
                                    {
                                        "rule": "self.minReplicas <= self.replicas",
                                        "message": "spec.minReplicas must not exceed spec.replicas",
                                    }
                                ],
                            }
                        },
                    }
                },
            }
        ],
    },
}


def widget(name: str, min_replicas: int, replicas: int) -> str:
    return json.dumps(
        {
            "apiVersion": "e2e.phasefleet.dev/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": {"minReplicas": min_replicas, "replicas": replicas},
        }
    )


def test_cel_rule_rejects_bad_object_with_its_message(
    cluster: ControlPlane, namespace: str
) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(WIDGET_CRD))
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/widgets.e2e.phasefleet.dev", "--timeout=30s"
    )
    bad = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=widget("bad", 3, 1), check=False
    )
    assert bad.returncode != 0
    assert "spec.minReplicas must not exceed spec.replicas" in bad.stderr
    assert cluster.kubectl("get", "widget", "bad", "-n", namespace, check=False).returncode != 0

    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget("good", 1, 3))
    stored = cluster.get_json("widget", "good", "-n", namespace)
    assert stored["spec"] == {"minReplicas": 1, "replicas": 3}


def test_server_side_apply_reports_conflict_between_managers(
    cluster: ControlPlane, namespace: str
) -> None:
    def config_map(value: str) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "shared", "namespace": namespace},
                "data": {"level": value},
            }
        )

    apply = ["apply", "--server-side", "-f", "-"]
    cluster.kubectl(*apply, "--field-manager=alice", input=config_map("1"))
    clash = cluster.kubectl(*apply, "--field-manager=bob", input=config_map("2"), check=False)
    assert clash.returncode != 0
    assert "conflict" in clash.stderr.lower()
    assert 'conflict with "alice"' in clash.stderr
    assert cluster.get_json("configmap", "shared", "-n", namespace)["data"] == {"level": "1"}
