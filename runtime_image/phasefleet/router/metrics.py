"""The router's Prometheus metrics: the latencies users see, labelled `role="router"`.

Same names, meanings and buckets as the worker's histograms (docs/worker.md); the buckets are
imported from the worker's module so the two cannot drift. Time starts when the router receives
the request. Only streamed requests have a first-token time the client sees, so TTFT, ITL and TPOT
come from streams; e2e covers every successful request.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from phasefleet.api.contract import Metric
from phasefleet.server.metrics import (
    LABELS,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
)

ROLE = "router"


class RouterMetrics:
    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no *_created series, as on the worker
        self.registry = CollectorRegistry()
        labels = [model_name, ROLE]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)
            return family.labels(*labels)

        self.time_to_first_token = histogram(
            "phasefleet_time_to_first_token_seconds",
            "Arrival at the router to the first token sent to the client.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "phasefleet_inter_token_latency_seconds",
            "Gap between consecutive output events sent to the client (ITL).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "phasefleet_time_per_output_token_seconds",
            "Per stream: (last - first token time) / (output events - 1) (TPOT).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "phasefleet_e2e_request_latency_seconds",
            "Arrival at the router to the last token sent to the client.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.retries = Counter(
            "phasefleet_router_retries",
            "Requests sent to another worker after one failed before the first token.",
            LABELS,
            registry=self.registry,
        ).labels(*labels)
        self.held = Gauge(
            Metric.ROUTER_REQUESTS_HELD,
            "Requests waiting for a ready worker in a pool that has none (scaled to zero).",
            [*LABELS, Metric.ROUTER_HELD_POOL_LABEL],
            registry=self.registry,
        )
        self.labels = labels

    def set_held(self, pool: str, held: int) -> None:
        self.held.labels(*self.labels, pool).set(held)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StreamTimer:
    """Observes one stream's token events into the router's histograms."""

    def __init__(self, metrics: RouterMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival  # time.monotonic() when the request reached the router
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0

    def token(self, now: float) -> None:
        if self.last is None:
            self.first = now
            self.metrics.time_to_first_token.observe(now - self.arrival)
        else:
            self.metrics.inter_token_latency.observe(now - self.last)
        self.last = now
        self.tokens += 1

    def finished(self) -> None:
        """The stream ended with [DONE] and no error."""
        if self.first is None or self.last is None:
            return
        self.metrics.e2e_request_latency.observe(self.last - self.arrival)
        if self.tokens > 1:
            tpot = (self.last - self.first) / (self.tokens - 1)
            self.metrics.time_per_output_token.observe(tpot)
