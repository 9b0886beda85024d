"""The operator's own /metrics: the autoscaler's last decision per service and pool.

Served on `--metrics-port` (the chart sets it and scrapes it with a PodMonitor that keeps these
series' own `namespace` label: honorLabels). The chart's autoscaler-at-limit alert reads
`phasefleet_autoscaler_scaling_limited`.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import suppress

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from phasefleet.api.contract import Metric
from phasefleet.autoscale.policy import Decision

SERVICE_LABELS = ("namespace", "inferenceservice")


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        pool_labels = (*SERVICE_LABELS, "pool")
        self.scaling_limited = Gauge(
            Metric.AUTOSCALER_SCALING_LIMITED,
            "1 while the pool's ask is cut by maxReplicas or the GPU budget (ScalingLimited)",
            pool_labels,
            registry=self.registry,
        )
        self.desired_replicas = Gauge(
            Metric.AUTOSCALER_DESIRED_REPLICAS,
            "Replicas the autoscaler's last decision gave the pool",
            pool_labels,
            registry=self.registry,
        )
        self.metrics_available = Gauge(
            Metric.AUTOSCALER_METRICS_AVAILABLE,
            "1 while the autoscaler has usable metrics for the service (MetricsAvailable)",
            SERVICE_LABELS,
            registry=self.registry,
        )

    def record(self, namespace: str, service: str, decision: Decision) -> None:
        self.metrics_available.labels(namespace, service).set(int(decision.metrics_available))
        for role, pool in decision.pools.items():
            self.desired_replicas.labels(namespace, service, role).set(pool.desired)
            self.scaling_limited.labels(namespace, service, role).set(int(pool.limited is not None))

    def forget(self, namespace: str, service: str, pools: Iterable[str]) -> None:
        """Drop a service's series (autoscaling turned off, or the service deleted)."""
        with suppress(KeyError):  # never recorded
            self.metrics_available.remove(namespace, service)
        for role in pools:
            for gauge in (self.desired_replicas, self.scaling_limited):
                with suppress(KeyError):
                    gauge.remove(namespace, service, role)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)


AUTOSCALER_METRICS = AutoscalerMetrics()  # the operator process's one set
