"""The operator on the real control plane: examples, status and columns, rollout, drift,
garbage collection, a missing PVC, restart idempotence. The operator runs as a process with
the Helm chart's ServiceAccount, so these tests also prove the chart's RBAC is enough."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.controlplane import ControlPlane
from e2e.harness.phasefleet_operator import (
    Operator,
    can_i,
    condition,
    get,
    is_ready,
)
from e2e.harness.wait import wait_for
from phasefleet.api import contract
from phasefleet.api.base import quantity

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CHILD_KINDS = tuple(child.kind.lower() for child in contract.CHILD_KINDS)


def expected_children(name: str, pools: list[str]) -> set[str]:
    """ "kind/name" of every child an InferenceService with these pools should have."""
    return {
        f"{child.kind.lower()}/{child_name}"
        for child in contract.CHILD_KINDS
        for child_name in child.names(name, pools)
    }


@pytest.fixture
def wait(operator: Operator) -> Callable[..., Any]:
    """wait_for, with the operator's log tail in the timeout message."""

    def waiter(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        try:
            return wait_for(predicate, timeout, what)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\noperator log tail:\n{operator.log()[-5000:]}") from None

    return waiter


def tiny(name: str = "tiny", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"image": {"path": "/models/tiny"}},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 1},
    }
    body.update(spec)
    return {
        "apiVersion": "serving.phasefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": body,
    }


def apply(cluster: ControlPlane, namespace: str, obj: dict[str, Any] | str) -> None:
    text = obj if isinstance(obj, str) else json.dumps(obj)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=text)


def children(cluster: ControlPlane, namespace: str, name: str) -> dict[str, dict[str, Any]]:
    """ "kind/name" -> object, for every child labelled with the InferenceService's name."""
    out = {}
    for kind in CHILD_KINDS:
        selector = f"phasefleet.dev/inferenceservice={name}"
        items = get(cluster, kind, "-n", namespace, "-l", selector, "--show-managed-fields")
        for item in (items or {}).get("items", []):
            out[f"{kind}/{item['metadata']['name']}"] = item
    return out


def columns(table: str) -> list[dict[str, str]]:
    """Rows of `kubectl get` output, cut at the header's column starts (cells may be blank)."""
    header, *rows = table.splitlines()
    names = header.split()
    starts = [header.index(f"{n} " if i < len(names) - 1 else n) for i, n in enumerate(names)]
    ends = [*starts[1:], None]
    return [{n: r[a:b].strip() for n, a, b in zip(names, starts, ends, strict=True)} for r in rows]


