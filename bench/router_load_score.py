"""The router's load score with and without the prompt tokens a worker has not yet computed,
under both router policies, on fixed fleets of the planner's simulators (the router's own
ranking code, `phasefleet.router.policy`, over what each replica's gauges would report).

Before, a worker's load was its requests (running, waiting twice, a full KV cache as four);
now every `PREFILL_TOKENS_PER_UNIT` prompt tokens admitted or queued and not yet computed
count as one more. Both are replayed in this process, the old by setting that constant to
infinity. For each fleet: the share of requests meeting the SLO and the share of prompt tokens
found in the workers' caches (the prefix cache modelled from the Mooncake traces' block ids),
on the 8B/H100 roofline curves, SLO TTFT 10 s and TPOT 50 ms (docs/plan.md's example).

    cd bench && ../.venv/bin/python router_load_score.py
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path

import phasefleet.router.policy as policy
from phasefleet.plan.curves import Curves, roofline
from phasefleet.plan.gpus import GPUS
from phasefleet.plan.prefix_cache import PrefixCaching
from phasefleet.plan.report import LLAMA_3_8B, default_context
from phasefleet.plan.search import Outcome, Shape, Slo, replay
from phasefleet.plan.trace import Trace, read_trace

TRACES = Path(__file__).resolve().parents[2] / "shared/traces"
ROUTERS = ("least-loaded", "prefix-aware")


@dataclass(frozen=True)
class Case:
    trace: str
    shape: Shape
    host_gib: float  # each worker's host tier (0: the device cache only)


CASES = (
    Case("mooncake_conversation", Shape("aggregated", 512, workers=7), 0),
    Case("mooncake_conversation", Shape("aggregated", 512, workers=7), 400),
    Case("mooncake_conversation", Shape("disaggregated", 2048, prefill=3, decode=2), 400),
    Case("mooncake_synthetic", Shape("aggregated", 512, workers=4), 400),
    Case("mooncake_synthetic", Shape("disaggregated", 2048, prefill=5, decode=1), 0),
    Case("mooncake_synthetic", Shape("disaggregated", 2048, prefill=4, decode=1), 100),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ttft-ms", type=float, default=10_000)
    p.add_argument("--tpot-ms", type=float, default=50)
    p.add_argument("--percentile", type=float, default=0.99)
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    return p.parse_args()


def replay_with(
    tokens_per_unit: float,
    trace: Trace,
    curves: Curves,
    shape: Shape,
    slo: Slo,
    caching: PrefixCaching,
) -> Outcome:
    """One replay with the router's load score counting a unit per `tokens_per_unit`."""
    kept = policy.PREFILL_TOKENS_PER_UNIT
    policy.PREFILL_TOKENS_PER_UNIT = tokens_per_unit
    try:
        return replay(trace, curves, shape, slo, caching)
    finally:
        policy.PREFILL_TOKENS_PER_UNIT = kept


def cell(o: Outcome) -> str:
    found = o.prefix.found_share if o.prefix is not None else 0.0
    return f"{o.attainment:.2%} ({found:.1%})"


def main() -> None:
    args = parse_args()
    gpu = GPUS[args.gpu]
    curves = roofline(LLAMA_3_8B, gpu)
    slo = Slo(args.ttft_ms / 1000, args.tpot_ms / 1000, args.percentile)
    print(
        f"machine: {platform.processor() or platform.machine()}, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}; {curves.name}; SLO TTFT {args.ttft_ms:g} ms, "
        f"TPOT {args.tpot_ms:g} ms, for {args.percentile:.1%} of requests; "
        f"now a unit per {policy.PREFILL_TOKENS_PER_UNIT:g} prompt tokens\n"
    )
    print(
        "attainment (prompt tokens found in the caches)\n\n"
        "| trace | fleet | host tier | least-loaded, requests only | least-loaded, now "
        "| prefix-aware, requests only | prefix-aware, now |\n|---|---|---|---|---|---|---|"
    )
    traces: dict[str, Trace] = {}
    for case in CASES:
        trace = traces.setdefault(case.trace, read_trace(TRACES / f"{case.trace}.jsonl"))
        tier = int(case.host_gib * 2**30 // curves.kv_bytes_per_token)
        caching = PrefixCaching(tier, gpu.host_bytes_per_s)
        cells = []
        for router in ROUTERS:
            shape = replace(case.shape, router=router)
            for per_unit in (math.inf, policy.PREFILL_TOKENS_PER_UNIT):
                cells.append(cell(replay_with(per_unit, trace, curves, shape, slo, caching)))
        label = case.shape.label(default_context(trace))
        tier_label = f"{case.host_gib:g} GiB" if case.host_gib else "none"
        print(f"| {case.trace} | {label} | {tier_label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
