"""The autoscaler's closed loop on a real control plane.

The operator runs as the chart's ServiceAccount with the chart's `prometheus.url` pointing at a
real Prometheus, which finds the service's pods through Kubernetes pod discovery (the harness's
podsd.py, over HTTP SD: Debian's Prometheus lacks `kubernetes_sd_configs`) and labels their
samples with the chart's own PodMonitor relabelings. The pods run as local processes (the
pod runner). One disaggregated tiny-model service, autoscaled every 3 s with a 1 ms TTFT target
and a GPU budget of 3 (each worker asks for one fake GPU), goes through:

1. a burst of streams: TTFT is far over target, prefill grows 1 -> 2, the new pod starts and
   joins the router, and the next ask (3) is refused: the budget binds, ScalingLimited; decode
   (KV under target, no TPOT target) stays at 1. The operator's next apply of that Deployment
   leaves the autoscaler's replicas alone (managedFields).
2. the burst stops, the SLO is relaxed to 60 s (with a 1 ms target every request is over it
   and no pool would ever shrink) and light stream traffic keeps running; Prometheus is stopped:
   MetricsAvailable=False with PrometheusUnreachable, and prefill holds at 2 past the time it
   would otherwise have shrunk.
3. Prometheus is back: after the scale-down window prefill shrinks to 1, removing the pod the
   autoscaler marked with pod-deletion-cost, while streams keep running; none is lost.
4. autoscaling is turned off: the operator owns the replicas again, the autoscaler's status
   and kopf's finalizer are gone.
Each decision is checked in `kubectl get`, `kubectl describe` (Events) and the operator log.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e.harness.chart import pod_monitor_scrape_config
from e2e.harness.controlplane import ControlPlane
from e2e.harness.kubeapi import KubeApi
from e2e.harness.phasefleet_operator import (
    RELEASE,
    SYSTEM_NAMESPACE,
    Operator,
    condition,
    get,
    install_chart,
    is_ready,
    service_account_kubeconfig,
)
from e2e.harness.podsd import PodDiscovery
from e2e.harness.process import free_port
from e2e.harness.prometheus import Prometheus
from e2e.harness.serving import (
    DISAGGREGATED,
    PLANS,
    client,
    pods,
    ready_ips,
    ship_linear_plans,
    wait_router_sees,
)
from e2e.harness.wait import wait_for
from phasefleet.api.contract import CPU_LINEAR_CACHE_ENV, ROUTER_PORT, Metric
from phasefleet.operator.meta import AUTOSCALER_FIELD_MANAGER, FIELD_MANAGER
from phasefleet.operator.pool_scaling import DELETION_COST_ANNOTATION, REMOVE_FIRST_COST

NAME = "tiny"
INTERVAL_S = 3
WINDOW_S = 15  # scaleDownStabilizationSeconds
SIGNAL_WINDOW_S = 10  # signalWindowSeconds: the rates' and quantiles' window
GPU = {
    "limits": {"nvidia.com/gpu": 1, "memory": "2Gi"},
    "requests": {"cpu": "500m", "memory": "1Gi"},
}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
METRICS_PORT = free_port()  # the operator's own /metrics


def operator_metric(name: str, ns: str, pool: str | None = None) -> float | None:
    """A series of the operator's /metrics for this service (and pool); None when absent."""
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5).text
    want = {"namespace": ns, "inferenceservice": NAME, **({"pool": pool} if pool else {})}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == want:
                return float(sample.value)
    return None