def bind_pvc(cluster: ControlPlane, namespace: str, claim: str) -> None:
    """A static PersistentVolume for the claim: the scheduler waits for bound claims."""
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{namespace}-{claim}"},
        "spec": {
            "capacity": {"storage": "100Gi"},
            "accessModes": ["ReadOnlyMany", "ReadWriteOnce", "ReadWriteMany"],
            "hostPath": {"path": f"/tmp/{namespace}-{claim}"},
            "claimRef": {"namespace": namespace, "name": claim},
            "persistentVolumeReclaimPolicy": "Delete",
        },
    }
    apply(cluster, namespace, pv)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_gets_children_status_and_columns(
    cluster: ControlPlane,
    operator: Operator,
    namespace: str,
    wait: Callable[..., Any],
    example: Path,
) -> None:
    docs = [d for d in yaml.safe_load_all(example.read_text()) if d]
    for doc in docs:
        if doc["kind"] == "PersistentVolumeClaim":
            bind_pvc(cluster, namespace, doc["metadata"]["name"])
    (isvc,) = [d for d in docs if d["kind"] == "InferenceService"]
    name, spec = isvc["metadata"]["name"], isvc["spec"]
    if "pvc" in spec["model"].get("cache", {}):  # the model cache's claim, made by the operator
        bind_pvc(cluster, namespace, f"{name}-model-cache")
    apply(cluster, namespace, example.read_text())
    roles = ["worker"] if spec.get("mode") == "aggregated" else ["prefill", "decode"]

    wait(lambda: is_ready(cluster, namespace, name), 120, f"{name} Ready")
    kids = children(cluster, namespace, name)
    expected = expected_children(name, list(roles))
    assert set(kids) == expected
    for obj in kids.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["kind"] == "InferenceService" and ref["name"] == name and ref["controller"]
        managers = {m["manager"] for m in obj["metadata"]["managedFields"]}
        assert "phasefleet-operator" in managers
    for role in roles:
        dep = kids[f"deployment/{name}-{role}"]
        pod = dep["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert dep["spec"]["replicas"] == spec[role].get("replicas", 1)
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        limits = spec[role].get("resources", {}).get("limits", {})
        if "nvidia.com/gpu" in limits:
            assert container["resources"]["limits"]["nvidia.com/gpu"] == str(
                limits["nvidia.com/gpu"]
            )
            assert pod["tolerations"] == spec[role]["tolerations"]
            pods = get(cluster, "pods", "-n", namespace, "-l", f"phasefleet.dev/role={role}")
            assert {p["spec"]["nodeName"] for p in pods["items"]} <= {"kwok-gpu-0", "kwok-gpu-1"}
        host_kv = spec.get("runtime", {}).get("hostKvCacheSize")
        if host_kv is not None and "memory" in limits:  # the host tier counts in the pod's memory
            asked = quantity(container["resources"]["limits"]["memory"])
            assert asked == quantity(limits["memory"]) + quantity(host_kv)  # type: ignore[operator]
            assert "--host-kv-cache-gib" in container["args"]
        hf = spec["model"].get("hf", {})
        if "tokenSecret" in hf:  # for whoever downloads: with a cache, the init container
            cached = "cache" in spec["model"]
            (downloader,) = pod["initContainers"] if cached else [container]
            env = {e["name"]: e for e in downloader["env"]}
            assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == hf["tokenSecret"]["name"]
            assert cached != ("HF_TOKEN" in {e["name"] for e in container["env"]})

    # The router's own account reads its namespace's EndpointSlices and nothing else.
    router_sa = f"system:serviceaccount:{namespace}:{name}-router"
    here = ["-n", namespace]
    for verb in ("get", "list", "watch"):
        assert can_i(cluster, router_sa, verb, "endpointslices.discovery.k8s.io", *here)
    assert not can_i(cluster, router_sa, "list", "endpointslices.discovery.k8s.io", "-n", "default")
    for verb, resource in (("get", "secrets"), ("list", "pods"), ("create", "endpointslices")):
        assert not can_i(cluster, router_sa, verb, resource, *here), (verb, resource)
    token = get(cluster, "secret", f"{name}-internal", *here)
    assert token["metadata"]["ownerReferences"][0]["name"] == name and token["data"]["token"]
    router_pod = kids[f"deployment/{name}-router"]["spec"]["template"]["spec"]
    assert router_pod["serviceAccountName"] == f"{name}-router"

    stored = get(cluster, "inferenceservice", name, "-n", namespace)
    status = stored["status"]
    assert status["endpoint"] == f"http://{name}-router.{namespace}.svc:80"
    assert status["observedGeneration"] == stored["metadata"]["generation"]
    assert condition(stored, "Degraded")["status"] == "False"
    assert condition(stored, "Progressing")["status"] == "False"
    for role in roles:
        want = spec[role].get("replicas", 1)
        assert status["pools"][role] == {
            "replicas": want,
            "readyReplicas": want,
            "desiredReplicas": want,
        }
    assert "secret" not in json.dumps(status).lower()
    for doc in docs:  # Secret values never reach the operator's log
        for value in (doc.get("stringData") or {}).values():
            assert value not in operator.log()

    table = cluster.kubectl("get", "inferenceservices", "-n", namespace).stdout
    row = columns(table)[0]
    assert list(row) == [
        "NAME", "MODE", "PREFILL", "DECODE", "WORKERS", "TTFT", "TPOT", "KV", "SCALE", "READY",
        "AGE",
    ]  # fmt: skip
    assert row["NAME"] == name and row["MODE"] == spec.get("mode", "disaggregated")
    for column, role in (("PREFILL", "prefill"), ("DECODE", "decode"), ("WORKERS", "worker")):
        want = spec[role].get("replicas", 1) if role in roles else None
        assert row[column] == ("" if want is None else f"{want}/{want}"), (column, table)
    assert row["TTFT"] in ("", "<none>")  # metrics come from the autoscaler, not running here
    assert row["SCALE"] in ("", "<none>")  # not scaled to zero
    assert row["READY"] == "True"

    events = get(
        cluster, "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}"
    )
    assert "Created" in {e["reason"] for e in events["items"]}


def test_spec_change_rolls_the_pods(
    cluster: ControlPlane, operator: Operator, namespace: str, wait: Callable[..., Any]
) -> None:
    apply(cluster, namespace, tiny())
    wait(lambda: is_ready(cluster, namespace, "tiny"), 90, "tiny Ready")
    before = get(cluster, "deployment", "tiny-decode", "-n", namespace)
    old_pods = {
        p["metadata"]["name"]
        for p in get(cluster, "pods", "-n", namespace, "-l", "phasefleet.dev/role=decode")["items"]
    }
    cluster.kubectl(
        "patch", "inferenceservice", "tiny", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"decode": {"maxNumSeqs": 8}}}),
    )  # fmt: skip

    def rolled() -> bool:
        isvc = get(cluster, "inferenceservice", "tiny", "-n", namespace)
        pods = get(cluster, "pods", "-n", namespace, "-l", "phasefleet.dev/role=decode")["items"]
        names = {p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")}
        return (
            isvc["status"].get("observedGeneration") == 2
            and condition(isvc, "Ready").get("status") == "True"
            and bool(names)
            and not names & old_pods
        )

    wait(rolled, 120, "decode pods replaced")
    after = get(cluster, "deployment", "tiny-decode", "-n", namespace)
    key = "phasefleet.dev/spec-hash"
    tmpl_before = before["spec"]["template"]
    tmpl_after = after["spec"]["template"]
    assert tmpl_after["metadata"]["annotations"][key] != tmpl_before["metadata"]["annotations"][key]
    args = tmpl_after["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "8"
    prefill = get(cluster, "deployment", "tiny-prefill", "-n", namespace)
    assert prefill["metadata"]["generation"] == 1  # the prefill pool did not change
    events = get(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=tiny")
    assert "Updated" in {e["reason"] for e in events["items"]}


def test_an_slo_edit_rolls_the_router_and_no_pool(
    cluster: ControlPlane, operator: Operator, namespace: str, wait: Callable[..., Any]
) -> None:
    """slo.ttftMs and slo.tpotMs reach the workers with each request, through the router: an
    edit of both changes the router's Deployment (its flags) and neither pool's."""
    spec = {"slo": {"ttftMs": 800, "tpotMs": 50}, "runtime": {"adaptivePhaseBoundary": True}}
    apply(cluster, namespace, tiny("slo", **spec))
    wait(lambda: is_ready(cluster, namespace, "slo"), 90, "slo Ready")

    def deployments() -> dict[str, dict[str, Any]]:
        return {
            role: get(cluster, "deployment", f"slo-{role}", "-n", namespace)
            for role in ("prefill", "decode", "router")
        }

    before = deployments()
    cluster.kubectl(
        "patch", "inferenceservice", "slo", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"slo": {"ttftMs": 900, "tpotMs": 60}}}),
    )  # fmt: skip

    def router_changed() -> bool:
        isvc = get(cluster, "inferenceservice", "slo", "-n", namespace)
        router = get(cluster, "deployment", "slo-router", "-n", namespace)
        generation = router["metadata"]["generation"]
        observed = isvc["status"].get("observedGeneration") == 2
        return observed and generation > before["router"]["metadata"]["generation"]

    wait(router_changed, 60, "the router's Deployment changed")
    after = deployments()
    for pool in ("prefill", "decode"):
        assert after[pool]["metadata"]["generation"] == before[pool]["metadata"]["generation"]
    args = after["router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--late-after-ms") + 1] == "900"
    assert args[args.index("--tpot-target-ms") + 1] == "60"


