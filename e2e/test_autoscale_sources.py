"""The autoscaler's two metric sources read the same live worker and router alike.

A real Prometheus scrapes a real worker and router every second, with the labels the chart's
PodMonitor gives pod targets (namespace, pod, inferenceservice); PrometheusSource's PromQL and
ScrapeSource's own scrapes of the same processes, over the same traffic, must agree (the
router's held gauge too). A service whose only worker pod is being deleted keeps the router's
signals, as one scaled to zero does. Then the failures: a service with no series, a URL that is
not Prometheus, and a stopped Prometheus.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from e2e.harness.prometheus import Prometheus
from phasefleet.autoscale.prometheus import PrometheusSource
from phasefleet.autoscale.scrape import ScrapeSource, ScrapeTargets
from phasefleet.autoscale.signals import MetricsUnavailable, Signals
from tests.autoscale.test_scrape_live import stream_many
from tests.router.router_proc import run_router, worker_list
from tests.server.worker_proc import run_worker

NAMESPACE, SERVICE = "demo", "llm"
REQUESTS = 12


def pod_target(url: str, pod: str, pool: str) -> dict[str, Any]:
    """A static target labelled as the PodMonitor's relabelling labels a pod's samples."""
    labels = {"namespace": NAMESPACE, "pod": pod, "inferenceservice": SERVICE, "pool": pool}
    return {"targets": [url.removeprefix("http://")], "labels": labels}


def wait_for_samples(source: PrometheusSource, timeout: float = 30.0) -> Signals:
    deadline = time.monotonic() + timeout
    while True:
        try:
            signals = source.read(now=time.time())
            if signals.request_rate is not None:  # the router's series are in too
                return signals
        except MetricsUnavailable as exc:
            if exc.reason != "NoSamples" or time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"Prometheus has no router samples after {timeout}s")
        time.sleep(0.5)


def close(a: float | None, b: float | None, rel: float) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=rel)


def test_prometheus_and_scrape_sources_agree_and_prometheus_failures_are_named(
    tiny_model: Path, start_prometheus: Callable[[list[dict[str, Any]]], Prometheus]
) -> None:
    with (
        run_worker(tiny_model) as worker,
        run_router("--workers", worker_list(worker)) as router,
    ):
        targets = [
            pod_target(worker.base_url, f"{SERVICE}-worker-0", "worker"),
            pod_target(router.base_url, f"{SERVICE}-router-0", "router"),
        ]
        prometheus = start_prometheus([{"job_name": "phasefleet", "static_configs": targets}])
        scrape = ScrapeSource(
            lambda: ScrapeTargets((router.base_url,), {"worker": {"w0": worker.base_url}})
        )
        probe = PrometheusSource(prometheus.url, NAMESPACE, SERVICE, ["worker"], window_s=5)
        before = wait_for_samples(probe)
        assert before.pools["worker"].reporting == 1
        time.sleep(1.5)  # a Prometheus sample with no traffic yet, as the scrape's baseline
        started = time.time()
        scrape.read(now=started)

        stream_many(router.client, REQUESTS)
        time.sleep(2.5)  # two more scrapes by Prometheus, after the last request

        now = time.time()
        direct = scrape.read(now=now)
        window = math.ceil(now - started) + 1  # covers the baseline sample, and all the traffic
        source = PrometheusSource(prometheus.url, NAMESPACE, SERVICE, ["worker"], window_s=window)
        via_prometheus = source.read(now=now)

        assert now - 5 < via_prometheus.sampled_at <= now + 1  # Unix time of the newest sample
        p, d = via_prometheus.pools["worker"], direct.pools["worker"]
        assert p.reporting == d.reporting == 1
        assert set(p.pods) == {f"{SERVICE}-worker-0"} and set(d.pods) == {"w0"}
        assert p.running == d.running == 0 and p.waiting == d.waiting == 0
        assert p.kv_usage_sum == d.kv_usage_sum and p.prefill_backlog_tokens == 0
        # the router's held gauge keeps its worker_pool label through the PodMonitor's pool
        assert via_prometheus.held == direct.held == {"worker": 0.0}
        # Same observations in both; PromQL's rate() extrapolates to the window's edges and
        # divides by the window, the scrape by the time between its own two scrapes.
        for name in ("ttft_s", "tpot_s", "itl_s"):
            ours, theirs = getattr(direct, name), getattr(via_prometheus, name)
            assert close(ours, theirs, rel=0.25), (name, ours, theirs)
        assert close(direct.request_rate, via_prometheus.request_rate, rel=0.4)
        assert close(d.prompt_tokens_per_s, p.prompt_tokens_per_s, rel=0.4)
        assert close(d.generation_tokens_per_s, p.generation_tokens_per_s, rel=0.4)
        assert close(d.busy_fraction, p.busy_fraction, rel=0.5)
        assert d.busy_fraction is not None and 0 < d.busy_fraction <= 1
        # the peak gauges: read as they are over a window within their own 30 s, with their
        # highest over the rest of a longer window (max_over_time) beyond it
        assert d.requests_peak is not None and d.requests_peak >= 1
        assert p.requests_peak == d.requests_peak
        wide = PrometheusSource(prometheus.url, NAMESPACE, SERVICE, ["worker"], window_s=90)
        assert "max_over_time" in wide.queries()["requests_peak"]
        widened = wide.read(now=now).pools["worker"]
        assert widened.requests_peak is not None and widened.requests_peak >= d.requests_peak
        assert widened.kv_usage_peak_sum is not None and widened.kv_usage_peak_sum > 0

        other = PrometheusSource(prometheus.url, NAMESPACE, "other", ["worker"])
        with pytest.raises(MetricsUnavailable) as no_samples:
            other.read(now=now)
        assert no_samples.value.reason == "NoSamples"
        assert f"{NAMESPACE}/other" in no_samples.value.message

        def leaving(*pods: str) -> PrometheusSource:
            return PrometheusSource(
                prometheus.url,
                NAMESPACE,
                SERVICE,
                ["worker"],
                window_s=window,
                leaving=lambda: pods,
            )

        # A pod being deleted is left out by its pod label; Prometheus takes the matcher.
        # Without a worker series the router's remain: the signals of a service at zero (the
        # policy holds a pool whose replicas do not report).
        assert leaving("llm-worker-9.x").read(now=now).pools["worker"].reporting == 1
        drained = leaving(f"{SERVICE}-worker-0").read(now=now)
        assert drained.pools == {} and drained.held == {"worker": 0.0}

        not_prometheus = PrometheusSource(worker.base_url, NAMESPACE, SERVICE, ["worker"])
        with pytest.raises(MetricsUnavailable) as bad:
            not_prometheus.read(now=now)
        assert bad.value.reason == "PrometheusError" and worker.base_url in bad.value.message

        prometheus.stop()
        began = time.monotonic()
        with pytest.raises(MetricsUnavailable) as down:
            source.read(now=time.time())
        assert down.value.reason == "PrometheusUnreachable"
        assert prometheus.url in down.value.message and "prometheus.url" in down.value.message
        assert time.monotonic() - began < 5  # one quick retry, not the client's default backoff
