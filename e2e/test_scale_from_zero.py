"""Scale to zero and back on a real control plane, with the pods run as local processes.

An aggregated tiny-model service whose worker pool has minReplicas 0, autoscaled every 2 s with
metrics scraped from the pods, a 10 s idle window and the router holding requests up to 120 s:

1. it idles to zero worker pods; status.scale says ScaledToZero and Ready stays True;
2. one request arrives: the router holds it, the autoscaler sees the held gauge and wakes the
   pool, and the answer comes in full once the pod has started; 20 more requests sent while the
   pool wakes are all answered in full; none is lost;
3. with no more requests it idles back to zero after the window.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import yaml

from e2e.harness.controlplane import ControlPlane
from e2e.harness.phasefleet_operator import Operator, condition, get, is_ready
from e2e.harness.serving import AGGREGATED, PLANS, pods, ready_ips, ship_linear_plans
from e2e.harness.wait import wait_for
from phasefleet.api.contract import CPU_LINEAR_CACHE_ENV, ROUTER_PORT

NAME = "tiny-agg"
IDLE_S = 10  # scaleToZeroAfterSeconds
MAX_TOKENS = 8
WAKE_REQUESTS = 20


def scale_to_zero_service() -> dict[str, Any]:
    body = yaml.safe_load(AGGREGATED.read_text())
    spec = body["spec"]
    spec["worker"].update(replicas=1, minReplicas=0, maxReplicas=1)
    spec["runtime"] = {"env": [{"name": CPU_LINEAR_CACHE_ENV, "value": f"/{PLANS}"}]}
    spec["router"]["holdSeconds"] = 120
    spec["autoscaling"] = {
        "enabled": True, "intervalSeconds": 2, "signalWindowSeconds": 10,
        "scaleToZeroAfterSeconds": IDLE_S,
        "scaleDownStabilizationSeconds": 0,
    }  # fmt: skip
    return dict(body)


def worker_pods(cluster: ControlPlane, namespace: str) -> list[dict[str, Any]]:
    return pods(cluster, namespace, "worker")


def scale(cluster: ControlPlane, namespace: str) -> str | None:
    isvc = get(cluster, "inferenceservice", NAME, "-n", namespace)
    return ((isvc or {}).get("status") or {}).get("scale")


def at_zero(cluster: ControlPlane, namespace: str) -> bool:
    return not worker_pods(cluster, namespace) and scale(cluster, namespace) == "ScaledToZero"


def ask(ip: str, i: int) -> httpx.Response:
    body = {
        "model": "tiny", "prompt": f"Wake up {i}", "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True,
    }  # fmt: skip
    return httpx.post(f"http://{ip}:{ROUTER_PORT}/v1/completions", json=body, timeout=180)


def answered_in_full(answer: httpx.Response) -> bool:
    return (
        answer.status_code == 200
        and answer.json()["usage"]["completion_tokens"] == MAX_TOKENS
        and answer.json()["choices"][0]["finish_reason"] == "length"
    )


def test_a_service_idles_to_zero_wakes_for_requests_and_idles_back(
    cluster: ControlPlane, operator: Operator, run_namespace: str, image_model: str
) -> None:
    def wait(predicate: Callable[[], Any], timeout: float, what: str) -> None:
        try:
            wait_for(predicate, timeout, what)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\noperator log tail:\n{operator.log()[-5000:]}") from None

    ship_linear_plans(cluster)
    manifest = yaml.safe_dump(scale_to_zero_service())
    cluster.kubectl("apply", "-n", run_namespace, "-f", "-", input=manifest)
    wait(lambda: is_ready(cluster, run_namespace, NAME), 360, f"{NAME} Ready")

    # 1. idle: down to zero worker pods, still Ready
    wait(lambda: at_zero(cluster, run_namespace), 120, "the worker pool at zero")
    isvc = get(cluster, "inferenceservice", NAME, "-n", run_namespace)
    assert condition(isvc, "Ready")["status"] == "True", isvc["status"]
    assert "worker scaled to 0" in condition(isvc, "Ready")["message"]
    table = cluster.kubectl("get", "inferenceservices", "-n", run_namespace).stdout
    assert "ScaledToZero" in table, table
    (ip,) = ready_ips(cluster, run_namespace, "router")

    # 2. one request wakes the pool; 20 more arrive while it wakes; all are answered in full
    with ThreadPoolExecutor(max_workers=WAKE_REQUESTS + 1) as threads:
        first = threads.submit(ask, ip, 0)
        wait_for(lambda: bool(worker_pods(cluster, run_namespace)), 60, "a worker pod created")
        during = [threads.submit(ask, ip, i) for i in range(1, WAKE_REQUESTS + 1)]
        answers = [first.result(), *(f.result() for f in during)]
    lost = [(a.status_code, a.text[:200]) for a in answers if not answered_in_full(a)]
    assert not lost, lost
    log = operator.log()
    assert "the router holds" in log and "(wake from zero)" in log

    # 3. no more requests: back to zero after the window
    wait(lambda: at_zero(cluster, run_namespace), 120, "the worker pool back at zero")
    assert "no request for" in operator.log()
