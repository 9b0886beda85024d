"""The autoscaler's writes to a pool on Kubernetes: its Deployment's spec.replicas, and the
deletion cost of the pods a scale-down should remove first.

spec.replicas is applied alone with the autoscaler's own field manager (force: the operator
created the Deployment and owned the field until then); the operator's reconcile sees that
manager in managedFields and stops sending replicas (children.pool_replicas). Plain functions
over `kube.Api`, no kopf.
"""

from __future__ import annotations

import contextlib
import datetime
import statistics
from collections.abc import Mapping
from typing import Any

from phasefleet.autoscale.signals import PodLoad
from phasefleet.operator.kube import Api, Gone
from phasefleet.operator.meta import AUTOSCALER_FIELD_MANAGER, replicas_managers

# The ReplicaSet controller removes pods with the lowest cost first (after unready ones); every
# other pod has the default 0.
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
REMOVE_FIRST_COST = "-1000"


def owns_replicas(deployment: dict[str, Any]) -> bool:
    """Whether the autoscaler's field manager owns the Deployment's spec.replicas."""
    return AUTOSCALER_FIELD_MANAGER in replicas_managers(deployment)


def scale(api: Api, namespace: str, name: str, replicas: int) -> None:
    """Applies spec.replicas of Deployment `name`, and nothing else, as the autoscaler.

    A Deployment deleted meanwhile is not re-created: an object with only replicas is invalid,
    and the API server refuses it (kube.Rejected).
    """
    api.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": replicas},
        },
        manager=AUTOSCALER_FIELD_MANAGER,
    )


def serving(pod: dict[str, Any]) -> bool:
    """Not being deleted, and Ready."""
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _timestamp(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def startup_seconds(pods: list[dict[str, Any]]) -> float | None:
    """The median time from creation to Ready of the serving pods among `pods` (a replica's
    start-up: scheduling, image, model load); None when no pod tells."""
    spans = []
    for pod in pods:
        if not serving(pod):
            continue
        created = _timestamp(pod["metadata"].get("creationTimestamp"))
        ready = next(
            c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"
        )
        became_ready = _timestamp(ready.get("lastTransitionTime"))
        if created is not None and became_ready is not None and became_ready >= created:
            spans.append(became_ready - created)
    return statistics.median(spans) if spans else None


def least_loaded(pods: list[dict[str, Any]], loads: Mapping[str, PodLoad], count: int) -> list[str]:
    """Names of the `count` serving pods with the fewest running requests, then the lowest KV
    usage (then by name, so the choice is stable). Pods without a load sample are not chosen:
    the ReplicaSet removes unready pods first anyway."""
    known = [p["metadata"]["name"] for p in pods if serving(p) and p["metadata"]["name"] in loads]
    ranked = sorted(known, key=lambda name: (loads[name].running, loads[name].kv_usage, name))
    return ranked[: max(count, 0)]


def mark_for_removal(
    api: Api, namespace: str, pods: list[dict[str, Any]], chosen: list[str]
) -> None:
    """Gives the `chosen` pods a low deletion cost, and takes it off the pool's other pods (a
    mark left from an earlier scale-down would otherwise send a busy pod first next time)."""
    for pod in pods:
        name = pod["metadata"]["name"]
        cost = (pod["metadata"].get("annotations") or {}).get(DELETION_COST_ANNOTATION)
        if name in chosen and cost != REMOVE_FIRST_COST:
            value: str | None = REMOVE_FIRST_COST
        elif name not in chosen and cost is not None:
            value = None  # merge patch: removes the annotation
        else:
            continue
        with contextlib.suppress(Gone):  # a pod deleted meanwhile needs no mark
            api.patch(
                "Pod",
                namespace,
                name,
                {"metadata": {"annotations": {DELETION_COST_ANNOTATION: value}}},
            )
