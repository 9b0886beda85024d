"""Tensor parallelism per pool on the real control plane with 8-GPU KWOK nodes: a pool's pods ask
one GPU per rank, the scheduler places them, the pod runner runs each worker's ranks as
processes on the CPU (gloo), and a 2-rank prefill worker hands its KV to a 1-rank decode worker
with greedy answers equal to a single worker's. A pod asking more GPUs than any node has is
reported unschedulable in Degraded, though the cluster has that many GPUs in all."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from e2e.harness.controlplane import ControlPlane
from e2e.harness.nodes import FAKE_NODES, GPU_RESOURCE
from e2e.harness.phasefleet_operator import Operator, condition, get, is_ready
from e2e.harness.wait import wait_for
from phasefleet.api.contract import ROUTER_PORT, WORKER_PORT

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-tensor-parallel.yaml"
GPU_NODES = {n.name for n in FAKE_NODES if n.gpus}
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
PROMPTS = [
    "Hello, my name is",
    "The capital of France is a city that many people visit every year because",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]
MAX_TOKENS = 16
READY_SECONDS = 480  # three torch processes load on a shared 2-core machine


@pytest.fixture(scope="module")
def reference(cluster: ControlPlane, image_model: str) -> Iterator[Any]:
    """One worker of one rank, started directly on the same files and settings."""
    from tests.server.worker_proc import run_worker

    local = cluster.image_root / image_model.lstrip("/")
    with run_worker(local, "--dtype", "float32", "--max-model-len", "512") as worker:
        yield worker


def pod_of(cluster: ControlPlane, namespace: str, role: str) -> dict[str, Any]:
    found = get(cluster, "pods", "-n", namespace, "-l", f"phasefleet.dev/role={role}")
    live = [p for p in (found or {}).get("items", []) if not p["metadata"].get("deletionTimestamp")]
    (pod,) = live
    return pod


def rank_processes(pod_name: str) -> list[int]:
    """Processes of this machine running a rank of the pod's worker: multiprocessing's spawned
    children (not its resource tracker) that carry the pod's POD_NAME."""
    ranks = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:  # gone, or not ours
            continue
        ours = f"POD_NAME={pod_name}".encode() in environ
        if ours and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            ranks.append(int(proc.name))
    return ranks


def complete(api: openai.OpenAI, prompt: str, stream: bool) -> str:
    args: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS}
    if not stream:
        return api.completions.create(**args, temperature=0).choices[0].text
    chunks = api.completions.create(**args, temperature=0, stream=True)
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


def sample(metrics: str, name: str, label: str = "") -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name) and label in line
    )


def test_a_two_gpu_prefill_pool_hands_off_to_a_one_gpu_decode_pool_through_the_router(
    cluster: ControlPlane, operator: Operator, run_namespace: str, reference: Any
) -> None:
    ns = run_namespace
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    try:
        wait_for(lambda: is_ready(cluster, ns, "tiny-tp"), READY_SECONDS, "tiny-tp Ready")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\noperator log tail:\n{operator.log()[-3000:]}") from None

    prefill, decode = pod_of(cluster, ns, "prefill"), pod_of(cluster, ns, "decode")
    shm_limits = {}
    for pod, gpus in ((prefill, "2"), (decode, "1")):
        assert pod["spec"]["nodeName"] in GPU_NODES
        (engine,) = pod["spec"]["containers"]
        assert engine["resources"]["limits"][GPU_RESOURCE] == gpus
        (shm,) = [v["emptyDir"] for v in pod["spec"]["volumes"] if v["name"] == "shm"]
        assert shm["medium"] == "Memory"
        assert {"name": "shm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
        shm_limits[gpus] = shm.get("sizeLimit")
    assert shm_limits == {"2": "2Gi", "1": None}  # 1Gi a rank, for NCCL, in a 2-rank pod
    engine = prefill["spec"]["containers"][0]
    assert engine["args"][engine["args"].index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in decode["spec"]["containers"][0]["args"]
    assert len(rank_processes(prefill["metadata"]["name"])) == 1  # rank 1; rank 0 is the worker
    assert rank_processes(decode["metadata"]["name"]) == []

    router = pod_of(cluster, ns, "router")["status"]["podIP"]

    def router_sees_both() -> bool:
        health = httpx.get(f"http://{router}:{ROUTER_PORT}/health", timeout=5).json()
        return bool(health["ready_workers"] == {"prefill": 1, "decode": 1})

    wait_for(router_sees_both, 30, "the router to see both workers")
    api = openai.OpenAI(
        base_url=f"http://{router}:{ROUTER_PORT}/v1", api_key="unused", max_retries=0, timeout=120
    )
    for prompt in PROMPTS:
        want = complete(reference.client(), prompt, stream=False)
        assert complete(api, prompt, stream=False) == want, prompt
        assert complete(api, prompt, stream=True) == want, prompt
    ip = decode["status"]["podIP"]
    metrics = httpx.get(f"http://{ip}:{WORKER_PORT}/metrics", timeout=5).text
    assert sample(metrics, "phasefleet_prefills_total", 'where="remote"') == 2 * len(PROMPTS)
    assert sample(metrics, "phasefleet_kv_transfer_failures_total") == 0


def test_a_pod_asking_more_gpus_than_any_node_has_is_unschedulable_in_degraded(
    cluster: ControlPlane, operator: Operator, namespace: str
) -> None:
    """16 ranks a pod: the two GPU nodes have 16 GPUs between them, 8 each, and a pod's GPUs
    must all be on its node."""
    spec = {
        "model": {"image": {"path": "/models/tiny-llama"}},
        "mode": "aggregated",
        "worker": {
            "tensorParallelSize": 16,
            "resources": {"limits": {GPU_RESOURCE: 16}},
            "tolerations": [GPU_TOLERATION],
        },
    }
    isvc = {
        "apiVersion": "serving.phasefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "wide"},
        "spec": spec,
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(isvc))

    def degraded() -> dict[str, Any]:
        cond = condition(get(cluster, "inferenceservice", "wide", "-n", namespace), "Degraded")
        return cond if cond.get("reason") == "PodUnschedulable" else {}

    cond = wait_for(degraded, 90, "wide Degraded with PodUnschedulable")
    assert cond["status"] == "True"
    message = cond["message"]
    assert "(pool worker) cannot be scheduled (0/3 nodes are available:" in message
    assert "Insufficient nvidia.com/gpu" in message
    assert "spec.worker.tensorParallelSize and the nvidia.com/gpu limit" in message
    ready = condition(get(cluster, "inferenceservice", "wide", "-n", namespace), "Ready")
    assert ready["status"] == "False"
    assert "nodeName" not in pod_of(cluster, namespace, "worker")["spec"]
