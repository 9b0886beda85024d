"""An in-memory stand-in for kube.Api: enough of server-side apply to test the reconciler.

Field ownership is modelled where two managers meet: a Deployment's spec.replicas (the
operator and the autoscaler, written to metadata.managedFields as the API server does) and the
InferenceService status (each manager's last applied status, merged; a field no manager
applies any more is gone).
"""

from __future__ import annotations

import copy
from typing import Any

from phasefleet.operator.compare import contains
from phasefleet.operator.kube import Gone, Rejected
from phasefleet.operator.meta import FIELD_MANAGER, replicas_managers

DEFAULT_REPLICAS = 1  # what the API server defaults a Deployment's missing spec.replicas to


def _merge(live: Any, desired: Any) -> Any:
    if isinstance(live, dict) and isinstance(desired, dict):
        out = dict(live)
        for k, v in desired.items():
            out[k] = _merge(live.get(k), v)
        return out
    return copy.deepcopy(desired)


class FakeApi:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.writes: list[tuple[str, str, str]] = []  # (verb, kind, name) of each change
        self.reads: list[tuple[str, str]] = []  # (verb, kind) of each get and list
        self.applies: list[tuple[str, str]] = []  # (kind, name) of every apply call
        self.refuse: dict[tuple[str, str], tuple[int, str]] = {}  # (kind, name) -> HTTP error
        self.events: list[dict[str, Any]] = []
        self.refuse_gets: set[str] = set()  # kinds the operator may not read (RBAC)
        self.normalize: dict[str, str] = {}  # what the API server stores for a value we send
        self.patches: list[tuple[str, str, dict[str, Any]]] = []  # (kind, name, merge patch)
        self._status_applied: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
        self._version = 0

    def _bump(self, obj: dict[str, Any]) -> None:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)

    def add(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        obj["metadata"].setdefault("uid", f"uid-{obj['metadata']['name']}")
        obj["metadata"].setdefault("generation", 1)
        self._bump(obj)
        self.objects[(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj
        return obj

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads.append(("get", kind))
        if kind in self.refuse_gets:
            raise Rejected(f"GET {kind}/{name}", 403, f"{kind.lower()}s is forbidden")
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """As kube.Kube.list: items carry apiVersion and kind."""
        self.reads.append(("list", kind))
        label, value = label_selector.split("=")
        return [
            copy.deepcopy(o)
            for (k, ns, _), o in self.objects.items()
            if k == kind and ns == namespace and o["metadata"].get("labels", {}).get(label) == value
        ]

    def apply(self, obj: dict[str, Any], manager: str = FIELD_MANAGER) -> dict[str, Any]:
        k = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.applies.append((obj["kind"], obj["metadata"]["name"]))
        if (obj["kind"], obj["metadata"]["name"]) in self.refuse:
            code, message = self.refuse[(obj["kind"], obj["metadata"]["name"])]
            raise Rejected(f"PATCH {obj['kind']}/{obj['metadata']['name']}", code, message)
        live = self.objects.get(k)
        owners = _replicas_owners(live, obj, manager)
        if live is not None and contains(live, obj) and owners == replicas_managers(live):
            return copy.deepcopy(live)
        merged = self._normalized(_merge(live or {}, obj))
        if "replicas" in merged.get("spec", {}) and not owners:
            merged["spec"]["replicas"] = DEFAULT_REPLICAS  # its last owner let go of it
        if obj["kind"] == "Deployment":
            merged["metadata"]["managedFields"] = [
                {"manager": m, "operation": "Apply", "fieldsV1": {"f:spec": {"f:replicas": {}}}}
                for m in sorted(owners)
            ]
        merged["metadata"].setdefault("generation", 0)
        if live is None or live.get("spec") != merged.get("spec"):
            merged["metadata"]["generation"] += 1
        self._bump(merged)
        self.objects[k] = merged
        self.writes.append(("apply", obj["kind"], obj["metadata"]["name"]))
        return copy.deepcopy(merged)

    def _normalized(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self._normalized(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._normalized(v) for v in value]
        return self.normalize.get(value, value) if isinstance(value, str) else value

    def apply_status(self, obj: dict[str, Any], manager: str = FIELD_MANAGER) -> dict[str, Any]:
        k = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        live = self.objects[k]
        applied = self._status_applied.setdefault(k, {})
        if not applied and live.get("status"):
            applied[FIELD_MANAGER] = copy.deepcopy(live["status"])  # written before: the operator's
        applied[manager] = copy.deepcopy(obj["status"])
        live["status"] = _merge_status(list(applied.values()))
        self._bump(live)
        self.writes.append(("status", obj["kind"], obj["metadata"]["name"]))
        return copy.deepcopy(live)

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """A JSON merge patch: None deletes a key."""
        if (kind, namespace, name) not in self.objects:
            raise Gone(f"PATCH {kind}/{name}", 404, f'{kind.lower()}s "{name}" not found')
        live = self.objects[(kind, namespace, name)]
        self.objects[(kind, namespace, name)] = _merge_patch(live, patch)
        self._bump(self.objects[(kind, namespace, name)])
        self.patches.append((kind, name, copy.deepcopy(patch)))
        self.writes.append(("patch", kind, name))

    def delete(self, kind: str, namespace: str, name: str) -> None:
        if self.objects.pop((kind, namespace, name), None) is not None:
            self.writes.append(("delete", kind, name))

    def create(self, obj: dict[str, Any]) -> bool:
        """As kube.Kube.create: an existing object of that name is left as it is."""
        meta = obj["metadata"]
        if (obj["kind"], meta["name"]) in self.refuse:
            code, message = self.refuse[(obj["kind"], meta["name"])]
            raise Rejected(f"POST {obj['kind']}/{meta['name']}", code, message)
        if (obj["kind"], meta["namespace"], meta["name"]) in self.objects:
            return False
        self.writes.append(("create", obj["kind"], meta["name"]))
        self.add(obj)
        return True

    def create_event(self, event: dict[str, Any]) -> None:
        self.events.append(copy.deepcopy(event))

    def set_ready(self, namespace: str) -> None:
        """What the Deployment controller and kubelets would do: every pod up to date, ready."""
        for (kind, ns, _), obj in self.objects.items():
            if kind == "Deployment" and ns == namespace:
                n = obj["spec"]["replicas"]
                obj["status"] = {
                    "observedGeneration": obj["metadata"]["generation"],
                    "replicas": n,
                    "updatedReplicas": n,
                    "readyReplicas": n,
                    "availableReplicas": n,
                }
                self._bump(obj)


def _replicas_owners(live: dict[str, Any] | None, obj: dict[str, Any], manager: str) -> set[str]:
    """Who owns spec.replicas after `manager` applies `obj` with force."""
    owners = replicas_managers(live) if live is not None else set()
    wanted = obj.get("spec", {}).get("replicas")
    if wanted is None:
        return owners - {manager}
    if live is not None and live.get("spec", {}).get("replicas") == wanted:
        return owners | {manager}  # the same value: shared ownership, no conflict
    return {manager}  # a conflict, forced: the others lose the field


def _merge_status(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """Managers' applied statuses together: maps merged, conditions keyed by type."""
    out: dict[str, Any] = {}
    for config in configs:
        for key, value in config.items():
            if key == "conditions":
                by_type = {c["type"]: c for c in out.get("conditions", [])}
                by_type.update({c["type"]: copy.deepcopy(c) for c in value})
                out["conditions"] = list(by_type.values())
            else:
                out[key] = _merge(out.get(key), value)
    return out


def _merge_patch(live: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(live) if isinstance(live, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out
