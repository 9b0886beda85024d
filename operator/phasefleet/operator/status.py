"""The operator's part of InferenceService status, computed from the child Deployments.

Pure: the caller passes in the live Deployments, the previous status and the time. The
operator owns the Ready, Progressing and Degraded conditions, `pools.*.{replicas,
readyReplicas, desiredReplicas}`, the ready summaries and the endpoint; the autoscaler owns
the metrics, its own conditions and `pools.*.lastScale*` (server-side apply keeps them apart).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phasefleet.api.spec import InferenceServiceSpec, Role
from phasefleet.api.status import DEGRADED, PROGRESSING, READY
from phasefleet.operator.children import endpoint
from phasefleet.operator.compare import contains
from phasefleet.operator.meta import ROUTER, Owner, child_name

OWNED_CONDITIONS = (READY, PROGRESSING, DEGRADED)
STUCK_REASONS = {"ProgressDeadlineExceeded", "ReplicaFailure"}


@dataclass(frozen=True)
class Problem:
    """Why the service cannot work as specified, and what the user should do about it."""

    reason: str  # CamelCase, e.g. ModelVolumeMissing
    message: str  # names the object and the fix


def _pool(deployment: dict[str, Any] | None) -> dict[str, int]:
    if deployment is None:
        return {"replicas": 0, "readyReplicas": 0, "desiredReplicas": 0}
    status = deployment.get("status") or {}
    return {
        "replicas": int(status.get("replicas") or 0),
        "readyReplicas": int(status.get("readyReplicas") or 0),
        "desiredReplicas": int((deployment.get("spec") or {}).get("replicas") or 0),
    }


def _rolled_out(deployment: dict[str, Any]) -> bool:
    meta, status = deployment["metadata"], deployment.get("status") or {}
    desired = int(deployment["spec"].get("replicas") or 0)
    return (
        int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
        and int(status.get("updatedReplicas") or 0) >= desired
        and int(status.get("replicas") or 0) == desired
    )


def _stuck(deployment: dict[str, Any]) -> str | None:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("reason") in STUCK_REASONS or (
            cond.get("type") == "ReplicaFailure" and cond.get("status") == "True"
        ):
            return f"{cond.get('reason')}: {cond.get('message', '')}".strip()
    return None


def _condition(type_: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def compute_status(
    owner: Owner,
    generation: int,
    spec: InferenceServiceSpec,
    deployments: dict[str, dict[str, Any]],
    previous: dict[str, Any],
    now: str,
    problem: Problem | None = None,
) -> dict[str, Any]:
    """The operator-owned status fields (camelCase), ready to apply to the status subresource.

    `deployments` maps Deployment name -> live object; `previous` is the live status, used to
    keep lastTransitionTime when a condition's status did not change.
    """
    roles = [r.value for r in spec.pools()] + [ROUTER]
    pools = {role: _pool(deployments.get(child_name(owner.name, role))) for role in roles}

    missing, not_ready, rolling, stuck = [], [], [], []
    for role in roles:
        dep = deployments.get(child_name(owner.name, role))
        p = pools[role]
        if dep is None:
            missing.append(role)
            continue
        if p["desiredReplicas"] == 0 or p["readyReplicas"] < p["desiredReplicas"]:
            not_ready.append(f"{role} {p['readyReplicas']}/{p['desiredReplicas']} ready")
        if not _rolled_out(dep):
            rolling.append(role)
        if (why := _stuck(dep)) is not None:
            stuck.append(f"{role}: {why}")

    if problem is not None:
        ready = _condition(READY, False, problem.reason, problem.message, generation)
    elif missing:
        ready = _condition(
            READY, False, "ChildrenMissing", f"not created yet: {', '.join(missing)}", generation
        )
    elif not_ready:
        ready = _condition(READY, False, "PodsNotReady", "; ".join(not_ready), generation)
    else:
        ready = _condition(
            READY, True, "AllPodsReady", "all pools and the router are ready", generation
        )

    progressing = _condition(
        PROGRESSING,
        bool(rolling or missing) and problem is None,
        "RollingOut" if rolling or missing else "Complete",
        f"rolling out: {', '.join(rolling + missing)}"
        if rolling or missing
        else "rollout complete",
        generation,
    )
    if problem is not None:
        degraded = _condition(DEGRADED, True, problem.reason, problem.message, generation)
    elif stuck:
        degraded = _condition(DEGRADED, True, "RolloutStuck", "; ".join(stuck), generation)
    else:
        degraded = _condition(DEGRADED, False, "AsExpected", "", generation)

    before = {c["type"]: c for c in previous.get("conditions") or []}
    conditions = []
    for cond in (ready, progressing, degraded):
        old = before.get(cond["type"])
        same = old is not None and old.get("status") == cond["status"]
        cond["lastTransitionTime"] = old.get("lastTransitionTime") if same and old else now
        conditions.append(cond)

    def summary(role: str) -> str:
        return f"{pools[role]['readyReplicas']}/{pools[role]['desiredReplicas']}"

    worker = Role.WORKER.value
    return {
        "observedGeneration": generation,
        "conditions": conditions,
        "pools": pools,
        "prefillReady": summary(worker if worker in pools else Role.PREFILL.value),
        "decodeReady": summary(worker if worker in pools else Role.DECODE.value),
        "endpoint": endpoint(owner),
    }


def status_changed(desired: dict[str, Any], previous: dict[str, Any]) -> bool:
    """Whether applying `desired` would change anything (so unchanged status is not written)."""
    stale_pools = set(previous.get("pools") or {}) - set(desired["pools"])
    if stale_pools:
        return True
    without_conditions = {k: v for k, v in desired.items() if k != "conditions"}
    if not contains(previous, without_conditions):
        return True
    before = {c["type"]: c for c in previous.get("conditions") or []}
    return any(not contains(before.get(c["type"]), c) for c in desired["conditions"])
