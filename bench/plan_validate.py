"""Checks `phasefleet plan` against real local fleets on this CPU.

A segment of the Azure conversation trace (lengths divided by --scale, as in
bench/autoscale_validate.py) is planned with the curves measured here (--curves, from
bench/autoscale_measure.py; the hand-off at `phasefleet plan --gpu cpu`'s loopback bandwidth)
for fleets of at most --max-gpus workers (one per core); then the recommended fleet and the
runner-up (the next candidate by the plan's own order) serve the same segment for real
(`phasefleet serve`'s fleet, one thread per worker, the bench model). Printed per fleet: SLO
attainment predicted and measured, with the error, and TTFT and TPOT at the percentile.

    .venv/bin/python bench/plan_validate.py --model /tmp/pf-bench --curves /tmp/cpu_now.json
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from autoscale_curves import BENCH_KV_BYTES_PER_TOKEN
from autoscale_validate import cpu_segment, measure_fleet
from trace_segment import AZURE_CONV, as_trace

from phasefleet.plan.cli import LINK_GBPS
from phasefleet.plan.curves import measured
from phasefleet.plan.search import Outcome, Shape, Slo, search


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="make-tiny DIR --preset bench")
    p.add_argument("--curves", type=Path, required=True, help="bench/autoscale_measure.py JSON")
    p.add_argument("--start", type=float, default=0.0)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--scale", type=float, default=8.0)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--ttft-ms", type=float, default=1000.0)
    p.add_argument("--tpot-ms", type=float, default=60.0)
    p.add_argument("--percentile", type=float, default=0.9)
    p.add_argument("--max-gpus", type=int, default=2)
    return p.parse_args()


def attainment(ttft: np.ndarray, tpot: np.ndarray, slo: Slo) -> float:
    tpot = np.nan_to_num(tpot, nan=0.0)  # one-token answers have no TPOT
    return float(((ttft <= slo.ttft_s) & (tpot <= slo.tpot_s)).mean())


def pools(shape: Shape) -> dict[str, int]:
    if shape.mode == "aggregated":
        return {"worker": shape.workers}
    return {"prefill": shape.prefill, "decode": shape.decode}


def main() -> None:
    args = parse_args()
    segment, vocab = cpu_segment(args)
    trace = as_trace(segment)
    slo = Slo(args.ttft_ms / 1000, args.tpot_ms / 1000, args.percentile)
    curves = measured(args.curves, BENCH_KV_BYTES_PER_TOKEN, LINK_GBPS["cpu"] * 1e9)
    context = 2048
    plan = search(trace, curves, slo, args.max_gpus, context)
    ranked = sorted(plan.candidates, key=lambda c: (not c.meets(slo), c.shape.gpus, -c.attainment))
    shapes: list[Outcome] = []
    for c in ranked:  # two different fleets (a budget over the longest prompt is unchunked)
        if all(c.shape != s.shape for s in shapes):
            shapes.append(c)
    print(
        f"{len(segment)} requests, {args.duration:.0f} s of {AZURE_CONV.name} (lengths / "
        f"{args.scale:g}); SLO TTFT {args.ttft_ms:g} ms, TPOT {args.tpot_ms:g} ms for "
        f"{args.percentile:.0%}; {curves.name}; load {os.getloadavg()[0]:.1f}\n"
    )
    q = f"p{args.percentile * 100:g}"
    print(
        f"| fleet | GPUs | predicted attainment | measured | error (points) | TTFT {q} "
        f"predicted / measured | TPOT {q} predicted / measured |"
    )
    print("|---|---|---|---|---|---|---|")
    for rank, out in zip(("recommended", "runner-up"), shapes[:2], strict=False):
        ttft, tpot = measure_fleet(
            args.model, pools(out.shape), out.shape.chunk_tokens, [], segment, vocab
        )
        real = attainment(ttft, tpot, slo)
        t_q = float(np.quantile(ttft, args.percentile))
        p_q = float(np.nanquantile(tpot, args.percentile))
        print(
            f"| {rank}: {out.shape.label(context)} | {out.shape.gpus} | {out.attainment:.1%} | "
            f"{real:.1%} | {(out.attainment - real) * 100:+.1f} | {out.ttft_p * 1000:.0f} / "
            f"{t_q * 1000:.0f} ms | {out.tpot_p * 1000:.0f} / {p_q * 1000:.0f} ms |",
            flush=True,
        )
    print(f"\nload after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
