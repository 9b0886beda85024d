"""The phase boundary in the simulator: every prompt prefilled remotely, the fixed threshold
(the worker's default, 512 uncached tokens), and the adaptive rule (phasefleet/api/boundary.py),
on every trace, for disaggregated fleets of a few P:D splits.

Measure: goodput per GPU (the highest rate at which --target of the requests meet both the
trace's TTFT and TPOT, per GPU), found as bench/disagg_vs_agg.py finds it (a rate grid, then
bisection around the crossing); and, at the rate where the fixed rule's goodput is, the
attainment of each rule and the share of prompts the decode pool prefilled. Curves: 8B/H100
roofline and this CPU's measured ones (lengths / CPU_TOKEN_SCALE, as disagg_vs_agg does).

    .venv/bin/python bench/phase_boundary.py
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace

import numpy as np
from autoscale_curves import cpu_curves, h100_8b
from autoscale_policies import static
from autoscale_replay import DT_S, SLOS, Slo
from autoscale_traces import NAMES, load, scale_rate
from disagg_vs_agg import CPU_TOKEN_SCALE, capacity_per_gpu, refine, segment, shrink, sweep

from phasefleet.api.boundary import PhaseBoundary
from phasefleet.plan.curves import Curves
from phasefleet.plan.disagg_sim import simulate
from phasefleet.plan.trace import Trace, latencies

RULES = {
    "all remote": None,
    "fixed 512": PhaseBoundary(),
    "adaptive": PhaseBoundary(adaptive=True),
}


@dataclass(frozen=True)
class Setup:
    name: str
    gpus: int
    prefill: int
    decode: int
    rule: str
    aggregated: bool = field(default=False, compare=False)  # disagg_vs_agg's sweep reads it


@dataclass(frozen=True)
class Replay:
    trace: Trace
    curves: Curves
    slos: tuple[Slo, ...]
    scale: int  # token lengths divided by this (the boundary's token knobs too)

    def run(self, setup: Setup, rate: float) -> tuple[np.ndarray, float]:
        """(attainment per SLO, share of prompts prefilled by the decode pool) at `rate`
        requests/s per GPU."""
        base = len(self.trace.arrival) / self.trace.duration
        scaled = scale_rate(self.trace, rate * setup.gpus / base)
        pools = {"prefill": setup.prefill, "decode": setup.decode}
        fleet = simulate(
            scaled,
            self.curves,
            static(pools),
            pools,
            interval_s=1e9,
            dt=DT_S,
            boundary=scaled_rule(RULES[setup.rule], self.scale),
            tpot_target_s=self.slos[0].tpot_s,
        )
        ttft, tpot = latencies(scaled, fleet.first_token, fleet.finish)
        met = np.array([((ttft <= s.ttft_s) & (tpot <= s.tpot_s)).mean() for s in self.slos])
        return met, fleet.local_prefills / max(1, len(scaled.arrival))

    def attainment(self, setup: Setup, rate: float) -> np.ndarray:
        return self.run(setup, rate)[0]


def scaled_rule(rule: PhaseBoundary | None, scale: int) -> PhaseBoundary | None:
    """The rule's token knobs divided as the trace's lengths are (the CPU curves)."""
    if rule is None or scale == 1:
        return rule
    return replace(
        rule,
        min_tokens=rule.min_tokens // scale,
        idle_min_tokens=rule.idle_min_tokens // scale,
        local_max_tokens=rule.local_max_tokens // scale,
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--traces", type=lambda v: v.split(","), default=list(NAMES))
    p.add_argument("--curves", type=lambda v: v.split(","), default=["h100", "cpu"])
    p.add_argument("--gpus", type=int, default=8, help="GPUs of every fleet")
    p.add_argument(
        "--splits", type=lambda v: [int(x) for x in v.split(",")], default=[2, 3, 4],
        help="prefill replicas of the fleets (the rest decode)",
    )  # fmt: skip
    p.add_argument("--segment-s", type=float, default=300.0)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--tpot-scale", type=float, default=1.0, help="x the trace's TPOT target")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    summary = [
        "| curves, trace | fleet | all remote | fixed 512 | adaptive | adaptive / fixed |"
        " decode-pool prefills (fixed, adaptive) |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in args.curves:
        curves = h100_8b() if key == "h100" else cpu_curves()
        scale = 1 if key == "h100" else CPU_TOKEN_SCALE
        for name in args.traces:
            trace = load(name)
            trace = shrink(trace, scale) if scale > 1 else trace
            rough = capacity_per_gpu(trace, curves) * args.gpus
            trace = segment(trace, max(args.segment_s, args.requests / rough))
            slo = Slo(SLOS[name].ttft_s, SLOS[name].tpot_s * args.tpot_scale)
            replay = Replay(trace, curves, (slo,), scale)
            for p in args.splits:
                runs = [
                    Setup(f"{p}P:{args.gpus - p}D {rule}", args.gpus, p, args.gpus - p, rule)
                    for rule in RULES
                ]
                sw = sweep(replay, runs, args.target)
                good = {s.rule: refine(replay, sw, s, 0, args.target) for s in runs}
                at = good["fixed 512"] or good["adaptive"]
                local = {s.rule: replay.run(s, at)[1] if at else 0.0 for s in runs}
                ratio = good["adaptive"] / good["fixed 512"] if good["fixed 512"] else float("nan")
                summary.append(
                    f"| {key}, {name}, TPOT {slo.tpot_s * 1000:g} ms | {p}P:{args.gpus - p}D | "
                    + " | ".join(f"{good[r]:.3g}" for r in RULES)
                    + f" | {ratio:.2f} | {local['fixed 512']:.0%}, {local['adaptive']:.0%} |"
                )
                print(summary[-1], f"({sw.seconds:.0f} s)", flush=True)
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
