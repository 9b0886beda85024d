"""The KV hand-off in the autoscaling simulator (8B Llama-shaped model on H100): pulled after
the prefill, streamed chunk by chunk during it, streamed in layer groups during each chunk's
forward pass (LAYER_GROUPS: what a prompt prefilled in one step could gain), and streamed with
the first token held until the KV has landed. Same traces, rates and fleets as
bench/autoscale_replay.py (the oracle's sizes, found on the pulled hand-off, and the static
fleet at their peak); SLO attainment of every request, of short answers (at most SHORT
tokens: the ones a hand-off hurts most, and the ones a prefill worker could finish itself),
TTFT and TPOT.

    .venv/bin/python bench/handoff_sim.py [--traces mooncake_synthetic,...]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
from autoscale_curves import h100_8b
from autoscale_policies import oracle, static
from autoscale_replay import (
    ORACLE_INTERVAL_S,
    SLOS,
    find_oracle,
    initial,
    lead,
    rate_factor,
    run,
)
from autoscale_traces import NAMES, load, scale_rate

from phasefleet.plan.curves import Curves
from phasefleet.plan.disagg_sim import POOLS, Fleet
from phasefleet.plan.trace import latencies

SHORT = 4  # output tokens
LAYER_GROUPS = 4  # 8 of the 32 layers' KV per piece


def hand_offs(curves: Curves) -> dict[str, Curves]:
    return {
        "pulled": replace(curves, streamed=False),
        "streamed": curves,
        f"streamed, {LAYER_GROUPS} layer groups": replace(curves, layer_groups=LAYER_GROUPS),
        "streamed, token 1 held": replace(curves, first_token_waits_for_kv=True),
    }


def row(label: str, fleet: Fleet, ttft_slo: float, tpot_slo: float) -> str:
    tr = fleet.trace
    ttft, tpot = latencies(tr, fleet.first_token, fleet.finish)
    many = tr.output > 1
    ok = (ttft <= ttft_slo) & (tpot <= tpot_slo)
    short = tr.output <= SHORT
    cells = [
        label,
        f"{ok.mean():.2%}",
        f"{ok[short].mean():.2%} of {int(short.sum())}" if short.any() else "none",
        f"{ok[~short].mean():.2%}",
        f"{np.median(ttft):.2f} / {np.quantile(ttft, 0.99):.2f} s",
        f"{np.quantile(tpot[many], 0.99) * 1000:.1f} ms",
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--traces", type=lambda v: v.split(","), default=list(NAMES))
    p.add_argument("--peak", type=float, default=12.0, help="replicas the busiest minute needs")
    args = p.parse_args()
    curves = h100_8b()
    pulled = replace(curves, streamed=False)
    for name in args.traces:
        trace = load(name)
        trace = scale_rate(trace, rate_factor(trace, pulled, args.peak))
        slo = SLOS[name]
        sizes, note = find_oracle(trace, pulled, slo)
        peak = {pool: int(sizes[pool].max()) for pool in POOLS}
        best = oracle(sizes, ORACLE_INTERVAL_S, lead(curves))
        print(f"\n#### {name}: {len(trace.arrival)} requests; oracle {note}; static {peak}")
        print(
            f"\n| fleet, hand-off | SLO attainment | answers of <= {SHORT} tokens | longer "
            "| TTFT p50 / p99 | TPOT p99 |\n|---|---|---|---|---|---|"
        )
        for fleet_name, control, at_0 in (
            ("static", static(peak), peak),
            ("oracle", best, initial(best)),
        ):
            for label, variant in hand_offs(curves).items():
                fleet = run(trace, variant, control, at_0)
                print(row(f"{fleet_name}, {label}", fleet, slo.ttft_s, slo.tpot_s), flush=True)


if __name__ == "__main__":
    main()
