"""Serving on the control plane: the tiny examples, their pods and their router, and the CPU
linear plans the worker pods find "in the image"."""

from __future__ import annotations

import shutil
from typing import Any

import httpx
import openai

from e2e.harness.chart import ROOT
from e2e.harness.controlplane import ControlPlane
from e2e.harness.phasefleet_operator import get
from e2e.harness.wait import wait_for
from phasefleet.api.contract import ROUTER_PORT
from phasefleet.engine.models.linear_plan import DEFAULT_CACHE_FILE

AGGREGATED = ROOT / "examples" / "tiny-aggregated.yaml"
DISAGGREGATED = ROOT / "examples" / "tiny-disaggregated.yaml"
API_KEYS = ROOT / "examples" / "api-keys.yaml"
PLANS = "plans/cpu_linear_plans.json"


def pods(cluster: ControlPlane, namespace: str, role: str) -> list[dict[str, Any]]:
    found = get(cluster, "pods", "-n", namespace, "-l", f"phasefleet.dev/role={role}")
    return list((found or {}).get("items", []))


def ready_ips(cluster: ControlPlane, namespace: str, role: str) -> list[str]:
    """Pod IPs of the role's pods that are Ready and not terminating."""
    return sorted(
        p["status"]["podIP"]
        for p in pods(cluster, namespace, role)
        if not p["metadata"].get("deletionTimestamp")
        and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions") or []
        )
    )


def client(ip: str, port: int, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{ip}:{port}/v1", api_key=api_key, max_retries=0, timeout=120
    )


def wait_router_sees(ip: str, ready: dict[str, int]) -> None:
    def sees() -> bool:
        health = httpx.get(f"http://{ip}:{ROUTER_PORT}/health", timeout=5).json()
        return bool(health["ready_workers"] == ready)

    wait_for(sees, 30, f"router at {ip} to see {ready} ready workers")


def ship_linear_plans(cluster: ControlPlane) -> None:
    """Puts this machine's CPU linear plans "in the image": a worker pod otherwise times its
    linears at every start (its HOME is an emptyDir), which takes minutes on a busy 2-core
    machine; plans for another CPU or torch are keyed apart and not used."""
    shipped = cluster.image_root / PLANS
    shipped.parent.mkdir(parents=True, exist_ok=True)
    if DEFAULT_CACHE_FILE.is_file() and not shipped.exists():
        shutil.copyfile(DEFAULT_CACHE_FILE, shipped)
