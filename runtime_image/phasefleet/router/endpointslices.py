"""Discovery from the Kubernetes API: the EndpointSlices of a pool's Service.

Read with the pod's ServiceAccount token over plain HTTPS (httpx; the router image has no
Kubernetes client). Every refresh lists the slices labelled `kubernetes.io/service-name=<svc>`
in the Service's namespace; the router's ServiceAccount needs `list` on `endpointslices` there.
Unlike DNS, a slice also lists terminating pods: they are kept with `ready=False`, so their
requests run to the end while new ones go elsewhere.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from phasefleet.router.discovery import Endpoint, parse_host_port

SERVICEACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
API_TIMEOUT = 2.0  # seconds for one list call
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


@dataclass(frozen=True)
class KubeAccess:
    """How to reach the API server: its URL and the files of the pod's ServiceAccount."""

    server: str  # https://host:port
    token_path: Path  # re-read on every call: the kubelet rotates bound tokens
    ca_path: Path
    namespace: str  # the pod's own namespace

    @classmethod
    def in_cluster(
        cls, root: Path = SERVICEACCOUNT_DIR, env: Mapping[str, str] = os.environ
    ) -> KubeAccess | None:
        """The in-cluster settings, or None outside a pod (or with no token mounted)."""
        host = env.get("KUBERNETES_SERVICE_HOST")
        port = env.get("KUBERNETES_SERVICE_PORT")
        if not host or not port or not (root / "token").is_file():
            return None
        host = f"[{host}]" if ":" in host else host
        namespace_file = root / "namespace"
        namespace = namespace_file.read_text().strip() if namespace_file.is_file() else "default"
        return cls(f"https://{host}:{port}", root / "token", root / "ca.crt", namespace)


def service_of(address: str, default_namespace: str) -> tuple[str, str, int]:
    """`llm-worker.team-a.svc:8000` -> ("team-a", "llm-worker", 8000); a bare name is in
    `default_namespace`."""
    host, port = parse_host_port(address)
    parts = host.split(".")
    namespace = parts[1] if len(parts) > 1 else default_namespace
    return namespace, parts[0], port


def endpoints_from_slices(slices: list[dict[str, Any]], default_port: int) -> list[Endpoint]:
    """EndpointSlice objects -> endpoints. An endpoint is ready unless its `ready` condition is
    false (unset means ready, as the API says) or it is terminating; only its first address is
    used, as the API asks of consumers."""
    found: dict[str, bool] = {}
    for item in slices:
        family = item.get("addressType")
        if family not in ("IPv4", "IPv6"):
            continue
        port = _slice_port(item.get("ports") or [], default_port)
        for endpoint in item.get("endpoints") or []:
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            host = f"[{addresses[0]}]" if family == "IPv6" else addresses[0]
            conditions = endpoint.get("conditions") or {}
            ready = (
                conditions.get("ready") is not False and conditions.get("terminating") is not True
            )
            url = f"http://{host}:{port}"
            found[url] = found.get(url, False) or ready  # a pod in two slices mid-update
    return [Endpoint(url, ready) for url, ready in found.items()]


def _slice_port(ports: list[dict[str, Any]], default_port: int) -> int:
    numbered = [p for p in ports if isinstance(p.get("port"), int)]
    for p in numbered:
        if p.get("name") == "http":
            return int(p["port"])
    return int(numbered[0]["port"]) if numbered else default_port


class EndpointSliceDiscovery:
    def __init__(self, access: KubeAccess, address: str) -> None:
        self.access = access
        self.address = address
        self.namespace, self.service, self.port = service_of(address, access.namespace)
        self.url = (
            f"{access.server}/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"
        )
        context = ssl.create_default_context(cafile=str(access.ca_path))
        self.client = httpx.AsyncClient(verify=context, timeout=API_TIMEOUT)

    def describe(self) -> str:
        return f"EndpointSlices of Service {self.namespace}/{self.service}"

    async def endpoints(self) -> list[Endpoint]:
        token = self.access.token_path.read_text().strip()
        response = await self.client.get(
            self.url,
            params={"labelSelector": f"{SERVICE_NAME_LABEL}={self.service}"},
            headers={"Authorization": f"Bearer {token}"},
        )
        if response.status_code != 200:
            raise RuntimeError(
                f"listing {self.describe()} answered {response.status_code}: "
                f"{_status_message(response)}"
            )
        return endpoints_from_slices(response.json().get("items") or [], self.port)

    async def aclose(self) -> None:
        await self.client.aclose()


def _status_message(response: httpx.Response) -> str:
    try:
        return str(response.json().get("message", ""))
    except ValueError:
        return response.text[:200]
