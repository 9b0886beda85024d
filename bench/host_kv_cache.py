"""The prefix cache's host tier (`--host-kv-cache-gib`) against the device pool alone: our
engine both times, same model, same requests, same process, on the Mooncake conversation
trace's real prefix sharing.

Each request of the trace names its 512-token prompt blocks by id (equal ids: a shared prefix,
mostly earlier turns of the same conversation). Scaled down by --scale, each id becomes a run of
512 / scale random tokens, the same run wherever the id recurs, so a later turn shares its
earlier turns' tokens. The requests are replayed in trace order, in the trace's own arrival
batches, on a device pool of --pool-tokens (far less than the trace's working set), with host
tiers of several sizes. Printed: prompt tokens computed and found in each tier, time to first
token, and the wall time of the whole replay, each as a ratio against the pool alone; and beside
each tier, what `phasefleet plan`'s model of the prefix cache (plan/prefix_cache.py) predicts
the engine finds in the same stream.

    PYTHONPATH=. .venv/bin/python bench/host_kv_cache.py                # the bench model (100M)
    PYTHONPATH=. .venv/bin/python bench/host_kv_cache.py --requests 1000 --tiers 0,16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from engine_throughput import model_folder

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.plan.prefix_cache import PrefixCaching, PrefixModel, PrefixStats
from phasefleet.plan.trace import Trace, from_arrays

TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake_conversation.jsonl"
TRACE_BLOCK = 512  # tokens per hash id in the trace


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="a model source (default: the bench model)")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--requests", type=int, default=400, help="the trace's first N requests")
    p.add_argument("--scale", type=int, default=32, help="divide the trace's lengths by this")
    p.add_argument("--max-prompt", type=int, default=1024, help="longest prompt, tokens")
    p.add_argument("--max-output", type=int, default=8)
    p.add_argument("--pool-tokens", type=int, default=8192, help="the device pool, tokens")
    p.add_argument(
        "--tiers",
        default="0,4,16",
        help="host tiers to compare, each as a multiple of the device pool (0: none)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time by the wall, or (cpu: one torch thread) by this process's CPU time, which"
        " other processes on a shared machine do not inflate",
    )
    return p.parse_args()


Request = tuple[int, list[int], int, list[int]]  # arrival ms, prompt, output tokens, block ids


def trace_requests(args: argparse.Namespace, vocab: int) -> list[Request]:
    """(arrival ms, prompt, output tokens, the block ids the prompt covers) of the trace's
    first requests, scaled down."""
    rng = random.Random(args.seed)
    run = TRACE_BLOCK // args.scale
    runs: dict[int, list[int]] = {}
    out = []
    with args.trace.open() as f:
        for line in f:
            row = json.loads(line)
            prompt: list[int] = []
            for block_id in row["hash_ids"]:
                if block_id not in runs:
                    runs[block_id] = [rng.randrange(10, vocab) for _ in range(run)]
                prompt += runs[block_id]
            length = min(max(1, row["input_length"] // args.scale), args.max_prompt)
            output = min(max(1, row["output_length"] // args.scale), args.max_output)
            covered = row["hash_ids"][: -(-length // run)]
            out.append((row["timestamp"], prompt[:length], output, covered))
            if len(out) == args.requests:
                break
    return out


clock = time.perf_counter


def as_trace(requests: list[Request], run: int, arrival_s: np.ndarray) -> Trace:
    """The requests as the planner's simulators read them: lengths and block ids of `run`
    tokens, arriving at `arrival_s`."""
    prompts = np.array([len(p) for _, p, _, _ in requests])
    outputs = np.array([o for _, _, o, _ in requests])
    ids = [b for _, _, _, b in requests]
    return from_arrays("bench", arrival_s, prompts, outputs, "", ids, run)


def modelled(
    requests: list[Request], run: int, pool_tokens: int, host_tokens: int, block_size: int
) -> PrefixStats:
    """What the planner's model of one replica's prefix cache finds in the same stream."""
    trace = as_trace(requests, run, np.arange(len(requests), dtype=float))
    caching = PrefixCaching(host_tokens=host_tokens, kv_block_tokens=block_size)
    model = PrefixModel(trace, caching, pool_tokens, 1)
    cache = model.new_cache()
    for i, prompt in enumerate(trace.prompt):
        model.admit(cache, i, float(prompt))
    return model.stats


def replay(engine: LLMEngine, requests: list[Request]) -> dict[str, float]:
    """Each arrival batch added at once and run to the end; TTFT from the batch's start."""
    ttfts: list[float] = []
    batches: dict[int, list[tuple[list[int], int]]] = {}
    for arrival, prompt, output, _ in requests:
        batches.setdefault(arrival, []).append((prompt, output))
    before = engine.stats()
    started = clock()
    for n, batch in enumerate(batches.values()):
        t0, waiting = clock(), set()
        for i, (prompt, output) in enumerate(batch):
            params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
            engine.add_request(f"{n}-{i}", prompt, params)
            waiting.add(f"{n}-{i}")
        while engine.has_unfinished_requests():
            for result in engine.step():
                if result.request_id in waiting and result.output_token_ids:
                    waiting.discard(result.request_id)
                    ttfts.append(clock() - t0)
    wall = clock() - started
    after = engine.stats()
    queried = after.prefix_cache_queries_total - before.prefix_cache_queries_total
    hits = after.prefix_cache_hits_total - before.prefix_cache_hits_total
    host = after.host_kv_cache_hits_total - before.host_kv_cache_hits_total
    return {
        "wall": wall,
        "computed": queried - hits,
        "device_hits": hits - host,
        "host_hits": host,
        "ttft_mean": statistics.mean(ttfts),
        "ttft_p90": statistics.quantiles(ttfts, n=10)[-1],
        "preempted": after.num_preemptions_total - before.num_preemptions_total,
    }


