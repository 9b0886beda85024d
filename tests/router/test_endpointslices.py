"""EndpointSlice objects to endpoints, the Service address, and the in-cluster settings (pure
parts; e2e/test_router_discovery.py reads real slices from a real API server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from phasefleet.router.discovery import Endpoint
from phasefleet.router.endpointslices import KubeAccess, endpoints_from_slices, service_of


def endpoint(ip: str, **conditions: bool) -> dict[str, Any]:
    return {"addresses": [ip], "conditions": conditions}


def test_ready_and_terminating_endpoints() -> None:
    slices = [
        {
            "addressType": "IPv4",
            "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
            "endpoints": [
                endpoint("10.0.0.1", ready=True, serving=True, terminating=False),
                endpoint("10.0.0.2", ready=False, serving=True, terminating=True),
                endpoint("10.0.0.3", ready=False),
                endpoint("10.0.0.4"),  # no conditions: ready, as the API says
                {"addresses": []},
            ],
        },
        {"addressType": "FQDN", "endpoints": [endpoint("example.com", ready=True)]},
        {"addressType": "IPv6", "endpoints": [endpoint("fd00::5", ready=True)]},
    ]
    assert endpoints_from_slices(slices, default_port=8080) == [
        Endpoint("http://10.0.0.1:8000", ready=True),
        Endpoint("http://10.0.0.2:8000", ready=False),
        Endpoint("http://10.0.0.3:8000", ready=False),
        Endpoint("http://10.0.0.4:8000", ready=True),
        Endpoint("http://[fd00::5]:8080", ready=True),
    ]


def test_a_pod_in_two_slices_is_ready_if_either_says_so() -> None:
    old = {"addressType": "IPv4", "endpoints": [endpoint("10.0.0.1", ready=False)]}
    new = {"addressType": "IPv4", "endpoints": [endpoint("10.0.0.1", ready=True)]}
    assert endpoints_from_slices([old, new], 8000) == [Endpoint("http://10.0.0.1:8000", True)]


def test_service_of_an_address() -> None:
    assert service_of("llm-worker.team-a.svc:8000", "x") == ("team-a", "llm-worker", 8000)
    assert service_of("llm-decode.b.svc.cluster.local:9", "x") == ("b", "llm-decode", 9)
    assert service_of("llm-worker:8000", "mine") == ("mine", "llm-worker", 8000)


def test_in_cluster_settings(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert KubeAccess.in_cluster(tmp_path, env) is None  # no token mounted
    (tmp_path / "token").write_text("t")
    (tmp_path / "namespace").write_text("team-a\n")
    access = KubeAccess.in_cluster(tmp_path, env)
    assert access == KubeAccess(
        "https://10.96.0.1:443", tmp_path / "token", tmp_path / "ca.crt", "team-a"
    )
    assert KubeAccess.in_cluster(tmp_path, {}) is None  # not in a pod
    v6 = KubeAccess.in_cluster(tmp_path, {**env, "KUBERNETES_SERVICE_HOST": "fd00::1"})
    assert v6 is not None and v6.server == "https://[fd00::1]:443"


def test_endpointslices_discovery_without_a_token_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from phasefleet.cli import build_parser
    from phasefleet.router.cli import run

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    args = build_parser().parse_args(
        ["router", "--served-model-name", "m", "--worker-service", "s.ns.svc:8000",
         "--discovery", "endpointslices"]
    )  # fmt: skip
    assert run(args) == 2
    assert "ServiceAccount token" in capsys.readouterr().err
