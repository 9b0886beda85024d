"""kopf daemon: one autoscaler per InferenceService with spec.autoscaling.enabled.

A daemon rather than a timer: it re-reads the spec on each step and sleeps that step's
`intervalSeconds`, so an interval change takes effect at the next step without a fast timer
ticking in between (and logging every tick), and it keeps the policy's history and the
scrape source's samples in one object for its lifetime. It is async and runs each step in a
worker thread, so idle daemons hold no thread of kopf's pool (which the reconcile handlers
share). kopf stops it when autoscaling is turned off (the `when` filter stops matching), when
the service is deleted, and when the operator exits; like every kopf daemon it puts kopf's
finalizer on the service while it runs.

A step reads no API: the service is the daemon's live body, and its Deployments and pods come
from two kopf indexes kept by the watches the operator runs anyway (children and pods, by the
service label). kopf fills the indexes before any daemon starts; each step copies what it
needs on the event loop, then decides in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import kopf

from phasefleet.api.contract import ISVC_LABEL
from phasefleet.api.crd import GROUP, PLURAL, VERSION
from phasefleet.autoscale.report import summary
from phasefleet.operator.handlers import PODS, plain
from phasefleet.operator.kube import Gone, Rejected, Transient
from phasefleet.operator.metrics import AUTOSCALER_METRICS
from phasefleet.operator.service_autoscaler import ClusterView, ServiceAutoscaler

RETRY_SECONDS = 5.0  # after an API error, before the next step

log = logging.getLogger(__name__)


def autoscaling_enabled(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


def indexed_by_service(body: kopf.Body) -> dict[tuple[str, str], dict[str, Any]]:
    """An index entry: the object, as a plain dict, under (namespace, its service's name)."""
    labels = body.metadata.labels or {}
    return {(body.metadata.namespace or "", labels.get(ISVC_LABEL, "")): plain(body)}


@kopf.index("apps", "v1", "deployments", labels={ISVC_LABEL: kopf.PRESENT})
def service_deployments(body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return indexed_by_service(body)


@kopf.index(*PODS, labels={ISVC_LABEL: kopf.PRESENT})
def service_pods(body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return indexed_by_service(body)


def cluster_view(body: kopf.Body, deployments: kopf.Index, pods: kopf.Index) -> ClusterView:
    """The step's objects, copied from the live body and the indexes (on the event loop, where
    kopf updates them)."""
    key = (body.metadata.namespace or "", body.metadata.name or "")
    return ClusterView(plain(body), list(deployments.get(key, ())), list(pods.get(key, ())))


@kopf.daemon(GROUP, VERSION, PLURAL, when=autoscaling_enabled, cancellation_backoff=10.0)
async def autoscale(
    stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, **kwargs: Any
) -> None:
    deployments: kopf.Index = kwargs["service_deployments"]  # kopf passes indexes by name
    pods: kopf.Index = kwargs["service_pods"]
    namespace, name = body.metadata.namespace or "", body.metadata.name or ""
    scaler = ServiceAutoscaler(memo.api, namespace, name, getattr(memo, "prometheus_url", None))
    where = f"{namespace}/{name}"
    log.info("autoscaler %s: started, %s", where, scaler.source_name)
    available: bool | None = None  # MetricsAvailable at the last decision
    pools: list[str] = []  # the pools of the last decision (their series on /metrics)
    while not stopped:
        started = time.monotonic()
        try:
            view = cluster_view(body, deployments, pods)
            step = await asyncio.to_thread(scaler.step, time.time(), view)
        except (Transient, Rejected, Gone) as exc:
            log.warning(
                "autoscaler %s: step failed, retrying in %.0f s: %s", where, RETRY_SECONDS, exc
            )
            await stopped.wait(RETRY_SECONDS)
            continue
        for notice in step.notices:
            kopf.event(body, type=notice.type, reason=notice.reason, message=notice.message)
        decision = step.decision
        if decision is not None:
            AUTOSCALER_METRICS.record(namespace, name, decision)
            pools = list(decision.pools)
        if decision is None:
            log.debug("autoscaler %s: no decision: %s", where, step.skipped)
        elif (
            any(p.changed for p in decision.pools.values())
            or decision.metrics_available != available
        ):
            log.info("autoscaler %s: %s", where, summary(decision))  # a change: one line
            available = decision.metrics_available
        else:
            log.debug("autoscaler %s: %s", where, summary(decision))
        await stopped.wait(max(0.0, step.interval_s - (time.monotonic() - started)))
    gone = kopf.DaemonStoppingReason.FILTERS_MISMATCH | kopf.DaemonStoppingReason.RESOURCE_DELETED
    if stopped.reason is not None and stopped.reason & gone:
        AUTOSCALER_METRICS.forget(namespace, name, pools)
    if stopped.reason is not None and stopped.reason & kopf.DaemonStoppingReason.FILTERS_MISMATCH:
        try:
            await asyncio.to_thread(scaler.release)
        except (Transient, Rejected, Gone) as exc:
            log.warning("autoscaler %s: could not clear its status: %s", where, exc)
        log.info("autoscaler %s: stopped, autoscaling is off", where)
