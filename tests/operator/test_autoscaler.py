"""The autoscaler's steps on an in-memory API with hand-made signals and the real policy: what it
applies (spec.replicas only, as its own field manager), how the operator's reconcile treats
that field afterwards, the status both write, pod deletion costs, Events."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, cast

from phasefleet.api.contract import ISVC_LABEL, ROLE_LABEL
from phasefleet.api.names import validate_service
from phasefleet.autoscale.policy import ScalingConfig
from phasefleet.autoscale.prometheus import PrometheusSource
from phasefleet.autoscale.report import Notice, metrics, summary
from phasefleet.autoscale.signals import MetricsUnavailable, PodLoad, PoolSignals, Signals
from phasefleet.operator.meta import AUTOSCALER_FIELD_MANAGER, FIELD_MANAGER, replicas_managers
from phasefleet.operator.pool_scaling import (
    DELETION_COST_ANNOTATION,
    REMOVE_FIRST_COST,
    mark_for_removal,
)
from phasefleet.operator.reconcile import reconcile
from phasefleet.operator.service_autoscaler import ServiceAutoscaler, rfc3339, scrape_targets
from tests.operator.factories import NAMESPACE, make_isvc
from tests.operator.fake_api import FakeApi

NOW = "2026-01-01T00:00:00Z"
T0 = 1_767_225_600.0  # NOW as seconds since the epoch
GPU_POOL = {
    "resources": {"limits": {"nvidia.com/gpu": 1}},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
}


class FakeSource:
    """Returns the signals (or raises the MetricsUnavailable) it was last given."""

    def __init__(self, reading: Signals | MetricsUnavailable) -> None:
        self.reading = reading

    def read(self, now: float) -> Signals:
        if isinstance(self.reading, MetricsUnavailable):
            raise self.reading
        return self.reading


def make_signals(
    now: float,
    ttft: float | None = 0.05,
    prefill: int = 1,
    decode: int = 1,
    decode_kv: float = 0.1,
    decode_pods: dict[str, PodLoad] | None = None,
) -> Signals:
    """`ttft` over the 100 ms target comes with a busy prefill pool and 27 s of prompt backlog
    (a load more replicas help: it asks for 1 x (1 + 27 / 12) -> 4, more than maxStep adds)."""
    slow = ttft is not None and ttft > 0.1
    busy, backlog = (0.9, 30_000) if slow else (0.1, 0)
    return Signals(
        sampled_at=now,
        window_s=12.0,
        pools={
            "prefill": PoolSignals(
                reporting=prefill,
                busy_fraction=busy,
                prefill_backlog_tokens=backlog,
                prompt_tokens_per_s=1000.0,
            ),
            "decode": PoolSignals(
                reporting=decode,
                kv_usage_sum=decode_kv * decode,
                running=1.0,
                waiting=0.0,
                pods=decode_pods or {},
            ),
        },
        ttft_s=ttft,
        request_rate=2.5,
    )


def make_pod(
    name: str,
    role: str,
    ready: bool = True,
    cost: str | None = None,
    started_in_s: float | None = None,  # creation to Ready, for the measured start-up
) -> dict[str, Any]:
    annotations = {DELETION_COST_ANNOTATION: cost} if cost is not None else {}
    ready_condition: dict[str, Any] = {"type": "Ready", "status": "True" if ready else "False"}
    metadata_times = {}
    if started_in_s is not None:
        metadata_times["creationTimestamp"] = rfc3339(T0 - 600)
        ready_condition["lastTransitionTime"] = rfc3339(T0 - 600 + started_in_s)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {ISVC_LABEL: "llm", ROLE_LABEL: role},
            "annotations": annotations,
            **metadata_times,
        },
        "status": {"podIP": f"10.1.0.{len(name)}", "conditions": [ready_condition]},
    }


def service(**overrides: Any) -> tuple[FakeApi, dict[str, Any]]:
    """An autoscaled service whose children the operator has created and whose pods are up."""
    spec: dict[str, Any] = {
        "prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
        "decode": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
        "slo": {"ttftMs": 100},
        "autoscaling": {"enabled": True, "intervalSeconds": 3, "maxStep": 2},
    }
    spec.update(overrides)
    api = FakeApi()
    body = api.add(make_isvc(**spec))
    reconcile(api, body, NOW)
    api.set_ready(NAMESPACE)
    reconcile(api, fresh(api), NOW)
    return api, fresh(api)


def fresh(api: FakeApi) -> dict[str, Any]:
    body = api.get("InferenceService", NAMESPACE, "llm")
    assert body is not None
    return body


def deployment(api: FakeApi, role: str) -> dict[str, Any]:
    return api.objects[("Deployment", NAMESPACE, f"llm-{role}")]


def conditions(api: FakeApi) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in fresh(api)["status"]["conditions"]}


def test_scale_up_applies_only_replicas_as_the_autoscaler_and_reports_it():
    api, _ = service()
    scaler = ServiceAutoscaler(api, NAMESPACE, "llm", source=FakeSource(make_signals(T0, 0.4)))
    step = scaler.step(T0)

    assert step.interval_s == 3.0 and step.status_written
    (scaled,) = [a for a in api.applies[-3:] if a == ("Deployment", "llm-prefill")]
    assert scaled and deployment(api, "prefill")["spec"]["replicas"] == 3  # 1 + maxStep 2
    assert replicas_managers(deployment(api, "prefill")) == {AUTOSCALER_FIELD_MANAGER}
    # The first step takes the field over in every pool, even one that keeps its size.
    assert deployment(api, "decode")["spec"]["replicas"] == 1
    assert AUTOSCALER_FIELD_MANAGER in replicas_managers(deployment(api, "decode"))

    reason = "prefill 1->3: prompt backlog 27.0 s > 0.05 s (TTFT p90 400 ms, target 100 ms)"
    assert step.notices == [Notice("Normal", "ScaledUp", reason)]
    status = fresh(api)["status"]
    assert status["pools"]["prefill"]["lastScaleReason"] == reason
    assert status["pools"]["prefill"]["lastScaleTime"] == rfc3339(T0) == NOW
    assert "lastScaleTime" not in status["pools"]["decode"]
    assert status["metrics"] == {"ttftMs": 400.0, "kvCacheUsage": 0.1, "requestRate": 2.5}
    assert conditions(api)["MetricsAvailable"]["status"] == "True"
    assert conditions(api)["ScalingLimited"]["status"] == "False"
    assert conditions(api)["Ready"]["status"] == "True"  # the operator's, untouched


def test_the_operators_reconcile_leaves_the_autoscalers_replicas_alone():
    api, _ = service()
    ServiceAutoscaler(api, NAMESPACE, "llm", source=FakeSource(make_signals(T0, 0.4))).step(T0)
    api.applies.clear()
    reconcile(api, fresh(api), NOW)
    assert ("Deployment", "llm-prefill") not in api.applies

    # A spec change that rolls the prefill pool: the Deployment is applied without replicas.
    body = fresh(api)
    body["spec"]["prefill"]["maxNumSeqs"] = 8
    api.objects[("InferenceService", NAMESPACE, "llm")]["spec"] = body["spec"]
    reconcile(api, fresh(api), NOW)
    assert ("Deployment", "llm-prefill") in api.applies
    assert deployment(api, "prefill")["spec"]["replicas"] == 3
    assert replicas_managers(deployment(api, "prefill")) == {AUTOSCALER_FIELD_MANAGER}
    assert "--max-num-seqs" in str(deployment(api, "prefill")["spec"]["template"])


def test_status_passes_of_operator_and_autoscaler_keep_each_others_fields():
    # The first ask is the pool's bound and no room is kept over it: the calm readings after it
    # change no size (burst memory would grow the pool to its peak ask, or over it).
    api, _ = service(
        prefill={"replicas": 1, "minReplicas": 1, "maxReplicas": 3},
        autoscaling={"enabled": True, "intervalSeconds": 3, "maxStep": 2, "peakHeadroom": 1},
    )
    source = FakeSource(make_signals(T0, 0.4))
    scaler = ServiceAutoscaler(api, NAMESPACE, "llm", source=source)
    scaler.step(T0)
    api.set_ready(NAMESPACE)  # the third prefill pod is up: the operator's status changes
    outcome = reconcile(api, fresh(api), NOW)
    assert outcome.status_written
    status = fresh(api)["status"]
    assert status["pools"]["prefill"]["desiredReplicas"] == 3  # the operator's field
    assert status["pools"]["prefill"]["lastScaleReason"].startswith("prefill 1->3")
    assert status["metrics"]["ttftMs"] == 400.0
    assert {"Ready", "MetricsAvailable", "ScalingLimited"} <= set(conditions(api))
    # Neither pass sees the other's fields as a change to write again.
    assert not reconcile(api, fresh(api), NOW).status_written
    source.reading = make_signals(T0 + 3, 0.05, prefill=3)
    assert scaler.step(T0 + 3).status_written  # new metrics
    source.reading = make_signals(T0 + 6, 0.05, prefill=3)
    api.writes.clear()
    assert not scaler.step(T0 + 6).status_written and api.writes == []
    assert fresh(api)["status"]["pools"]["prefill"]["lastScaleTime"] == NOW  # kept
    assert not reconcile(api, fresh(api), NOW).status_written


def test_missing_metrics_hold_every_pool_and_warn_once():
    api, _ = service()
    source = FakeSource(make_signals(T0, 0.05))
    scaler = ServiceAutoscaler(api, NAMESPACE, "llm", source=source)
    scaler.step(T0)
    assert "metrics" in fresh(api)["status"]

    source.reading = MetricsUnavailable(
        "PrometheusUnreachable", "Prometheus at http://p:9090 did not answer: check its url"
    )
    step = scaler.step(T0 + 3)
    assert step.decision is not None and not any(p.changed for p in step.decision.pools.values())
    cond = conditions(api)["MetricsAvailable"]
    assert cond["status"] == "False" and cond["reason"] == "PrometheusUnreachable"
    assert "did not answer" in cond["message"]
    assert "metrics" not in fresh(api)["status"]  # no stale numbers in `kubectl get`
    assert [(n.type, n.reason) for n in step.notices] == [("Warning", "MetricsUnavailable")]
    assert "PrometheusUnreachable" in step.notices[0].message
    assert scaler.step(T0 + 6).notices == []  # still False: no new Warning
    assert summary(step.decision) == (
        "holds prefill at 1, decode at 1: MetricsAvailable=False PrometheusUnreachable:"
        " Prometheus at http://p:9090 did not answer: check its url"
    )


def test_scale_down_marks_the_least_loaded_pod_first():
    api, _ = service(
        decode={"replicas": 3, "minReplicas": 1, "maxReplicas": 4},
        autoscaling={
            "enabled": True,
            "intervalSeconds": 3,
            "maxStep": 2,
            "scaleDownStabilizationSeconds": 0,
        },
    )
    for pod in (
        make_pod("d-busy", "decode", cost=REMOVE_FIRST_COST),  # marked by an earlier step
        make_pod("d-idle-kv-low", "decode"),
        make_pod("d-idle-kv-high", "decode"),
        make_pod("d-starting", "decode", ready=False),
    ):
        api.add(pod)
    loads = {
        "d-busy": PodLoad(running=5, kv_usage=0.1),
        "d-idle-kv-high": PodLoad(running=1, kv_usage=0.5),
        "d-idle-kv-low": PodLoad(running=1, kv_usage=0.2),
    }
    reading = make_signals(T0, decode=3, decode_kv=0.4, decode_pods=loads)  # 1.2 / 0.7 -> 2
    api.writes.clear()
    step = ServiceAutoscaler(api, NAMESPACE, "llm", source=FakeSource(reading)).step(T0)

    assert step.decision is not None and step.decision.pools["decode"].desired == 2
    assert deployment(api, "decode")["spec"]["replicas"] == 2
    costs = {
        name: (api.objects[("Pod", NAMESPACE, name)]["metadata"].get("annotations") or {}).get(
            DELETION_COST_ANNOTATION
        )
        for name in loads
    }
    assert costs == {"d-busy": None, "d-idle-kv-low": REMOVE_FIRST_COST, "d-idle-kv-high": None}
    marked = api.writes.index(("patch", "Pod", "d-idle-kv-low"))
    assert marked < api.writes.index(("apply", "Deployment", "llm-decode"))
    assert [n.reason for n in step.notices] == ["ScaledDown"]


def test_a_pod_gone_before_its_mark_is_skipped():
    api = FakeApi()
    pods = [make_pod("d-gone", "decode"), make_pod("d-old-mark", "decode", cost=REMOVE_FIRST_COST)]
    api.add(pods[1])
    mark_for_removal(api, NAMESPACE, pods, ["d-gone"])
    assert api.patches == [
        ("Pod", "d-old-mark", {"metadata": {"annotations": {DELETION_COST_ANNOTATION: None}}})
    ]


def test_gpu_budget_caps_growth_with_scaling_limited():
    api, _ = service(
        prefill={"replicas": 1, "minReplicas": 1, "maxReplicas": 4, **GPU_POOL},
        decode={"replicas": 1, "minReplicas": 1, "maxReplicas": 4, **GPU_POOL},
        autoscaling={"enabled": True, "intervalSeconds": 3, "maxStep": 2, "gpuBudget": 3},
    )
    scaler = ServiceAutoscaler(api, NAMESPACE, "llm", source=FakeSource(make_signals(T0, 0.4)))
    step = scaler.step(T0)
    assert deployment(api, "prefill")["spec"]["replicas"] == 2  # asked 3, 3 GPUs in all
    limited = conditions(api)["ScalingLimited"]
    assert limited["status"] == "True" and limited["reason"] == "LimitReached"
    assert "gpuBudget 3" in limited["message"]
    assert step.decision is not None and step.decision.scaling_limited == limited["message"]


def test_turning_autoscaling_off_gives_replicas_back_to_the_operator():
    api, _ = service()
    scaler = ServiceAutoscaler(api, NAMESPACE, "llm", source=FakeSource(make_signals(T0, 0.4)))
    scaler.step(T0)
    assert deployment(api, "prefill")["spec"]["replicas"] == 3

    spec = copy.deepcopy(fresh(api)["spec"])
    spec["autoscaling"]["enabled"] = False
    api.objects[("InferenceService", NAMESPACE, "llm")]["spec"] = spec
    reconcile(api, fresh(api), NOW)
    # The spec's number again, with force: the operator owns the field (in decode too, where
    # the number did not change and only the ownership had to move back).
    assert deployment(api, "prefill")["spec"]["replicas"] == 1
    assert replicas_managers(deployment(api, "prefill")) == {FIELD_MANAGER}
    assert FIELD_MANAGER in replicas_managers(deployment(api, "decode"))
    api.applies.clear()
    reconcile(api, fresh(api), NOW)
    assert api.applies == []  # settled: no apply on every pass

    scaler.release()
    status = fresh(api)["status"]
    assert "metrics" not in status and "lastScaleReason" not in status["pools"]["prefill"]
    assert set(conditions(api)) == {"Ready", "Progressing", "Degraded"}
    assert status["pools"]["prefill"]["replicas"] == 1  # the operator's fields stay


def test_a_step_before_the_pools_exist_does_nothing():
    api = FakeApi()
    api.add(make_isvc(autoscaling={"enabled": True}))
    step = ServiceAutoscaler(api, NAMESPACE, "llm", source=FakeSource(make_signals(T0))).step(T0)
    assert step.decision is None and step.skipped == "pools not created yet"
    assert api.writes == []


def test_scrape_targets_are_the_serving_pods_by_ip():
    pods = [
        make_pod("r", "router"),
        make_pod("p-1", "prefill"),
        make_pod("p-22", "prefill", ready=False),
        make_pod("d-333", "decode"),
    ]
    targets = scrape_targets(pods, ["prefill", "decode"])
    assert targets.routers == ("http://10.1.0.1:8000",)
    assert targets.workers == {
        "prefill": {"p-1": "http://10.1.0.3:8000"},
        "decode": {"d-333": "http://10.1.0.5:8000"},
    }


def test_a_scraping_step_reads_the_service_its_deployments_and_its_pods_once_each():
    """API load: a step is three reads however it gets its metrics (the scrape's targets come
    from the step's own list of pods)."""
    api, _ = service()
    for pod in (make_pod("r", "router", ready=False), make_pod("p-1", "prefill", ready=False)):
        api.add(pod)
    scaler = ServiceAutoscaler(api, NAMESPACE, "llm")  # no Prometheus: scrapes the pods
    api.reads.clear()
    step = scaler.step(T0)
    assert step.decision is not None and not step.decision.metrics_available
    assert sorted(api.reads) == [
        ("get", "InferenceService"), ("list", "Deployment"), ("list", "Pod"),
    ]  # fmt: skip


def test_a_step_given_the_watch_caches_view_reads_no_api_and_decides_the_same():
    """The operator's daemon passes the service, Deployments and pods from kopf's watches: the
    step then makes no API read, and decides as it would have from the API server."""
    from phasefleet.operator.service_autoscaler import read_view

    decisions = []
    for from_cache in (False, True):
        api, _ = service()
        api.add(make_pod("p-1", "prefill"))
        scaler = ServiceAutoscaler(api, NAMESPACE, "llm", source=FakeSource(make_signals(T0, 0.4)))
        view = read_view(api, NAMESPACE, "llm") if from_cache else None
        api.reads.clear()
        step = scaler.step(T0, view)
        assert step.decision is not None
        decisions.append(step.decision.pools)
        assert api.reads == ([] if from_cache else [
            ("get", "InferenceService"), ("list", "Deployment"), ("list", "Pod"),
        ])  # fmt: skip
    assert decisions[0] == decisions[1]
    assert decisions[1]["prefill"].desired == 3


def test_the_daemons_indexes_key_deployments_and_pods_by_their_service():
    import kopf

    from phasefleet.operator.autoscaling import cluster_view, indexed_by_service

    pod = make_pod("p-1", "prefill")
    entry = indexed_by_service(kopf.Body(cast(kopf.RawBody, pod)))
    assert entry == {(NAMESPACE, "llm"): pod}
    api, body = service()
    deployment_body = deployment(api, "prefill")
    assert list(indexed_by_service(kopf.Body(cast(kopf.RawBody, deployment_body)))) == [
        (NAMESPACE, "llm")
    ]
    indexes = {  # kopf's Index: key -> a collection of the objects' values
        "deployments": {(NAMESPACE, "llm"): [deployment_body], (NAMESPACE, "other"): [{}]},
        "pods": {(NAMESPACE, "llm"): [pod]},
    }
    view = cluster_view(
        kopf.Body(cast(kopf.RawBody, body)),
        cast(kopf.Index[Any, Any], indexes["deployments"]),
        cast(kopf.Index[Any, Any], indexes["pods"]),
    )
    assert view.service == body and view.deployments == [deployment_body] and view.pods == [pod]
    empty = cluster_view(
        kopf.Body(cast(kopf.RawBody, body)),
        cast(kopf.Index[Any, Any], {}),
        cast(kopf.Index[Any, Any], {}),
    )
    assert empty.deployments == [] and empty.pods == []


def test_the_daemon_runs_only_while_autoscaling_is_enabled():
    import kopf

    from phasefleet.operator.autoscaling import autoscaling_enabled

    def enabled(body: dict[str, Any]) -> bool:
        return autoscaling_enabled(spec=kopf.Spec(kopf.Body(cast(kopf.RawBody, body))))

    assert enabled({"spec": {"autoscaling": {"enabled": True}}})
    assert not enabled({"spec": {"autoscaling": {"enabled": False}}})
    assert not enabled({"spec": {}})


def test_metrics_of_an_aggregated_pool_and_missing_values_left_out():
    reading = Signals(
        sampled_at=T0,
        window_s=12.0,
        pools={"worker": PoolSignals(reporting=2, kv_usage_sum=0.9)},
        ttft_s=0.12345,
        tpot_s=None,
        itl_s=0.0216,
    )
    assert metrics(reading) == {"ttftMs": 123.5, "itlMs": 21.6, "kvCacheUsage": 0.45}
    assert metrics(MetricsUnavailable("NoSamples", "none yet")) == {}


def test_start_up_is_measured_from_the_pools_pods_creation_to_ready():
    api, _ = service()
    autoscaler = ServiceAutoscaler(api, NAMESPACE, "llm", source=FakeSource(make_signals(T0)))
    autoscaler.step(T0)
    assert autoscaler.startup_s == 60.0  # no pod tells yet: the default
    for pod in (
        make_pod("p-a", "prefill", started_in_s=40.0),
        make_pod("d-a", "decode", started_in_s=50.0),
        make_pod("d-b", "decode", started_in_s=300.0),  # one slow start does not move the median
        make_pod("d-loading", "decode", ready=False, started_in_s=5.0),  # not Ready: not counted
        make_pod("router", "router", started_in_s=1.0),  # not a pool's pod
    ):
        api.add(pod)
    autoscaler.step(T0 + 15)
    assert autoscaler.startup_s == 50.0


def test_a_new_service_whose_pods_load_is_starting_not_warned_about():
    api, _ = service()
    api.add(make_pod("d-loading", "decode", ready=False))
    source = FakeSource(MetricsUnavailable("NoSamples", "Prometheus has no series yet"))
    scaler = ServiceAutoscaler(api, NAMESPACE, "llm", source=source)
    step = scaler.step(T0)
    cond = conditions(api)["MetricsAvailable"]
    assert (cond["status"], cond["reason"]) == ("False", "ReplicasStarting")
    assert cond["message"].startswith("no prefill, decode replica is Ready yet")
    assert step.notices == []

    # Ready, and still nothing in Prometheus: now it is worth a Warning
    api.add(make_pod("d-ready", "decode"))
    step = scaler.step(T0 + 3)
    assert conditions(api)["MetricsAvailable"]["reason"] == "NoSamples"
    assert [(n.type, n.reason) for n in step.notices] == [("Warning", "MetricsUnavailable")]
    assert "no series yet" in step.notices[0].message


def test_a_pool_with_a_ready_pod_and_no_samples_is_warned_about_at_once():
    api, _ = service()
    api.add(make_pod("p-ready", "prefill"))
    reading = make_signals(T0)
    silent = replace(reading, pools={**reading.pools, "prefill": PoolSignals(reporting=0)})
    step = ServiceAutoscaler(api, NAMESPACE, "llm", source=FakeSource(silent)).step(T0)
    assert conditions(api)["MetricsAvailable"]["reason"] == "NoSamples"
    assert [(n.type, n.reason) for n in step.notices] == [("Warning", "MetricsUnavailable")]


def test_prometheus_reads_leave_out_the_pods_being_deleted():
    api, _ = service()
    draining = make_pod("d-old", "decode")
    draining["metadata"]["deletionTimestamp"] = NOW
    for pod in (make_pod("p-a", "prefill"), make_pod("d-a", "decode"), draining):
        api.add(pod)
    nothing_listens = "http://127.0.0.1:9"  # the read fails; only the source's wiring counts
    autoscaler = ServiceAutoscaler(api, NAMESPACE, "llm", prometheus_url=nothing_listens)
    step = autoscaler.step(T0)
    assert step.decision is not None and not step.decision.metrics_available
    spec = validate_service("llm", fresh(api)["spec"])
    source = autoscaler.source(spec, ScalingConfig.from_spec(spec))
    assert isinstance(source, PrometheusSource)
    assert set(source.leaving()) == {"d-old"}
    assert 'pod!~"d\\\\-old"' in source.queries(source.leaving())["kv_usage_sum"]