def autoscaled_service() -> dict[str, Any]:
    """The disaggregated example, autoscaled: 1 ms TTFT target, 3 GPUs for 2 pools of 1..3."""
    body = yaml.safe_load(DISAGGREGATED.read_text())
    spec = body["spec"]
    spec["runtime"] = {
        "remotePrefillMinTokens": 0,  # every prompt is prefilled by the prefill pool
        # the test relaxes slo.ttftMs mid-run: with the router carrying it (late prompts last)
        # that would roll the router pod it streams through
        "latePromptsLast": False,
        # a plans file "in the image", shared
        "env": [{"name": CPU_LINEAR_CACHE_ENV, "value": f"/{PLANS}"}],
    }
    for pool in ("prefill", "decode"):
        spec[pool] = {
            "replicas": 1, "minReplicas": 1, "maxReplicas": 3,
            "resources": GPU, "tolerations": [GPU_TOLERATION],
            "terminationGracePeriodSeconds": 30,
        }  # fmt: skip
    spec["slo"] = {"ttftMs": 1, "percentile": 0.9}
    spec["autoscaling"] = {
        "enabled": True, "intervalSeconds": INTERVAL_S, "signalWindowSeconds": SIGNAL_WINDOW_S,
        "scaleDownStabilizationSeconds": WINDOW_S, "maxStep": 2, "gpuBudget": 3,
    }  # fmt: skip
    return dict(body)


@contextmanager
def operator_with_prometheus(cluster: ControlPlane, prometheus_url: str) -> Iterator[Operator]:
    """The chart installed with prometheus.url; the operator run with its ServiceAccount and the
    PHASEFLEET_PROMETHEUS_URL the chart's Deployment sets."""
    install_chart(cluster, f"prometheus.url={prometheus_url}")
    manifest = cluster.helm("get", "manifest", RELEASE, "-n", SYSTEM_NAMESPACE).stdout
    (deployment,) = [d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    assert env["PHASEFLEET_PROMETHEUS_URL"] == prometheus_url
    workdir = Path(tempfile.mkdtemp(prefix="phasefleet-operator-"))
    kubeconfig = service_account_kubeconfig(cluster, workdir / "kubeconfig")
    op = Operator(cluster, kubeconfig, workdir, "--metrics-port", str(METRICS_PORT))
    assert op.component.env is not None
    op.component.env["PHASEFLEET_PROMETHEUS_URL"] = env["PHASEFLEET_PROMETHEUS_URL"]
    op.start()
    try:
        yield op
    finally:
        op.stop()
        install_chart(cluster)  # back to the chart's defaults for the other modules


class Streams:
    """Threads that keep opening streams through the router until stopped; every stream's end
    (its finish_reason, or the exception) is kept."""

    def __init__(
        self, ip: str, threads: int, max_tokens: int, ignore_eos: bool, prompt_words: int
    ) -> None:
        self.ip, self.max_tokens, self.ignore_eos = ip, max_tokens, ignore_eos
        self.prompt_words = prompt_words
        self.stopping = threading.Event()
        self.ends: list[str | BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def _run(self, index: int) -> None:
        api = client(self.ip, ROUTER_PORT)
        n = 0
        while not self.stopping.is_set():
            n += 1
            try:
                # Distinct words per request: nothing comes from the prefix cache.
                words = (
                    f"w{(index * 31 + n * 7 + i) % 97} alpha" for i in range(self.prompt_words)
                )
                chunks = api.completions.create(
                    model="tiny", prompt=f"Request {index}-{n}: {' '.join(words)}", temperature=0,
                    max_tokens=self.max_tokens, stream=True,
                    extra_body={"ignore_eos": self.ignore_eos},
                )  # fmt: skip
                reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
                self.ends.append(str(reasons[-1]))
            except BaseException as exc:  # recorded, asserted by the test
                self.ends.append(exc)

    def stop(self, timeout: float = 180) -> list[str | BaseException]:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=timeout)
        return self.ends


def replicas(cluster: ControlPlane, namespace: str, role: str) -> int:
    deployment = get(cluster, "deployment", f"{NAME}-{role}", "-n", namespace)
    return int(deployment["spec"]["replicas"])


def replicas_owners(cluster: ControlPlane, namespace: str, role: str) -> set[str]:
    deployment = cluster.get_json(
        "deployment", f"{NAME}-{role}", "-n", namespace, "--show-managed-fields"
    )
    return {
        entry["manager"]
        for entry in deployment["metadata"].get("managedFields") or []
        if "f:replicas" in entry.get("fieldsV1", {}).get("f:spec", {})
    }


def status_condition(cluster: ControlPlane, namespace: str, type_: str) -> dict[str, Any]:
    return condition(get(cluster, "inferenceservice", NAME, "-n", namespace), type_)


def printed(cluster: ControlPlane, namespace: str) -> dict[str, str]:
    """`kubectl get inferenceservice` as printed: column -> value ("" where it shows none)."""
    header, row = cluster.kubectl("get", "inferenceservice", NAME, "-n", namespace).stdout.split(
        "\n"
    )[:2]
    names = header.split()
    starts = [
        header.index(f"{name} ") if name != names[-1] else header.rindex(name) for name in names
    ]
    ends = [*starts[1:], None]
    return {name: row[a:b].strip() for name, a, b in zip(names, starts, ends, strict=True)}


@pytest.mark.timeout(900)  # about 5 minutes on an idle machine; the CPU here is shared
def test_autoscaling_closed_loop(
    cluster: ControlPlane,
    run_namespace: str,
    image_model: str,
    start_prometheus: Callable[[list[dict[str, Any]]], Prometheus],
) -> None:
    ns = run_namespace
    ship_linear_plans(cluster)
    discovery = PodDiscovery(KubeApi.from_kubeconfig(cluster.kubeconfig), [ns])
    discovery.start()
    prometheus = start_prometheus([pod_monitor_scrape_config(discovery.url)])
    with closing(discovery), operator_with_prometheus(cluster, prometheus.url) as operator:
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(autoscaled_service()))
        try:
            closed_loop(cluster, ns, prometheus, operator)
        finally:  # with the operator up, so kopf lifts its finalizer
            cluster.kubectl("delete", "inferenceservice", NAME, "-n", ns, "--timeout=60s")


