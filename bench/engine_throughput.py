"""Offline throughput: our engine vs transformers `generate`, same model, same process.

Request lengths are drawn from the ShareGPT trace (prompt and output token counts), divided by
--scale so they fit a small model on a CPU. transformers runs batched with left padding (each
batch generates up to its longest requested output; we count only the requested tokens, the
same work our engine does), at every --hf-batch-sizes value, with batches in arrival order and
grouped by output length (an oracle: it needs the output lengths in advance); the best of each
is reported. Then one request alone on each side: decode tokens/s after the first token.

    .venv/bin/python bench/engine_throughput.py --num-requests 24 --hf-batch-sizes 4,8,16
"""

from __future__ import annotations

import argparse
import csv
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.tiny import make_tiny

TRACE = Path(__file__).resolve().parents[2] / "shared/traces/sharegpt_8k_stats.csv"
DEFAULT_MODEL = Path.home() / ".cache/phasefleet/bench-llama-100m"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="model folder (made if absent)"
    )
    p.add_argument("--trace", type=Path, default=TRACE, help="CSV with num_prefill_tokens, ...")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--scale", type=float, default=16.0, help="divide trace lengths by this")
    p.add_argument("--max-prompt", type=int, default=512, help="prompt length cap, tokens")
    p.add_argument("--max-output", type=int, default=128, help="output length cap, tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"])
    p.add_argument("--max-num-seqs", type=int, default=64, help="our engine's batch cap")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="our token budget")
    p.add_argument("--hf-batch-sizes", default="4,8,16", help="comma-separated batch sizes")
    p.add_argument("--single-output", type=int, default=64, help="tokens in the 1-request run")
    p.add_argument(
        "--hf-order",
        choices=["arrival", "sorted", "both"],
        default="both",
        help="transformers batches in arrival order, grouped by output length, or both",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: torch's default")
    p.add_argument("--rounds", type=int, default=2, help="throughput rounds; best is kept")
    p.add_argument("--repeats", type=int, default=5, help="single-request runs; best is kept")
    return p.parse_args()


def sample_lengths(args: argparse.Namespace) -> list[tuple[int, int]]:
    with args.trace.open() as f:
        rows = [
            (int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)
        ]
    rng = random.Random(args.seed)
    picked = rng.sample(rows, args.num_requests)
    return [
        (
            max(4, min(args.max_prompt, round(p / args.scale))),
            max(2, min(args.max_output, round(d / args.scale))),
        )
        for p, d in picked
    ]


def random_prompt(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def run_engine(eng: LLMEngine, prompts: list[list[int]], outs: list[int]) -> float:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outs]
    start = time.perf_counter()
    results = eng.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if [len(r.output_token_ids) for r in results] != outs:
        raise RuntimeError("engine produced the wrong number of tokens")
    return elapsed


@torch.inference_mode()
def run_hf(
    model: Any, prompts: list[list[int]], outs: list[int], batch: int, pad: int, sort: bool
) -> float:
    """Batches in arrival order, or (sort=True) grouped by output length, which needs the
    output lengths in advance: an oracle no server has, but transformers' best case."""
    order = list(range(len(prompts)))
    if sort:
        order.sort(key=lambda i: outs[i])
    start = time.perf_counter()
    for b in range(0, len(order), batch):
        idx = order[b : b + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):  # left padding
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        new = max(outs[i] for i in idx)
        model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
        )
    return time.perf_counter() - start


def _label(batch: int, sort: bool) -> str:
    return f"batch {batch}, {'sorted by output length' if sort else 'arrival order'}"


