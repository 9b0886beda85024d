"""PhaseFleet on the control plane, for the e2e tests and bench/operator_scale.py: the chart
installed, the operator run, and InferenceServices read back.

The chart is installed with replicaCount=0 (pods on KWOK nodes run nothing), and the operator
runs here as a `phasefleet operator` process authenticated as the chart's ServiceAccount, so
the chart's RBAC is what the operator gets.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

from e2e.harness.chart import CHART
from e2e.harness.controlplane import ControlPlane
from e2e.harness.process import Component, free_port
from e2e.harness.wait import wait_for

RELEASE = "pf"
SYSTEM_NAMESPACE = "phasefleet-system"
SERVICE_ACCOUNT = f"{RELEASE}-phasefleet"


def install_chart(cluster: ControlPlane, *set_args: str) -> None:
    """helm install (or upgrade) the chart as release `pf`, the operator Deployment at 0."""
    sets = ["--set", "replicaCount=0", *(a for s in set_args for a in ("--set", s))]
    cluster.helm(
        "upgrade", "--install", RELEASE, str(CHART), "--namespace", SYSTEM_NAMESPACE,
        "--create-namespace", "--wait", "--timeout", "120s", *sets,
    )  # fmt: skip
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/inferenceservices.serving.phasefleet.dev"
    )


def service_account_kubeconfig(
    cluster: ControlPlane,
    path: Path,
    account: str = SERVICE_ACCOUNT,
    namespace: str = SYSTEM_NAMESPACE,
) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount."""
    token = cluster.kubectl(
        "create", "token", account, "-n", namespace, "--duration", "3h"
    ).stdout.strip()
    config = json.loads(cluster.kubeconfig.read_text())
    config["users"] = [{"name": "admin", "user": {"token": token}}]
    path.write_text(json.dumps(config))
    path.chmod(0o600)
    return path


class Operator:
    """`phasefleet operator` as a child process."""

    def __init__(self, cluster: ControlPlane, kubeconfig: Path, workdir: Path, *args: str):
        self.port = free_port()
        env = {**cluster.env, "KUBECONFIG": str(kubeconfig), "PHASEFLEET_WATCH_NAMESPACES": ""}
        argv = [
            sys.executable, "-m", "phasefleet.cli", "operator",
            "--liveness", f"http://127.0.0.1:{self.port}/healthz", *args,
        ]  # fmt: skip
        self.component = Component("operator", argv, workdir / "operator.log", env=env)

    def start(self, timeout: float = 60) -> None:
        self.component.start()
        wait_for(self.healthy, timeout, "operator liveness endpoint")

    def healthy(self) -> bool:
        self.component.check_alive()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        self.component.stop(grace_seconds=15)

    def rss_mib(self) -> float:
        pid = self.component.pid
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.component.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmHWM")

    def log(self) -> str:
        return self.component.log_path.read_text(errors="replace")


def get(cluster: ControlPlane, *args: str) -> Any:
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def condition(isvc: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for cond in ((isvc or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return dict(cond)
    return {}


def is_ready(cluster: ControlPlane, namespace: str, name: str) -> bool:
    isvc = get(cluster, "inferenceservice", name, "-n", namespace)
    return condition(isvc, "Ready").get("status") == "True"


def can_i(cluster: ControlPlane, user: str, *args: str) -> bool:
    """`kubectl auth can-i --as user ...`: what the API server's RBAC allows that user."""
    result = cluster.kubectl("auth", "can-i", "--as", user, *args, check=False)
    return result.stdout.strip() == "yes"
