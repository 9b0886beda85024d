"""The operator's /metrics: the autoscaler's decisions as series, over real HTTP."""

from __future__ import annotations

import socket

import httpx
from prometheus_client.parser import text_string_to_metric_families

from phasefleet.api.contract import Metric
from phasefleet.autoscale.policy import Decision, PolicyState, PoolDecision
from phasefleet.operator.metrics import AutoscalerMetrics


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def decision(limited: str | None, available: bool = True) -> Decision:
    pools = {
        "prefill": PoolDecision("prefill", 3, 3, "prefill stays at 3", limited=limited),
        "decode": PoolDecision("decode", 2, 3, "decode 2->3: KV usage 0.91 > target 0.70"),
    }
    return Decision(pools=pools, state=PolicyState(), metrics_available=available)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_decisions_are_served_with_the_service_labels_and_forgotten() -> None:
    metrics, port = AutoscalerMetrics(), free_port()
    metrics.serve(port, host="127.0.0.1")
    metrics.record("team-a", "llama", decision("prefill is at maxReplicas 3 (asked for 5)"))
    metrics.record("team-b", "qwen", decision(None, available=False))
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    got = samples(text)

    def key(name: str, ns: str, svc: str, pool: str | None = None) -> tuple:
        labels = {"namespace": ns, "inferenceservice": svc} | ({"pool": pool} if pool else {})
        return (name, tuple(sorted(labels.items())))

    assert got[key(Metric.AUTOSCALER_SCALING_LIMITED, "team-a", "llama", "prefill")] == 1
    assert got[key(Metric.AUTOSCALER_SCALING_LIMITED, "team-a", "llama", "decode")] == 0
    assert got[key(Metric.AUTOSCALER_DESIRED_REPLICAS, "team-a", "llama", "decode")] == 3
    assert got[key(Metric.AUTOSCALER_METRICS_AVAILABLE, "team-a", "llama")] == 1
    assert got[key(Metric.AUTOSCALER_METRICS_AVAILABLE, "team-b", "qwen")] == 0

    metrics.forget("team-a", "llama", ["prefill", "decode"])
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert 'inferenceservice="llama"' not in text
    assert 'inferenceservice="qwen"' in text
