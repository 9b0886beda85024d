"""Every panel of the chart's dashboard shows data for a live service.

The operator runs a tiny aggregated InferenceService (one worker, one router) whose pods the pod
runner runs as processes. A real Prometheus finds them through Kubernetes pod discovery (the
harness's podsd.py) and scrapes them every second with the chart's own PodMonitor relabelings
(namespace, pod, and inferenceservice and pool from the pods' labels). While requests flow
through the router, each query of the dashboard as the chart's ConfigMap ships it, with the
template variables filled in as Grafana would, must return a finite value. The replicas panel's
kube-state-metrics queries must parse but find nothing: the e2e cluster runs no
kube-state-metrics; the panel's own PhaseFleet query carries its data. The chart's alert
expressions run on the same series: the SLIs are ratios, and no other alert condition holds.
The worker drafts tokens by prompt lookup, so the speculative decoding panel has data too.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable
from contextlib import closing
from typing import Any

import openai
import pytest
import yaml

from e2e.harness.chart import pod_monitor_scrape_config, rendered_dashboard, rule_groups
from e2e.harness.controlplane import ControlPlane
from e2e.harness.kubeapi import KubeApi
from e2e.harness.phasefleet_operator import Operator, is_ready
from e2e.harness.podsd import PodDiscovery
from e2e.harness.prometheus import Prometheus
from e2e.harness.serving import PLANS, ship_linear_plans
from e2e.harness.wait import wait_for
from phasefleet.api.contract import CPU_LINEAR_CACHE_ENV, ROUTER_PORT, ROUTER_ROLE
from phasefleet.api.dashboard import KSM_METRICS

NAME = "dash"
RATE_INTERVAL = "10s"  # Grafana's $__rate_interval for a 1 s scrape at a 10 s step, about
SHARED_PREFIX = "Answer briefly and in plain words, as a careful assistant would. " * 3


def service(image_model: str) -> dict[str, Any]:
    return {
        "apiVersion": "serving.phasefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {
                "image": {"path": image_model},
                "servedName": "tiny",
                "maxModelLen": 512,
                "dtype": "float32",
            },
            "mode": "aggregated",
            "runtime": {
                "env": [{"name": CPU_LINEAR_CACHE_ENV, "value": f"/{PLANS}"}],
                # drafts from a one-token match: the random tiny model repeats no longer n-gram
                "numSpeculativeTokens": 4,
                "extraArgs": ["--prompt-lookup-min", "1"],
            },
            "worker": {"replicas": 1, "maxNumSeqs": 8},
            "router": {"replicas": 1},
        },
    }


class Load:
    """Streaming completions through the router from a few threads until stopped."""

    def __init__(self, router_ip: str, threads: int = 3) -> None:
        self.client = openai.OpenAI(
            base_url=f"http://{router_ip}:{ROUTER_PORT}/v1",
            api_key="unused",
            max_retries=0,
            timeout=60,
        )
        self.done = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                stream = self.client.completions.create(
                    model="tiny",
                    prompt=f"{SHARED_PREFIX}Question {index}.{i}: what comes next?",
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for _ in stream:
                    pass
                self.done += 1
            except (openai.OpenAIError, OSError) as exc:
                self.errors.append(exc)
                return
            i += 1

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)


def fill(expr: str, variables: dict[str, str]) -> str:
    """The query Grafana sends: its variables replaced ($name and ${name})."""
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    assert "$" not in expr, expr
    return expr


def finite(result: list[dict[str, Any]]) -> list[float]:
    return [v for v in (float(s["value"][1]) for s in result) if math.isfinite(v)]


@pytest.fixture
def live_service(
    cluster: ControlPlane, operator: Operator, run_namespace: str, image_model: str
) -> str:
    """The service, Ready, in a run namespace (deleted with it); returns the namespace."""
    manifest = yaml.safe_dump(service(image_model))
    ship_linear_plans(cluster)
    cluster.kubectl("apply", "-n", run_namespace, "-f", "-", input=manifest)
    try:
        wait_for(lambda: is_ready(cluster, run_namespace, NAME), 360, f"{NAME} Ready")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\noperator log tail:\n{operator.log()[-3000:]}") from None
    return run_namespace


def test_every_panel_has_data_while_requests_flow(
    cluster: ControlPlane,
    live_service: str,
    start_prometheus: Callable[[list[dict[str, Any]]], Prometheus],
) -> None:
    namespace = live_service
    discovery = PodDiscovery(KubeApi.from_kubeconfig(cluster.kubeconfig), [namespace])
    discovery.start()
    with closing(discovery):
        prometheus = start_prometheus([pod_monitor_scrape_config(discovery.url)])
        check_live_service(prometheus, namespace)


def check_live_service(prometheus: Prometheus, namespace: str) -> None:
    targets = f'up{{namespace="{namespace}", inferenceservice="{NAME}"}} == 1'
    wait_for(lambda: len(prometheus.query(targets)) == 2, 60, "the worker and router scraped")
    pools = {r["metric"]["pool"]: r["metric"]["instance"] for r in prometheus.query(targets)}
    assert set(pools) == {"router", "worker"}
    dashboard = rendered_dashboard()
    variables = {"namespace": namespace, "inferenceservice": NAME}
    variables["__rate_interval"] = RATE_INTERVAL
    for var in dashboard["templating"]["list"]:
        if var["type"] == "constant":
            variables[var["name"]] = var["query"]
    request_rate = fill(
        next(p for p in dashboard["panels"] if p["title"] == "Requests")["targets"][0]["expr"],
        variables,
    )
    load = Load(pools[ROUTER_ROLE].rsplit(":", 1)[0])
    try:
        wait_for(lambda: any(v > 0 for v in finite(prometheus.query(request_rate))), 60, "traffic")
        time.sleep(3)  # a few more scrapes with traffic in every rate window
        empty = check_panels(prometheus, dashboard, variables)
        check_alert_expressions(prometheus, namespace)
    finally:
        load.stop()
    assert not load.errors, load.errors[:3]
    assert load.done > 0
    assert empty == {
        ("Replicas per pool", f"max by (deployment) ({metric}") for metric in KSM_METRICS
    }


def check_panels(
    prometheus: Prometheus, dashboard: dict[str, Any], variables: dict[str, str]
) -> set[tuple[str, str]]:
    """Runs every panel's queries; returns the (panel, query start) of those with no data,
    after checking each panel has some and the counts and rates are what the load gives."""
    empty = set()
    values: dict[str, list[list[float]]] = {}
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        per_target = []
        for target in panel["targets"]:
            expr = fill(target["expr"], variables)
            found = finite(prometheus.query(expr))
            if not found:
                empty.add((panel["title"], re.split(r"\{", expr)[0]))
            per_target.append(found)
        assert any(per_target), f"panel {panel['title']!r} has no data"
        values[panel["title"]] = per_target
    ttft = values["Time to first token"]
    assert all(len(q) == 1 and q[0] > 0 for q in ttft[:3]) and ttft[0][0] <= ttft[2][0]
    assert values["Requests"][0][0] > 0
    drafted, accepted_share = values["Speculative decoding"]
    assert drafted[0] > 0 and 0 <= accepted_share[0] <= 1
    prompt, generated = values["Tokens"]
    assert prompt[0] > 0 and generated[0] > 0
    sli = values["Requests within the SLO targets"]
    assert all(0 <= q[0] <= 1 for q in sli[:2]) and sli[2] == [0.99]
    reporting = values["Replicas per pool"][2]
    assert sorted(reporting) == [1.0, 1.0]  # the worker and the router
    usage, peak = values["KV cache usage per pod"]  # now, and the pod's 30 s peak
    assert len(usage) == len(peak) == 1 and 0 <= usage[0] <= peak[0] <= 1 and peak[0] > 0
    return empty


def check_alert_expressions(prometheus: Prometheus, namespace: str) -> None:
    """The chart's rules on live series: each SLI ratio has one sample for the service in
    [0, 1]; the burn alerts' conditions evaluate (with the recorded ratios inlined, as this
    Prometheus loads no rules); the other alerts' conditions do not hold for a healthy service,
    so the absent-metrics join matches a live pod's series to its target."""
    service = {"namespace": namespace, "inferenceservice": NAME}
    rules = [r for g in rule_groups() for r in g["rules"]]
    records = {r["record"]: r["expr"] for r in rules if "record" in r}
    for rule in rules:
        expr = rule["expr"]
        for name, recorded in records.items():
            expr = re.sub(rf"{re.escape(name)}\b", f"({recorded})", expr)
        result = prometheus.query(expr)
        mine = [r for r in result if all(r["metric"].get(k) == v for k, v in service.items())]
        if "record" in rule:
            (sample,) = mine
            assert 0 <= float(sample["value"][1]) <= 1, rule["record"]
        elif "slo" not in rule["labels"]:
            assert mine == [], (rule["alert"], mine)