def test_mode_change_replaces_the_pools(
    cluster: ControlPlane, operator: Operator, namespace: str, wait: Callable[..., Any]
) -> None:
    apply(cluster, namespace, tiny())
    wait(lambda: is_ready(cluster, namespace, "tiny"), 90, "tiny Ready")
    patch: dict[str, Any] = {
        "spec": {"mode": "aggregated", "prefill": None, "decode": None, "worker": {}}
    }
    cluster.kubectl(
        "patch",
        "inferenceservice",
        "tiny",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps(patch),
    )
    expected = expected_children("tiny", ["worker"])
    wait(lambda: set(children(cluster, namespace, "tiny")) == expected, 90, "pools replaced")
    wait(lambda: is_ready(cluster, namespace, "tiny"), 90, "aggregated tiny Ready")
    isvc = get(cluster, "inferenceservice", "tiny", "-n", namespace)
    assert set(isvc["status"]["pools"]) == {"worker", "router"}

    # The old pools were deleted only once the worker pool was ready: the new Deployment
    # cannot have been ready when it was created, so the deletion came from a later pass
    # (whose event may be posted a moment after the status shows the new pools).
    def deletions() -> list[str]:
        events = get(
            cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=tiny"
        )
        return [e["message"] for e in events["items"] if "deleted" in e["message"]]

    # kopf posts events in the background: wait for it. The pass that deletes them runs for
    # a child's or a pod's event, and says why.
    posted = wait(deletions, 30, "the deletion event")
    assert any("the pools replacing them are ready" in m for m in posted), posted


