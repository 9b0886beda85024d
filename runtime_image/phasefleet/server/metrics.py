"""The worker's Prometheus metrics: names, meanings and buckets as in docs/architecture.md.

Gauges and counters are read from the engine's latest stats at scrape time (the engine keeps the
running totals); latency histograms are observed by the server as each request's tokens arrive.
Every series carries the labels `model_name` and `role`. Each WorkerMetrics has its own
registry, so several workers (or tests) can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from phasefleet.api.contract import PEAK_WINDOW_S
from phasefleet.api.contract import Metric as M

if TYPE_CHECKING:
    from phasefleet.engine.llm_engine import EngineStats

LABELS = M.LABELS

# vLLM's bucket boundaries (seconds) for the same quantities.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# name -> (help, EngineStats attribute)
GAUGES = {
    M.NUM_REQUESTS_RUNNING: ("Requests in the running batch.", "num_running"),
    M.NUM_REQUESTS_WAITING: ("Requests queued, not yet scheduled.", "num_waiting"),
    M.KV_CACHE_USAGE_PERC: ("Used KV blocks / all KV blocks, 0..1.", "kv_cache_usage"),
    M.NUM_REQUESTS_PEAK: (
        f"Highest running + waiting requests of any step in the last {PEAK_WINDOW_S} s.",
        "num_requests_peak",
    ),
    M.KV_CACHE_USAGE_PEAK_PERC: (
        f"Highest KV usage of any step in the last {PEAK_WINDOW_S} s, 0..1.",
        "kv_cache_usage_peak",
    ),
    M.KV_LEASES: ("Prompts whose KV is leased, awaiting a decode worker's pull.", "num_kv_leases"),
    M.PREFILL_TOKENS_PENDING: (
        "Prompt tokens admitted but not yet prefilled.",
        "prefill_tokens_pending",
    ),
    M.PREFILL_TOKENS_WAITING: (
        "Prompt tokens of queued requests, not yet admitted.",
        "prefill_tokens_waiting",
    ),
    M.HOST_KV_CACHE_USAGE_PERC: (
        "Used slots / all slots of the prefix cache's host tier, 0..1 (0: off).",
        "host_kv_cache_usage",
    ),
}
ITL_WEIGHT = 0.05  # a new gap's weight in the moving average (about the last 20 gaps)
ANSWER_WEIGHT = 0.1  # a finished answer's weight in the moving average of their lengths

COUNTERS = {
    M.PROMPT_TOKENS_TOTAL: ("Prompt tokens processed.", "prompt_tokens_total"),
    M.GENERATION_TOKENS_TOTAL: ("Output tokens produced.", "generation_tokens_total"),
    M.NUM_PREEMPTIONS_TOTAL: ("Requests preempted (to be recomputed).", "num_preemptions_total"),
    M.LATE_PROMPTS_TOTAL: (
        "Prompts moved behind on-time ones, having waited past the TTFT target.",
        "late_prompts_total",
    ),
    M.PREFIX_CACHE_QUERIES_TOTAL: ("Prompt tokens looked up.", "prefix_cache_queries_total"),
    M.PREFIX_CACHE_HITS_TOTAL: (
        "Prompt tokens found in the prefix cache.",
        "prefix_cache_hits_total",
    ),
    M.HOST_KV_CACHE_HITS_TOTAL: (
        "Prompt tokens loaded from the prefix cache's host tier (part of the hits).",
        "host_kv_cache_hits_total",
    ),
    M.SPEC_DECODE_DRAFT_TOKENS_TOTAL: (
        "Draft tokens verified (speculative decoding by prompt lookup).",
        "spec_draft_tokens_total",
    ),
    M.SPEC_DECODE_ACCEPTED_TOKENS_TOTAL: (
        "Draft tokens the model agreed with (each saved a step).",
        "spec_accepted_tokens_total",
    ),
}


COUNTERS[M.KV_LEASE_EXPIRIES_TOTAL] = (
    "KV leases that expired before the decode worker released them.",
    "num_kv_lease_expiries_total",
)
COUNTERS[M.ENGINE_BUSY_SECONDS_TOTAL] = (
    "Wall seconds the engine spent in steps that had work (rate: busy fraction, 0..1).",
    "busy_seconds_total",
)
KV_TRANSFER_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
HANDOFF_FAILURE_REASONS = (
    "prefill_unreachable", "prefill_refused", "layout_mismatch", "pull_failed", "pull_timeout",
    "pull_order",
)  # fmt: skip


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None], labels: list[str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            # Loading (or failed to load): no engine series, so a worker that cannot serve yet
            # is not counted as a reporting replica, nor averaged in as an idle one.
            return
        for name, (doc, attr) in GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self._labels, float(getattr(stats, attr)))
            yield family
        for name, (doc, attr) in COUNTERS.items():
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            counter.add_metric(self._labels, float(getattr(stats, attr)))
            yield counter
        if stats.max_loras:
            info = GaugeMetricFamily(
                M.LORA_REQUESTS_INFO,
                "1, labelled with the LoRA adapters of the running and waiting requests.",
                labels=[*LABELS, "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            )
            running, waiting = ",".join(stats.running_loras), ",".join(stats.waiting_loras)
            info.add_metric([*self._labels, running, waiting, str(stats.max_loras)], 1.0)
            yield info
            loaded = GaugeMetricFamily(
                M.LORA_ADAPTER_LOADED,
                "1 for each LoRA adapter loaded in a slot, labelled with its name.",
                labels=[*LABELS, "lora_name"],
            )
            for name in stats.loaded_loras:
                loaded.add_metric([*self._labels, name], 1.0)
            yield loaded


class _StartupCollector(Collector):
    def __init__(self, seconds: Callable[[], dict[str, float]], labels: list[str]) -> None:
        self.seconds = seconds
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            M.WORKER_STARTUP_SECONDS,
            "Seconds each phase of this worker's start-up took (phases so far while loading).",
            labels=[*LABELS, "phase"],
        )
        for phase, seconds in self.seconds().items():
            family.add_metric([*self.labels, phase], seconds)
        yield family


class WorkerMetrics:
    def __init__(
        self,
        model_name: str,
        role: str,
        stats: Callable[[], EngineStats | None],
        startup: Callable[[], dict[str, float]] = dict,
    ) -> None:
        disable_created_metrics()  # no *_created series (process-wide; vLLM does the same)
        self.registry = CollectorRegistry()
        labels = [model_name, role]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)
            return family.labels(*labels)

        self.time_to_first_token = histogram(
            M.TIME_TO_FIRST_TOKEN, "Arrival to first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            M.INTER_TOKEN_LATENCY,
            "Gap between consecutive output tokens (ITL).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            M.TIME_PER_OUTPUT_TOKEN,
            "Per request: (last - first token time) / (output tokens - 1) (TPOT).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            M.E2E_REQUEST_LATENCY, "Arrival to last token.", REQUEST_LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            M.REQUEST_QUEUE_TIME, "Arrival to first scheduled.", REQUEST_LATENCY_BUCKETS
        )
        self.kv_transfer_seconds = histogram(
            M.KV_TRANSFER_SECONDS, "One hand-off's stream, request to its end.", KV_TRANSFER_BUCKETS
        )
        self.kv_transfer_bytes = Counter(
            M.KV_TRANSFER_BYTES_TOTAL, "Bytes of KV received.", LABELS, registry=self.registry
        ).labels(*labels)
        failures = Counter(
            M.KV_TRANSFER_FAILURES_TOTAL,
            "Hand-offs that fell back to prefilling or recomputing here, by reason.",
            [*LABELS, "reason"],
            registry=self.registry,
        )
        self.kv_transfer_failures = {
            r: failures.labels(*labels, r) for r in HANDOFF_FAILURE_REASONS
        }
        prefills = Counter(
            M.PREFILLS_TOTAL,
            "Requests whose prompt was prefilled here (local) or on a prefill worker (remote).",
            [*LABELS, "where"],
            registry=self.registry,
        )
        self.prefills = {where: prefills.labels(*labels, where) for where in ("local", "remote")}
        moves = Counter(
            M.PHASE_BOUNDARY_MOVES_TOTAL,
            "Prompts the adaptive phase boundary placed other than the fixed threshold would.",
            [*LABELS, "to"],
            registry=self.registry,
        )
        self.boundary_moves = {to: moves.labels(*labels, to) for to in ("local", "remote")}
        self.recent_itl_s: float | None = None  # inter-token latency, a moving average
        self.recent_output_tokens: float | None = None  # finished answers' lengths, the same
        self.registry.register(_EngineStatsCollector(stats, labels))
        self.registry.register(_StartupCollector(startup, labels))

    def observe_itl(self, seconds: float) -> None:
        """One gap between two output tokens: the histogram and the moving average."""
        self.inter_token_latency.observe(seconds)
        recent = self.recent_itl_s
        self.recent_itl_s = seconds if recent is None else recent + ITL_WEIGHT * (seconds - recent)

    def observe_answer(self, tokens: int) -> None:
        """A finished request's output tokens, for the moving average of answer lengths."""
        recent = self.recent_output_tokens
        self.recent_output_tokens = (
            tokens if recent is None else recent + ANSWER_WEIGHT * (tokens - recent)
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
