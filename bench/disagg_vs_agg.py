"""Where disaggregation pays: goodput per GPU of aggregated and disaggregated fleets of the same
GPU count in the simulator, as the request rate grows (DistServe's measure).

For every trace in ../shared/traces (a first segment: --segment-s seconds, or more where a
rough capacity would see fewer than --requests; rate-scaled by `scale_rate`), on the 8B/H100
roofline curves and on this CPU's measured curves (token counts divided by CPU_TOKEN_SCALE, as
bench/disagg_replay.py does to fit the bench model), and for three SLOs (the trace's from
autoscale_replay.SLOS, and its TPOT halved and doubled):
- aggregated (phasefleet/plan/aggregated_sim.py): --gpus workers, unchunked and at several
  token budgets;
- disaggregated (phasefleet/plan/disagg_sim.py, static pools): every P:D split of --gpus.
Goodput per GPU of a setup is the highest rate at which at least --target of the requests meet
both TTFT and TPOT, divided by its GPUs. The rates grow by RATE_STEP from LOWEST x a rough
per-GPU capacity; every setup's table reads goodput off that grid (linear between the highest
rate that meets the target and the next); the side-by-side table takes each mode's best
CANDIDATES by the grid and bisects between those two rates REFINE_STEPS times (to within
RATE_STEP^(1/2^REFINE_STEPS)), giving the highest rate found to meet it. One PNG per curves.

    .venv/bin/python bench/disagg_vs_agg.py
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from autoscale_curves import cpu_curves, h100_8b
from autoscale_policies import static
from autoscale_replay import DT_S, SLOS, Slo
from autoscale_traces import CONTEXT, NAMES, load, scale_rate
from disagg_vs_agg_plot import plot_attainment

from phasefleet.plan.aggregated_sim import simulate_aggregated
from phasefleet.plan.curves import Curves
from phasefleet.plan.disagg_sim import simulate
from phasefleet.plan.trace import Trace, latencies

CPU_TOKEN_SCALE = 8  # trace lengths / this on the CPU curves (the bench model, 32k KV tokens)
CHUNKS = {"h100": (512, 2048, 8192), "cpu": (128, 512, 2048)}  # aggregated token budgets
TPOT_SCALES = (0.5, 1.0, 2.0)  # x the trace's TPOT target
RATE_STEP = 1.15
LOWEST = 0.1  # the first rate, x the rough capacity per GPU
MAX_RATES = 28
CANDIDATES = 2  # setups per mode and SLO refined by bisection
REFINE_STEPS = 3


@dataclass(frozen=True)
class Setup:
    name: str
    gpus: int
    chunk_tokens: int = 0  # aggregated: the step's token budget; 0 for disaggregated
    prefill: int = 0  # disaggregated: replicas per pool
    decode: int = 0

    @property
    def aggregated(self) -> bool:
        return self.chunk_tokens > 0


def setups(chunks: tuple[int, ...], context: int, gpus: int) -> list[Setup]:
    """Aggregated unchunked and at every budget; disaggregated at every split of `gpus`."""
    agg = [Setup("agg unchunked", gpus, chunk_tokens=context)]
    agg += [Setup(f"agg chunk {b}", gpus, chunk_tokens=b) for b in chunks]
    dis = [
        Setup(f"disagg {p}P:{gpus - p}D", gpus, prefill=p, decode=gpus - p) for p in range(1, gpus)
    ]
    return agg + dis


def shrink(trace: Trace, scale: int) -> Trace:
    p = np.maximum(1, np.round(trace.prompt / scale)).astype(np.int64)
    o = np.maximum(1, np.round(trace.output / scale)).astype(np.int64)
    return Trace(trace.name, trace.arrival, p, o, f"{trace.note}; lengths / {scale}")


def segment(trace: Trace, seconds: float) -> Trace:
    keep = trace.arrival < seconds
    note = f"{trace.note}; first {seconds:.0f} s"
    return Trace(trace.name, trace.arrival[keep], trace.prompt[keep], trace.output[keep], note)


def capacity_per_gpu(trace: Trace, curves: Curves) -> float:
    """Requests/s one GPU would serve doing both phases at a full batch: only to place the
    rate grid."""
    c = curves
    kv = float(np.mean(trace.prompt + trace.output / 2))
    batch = max(1.0, min(c.max_num_seqs, c.kv_capacity_tokens / kv))
    step = c.decode_step_s(batch, batch * kv)
    work = [
        c.prefill_s(p) + (o - 1) * step / batch
        for p, o in zip(trace.prompt, trace.output, strict=True)
    ]
    return 1.0 / float(np.mean(work))


@dataclass(frozen=True)
class Replay:
    """A trace segment on one pair of curves, scored against a few SLOs."""

    trace: Trace
    curves: Curves  # the aggregated setups'
    dis_curves: Curves  # the disaggregated setups' (the same but for a what-if)
    slos: tuple[Slo, ...]

    def attainment(self, setup: Setup, rate: float) -> np.ndarray:
        """Share of the requests meeting both targets, per SLO [SLOs], at `rate` requests/s
        per GPU."""
        base = len(self.trace.arrival) / self.trace.duration
        scaled = scale_rate(self.trace, rate * setup.gpus / base)
        if setup.aggregated:
            curves = replace(self.curves, chunk_tokens=setup.chunk_tokens)
            agg = simulate_aggregated(scaled, curves, setup.gpus)
            first, finish = agg.first_token, agg.finish
        else:
            pools = {"prefill": setup.prefill, "decode": setup.decode}
            dis = simulate(scaled, self.dis_curves, static(pools), pools, interval_s=1e9, dt=DT_S)
            first, finish = dis.first_token, dis.finish
        ttft, tpot = latencies(scaled, first, finish)
        return np.array([((ttft <= s.ttft_s) & (tpot <= s.tpot_s)).mean() for s in self.slos])


@dataclass
class Sweep:
    rates: np.ndarray  # requests/s per GPU [R]
    attained: dict[Setup, np.ndarray]  # share meeting both targets [SLOs, R], NaN if not run
    seconds: float  # wall time of the simulations


def sweep(replay: Replay, runs: list[Setup], target: float) -> Sweep:
    """Raises the rate until every setup misses `target` on every SLO (or MAX_RATES); a setup
    is not run past two such misses in a row (one may be the noise of a small sample)."""
    started = time.perf_counter()
    rates = (
        capacity_per_gpu(replay.trace, replay.curves) * LOWEST * RATE_STEP ** np.arange(MAX_RATES)
    )
    attained = {s: np.full((len(replay.slos), MAX_RATES), np.nan) for s in runs}
    alive = list(runs)
    misses = dict.fromkeys(runs, 0)
    for k, rate in enumerate(rates):
        if not alive:
            break
        for s in list(alive):
            attained[s][:, k] = replay.attainment(s, rate)
            misses[s] = misses[s] + 1 if (attained[s][:, k] < target).all() else 0
            if misses[s] == 2:
                alive.remove(s)
    return Sweep(rates, attained, time.perf_counter() - started)


def crossing(attained: np.ndarray, target: float) -> int | None:
    """The highest grid index that meets `target`, if any."""
    met = np.flatnonzero(attained >= target)
    return int(met[-1]) if len(met) else None


def goodput(rates: np.ndarray, attained: np.ndarray, target: float) -> float:
    """Requests/s per GPU at `target` off the grid: the highest rate that meets it, moved
    toward the next (which misses) as far as the line between the two stays over it; 0 if
    none."""
    k = crossing(attained, target)
    if k is None:
        return 0.0
    if k + 1 == len(rates) or np.isnan(attained[k + 1]):
        return float(rates[k])
    share = (attained[k] - target) / (attained[k] - attained[k + 1])
    return float(rates[k] + share * (rates[k + 1] - rates[k]))


def refine(replay: Replay, sw: Sweep, setup: Setup, j: int, target: float) -> float:
    """Goodput of `setup` on SLO j: the highest rate found to meet `target`, bisecting (in
    log rate) between the grid's crossing and the next rate."""
    a = sw.attained[setup][j]
    k = crossing(a, target)
    if k is None:
        return 0.0
    if k + 1 == len(sw.rates) or np.isnan(a[k + 1]):
        return float(sw.rates[k])
    lo, hi = float(sw.rates[k]), float(sw.rates[k + 1])
    for _ in range(REFINE_STEPS):
        mid = math.sqrt(lo * hi)
        if replay.attainment(setup, mid)[j] >= target:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Best:
    setup: Setup | None  # None: no setup of the mode met the target at any rate run
    goodput: float  # requests/s per GPU, refined
    most: float  # the highest attainment any setup of the mode reached, at any rate run


