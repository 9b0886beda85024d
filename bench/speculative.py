"""Speculative decoding by prompt lookup: our engine with drafts vs the same engine without,
same model, same process, greedy or seeded sampling, on answers that repeat their context (an
edited passage, a refactored function, a quoted passage, a record written out as JSON under a
JSON schema) and on one that does not (a plain question).

Each prompt runs alone (batch 1: latency) and all together (a batch); output tokens per second,
the ratio to no drafts, the share of draft tokens the model accepted and the engine steps each
took. The answers with and without drafts must be the same tokens (greedy, or sampled with a
seed): checked.

    .venv/bin/python bench/speculative.py                     # SmolLM2-135M-Instruct, k = 4
    .venv/bin/python bench/speculative.py --k 2 --max-tokens 64
    .venv/bin/python bench/speculative.py --temperature 0.7   # sampled, seeded
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import Grammar, SamplingParams

PASSAGE = (
    "PhaseFleet runs prefill and decode as separate pools. The router sends each prompt to a "
    "prefill worker, which computes its KV cache and streams it to a decode worker. The decode "
    "worker writes the answer one token at a time. Pools grow and shrink to hold the latency "
    "targets at the lowest cost."
)
FUNCTION = """def mean(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)
"""
RECORD = {
    "name": "Ada Lovelace",
    "city": "London",
    "role": "analyst of the Analytical Engine",
    "notes": "wrote the first published program, for Bernoulli numbers, in 1843",
}
RECORD_SCHEMA = {
    "type": "object",
    "properties": {key: {"type": "string"} for key in RECORD},
    "required": list(RECORD),
    "additionalProperties": False,
}
# (kind, user message, grammar): all but the story repeat their context
TASKS: list[tuple[str, str, Grammar | None]] = [
    ("edit", f"Rewrite this text, replacing 'pools' with 'groups':\n\n{PASSAGE}", None),
    ("code", f"Add a docstring to this Python function and return it whole:\n\n{FUNCTION}", None),
    ("quote", f"Repeat the following text exactly:\n\n{PASSAGE}", None),
    (
        "json",
        "Write this record as a JSON object with the keys name, city, role and notes: "
        + "; ".join(f"{key}: {value}" for key, value in RECORD.items()),
        Grammar("json", json.dumps(RECORD_SCHEMA)),
    ),
    ("plain", "Write a short story about a lighthouse keeper.", None),
]


@dataclass
class Run:
    seconds: float
    tokens: list[list[int]]
    drafted: int
    accepted: int
    steps: int


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a --model source of `phasefleet worker`")
    p.add_argument("--k", type=int, default=4, help="draft tokens per step")
    p.add_argument("--prompt-lookup-min", type=int, default=EngineConfig.prompt_lookup_min)
    p.add_argument("--prompt-lookup-max", type=int, default=EngineConfig.prompt_lookup_max)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=1, help="the sampled requests' seed")
    p.add_argument("--rounds", type=int, default=2, help="best of this many")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: torch's default")
    return p.parse_args()


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> Run:
    """The prompts through the engine together, to the end (each with its params)."""
    s = engine.scheduler
    drafted, accepted = s.draft_tokens_total, s.accepted_tokens_total
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, SamplingParams(**vars(p)))
    done: dict[str, list[int]] = {}
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    seconds = time.perf_counter() - start
    tokens = [done[rid] for rid in ids]
    return Run(seconds, tokens, s.draft_tokens_total - drafted, s.accepted_tokens_total - accepted,
               steps)  # fmt: skip


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from phasefleet.server.model_source import resolve_model

    folder = Path(resolve_model(args.model))
    configs = {
        "no drafts": EngineConfig(model=str(folder), device="cpu", max_num_seqs=16),
        f"k={args.k}": EngineConfig(
            model=str(folder), device="cpu", max_num_seqs=16, num_speculative_tokens=args.k,
            prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
        ),
    }  # fmt: skip
    engines = {name: LLMEngine(c) for name, c in configs.items()}
    tokenizer = next(iter(engines.values())).tokenizer
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=True))
        for _, text, _ in TASKS
    ]  # fmt: skip
    seed = args.seed if args.temperature > 0 else None  # seeded: the same tokens either way
    params = [
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed,
                       grammar=grammar)
        for _, _, grammar in TASKS
    ]  # fmt: skip
    print(
        f"machine: {platform.machine()}, torch threads {torch.get_num_threads()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
        f"{os.getloadavg()[0]:.1f}; model {folder.name}, temperature {args.temperature:g}, "
        f"max_tokens {args.max_tokens}, "
        f"prompt lookup n {args.prompt_lookup_min}..{args.prompt_lookup_max}"
    )
    cases = [
        (kind, [prompt], [p])
        for (kind, _, _), prompt, p in zip(TASKS, prompts, params, strict=True)
    ]
    cases.append((f"batch of {len(TASKS)}", prompts, params))
    best: dict[tuple[str, str], Run] = {}
    for _ in range(args.rounds):
        for case, batch, batch_params in cases:
            for name, engine in engines.items():
                result = run(engine, batch, batch_params)
                key = (case, name)
                if key not in best or result.seconds < best[key].seconds:
                    best[key] = result
    plain, drafted = "no drafts", f"k={args.k}"
    print(f"{'case':<11} {'tokens':>6} {'no drafts tok/s':>16} {drafted + ' tok/s':>11} "
          f"{'ratio':>6} {'accepted':>9} {'steps':>11} same")  # fmt: skip
    for case, _, _ in cases:
        a, b = best[case, plain], best[case, drafted]
        n = sum(len(t) for t in a.tokens)
        share = f"{b.accepted / b.drafted:.0%}" if b.drafted else "-"
        print(
            f"{case:<11} {n:>6} {n / a.seconds:>16.1f} {n / b.seconds:>11.1f} "
            f"{a.seconds / b.seconds:>5.2f}x {share:>9} {f'{a.steps} -> {b.steps}':>11} "
            f"{'yes' if a.tokens == b.tokens else 'NO'}"
        )


if __name__ == "__main__":
    main()
