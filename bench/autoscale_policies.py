"""The controllers the replay compares: static pools, an HPA-style utilization target, a
KEDA-style queue threshold, our policy (`phasefleet.autoscale.policy.decide`, unchanged code),
and an oracle that knows each interval's load in advance.

Each is a `Controller`: (fleet, now) -> desired replicas per pool, called every interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from autoscale_observe import LOOKBACK_S, Observer

from phasefleet.autoscale.policy import PolicyState, ScalingConfig, decide
from phasefleet.plan.curves import Curves
from phasefleet.plan.disagg_sim import POOLS, Controller, Fleet
from phasefleet.plan.trace import Trace


def static(sizes: Mapping[str, int]) -> Controller:
    return lambda fleet, now: sizes


def ours(config: ScalingConfig, log: list[str] | None = None) -> Controller:
    """Our policy, reading its signals over config.signal_window_s; replay it every
    config.interval_s."""
    observer = Observer(config.signal_window_s, config.percentile)
    state = PolicyState()

    def control(fleet: Fleet, now: float) -> Mapping[str, int]:
        nonlocal state
        current = {p: len(fleet.asked(p)) for p in POOLS}
        decision = decide(config, observer.signals(fleet, now), current, state, now)
        state = decision.state
        if log is not None:
            log.extend(f"{now:7.0f} {d.reason}" for d in decision.pools.values() if d.changed)
        return {p: d.desired for p, d in decision.pools.items()}

    return control


@dataclass
class Hpa:
    """Kubernetes HPA semantics on one metric per pool: ratio rule (desired = ceil(ready x
    metric / target)), no change within 10% of the target, starting pods counted at 0 when
    scaling up; scale-up at most max(+4 pods, +100%) per 15 s (the default behaviour, no
    stabilization); scale-down to the highest recommendation of the last 300 s."""

    # pool -> (fleet, now, observer) -> (summed metric over ready pods, ready pods); the target
    # is per pod. With `average_value`, desired = ceil(sum / target) (KEDA's AverageValue).
    metric: Mapping[str, Callable[[Fleet, float], tuple[float, int]]]
    target: Mapping[str, float]
    minimum: int = 1
    maximum: int = 200  # as our policy's maxReplicas in the replay: above every trace's peak
    average_value: bool = False
    tolerance: float = 0.1
    down_window_s: float = 300.0
    history: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def __call__(self, fleet: Fleet, now: float) -> Mapping[str, int]:
        out = {}
        for pool in POOLS:
            current = len(fleet.asked(pool))
            total, ready = self.metric[pool](fleet, now)
            starting = current - ready
            if self.average_value:
                ratio = total / (self.target[pool] * max(current, 1))
                rec = (
                    math.ceil(total / self.target[pool])
                    if abs(ratio - 1) > self.tolerance
                    else current
                )
            elif ready == 0:
                rec = current
            else:
                ratio = total / (ready * self.target[pool])
                rec = current
                if abs(ratio - 1) > self.tolerance:
                    rec = math.ceil(ratio * ready)
                    if rec > current and starting > 0:  # unready pods count as 0 on the way up
                        diluted = total / (current * self.target[pool])
                        rec = (
                            math.ceil(diluted * current)
                            if diluted > 1 + self.tolerance
                            else current
                        )
            rec = min(max(rec, self.minimum), self.maximum)
            seen = self.history.get(pool) or [(now, current)]  # the pods ran before we started
            past = [(t, n) for t, n in seen if now - t < self.down_window_s]
            self.history[pool] = [*past, (now, rec)]
            if rec > current:
                out[pool] = min(rec, max(current + 4, 2 * current))
            else:
                out[pool] = min(current, max(n for _, n in self.history[pool]))
        return out


def busy_metric(fleet: Fleet, now: float, observer: Observer) -> tuple[float, int]:
    pool = observer.signals(fleet, now).pools["prefill"]
    return (pool.busy_fraction or 0.0) * pool.reporting, pool.reporting


def hpa(window_s: float, target: float = 0.7) -> Hpa:
    """Utilization: prefill engines' busy fraction, decode engines' KV usage, target 0.7."""
    observer = Observer(window_s, 0.99)

    def prefill(fleet: Fleet, now: float) -> tuple[float, int]:
        return busy_metric(fleet, now, observer)

    def decode(fleet: Fleet, now: float) -> tuple[float, int]:
        c, ready = fleet.curves, fleet.serving("decode", now)
        return sum(r.kv_tokens() / c.kv_capacity_tokens for r in ready), len(ready)

    return Hpa({"prefill": prefill, "decode": decode}, {"prefill": target, "decode": target})


def keda(per_replica: float = 4.0) -> Hpa:
    """Queue: requests waiting for a prefill replica, and for a decode batch slot; the target is
    that many waiting per replica (KEDA's AverageValue metric through the HPA)."""

    def prefill(fleet: Fleet, now: float) -> tuple[float, int]:
        tr = fleet.trace
        lo = int(np.searchsorted(tr.arrival, now - LOOKBACK_S))
        hi = int(np.searchsorted(tr.arrival, now))
        waiting = int((fleet.prefill_start[lo:hi] > now).sum())
        return float(waiting), len(fleet.serving("prefill", now))

    def decode(fleet: Fleet, now: float) -> tuple[float, int]:
        return float(len(fleet.decode_queue)), len(fleet.serving("decode", now))

    return Hpa(
        {"prefill": prefill, "decode": decode},
        {"prefill": per_replica, "decode": per_replica},
        average_value=True,
    )


@dataclass(frozen=True)
class Demand:
    """Per interval of the trace: prefill seconds of work and the decode pool's peak KV and
    batch demand, from the requests themselves (what an oracle knows in advance)."""

    interval_s: float
    prefill_work_s: np.ndarray  # [intervals]
    decode_kv_peak: np.ndarray  # KV tokens at the interval's busiest moment
    decode_seqs_peak: np.ndarray


def demand(trace: Trace, curves: Curves, interval_s: float = 60.0) -> Demand:
    c = curves
    n = int(trace.duration // interval_s) + 2
    work = np.array([c.prefill_s(p) for p in trace.prompt])
    prefill = np.bincount((trace.arrival // interval_s).astype(int), weights=work, minlength=n)
    # the last interval with arrivals is partial: its work is spread over its own span
    last = int(trace.duration // interval_s)
    prefill[last] *= interval_s / max(trace.duration - last * interval_s, 1.0)
    # a decode step at a typical batch: half the KV cache, max_num_seqs / 2 requests
    step = c.decode_step_s(c.max_num_seqs / 2, c.kv_capacity_tokens / 2)
    begin = trace.arrival + work + [c.handoff_s(p) for p in trace.prompt]
    end = begin + (trace.output - 1) * step
    size = trace.prompt + trace.output / 2  # a request's KV, averaged over its decode
    times = np.concatenate([begin, end])
    order = np.argsort(times, kind="stable")
    kv = np.cumsum(np.concatenate([size, -size])[order])
    seqs = np.cumsum(np.concatenate([np.ones_like(size), -np.ones_like(size)])[order])
    slot = np.minimum((times[order] // interval_s).astype(int), n - 1)
    kv_peak, seq_peak = np.zeros(n), np.zeros(n)
    np.maximum.at(kv_peak, slot, kv)
    np.maximum.at(seq_peak, slot, seqs)
    return Demand(interval_s, prefill[:n], kv_peak, seq_peak)


def oracle_sizes(d: Demand, curves: Curves, rho: Mapping[str, float]) -> dict[str, np.ndarray]:
    """Fewest replicas per interval at utilization rho per pool."""
    c = curves
    pre = np.ceil(d.prefill_work_s / (d.interval_s * rho["prefill"]) - 1e-9)
    dec = np.ceil(
        np.maximum(d.decode_kv_peak / c.kv_capacity_tokens, d.decode_seqs_peak / c.max_num_seqs)
        / rho["decode"]
        - 1e-9
    )
    return {"prefill": np.maximum(pre, 1).astype(int), "decode": np.maximum(dec, 1).astype(int)}


def held(
    sizes: Mapping[str, np.ndarray], window_s: float, interval_s: float
) -> dict[str, np.ndarray]:
    """The oracle's sizes under a scale-down window: no pool shrinks before `window_s` of
    lower sizes, so each interval's size is kept over the intervals the window covers. With
    `oracle` it is the cheapest fleet that knows the load in advance, runs at the oracle's
    utilization and still obeys scaleDownStabilizationSeconds (a policy can cost less only by
    running hotter, at a lower attainment: ShareGPT in bench/RESULTS.md)."""
    extra = max(0, math.ceil(window_s / interval_s - 1e-9) - 1)
    return {
        pool: np.array([s[max(0, i - extra) : i + 1].max() for i in range(len(s))])
        for pool, s in sizes.items()
    }


def oracle(sizes: Mapping[str, np.ndarray], interval_s: float, lead_s: float) -> Controller:
    """Asks for each interval's size `lead_s` (start-up time plus one decision interval) ahead,
    and lets go of replicas as soon as the next `lead_s` does not need them."""

    def control(fleet: Fleet, now: float) -> Mapping[str, int]:
        first = int(now // interval_s)
        last = int((now + lead_s) // interval_s)
        out = {}
        for pool in POOLS:
            s = sizes[pool]
            out[pool] = int(s[min(first, len(s) - 1) : min(last, len(s) - 1) + 1].max())
        return out

    return control
