"""The kopf settings the handlers module installs, and its pod handler over an in-memory API
(no kopf started, no API server)."""

from __future__ import annotations

import logging
from typing import Any

import kopf
import pytest
from kopf._cogs.structs.references import Resource

from phasefleet.api.contract import CHILD_KINDS, ISVC_LABEL
from phasefleet.operator import handlers
from phasefleet.operator.reconcile import reconcile
from tests.operator.factories import NAMESPACE, make_isvc
from tests.operator.fake_api import FakeApi


def _settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    memo = kopf.Memo()
    memo.api = FakeApi()
    configure: Any = handlers.configure  # the kopf decorator's type wants kopf's own kwargs
    configure(settings=settings, memo=memo)
    return settings


def test_children_are_watched_through_a_server_side_label_selector():
    selectors = _settings().watching.label_selectors
    for child in CHILD_KINDS:
        resource = Resource(
            group=child.group, version=child.version, plural=child.plural, kind=child.kind
        )
        assert list(selectors.collect(resource)) == [ISVC_LABEL], child.kind


def test_other_resources_are_not_filtered():
    selectors = _settings().watching.label_selectors
    for resource in (
        Resource("serving.phasefleet.dev", "v1alpha1", "inferenceservices"),
        Resource("serving.knative.dev", "v1", "services"),  # same plural, other group
        Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions"),
        Resource("", "v1", "namespaces"),
    ):
        assert list(selectors.collect(resource)) == [], resource


def test_only_the_services_pods_are_watched():
    selectors = _settings().watching.label_selectors
    pods = Resource("", "v1", "pods", kind="Pod")
    assert list(selectors.collect(pods)) == [ISVC_LABEL]


def _switched_to_aggregated() -> FakeApi:
    """A disaggregated service switched to aggregated whose new worker pool has become ready:
    the next settled pass deletes the old prefill and decode pools."""
    api = FakeApi()
    body = api.add(make_isvc())
    reconcile(api, body, "2026-01-01T00:00:00Z")
    api.set_ready(NAMESPACE)
    body = api.get("InferenceService", NAMESPACE, "llm") or {}
    body["spec"] = {"model": body["spec"]["model"], "mode": "aggregated", "worker": {"replicas": 1}}
    body["metadata"]["generation"] = 2
    api.objects[("InferenceService", NAMESPACE, "llm")] = body
    assert reconcile(api, body, "2026-01-01T00:05:00Z").deleted == []  # new pool not ready yet
    api.set_ready(NAMESPACE)
    return api


def _pod_event(api: FakeApi, ready: bool, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Runs the pod handler for a worker pod's change; returns the events it posted."""
    posted: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "event", lambda _body, **event: posted.append(event))
    pod: Any = {
        "kind": "Pod",
        "metadata": {
            "name": "llm-worker-5c4-q8",
            "namespace": NAMESPACE,
            "labels": {ISVC_LABEL: "llm", "phasefleet.dev/role": "worker"},
        },
        "status": {"conditions": [{"type": "Ready", "status": str(ready)}]},
    }
    memo = kopf.Memo()
    memo.api = api
    pod_event: Any = handlers.pod_event  # the kopf decorator's type wants kopf's own kwargs
    pod_event(body=kopf.Body(pod), type="MODIFIED", memo=memo, logger=logging.getLogger("t"))
    return posted


def test_a_pod_event_that_retires_the_old_pools_posts_their_deletion(monkeypatch):
    api = _switched_to_aggregated()
    posted = _pod_event(api, ready=False, monkeypatch=monkeypatch)
    names = {name for kind, _, name in api.objects if kind == "Deployment"}
    assert names == {"llm-worker", "llm-router"}
    deletions = [e for e in posted if e["message"].startswith("deleted ")]
    assert len(deletions) == 1 and deletions[0]["type"] == "Normal"
    assert "Deployment/llm-prefill" in deletions[0]["message"]
    assert "Deployment/llm-decode" in deletions[0]["message"]
    assert deletions[0]["message"].endswith(": the pools replacing them are ready")


def test_a_ready_pods_event_runs_no_pass(monkeypatch):
    api = _switched_to_aggregated()
    assert _pod_event(api, ready=True, monkeypatch=monkeypatch) == []
    # the old pools stay until a pass runs: the Deployment's own event runs it, not the pod's
    assert ("Deployment", NAMESPACE, "llm-prefill") in api.objects
