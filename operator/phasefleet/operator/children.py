"""Every object an InferenceService owns, built from its spec (pure functions)."""

from __future__ import annotations

import copy
import secrets
from typing import Any

from phasefleet.api.contract import INTERNAL_TOKEN_KEY, WORKER_PORT
from phasefleet.api.spec import InferenceServiceSpec, PoolSpec, Role
from phasefleet.operator.meta import (
    APPLIED_HASH_ANNOTATION,
    ROUTER,
    Owner,
    child_name,
    metadata,
    selector,
)
from phasefleet.operator.workloads import (
    internal_token_secret_name,
    router_deployment,
    spec_hash,
    worker_deployment,
)

ROUTER_SERVICE_PORT = 80


def endpoint(owner: Owner) -> str:
    """The service's URL inside the cluster: the router's Service."""
    return f"http://{child_name(owner.name, ROUTER)}.{owner.namespace}.svc:{ROUTER_SERVICE_PORT}"


def pool_replicas(
    spec: InferenceServiceSpec, pool: PoolSpec, live: int | None, autoscaled: bool = False
) -> int | None:
    """Replicas to apply for a pool whose Deployment has `live` replicas (None: not created);
    None leaves `spec.replicas` out of the apply.

    Without autoscaling the spec decides (applied with force, which also takes the field back
    from the autoscaler). With it, once the autoscaler owns the field (`autoscaled`: its field
    manager is in the live Deployment's managedFields for spec.replicas) the operator leaves it
    out: server-side apply then keeps the autoscaler's value, where sending any number would
    race with the autoscaler and sending none while owning it would reset it to 1. Before that
    hand-over the operator keeps the live number within [minReplicas, maxReplicas].
    """
    if not spec.autoscaling.enabled or live is None:
        return pool.replicas
    if autoscaled:
        return None
    return min(max(live, pool.min_size), pool.max_size)


def headless_service(owner: Owner, role: Role) -> dict[str, Any]:
    name = child_name(owner.name, role.value)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, name, role.value),
        "spec": {
            "clusterIP": "None",
            "selector": selector(owner.name, role.value),
            "ports": [{"name": "http", "port": WORKER_PORT, "targetPort": "http"}],
        },
    }


def router_service(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, child_name(owner.name, ROUTER), ROUTER),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(owner.name, ROUTER),
            "ports": [{"name": "http", "port": ROUTER_SERVICE_PORT, "targetPort": "http"}],
        },
    }


def router_service_account(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(owner, child_name(owner.name, ROUTER), ROUTER),
        "automountServiceAccountToken": False,  # only the router pod mounts it, by its own spec
    }


def router_role(owner: Owner) -> dict[str, Any]:
    """Read the EndpointSlices of this namespace: the router's discovery, and nothing else."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(owner, child_name(owner.name, ROUTER), ROUTER),
        "rules": [
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["get", "list", "watch"],
            }
        ],
    }


def router_role_binding(owner: Owner) -> dict[str, Any]:
    name = child_name(owner.name, ROUTER)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(owner, name, ROUTER),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
    }


def internal_token_secret(owner: Owner) -> dict[str, Any]:
    """The service's internal token: random, created once (never applied again, never read)."""
    meta = metadata(owner, internal_token_secret_name(owner.name), ROUTER)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "stringData": {INTERNAL_TOKEN_KEY: secrets.token_urlsafe(32)},
    }


def disruption_budget(owner: Owner, role: str) -> dict[str, Any]:
    """At most one healthy pod of a pool is evicted at a time (node drains, upgrades).

    Pods that are not ready (crash-looping, never started) may always be evicted: they serve
    nothing, and counting them would block a node drain for good.
    """
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(owner, child_name(owner.name, role), role),
        "spec": {
            "maxUnavailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": selector(owner.name, role)},
        },
    }


def desired_children(
    owner: Owner,
    spec: InferenceServiceSpec,
    live_replicas: dict[str, int] | None = None,
    autoscaled: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """All children in apply order; `live_replicas` maps Deployment name -> spec.replicas,
    `autoscaled` names the Deployments whose spec.replicas the autoscaler owns."""
    live_replicas = live_replicas or {}
    out: list[dict[str, Any]] = [
        router_service_account(owner),
        router_role(owner),
        router_role_binding(owner),
    ]
    for role, pool in spec.pools().items():
        name = child_name(owner.name, role.value)
        replicas = pool_replicas(spec, pool, live_replicas.get(name), name in autoscaled)
        out.append(headless_service(owner, role))
        out.append(worker_deployment(owner, spec, role, replicas))
        out.append(disruption_budget(owner, role.value))
    out.append(router_service(owner))
    out.append(router_deployment(owner, spec))
    out.append(disruption_budget(owner, ROUTER))
    return [stamp(obj) for obj in out]


def stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """Annotates a child with a hash of everything the operator sets in it but replicas.

    The live object keeps the hash it was last applied with, so a field the operator stops
    setting (which a live object would still hold) shows up as a different hash; replicas are
    left out because the autoscaler changes them without a new apply.
    """
    body = copy.deepcopy(obj)
    body.get("spec", {}).pop("replicas", None)
    obj["metadata"].setdefault("annotations", {})[APPLIED_HASH_ANNOTATION] = spec_hash(body)
    return obj


def key(obj: dict[str, Any]) -> tuple[str, str]:
    """(kind, name): identifies a child within its namespace."""
    return obj["kind"], obj["metadata"]["name"]
