"""The REST layer: paths, server-side apply parameters, error mapping (no API server)."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from phasefleet.operator.kube import Gone, Kube, NamespaceTerminating, Rejected, Transient
from phasefleet.operator.meta import AUTOSCALER_FIELD_MANAGER, FIELD_MANAGER


class FakeClient:
    def __init__(self, result: Any = None, status: int | None = None, body: str = "") -> None:
        self.calls: list[dict[str, Any]] = []
        self.result, self.status, self.body = result, status, body

    def call_api(self, path: str, method: str, **kwargs: Any) -> Any:
        self.calls.append({"path": path, "method": method, **kwargs})
        if self.status is not None:
            exc = ApiException(status=self.status, reason="x")
            exc.body = self.body
            raise exc
        return self.result


def kube(client: FakeClient) -> Kube:
    return Kube(client)


def test_apply_is_server_side_with_our_field_manager_and_force():
    client = FakeClient(result={"metadata": {"resourceVersion": "7"}})
    obj = {"kind": "Deployment", "metadata": {"name": "llm-decode", "namespace": "ns"}}
    assert kube(client).apply(obj)["metadata"]["resourceVersion"] == "7"
    (call,) = client.calls
    assert call["method"] == "PATCH"
    assert call["path"] == "/apis/apps/v1/namespaces/ns/deployments/llm-decode"
    assert call["header_params"]["Content-Type"] == "application/apply-patch+yaml"
    assert ("fieldManager", FIELD_MANAGER) in call["query_params"]
    assert ("force", "true") in call["query_params"]
    assert call["body"] is obj


def test_status_apply_targets_the_subresource():
    client = FakeClient(result={})
    obj = {"kind": "InferenceService", "metadata": {"name": "llm", "namespace": "ns"}}
    kube(client).apply_status(obj)
    assert client.calls[0]["path"] == (
        "/apis/serving.phasefleet.dev/v1alpha1/namespaces/ns/inferenceservices/llm/status"
    )


def test_the_autoscaler_applies_with_its_own_field_manager():
    client = FakeClient(result={})
    obj = {"kind": "InferenceService", "metadata": {"name": "llm", "namespace": "ns"}}
    kube(client).apply_status(obj, manager=AUTOSCALER_FIELD_MANAGER)
    kube(client).apply({**obj, "kind": "Deployment"}, manager=AUTOSCALER_FIELD_MANAGER)
    for call in client.calls:
        assert ("fieldManager", AUTOSCALER_FIELD_MANAGER) in call["query_params"]
        assert ("force", "true") in call["query_params"]


def test_patch_is_a_json_merge_patch():
    client = FakeClient(result={})
    patch = {"metadata": {"annotations": {"a": None}}}
    kube(client).patch("Pod", "ns", "p-1", patch)
    (call,) = client.calls
    assert call["method"] == "PATCH" and call["path"] == "/api/v1/namespaces/ns/pods/p-1"
    assert call["header_params"]["Content-Type"] == "application/merge-patch+json"
    assert call["body"] is patch


def test_list_fills_in_the_kind_and_api_version():
    client = FakeClient(result={"items": [{"metadata": {"name": "a"}}]})
    (item,) = kube(client).list("Service", "ns", "phasefleet.dev/inferenceservice=llm")
    assert item["kind"] == "Service" and item["apiVersion"] == "v1"
    assert client.calls[0]["path"] == "/api/v1/namespaces/ns/services"
    client = FakeClient(result={"items": [{"metadata": {"name": "a"}}]})
    (dep,) = kube(client).list("Deployment", "ns", "phasefleet.dev/inferenceservice=llm")
    assert dep["kind"] == "Deployment" and dep["apiVersion"] == "apps/v1"


def test_missing_object_is_none_and_delete_of_missing_is_quiet():
    assert kube(FakeClient(status=404)).get("Secret", "ns", "hf") is None
    kube(FakeClient(status=404)).delete("Service", "ns", "gone")


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (404, "not found", Gone),
        (409, "conflict", Transient),
        (429, "slow down", Transient),
        (503, "unavailable", Transient),
        (422, "invalid", Rejected),
        (403, "forbidden", Rejected),
        (403, '{"details":{"causes":[{"reason":"NamespaceTerminating"}]}}', NamespaceTerminating),
    ],
)  # fmt: skip
def test_errors_map_to_retry_or_reject(status: int, body: str, error: type[Exception]):
    obj = {"kind": "Service", "metadata": {"name": "s", "namespace": "ns"}}
    with pytest.raises(error):
        kube(FakeClient(status=status, body=body)).apply(obj)


def test_rejection_carries_the_status_message_not_the_raw_body():
    body = (
        '{"kind":"Status","apiVersion":"v1","status":"Failure","message":"Service'
        ' \\"a.b-prefill\\" is invalid: metadata.name: Invalid value","reason":"Invalid",'
        '"code":422}'
    )
    obj = {"kind": "Service", "metadata": {"name": "a.b-prefill", "namespace": "ns"}}
    with pytest.raises(Rejected) as info:
        kube(FakeClient(status=422, body=body)).apply(obj)
    assert info.value.code == 422
    assert info.value.message == 'Service "a.b-prefill" is invalid: metadata.name: Invalid value'
    assert "kind" not in str(info.value) and "Failure" not in str(info.value)
