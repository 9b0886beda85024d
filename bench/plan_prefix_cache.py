"""What modelling the prefix cache changes in `phasefleet plan`: the same search on the same
trace, side by side, as if nothing were reused (the planner before it knew of block ids), with
the workers' device caches, and with a host tier per worker.

For each Mooncake trace in ../shared/traces (both name their prompts' 512-token blocks), on the
8B/H100 roofline curves, with the SLO of the example in docs/plan.md (TTFT 10 s, TPOT 50 ms, for
99% of requests): the cheapest fleet of each search, its GPUs, router, attainment and the share
of prompt tokens found in the caches; then each search's GPUs against the search without the
cache.

    cd bench && ../.venv/bin/python plan_prefix_cache.py
    cd bench && ../.venv/bin/python plan_prefix_cache.py --host-gib 100,400 --ttft-ms 2000
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from phasefleet.plan.curves import roofline
from phasefleet.plan.gpus import GPUS
from phasefleet.plan.prefix_cache import PrefixCaching
from phasefleet.plan.report import LLAMA_3_8B, default_context
from phasefleet.plan.search import Plan, Slo, search
from phasefleet.plan.trace import read_trace

TRACES = Path(__file__).resolve().parents[2] / "shared/traces"
NAMES = ("mooncake_conversation", "mooncake_synthetic")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--traces", default=",".join(NAMES), help="names in ../shared/traces")
    p.add_argument("--ttft-ms", type=float, default=10_000)
    p.add_argument("--tpot-ms", type=float, default=50)
    p.add_argument("--percentile", type=float, default=0.99)
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    p.add_argument("--host-gib", default="200", help="host tiers per worker to try, GiB")
    p.add_argument("--max-gpus", type=int, default=64)
    return p.parse_args()


def best_row(label: str, plan: Plan, context: int) -> str:
    b = plan.best
    if b is None:
        return f"| {label} | none meets | | | | {plan.seconds:.0f} s |"
    found = "-" if b.prefix is None else f"{b.prefix.found_share:.1%}"
    if b.prefix is not None and b.prefix.host_tokens:
        found += f" ({b.prefix.host_share:.1%} from host)"
    name = b.shape.label(context)
    return (
        f"| {label} | {name}, {b.shape.gpus} GPUs | {b.shape.router} | {b.attainment:.2%} | "
        f"{found} | {plan.seconds:.0f} s |"
    )


def main() -> None:
    args = parse_args()
    gpu = GPUS[args.gpu]
    curves = roofline(LLAMA_3_8B, gpu)
    slo = Slo(args.ttft_ms / 1000, args.tpot_ms / 1000, args.percentile)
    tiers = [float(g) for g in args.host_gib.split(",") if g]
    print(
        f"machine: {platform.processor() or platform.machine()}, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}; {curves.name}; SLO TTFT {args.ttft_ms:g} ms, "
        f"TPOT {args.tpot_ms:g} ms, for {args.percentile:.1%} of requests"
    )
    for name in args.traces.split(","):
        trace = read_trace(TRACES / f"{name}.jsonl")
        context = default_context(trace)
        runs: list[tuple[str, Plan]] = [
            ("nothing reused", search(trace, curves, slo, args.max_gpus, context)),
            (
                "device caches",
                search(trace, curves, slo, args.max_gpus, context, PrefixCaching()),
            ),
        ]
        for gib in tiers:
            caching = PrefixCaching(
                int(gib * 2**30 // curves.kv_bytes_per_token), gpu.host_bytes_per_s
            )
            plan = search(trace, curves, slo, args.max_gpus, context, caching)
            runs.append((f"+ host tier {gib:g} GiB", plan))
        print(
            f"\n{name}: {len(trace.arrival)} requests over {trace.duration / 60:.1f} min\n\n"
            "| modelled | cheapest fleet | router | attainment | prompt tokens cached | search |\n"
            "|---|---|---|---|---|---|"
        )
        for label, plan in runs:
            print(best_row(label, plan, context))
        base = runs[0][1].best
        if base is None:
            continue
        print("\nGPUs against nothing reused (same process, same search):")
        for label, plan in runs[1:]:
            if plan.best is not None:
                print(f"  {label}: {plan.best.shape.gpus / base.shape.gpus:.2f}x")


if __name__ == "__main__":
    main()
