"""Names, labels and ownership shared by every child of an InferenceService."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phasefleet.api.contract import ISVC_LABEL, ROLE_LABEL, ROUTER_ROLE
from phasefleet.api.crd import API_VERSION, KIND

FIELD_MANAGER = "phasefleet-operator"
# The autoscaler's server-side apply field manager: a pool Deployment's spec.replicas, and its
# own status fields (metrics, MetricsAvailable, ScalingLimited, pools.*.lastScale*).
AUTOSCALER_FIELD_MANAGER = "phasefleet-autoscaler"
SPEC_HASH_ANNOTATION = "phasefleet.dev/spec-hash"  # on pod templates: inputs of the template
APPLIED_HASH_ANNOTATION = "phasefleet.dev/applied-hash"  # on children: what the operator applied
ROUTER = ROUTER_ROLE


@dataclass(frozen=True)
class Owner:
    """The InferenceService a child belongs to."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Any) -> Owner:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def child_name(owner_name: str, role: str) -> str:
    return f"{owner_name}-{role}"


def selector(owner_name: str, role: str) -> dict[str, str]:
    """Deployment selectors are immutable: only these two labels, forever."""
    return {ISVC_LABEL: owner_name, ROLE_LABEL: role}


def labels(owner_name: str, role: str) -> dict[str, str]:
    return {
        **selector(owner_name, role),
        "app.kubernetes.io/name": "phasefleet",
        "app.kubernetes.io/instance": owner_name,
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
    }


def metadata(owner: Owner, name: str, role: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner.name, role),
        "ownerReferences": [owner.reference()],
    }


def is_owned_by(child: dict[str, Any], owner: Owner) -> bool:
    refs = child.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == owner.uid for ref in refs)


def replicas_managers(deployment: dict[str, Any]) -> set[str]:
    """The field managers that own a Deployment's spec.replicas (from metadata.managedFields)."""
    owners = set()
    for entry in deployment.get("metadata", {}).get("managedFields") or []:
        spec = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        if "f:replicas" in spec:
            owners.add(str(entry.get("manager", "")))
    return owners