def engine_decode_rate(eng: LLMEngine, prompt: list[int], n: int) -> float:
    eng.add_request("single", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    first = last = 0.0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if len(o.output_token_ids) == 1:
                first = time.perf_counter()
            last = time.perf_counter()
    return (n - 1) / (last - first)


@torch.inference_mode()
def hf_decode_rate(model: Any, prompt: list[int], n: int, pad: int) -> float:
    ids = torch.tensor([prompt], device=model.device)

    def timed(k: int) -> float:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=pad)
        return time.perf_counter() - start

    timed(2)  # warm-up
    return (n - 1) / (timed(n) - timed(1))


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (args.model / "config.json").is_file():
        print(f"making the benchmark model in {args.model}")
        make_tiny(args.model, arch="llama", preset="bench", seed=0)
    lengths = sample_lengths(args)
    rng = random.Random(args.seed + 1)
    config = EngineConfig(
        model=str(args.model),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,  # random prompts share nothing; keep the comparison plain
    )
    eng = LLMEngine(config)
    vocab = eng.hf_config.vocab_size
    prompts = [random_prompt(p, vocab, rng) for p, _ in lengths]
    outs = [o for _, o in lengths]
    hf: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    hf = hf.to(eng.device).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    pad = eng.tokenizer.pad_token_id
    print(
        f"model {args.model.name}: {n_params / 1e6:.0f}M parameters, {args.dtype}, {eng.device}, "
        f"our linears: {eng.runner.model.linear_backend}"
    )
    print(
        f"machine: {platform.processor() or platform.machine()}, torch threads "
        f"{torch.get_num_threads()}, {time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    print(
        f"{len(prompts)} requests: prompt tokens {sum(p for p, _ in lengths)} "
        f"(mean {sum(p for p, _ in lengths) / len(lengths):.0f}), output tokens {sum(outs)} "
        f"(mean {sum(outs) / len(outs):.0f})"
    )

    # The machine may be shared: rounds alternate between the two systems and the best time of
    # each is kept, so a burst of outside load does not land on one side only.
    run_engine(eng, prompts[:2], [2, 2])  # warm-up
    orders = {"arrival": [False], "sorted": [True], "both": [False, True]}[args.hf_order]
    settings = [(b, o) for b in (int(x) for x in args.hf_batch_sizes.split(",")) for o in orders]
    t_ours = float("inf")
    t_hf = {k: float("inf") for k in settings}
    for r in range(args.rounds):
        t = run_engine(eng, prompts, outs)
        print(f"round {r + 1}: ours {t:.1f} s", end="", flush=True)
        t_ours = min(t_ours, t)
        for b, o in settings:
            t = run_hf(hf, prompts, outs, b, pad, o)
            print(f", transformers {_label(b, o)} {t:.1f} s", end="", flush=True)
            t_hf[(b, o)] = min(t_hf[(b, o)], t)
        print()
    n_out, n_all = sum(outs), sum(outs) + sum(len(p) for p in prompts)
    print(
        f"ours:         {t_ours:7.1f} s  {n_out / t_ours:8.1f} output tok/s  "
        f"{n_all / t_ours:8.1f} total tok/s"
    )
    for b, o in settings:
        t = t_hf[(b, o)]
        print(
            f"transformers: {t:7.1f} s  {n_out / t:8.1f} output tok/s  "
            f"{n_all / t:8.1f} total tok/s  ({_label(b, o)})  ratio {t / t_ours:.2f}x"
        )
    for o in orders:
        best = min(t for (_, so), t in t_hf.items() if so == o)
        print(
            f"throughput ratio (ours / best transformers, {'sorted' if o else 'arrival'} "
            f"order): {best / t_ours:.2f}x"
        )

    prompt = random_prompt(32, vocab, rng)
    ours_1 = hf_1 = 0.0
    for _ in range(args.repeats):
        ours_1 = max(ours_1, engine_decode_rate(eng, prompt, args.single_output))
        hf_1 = max(hf_1, hf_decode_rate(hf, prompt, args.single_output, pad))
    print(
        f"single request decode (best of {args.repeats}): ours {ours_1:.1f} tok/s, "
        f"transformers {hf_1:.1f} tok/s, ratio {ours_1 / hf_1:.2f}x"
    )


if __name__ == "__main__":
    main()
