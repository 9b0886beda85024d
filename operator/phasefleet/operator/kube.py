"""The operator's few Kubernetes API calls, as plain dicts over the kubernetes client's REST layer.

Server-side apply goes through `ApiClient.call_api` with the apply-patch content type, which
the generated typed methods of this client version cannot send. Errors become two kinds:
`Transient` (retry later) and `Rejected` (the API server refused what we sent).
"""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING, Any, Protocol

from phasefleet.api.contract import CHILD_KINDS
from phasefleet.api.crd import GROUP, PLURAL, VERSION
from phasefleet.operator.meta import FIELD_MANAGER

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

# kind -> (API path prefix, plural)
RESOURCES = {
    **{
        child.kind: ("/api/v1" if not child.group else f"/apis/{child.api_version}", child.plural)
        for child in CHILD_KINDS
    },
    "Secret": ("/api/v1", "secrets"),
    "Pod": ("/api/v1", "pods"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "InferenceService": (f"/apis/{GROUP}/{VERSION}", PLURAL),
}
APPLY = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"
RETRYABLE = {409, 429, 500, 502, 503, 504}


class ApiError(Exception):
    """An API server error, with its Status message instead of the raw HTTP body."""

    def __init__(self, request: str, code: int, message: str) -> None:
        super().__init__(f"{request}: HTTP {code}: {message}")
        self.request = request  # "PATCH /apis/apps/v1/namespaces/ns/deployments/x"
        self.code = code  # HTTP status
        self.message = message  # the Status object's message: what the API server objected to


class Transient(ApiError):
    """The API server could not do it now (conflict, throttling, unavailable)."""


class Rejected(ApiError):
    """The API server refused the request (invalid object, forbidden)."""


class Gone(ApiError):
    """The object (for a status write: the InferenceService) no longer exists."""


class NamespaceTerminating(Rejected):
    """The namespace is being deleted: nothing may be created in it any more."""


class Api(Protocol):
    """What the reconciler needs from Kubernetes (a fake implements it in tests)."""

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]: ...

    def apply(self, obj: dict[str, Any], manager: str = FIELD_MANAGER) -> dict[str, Any]: ...

    def apply_status(self, obj: dict[str, Any], manager: str = FIELD_MANAGER) -> dict[str, Any]: ...

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None: ...

    def delete(self, kind: str, namespace: str, name: str) -> None: ...

    def create(self, obj: dict[str, Any]) -> bool: ...

    def create_event(self, event: dict[str, Any]) -> None: ...


def status_message(exc: Any) -> str:
    """The `message` of the metav1.Status an API error carries (its reason if there is none)."""
    try:
        status = json.loads(exc.body or "")
    except ValueError:
        status = None
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])
    return str(exc.reason or "no reason given")


def _path(kind: str, namespace: str, name: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


class Kube:
    """`Api` over a kubernetes.client.ApiClient."""

    def __init__(self, client: ApiClient) -> None:
        self.client = client

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster credentials when in a pod, else $KUBECONFIG / ~/.kube/config."""
        from kubernetes import client, config

        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
        configuration.connection_pool_maxsize = 32
        return cls(client.ApiClient(configuration))

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return self.client.call_api(
                path,
                method,
                query_params=query or [],
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                response_type="object",
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _request_timeout=30,
            )
        except ApiException as exc:
            request, code, message = f"{method} {path}", int(exc.status), status_message(exc)
            if code == 404:
                raise Gone(request, code, message) from exc
            if code in RETRYABLE:
                raise Transient(request, code, message) from exc
            if code == 403 and "NamespaceTerminating" in str(exc.body):
                raise NamespaceTerminating(request, code, message) from exc
            raise Rejected(request, code, message) from exc
        except (OSError, HTTPError) as exc:  # connection refused or reset, timeouts
            raise Transient(f"{method} {path}", 0, str(exc)) from exc

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return dict(self._call("GET", _path(kind, namespace, name)))
        except Gone:
            return None

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        result = self._call(
            "GET", _path(kind, namespace), query=[("labelSelector", label_selector)]
        )
        items = list(result.get("items") or [])
        api_version = RESOURCES[kind][0].removeprefix("/apis/").removeprefix("/api/")
        for item in items:  # list items come without apiVersion and kind
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items

    def _apply(self, obj: dict[str, Any], manager: str, suffix: str = "") -> dict[str, Any]:
        meta = obj["metadata"]
        path = _path(obj["kind"], meta["namespace"], meta["name"]) + suffix
        query = [("fieldManager", manager), ("force", "true")]
        return dict(self._call("PATCH", path, body=obj, query=query, content_type=APPLY))

    def apply(self, obj: dict[str, Any], manager: str = FIELD_MANAGER) -> dict[str, Any]:
        return self._apply(obj, manager)

    def apply_status(self, obj: dict[str, Any], manager: str = FIELD_MANAGER) -> dict[str, Any]:
        return self._apply(obj, manager, "/status")

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """A JSON merge patch (the autoscaler's pod annotations: no field manager to keep)."""
        self._call("PATCH", _path(kind, namespace, name), body=patch, content_type=MERGE_PATCH)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        with contextlib.suppress(Gone):
            self._call(
                "DELETE", _path(kind, namespace, name), body={"propagationPolicy": "Background"}
            )

    def create(self, obj: dict[str, Any]) -> bool:
        """Creates the object unless one of its name exists (then leaves it as it is): True
        when created. Needs only the `create` verb, so the object is never read back."""
        meta = obj["metadata"]
        try:
            self._call("POST", _path(obj["kind"], meta["namespace"]), body=obj)
        except Transient as exc:
            if exc.code == 409:  # AlreadyExists
                return False
            raise
        return True

    def create_event(self, event: dict[str, Any]) -> None:
        path = f"/api/v1/namespaces/{event['metadata']['namespace']}/events"
        self._call("POST", path, body=event)
