"""Late prompts last against first come, first served, side by side in the simulator: a
prompt that would wait past its TTFT target for a prefill replica goes behind the prompts that
can still meet it (the engine's order when the service has a TTFT target; `simulate(
late_after_s=...)`). Ours, HPA at 0.5 and the oracle held through the scale-down window, each
in both orders; the bar (within 0.5 points of the held oracle, at most 1.15x its GPU-hours) is
judged against the held oracle in the same order.

    .venv/bin/python bench/autoscale_late.py                            # bursty variants
    .venv/bin/python bench/autoscale_late.py --traces azure2023_conv,sharegpt_8k --variants ""
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np
from autoscale_bursts import (
    ATTAINMENT_GAP,
    HOURS_RATIO,
    VARIANTS,
    Case,
    cases,
    held_oracle,
)
from autoscale_curves import h100_8b
from autoscale_policies import hpa, ours
from autoscale_replay import (
    HPA_SLO_TARGET,
    INTERVAL_S,
    SCALE_DOWN_S,
    WINDOW_S,
    Score,
    initial,
    oracles,
    policy_config,
    run,
    score,
)
from autoscale_traces import NAMES

from phasefleet.plan.curves import Curves
from phasefleet.plan.disagg_sim import Fleet

ORDERS = ("fcfs", "late last")


def replays(
    case: Case, curves: Curves, sizes: object, late: bool
) -> dict[str, tuple[Fleet, Score]]:
    """Ours, HPA at 0.5 and the held oracle, with one prefill order."""
    config = policy_config(curves, case.slo)
    best, bound = oracles(sizes, curves, SCALE_DOWN_S[0])
    start = initial(best)
    late_after_s = case.slo.ttft_s if late else None
    out = {}
    for name, control, interval_s in (
        ("ours", ours(config), config.interval_s),
        (f"HPA {HPA_SLO_TARGET:g}", hpa(WINDOW_S, HPA_SLO_TARGET), INTERVAL_S),
        ("held oracle", bound, INTERVAL_S),
    ):
        fleet = run(case.trace, curves, control, start, interval_s, late_after_s)
        out[name] = (fleet, score(fleet, case.slo, 0.0))
    return out


def late_wait(fleet: Fleet) -> str:
    """How many prompts waited as late, and the p99 of their TTFT."""
    if not fleet.deferred:
        return "0"
    ids = np.array(fleet.deferred)
    ttft = fleet.first_token[ids] - fleet.trace.arrival[ids]
    return f"{len(ids)} (TTFT p99 {np.quantile(ttft, 0.99):.0f} s)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", type=lambda v: [x for x in v.split(",") if x], default=[])
    p.add_argument("--variants", type=lambda v: [x for x in v.split(",") if x], default=VARIANTS)
    p.add_argument("--seed", type=int, default=0, help="the on/off variants' seed")
    p.add_argument("--cache", type=Path, default=Path("/tmp/phasefleet_oracle_cache"))
    args = p.parse_args()
    unknown = set(args.traces) - set(NAMES)
    if unknown:
        p.error(f"unknown traces {sorted(unknown)}; known: {', '.join(NAMES)}")
    curves = replace(h100_8b(), streamed=True)
    print(f"start-up {curves.startup_s:g} s; attainment / GPU-hours per order", flush=True)
    print(
        "| trace | ours, fcfs | ours, late last | HPA 0.5, fcfs | HPA 0.5, late last "
        "| held oracle, fcfs | held oracle, late last | ours x held (late last) | bar "
        "| late prompts, ours |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in cases(args.traces, args.variants, curves, 12.0, args.seed):
        _, _, sizes = held_oracle(case, curves, args.cache, fleet_needed=False)
        by_order = {order: replays(case, curves, sizes, order != "fcfs") for order in ORDERS}
        late = by_order["late last"]
        ours_sc, held_sc = late["ours"][1], late["held oracle"][1]
        ratio = ours_sc.gpu_hours / held_sc.gpu_hours
        met = ours_sc.attainment >= held_sc.attainment - ATTAINMENT_GAP and ratio <= HOURS_RATIO
        cells = [
            f"{by_order[order][name][1].attainment:.2%} / {by_order[order][name][1].gpu_hours:.1f}"
            for name in ("ours", f"HPA {HPA_SLO_TARGET:g}", "held oracle")
            for order in ORDERS
        ]
        print(
            f"| {case.label} | {' | '.join(cells)} | {ratio:.2f} | {'met' if met else 'not met'} "
            f"| {late_wait(late['ours'][0])} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