def main() -> None:
    global clock
    args = parse_args()
    if args.clock == "cpu":
        torch.set_num_threads(1)
        clock = time.process_time
    model = model_folder(args.model)
    probe = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=2))
    vocab, block_size = probe.hf_config.vocab_size, probe.runner.block_size
    block_bytes = probe.runner.host_block_bytes()
    del probe
    requests = trace_requests(args, vocab)
    pool_blocks = args.pool_tokens // block_size + 1
    prompt_tokens = sum(len(p) for _, p, _, _ in requests)
    print(
        f"machine: {platform.processor() or platform.machine()}, torch threads "
        f"{torch.get_num_threads()}, {time.strftime('%Y-%m-%d %H:%M %Z')}, load average "
        f"{os.getloadavg()[0]:.1f}, clock {args.clock}\nmodel {model.name}, float32; "
        f"{args.trace.name}: the first "
        f"{len(requests)} requests at 1/{args.scale} ({prompt_tokens} prompt tokens, "
        f"{len({a for a, _, _, _ in requests})} arrival batches); device pool {args.pool_tokens} "
        f"tokens ({(pool_blocks - 1) * block_bytes / 2**20:.0f} MiB)"
    )
    tiers = [float(t) for t in args.tiers.split(",")]

    def engine_for(multiple: float) -> LLMEngine:
        gib = multiple * (pool_blocks - 1) * block_bytes / 2**30
        config = EngineConfig(
            model=str(model), num_kv_blocks=pool_blocks, host_kv_cache_gib=gib, device="cpu"
        )
        return LLMEngine(config)

    # Untimed: the CPU's kernels for each new step shape are made on first use in a process.
    replay(engine_for(0.0), requests)
    results: dict[float, dict[str, float]] = {}
    for order in (tiers, tiers[::-1]):  # rounds in both orders; each tier's best kept
        for multiple in order:
            r = replay(engine_for(multiple), requests)  # a fresh engine: empty caches
            if multiple not in results or r["wall"] < results[multiple]["wall"]:
                results[multiple] = r
    for multiple, r in results.items():
        mib = multiple * (pool_blocks - 1) * block_bytes / 2**20
        name = f"host tier {multiple:g}x the pool ({mib:.0f} MiB)" if multiple else "pool alone"
        print(
            f"\n{name}:\n  prompt tokens computed {r['computed']:.0f}, found on the device "
            f"{r['device_hits']:.0f}, loaded from host memory {r['host_hits']:.0f}; "
            f"{r['preempted']:.0f} preemptions\n  TTFT mean {r['ttft_mean'] * 1000:.0f} ms, "
            f"p90 {r['ttft_p90'] * 1000:.0f} ms; replay {r['wall']:.1f} s (best of 2)"
        )
        run = TRACE_BLOCK // args.scale
        host = int(multiple * args.pool_tokens)
        m = modelled(requests, run, args.pool_tokens, host, block_size)
        computed = m.prompt_tokens - m.device_tokens - m.host_tokens
        print(
            f"  the planner's model of it: computed {computed}, found on the device "
            f"{m.device_tokens}, loaded from host memory {m.host_tokens}"
        )
    base = results.get(0.0)
    if base is None:
        return
    print("\nagainst the pool alone (same process, same requests):")
    for multiple, r in results.items():
        if multiple:
            print(
                f"  {multiple:g}x: prompt tokens computed {r['computed'] / base['computed']:.2f}x,"
                f" TTFT mean {r['ttft_mean'] / base['ttft_mean']:.2f}x, p90 "
                f"{r['ttft_p90'] / base['ttft_p90']:.2f}x, replay {base['wall'] / r['wall']:.2f}x"
                " as fast"
            )


if __name__ == "__main__":
    main()
