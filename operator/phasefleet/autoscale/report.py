"""What the autoscaler tells people about a decision: its status fields, Events and log line.

Pure functions of the decision, the signals and the live status. The autoscaler's status is
applied with its own field manager, so it holds all of the autoscaler's fields every time:
server-side apply removes a field its manager stops sending (a pool that no longer exists, or
metrics that went missing). The operator owns the rest (operator/status.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phasefleet.api.spec import Role
from phasefleet.api.status import METRICS_AVAILABLE, SCALING_LIMITED
from phasefleet.autoscale.policy import Decision
from phasefleet.autoscale.signals import MetricsUnavailable, Signals

LIMITED_REASON = "LimitReached"  # ScalingLimited=True: maxReplicas or gpuBudget binds
WITHIN_LIMITS_REASON = "WithinLimits"
METRICS_LOST_EVENT = "MetricsUnavailable"
# MetricsAvailable=False while a pool's pods are still loading: expected, so no Warning
STARTING_REASON = "ReplicasStarting"


@dataclass(frozen=True)
class Notice:
    """An Event to post on the InferenceService."""

    type: str  # Normal or Warning
    reason: str  # CamelCase
    message: str


def metrics(signals: Signals | MetricsUnavailable) -> dict[str, float]:
    """status.metrics (what `kubectl get` shows as TTFT, TPOT, KV); empty without metrics."""
    if isinstance(signals, MetricsUnavailable):
        return {}
    out: dict[str, float | None] = {
        "ttftMs": _ms(signals.ttft_s),
        "tpotMs": _ms(signals.tpot_s),
        "itlMs": _ms(signals.itl_s),
        "kvCacheUsage": _kv_usage(signals),
        "requestRate": None if signals.request_rate is None else round(signals.request_rate, 2),
    }
    return {k: v for k, v in out.items() if v is not None}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _kv_usage(signals: Signals) -> float | None:
    """Mean KV usage over the pods that hold the decode phase (decode, or the aggregated pool)."""
    for role in (Role.DECODE.value, Role.WORKER.value):
        pool = signals.pools.get(role)
        if pool is not None and pool.reporting and pool.kv_usage_sum is not None:
            return round(pool.kv_usage_sum / pool.reporting, 3)
    return None


def _previous_condition(previous: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in previous.get("conditions") or [] if c.get("type") == type_), {})


def _condition(
    type_: str, ok: bool, reason: str, message: str, generation: int, previous: dict[str, Any]
) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = _previous_condition(previous, type_)
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": before.get("lastTransitionTime")
        if before.get("status") == status
        else None,
    }


def autoscaler_status(
    decision: Decision,
    signals: Signals | MetricsUnavailable,
    previous: dict[str, Any],
    generation: int,
    now: str,
) -> dict[str, Any]:
    """All of the autoscaler's status fields (camelCase); `previous` is the live status,
    `now` RFC 3339."""
    conditions = [
        _condition(
            METRICS_AVAILABLE, decision.metrics_available, decision.metrics_reason,
            decision.metrics_message, generation, previous,
        ),
        _condition(
            SCALING_LIMITED, decision.scaling_limited is not None,
            LIMITED_REASON if decision.scaling_limited else WITHIN_LIMITS_REASON,
            decision.scaling_limited or "", generation, previous,
        ),
    ]  # fmt: skip
    for cond in conditions:
        cond["lastTransitionTime"] = cond["lastTransitionTime"] or now
    old_pools = previous.get("pools") or {}
    pools: dict[str, dict[str, Any]] = {}
    for role, pool in decision.pools.items():
        if pool.changed:
            pools[role] = {"lastScaleTime": now, "lastScaleReason": pool.reason}
        else:
            old = old_pools.get(role) or {}
            kept = {k: old[k] for k in ("lastScaleTime", "lastScaleReason") if old.get(k)}
            if kept:
                pools[role] = kept
    status: dict[str, Any] = {"conditions": conditions}
    if pools:
        status["pools"] = pools
    if found := metrics(signals):
        status["metrics"] = found
    return status


def notices(decision: Decision, previous: dict[str, Any]) -> list[Notice]:
    """An Event per pool scaled, and a Warning when MetricsAvailable turns False (not while
    pools are only starting, but once they stop being so)."""
    out = [
        Notice("Normal", "ScaledUp" if pool.desired > pool.current else "ScaledDown", pool.reason)
        for pool in decision.pools.values()
        if pool.changed
    ]
    before = _previous_condition(previous, METRICS_AVAILABLE)
    newly_lost = before.get("status") != "False" or before.get("reason") == STARTING_REASON
    if not decision.metrics_available and decision.metrics_reason != STARTING_REASON and newly_lost:
        message = f"{decision.metrics_reason}: {decision.metrics_message}"
        out.append(Notice("Warning", METRICS_LOST_EVENT, message))
    return out


def summary(decision: Decision) -> str:
    """The decision as one log line: every pool's sentence, or the hold and why."""
    if not decision.metrics_available and not any(p.changed for p in decision.pools.values()):
        sizes = ", ".join(f"{role} at {pool.current}" for role, pool in decision.pools.items())
        return (
            f"holds {sizes}: MetricsAvailable=False {decision.metrics_reason}:"
            f" {decision.metrics_message}"
        )
    pools = "; ".join(pool.reason for pool in decision.pools.values())
    if decision.metrics_available:
        return pools
    return f"{pools} [MetricsAvailable=False {decision.metrics_reason}]"