def best(replay: Replay, sw: Sweep, aggregated: bool, j: int, target: float) -> Best:
    runs = [s for s in sw.attained if s.aggregated == aggregated]
    coarse = {s: goodput(sw.rates, sw.attained[s][j], target) for s in runs}
    top = sorted((s for s in runs if coarse[s] > 0), key=lambda s: -coarse[s])[:CANDIDATES]
    refined = {s: refine(replay, sw, s, j, target) for s in top}
    most = float(max(np.nanmax(sw.attained[s][j]) for s in runs))
    if not refined:
        return Best(None, 0.0, most)
    winner = max(refined, key=lambda s: refined[s])
    return Best(winner, refined[winner], most)


def slo_label(slo: Slo) -> str:
    return f"TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s * 1000:g} ms"


def report(name: str, replay: Replay, sw: Sweep, target: float, rows: list[str]) -> None:
    """Prints every setup's goodput per GPU off the grid; appends each mode's best per SLO,
    refined, to `rows`."""
    slos = replay.slos
    print("| setup (off the grid) | " + " | ".join(slo_label(s) for s in slos) + " |")
    print("|" + "---|" * (len(slos) + 1))
    for s, a in sw.attained.items():
        good = [goodput(sw.rates, a[j], target) for j in range(len(slos))]
        print(f"| {s.name} | " + " | ".join(f"{g:.3g}" for g in good) + " |")
    run = max(k for a in sw.attained.values() for k in np.flatnonzero(~np.isnan(a[0])))
    print(f"(rates {sw.rates[0]:.3g}-{sw.rates[run]:.3g} req/s per GPU; {sw.seconds:.0f} s)")
    for j, slo in enumerate(slos):
        agg, dis = best(replay, sw, True, j, target), best(replay, sw, False, j, target)
        cells = [
            f"{b.setup.name}: {b.goodput:.3g}" if b.setup else f"none ({b.most:.1%} at most)"
            for b in (agg, dis)
        ]
        ratio = f"{dis.goodput / agg.goodput:.2f}" if agg.setup and dis.setup else "-"
        rows.append(f"| {name} | {slo_label(slo)} | {cells[0]} | {cells[1]} | {ratio} |")
        print(rows[-1], flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--traces", type=lambda v: v.split(","), default=list(NAMES))
    p.add_argument("--curves", type=lambda v: v.split(","), default=["h100", "cpu"])
    p.add_argument("--gpus", type=int, default=12, help="GPUs of every fleet")
    p.add_argument("--segment-s", type=float, default=300.0, help="seconds of each trace, at least")
    p.add_argument(
        "--requests", type=int, default=4000, help="the segment's requests at the rough capacity"
    )
    p.add_argument("--target", type=float, default=0.9, help="SLO attainment goodput counts at")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).parent)
    p.add_argument("--handoff-gbps", type=float, help="what-if: the hand-off at this GB/s")
    p.add_argument(
        "--free-prefill-overhead",
        action="store_true",
        help="what-if: disaggregated prefills pay no fixed step overhead (prefill a = 0): the\n"
        "most that batching prompts, which autoscale_sim does not model, could give them",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    summary = [
        "| curves, trace | SLO | best aggregated | best disaggregated | disagg / agg |",
        "|---|---|---|---|---|",
    ]
    for key in args.curves:
        curves = h100_8b() if key == "h100" else cpu_curves()
        scale = 1 if key == "h100" else CPU_TOKEN_SCALE
        runs = setups(CHUNKS[key], CONTEXT // scale, args.gpus)
        dis_curves = curves
        if args.handoff_gbps:
            dis_curves = replace(dis_curves, handoff_bytes_per_s=args.handoff_gbps * 1e9)
        if args.free_prefill_overhead:
            dis_curves = replace(dis_curves, prefill=(0.0, *curves.prefill[1:]))
        print(f"\n## {curves.name}: {args.gpus} GPUs, goodput per GPU at {args.target:.0%}")
        if dis_curves != curves:
            print(f"what-if, disaggregated: {dis_curves}")
        sweeps, labels = {}, {}
        for name in args.traces:
            trace = load(name)
            trace = shrink(trace, scale) if scale > 1 else trace
            rough = capacity_per_gpu(trace, curves) * args.gpus  # requests/s of a fleet
            trace = segment(trace, max(args.segment_s, args.requests / rough))
            base = SLOS[name]
            slos = tuple(Slo(base.ttft_s, base.tpot_s * f) for f in TPOT_SCALES)
            replay = Replay(trace, curves, dis_curves, slos)
            print(f"\n### {name}: {len(trace.arrival)} requests in the segment ({trace.note})")
            sweeps[name] = sweep(replay, runs, args.target)
            labels[name] = [f"{name}\n{slo_label(s)}" for s in slos]
            report(f"{key}, {name}", replay, sweeps[name], args.target, summary)
        path = args.out_dir / f"disagg_vs_agg_{key}.png"
        title = f"{curves.name}: SLO attainment vs rate, {args.gpus} GPUs"
        plot_attainment(sweeps, labels, args.target, path, title)
        print(f"plot: {path}")
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