def closed_loop(cluster: ControlPlane, ns: str, prometheus: Prometheus, operator: Operator) -> None:
    wait_for(lambda: is_ready(cluster, ns, NAME), 420, f"{NAME} Ready")
    (router_ip,) = ready_ips(cluster, ns, "router")
    wait_router_sees(router_ip, {"prefill": 1, "decode": 1})
    assert status_condition(cluster, ns, "MetricsAvailable")  # the daemon runs

    # 1. A burst: prefill grows to what the GPU budget allows, decode does not move.
    # Long prompts (about 430 tokens), short answers: work for prefill, little for decode.
    burst = Streams(router_ip, threads=8, max_tokens=4, ignore_eos=False, prompt_words=60)
    try:
        wait_for(lambda: replicas(cluster, ns, "prefill") == 2, 90, "prefill scaled to 2")
        # a latency term asks for a quarter more at most: 1 -> 2, then, once both report, 3,
        # which the budget (3 GPUs, 1 of them decode's) does not allow
        wait_for(
            lambda: len(ready_ips(cluster, ns, "prefill")) == 2, 240, "the new prefill pod Ready"
        )
        wait_router_sees(router_ip, {"prefill": 2, "decode": 1})
        limited = wait_for(
            lambda: (
                (c := status_condition(cluster, ns, "ScalingLimited"))["status"] == "True" and c
            ),
            60,
            "ScalingLimited=True",
        )
        assert limited["reason"] == "LimitReached" and "gpuBudget 3 binds" in limited["message"]
        limited_series = partial(operator_metric, Metric.AUTOSCALER_SCALING_LIMITED, ns, "prefill")
        wait_for(lambda: limited_series() == 1, 10, "scaling_limited 1 on the operator's /metrics")
        assert operator_metric(Metric.AUTOSCALER_DESIRED_REPLICAS, ns, "prefill") == 2
        shown = wait_for(
            lambda: (row := printed(cluster, ns))["PREFILL"] == "2/2" and row, 30, "PREFILL 2/2"
        )
        assert float(shown["TTFT"]) > 1 and float(shown["KV"]) < 0.7, shown
        assert shown["DECODE"] == "1/1"
        check_operator_leaves_replicas(cluster, ns)
        assert replicas(cluster, ns, "prefill") == 2  # still capped by the budget
    finally:
        burst_ends = burst.stop()
    assert burst_ends and all(end in ("stop", "length") for end in burst_ends), burst_ends[:5]
    status = get(cluster, "inferenceservice", NAME, "-n", ns)["status"]
    reason = status["pools"]["prefill"]["lastScaleReason"]
    # whichever prefill signal crossed first explains it: TTFT p90, or the prompt backlog when
    # the decision came before Prometheus had a TTFT quantile for the burst
    assert reason.startswith("prefill 1->2: "), reason
    assert "TTFT p90" in reason or "prompt backlog" in reason, reason
    assert "lastScaleReason" not in status["pools"]["decode"]
    assert replicas(cluster, ns, "decode") == 1

    # 2. Light traffic within a relaxed SLO; Prometheus stops: no scale-down, and it says why.
    relaxed = '{"spec": {"slo": {"ttftMs": 60000}}}'
    cluster.kubectl("patch", "inferenceservice", NAME, "-n", ns, "--type=merge", "-p", relaxed)
    light = Streams(router_ip, threads=2, max_tokens=48, ignore_eos=True, prompt_words=2)
    try:
        prometheus.stop()
        down_since = time.monotonic()
        unavailable = wait_for(
            lambda: (
                (c := status_condition(cluster, ns, "MetricsAvailable"))["status"] == "False" and c
            ),
            30,
            "MetricsAvailable=False",
        )
        assert unavailable["reason"] == "PrometheusUnreachable"
        assert prometheus.url in unavailable["message"]
        available = partial(operator_metric, Metric.AUTOSCALER_METRICS_AVAILABLE, ns)
        wait_for(lambda: available() == 0, 10, "metrics_available 0 on the operator's /metrics")
        assert printed(cluster, ns)["TTFT"] == ""  # no stale numbers
        # Without the outage prefill would shrink one window after the burst's samples left
        # the signal window; it holds for longer than that.
        while time.monotonic() - down_since < SIGNAL_WINDOW_S + WINDOW_S + 2 * INTERVAL_S:
            assert replicas(cluster, ns, "prefill") == 2
            time.sleep(1)

        # 3. Prometheus is back: prefill shrinks after the window, removing the marked pod.
        prometheus.start()
        back = time.monotonic()
        wait_for(
            lambda: status_condition(cluster, ns, "MetricsAvailable")["status"] == "True",
            30,
            "MetricsAvailable=True again",
        )
        removed = wait_for(
            lambda: terminating_prefill(cluster, ns), 120, "a prefill pod being removed"
        )
        ended_before = len(light.ends)
        assert time.monotonic() - back >= WINDOW_S - INTERVAL_S  # not before the window
        annotations = removed["metadata"].get("annotations") or {}
        assert annotations.get(DELETION_COST_ANNOTATION) == REMOVE_FIRST_COST
        assert replicas(cluster, ns, "prefill") == 1
        wait_for(lambda: len(pods(cluster, ns, "prefill")) == 1, 120, "one prefill pod left")
        wait_for(partial(router_sees_prefill, router_ip, 1), 30, "the router sees 1 prefill")
        assert len(light.ends) > ended_before, "no stream ran while prefill shrank"
    finally:
        light_ends = light.stop()
    assert light_ends and all(end == "length" for end in light_ends), light_ends[:5]

    # 4. Autoscaling off: the operator takes spec.replicas back (even where the number is the
    # spec's already), and the autoscaler's status fields and kopf's finalizer go.
    off = '{"spec": {"autoscaling": {"enabled": false}}}'
    cluster.kubectl("patch", "inferenceservice", NAME, "-n", ns, "--type=merge", "-p", off)
    for role in ("prefill", "decode"):
        owned: Callable[[], bool] = partial(operator_owns_replicas, cluster, ns, role)
        wait_for(owned, 30, f"the operator owning {role} replicas again")
        assert replicas(cluster, ns, role) == 1  # the spec's number
    wait_for(
        lambda: not status_condition(cluster, ns, "MetricsAvailable"), 30, "autoscaler status gone"
    )
    isvc = get(cluster, "inferenceservice", NAME, "-n", ns)
    assert "metrics" not in isvc["status"] and not isvc["metadata"].get("finalizers")
    assert operator_metric(Metric.AUTOSCALER_DESIRED_REPLICAS, ns, "prefill") is None

    reasons = scale_events(cluster, ns)
    # the same two signals as the status's lastScaleReason above
    assert any(
        m.startswith("prefill 1->2: ") and ("TTFT p90" in m or "prompt backlog" in m)
        for m in reasons["ScaledUp"]
    ), reasons
    assert any(m.startswith("prefill 2->1:") for m in reasons["ScaledDown"]), reasons
    assert any("PrometheusUnreachable" in m for m in reasons["MetricsUnavailable"]), reasons
    describe = cluster.kubectl("describe", "inferenceservice", NAME, "-n", ns).stdout
    assert "ScaledUp" in describe and "ScaledDown" in describe
    log = operator.log()
    assert f"autoscaler {ns}/{NAME}: prefill 1->2: " in log
    assert f"autoscaler {ns}/{NAME}: holds prefill at 2, decode at" in log
    assert f"autoscaler {ns}/{NAME}: prefill 2->1:" in log
    assert "forbidden" not in log