def test_hand_edits_are_restored(
    cluster: ControlPlane, operator: Operator, namespace: str, wait: Callable[..., Any]
) -> None:
    apply(cluster, namespace, tiny())
    wait(lambda: is_ready(cluster, namespace, "tiny"), 90, "tiny Ready")
    cluster.kubectl("scale", "deployment", "tiny-prefill", "-n", namespace, "--replicas=3")
    cluster.kubectl(
        "patch", "service", "tiny-router", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"selector": {"phasefleet.dev/role": "decode"}}}),
    )  # fmt: skip
    cluster.kubectl("delete", "pdb", "tiny-decode", "-n", namespace)

    def restored() -> bool:
        dep = get(cluster, "deployment", "tiny-prefill", "-n", namespace)
        svc = get(cluster, "service", "tiny-router", "-n", namespace)
        pdb = get(cluster, "pdb", "tiny-decode", "-n", namespace)
        return bool(
            dep and dep["spec"]["replicas"] == 1
            and svc and svc["spec"]["selector"]["phasefleet.dev/role"] == "router"
            and pdb is not None
        )  # fmt: skip

    wait(restored, 60, "hand edits undone")
    events = get(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=tiny")
    assert "DriftCorrected" in {e["reason"] for e in events["items"]}


def test_delete_garbage_collects_children(
    cluster: ControlPlane, operator: Operator, namespace: str, wait: Callable[..., Any]
) -> None:
    apply(cluster, namespace, tiny())
    want = len(expected_children("tiny", ["prefill", "decode"]))
    wait(lambda: len(children(cluster, namespace, "tiny")) == want, 60, "children created")
    cluster.kubectl("delete", "inferenceservice", "tiny", "-n", namespace, "--wait=true")
    wait(lambda: not children(cluster, namespace, "tiny"), 90, "children garbage-collected")
    selector = "phasefleet.dev/inferenceservice=tiny"
    wait(
        lambda: not get(cluster, "pods", "-n", namespace, "-l", selector)["items"], 90, "pods gone"
    )


def test_missing_pvc_is_degraded_until_created(
    cluster: ControlPlane, operator: Operator, namespace: str, wait: Callable[..., Any]
) -> None:
    apply(cluster, namespace, tiny(model={"pvc": {"claimName": "weights", "path": "/m"}}))

    def degraded() -> dict[str, Any]:
        cond = condition(get(cluster, "inferenceservice", "tiny", "-n", namespace), "Degraded")
        return cond if cond.get("status") == "True" else {}

    cond = wait(degraded, 60, "Degraded condition")
    assert cond["reason"] == "ModelVolumeMissing"
    assert f"PersistentVolumeClaim {namespace}/weights not found" in cond["message"]
    assert "spec.model.pvc.claimName" in cond["message"]
    assert not children(cluster, namespace, "tiny")
    events = get(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=tiny")
    warnings = {e["reason"] for e in events["items"] if e["type"] == "Warning"}
    assert "ModelVolumeMissing" in warnings

    bind_pvc(cluster, namespace, "weights")
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "weights"},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    apply(cluster, namespace, pvc)
    wait(lambda: is_ready(cluster, namespace, "tiny"), 120, "Ready after the PVC appears")
    isvc = get(cluster, "inferenceservice", "tiny", "-n", namespace)
    assert condition(isvc, "Degraded")["status"] == "False"


def _versions(cluster: ControlPlane, namespace: str, names: list[str]) -> dict[str, str]:
    out = {}
    for name in names:
        for key, obj in children(cluster, namespace, name).items():
            out[key] = obj["metadata"]["resourceVersion"]
        isvc = get(cluster, "inferenceservice", name, "-n", namespace)
        out[f"inferenceservice/{name}"] = isvc["metadata"]["resourceVersion"]
    return out


def test_restart_is_idempotent(
    cluster: ControlPlane, operator: Operator, namespace: str, wait: Callable[..., Any]
) -> None:
    names = ["svc-a", "svc-b"]
    for name in names:
        apply(cluster, namespace, tiny(name))
    for name in names:
        wait(lambda n=name: is_ready(cluster, namespace, n), 90, f"{name} Ready")
    time.sleep(3)  # let trailing Deployment status updates settle
    before = _versions(cluster, namespace, names)

    operator.stop()
    log_size = len(operator.log())
    operator.start()

    def resumed() -> bool:
        return operator.log()[log_size:].count("reconciled (resume)") >= len(names)

    wait(resumed, 60, "resume handlers to run")
    time.sleep(3)
    assert _versions(cluster, namespace, names) == before
    assert re.findall(rf"apply {namespace}/\S+", operator.log()[log_size:]) == []  # not even no-ops
    for name in names:
        assert len(children(cluster, namespace, name)) == 12  # no duplicates
    denied = re.findall(r"forbidden: User \S+ cannot [^']*", operator.log())
    assert not denied, denied  # the chart's RBAC covered everything so far


def test_settled_service_gets_no_apply(
    cluster: ControlPlane, operator: Operator, namespace: str, wait: Callable[..., Any]
) -> None:
    """Normalised quantities and another manager's fields are not drift."""
    decode = {"replicas": 1, "resources": {"limits": {"memory": "1.5Gi"}}}
    apply(cluster, namespace, tiny(decode=decode))
    wait(lambda: is_ready(cluster, namespace, "tiny"), 90, "tiny Ready")
    dep = get(cluster, "deployment", "tiny-decode", "-n", namespace)
    limits = dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["memory"] == "1536Mi"  # the API server's form of 1.5Gi

    log_size = len(operator.log())
    port = {"name": "metrics", "port": 9090, "targetPort": 9090}
    other = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "tiny-router"},
             "spec": {"ports": [port]}}  # fmt: skip
    cluster.kubectl(
        "apply", "--server-side", "--field-manager=other-tool", "-n", namespace, "-f", "-",
        input=json.dumps(other),
    )  # fmt: skip
    cluster.kubectl("annotate", "deployment", "tiny-decode", "-n", namespace, "example.com/x=1")
    time.sleep(5)  # the events of both edits reach the operator and run its pass
    before = _versions(cluster, namespace, ["tiny"])
    time.sleep(5)
    assert _versions(cluster, namespace, ["tiny"]) == before

    applied = re.findall(rf"apply {namespace}/\S+: .*", operator.log()[log_size:])
    assert applied == [], operator.log()[log_size:][:6000]
    svc = get(cluster, "service", "tiny-router", "-n", namespace)
    assert {p["name"] for p in svc["spec"]["ports"]} == {"http", "metrics"}
    events = get(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=tiny")
    assert "DriftCorrected" not in {e["reason"] for e in events["items"]}


def test_refused_child_keeps_the_generation_unobserved_and_not_ready(
    cluster: ControlPlane, operator: Operator, namespace: str, wait: Callable[..., Any]
) -> None:
    """A quota refuses the PodDisruptionBudgets: the Deployments still come up, and their
    events must not turn the service Ready over the reconcile's error."""
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-pdbs"},
        "spec": {"hard": {"count/poddisruptionbudgets.policy": "0"}},
    }
    apply(cluster, namespace, quota)
    wait(
        lambda: (
            (get(cluster, "resourcequota", "no-pdbs", "-n", namespace) or {})
            .get("status", {})
            .get("hard")
        ),
        30,
        "quota active",
    )
    apply(cluster, namespace, tiny())

    def degraded() -> dict[str, Any]:
        cond = condition(get(cluster, "inferenceservice", "tiny", "-n", namespace), "Degraded")
        return cond if cond.get("status") == "True" else {}

    cond = wait(degraded, 60, "Degraded condition")
    assert cond["reason"] == "ChildRejected"
    message = cond["message"]
    assert message.startswith(f"The API server refused PodDisruptionBudget {namespace}/tiny-")
    assert "exceeded quota" in message and "raise the ResourceQuota" in message
    assert "HTTP" not in message and "{" not in message and "\n" not in message

    # The Deployments created before the refusal get pods and report them ready.
    wait(
        lambda: (
            (get(cluster, "deployment", "tiny-prefill", "-n", namespace) or {})
            .get("status", {})
            .get("readyReplicas")
            == 1
        ),
        90,
        "tiny-prefill pods ready",
    )
    time.sleep(3)
    isvc = get(cluster, "inferenceservice", "tiny", "-n", namespace)
    assert "observedGeneration" not in isvc["status"]
    assert condition(isvc, "Ready")["status"] == "False"
    assert condition(isvc, "Ready")["reason"] == "ChildRejected"
    assert condition(isvc, "Degraded")["message"] == message

    cluster.kubectl("delete", "resourcequota", "no-pdbs", "-n", namespace)
    wait(lambda: is_ready(cluster, namespace, "tiny"), 120, "Ready once the quota is gone")
    isvc = get(cluster, "inferenceservice", "tiny", "-n", namespace)
    assert isvc["status"]["observedGeneration"] == isvc["metadata"]["generation"]
    assert condition(isvc, "Degraded")["status"] == "False"


