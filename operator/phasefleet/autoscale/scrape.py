"""ScrapeSource: Signals from the pods' own /metrics, for clusters without Prometheus and for
`phasefleet serve --autoscale`.

Each `read(now)` GETs every target's /metrics at once and keeps the scrapes of the last window per
target; rates and latency quantiles come from the difference between a target's newest scrape and
its oldest one still in the window (at least `window_s` old once the source has run that long).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from phasefleet.api.contract import METRICS_PATH
from phasefleet.api.contract import Metric as M
from phasefleet.autoscale.histogram import histogram_quantile
from phasefleet.autoscale.signals import (
    NO_SAMPLES,
    MetricsUnavailable,
    PodLoad,
    PoolSignals,
    Signals,
)

# One exposition: (sample name, `le` of a bucket, the router's held gauge's worker pool, or "")
# -> value, summed over the other labels.
Samples = dict[tuple[str, str], float]


@dataclass(frozen=True)
class ScrapeTargets:
    """What to scrape now: base URLs (scheme://host:port), no path."""

    routers: tuple[str, ...] = ()
    workers: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # role -> name -> URL


def parse_exposition(text: str) -> Samples:
    """Prometheus text format -> samples by (name, le); raises ValueError on a malformed body."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                second = sample.labels.get("le", "")
            elif sample.name == M.ROUTER_REQUESTS_HELD:
                second = sample.labels.get(M.ROUTER_HELD_POOL_LABEL, "")
            else:
                second = ""
            key = (sample.name, second)
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def increase(new: Samples, old: Samples, name: str) -> float:
    """How much counter `name` grew from `old` to `new`; a drop means the target restarted, and
    then all of `new` is growth (as PromQL's rate() treats a reset)."""
    now, before = new.get((name, ""), 0.0), old.get((name, ""), 0.0)
    return now if now < before else now - before


def bucket_increase(new: Samples, old: Samples, name: str) -> dict[float, float]:
    """Histogram `name`'s observations per cumulative bucket between two scrapes, by bound."""
    restarted = new.get((f"{name}_count", ""), 0.0) < old.get((f"{name}_count", ""), 0.0)
    out: dict[float, float] = {}
    for (sample, le), value in new.items():
        if sample == f"{name}_bucket":
            out[float(le)] = value if restarted else value - old.get((sample, le), 0.0)
    return out


@dataclass
class _History:
    scrapes: deque[tuple[float, Samples]] = field(default_factory=deque)  # (time, samples)

    def add(self, now: float, samples: Samples, window_s: float) -> None:
        self.scrapes.append((now, samples))
        # Keep one scrape at least window_s old as the baseline, drop the ones before it.
        while len(self.scrapes) > 2 and self.scrapes[1][0] <= now - window_s:
            self.scrapes.popleft()

    @property
    def pair(self) -> tuple[float, Samples, Samples] | None:
        """(seconds between them, newest, baseline), or None before two scrapes."""
        if len(self.scrapes) < 2:
            return None
        (t0, old), (t1, new) = self.scrapes[0], self.scrapes[-1]
        return (t1 - t0, new, old) if t1 > t0 else None


class ScrapeSource:
    def __init__(
        self,
        targets: Callable[[], ScrapeTargets],
        percentile: float = 0.9,
        window_s: float = 60.0,
        timeout_s: float = 2.0,
    ) -> None:
        if not 0.0 < percentile < 1.0:
            raise ValueError(f"percentile must be between 0 and 1, got {percentile}")
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0 seconds, got {window_s}")
        self.targets = targets
        self.percentile = percentile
        self.window_s = window_s  # seconds the rates and quantiles cover
        self.timeout_s = timeout_s  # seconds per GET
        self._history: dict[str, _History] = {}  # by URL

    def read(self, now: float) -> Signals:
        """One scrape of every target; `now` is the caller's clock, the rates' time base."""
        targets = self.targets()
        urls = [*targets.routers, *(u for pool in targets.workers.values() for u in pool.values())]
        answered = self._scrape_all(urls)
        routers = [u for u in targets.routers if u in answered]
        held = _held(answered[u] for u in routers)
        if not any(targets.workers.values()):
            if routers:  # scaled to zero: the router says whether requests wait for a worker
                return Signals(sampled_at=now, window_s=self.window_s, held=held)
            raise MetricsUnavailable(
                NO_SAMPLES, "No worker to scrape: the service has no running worker pods yet."
            )
        for url in list(self._history):
            if url not in urls:
                del self._history[url]
        for url, samples in answered.items():
            self._history.setdefault(url, _History()).add(now, samples, self.window_s)
        pools = {role: self._pool(members, answered) for role, members in targets.workers.items()}
        if not any(p.reporting for p in pools.values()):
            if any(u in answered for pool in targets.workers.values() for u in pool.values()):
                raise MetricsUnavailable(
                    NO_SAMPLES,
                    "The workers answer but none has loaded its model yet: the pools hold their"
                    " sizes until one serves.",
                )
            raise MetricsUnavailable(
                "ScrapeFailed",
                f"No worker answered GET {METRICS_PATH} (tried {', '.join(sorted(urls))}): check "
                "that the workers are running and reachable from here.",
            )
        # Without a router (an aggregated fleet) the users' latencies are the workers' own: the
        # workers that answer clients, so not the prefill pool's internal prefill-only requests.
        latency_urls = routers or [
            url
            for role, members in targets.workers.items()
            if role != "prefill"
            for url in members.values()
            if url in answered
        ]
        pairs = [p for u in latency_urls if (p := self._history[u].pair) is not None]
        return Signals(
            sampled_at=now,
            window_s=self.window_s,
            pools=pools,
            ttft_s=self._quantile(pairs, M.TIME_TO_FIRST_TOKEN),
            tpot_s=self._quantile(pairs, M.TIME_PER_OUTPUT_TOKEN),
            itl_s=self._quantile(pairs, M.INTER_TOKEN_LATENCY),
            request_rate=_sum_rates(pairs, f"{M.E2E_REQUEST_LATENCY}_count"),
            held=held,
        )

    def _scrape_all(self, urls: list[str]) -> dict[str, Samples]:
        if not urls:
            return {}
        with (
            httpx.Client(timeout=self.timeout_s) as client,
            ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool,
        ):
            results = pool.map(lambda url: (url, _scrape(client, url)), urls)
            return {url: samples for url, samples in results if samples is not None}

    def _pool(self, members: Mapping[str, str], answered: Mapping[str, Samples]) -> PoolSignals:
        # a worker still loading answers /metrics without engine series: not a replica yet
        up = {
            name: answered[url]
            for name, url in members.items()
            if url in answered and (M.NUM_REQUESTS_RUNNING, "") in answered[url]
        }
        pairs = [p for n, u in members.items() if n in up and (p := self._history[u].pair)]

        def total(metric: str) -> float:
            return sum(s.get((metric, ""), 0.0) for s in up.values())

        def exported(metric: str) -> float | None:  # None where no worker exports it
            return total(metric) if any((metric, "") in s for s in up.values()) else None

        busy = [increase(new, old, M.ENGINE_BUSY_SECONDS_TOTAL) / dt for dt, new, old in pairs]
        return PoolSignals(
            reporting=len(up),
            kv_usage_sum=total(M.KV_CACHE_USAGE_PERC) if up else None,
            prefill_backlog_tokens=(
                total(M.PREFILL_TOKENS_PENDING) + total(M.PREFILL_TOKENS_WAITING) if up else None
            ),  # admitted and queued prompts alike
            prompt_tokens_per_s=_sum_rates(pairs, M.PROMPT_TOKENS_TOTAL),
            generation_tokens_per_s=_sum_rates(pairs, M.GENERATION_TOKENS_TOTAL),
            busy_fraction=min(1.0, sum(busy) / len(busy)) if busy else None,
            running=total(M.NUM_REQUESTS_RUNNING) if up else None,
            waiting=total(M.NUM_REQUESTS_WAITING) if up else None,
            requests_peak=exported(M.NUM_REQUESTS_PEAK),
            kv_usage_peak_sum=exported(M.KV_CACHE_USAGE_PEAK_PERC),
            pods={
                name: PodLoad(
                    running=s.get((M.NUM_REQUESTS_RUNNING, ""), 0.0),
                    kv_usage=s.get((M.KV_CACHE_USAGE_PERC, ""), 0.0),
                )
                for name, s in up.items()
            },
        )

    def _quantile(self, pairs: list[tuple[float, Samples, Samples]], name: str) -> float | None:
        merged: dict[float, float] = {}
        for _, new, old in pairs:
            for bound, count in bucket_increase(new, old, name).items():
                merged[bound] = merged.get(bound, 0.0) + count
        return histogram_quantile(self.percentile, merged.items())


def _held(routers: Iterable[Samples]) -> dict[str, float]:
    """Requests the routers hold, by worker pool."""
    out: dict[str, float] = {}
    for samples in routers:
        for (name, pool), value in samples.items():
            if name == M.ROUTER_REQUESTS_HELD and pool:
                out[pool] = out.get(pool, 0.0) + value
    return out


def _sum_rates(pairs: Iterable[tuple[float, Samples, Samples]], name: str) -> float | None:
    rates = [increase(new, old, name) / dt for dt, new, old in pairs]
    return sum(rates) if rates else None


def _scrape(client: httpx.Client, url: str) -> Samples | None:
    """A target's samples, or None when it does not answer with a parseable 200."""
    try:
        response = client.get(f"{url}{METRICS_PATH}")
        if response.status_code != 200:
            return None
        return parse_exposition(response.text)
    except (httpx.HTTPError, ValueError):
        return None