def check_operator_leaves_replicas(cluster: ControlPlane, ns: str) -> None:
    """The autoscaler owns prefill's spec.replicas; an apply of that Deployment by the
    operator (it restores a field edited by hand) keeps the number and the ownership."""
    assert replicas_owners(cluster, ns, "prefill") == {AUTOSCALER_FIELD_MANAGER}
    deployment = get(cluster, "deployment", f"{NAME}-prefill", "-n", ns)
    deadline = deployment["spec"]["progressDeadlineSeconds"]
    edit = '{"spec": {"progressDeadlineSeconds": 1234}}'
    cluster.kubectl("patch", "deployment", f"{NAME}-prefill", "-n", ns, "--type=merge", "-p", edit)
    wait_for(
        lambda: (
            get(cluster, "deployment", f"{NAME}-prefill", "-n", ns)["spec"][
                "progressDeadlineSeconds"
            ]
            == deadline
        ),
        30,
        "the operator restoring the Deployment",
    )
    assert replicas(cluster, ns, "prefill") == 2
    owners = replicas_owners(cluster, ns, "prefill")
    assert owners == {AUTOSCALER_FIELD_MANAGER} and FIELD_MANAGER not in owners


def operator_owns_replicas(cluster: ControlPlane, ns: str, role: str) -> bool:
    return FIELD_MANAGER in replicas_owners(cluster, ns, role)


def router_sees_prefill(ip: str, count: int) -> bool:
    health = httpx.get(f"http://{ip}:{ROUTER_PORT}/health", timeout=5).json()
    return bool(health["ready_workers"].get("prefill") == count)


def terminating_prefill(cluster: ControlPlane, ns: str) -> dict[str, Any] | None:
    for pod in pods(cluster, ns, "prefill"):
        if pod["metadata"].get("deletionTimestamp"):
            return pod
    return None


def scale_events(cluster: ControlPlane, ns: str) -> dict[str, list[str]]:
    """Messages of the InferenceService's Events, by reason."""
    events = get(
        cluster, "events", "-n", ns,
        "--field-selector", f"involvedObject.kind=InferenceService,involvedObject.name={NAME}",
    )  # fmt: skip
    out: dict[str, list[str]] = {"ScaledUp": [], "ScaledDown": [], "MetricsUnavailable": []}
    for event in (events or {}).get("items", []):
        out.setdefault(event["reason"], []).append(event.get("message", ""))
    return out
