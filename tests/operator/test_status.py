"""Status computation from Deployments (pure)."""

from __future__ import annotations

from typing import Any

from phasefleet.api.crd import PRINTER_COLUMNS
from phasefleet.operator.status import Problem, compute_status, status_changed
from tests.operator.factories import make_owner, make_spec

NOW = "2026-01-01T00:00:00Z"


def deployment(name: str, desired: int, ready: int, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "generation": 1},
        "spec": {"replicas": desired},
        "status": {
            "observedGeneration": 1,
            "replicas": desired,
            "updatedReplicas": desired,
            "readyReplicas": ready,
            **status,
        },
    }


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def printed(status: dict[str, Any]) -> dict[str, Any]:
    """The pool columns of `kubectl get inferenceservice` for this status (None prints blank)."""
    cells = {}
    for column in PRINTER_COLUMNS:
        if column["name"] in ("Prefill", "Decode", "Workers"):
            field = column["jsonPath"].removeprefix(".status.")
            assert field.isalpha(), column  # a plain `.status.<field>` path
            cells[column["name"]] = status.get(field)
    return cells


def test_aggregated_shows_the_worker_pool_once():
    spec = make_spec(mode="aggregated", prefill=None, decode=None, worker={"replicas": 2})
    deps = {
        "llm-worker": deployment("llm-worker", 2, 1),
        "llm-router": deployment("llm-router", 1, 1),
    }
    status = compute_status(make_owner(), 1, spec, deps, {}, NOW)
    assert printed(status) == {"Prefill": None, "Decode": None, "Workers": "1/2"}
    ready = conditions(status)["Ready"]
    assert ready["status"] == "False" and "worker 1/2 ready" in ready["message"]


def test_disaggregated_shows_prefill_and_decode():
    deps = {
        "llm-prefill": deployment("llm-prefill", 1, 1),
        "llm-decode": deployment("llm-decode", 2, 1),
        "llm-router": deployment("llm-router", 1, 1),
    }
    status = compute_status(make_owner(), 1, make_spec(), deps, {}, NOW)
    assert printed(status) == {"Prefill": "1/1", "Decode": "1/2", "Workers": None}


def test_stuck_rollout_is_degraded():
    spec = make_spec()
    stuck = deployment("llm-decode", 2, 0, conditions=[
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": "ReplicaSet has timed out progressing."}
    ])  # fmt: skip
    deps = {
        "llm-prefill": deployment("llm-prefill", 1, 1),
        "llm-decode": stuck,
        "llm-router": deployment("llm-router", 1, 1),
    }
    status = compute_status(make_owner(), 1, spec, deps, {}, NOW)
    degraded = conditions(status)["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "RolloutStuck"
    assert "decode" in degraded["message"]


def test_transition_time_kept_while_status_holds():
    spec = make_spec()
    first = compute_status(make_owner(), 1, spec, {}, {}, NOW)
    second = compute_status(make_owner(), 1, spec, {}, first, "2026-01-02T00:00:00Z")
    assert conditions(second)["Ready"]["lastTransitionTime"] == NOW
    assert not status_changed(second, first)
    problem = Problem("ModelVolumeMissing", "PersistentVolumeClaim x not found")
    third = compute_status(make_owner(), 1, spec, {}, second, "2026-01-03T00:00:00Z", problem)
    assert conditions(third)["Degraded"]["lastTransitionTime"] == "2026-01-03T00:00:00Z"
    assert status_changed(third, second)


def test_status_written_by_others_is_not_a_change():
    spec = make_spec()
    mine = compute_status(make_owner(), 1, spec, {}, {}, NOW)
    live = {**mine, "metrics": {"ttftMs": 120.0}}
    live["pools"] = {k: {**v, "lastScaleReason": "kv usage"} for k, v in mine["pools"].items()}
    live["conditions"] = [*mine["conditions"], {"type": "MetricsAvailable", "status": "True"}]
    assert not status_changed(mine, live)


def zero_spec() -> Any:
    return make_spec(
        mode="aggregated",
        prefill=None,
        decode=None,
        worker={"replicas": 1, "minReplicas": 0, "maxReplicas": 2},
        autoscaling={"enabled": True, "scaleToZeroAfterSeconds": 30},
    )


def test_a_service_scaled_to_zero_says_so_and_stays_ready():
    deps = {
        "llm-worker": deployment("llm-worker", 0, 0),
        "llm-router": deployment("llm-router", 1, 1),
    }
    status = compute_status(make_owner(), 1, zero_spec(), deps, {}, NOW)
    assert status["scale"] == "ScaledToZero"
    assert printed(status)["Workers"] == "0/0"
    ready = conditions(status)["Ready"]
    assert ready["status"] == "True"
    assert ready["message"] == "all pools and the router are ready (worker scaled to 0)"


def test_a_pool_waking_from_zero_keeps_the_service_ready_while_requests_are_held():
    deps = {
        "llm-worker": deployment("llm-worker", 1, 0),
        "llm-router": deployment("llm-router", 1, 1),
    }
    status = compute_status(make_owner(), 1, zero_spec(), deps, {}, NOW)
    assert status["scale"] == "WakingFromZero"
    ready = conditions(status)["Ready"]
    assert ready["status"] == "True" and "worker waking from 0" in ready["message"]
    # once it serves, scale is left out, and that is a change to write
    deps["llm-worker"] = deployment("llm-worker", 1, 1)
    serving = compute_status(make_owner(), 1, zero_spec(), deps, status, NOW)
    assert "scale" not in serving
    assert status_changed(serving, status)


def test_a_waking_pool_whose_pod_cannot_start_is_not_ready():
    deps = {
        "llm-worker": deployment("llm-worker", 1, 0),
        "llm-router": deployment("llm-router", 1, 1),
    }
    problem = Problem("PodCannotStart", "Pod team-a/llm-worker-x (pool worker) cannot start")
    status = compute_status(make_owner(), 1, zero_spec(), deps, {}, NOW, problem=problem)
    assert conditions(status)["Ready"]["status"] == "False"
    assert conditions(status)["Degraded"]["reason"] == "PodCannotStart"


def test_without_scale_to_zero_a_pool_with_no_ready_pod_is_not_ready():
    spec = make_spec(mode="aggregated", prefill=None, decode=None, worker={"replicas": 1})
    deps = {
        "llm-worker": deployment("llm-worker", 1, 0),
        "llm-router": deployment("llm-router", 1, 1),
    }
    status = compute_status(make_owner(), 1, spec, deps, {}, NOW)
    assert conditions(status)["Ready"]["status"] == "False" and "scale" not in status
