"""Failures that explain themselves: for each way a pool cannot become ready, the
InferenceService is not Ready and its Degraded condition names the pool, the pod, the cause and
the fix, in the same words as one Warning event.

Real parts throughout: the operator with the chart's RBAC, the API server, the scheduler on the
fake GPU nodes, and the pod runner running each worker as a process: a worker that exits leaves
its termination message, which the runner reports as the kubelet does (CrashLoopBackOff,
lastState.terminated); a container over its memory limit is killed by the kernel in its memory
cgroup (OOMKilled); an image from a `.invalid` registry cannot be pulled; the Hugging Face
download is refused by a local Hub (tests/server/hub_server.py, via HF_ENDPOINT) that answers a
gated repository's files 401 without a token. All services start at once in one namespace.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import pytest

from e2e.harness.controlplane import ControlPlane
from e2e.harness.memcg import MemoryCgroup
from e2e.harness.phasefleet_operator import Operator, condition, get
from tests.server.hub_server import FakeHub, FakeRepo, read_folder

GATED = "org/gated"  # a repository of the local Hub that needs a token
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
TINY = {"image": {"path": "/models/tiny-llama"}, "servedName": "tiny", "maxModelLen": 256}
WAIT_SECONDS = 480  # every case's Degraded; a worker that loads torch took 4+ min at load 20


@dataclass(frozen=True)
class Case:
    name: str  # the InferenceService
    spec: dict[str, Any]  # over a one-worker aggregated service (`model` whole, others merged)
    reason: str  # Degraded's reason
    says: tuple[str, ...]  # in Degraded's message: the cause and the fix


CASES = (
    Case(
        "bad-path",
        {"model": {**TINY, "image": {"path": "/models/missing"}}},
        "ContainerFailing",
        (
            "(pool worker) keeps failing: container engine exited with code 2 (model folder",
            "/models/missing does not exist: put the model there, or point spec.model",
            "change what the message names (kubectl logs --previous has the rest)",
        ),
    ),
    Case(
        "hf-refused",  # runtime.env gets HF_ENDPOINT, the local Hub's address
        {"model": {"hf": {"repoId": GATED}, "servedName": "tiny", "maxModelLen": 256}},
        "ContainerFailing",
        (
            "(pool worker) keeps failing: container engine exited with code 1 (model org/gated"
            " is gated and no token was given: set spec.model.hf.tokenSecret to a Secret",
        ),
    ),
    Case(
        "oom-at-load",  # a KV pool this machine cannot hold: the allocator refuses it
        {"runtime": {"extraArgs": ["--num-kv-blocks", str(10**9)]}},
        "ContainerFailing",
        (
            "(pool worker) keeps failing: container engine exited with code 1 (out of memory"
            " loading model",
            "lower --num-kv-blocks, maxModelLen or maxNumSeqs",
        ),
    ),
    Case(
        "unknown-flag",  # what an engine image of an older release says to a newer flag
        {"runtime": {"extraArgs": ["--no-such-flag", "7"]}},
        "ContainerFailing",
        (
            "(pool worker) keeps failing: container engine (image",
            "does not know the flags --no-such-flag 7; if spec.runtime.extraArgs has them, fix"
            " or remove them, else the image is of an older release than this operator",
        ),
    ),
    Case(
        "oom-killed",  # the kernel kills the worker at its memory limit, in its cgroup
        {"worker": {"resources": {"limits": {"memory": "150Mi"}}}},
        "ContainerFailing",
        (
            "(pool worker) keeps failing: container engine was killed for exceeding its memory"
            " limit (OOMKilled, exit code 137); raise spec.worker.resources.limits.memory",
        ),
    ),
    Case(
        "bad-image",
        {"runtime": {"image": "registry.invalid/phasefleet/engine:0.0.0"}},
        "PodCannotStart",
        (
            "(pool worker) cannot start (ErrImagePull: failed to pull and unpack image"
            ' "registry.invalid/phasefleet/engine:0.0.0"',
            "lookup registry.invalid: no such host",
            "check spec.runtime.image and the node's pull access",
        ),
    ),
    Case(
        "no-gpus",  # 16 GPUs a pod (16 ranks); the fake GPU nodes have 8 each
        {
            "worker": {
                "tensorParallelSize": 16,
                "resources": {"limits": {"nvidia.com/gpu": "16"}},
                "tolerations": [GPU_TOLERATION],
            }
        },
        "PodUnschedulable",
        (
            "(pool worker) cannot be scheduled (0/3 nodes are available: 3 Insufficient"
            " nvidia.com/gpu.",
            "ask for fewer GPUs per pod (spec.worker.tensorParallelSize and the nvidia.com/gpu"
            " limit in spec.worker.resources: all of a pod's GPUs must be on one node) or fewer"
            " replicas, add nodes with free GPUs",
        ),
    ),
)


def manifest(case: Case, hub_url: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": TINY,
        "mode": "aggregated",
        "worker": {"replicas": 1, "maxNumSeqs": 4},
        "router": {"replicas": 1},
        "runtime": {"env": [{"name": "HF_ENDPOINT", "value": hub_url}]},
    }
    for key, value in case.spec.items():
        spec[key] = value if key == "model" else {**spec.get(key, {}), **value}
    return {
        "apiVersion": "serving.phasefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": case.name},
        "spec": spec,
    }


def degraded_as_expected(cluster: ControlPlane, namespace: str, case: Case) -> dict[str, Any]:
    cond = condition(get(cluster, "inferenceservice", case.name, "-n", namespace), "Degraded")
    ok = cond.get("status") == "True" and cond.get("reason") == case.reason
    return cond if ok and all(s in cond.get("message", "") for s in case.says) else {}


def warnings(cluster: ControlPlane, namespace: str, name: str) -> list[dict[str, Any]]:
    selector = f"involvedObject.kind=InferenceService,involvedObject.name={name},type=Warning"
    found = get(cluster, "events", "-n", namespace, "--field-selector", selector)
    return list((found or {}).get("items") or [])


def worker_pods(cluster: ControlPlane, namespace: str, name: str) -> list[str]:
    selector = f"phasefleet.dev/inferenceservice={name},phasefleet.dev/role=worker"
    pods = get(cluster, "pods", "-n", namespace, "-l", selector) or {"items": []}
    return [p["metadata"]["name"] for p in pods["items"]]


def test_each_failure_is_named_with_its_fix_in_status_and_one_event(
    cluster: ControlPlane, operator: Operator, run_namespace: str, image_model: str
) -> None:
    probe = MemoryCgroup.create(f"phasefleet-probe-{time.monotonic_ns()}", 64 * 2**20)
    if probe is None:
        pytest.fail("no writable memory cgroup: the pod runner cannot enforce memory limits")
    probe.remove()
    files = read_folder(cluster.image_root / image_model.lstrip("/"))
    hub = FakeHub({GATED: FakeRepo(revisions={"main": files}, gated=True)})
    with hub:
        check_each_case(cluster, run_namespace, hub.url)
    assert any(GATED in r.path for r in hub.requests)  # the worker asked this Hub


def check_each_case(cluster: ControlPlane, run_namespace: str, hub_url: str) -> None:
    items = [manifest(case, hub_url) for case in CASES]
    cluster.kubectl(
        "apply", "-n", run_namespace, "-f", "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
    )  # fmt: skip

    found: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + WAIT_SECONDS
    while len(found) < len(CASES) and time.monotonic() < deadline:
        for case in CASES:
            if case.name not in found and (
                cond := degraded_as_expected(cluster, run_namespace, case)
            ):
                found[case.name] = cond
        time.sleep(1)
    missing = {
        case.name: condition(get(cluster, "isvc", case.name, "-n", run_namespace), "Degraded")
        for case in CASES
        if case.name not in found
    }
    assert not missing, f"Degraded not as expected after {WAIT_SECONDS} s: {missing}"

    time.sleep(15)  # restarts, back-offs and passes go on: the text (and its event) must hold
    # `kubectl get inferenceservice`: the READY column (empty metric columns print as blanks,
    # so the column is found by its offset in the header)
    table = cluster.kubectl("get", "inferenceservice", "-n", run_namespace).stdout.splitlines()
    at = table[0].index("READY")
    assert {row.split()[0]: row[at:].split()[0] for row in table[1:]} == {
        case.name: "False" for case in CASES
    }
    for case in CASES:
        isvc = get(cluster, "inferenceservice", case.name, "-n", run_namespace)
        assert condition(isvc, "Ready")["status"] == "False", case.name
        degraded = condition(isvc, "Degraded")
        assert degraded["message"] == found[case.name]["message"], case.name
        message = degraded["message"]
        pods = worker_pods(cluster, run_namespace, case.name)
        assert any(message.startswith(f"Pod {run_namespace}/{pod} (pool worker)") for pod in pods)
        same = [
            e for e in warnings(cluster, run_namespace, case.name)
            if (e["reason"], e["message"]) == (case.reason, message)
        ]  # fmt: skip
        assert len(same) == 1 and same[0].get("count", 1) == 1, (case.name, same)