def test_pool_scaled_to_zero_is_ready(
    cluster: ControlPlane, operator: Operator, namespace: str, wait: Callable[..., Any]
) -> None:
    apply(cluster, namespace, tiny(prefill={"replicas": 0}))
    wait(lambda: is_ready(cluster, namespace, "tiny"), 90, "tiny Ready with prefill at 0")
    isvc = get(cluster, "inferenceservice", "tiny", "-n", namespace)
    assert "prefill scaled to 0" in condition(isvc, "Ready")["message"]
    assert isvc["status"]["prefillReady"] == "0/0"


GPU_NODES = ("kwok-gpu-0", "kwok-gpu-1")  # 8 GPUs each (e2e/harness/nodes.py)


def test_gpu_pool_rolls_on_a_full_cluster(
    cluster: ControlPlane, operator: Operator, namespace: str, wait: Callable[..., Any]
) -> None:
    """Two 8-GPU decode pods fill both GPU nodes; a spec change still rolls them, because a
    GPU pool replaces pods in place (maxSurge 0) instead of waiting for a spare GPU."""

    def gpu_nodes_free() -> bool:
        pods = get(cluster, "pods", "-A")["items"]
        return not any(p["spec"].get("nodeName") in GPU_NODES for p in pods)

    wait(gpu_nodes_free, 90, "earlier tests' pods gone from the GPU nodes")
    decode = {
        "replicas": 2,
        "tensorParallelSize": 8,
        "resources": {"limits": {"nvidia.com/gpu": 8}},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }
    apply(cluster, namespace, tiny(decode=decode))
    wait(lambda: is_ready(cluster, namespace, "tiny"), 90, "tiny Ready on all 16 GPUs")
    dep = get(cluster, "deployment", "tiny-decode", "-n", namespace)
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}

    cluster.kubectl(
        "patch", "inferenceservice", "tiny", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"decode": {"maxNumSeqs": 8}}}),
    )  # fmt: skip

    def rolled() -> bool:
        dep = get(cluster, "deployment", "tiny-decode", "-n", namespace)
        status = dep.get("status") or {}
        isvc = get(cluster, "inferenceservice", "tiny", "-n", namespace)
        return (
            status.get("observedGeneration") == dep["metadata"]["generation"] == 2
            and status.get("updatedReplicas") == 2
            and status.get("readyReplicas") == 2
            and status.get("replicas") == 2
            and condition(isvc, "Ready").get("status") == "True"
        )

    wait(rolled, 120, "decode rolled onto the same GPUs")
    pods = get(cluster, "pods", "-n", namespace, "-l", "phasefleet.dev/role=decode")["items"]
    assert {p["spec"]["nodeName"] for p in pods} == set(GPU_NODES)
