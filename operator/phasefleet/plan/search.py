"""The search behind `phasefleet plan`: for a trace and an SLO, the fewest GPUs that meet it in
each mode, found by replaying the trace in the simulators on fleets of fixed size.

- Aggregated: workers that prefill and decode, at each token budget per step in `CHUNKS`
  (and unchunked); the fewest workers meeting the SLO, by bisection (attainment grows with
  the workers).
- Disaggregated: TTFT is set mostly by the prefill pool, so the fewest prefill replicas whose
  TTFT meets the target on a generous decode pool come first; then, for that pool and one
  replica more, the fewest decode replicas that meet both targets. Every prompt is prefilled
  by the prefill pool, as the written service's workers will do (`remotePrefillMinTokens: 0`):
  with the default threshold (512) the decode workers would prefill short prompts beside
  their batch, which the simulator shows costs tight TPOT targets their tail.

With `prefix` (a trace with block ids), every replay models the workers' prefix cache
(plan/prefix_cache.py), and each mode and budget is searched under both router policies that
can use it: `prefix-aware` (a prompt to the worker that served its prefix, within a load slack)
and `least-loaded` (caches hit only by chance); the cheaper is kept.

A request meets the SLO when its TTFT and its TPOT are both within target; a fleet meets it
when at least `percentile` of the requests do (attainment).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from phasefleet.plan.aggregated_sim import simulate_aggregated
from phasefleet.plan.curves import Curves
from phasefleet.plan.disagg_sim import simulate
from phasefleet.plan.prefix_cache import PrefixCaching, PrefixStats
from phasefleet.plan.trace import Trace, latencies

CHUNKS = (512, 2048, 8192)  # token budgets per step tried for aggregated workers
ROUTERS = ("prefix-aware", "least-loaded")  # spec.router.policy; the first needs a prefix cache
DT_S = 0.1  # the disaggregated simulator's decode tick


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float
    percentile: float  # the share of requests that must meet both, e.g. 0.99


@dataclass(frozen=True)
class Shape:
    mode: str  # "aggregated" or "disaggregated"
    chunk_tokens: int  # the token budget per step (aggregated; prefill chunks otherwise)
    workers: int = 0  # aggregated
    prefill: int = 0  # disaggregated
    decode: int = 0
    router: str = "least-loaded"  # spec.router.policy

    @property
    def gpus(self) -> int:
        return self.workers + self.prefill + self.decode

    def label(self, context: int) -> str:
        if self.mode == "disaggregated":
            return f"disaggregated {self.prefill}P:{self.decode}D"
        budget = "unchunked" if self.chunk_tokens >= context else f"chunks of {self.chunk_tokens}"
        return f"aggregated, {budget}"


@dataclass(frozen=True)
class Outcome:
    shape: Shape
    attainment: float  # share of requests meeting both targets
    ttft_p: float  # seconds, at the SLO's percentile
    tpot_p: float
    goodput_per_gpu: float  # requests meeting the SLO per second per GPU
    prefix: PrefixStats | None = None  # prompt tokens found in the caches, when modelled

    def meets(self, slo: Slo) -> bool:
        return self.attainment >= slo.percentile


@dataclass(frozen=True)
class Plan:
    best: Outcome | None  # the cheapest that meets the SLO (fewest GPUs, then attainment)
    candidates: list[Outcome]  # the cheapest of each mode and budget, met or not
    seconds: float  # wall time of the search


def replay(
    trace: Trace, curves: Curves, shape: Shape, slo: Slo, prefix: PrefixCaching | None = None
) -> Outcome:
    """One fixed-size fleet through the whole trace, scored."""
    curves = replace(curves, chunk_tokens=shape.chunk_tokens)
    if prefix is not None:
        prefix = replace(prefix, prefix_aware=shape.router == "prefix-aware")
    if shape.mode == "aggregated":
        fleet = simulate_aggregated(trace, curves, shape.workers, prefix)
        first, finish = fleet.first_token, fleet.finish
        model = fleet.prefix
    else:
        pools = {"prefill": shape.prefill, "decode": shape.decode}
        sized = simulate(
            trace,
            curves,
            lambda _f, _t: pools,
            pools,
            interval_s=1e9,
            dt=DT_S,
            prefix=prefix,
        )
        first, finish = sized.first_token, sized.finish
        model = sized.prefix
    ttft, tpot = latencies(trace, first, finish)
    met = (ttft <= slo.ttft_s) & (tpot <= slo.tpot_s)
    span = max(trace.duration, 1.0)
    return Outcome(
        shape,
        float(met.mean()),
        float(np.quantile(ttft, slo.percentile)),
        float(np.quantile(tpot, slo.percentile)),
        float(met.sum()) / span / shape.gpus,
        None if model is None else model.stats,
    )


def fewest(
    low: int, high: int, run: Callable[[int], Outcome], good: Callable[[Outcome], bool]
) -> Outcome:
    """The outcome of the smallest n in [low, high] whose outcome is good (taken to be good for
    every n above one that is); that of `high` when none is."""
    best = run(high)
    if not good(best):
        return best
    while low < high:
        mid = (low + high) // 2
        out = run(mid)
        if good(out):
            best, high = out, mid
        else:
            low = mid + 1
    return best


def search(
    trace: Trace,
    curves: Curves,
    slo: Slo,
    max_gpus: int,
    context: int,
    prefix: PrefixCaching | None = None,
) -> Plan:
    """The cheapest fleet of at most `max_gpus` GPUs per mode and budget, and the best of all."""
    started = time.monotonic()

    def met(out: Outcome) -> bool:
        return out.meets(slo)

    def aggregated(chunk: int, router: str) -> Callable[[int], Outcome]:
        def run(n: int) -> Outcome:
            shape = Shape("aggregated", chunk, workers=n, router=router)
            return replay(trace, curves, shape, slo, prefix)

        return run

    routers = ROUTERS if prefix is not None else ROUTERS[1:]
    budgets = sorted({min(chunk, context) for chunk in (*CHUNKS, context)})
    candidates = [
        cheapest([fewest(1, max_gpus, aggregated(c, r), met) for r in routers], slo)
        for c in budgets
    ]
    if max_gpus >= 2:
        by_router = [_disaggregated(trace, curves, slo, max_gpus, prefix, r) for r in routers]
        candidates.append(cheapest(by_router, slo))
    best = cheapest(candidates, slo)
    return Plan(best if met(best) else None, candidates, time.monotonic() - started)


def cheapest(outcomes: list[Outcome], slo: Slo) -> Outcome:
    """The fewest GPUs of those meeting the SLO, then the higher attainment; the highest
    attainment when none meets it."""
    meeting = [o for o in outcomes if o.meets(slo)]
    if not meeting:
        return max(outcomes, key=lambda o: o.attainment)
    return min(meeting, key=lambda o: (o.shape.gpus, -o.attainment))


def _disaggregated(
    trace: Trace,
    curves: Curves,
    slo: Slo,
    max_gpus: int,
    prefix: PrefixCaching | None,
    router: str = "least-loaded",
) -> Outcome:
    """Prefill replicas for TTFT first (decode generous), then decode replicas for both."""
    chunk = curves.chunk_tokens

    def fleet(prefill: int, decode: int) -> Outcome:
        shape = Shape("disaggregated", chunk, prefill=prefill, decode=decode, router=router)
        return replay(trace, curves, shape, slo, prefix)

    def ttft_met(out: Outcome) -> bool:
        return out.ttft_p <= slo.ttft_s

    def with_prefill(p: int) -> Callable[[int], Outcome]:
        return lambda d: fleet(p, d)

    roomy = fewest(1, max_gpus - 1, lambda p: fleet(p, max_gpus - p), ttft_met)
    prefill = roomy.shape.prefill
    tries = [
        fewest(1, max_gpus - p, with_prefill(p), lambda o: o.meets(slo))
        for p in (prefill, prefill + 1)
        if p < max_gpus
    ]
    return cheapest(tries, slo)
