"""Reconcile passes over an in-memory API: children, status, drift, pruning, idempotence."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from phasefleet.api.contract import ISVC_LABEL
from phasefleet.operator.reconcile import (
    Blocked,
    InvalidSpec,
    Outcome,
    owns_child,
    reconcile,
    sync_owner,
)
from tests.operator.factories import NAMESPACE, make_isvc
from tests.operator.fake_api import FakeApi

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"


def sync_child(api: FakeApi, child: dict[str, Any], now: str) -> Outcome | None:
    """What the operator does on a child's event: its owner's pass, if it owns the child."""
    if not owns_child(api, child):
        return None
    meta = child["metadata"]
    return sync_owner(api, meta["namespace"], meta["labels"][ISVC_LABEL], now)


def setup(**overrides: Any) -> tuple[FakeApi, dict]:
    api = FakeApi()
    body = api.add(make_isvc(**overrides))
    return api, body


def fresh(api: FakeApi, name: str = "llm") -> dict:
    body = api.get("InferenceService", NAMESPACE, name)
    assert body is not None
    return body


def condition(body: dict, type_: str) -> dict:
    return next(c for c in body["status"]["conditions"] if c["type"] == type_)


def test_first_reconcile_creates_children_and_status():
    api, body = setup()
    outcome = reconcile(api, body, NOW)
    assert len(outcome.applied) == 13 and outcome.status_written  # Secret + 12 children
    assert outcome.applied[0] == "Secret/llm-internal"
    status = fresh(api)["status"]
    assert status["endpoint"] == "http://llm-router.team-a.svc:80"
    assert status["observedGeneration"] == 1
    assert status["prefillReady"] == "0/1" and status["decodeReady"] == "0/2"
    assert condition(fresh(api), "Ready")["status"] == "False"
    assert condition(fresh(api), "Progressing")["status"] == "True"
    assert condition(fresh(api), "Degraded")["status"] == "False"


def test_internal_token_is_made_once_and_never_overwritten():
    api, body = setup()
    api.add(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "llm-internal", "namespace": NAMESPACE},
            "stringData": {"token": "made-before"},
        }
    )
    reconcile(api, body, NOW)
    secret = api.objects[("Secret", NAMESPACE, "llm-internal")]
    assert secret["stringData"] == {"token": "made-before"}
    assert ("create", "Secret", "llm-internal") not in api.writes
    assert not [a for a in api.applies if a[0] == "Secret"]  # never applied (or read back)


def test_ready_once_pods_are_ready_and_second_pass_writes_nothing():
    api, body = setup()
    reconcile(api, body, NOW)
    api.set_ready(NAMESPACE)
    reconcile(api, fresh(api), LATER)
    ready = condition(fresh(api), "Ready")
    assert ready["status"] == "True" and ready["lastTransitionTime"] == LATER
    assert fresh(api)["status"]["pools"]["decode"] == {
        "replicas": 2,
        "readyReplicas": 2,
        "desiredReplicas": 2,
    }
    api.writes.clear()
    outcome = reconcile(api, fresh(api), "2026-01-01T01:00:00Z")
    assert api.writes == [] and outcome.applied == [] and not outcome.status_written


def test_missing_pvc_is_reported_and_retried_until_it_exists():
    api, body = setup(model={"pvc": {"claimName": "weights"}})
    with pytest.raises(Blocked, match="PersistentVolumeClaim team-a/weights not found") as first:
        reconcile(api, body, NOW)
    assert first.value.news  # one Warning event for it
    with pytest.raises(Blocked) as retry:
        reconcile(api, fresh(api), LATER)
    assert not retry.value.news  # the same problem at the next retry: no second event
    degraded = condition(fresh(api), "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ModelVolumeMissing"
    assert "spec.model.pvc.claimName" in degraded["message"]
    assert not any(kind == "Deployment" for kind, _, _ in api.objects)
    api.add(
        {"kind": "PersistentVolumeClaim", "metadata": {"name": "weights", "namespace": NAMESPACE}}
    )
    reconcile(api, fresh(api), LATER)
    assert condition(fresh(api), "Degraded")["status"] == "False"
    assert ("Deployment", NAMESPACE, "llm-decode") in api.objects


def test_missing_token_secret_or_key_is_reported_without_reading_values():
    api, body = setup(
        model={"hf": {"repoId": "o/m", "tokenSecret": {"name": "hf", "key": "token"}}}
    )
    with pytest.raises(Blocked, match="Secret team-a/hf not found"):
        reconcile(api, body, NOW)
    api.add(
        {
            "kind": "Secret",
            "metadata": {"name": "hf", "namespace": NAMESPACE},
            "data": {"other": "c2VjcmV0"},
        }
    )
    with pytest.raises(Blocked, match="no key 'token'") as info:
        reconcile(api, fresh(api), NOW)
    assert "c2VjcmV0" not in str(info.value)
    assert "c2VjcmV0" not in str(fresh(api)["status"])


def test_missing_api_key_secret_or_key_is_reported_without_reading_values():
    api, body = setup(auth={"apiKeySecret": {"name": "keys"}})
    with pytest.raises(Blocked, match="Secret team-a/keys not found.*spec.auth.apiKeySecret"):
        reconcile(api, body, NOW)
    assert condition(fresh(api), "Degraded")["reason"] == "ApiKeySecretMissing"
    secret = {"kind": "Secret", "metadata": {"name": "keys", "namespace": NAMESPACE}}
    api.add({**secret, "data": {"other": "c2VjcmV0"}})
    with pytest.raises(Blocked, match="no key 'token'.*spec.auth.apiKeySecret.key") as info:
        reconcile(api, fresh(api), NOW)
    assert condition(fresh(api), "Degraded")["reason"] == "ApiKeySecretKeyMissing"
    assert "c2VjcmV0" not in str(info.value) + str(fresh(api)["status"])
    api.objects[("Secret", NAMESPACE, "keys")] = {**secret, "data": {"token": "c2VjcmV0"}}
    reconcile(api, fresh(api), NOW)
    assert condition(fresh(api), "Degraded")["status"] == "False"


def test_invalid_spec_is_permanent():
    api, body = setup(mode="aggregated")
    with pytest.raises(InvalidSpec, match="worker"):
        reconcile(api, body, NOW)


def test_mode_change_keeps_the_old_pools_serving_until_the_new_one_is_ready():
    api, body = setup()
    reconcile(api, body, NOW)
    api.set_ready(NAMESPACE)
    body = fresh(api)
    body["spec"] = {"model": body["spec"]["model"], "mode": "aggregated", "worker": {"replicas": 1}}
    body["metadata"]["generation"] = 2
    api.objects[("InferenceService", NAMESPACE, "llm")] = body
    outcome = reconcile(api, body, LATER)
    assert outcome.deleted == []
    names = {name for kind, _, name in api.objects if kind == "Deployment"}
    assert names == {"llm-prefill", "llm-decode", "llm-worker", "llm-router"}
    progressing = condition(fresh(api), "Progressing")
    assert progressing["status"] == "True"
    assert "old pools decode, prefill keep serving until worker" in progressing["message"]
    assert fresh(api)["status"]["observedGeneration"] == 2

    api.set_ready(NAMESPACE)  # the worker pool's pods come up; its Deployment's event arrives
    synced = sync_child(api, api.get("Deployment", NAMESPACE, "llm-worker") or {}, LATER)
    assert synced is not None and synced.applied == []
    assert "Deployment/llm-prefill" in synced.deleted and "Deployment/llm-decode" in synced.deleted
    names = {name for kind, _, name in api.objects if kind == "Deployment"}
    assert names == {"llm-worker", "llm-router"}
    assert condition(fresh(api), "Ready")["status"] == "True"
    status = fresh(api)["status"]  # kubectl get: the worker pool, and no old pool's column
    assert status["workersReady"] == "1/1"
    assert "prefillReady" not in status and "decodeReady" not in status


def test_spec_change_changes_the_pod_template():
    api, body = setup()
    reconcile(api, body, NOW)
    before = api.get("Deployment", NAMESPACE, "llm-decode")
    body = fresh(api)
    body["spec"]["runtime"] = {"image": "engine:2"}
    reconcile(api, body, LATER)
    after = api.get("Deployment", NAMESPACE, "llm-decode")
    assert before and after
    assert after["spec"]["template"]["spec"]["containers"][0]["image"] == "engine:2"
    key = "phasefleet.dev/spec-hash"
    old = before["spec"]["template"]["metadata"]["annotations"][key]
    assert after["spec"]["template"]["metadata"]["annotations"][key] != old


def test_child_drift_is_restored_and_deleted_child_recreated():
    api, body = setup()
    reconcile(api, body, NOW)
    dep = api.objects[("Deployment", NAMESPACE, "llm-decode")]
    dep["spec"]["replicas"] = 7
    outcome = sync_child(api, api.get("Deployment", NAMESPACE, "llm-decode") or {}, LATER)
    assert outcome is not None and outcome.applied == ["Deployment/llm-decode"]
    assert api.objects[("Deployment", NAMESPACE, "llm-decode")]["spec"]["replicas"] == 2

    svc = api.get("Service", NAMESPACE, "llm-router") or {}
    api.delete("Service", NAMESPACE, "llm-router")
    outcome = sync_child(api, svc, LATER)
    assert outcome is not None and outcome.applied == ["Service/llm-router"]
    assert ("Service", NAMESPACE, "llm-router") in api.objects


def test_child_event_with_nothing_changed_writes_nothing():
    api, body = setup()
    reconcile(api, body, NOW)
    api.writes.clear()
    api.applies.clear()
    for (kind, _, name), _obj in list(api.objects.items()):
        if kind != "InferenceService":
            child = api.get(kind, NAMESPACE, name) or {}
            outcome = sync_child(api, child, LATER)
            assert outcome is not None and outcome.applied == []
    assert api.writes == [] and api.applies == []


def test_child_of_a_deleted_owner_is_left_alone():
    api, body = setup()
    reconcile(api, body, NOW)
    child = api.get("Deployment", NAMESPACE, "llm-decode") or {}
    api.delete("InferenceService", NAMESPACE, "llm")
    assert sync_child(api, child, LATER) is None


def test_autoscaled_pool_keeps_the_autoscalers_replicas_within_bounds():
    api, body = setup(
        decode={"replicas": 2, "minReplicas": 1, "maxReplicas": 4}, autoscaling={"enabled": True}
    )
    reconcile(api, body, NOW)
    api.objects[("Deployment", NAMESPACE, "llm-decode")]["spec"]["replicas"] = 3  # the autoscaler
    outcome = sync_child(api, api.get("Deployment", NAMESPACE, "llm-decode") or {}, LATER)
    assert outcome is not None and outcome.applied == []
    reconcile(api, fresh(api), LATER)
    assert api.objects[("Deployment", NAMESPACE, "llm-decode")]["spec"]["replicas"] == 3
    api.objects[("Deployment", NAMESPACE, "llm-decode")]["spec"]["replicas"] = 10
    reconcile(api, fresh(api), LATER)
    assert api.objects[("Deployment", NAMESPACE, "llm-decode")]["spec"]["replicas"] == 4


REFUSED = (
    'Service "llm-prefill" is invalid: spec.ports[0].port: Invalid value: 0:'
    " must be between 1 and 65535, inclusive"
)


def test_a_generation_whose_child_was_refused_is_neither_observed_nor_ready():
    api, body = setup()
    reconcile(api, body, NOW)
    api.set_ready(NAMESPACE)
    reconcile(api, fresh(api), NOW)
    assert condition(fresh(api), "Ready")["status"] == "True"

    body = fresh(api)
    body["spec"]["decode"]["maxNumSeqs"] = 8
    body["metadata"]["generation"] = 2
    api.objects[("InferenceService", NAMESPACE, "llm")] = body
    api.refuse[("Deployment", "llm-decode")] = (422, REFUSED)
    with pytest.raises(Blocked) as info:
        reconcile(api, body, LATER)
    status = fresh(api)["status"]
    assert status["observedGeneration"] == 1
    ready, degraded = condition(fresh(api), "Ready"), condition(fresh(api), "Degraded")
    assert ready["status"] == "False" and ready["reason"] == "ChildRejected"
    assert degraded["status"] == "True" and degraded["message"] == info.value.problem.message
    message = degraded["message"]
    assert message.startswith("The API server refused Deployment team-a/llm-decode (")
    assert "must be between 1 and 65535" in message and "change InferenceService" in message
    assert "HTTP" not in message and "{" not in message and "\n" not in message

    # Deployment events keep arriving (the old pods are still running): they change nothing.
    api.writes.clear()
    for name in ("llm-prefill", "llm-decode", "llm-router"):
        assert sync_child(api, api.get("Deployment", NAMESPACE, name) or {}, LATER) is None
    assert api.writes == []
    assert condition(fresh(api), "Degraded")["message"] == message

    del api.refuse[("Deployment", "llm-decode")]  # the kopf handler's retry succeeds
    reconcile(api, fresh(api), LATER)
    assert fresh(api)["status"]["observedGeneration"] == 2
    assert condition(fresh(api), "Degraded")["status"] == "False"


def test_refusal_after_the_generation_was_observed_is_kept_by_child_events():
    api, body = setup()
    reconcile(api, body, NOW)
    api.objects[("Service", NAMESPACE, "llm-router")]["spec"]["ports"] = []  # a hand edit
    api.refuse[("Service", "llm-router")] = (403, "services is forbidden: User cannot patch")
    for _ in range(2):  # every event runs the one reconcile pass, which fails the same way
        with pytest.raises(Blocked, match="grant the operator's ServiceAccount"):
            sync_child(api, api.get("Deployment", NAMESPACE, "llm-decode") or {}, LATER)
        degraded = condition(fresh(api), "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "ChildRejected"


def test_a_pool_scaled_to_zero_on_purpose_is_ready():
    api, body = setup(prefill={"replicas": 0})
    reconcile(api, body, NOW)
    api.set_ready(NAMESPACE)
    reconcile(api, fresh(api), LATER)
    ready = condition(fresh(api), "Ready")
    assert ready["status"] == "True" and "prefill scaled to 0" in ready["message"]
    assert fresh(api)["status"]["prefillReady"] == "0/0"


def test_a_pod_that_cannot_start_is_reported_with_the_fix():
    api, body = setup(
        model={"hf": {"repoId": "o/m", "tokenSecret": {"name": "hf", "key": "token"}}}
    )
    api.refuse_gets = {"Secret"}
    reconcile(api, body, NOW)
    api.add(
        {
            "kind": "Pod",
            "metadata": {
                "name": "llm-decode-7d9-x2",
                "namespace": NAMESPACE,
                "labels": {
                    "phasefleet.dev/inferenceservice": "llm",
                    "phasefleet.dev/role": "decode",
                },
            },
            "status": {
                "containerStatuses": [
                    {
                        "name": "engine",
                        "state": {
                            "waiting": {
                                "reason": "CreateContainerConfigError",
                                "message": 'secret "hf" not found',
                            }
                        },
                    }
                ]
            },
        }
    )
    reconcile(api, fresh(api), LATER)
    degraded = condition(fresh(api), "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "PodCannotStart"
    assert degraded["message"] == (
        "Pod team-a/llm-decode-7d9-x2 (pool decode) cannot start (CreateContainerConfigError:"
        ' secret "hf" not found); create the Secret or ConfigMap it names'
        " (spec.model.hf.tokenSecret, spec.runtime.env), or change the spec"
    )
    assert condition(fresh(api), "Ready")["reason"] == "PodsNotReady"
    assert fresh(api)["status"]["observedGeneration"] == 1


def crashing_pod(message: str) -> dict[str, Any]:
    terminated = {"exitCode": 2, "reason": "Error", "message": message}
    return {
        "kind": "Pod",
        "metadata": {
            "name": "llm-decode-7d9-x2",
            "namespace": NAMESPACE,
            "labels": {"phasefleet.dev/inferenceservice": "llm", "phasefleet.dev/role": "decode"},
        },
        "status": {
            "containerStatuses": [
                {
                    "name": "engine",
                    "ready": False,
                    "restartCount": 1,
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
                    "lastState": {"terminated": terminated},
                }
            ]
        },
    }


def test_a_pod_change_runs_the_pass_and_a_new_degraded_text_is_news_once():
    api, body = setup()
    reconcile(api, body, NOW)
    assert sync_owner(api, NAMESPACE, "llm", LATER) is not None  # settled: the pass runs
    api.add(crashing_pod("model folder /models/m does not exist: put the model there"))
    outcome = sync_owner(api, NAMESPACE, "llm", LATER)
    assert outcome is not None and outcome.degraded is not None
    assert outcome.degraded.reason == "ContainerFailing"
    assert outcome.degraded.message == condition(fresh(api), "Degraded")["message"]
    assert "model folder /models/m does not exist" in outcome.degraded.message
    again = sync_owner(api, NAMESPACE, "llm", LATER)
    assert again is not None and again.degraded is None  # the same text: no second event
    api.add(crashing_pod("out of memory loading model /models/m"))
    reworded = reconcile(api, fresh(api), LATER)
    assert reworded.degraded is not None and "out of memory" in reworded.degraded.message
    assert sync_owner(api, NAMESPACE, "gone", LATER) is None


def test_invalid_name_is_permanent_reported_in_status_and_says_why():
    api = FakeApi()
    body = api.add(make_isvc("llama-3.1-8b"))  # created before the CRD had its name rules
    with pytest.raises(InvalidSpec, match="no dots"):
        reconcile(api, body, NOW)
    status = fresh(api, "llama-3.1-8b")["status"]
    assert "observedGeneration" not in status
    degraded = condition(fresh(api, "llama-3.1-8b"), "Degraded")
    assert degraded["reason"] == "InvalidSpec" and degraded["status"] == "True"
    assert degraded["message"].startswith(
        "InferenceService team-a/llama-3.1-8b is invalid, change it: metadata.name must"
    )
    assert condition(fresh(api, "llama-3.1-8b"), "Ready")["status"] == "False"
    assert not any(kind == "Deployment" for kind, _, _ in api.objects)


def test_invalid_spec_change_keeps_the_last_good_state_and_is_one_line():
    api, body = setup()
    reconcile(api, body, NOW)
    api.set_ready(NAMESPACE)
    reconcile(api, fresh(api), NOW)
    body = fresh(api)
    body["spec"]["prefill"]["minReplicas"] = 5  # possible only with an older CRD
    body["metadata"]["generation"] = 2
    with pytest.raises(InvalidSpec):
        reconcile(api, body, LATER)
    status = fresh(api)["status"]
    assert status["observedGeneration"] == 1 and status["endpoint"].startswith("http://")
    assert status["pools"]["decode"]["readyReplicas"] == 2
    message = condition(fresh(api), "Degraded")["message"]
    assert "spec.prefill: minReplicas" in message and "\n" not in message
    assert "errors.pydantic.dev" not in message


def test_a_settled_service_gets_no_apply_despite_normalised_quantities_and_foreign_ports():
    api, body = setup(decode={"replicas": 1, "resources": {"limits": {"memory": "1.5Gi"}}})
    api.normalize = {"1.5Gi": "1536Mi"}  # what the API server stores
    reconcile(api, body, NOW)
    api.set_ready(NAMESPACE)
    reconcile(api, fresh(api), NOW)
    dep = api.objects[("Deployment", NAMESPACE, "llm-decode")]
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "memory": "1536Mi"
    }
    router = api.objects[("Service", NAMESPACE, "llm-router")]
    router["spec"]["ports"].append({"name": "metrics", "port": 9090, "targetPort": 9090})

    api.writes.clear()
    api.applies.clear()
    for kind, name in (("Deployment", "llm-decode"), ("Service", "llm-router")):
        outcome = sync_child(api, api.get(kind, NAMESPACE, name) or {}, LATER)
        assert outcome is not None and outcome.applied == []  # no DriftCorrected event
    reconcile(api, fresh(api), LATER)  # an operator restart (resume) applies nothing either
    assert api.applies == [] and api.writes == []
    assert len(api.objects[("Service", NAMESPACE, "llm-router")]["spec"]["ports"]) == 2


def test_a_field_the_operator_stops_setting_is_applied():
    api, body = setup()
    reconcile(api, body, NOW)
    # As left by an operator version that also set publishNotReadyAddresses: an extra field,
    # which a containment check alone would accept, but the applied hash differs.
    svc = api.objects[("Service", NAMESPACE, "llm-decode")]
    svc["spec"]["publishNotReadyAddresses"] = True
    svc["metadata"]["annotations"]["phasefleet.dev/applied-hash"] = "from-an-older-version"
    api.applies.clear()
    reconcile(api, fresh(api), LATER)
    assert api.applies == [("Service", "llm-decode")]


def test_events_arriving_while_a_pass_waits_are_folded_into_it():
    """Event passes over one owner run one at a time; while one waits for its turn, a later
    event returns at once (the waiting pass reads after it); other owners are not held."""
    from phasefleet.operator import reconcile as module

    ran: list[str] = []
    results: dict[str, Outcome | None] = {}

    def event(owner: str, name: str) -> threading.Thread:
        def run() -> Outcome:
            ran.append(name)
            return Outcome()

        def handle() -> None:
            results[name] = module.event_pass("ns", owner, run)

        thread = threading.Thread(target=handle)
        thread.start()
        return thread

    with module.one_at_a_time("ns", "svc"):  # a pass over the owner is running
        waiter = event("svc", "waiter")
        deadline = time.monotonic() + 5
        while ("ns", "svc") not in module._waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        later = event("svc", "later")
        later.join(5)
        assert not later.is_alive() and results["later"] is None  # folded, at once
        event("other", "other").join(5)
        assert ran == ["other"] and results["other"] is not None
    waiter.join(5)
    assert ran == ["other", "waiter"] and results["waiter"] is not None
    event("svc", "next").join(5)
    assert ran[-1] == "next"  # nothing waited any more: the next event's pass ran
