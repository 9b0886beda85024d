"""Trace replay of the autoscaling policies in the simulator (8B Llama-shaped model on H100).

For every trace in ../shared/traces: the request rate is scaled so the busiest minute needs
about --peak replicas in the larger pool (at 80% utilization on the 8B/H100 curves); then static
pools (peak, mean), HPA, KEDA, our policy and the oracle (alone, and held through the scale-down
window as the spec's rule holds every policy) are replayed and compared side by side, and a PNG
per trace is written. --hard also replays harder variants of one trace.

    .venv/bin/python bench/autoscale_replay.py            # or: make bench-autoscale
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from autoscale_curves import h100_8b
from autoscale_plot import plot_runs
from autoscale_policies import demand, held, hpa, keda, oracle, oracle_sizes, ours, static
from autoscale_traces import (
    NAMES,
    add_spike,
    code_lengths,
    compress_bursts,
    load,
    on_off,
    scale_rate,
)

from phasefleet.autoscale.policy import PoolLimits, ScalingConfig
from phasefleet.plan.curves import Curves
from phasefleet.plan.disagg_sim import POOLS, Controller, Fleet, simulate
from phasefleet.plan.trace import Trace, latencies

EMPTY = Trace("empty", np.zeros(1), np.ones(1, int), np.ones(1, int))
INTERVAL_S = 15.0  # HPA, KEDA and the oracles decide this often (HPA's sync period); ours
# decides every spec.autoscaling.intervalSeconds (5 s by default)
WINDOW_S = 30.0  # the span of HPA's and KEDA's rates (ours: spec.autoscaling.signalWindowSeconds)
ORACLE_INTERVAL_S = 60.0
PERCENTILE = 0.99
RHOS = tuple(round(1.0 - 0.05 * k, 2) for k in range(15))  # 1.0 ... 0.3
HPA_SLO_TARGET = 0.5  # the highest of 0.7, 0.6, 0.5 at which HPA meets 99% on Azure and ShareGPT
DT_S = 0.1  # the decode time step (8B/H100 steps are 10-40 ms: a few per tick)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


# Mooncake's prompts run to 128k tokens (12.5 s of prefill alone on the 8B/H100 curves; pulled
# after the prefill, 0.3 s of KV hand-off came before the second token, which many of its short
# answers could not spread; streamed during the prefill, the last chunk's 5 ms).
SLOS = {
    "azure2023_conv": Slo(1.0, 0.05),
    "sharegpt_8k": Slo(1.0, 0.05),
    "mooncake_conversation": Slo(10.0, 0.1),
    "mooncake_synthetic": Slo(10.0, 0.1),
}


@dataclass(frozen=True)
class Score:
    attainment: float  # share of requests meeting both targets
    ttft_ok: float  # share meeting the TTFT target
    tpot_ok: float
    ttft_q: float  # seconds, at PERCENTILE
    tpot_q: float
    goodput: float  # requests within SLO per second of the replay
    gpu_hours: float
    per_gpu_hour: float  # requests within SLO per GPU-hour
    scale_events: int
    seconds: float  # wall time of the simulation


def score(fleet: Fleet, slo: Slo, seconds: float) -> Score:
    tr = fleet.trace
    ttft, tpot = latencies(tr, fleet.first_token, fleet.finish)
    long = tr.output > 1
    ttft_ok, tpot_ok = ttft <= slo.ttft_s, tpot <= slo.tpot_s
    met = int((ttft_ok & tpot_ok).sum())
    gpu_hours = fleet.gpu_seconds(fleet.end) / 3600
    return Score(
        attainment=met / len(ttft),
        ttft_ok=float(ttft_ok.mean()),
        tpot_ok=float(tpot_ok.mean()),
        ttft_q=float(np.quantile(ttft, PERCENTILE)),
        tpot_q=float(np.quantile(tpot[long], PERCENTILE)),
        goodput=met / fleet.end,
        gpu_hours=gpu_hours,
        per_gpu_hour=met / gpu_hours,
        scale_events=sum(fleet.scale_events.values()),
        seconds=seconds,
    )


def run(
    trace: Trace,
    curves: Curves,
    control: Controller,
    initial: Mapping[str, int],
    interval_s: float = INTERVAL_S,
    late_after_s: float | None = None,
) -> Fleet:
    return simulate(
        trace, curves, control, initial, interval_s=interval_s, dt=DT_S, late_after_s=late_after_s
    )


def peak_need(trace: Trace, curves: Curves) -> float:
    """Replicas the larger pool needs in the busiest minute at 80% utilization (fractional)."""
    d = demand(trace, curves, ORACLE_INTERVAL_S)
    prefill = d.prefill_work_s.max() / (ORACLE_INTERVAL_S * 0.8)
    kv = d.decode_kv_peak.max() / curves.kv_capacity_tokens
    decode = max(kv, d.decode_seqs_peak.max() / curves.max_num_seqs) / 0.8
    return float(max(prefill, decode))


def rate_factor(trace: Trace, curves: Curves, peak: float) -> float:
    """Scales until the busiest minute needs `peak` replicas (two corrections: copies are
    random, so the scaled peak is not exactly proportional)."""
    factor = peak / peak_need(trace, curves)
    for _ in range(2):
        factor *= peak / peak_need(scale_rate(trace, factor), curves)
    return factor


def find_oracle(trace: Trace, curves: Curves, slo: Slo) -> tuple[dict[str, np.ndarray], str]:
    """The highest utilization per pool (on a 0.05 grid) at which the oracle's sizes still meet
    TTFT (prefill) and TPOT (decode) for 99.5% of requests (or what the most generous sizes
    reach, if less): a bisection per pool, both pools in the same simulations (each pool's
    latency hardly depends on the other's size)."""
    d = demand(trace, curves, ORACLE_INTERVAL_S)

    def attained(rho: Mapping[str, float]) -> dict[str, float]:
        control = oracle(oracle_sizes(d, curves, rho), ORACLE_INTERVAL_S, lead(curves))
        s = score(run(trace, curves, control, initial(control)), slo, 0.0)
        return {"prefill": s.ttft_ok, "decode": s.tpot_ok}

    # some requests miss on any fleet (prompts too long for the TTFT target, hand-offs too long
    # for their few tokens): the aim is what the most generous sizes reach, at most 99.5%
    generous = attained({p: RHOS[-1] for p in POOLS})
    aim = {p: min(0.995, generous[p] - 0.001) for p in POOLS}
    lo = {p: 0 for p in POOLS}  # indices into RHOS (descending): lo fails or is unknown
    hi = {p: len(RHOS) - 1 for p in POOLS}  # hi passes
    while any(hi[p] - lo[p] > 1 for p in POOLS):
        mid = {p: (lo[p] + hi[p]) // 2 for p in POOLS}
        got = attained({p: RHOS[mid[p]] for p in POOLS})
        for pool, ok in got.items():
            if hi[pool] - lo[pool] > 1:
                if ok >= aim[pool]:
                    hi[pool] = mid[pool]
                else:
                    lo[pool] = mid[pool]
    best = {p: RHOS[hi[p]] for p in POOLS}
    note = f"utilization prefill {best['prefill']:.2f}, decode {best['decode']:.2f}"
    return oracle_sizes(d, curves, best), note


def lead(curves: Curves) -> float:
    return curves.startup_s + INTERVAL_S


def initial(oracle_control: Controller) -> dict[str, int]:
    """Every autoscaler starts where the oracle does at 0 s: the sizes the first minutes need."""
    return dict(oracle_control(Fleet(EMPTY, h100_8b(), {p: 0 for p in POOLS}, DT_S), 0.0))


SCALE_DOWN_S = [300.0]  # main() sets it from --scale-down-s
# Every fleet serves late prompts last, as workers given the TTFT target do by default
# (runtime.latePromptsLast); --fcfs: first come, first served. The oracles' sizes are found
# first come, first served either way.
FCFS = [False]


def late_after(slo: Slo) -> float | None:
    """The replay's `late_after_s` for an SLO: its TTFT target, or None with --fcfs."""
    return None if FCFS[0] else slo.ttft_s


def policy_config(curves: Curves, slo: Slo) -> ScalingConfig:
    limits = PoolLimits(
        min_replicas=1, max_replicas=200, gpus_per_replica=1, max_num_seqs=curves.max_num_seqs
    )
    return ScalingConfig(
        pools={"prefill": limits, "decode": limits},
        ttft_s=slo.ttft_s,
        tpot_s=slo.tpot_s,
        percentile=PERCENTILE,
        startup_s=curves.startup_s,
        scale_down_stabilization_s=SCALE_DOWN_S[0],
    )


def oracles(
    sizes: Mapping[str, np.ndarray], curves: Curves, window_s: float
) -> tuple[Controller, Controller]:
    """The oracle, and the oracle held through the scale-down window `window_s`."""
    best = oracle(sizes, ORACLE_INTERVAL_S, lead(curves))
    return best, oracle(held(sizes, window_s, ORACLE_INTERVAL_S), ORACLE_INTERVAL_S, lead(curves))


def compare(
    trace: Trace, curves: Curves, slo: Slo, log: list[str]
) -> dict[str, tuple[Fleet, Score]]:
    sizes, note = find_oracle(trace, curves, slo)
    peak = {p: int(sizes[p].max()) for p in POOLS}
    mean = {p: max(1, round(float(sizes[p].mean()))) for p in POOLS}
    print(f"  oracle {note}; static peak {peak}, static mean {mean}", flush=True)
    config = policy_config(curves, slo)
    window_s = config.scale_down_stabilization_s
    best, bound = oracles(sizes, curves, window_s)
    start = initial(best)
    # each controller, its sizes at 0 s and how often it decides
    controllers: dict[str, tuple[Controller, Mapping[str, int], float]] = {
        "static peak": (static(peak), peak, INTERVAL_S),
        "static mean": (static(mean), mean, INTERVAL_S),
        "HPA": (hpa(WINDOW_S), start, INTERVAL_S),
        # HPA with the utilization target a user would lower it to for the SLO
        f"HPA {HPA_SLO_TARGET:g}": (hpa(WINDOW_S, HPA_SLO_TARGET), start, INTERVAL_S),
        "KEDA": (keda(), start, INTERVAL_S),
        "ours": (ours(config, log), start, config.interval_s),
        f"oracle held {window_s:g} s": (bound, start, INTERVAL_S),
        "oracle": (best, start, INTERVAL_S),
    }
    results = {}
    for name, (control, sizes_at_0, interval_s) in controllers.items():
        started = time.perf_counter()
        fleet = run(trace, curves, control, sizes_at_0, interval_s, late_after(slo))
        results[name] = (fleet, score(fleet, slo, time.perf_counter() - started))
    return results


def print_table(results: Mapping[str, tuple[Fleet, Score]], slo: Slo) -> None:
    q = f"p{PERCENTILE * 100:g}"
    oracle_hours = results["oracle"][1].gpu_hours
    bound = next(name for name in results if name.startswith("oracle held"))
    bound_hours = results[bound][1].gpu_hours
    rows = [
        ("", *results),
        ("SLO attainment", *(f"{s.attainment:.2%}" for _, s in results.values())),
        (
            f"TTFT {q} (target {slo.ttft_s:g} s)",
            *(f"{s.ttft_q:.2f} s" for _, s in results.values()),
        ),
        (
            f"TPOT {q} (target {slo.tpot_s * 1000:g} ms)",
            *(f"{s.tpot_q * 1000:.1f} ms" for _, s in results.values()),
        ),
        ("goodput req/s", *(f"{s.goodput:.2f}" for _, s in results.values())),
        ("GPU-hours", *(f"{s.gpu_hours:.1f}" for _, s in results.values())),
        ("GPU-hours / oracle", *(f"{s.gpu_hours / oracle_hours:.2f}" for _, s in results.values())),
        (
            f"GPU-hours / {bound}",
            *(f"{s.gpu_hours / bound_hours:.2f}" for _, s in results.values()),
        ),
        ("SLO-met requests per GPU-hour", *(f"{s.per_gpu_hour:.0f}" for _, s in results.values())),
        ("scale events", *(str(s.scale_events) for _, s in results.values())),
        ("simulation wall s", *(f"{s.seconds:.1f}" for _, s in results.values())),
    ]
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows[1:]:
        print("| " + " | ".join(row) + " |")


def replay(name: str, trace: Trace, curves: Curves, slo: Slo, out_dir: Path) -> None:
    log: list[str] = []
    results = compare(trace, curves, slo, log)
    print_table(results, slo)
    path = out_dir / f"autoscale_{name}.png"
    plot_runs(results, slo, WINDOW_S, PERCENTILE, path, f"{name}: {trace.note}")
    print(f"  plot: {path}; our policy's first decisions:", *log[:6], sep="\n    ")


def code_completion(trace: Trace, curves: Curves, peak: float) -> Trace:
    """`trace`'s arrivals with code-completion lengths (Mooncake conversation prompts, answers
    of 1-30 tokens), rate-scaled as the traces are (the busiest minute needs `peak` replicas)."""
    code = code_lengths(trace, load("mooncake_conversation"), seed=0)
    return scale_rate(code, rate_factor(code, replace(curves, streamed=False), peak))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--traces", type=lambda v: v.split(","), default=list(NAMES))
    p.add_argument("--peak", type=float, default=12.0, help="replicas the busiest minute needs")
    p.add_argument("--hard", default="azure2023_conv", help="trace for the harder variants")
    p.add_argument("--no-hard", action="store_true", help="skip the harder variants")
    p.add_argument(
        "--variants",
        type=lambda v: v.split(","),
        default=["bursts", "spike"],
        help="which harder variants (bursts, spike, onoff_chat, onoff_code); with --hard-only,\n"
        "the traces themselves are not replayed",
    )
    p.add_argument("--hard-only", action="store_true", help="only the harder variants")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).parent)
    p.add_argument(
        "--pull", action="store_true", help="the KV pulled after the prefill (before streaming)"
    )
    p.add_argument(
        "--startup-s", type=float, help="a new replica's start-up (default: the curves', 60 s)"
    )
    p.add_argument(
        "--scale-down-s",
        type=float,
        default=300.0,
        help="our policy's scaleDownStabilizationSeconds, and how long the held oracle holds",
    )
    p.add_argument(
        "--fcfs", action="store_true", help="first come, first served (not late prompts last)"
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    SCALE_DOWN_S[0] = args.scale_down_s
    FCFS[0] = args.fcfs
    curves = replace(h100_8b(), streamed=not args.pull)
    if args.startup_s is not None:
        curves = replace(curves, startup_s=args.startup_s)
    print(f"curves: {curves}")
    scaled: dict[str, Trace] = {}
    for name in args.traces:
        trace = load(name)
        # scaled on the pulled hand-off, as before streaming: both replay the same requests
        factor = rate_factor(trace, replace(curves, streamed=False), args.peak)
        scaled[name] = scale_rate(trace, factor)
        tr = scaled[name]
        print(
            f"\n## {name}: rate x{factor:.2f} -> {len(tr.arrival)} requests over "
            f"{tr.duration / 60:.0f} min ({len(tr.arrival) / tr.duration:.1f} req/s); "
            f"SLO TTFT {SLOS[name].ttft_s:g} s, TPOT {SLOS[name].tpot_s * 1000:g} ms at "
            f"p{PERCENTILE * 100:g} ({tr.note})",
            flush=True,
        )
        if not args.hard_only:
            replay(name, tr, curves, SLOS[name], args.out_dir)
    if args.no_hard or args.hard not in scaled:
        return
    base = scaled[args.hard]
    variants = {
        "bursts": lambda: compress_bursts(base),
        "spike": lambda: add_spike(base, at_s=base.duration / 2),
        "onoff_chat": lambda: on_off(base, seed=0),
        "onoff_code": lambda: on_off(code_completion(load(args.hard), curves, args.peak), seed=0),
    }
    for label, make in variants.items():
        if label not in args.variants:
            continue
        trace = make()
        print(f"\n## {args.hard}, harder ({label}): {trace.note}", flush=True)
        replay(f"{args.hard}_{label}", trace, curves, SLOS[args.hard], args.out_dir)


if __name__ == "__main__":
    main()
