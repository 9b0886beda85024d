"""Checks the simulators against the real local fleet on one trace segment.

The segment (Azure 2023 conversation trace, lengths divided by --scale, as in
bench/disagg_replay.py) is replayed with its arrival times against `phasefleet serve`'s fleet
of two workers of one CPU thread each, the bench model: 1 prefill + 1 decode, every prompt
prefilled remotely (`--mode disaggregated`, phasefleet/plan/disagg_sim.py), or 2 aggregated workers
with a token budget of `--chunk` per step (`--mode aggregated`, phasefleet/plan/aggregated_sim.py; a
budget over the longest prompt is unchunked). The same segment is simulated with the curves
measured on this CPU (bench/autoscale_cpu.json, from bench/autoscale_measure.py) for the same
static fleet. Printed: TTFT and TPOT percentiles, predicted vs measured, with the error.

    .venv/bin/python bench/autoscale_validate.py --model /tmp/pf-bench --duration 60
    .venv/bin/python bench/autoscale_validate.py --model /tmp/pf-bench --mode aggregated --chunk 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
from autoscale_curves import CPU_JSON, cpu_curves
from autoscale_policies import static
from disagg_replay import MODEL_NAME, replay, warm_up
from trace_segment import AZURE_CONV, as_trace, load_segment

from phasefleet.local.fleet import Fleet as LocalFleet
from phasefleet.local.fleet import FleetConfig, free_port
from phasefleet.plan.aggregated_sim import AggregatedFleet, simulate_aggregated
from phasefleet.plan.disagg_sim import Fleet, simulate

PERCENTILES = (50, 90, 99)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="make-tiny DIR --preset bench")
    p.add_argument("--curves", type=Path, default=CPU_JSON)
    p.add_argument("--start", type=float, default=0.0, help="segment start, s into the trace")
    p.add_argument("--duration", type=float, default=60.0, help="segment length, seconds")
    p.add_argument("--scale", type=float, default=8.0, help="divide trace lengths by this")
    p.add_argument("--max-prompt", type=int, default=1024, help="prompt cap after scaling")
    p.add_argument("--every", type=int, default=1, help="keep every Nth request (lighter load)")
    p.add_argument("--num-kv-blocks", type=int, default=2048, help="as when measured")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    p.add_argument("--mode", choices=("disaggregated", "aggregated"), default="disaggregated")
    p.add_argument("--chunk", type=int, default=2048, help="tokens per step (the budget)")
    return p.parse_args()


def measure(args: argparse.Namespace, segment: list, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(TTFT, TPOT) per request on the real fleet; TPOT NaN for one-token answers."""
    worker_args = ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.mode == "disaggregated":
        return measure_fleet(
            args.model, {"prefill": 1, "decode": 1}, args.chunk, worker_args, segment, vocab
        )
    return measure_fleet(args.model, {"worker": 2}, args.chunk, worker_args, segment, vocab)


def measure_fleet(
    model: Path,
    pools: dict[str, int],
    chunk: int,
    worker_args: list[str],
    segment: list,
    vocab: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(TTFT, TPOT) per request of `segment` replayed on a local fleet of `pools` (prefill and
    decode: every prompt handed off; or worker), `chunk` tokens per step; TPOT NaN for
    one-token answers."""
    worker_args = [*worker_args, "--log-level", "warning", "--max-num-batched-tokens", str(chunk)]
    if "prefill" in pools:
        worker_args += ["--remote-prefill-min-tokens", "0"]
    with tempfile.TemporaryDirectory(prefix="pf-validate-") as tmp:
        local = LocalFleet(
            FleetConfig(
                model=str(model),
                served_model_name=MODEL_NAME,
                port=free_port(),
                pools=pools,
                run_dir=Path(tmp),
                worker_args=worker_args,
                router_args=["--log-level", "warning"],
                drain_timeout=5.0,
            )
        )
        local.start()
        try:

            async def drive() -> list:
                limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
                async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                    await warm_up(client, local.url, vocab)
                    time.sleep(2.0)
                    return await replay(client, local.url, segment)

            timings = asyncio.run(drive())
        finally:
            local.stop()
    failed = [t.error for t in timings if not t.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    ttft = np.array([t.ttft for t in timings])
    tpot = np.array([np.nan if t.tpot is None else t.tpot for t in timings])
    return ttft, tpot


def predict(args: argparse.Namespace, segment: list, clock: str) -> tuple[np.ndarray, np.ndarray]:
    trace = as_trace(segment)
    curves = replace(cpu_curves(args.curves, clock), chunk_tokens=args.chunk)
    if args.mode == "aggregated":
        fleet: Fleet | AggregatedFleet = simulate_aggregated(trace, curves, 2)
    else:
        pools = {"prefill": 1, "decode": 1}
        fleet = simulate(trace, curves, static(pools), pools, interval_s=60.0, dt=0.005)
    long = trace.output > 1
    tpot = np.full(len(trace.arrival), np.nan)
    tpot[long] = (fleet.finish[long] - fleet.first_token[long]) / (trace.output[long] - 1)
    return fleet.first_token - trace.arrival, tpot


def cpu_segment(args: argparse.Namespace) -> tuple[list, int]:
    """(the Azure segment the flags name, every --every-th request; the bench model's
    vocabulary), with one thread per worker from here on, as the curves were measured."""
    os.environ["OMP_NUM_THREADS"] = "1"
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    segment = load_segment(
        AZURE_CONV, args.start, args.duration, args.scale, args.max_prompt, vocab
    )[:: args.every]
    return segment, vocab


def main() -> None:
    args = parse_args()
    segment, vocab = cpu_segment(args)
    print(
        f"{len(segment)} requests, {args.start:.0f}+{args.duration:.0f} s of {AZURE_CONV.name}, "
        f"lengths / {args.scale:g}; {args.mode}, {args.chunk} tokens per step; "
        f"load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    predicted = {clock: predict(args, segment, clock) for clock in ("cpu", "wall")}
    measured = measure(args, segment, vocab)
    print(f"load after: {os.getloadavg()[0]:.1f}\n")
    print("| metric | measured ms | predicted, CPU-time curves | predicted, wall-time curves |")
    print("|---|---|---|---|")
    numbers = {}
    for k, name in enumerate(("TTFT", "TPOT")):
        for q in PERCENTILES:
            mv = float(np.nanpercentile(measured[k], q))
            row = [f"| {name} p{q} | {mv * 1000:.0f}"]
            for clock, p in predicted.items():
                pv = float(np.nanpercentile(p[k], q))
                numbers[f"{name} p{q} {clock}"] = (pv, mv)
                row.append(f"{pv * 1000:.0f} ({(pv - mv) / mv:+.0%})")
            print(" | ".join(row) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps(numbers, indent=1))


if __name__ == "__main__":
    main()
