"""Reconcile passes with a model cache, over the in-memory API: the claim is created once and
never changed, a claim that differs is reported, a foreign or missing one stops the pass."""

from __future__ import annotations

from typing import Any

import pytest

from phasefleet.operator.reconcile import Blocked, reconcile
from tests.operator.factories import NAMESPACE, make_isvc
from tests.operator.fake_api import FakeApi

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"
HF = {"repoId": "org/m"}
CLAIM = ("PersistentVolumeClaim", NAMESPACE, "llm-model-cache")


def setup(cache: dict[str, Any]) -> tuple[FakeApi, dict[str, Any]]:
    api = FakeApi()
    return api, api.add(make_isvc(model={"hf": HF, "cache": cache}))


def fresh(api: FakeApi) -> dict[str, Any]:
    body = api.get("InferenceService", NAMESPACE, "llm")
    assert body is not None
    return body


def degraded(api: FakeApi) -> dict[str, Any]:
    return next(c for c in fresh(api)["status"]["conditions"] if c["type"] == "Degraded")


def test_the_claim_is_created_once_and_never_applied() -> None:
    api, body = setup({"pvc": {"size": "20Gi"}})
    outcome = reconcile(api, body, NOW)
    assert "PersistentVolumeClaim/llm-model-cache" in outcome.applied
    assert api.objects[CLAIM]["spec"]["resources"]["requests"]["storage"] == "20Gi"
    api.objects[CLAIM]["spec"]["volumeName"] = "pv-1"  # bound: the API server's own field
    api.writes.clear()
    api.set_ready(NAMESPACE)
    outcome = reconcile(api, fresh(api), LATER)
    assert not [w for w in api.writes if w[1] == "PersistentVolumeClaim"]
    assert not [a for a in api.applies if a[0] == "PersistentVolumeClaim"]
    assert degraded(api)["status"] == "False"


def test_a_claim_that_differs_from_the_spec_is_degraded_but_serves() -> None:
    api, body = setup({"pvc": {"size": "20Gi"}})
    reconcile(api, body, NOW)
    api.set_ready(NAMESPACE)
    isvc = fresh(api)
    isvc["spec"]["model"]["cache"]["pvc"]["size"] = "40Gi"
    isvc["metadata"]["generation"] = 2
    api.objects[("InferenceService", NAMESPACE, "llm")] = isvc
    outcome = reconcile(api, fresh(api), LATER)
    assert api.objects[CLAIM]["spec"]["resources"]["requests"]["storage"] == "20Gi"  # untouched
    cond = degraded(api)
    assert cond["status"] == "True" and cond["reason"] == "ModelCacheDiffers"
    assert "size 20Gi where spec.model.cache.pvc.size is 40Gi" in cond["message"]
    assert outcome.degraded is not None  # posted once as a Warning event
    assert fresh(api)["status"]["observedGeneration"] == 2  # not a blocked generation


def test_a_claim_of_that_name_owned_by_another_object_stops_the_pass() -> None:
    api, body = setup({"pvc": {"size": "20Gi"}})
    api.add(
        {
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "llm-model-cache", "namespace": NAMESPACE},
            "spec": {"resources": {"requests": {"storage": "1Ti"}}},
        }
    )
    with pytest.raises(Blocked, match="does not belong to InferenceService team-a/llm"):
        reconcile(api, body, NOW)
    assert degraded(api)["reason"] == "ModelCacheConflict"
    assert not any(kind == "Deployment" for kind, _, _ in api.objects)
    assert api.objects[CLAIM]["spec"]["resources"]["requests"]["storage"] == "1Ti"


def test_a_refused_claim_is_reported_with_the_api_servers_reason() -> None:
    api, body = setup({"pvc": {"size": "20Gi"}})
    api.refuse[("PersistentVolumeClaim", "llm-model-cache")] = (
        403,
        'persistentvolumeclaims "llm-model-cache" is forbidden: exceeded quota: storage',
    )
    with pytest.raises(Blocked, match="exceeded quota"):
        reconcile(api, body, NOW)
    assert degraded(api)["reason"] == "ChildRejected"
    assert "raise the ResourceQuota" in degraded(api)["message"]


def test_a_named_claim_that_is_missing_is_reported_until_it_exists() -> None:
    api, body = setup({"claimName": "shared-models"})
    with pytest.raises(Blocked, match="shared-models .spec.model.cache.claimName. not found"):
        reconcile(api, body, NOW)
    assert degraded(api)["reason"] == "ModelCacheMissing"
    api.add(
        {
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "shared-models", "namespace": NAMESPACE},
        }
    )
    outcome = reconcile(api, fresh(api), LATER)
    assert not [a for a in outcome.applied if a.startswith("PersistentVolumeClaim")]
    assert degraded(api)["status"] == "False"
