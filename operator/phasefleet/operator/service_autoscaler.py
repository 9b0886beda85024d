"""One InferenceService's autoscaler on Kubernetes: each step reads the signals, runs the policy,
scales the pool Deployments and writes the autoscaler's status.

No kopf: the daemon in operator/autoscaling.py calls `step` every `intervalSeconds` and posts
the notices it returns. The policy's history lives in this object only, so an operator restart
(or autoscaling turned off and on) starts a new one.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from phasefleet.api.contract import ISVC_LABEL, ROLE_LABEL, ROUTER_PORT, ROUTER_ROLE, WORKER_PORT
from phasefleet.api.crd import API_VERSION, KIND
from phasefleet.api.names import InvalidService, validate_service
from phasefleet.api.spec import InferenceServiceSpec
from phasefleet.autoscale.policy import Decision, PolicyState, ScalingConfig, decide
from phasefleet.autoscale.prometheus import PrometheusSource
from phasefleet.autoscale.report import (
    STARTING_REASON,
    Notice,
    autoscaler_status,
    notices,
)
from phasefleet.autoscale.scrape import ScrapeSource, ScrapeTargets
from phasefleet.autoscale.signals import NO_SAMPLES, MetricsUnavailable, Signals
from phasefleet.operator.kube import Api
from phasefleet.operator.meta import AUTOSCALER_FIELD_MANAGER, Owner, child_name, is_owned_by
from phasefleet.operator.pool_scaling import (
    least_loaded,
    mark_for_removal,
    owns_replicas,
    scale,
    serving,
    startup_seconds,
)

# Rates and latency quantiles cover spec.autoscaling.signalWindowSeconds (30 s by default, the
# window the trace replay measured; with 60 s a burst is averaged over twice its length:
# bench/RESULTS.md, "The signals' window"). The chart's PodMonitor scrapes every 5 s, so the
# default window holds six scrapes.
RETRY_S = 10.0  # the next look at a service that is gone or invalid
DEFAULT_STARTUP_S = 60.0  # a new replica's start-up until one of the service's pods was Ready


class Source(Protocol):
    def read(self, now: float) -> Signals: ...


@dataclass(frozen=True)
class ClusterView:
    """What a step reads from the cluster: the service, its Deployments and its pods (all the
    objects labelled with its name). The operator's daemon passes its watch caches' copies;
    without one, the step reads them from the API server (three reads)."""

    service: dict[str, Any] | None  # None: the service is gone
    deployments: list[dict[str, Any]]
    pods: list[dict[str, Any]]


def read_view(api: Api, namespace: str, name: str) -> ClusterView:
    selector = f"{ISVC_LABEL}={name}"
    return ClusterView(
        api.get(KIND, namespace, name),
        api.list("Deployment", namespace, selector),
        api.list("Pod", namespace, selector),
    )


@dataclass(frozen=True)
class Step:
    interval_s: float  # seconds until the next step
    decision: Decision | None = None  # None: no decision this time (`skipped` says why)
    notices: list[Notice] = field(default_factory=list)
    skipped: str | None = None
    status_written: bool = False


def rfc3339(now: float) -> str:
    return datetime.datetime.fromtimestamp(now, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _role(pod: dict[str, Any]) -> str:
    return str((pod["metadata"].get("labels") or {}).get(ROLE_LABEL, ""))


def starting(
    decision: Decision, signals: Signals | MetricsUnavailable, workers: list[dict[str, Any]]
) -> Decision:
    """A pool without samples whose pods are not Ready yet is starting, not failing: the
    decision's NoSamples becomes STARTING_REASON (no Warning; see report.notices)."""
    if decision.metrics_reason != NO_SAMPLES:
        return decision
    silent = [
        role for role in decision.pools
        if isinstance(signals, MetricsUnavailable) or role not in signals.pools
        or signals.pools[role].reporting == 0
    ]  # fmt: skip
    if any(serving(p) for p in workers if _role(p) in silent):
        return decision  # a Ready pod that reports nothing: a real NoSamples
    names = ", ".join(silent)
    return replace(
        decision,
        metrics_reason=STARTING_REASON,
        metrics_message=f"no {names} replica is Ready yet: the pool holds its size until one"
        " reports metrics",
    )


def scrape_targets(pods: list[dict[str, Any]], roles: list[str]) -> ScrapeTargets:
    """The service's serving router and worker pods, by pod IP (ScrapeSource's targets), from
    the step's own list of the service's pods."""
    routers: list[str] = []
    workers: dict[str, dict[str, str]] = {role: {} for role in roles}
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        role = _role(pod)
        if not ip or not serving(pod):
            continue
        if role == ROUTER_ROLE:
            routers.append(f"http://{ip}:{ROUTER_PORT}")
        elif role in workers:
            workers[role][pod["metadata"]["name"]] = f"http://{ip}:{WORKER_PORT}"
    return ScrapeTargets(routers=tuple(sorted(routers)), workers=workers)


def pools_of(
    owner: Owner, name: str, deployments: list[dict[str, Any]], config: ScalingConfig
) -> dict[str, dict[str, Any]]:
    """The service's pool Deployments by role, of those it owns."""
    found = {d["metadata"]["name"]: d for d in deployments if is_owned_by(d, owner)}
    names = {role: child_name(name, role) for role in config.pools}
    return {role: found[n] for role, n in names.items() if n in found}


