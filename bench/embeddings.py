"""Embedding throughput: our engine vs transformers' base model, same model, same process.

Inputs take their lengths from the ShareGPT trace's prompts (divided by --scale), as random
token ids. Two workloads: `distinct` (nothing shared) and `instructed` (every input starts with
the same --instruction-tokens, as Qwen3-Embedding's "Instruct: ...\\nQuery: " prompts do).
transformers runs batches of --hf-batch-sizes with right padding and reads each input's last
real token, in arrival order (as a server meets them) and sorted by length (the least padding:
an oracle's best case); ours takes every input at once (add_embedding_request) and schedules
them itself, with the prefix cache on.
Both give the last token's final hidden state; the run checks they agree before timing.

    .venv/bin/python bench/embeddings.py --num-inputs 64
    .venv/bin/python bench/embeddings.py --num-inputs 64 --instruction-tokens 256
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModel

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.tiny import make_tiny

TRACE = Path(__file__).resolve().parents[2] / "shared/traces/sharegpt_8k_stats.csv"
MODEL = Path.home() / ".cache/phasefleet/bench-llama-100m"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL, help="model folder (made if missing)")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--num-inputs", type=int, default=64)
    p.add_argument("--scale", type=float, default=4.0, help="divide trace lengths by this")
    p.add_argument("--max-input", type=int, default=512, help="input length cap, tokens")
    p.add_argument("--instruction-tokens", type=int, default=48)
    p.add_argument("--hf-batch-sizes", default="8,32")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2, help="best of this many runs each")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def input_lengths(args: argparse.Namespace) -> list[int]:
    with args.trace.open() as f:
        rows = [int(r["num_prefill_tokens"]) for r in csv.DictReader(f)]
    rng = random.Random(args.seed)
    picks = [rng.choice(rows) for _ in range(args.num_inputs)]
    return [max(4, min(args.max_input, round(n / args.scale))) for n in picks]


def run_ours(eng: LLMEngine, inputs: list[list[int]]) -> tuple[float, list[np.ndarray]]:
    start = time.perf_counter()
    for i, ids in enumerate(inputs):
        eng.add_embedding_request(f"e{i}", ids)
    done: dict[str, np.ndarray] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished and out.embedding is not None:
                done[out.request_id] = out.embedding
    seconds = time.perf_counter() - start
    return seconds, [done[f"e{i}"] for i in range(len(inputs))]


@torch.inference_mode()
def run_hf(
    model: Any, inputs: list[list[int]], batch: int, sort: bool
) -> tuple[float, list[np.ndarray]]:
    order = list(range(len(inputs)))
    if sort:
        order.sort(key=lambda i: len(inputs[i]))
    vectors: dict[int, np.ndarray] = {}
    start = time.perf_counter()
    for k in range(0, len(order), batch):
        rows = order[k : k + batch]
        width = max(len(inputs[i]) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, : len(inputs[i])] = torch.tensor(inputs[i])
            mask[r, : len(inputs[i])] = 1
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = mask.sum(1) - 1
        for r, i in enumerate(rows):
            vectors[i] = hidden[r, last[r]].numpy()
    return time.perf_counter() - start, [vectors[i] for i in range(len(inputs))]


def main() -> None:
    args = parse_args()
    if not (args.model / "config.json").is_file():
        make_tiny(args.model, arch="llama", preset="bench", seed=0)
    config = EngineConfig(
        model=str(args.model), device="cpu", max_num_batched_tokens=args.max_num_batched_tokens
    )
    eng = LLMEngine(config)
    hf: Any = AutoModel.from_pretrained(args.model, dtype=torch.float32).eval()
    vocab = eng.hf_config.vocab_size
    rng = random.Random(args.seed + 1)
    lengths = input_lengths(args)
    instruction = [rng.randrange(5, vocab) for _ in range(args.instruction_tokens)]
    workloads = {
        "distinct": [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths],
        "instructed": [instruction + [rng.randrange(5, vocab) for _ in range(n)] for n in lengths],
    }
    print(
        f"machine: {platform.processor() or platform.machine()}, torch threads "
        f"{torch.get_num_threads()}, {time.strftime('%Y-%m-%d %H:%M %Z')}, load average "
        f"{os.getloadavg()[0]:.1f}; model {args.model.name}, hidden {hf.config.hidden_size}, "
        f"{hf.config.num_hidden_layers} layers, float32"
    )
    batches = [int(b) for b in args.hf_batch_sizes.split(",")]
    for name, inputs in workloads.items():
        tokens = sum(len(i) for i in inputs)
        _, ours = run_ours(eng, inputs[:4])  # warm-up, and the check
        _, theirs = run_hf(hf, inputs[:4], 4, sort=False)
        worst = max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs, strict=True))
        if worst > 1e-3:
            raise SystemExit(f"{name}: ours and transformers differ by {worst:g}")
        settings = [(b, sort) for b in batches for sort in (False, True)]
        t_ours, t_hf = float("inf"), {k: float("inf") for k in settings}
        for _ in range(args.rounds):  # alternating, best of each: outside load lands on both
            fresh = LLMEngine(config)  # an empty prefix cache each round
            t_ours = min(t_ours, run_ours(fresh, inputs)[0])
            fresh.close()
            for b, sort in settings:
                t_hf[b, sort] = min(t_hf[b, sort], run_hf(hf, inputs, b, sort)[0])
        print(
            f"{name}: {len(inputs)} inputs, {tokens} tokens (mean {tokens / len(inputs):.0f}); "
            f"ours {t_ours:.2f} s ({tokens / t_ours:.0f} tok/s); transformers "
            + ", ".join(
                f"batch {b} {'sorted' if sort else 'arrival'} {t:.2f} s"
                for (b, sort), t in t_hf.items()
            )
        )
        for sort in (False, True):
            best = min(t for (_, so), t in t_hf.items() if so == sort)
            order = "sorted by length" if sort else "arrival order"
            print(f"  ratio (ours / best transformers, {order}): {best / t_ours:.2f}x")


if __name__ == "__main__":
    main()
