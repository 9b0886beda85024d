"""Tensor parallelism on this CPU: prefill latency of a 2048-token prompt and the decode step
at batch 1 and 16, N=1 (one process, every core) vs N=2 (two ranks, cores split between them),
side by side in one run on the same model (`make-tiny --preset bench`, or --model).

On a 2-core machine N=2 adds no compute (each rank gets one core of the two N=1 uses); what it
shows is the cost of the split itself: two all-reduces per layer, the embedding's all-reduce,
the logits' gather, and rank 0 sending each step to the other rank.

    .venv/bin/python bench/tensor_parallel.py                # 2048-token prefill, b=1 and 16
    .venv/bin/python bench/tensor_parallel.py --quick        # shorter, for a smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.tiny import make_tiny

CACHE = Path.home() / ".cache/phasefleet/bench-models"


def prefill_ms(engine: LLMEngine, length: int, rounds: int) -> float:
    """Median wall time of the one step that prefills a `length`-token prompt (no cache hit)."""
    times = []
    for r in range(rounds):
        prompt = [(7 * i + 13 * r) % 4000 + 5 for i in range(length)]  # differs every round
        engine.add_request(f"p{r}", prompt, SamplingParams(max_tokens=1, temperature=0))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def decode_ms(engine: LLMEngine, batch: int, context: int, steps: int) -> float:
    """Median wall time of a decode step of `batch` requests at about `context` tokens."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for b in range(batch):
        prompt = [(11 * i + 17 * b) % 4000 + 5 for i in range(context)]
        engine.add_request(f"d{batch}-{b}", prompt, params)
    while engine.scheduler.waiting or any(  # until every prompt is in
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model folder (default: the bench preset)")
    parser.add_argument("--prompt", type=int, default=2048, help="prefill prompt, tokens")
    parser.add_argument("--context", type=int, default=512, help="decode context, tokens")
    parser.add_argument("--batches", default="1,16", help="decode batch sizes")
    parser.add_argument("--rounds", type=int, default=5, help="prefills timed per degree")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per batch")
    parser.add_argument("--quick", action="store_true", help="short prompt and few rounds")
    args = parser.parse_args()
    if args.quick:
        args.prompt, args.context, args.rounds, args.steps = 256, 64, 2, 4
    folder = args.model or CACHE / "bench-llama"
    if not (folder / "config.json").is_file():
        make_tiny(folder, arch="llama", preset="bench", seed=0)
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"# tensor parallelism on the CPU: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, model {folder.name}"
    )
    rows: dict[int, list[float]] = {}
    for size in (1, 2):
        config = EngineConfig(
            model=str(folder), device="cpu", dtype="float32", tensor_parallel_size=size,
            max_num_batched_tokens=max(2048, args.prompt), max_num_seqs=max(batches),
            num_kv_blocks=max(batches) * (-(-(args.context + args.steps + 8) // 16)) + 160,
            enable_prefix_caching=False,
        )  # fmt: skip
        engine = LLMEngine(config)
        try:
            prefill_ms(engine, 32, 1)  # warm-up
            rows[size] = [prefill_ms(engine, args.prompt, args.rounds)]
            rows[size] += [decode_ms(engine, b, args.context, args.steps) for b in batches]
        finally:
            engine.close()
        torch.set_num_threads(os.cpu_count() or 1)  # rank 0 took its share; give it back
    names = [f"prefill {args.prompt} tokens"] + [f"decode step, batch {b}" for b in batches]
    print("\n| | N=1 (ms) | N=2 (ms) | N=2 / N=1 |\n|---|---|---|---|")
    for i, name in enumerate(names):
        one, two = rows[1][i], rows[2][i]
        print(f"| {name} | {one:.1f} | {two:.1f} | {two / one:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
