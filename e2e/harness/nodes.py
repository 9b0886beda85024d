"""The fake nodes KWOK manages: two tainted GPU nodes and one plain CPU node."""

from __future__ import annotations

import json
from dataclasses import dataclass

GPU_RESOURCE = "nvidia.com/gpu"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
ACCELERATOR_LABEL = "phasefleet.dev/accelerator"


@dataclass(frozen=True)
class FakeNode:
    name: str
    cpu: str  # cores
    memory: str  # bytes, as a quantity
    gpus: int  # nvidia.com/gpu capacity; GPU nodes are tainted


FAKE_NODES = (
    FakeNode("kwok-gpu-0", cpu="64", memory="512Gi", gpus=8),
    FakeNode("kwok-gpu-1", cpu="64", memory="512Gi", gpus=8),
    FakeNode("kwok-cpu-0", cpu="32", memory="128Gi", gpus=0),
)


def node_manifest(node: FakeNode) -> dict:
    capacity = {"cpu": node.cpu, "memory": node.memory, "pods": "110"}
    labels = {
        "kubernetes.io/hostname": node.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
    }
    spec: dict = {}
    if node.gpus:
        capacity[GPU_RESOURCE] = str(node.gpus)
        labels[ACCELERATOR_LABEL] = "nvidia-gpu"
        spec["taints"] = [GPU_TAINT]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            "labels": labels,
            # KWOK manages only nodes with this annotation (see its --manage-nodes-* flags).
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": spec,
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def node_manifests() -> str:
    items = [node_manifest(n) for n in FAKE_NODES]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
