"""The Helm chart: lint, values schema, rendering variants, and a real namespaced install whose
RBAC is checked with `kubectl auth can-i` (least privilege) and is enough for the operator to
serve a model in that namespace; its PodMonitor appears only when the monitoring.coreos.com CRD
exists."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from e2e.harness.chart import CHART, KUBE_VERSION, ROOT, helm, kinds, monitoring_crd, render
from e2e.harness.controlplane import ControlPlane, tools_bin_dir
from e2e.harness.phasefleet_operator import (
    Operator,
    can_i,
    get,
    is_ready,
    service_account_kubeconfig,
)
from e2e.harness.wait import wait_for
from phasefleet.api.contract import CHILD_KINDS

PODMONITOR_CRD = monitoring_crd("PodMonitor")


def test_lint_is_clean() -> None:
    result = helm("lint", "--strict", str(CHART), KUBE_VERSION)
    assert "0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


def helm_without_a_cluster(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """helm as a tool that renders charts runs it: no cluster, no kubeconfig."""
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "no-kubeconfig")}
    helm = str(tools_bin_dir() / "helm")
    return subprocess.run([helm, *args], env=env, capture_output=True, text=True, timeout=60)


def test_renders_and_lints_without_a_cluster_or_a_kube_version(tmp_path: Path) -> None:
    # Helm then reports its built-in default version: v1.20.0 for this Helm, built from source.
    rendered = helm_without_a_cluster(tmp_path, "template", "t", str(CHART), "-n", "pf")
    assert rendered.returncode == 0, rendered.stderr
    assert "Deployment" in kinds([d for d in yaml.safe_load_all(rendered.stdout) if d])
    linted = helm_without_a_cluster(tmp_path, "lint", "--strict", str(CHART))
    assert linted.returncode == 0 and "0 chart(s) failed" in linted.stdout, linted.stdout


def test_a_kube_version_below_the_minimum_is_refused(tmp_path: Path) -> None:
    old = helm_without_a_cluster(tmp_path, "template", "t", str(CHART), "--kube-version=1.29.0")
    assert old.returncode != 0
    assert "needs Kubernetes 1.30 or later" in old.stderr and "is v1.29.0" in old.stderr
    for version in ("1.30.0", "1.30.0-eks-1a2b3c"):  # a cloud's suffix is a semver pre-release
        args = ("template", "t", str(CHART), f"--kube-version={version}")
        ok = helm_without_a_cluster(tmp_path, *args)
        assert ok.returncode == 0, (version, ok.stderr)


def test_default_render_is_cluster_wide() -> None:
    docs = render()
    assert sorted(kinds(docs)) == [
        "ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding",
        "Deployment", "ServiceAccount",
    ]  # fmt: skip
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/phasefleet/phasefleet-operator:0.1.0"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PHASEFLEET_WATCH_NAMESPACES"] == ""


def test_watched_namespaces_get_roles_not_a_cluster_role() -> None:
    docs = render("--set", "watchNamespaces={team-a,team-b}", "--set", "logLevel=debug")
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    cluster_roles = [d for d in docs if d["kind"] == "ClusterRole"]
    assert [c["metadata"]["name"] for c in cluster_roles] == ["t-phasefleet-discovery"]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PHASEFLEET_WATCH_NAMESPACES"] == "team-a,team-b"
    assert "--log-level=debug" in container["args"]


def test_reading_secrets_is_opt_in() -> None:
    def verbs(resource: str, *args: str) -> set[str]:
        (role,) = [
            d for d in render(*args)
            if d["kind"] == "ClusterRole" and not d["metadata"]["name"].endswith("-discovery")
        ]  # fmt: skip
        return {v for rule in role["rules"] if resource in rule["resources"] for v in rule["verbs"]}

    assert verbs("secrets") == {"create"}  # each service's internal token, never read back
    # A missing token Secret is read from the pods' state instead (watched: a failing pod
    # changes no Deployment); the autoscaler annotates the pod a scale-down removes first.
    # Nothing else on pods.
    assert verbs("pods") == {"list", "watch", "patch"}
    assert verbs("secrets", "--set", "rbac.readSecrets=true") == {"create", "get"}
    # The model PVC is checked; a model cache claim is created once, never changed or deleted.
    assert verbs("persistentvolumeclaims") == {"get", "create"}


def test_rights_never_go_to_the_default_service_account() -> None:
    refusals = {
        "serviceAccount.create=false": (
            "never binds rights to the namespace's default ServiceAccount"
        ),
        "serviceAccount.name=default": "at '/serviceAccount/name'",  # the values schema's
    }
    for bad, message in refusals.items():
        result = helm("template", "t", str(CHART), KUBE_VERSION, "--set", bad, check=False)
        assert result.returncode != 0 and message in result.stderr, (bad, result.stderr)
    docs = render("--set", "serviceAccount.create=false", "--set", "serviceAccount.name=ops")
    assert "ServiceAccount" not in kinds(docs)
    for binding in (d for d in docs if d["kind"].endswith("Binding")):
        assert [s["name"] for s in binding["subjects"]] == ["ops"]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


def test_podmonitor_only_when_the_api_exists() -> None:
    assert "PodMonitor" not in kinds(render())
    with_api = render("--api-versions", "monitoring.coreos.com/v1/PodMonitor")
    monitors = {d["metadata"]["name"]: d for d in with_api if d["kind"] == "PodMonitor"}
    engines = monitors["t-phasefleet-engines"]["spec"]["podMetricsEndpoints"][0]
    assert engines["relabelings"][0]["targetLabel"] == "inferenceservice"
    # The operator's own /metrics keeps its series' namespace label (the service's, not its own).
    operator = monitors["t-phasefleet-operator"]["spec"]["podMetricsEndpoints"][0]
    assert operator["port"] == "metrics" and operator["honorLabels"] is True
    (dep,) = [d for d in with_api if d["kind"] == "Deployment"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--metrics-port=8081" in container["args"]
    assert {"name": "metrics", "containerPort": 8081} in container["ports"]


@pytest.mark.parametrize(
    "bad",
    ["replicaCount=3", "logLevel=loud", "image.pullPolicy=Sometimes", "watchNamespaces={Bad_NS}"],
)
def test_values_schema_rejects_bad_values(bad: str) -> None:
    result = helm("template", "t", str(CHART), KUBE_VERSION, "--set", bad, check=False)
    assert result.returncode != 0 and "values don't meet the specifications" in result.stderr


@pytest.fixture
def podmonitor_crd(cluster: ControlPlane) -> Iterator[None]:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(PODMONITOR_CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/podmonitors.monitoring.coreos.com")
    yield
    cluster.kubectl("delete", "crd", "podmonitors.monitoring.coreos.com", "--wait=false")


def test_install_namespaced_with_least_privilege(
    cluster: ControlPlane, namespace: str, podmonitor_crd: None
) -> None:
    release = f"rel-{namespace[-8:]}"
    watched = namespace
    cluster.helm(
        "install", release, str(CHART), "-n", namespace, "--wait", "--timeout", "120s",
        "--set", f"watchNamespaces={{{watched}}}", "--set", "replicaCount=1",
    )  # fmt: skip
    try:
        name = f"{release}-phasefleet"
        dep = wait_for(
            lambda: (
                (d := get(cluster, "deployment", name, "-n", namespace))
                and d.get("status", {}).get("readyReplicas") == 1
                and d
            ),
            90,
            "operator Deployment ready (on a KWOK node)",
        )
        assert dep["spec"]["strategy"]["type"] == "Recreate"
        assert get(cluster, "podmonitor", f"{name}-engines", "-n", namespace) is not None
        assert get(cluster, "crd", "inferenceservices.serving.phasefleet.dev") is not None

        sa = f"system:serviceaccount:{namespace}:{name}"
        ns = ["-n", watched]
        for child in CHILD_KINDS:  # the contract's list of child kinds drives this check
            resource = f"{child.plural}.{child.group}" if child.group else child.plural
            for verb in ("get", "list", "watch", "create", "patch", "delete"):
                assert can_i(cluster, sa, verb, resource, *ns), (verb, resource)
            assert not can_i(cluster, sa, "patch", resource, "-n", "default"), resource
        assert can_i(cluster, sa, "patch", "inferenceservices.serving.phasefleet.dev/status", *ns)
        assert not can_i(cluster, sa, "get", "secrets", *ns)
        assert not can_i(cluster, sa, "list", "secrets", *ns)
        assert can_i(cluster, sa, "list", "pods", *ns)
        assert can_i(cluster, sa, "watch", "pods", *ns)  # a failing pod changes no Deployment
        assert can_i(cluster, sa, "patch", "pods", *ns)  # the autoscaler's pod-deletion-cost
        assert not can_i(cluster, sa, "list", "pods", "-n", "default")
        assert not can_i(cluster, sa, "watch", "pods", "-n", "default")
        assert not can_i(cluster, sa, "patch", "pods", "-n", "default")
        for verb in ("get", "update", "delete", "create"):
            assert not can_i(cluster, sa, verb, "pods", *ns), verb
        assert can_i(cluster, sa, "create", "persistentvolumeclaims", *ns)  # spec.model.cache
        for verb in ("list", "watch", "update", "patch", "delete"):
            assert not can_i(cluster, sa, verb, "persistentvolumeclaims", *ns), verb
        assert not can_i(cluster, sa, "create", "persistentvolumeclaims", "-n", "default")
        assert not can_i(cluster, sa, "update", "deployments.apps", *ns)
        assert not can_i(cluster, sa, "delete", "inferenceservices.serving.phasefleet.dev", *ns)
        assert not can_i(cluster, sa, "patch", "deployments.apps", "-n", "default")
        assert can_i(cluster, sa, "list", "customresourcedefinitions.apiextensions.k8s.io")
        assert not can_i(cluster, sa, "create", "customresourcedefinitions.apiextensions.k8s.io")
        assert not can_i(cluster, sa, "delete", "namespaces")

        notes = cluster.helm("get", "notes", release, "-n", namespace).stdout
        assert f"It manages InferenceServices in: {watched}." in notes

        # The operator itself, limited to the Role in its one namespace, serves a model there.
        workdir = Path(tempfile.mkdtemp(prefix="phasefleet-helm-"))
        kubeconfig = service_account_kubeconfig(cluster, workdir / "kubeconfig", name, namespace)
        operator = Operator(cluster, kubeconfig, workdir, "--namespace", watched)
        operator.start()
        try:
            example = (ROOT / "examples" / "tiny-disaggregated.yaml").read_text()
            cluster.kubectl("apply", "-n", watched, "-f", "-", input=example)
            wait_for(lambda: is_ready(cluster, watched, "tiny"), 120, "tiny Ready")
            denied = re.findall(r"forbidden: User \S+ cannot [^']*", operator.log())
            assert not denied, denied
        finally:
            operator.stop()
    finally:
        cluster.helm("uninstall", release, "-n", namespace, "--wait")
    assert get(cluster, "deployment", f"{release}-phasefleet", "-n", namespace) is None
    # CRDs from the chart's crds/ folder stay: Helm never deletes them (the data would go).
    assert get(cluster, "crd", "inferenceservices.serving.phasefleet.dev") is not None