class ServiceAutoscaler:
    """`prometheus_url`: read PromQL there (the chart's prometheus.url); None: scrape the pods.
    `source` replaces both (tests)."""

    def __init__(
        self,
        api: Api,
        namespace: str,
        name: str,
        prometheus_url: str | None = None,
        source: Source | None = None,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.prometheus_url = prometheus_url
        self.state = PolicyState()
        self.startup_s = DEFAULT_STARTUP_S  # measured from the pods once one is Ready
        self._fixed_source = source
        self._source: Source | None = None
        self._source_key: tuple[Any, ...] = ()
        self._written: dict[str, Any] | None = None  # the status last applied
        self._leaving: frozenset[str] = frozenset()  # worker pods being deleted, at this step
        self._pods: list[dict[str, Any]] = []  # the service's pods, as this step listed them

    @property
    def source_name(self) -> str:
        if self.prometheus_url:
            return f"metrics from Prometheus at {self.prometheus_url}"
        return "metrics scraped from the pods' /metrics"

    def source(self, spec: InferenceServiceSpec, config: ScalingConfig) -> Source:
        """The metrics source for this spec; kept while its settings hold (it keeps history)."""
        if self._fixed_source is not None:
            return self._fixed_source
        window_s = config.signal_window_s
        roles = [role.value for role in spec.pools()]
        key = (config.percentile, window_s, tuple(roles))
        if self._source is not None and key == self._source_key:
            return self._source
        if self.prometheus_url:
            self._source = PrometheusSource(
                self.prometheus_url, self.namespace, self.name, roles,
                percentile=config.percentile, window_s=window_s, leaving=lambda: self._leaving,
            )  # fmt: skip
        else:
            self._source = ScrapeSource(
                lambda: scrape_targets(self._pods, roles),
                percentile=config.percentile,
                window_s=window_s,
            )
        self._source_key = key
        return self._source

    def step(self, now: float, view: ClusterView | None = None) -> Step:
        """One decision; `now` is seconds since the epoch, `view` the cluster's objects (None:
        read them from the API server). Raises kube.Transient / Rejected."""
        view = view or read_view(self.api, self.namespace, self.name)
        body = view.service
        if body is None or body["metadata"].get("deletionTimestamp"):
            return Step(interval_s=RETRY_S, skipped="the InferenceService is gone")
        try:
            spec = validate_service(self.name, dict(body.get("spec") or {}))
        except InvalidService:
            return Step(interval_s=RETRY_S, skipped="invalid spec (see its Degraded)")
        config = ScalingConfig.from_spec(spec)
        if not spec.autoscaling.enabled:
            return Step(interval_s=config.interval_s, skipped="autoscaling is off")
        deployments = pools_of(Owner.from_body(body), self.name, view.deployments, config)
        if len(deployments) < len(config.pools):
            return Step(interval_s=config.interval_s, skipped="pools not created yet")
        current = {role: int(d["spec"].get("replicas") or 0) for role, d in deployments.items()}
        pods = view.pods
        self._pods = pods  # the scrape's targets too
        workers = [p for p in pods if _role(p) in current]
        self._leaving = frozenset(
            p["metadata"]["name"] for p in workers if p["metadata"].get("deletionTimestamp")
        )
        self.startup_s = startup_seconds(workers) or self.startup_s
        config = replace(config, startup_s=self.startup_s)

        signals: Signals | MetricsUnavailable
        try:
            signals = self.source(spec, config).read(now)
        except MetricsUnavailable as exc:
            signals = exc
        decision = starting(decide(config, signals, current, self.state, now), signals, workers)
        self.state = decision.state
        self._act(decision, signals, deployments, pods)

        previous = dict(body.get("status") or {})
        generation = int(body["metadata"].get("generation") or 0)
        status = autoscaler_status(decision, signals, previous, generation, rfc3339(now))
        written = status != self._written
        if written:
            self.api.apply_status(self._status_object(status), manager=AUTOSCALER_FIELD_MANAGER)
            self._written = status
        return Step(
            interval_s=config.interval_s,
            decision=decision,
            notices=notices(decision, previous),
            status_written=written,
        )

    def release(self) -> None:
        """Autoscaling turned off: drop the autoscaler's status fields (they would go stale).

        spec.replicas is left alone: the operator's next pass applies the spec's number with
        force and so takes the field back; dropping it here first would reset it to 1.
        """
        self.api.apply_status(self._status_object({}), manager=AUTOSCALER_FIELD_MANAGER)
        self._written = None

    def _status_object(self, status: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": self.name, "namespace": self.namespace},
            "status": status,
        }

    def _act(
        self,
        decision: Decision,
        signals: Signals | MetricsUnavailable,
        deployments: dict[str, dict[str, Any]],
        pods: list[dict[str, Any]],
    ) -> None:
        """Marks the pods a scale-down removes, then applies every pool's size that changed
        (or that the autoscaler does not own yet: the first step takes the field over)."""
        for role, pool in decision.pools.items():
            deployment = deployments[role]
            if pool.desired < pool.current and isinstance(signals, Signals):
                members = [p for p in pods if _role(p) == role]
                loads = signals.pools[role].pods if role in signals.pools else {}
                chosen = least_loaded(members, loads, pool.current - pool.desired)
                mark_for_removal(self.api, self.namespace, members, chosen)
            if pool.changed or not owns_replicas(deployment):
                scale(self.api, self.namespace, deployment["metadata"]["name"], pool.desired)
