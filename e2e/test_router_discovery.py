"""The router's EndpointSlice discovery against the real kube-apiserver.

The router reads slices as its own ServiceAccount (a token from the TokenRequest API, a Role
granting `list` on endpointslices in its namespace), laid out as in a pod. Slices are written
by hand (managed by this test, not the EndpointSlice controller), so a test can turn an endpoint
terminating at will. The last test sends a request through a router whose only worker is found
through a slice.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.harness.controlplane import ControlPlane
from phasefleet.router.discovery import Endpoint
from phasefleet.router.endpointslices import EndpointSliceDiscovery, KubeAccess

SERVICE = "llm-worker"
REFRESH = 1.0  # seconds: the router's default refresh interval
ROLE = """
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: router}
rules:
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: router}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: router}
subjects:
- {kind: ServiceAccount, name: router}
"""


def pod_files(cluster: ControlPlane, namespace: str, account: str, root: Path) -> KubeAccess:
    """What the kubelet mounts into a pod for `account`, read the way the router reads it."""
    root.mkdir()
    token = cluster.kubectl("create", "token", account, "-n", namespace).stdout.strip()
    (root / "token").write_text(token)
    (root / "namespace").write_text(namespace)
    kubeconfig = json.loads(cluster.kubeconfig.read_text())
    ca = kubeconfig["clusters"][0]["cluster"]["certificate-authority-data"]
    (root / "ca.crt").write_bytes(base64.b64decode(ca))
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "0"}
    env["KUBERNETES_SERVICE_PORT"] = cluster.server.rsplit(":", 1)[1]
    access = KubeAccess.in_cluster(root, env)
    assert access is not None
    return access


def endpoint_slice(name: str, port: int, endpoints: list[tuple[str, dict[str, bool]]]) -> str:
    return json.dumps(
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/service-name": SERVICE,
                    "endpointslice.kubernetes.io/managed-by": "e2e.phasefleet.dev",
                },
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": c} for ip, c in endpoints],
        }
    )


READY = {"ready": True, "serving": True, "terminating": False}
TERMINATING = {"ready": False, "serving": True, "terminating": True}


@pytest.fixture
def access(cluster: ControlPlane, namespace: str, tmp_path: Path) -> KubeAccess:
    cluster.kubectl("create", "serviceaccount", "router", "-n", namespace)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=ROLE)
    return pod_files(cluster, namespace, "router", tmp_path / "serviceaccount")


def seen_within(
    access: KubeAccess, namespace: str, expected: list[Endpoint], seconds: float
) -> bool:
    """Polls at the router's refresh interval until the endpoints match."""

    async def poll() -> bool:
        discovery = EndpointSliceDiscovery(access, f"{SERVICE}.{namespace}.svc:8000")
        deadline = time.monotonic() + seconds
        try:
            while True:
                if sorted(await discovery.endpoints(), key=lambda e: e.url) == expected:
                    return True
                if time.monotonic() > deadline:
                    return False
                await asyncio.sleep(REFRESH)
        finally:
            await discovery.aclose()

    return asyncio.run(poll())


def test_ready_terminating_and_gone(
    cluster: ControlPlane, namespace: str, access: KubeAccess
) -> None:
    discovery = EndpointSliceDiscovery(access, f"{SERVICE}.{namespace}.svc:8000")
    assert discovery.describe() == f"EndpointSlices of Service {namespace}/{SERVICE}"
    assert seen_within(access, namespace, [], 0)

    def apply(*endpoints: tuple[str, dict[str, bool]]) -> None:
        slice_ = endpoint_slice(f"{SERVICE}-a", 8000, list(endpoints))
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=slice_)

    apply(("10.1.0.1", READY), ("10.1.0.2", READY))
    both = [Endpoint("http://10.1.0.1:8000", True), Endpoint("http://10.1.0.2:8000", True)]
    assert seen_within(access, namespace, both, 2.0)

    apply(("10.1.0.1", READY), ("10.1.0.2", TERMINATING))
    draining = [Endpoint("http://10.1.0.1:8000", True), Endpoint("http://10.1.0.2:8000", False)]
    assert seen_within(access, namespace, draining, 2.0)

    cluster.kubectl("delete", "endpointslice", f"{SERVICE}-a", "-n", namespace)
    assert seen_within(access, namespace, [], 2.0)


def test_without_rights_the_error_names_the_service(
    cluster: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    cluster.kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    access = pod_files(cluster, namespace, "nobody", tmp_path / "serviceaccount")
    discovery = EndpointSliceDiscovery(access, f"{SERVICE}.{namespace}.svc:8000")
    with pytest.raises(
        RuntimeError, match=f"EndpointSlices of Service {namespace}/{SERVICE} answered 403"
    ):
        asyncio.run(discovery.endpoints())


@pytest.fixture
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from phasefleet.engine.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny", arch="llama", seed=0)


def host_address() -> str | None:
    """A non-loopback IPv4 address of this machine (slices refuse 127.0.0.0/8), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))  # UDP: picks a route, sends nothing
        except OSError:
            return None
        address = str(sock.getsockname()[0])
    return None if address.startswith("127.") else address


@pytest.fixture
def worker(tiny_model: Path) -> Iterator[Any]:
    from tests.server.worker_proc import run_worker

    if host_address() is None:
        pytest.skip("no non-loopback IPv4 address to list in an EndpointSlice")
    with run_worker(tiny_model, "--host", "0.0.0.0") as w:
        yield w


def test_a_request_reaches_a_worker_found_through_its_slice(
    cluster: ControlPlane, namespace: str, access: KubeAccess, worker: Any
) -> None:
    import httpx
    import uvicorn

    from phasefleet.router.app import build_app
    from phasefleet.router.config import RouterConfig
    from phasefleet.router.dispatch import Router
    from phasefleet.router.metrics import RouterMetrics
    from phasefleet.router.pool import WorkerPool
    from phasefleet.router.upstream import Upstream
    from tests.server.worker_proc import free_port

    address = str(host_address())
    slice_ = endpoint_slice(f"{SERVICE}-a", worker.port, [(address, READY)])
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=slice_)
    upstream = Upstream()
    discovery = EndpointSliceDiscovery(access, f"{SERVICE}.{namespace}.svc:8000")
    pool = WorkerPool("worker", discovery, upstream)
    router = Router(
        RouterConfig("tiny", "least-loaded"), {"worker": pool}, upstream, RouterMetrics("tiny")
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(router), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/health").json()["ready_workers"] == {"worker": 1}
        answer = httpx.post(
            f"{base}/v1/completions",
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 4},
            timeout=60,
        )
        assert answer.status_code == 200
        assert answer.json()["usage"]["completion_tokens"] == 4
        # The worker turns terminating: no new requests, and the 503 names the slices.
        terminating = endpoint_slice(f"{SERVICE}-a", worker.port, [(address, TERMINATING)])
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=terminating)
        deadline = time.monotonic() + 2 * REFRESH + 1
        while httpx.get(f"{base}/health").json()["ready_workers"] != {"worker": 0}:
            assert time.monotonic() < deadline, "the router did not see the change in time"
            time.sleep(0.1)
        refused = httpx.post(
            f"{base}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        )
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == (
            f"no ready worker in pool 'worker' (EndpointSlices of Service {namespace}/{SERVICE})"
        )
    finally:
        server.should_exit = True
        thread.join(timeout=30)
