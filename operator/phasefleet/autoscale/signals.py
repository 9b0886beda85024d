"""What the policy reads: one snapshot of a service's metrics, per pool.

A source (Prometheus, or a direct scrape of the pods) builds a `Signals` from the router's
latency histograms and the workers' gauges, or raises `MetricsUnavailable` saying why it could
not. Times are seconds on the same clock as the policy's `now`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

NO_SAMPLES = "NoSamples"  # MetricsUnavailable reason: no series or no replica reports


class MetricsUnavailable(Exception):
    """No usable metrics: the policy holds every pool at its size.

    `reason` is a CamelCase word for the MetricsAvailable condition (e.g. PrometheusUnreachable,
    NoSamples, StaleMetrics, ScrapeFailed); the message says what is wrong and what to do.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class PodLoad:
    """One worker pod's load, to pick which pod a scale-down removes."""

    running: float = 0.0  # phasefleet_num_requests_running
    kv_usage: float = 0.0  # phasefleet_kv_cache_usage_perc


@dataclass(frozen=True)
class PoolSignals:
    """One pool's workers, summed or averaged over the pods that reported.

    None means the source has no sample for that value (e.g. no traffic yet for a rate).
    """

    reporting: int  # pods whose metrics are in this sample (ready workers)
    kv_usage_sum: float | None = None  # sum over pods of phasefleet_kv_cache_usage_perc (0..1 each)
    prefill_backlog_tokens: float | None = None  # sum of phasefleet_prefill_tokens_pending
    prompt_tokens_per_s: float | None = None  # pool's prompt tokens processed per second
    generation_tokens_per_s: float | None = None  # pool's output tokens per second
    busy_fraction: float | None = None  # mean share of wall time the engines spent in steps
    running: float | None = None  # sum of phasefleet_num_requests_running
    waiting: float | None = None  # sum of phasefleet_num_requests_waiting
    # Each pod's highest over its last PEAK_WINDOW_S seconds, summed: a burst between two
    # samples still counts. None: the workers do not export them.
    requests_peak: float | None = None  # sum of phasefleet_num_requests_peak
    kv_usage_peak_sum: float | None = None  # sum of phasefleet_kv_cache_usage_peak_perc
    pods: Mapping[str, PodLoad] = field(default_factory=dict)  # by pod name (or worker URL)


@dataclass(frozen=True)
class Signals:
    """A service's latencies (as the router saw them) and its pools' load, at one time."""

    sampled_at: float  # when the newest sample was taken, on the policy's clock
    window_s: float  # the span the rates and quantiles cover
    pools: Mapping[str, PoolSignals] = field(default_factory=dict)  # by role value
    # Router-side quantiles at the SLO percentile over the window (seconds); None: no requests.
    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: float | None = None
    request_rate: float | None = None  # requests finished per second at the router
    # Requests the router holds for a pool with no ready worker (scaled to zero), by pool.
    held: Mapping[str, float] = field(default_factory=dict)

    @property
    def busy(self) -> bool:
        """Whether any request is running, waiting or held anywhere in the service."""
        queued = ((p.running or 0.0) + (p.waiting or 0.0) for p in self.pools.values())
        return sum(queued) + sum(self.held.values()) > 0
