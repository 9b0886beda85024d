"""Measures one replica's speed curves on this CPU, for the autoscaling simulator.

Prefill time vs prompt tokens and decode step time vs batch size and KV tokens come from our
engine in this process (one request per prefill, `OMP_NUM_THREADS` threads, the step timed by
wall clock and by this process's CPU time); start-up time is `phasefleet worker` process start
to `/health` answering 200. Each point is the median of its repeats, after a warm-up pass over
every shape (oneDNN builds a primitive per row count the first time it sees it). Written as
JSON next to this file; autoscale_curves.cpu_curves fits the simulator's curves to it.

    .venv/bin/phasefleet make-tiny /tmp/pf-bench --preset bench
    OMP_NUM_THREADS=1 .venv/bin/python bench/autoscale_measure.py --model /tmp/pf-bench
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from autoscale_curves import cpu_curves

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.local.fleet import free_port
from phasefleet.local.process import Child

PREFILL_TOKENS = (16, 32, 64, 128, 256, 512, 1024)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 48)
DECODE_CONTEXTS = (32, 384)  # prompt tokens of every request in the batch
DECODE_STEPS = 8  # timed decode steps per point


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="make-tiny DIR --preset bench")
    p.add_argument("--num-kv-blocks", type=int, default=2048, help="as the validation fleet")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--startups", type=int, default=3, help="worker processes started and timed")
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("autoscale_cpu.json"))
    return p.parse_args()


class Clock:
    """Wall and process-CPU seconds since start."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def elapsed(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def prompt(n: int, rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def time_prefill(eng: LLMEngine, n: int, rng: random.Random, vocab: int) -> tuple[float, float]:
    rid = f"p{rng.random()}"
    eng.add_request(rid, prompt(n, rng, vocab), SamplingParams(max_tokens=1, ignore_eos=True))
    clock = Clock()
    while eng.has_unfinished_requests():
        eng.step()
    return clock.elapsed()


def time_decode(
    eng: LLMEngine, batch: int, context: int, rng: random.Random, vocab: int
) -> tuple[float, float]:
    """Median seconds of one decode step with `batch` requests of `context` prompt tokens."""
    params = SamplingParams(max_tokens=DECODE_STEPS + 4, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"d{i}-{rng.random()}", prompt(context, rng, vocab), params)
    started: set[str] = set()
    while len(started) < batch:  # prefill steps (each request's first token)
        started.update(o.request_id for o in eng.step() if o.new_token_ids)
    walls, cpus = [], []
    for _ in range(DECODE_STEPS):
        clock = Clock()
        eng.step()
        wall, cpu = clock.elapsed()
        walls.append(wall)
        cpus.append(cpu)
    while eng.has_unfinished_requests():
        eng.step()
    return statistics.median(walls), statistics.median(cpus)


def time_startup(args: argparse.Namespace, run_dir: Path) -> float:
    port = free_port()
    argv = [sys.executable, "-m", "phasefleet.cli", "worker", "--model", str(args.model)]
    argv += ["--port", str(port), "--num-kv-blocks", str(args.num_kv_blocks)]
    child = Child("worker", [*argv, "--log-level", "warning"], port, run_dir / "worker.log")
    started = time.perf_counter()
    child.start()
    try:
        child.wait_healthy(timeout=300)
        return time.perf_counter() - started
    finally:
        child.terminate()
        child.wait(10)


def main() -> None:
    args = parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads()
    torch.set_num_threads(threads)
    load_before = os.getloadavg()[0]
    eng = LLMEngine(
        EngineConfig(
            model=str(args.model),
            num_kv_blocks=args.num_kv_blocks,
            enable_prefix_caching=False,
            max_num_batched_tokens=2048,
        )
    )
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prefill: dict[int, list[tuple[float, float]]] = {n: [] for n in PREFILL_TOKENS}
    decode: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for repeat in range(args.repeats + 1):  # pass 0 warms up every shape and is dropped
        for n in PREFILL_TOKENS:
            timed = time_prefill(eng, n, rng, vocab)
            if repeat:
                prefill[n].append(timed)
        for context in DECODE_CONTEXTS:
            for batch in DECODE_BATCHES:
                timed = time_decode(eng, batch, context, rng, vocab)
                if repeat:
                    decode.setdefault((batch, context), []).append(timed)
        print(f"pass {repeat} done, load {os.getloadavg()[0]:.1f}", flush=True)
    run_dir = Path(f"/tmp/pf-autoscale-measure-{os.getpid()}")
    startups = [time_startup(args, run_dir) for _ in range(args.startups)]

    def med(values: list[tuple[float, float]], i: int) -> float:
        return statistics.median(v[i] for v in values)

    result = {
        "how": __doc__,
        "date_utc": f"{datetime.now(UTC):%Y-%m-%d %H:%M}",
        "machine": f"{os.cpu_count()} CPUs, load average {load_before:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end (shared with other agents)",
        "model": str(args.model),
        "threads": threads,
        "prefill_wall_s": {n: med(v, 0) for n, v in prefill.items()},
        "prefill_cpu_s": {n: med(v, 1) for n, v in prefill.items()},
        "decode_step_wall_s": {f"{b}x{c}": med(v, 0) for (b, c), v in sorted(decode.items())},
        "decode_step_cpu_s": {f"{b}x{c}": med(v, 1) for (b, c), v in sorted(decode.items())},
        "startup_s": startups,
        "kv_capacity_tokens": (args.num_kv_blocks - 1) * 16,
        "decode_steps": DECODE_STEPS,  # timed per point; KV tokens = batch x (prompt + half)
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for clock in ("cpu", "wall"):
        print(cpu_curves(args.out, clock), f"-> {args.out}")


if __name__ == "__main__":
    main()
