"""A float8 KV pool (`--kv-cache-dtype fp8`) against one in the model's dtype: our engine both
times, same model, same requests, same process, rounds alternating.

Two settings. Memory-bound: both pools get the same bytes (--kv-mib), so the float8 one holds
four times the blocks of a float32 pool (twice a 16-bit one's) and runs more requests at once;
its gain is what a GPU's fixed memory gives. Compute only: both get the same number of blocks,
more than the requests need, so the ratio is the cost of rounding keys and values and reading
them back. Then the answers themselves: greedy tokens of the two pools side by side (the same
answer, or where they first differ), which on a trained model (--model smollm2) says what the
rounding costs in output.

    .venv/bin/python bench/kv_fp8.py                        # the bench model (100M), float32
    .venv/bin/python bench/kv_fp8.py --model smollm2        # SmolLM2-135M-Instruct, trained
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from pathlib import Path

import torch
from engine_throughput import TRACE, model_folder, random_prompt, sample_lengths

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
QUESTIONS = [  # for a chat model: answers in words, where a changed token shows
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Explain photosynthesis in two sentences.",
    "List the days of the week.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning to code.",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="a model source (default: the bench model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--scale", type=float, default=16.0, help="divide trace lengths by this")
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kv-mib",
        type=float,
        default=0.0,
        help="memory-bound pool size (0: a third of every request at once in the model's dtype)",
    )
    p.add_argument("--rounds", type=int, default=2)
    return p.parse_args()


def timed(engine: LLMEngine, prompts: list[list[int]], outs: list[int]) -> tuple[float, int]:
    """(seconds, preemptions) for the whole batch, greedy, exact output lengths."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outs]
    before = engine.stats().num_preemptions_total
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if [len(r.output_token_ids) for r in results] != outs:
        raise RuntimeError("wrong number of tokens")
    return elapsed, engine.stats().num_preemptions_total - before


def chats(engines: dict[str, LLMEngine]) -> None:
    """QUESTIONS answered greedily (48 tokens) by both pools, printed where they differ."""
    tokenizer = engines["auto"].tokenizer
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in QUESTIONS
    ]
    params = SamplingParams(max_tokens=48, temperature=0)
    said = {
        kv: [r.output_token_ids for r in e.generate(prompts, params)] for kv, e in engines.items()
    }
    same = sum(a == b for a, b in zip(said["auto"], said["fp8"], strict=True))
    print(f"\nchat answers: {same} of {len(QUESTIONS)} the same token for token")
    for question, a, b in zip(QUESTIONS, said["auto"], said["fp8"], strict=True):
        if a != b:
            print(f"  {question}\n    auto: {tokenizer.decode(a, skip_special_tokens=True)!r}")
            print(f"    fp8:  {tokenizer.decode(b, skip_special_tokens=True)!r}")


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main() -> None:
    args = parse_args()
    model = model_folder(args.model, args.dtype)
    lengths = sample_lengths(args)
    outs = [o for _, o in lengths]
    probe = LLMEngine(EngineConfig(model=str(model), dtype=args.dtype, num_kv_blocks=2))
    vocab, block_bytes = probe.hf_config.vocab_size, probe.runner.block_bytes()
    block_size = probe.runner.block_size
    del probe
    rng = random.Random(args.seed + 1)
    prompts = [random_prompt(p, vocab, rng) for p, _ in lengths]
    tokens = sum(p + o for p, o in lengths)
    blocks_all = sum(-(-(p + o) // block_size) for p, o in lengths) + 1
    mib = args.kv_mib or blocks_all * block_bytes / 3 / 2**20
    print(
        f"machine: {platform.processor() or platform.machine()}, torch threads "
        f"{torch.get_num_threads()}, {time.strftime('%Y-%m-%d %H:%M %Z')}, load average "
        f"{os.getloadavg()[0]:.1f}\nmodel {model.name}, {args.dtype}; {len(prompts)} requests, "
        f"{sum(p for p, _ in lengths)} prompt and {sum(outs)} output tokens; every request at "
        f"once needs {blocks_all} blocks ({blocks_all * block_bytes / 2**20:.1f} MiB in "
        f"{args.dtype})"
    )
    fp8_ratio = ELEMENT_BYTES[args.dtype] // ELEMENT_BYTES["fp8"]
    budget_blocks = max(2, int(mib * 2**20 // block_bytes))
    settings = {
        f"memory-bound ({mib:.1f} MiB)": {"auto": budget_blocks, "fp8": budget_blocks * fp8_ratio},
        "compute only": {"auto": blocks_all, "fp8": blocks_all},
    }
    answers: dict[str, list[list[int]]] = {}
    for name, blocks in settings.items():
        engines = {
            kv: LLMEngine(
                EngineConfig(
                    model=str(model),
                    dtype=args.dtype,
                    num_kv_blocks=n,
                    kv_cache_dtype=kv,
                    enable_prefix_caching=False,
                )  # fmt: skip
            )
            for kv, n in blocks.items()
        }
        for engine in engines.values():
            timed(engine, prompts[:2], [2, 2])  # warm-up
        best = {kv: (float("inf"), 0) for kv in engines}
        for _ in range(args.rounds):
            for kv, engine in engines.items():
                best[kv] = min(best[kv], timed(engine, prompts, outs))
        print(f"\n{name}:")
        for kv, (seconds, preempted) in best.items():
            print(
                f"  kv {kv:4s}: {blocks[kv]:5d} blocks, {tokens / seconds:7.0f} tokens/s "
                f"(prompt + output), {preempted} preemptions"
            )
        print(f"  fp8 / auto: {best['auto'][0] / best['fp8'][0]:.2f}x the throughput")
        if name == "compute only":
            params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outs]
            for kv, engine in engines.items():
                answers[kv] = [r.output_token_ids for r in engine.generate(prompts, params)]
            if engines["auto"].tokenizer.chat_template:
                chats(engines)
    diffs = [first_difference(a, b) for a, b in zip(answers["auto"], answers["fp8"], strict=True)]
    where = sorted(d for d in diffs if d is not None)
    print(
        f"\ngreedy answers: {diffs.count(None)} of {len(diffs)} the same token for token; the "
        f"others first differ at tokens {where}"
    )


if __name__ == "__main__":
    main()
