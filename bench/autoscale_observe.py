"""What a metrics source would read from the simulated fleet: `Signals` at a time, built the way
the router's histograms and the workers' gauges would give them (quantiles over the requests
that got their first token, or finished, in the last window; gauges as of now)."""

from __future__ import annotations

import numpy as np

from phasefleet.autoscale.signals import PodLoad, PoolSignals, Signals
from phasefleet.plan.disagg_sim import Fleet

LOOKBACK_S = 900.0  # requests that arrived longer ago are assumed prefilled (keeps it fast)


def quantile(values: np.ndarray, q: float) -> float | None:
    return float(np.quantile(values, q)) if len(values) else None


def latencies(fleet: Fleet, now: float, window_s: float, q: float) -> tuple[float | None, ...]:
    """(TTFT, TPOT) at quantile q over the window, as the router's histograms would give them,
    and requests finished per second."""
    tr = fleet.trace
    lo = int(np.searchsorted(tr.arrival, now - window_s - LOOKBACK_S))
    hi = int(np.searchsorted(tr.arrival, now))  # arrivals at `now` come after the decision
    first, finish = fleet.first_token[lo:hi], fleet.finish[lo:hi]
    with np.errstate(invalid="ignore"):
        got_first = (first > now - window_s) & (first <= now)
        done = (finish > now - window_s) & (finish <= now)
    ttft = first[got_first] - tr.arrival[lo:hi][got_first]
    long = done & (tr.output[lo:hi] > 1)
    tpot = (finish[long] - first[long]) / (tr.output[lo:hi][long] - 1)
    return quantile(ttft, q), quantile(tpot, q), float(done.sum()) / window_s


def prefill_pool(fleet: Fleet, now: float, window_s: float) -> PoolSignals:
    tr = fleet.trace
    serving = fleet.serving("prefill", now)
    lo = int(np.searchsorted(tr.arrival, now - window_s - LOOKBACK_S))
    hi = int(np.searchsorted(tr.arrival, now))  # arrivals at `now` come after the decision
    start, first = fleet.prefill_start[lo:hi], fleet.first_token[lo:hi]
    prompt = tr.prompt[lo:hi]
    pending = first > now  # admitted, not yet prefilled
    running = pending & (start <= now)
    done = (first > now - window_s) & ~pending
    busy = np.clip(np.minimum(first, now) - np.maximum(start, now - window_s), 0.0, None).sum()
    # the part of a running prompt already computed counts as done, as the engine's counter
    return PoolSignals(
        reporting=len(serving),
        kv_usage_sum=0.0,
        prefill_backlog_tokens=float(prompt[pending].sum()),
        prompt_tokens_per_s=float(prompt[done].sum()) / window_s,
        busy_fraction=float(busy) / (window_s * len(serving)) if serving else None,
        running=float(running.sum()),
        waiting=float((pending & ~running).sum()),
        pods={str(id(r)): PodLoad(running=float(r.free_at > now)) for r in serving},
    )


def decode_pool(fleet: Fleet, now: float, window_s: float, busy_before: float) -> PoolSignals:
    """`busy_before`: the pool's summed busy seconds one window ago (the counter's old value)."""
    c = fleet.curves
    serving = fleet.serving("decode", now)
    live = fleet.pools["decode"]
    busy = sum(r.busy_s for r in live) + sum(r.busy_s for r in fleet.retired) - busy_before
    return PoolSignals(
        reporting=len(serving),
        kv_usage_sum=sum(r.kv_tokens() / c.kv_capacity_tokens for r in serving),
        prefill_backlog_tokens=0.0,
        generation_tokens_per_s=None,
        busy_fraction=busy / (window_s * len(serving)) if serving else None,
        running=float(sum(len(r.batch) for r in serving)),
        waiting=float(len(fleet.decode_queue)),
        # the peak gauges, each replica's own, summed; the fleet's hand-off queue stands for
        # the engines' waiting queues
        requests_peak=sum(r.requests_peak.peak(now) for r in serving) + fleet.queue_peak.peak(now),
        kv_usage_peak_sum=sum(r.kv_peak.peak(now) for r in serving) / c.kv_capacity_tokens,
        pods={
            str(id(r)): PodLoad(len(r.batch), r.kv_tokens() / c.kv_capacity_tokens) for r in serving
        },
    )


class Observer:
    """Builds `Signals` at each decision; keeps the decode busy counter's history."""

    def __init__(self, window_s: float, percentile: float) -> None:
        self.window_s, self.percentile = window_s, percentile
        self.busy_history: list[tuple[float, float]] = [(0.0, 0.0)]

    def signals(self, fleet: Fleet, now: float) -> Signals:
        busy_total = sum(r.busy_s for r in fleet.pools["decode"]) + sum(
            r.busy_s for r in fleet.retired
        )
        old = [b for t, b in self.busy_history if t <= now - self.window_s]
        before = old[-1] if old else 0.0
        self.busy_history = [(t, b) for t, b in self.busy_history if t > now - 2 * self.window_s]
        self.busy_history.append((now, busy_total))
        ttft, tpot, rate = latencies(fleet, now, self.window_s, self.percentile)
        window = min(self.window_s, max(now, 1.0))
        return Signals(
            sampled_at=now,
            window_s=window,
            pools={
                "prefill": prefill_pool(fleet, now, window),
                "decode": decode_pool(fleet, now, window, before),
            },
            ttft_s=ttft,
            tpot_s=tpot,
            itl_s=tpot,
            request_rate=rate,
        )
