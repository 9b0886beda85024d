"""The harness itself: a second control plane starts, is reachable, and leaves no process or
directory behind; the real Prometheus server scrapes the API server."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from e2e.harness.controlplane import ControlPlane, tools_bin_dir
from e2e.harness.process import process_group_alive
from e2e.harness.prometheus import Prometheus


def test_second_cluster_tears_down_without_strays() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="phasefleet-e2e-teardown-"))
    plane = ControlPlane(workdir=workdir, bin_dir=tools_bin_dir())
    try:
        plane.start()
        pids = plane.pids()
        assert len(pids) == 6  # etcd, apiserver, controller-manager, scheduler, kwok, pod runner
        nodes = plane.get_json("nodes")["items"]
        assert len(nodes) == 3
    finally:
        plane.destroy()
    assert not workdir.exists()
    assert [pid for pid in pids if process_group_alive(pid)] == []
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie_free(pid)


def _is_zombie_free(pid: int) -> bool:
    # A reaped pid may be reused by an unrelated process: only our own children matter.
    status = Path(f"/proc/{pid}/status").read_text()
    return f"PPid:\t{os.getpid()}" not in status


def test_prometheus_scrapes_the_api_server(
    cluster: ControlPlane, start_prometheus: Callable[[list[dict]], Prometheus]
) -> None:
    server = start_prometheus(
        [
            {
                "job_name": "apiserver",
                "scheme": "https",
                "static_configs": [{"targets": [cluster.server.removeprefix("https://")]}],
                "authorization": {"credentials": cluster.token},
                "tls_config": {"ca_file": str(cluster.workdir / "pki/ca.crt")},
            }
        ]
    )
    deadline = time.monotonic() + 30
    result: list[dict] = []
    while time.monotonic() < deadline:
        result = server.query('up{job="apiserver"}')
        if result and result[0]["value"][1] == "1":
            break
        time.sleep(0.5)
    assert result and result[0]["value"][1] == "1", result
    requests = server.query('sum(apiserver_request_total{job="apiserver"})')
    assert float(requests[0]["value"][1]) > 0
