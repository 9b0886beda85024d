"""Offline throughput: our engine vs transformers `generate`, same model, same process.

Request lengths are drawn from the ShareGPT trace (prompt and output token counts), divided by
--scale so they fit a small model on a CPU. transformers runs batched with left padding (each
batch generates up to its longest requested output; we count only the requested tokens, the
same work our engine does), at every --hf-batch-sizes value, with batches in arrival order and
grouped by output length (an oracle: it needs the output lengths in advance); the best of each
is reported. Then one request alone on each side: decode tokens/s after the first token, and
each as a fraction of the memory roofline measured in the same run: the bytes one decode step
must read (every weight once: the linears, and the output projection, which for a tied model is
the embedding; the KV of a short context is negligible) over the bandwidth of a large tensor
copy (bytes read plus bytes written, per second).

    .venv/bin/python bench/engine_throughput.py --num-requests 24 --hf-batch-sizes 4,8,16
    .venv/bin/python bench/engine_throughput.py --preset bench-mha --num-requests 24
    .venv/bin/python bench/engine_throughput.py --model smollm2   # the trained SmolLM2-135M
    .venv/bin/phasefleet make-tiny DIR --arch qwen3_moe --preset bench   # 8 experts, 2 per token
    .venv/bin/python bench/engine_throughput.py --model DIR
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

import torch
from transformers import AutoModelForCausalLM

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.models.moe_shape import moe_shape
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.tiny import make_tiny

TRACE = Path(__file__).resolve().parents[2] / "shared/traces/sharegpt_8k_stats.csv"
CACHE = Path.home() / ".cache/phasefleet"
# What the runs are timed by: wall time, or (--clock cpu, one thread) this process's CPU time,
# which time-slicing by other processes on a shared machine does not inflate.
clock = time.perf_counter
BENCH_PRESETS = ("bench", "bench-mha", "bench-wide")  # make-tiny presets; see docs/engine.md


def model_folder(source: str | None, dtype: str = "float32") -> Path:
    """A model source's folder (a path, a short name, a Hub id); None: the bench model (the
    100M random llama, written once into CACHE)."""
    if source is None:
        model = CACHE / "bench-llama-100m"
        if not (model / "config.json").is_file():
            make_tiny(model, arch="llama", preset="bench", seed=0)
        return model
    from phasefleet.server.model_source import resolve_model

    return Path(resolve_model(source, dtype=dtype))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model",
        help="model folder or any --model source of `phasefleet worker` (smollm2, a .gguf "
        "file); default: made from --preset, one per preset in ~/.cache/phasefleet",
    )
    p.add_argument("--preset", choices=BENCH_PRESETS, default="bench", help="model shape")
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
    p.add_argument(
        "--linears",
        default="auto",
        help="comma-separated PHASEFLEET_CPU_LINEAR modes (auto, onednn, torch): one engine "
        "each, all run in every round",
    )
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time by wall clock, or by CPU time (needs --threads 1; for a loaded machine)",
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
    start = clock()
    results = eng.generate(prompts, params)
    elapsed = clock() - start
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
    start = clock()
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
    return clock() - start


def _label(batch: int, sort: bool) -> str:
    return f"batch {batch}, {'sorted by output length' if sort else 'arrival order'}"


def engine_decode_rate(eng: LLMEngine, prompt: list[int], n: int) -> float:
    eng.add_request("single", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    first = last = 0.0
    produced = 0  # outputs before the last carry only their step's tokens (new_token_ids)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if produced == 0 and o.new_token_ids:
                first = clock()
            produced += len(o.new_token_ids)
            last = clock()
    if produced != n:
        raise RuntimeError(f"the engine wrote {produced} tokens, {n} were asked for")
    return (n - 1) / (last - first)


@torch.inference_mode()
def hf_decode_rate(model: Any, prompt: list[int], n: int, pad: int) -> float:
    ids = torch.tensor([prompt], device=model.device)

    def timed(k: int) -> float:
        start = clock()
        model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=pad)
        return clock() - start

    timed(2)  # warm-up
    return (n - 1) / (timed(n) - timed(1))


def copy_bandwidth(nbytes: int, device: torch.device) -> float:
    """Bytes moved per second (read plus written) by the best of 5 copies of an nbytes tensor."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def decode_step_bytes(model: Any) -> int:
    """Weight bytes one decode step of one request reads: every parameter but the embedding
    table, plus the output projection (the embedding itself when tied: it is read once, as the
    projection); of a mixture of experts' experts, the k of E its token runs."""
    shape = moe_shape(model.config)
    share = 1.0 if shape is None else shape.top_k / shape.experts
    embed = model.get_input_embeddings().weight
    total = 0.0
    for name, p in model.named_parameters():
        if p is not embed:
            total += p.numel() * p.element_size() * (share if ".experts." in name else 1.0)
    head = model.get_output_embeddings().weight
    return int(total) + (head.numel() * head.element_size() if head is embed else 0)


def load_engines(args: argparse.Namespace, config: EngineConfig) -> dict[str, LLMEngine]:
    """One engine per --linears mode (PHASEFLEET_CPU_LINEAR at load), printing load times."""
    engines = {}
    saved = os.environ.get("PHASEFLEET_CPU_LINEAR")
    for mode in args.linears.split(","):
        os.environ["PHASEFLEET_CPU_LINEAR"] = mode
        start = time.perf_counter()
        engines[mode] = LLMEngine(config)
        print(
            f"ours ({mode}) loaded in {time.perf_counter() - start:.1f} s; linears: "
            f"{engines[mode].runner.model.linear_backend}"
        )
    if saved is None:
        os.environ.pop("PHASEFLEET_CPU_LINEAR")
    else:
        os.environ["PHASEFLEET_CPU_LINEAR"] = saved
    return engines


def main() -> None:
    global clock
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if args.threads != 1:
            raise SystemExit("--clock cpu needs --threads 1 (other threads' waits count as CPU)")
        clock = time.process_time
    if args.model is None:
        name = "bench-llama-100m" if args.preset == "bench" else f"{args.preset}-llama"
        args.model = CACHE / name
    else:
        from phasefleet.server.model_source import resolve_model

        args.model = Path(resolve_model(args.model, dtype=args.dtype))
    if not (args.model / "config.json").is_file():
        print(f"making the benchmark model ({args.preset}) in {args.model}")
        make_tiny(args.model, arch="llama", preset=args.preset, seed=0)
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
    print(
        f"machine: {platform.processor() or platform.machine()}, torch threads "
        f"{torch.get_num_threads()}, {args.clock} clock, {time.strftime('%Y-%m-%d %H:%M %Z')}, "
        "load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    engines = load_engines(args, config)
    eng = next(iter(engines.values()))
    vocab = eng.hf_config.vocab_size
    prompts = [random_prompt(p, vocab, rng) for p, _ in lengths]
    outs = [o for _, o in lengths]
    hf: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    hf = hf.to(eng.device).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    pad = eng.tokenizer.pad_token_id
    if pad is None:  # e.g. a tokenizer converted from GGUF: pad with eos, as generate() would
        pad = eng.tokenizer.eos_token_id
    c = hf.config
    print(
        f"model {args.model.name}: {n_params / 1e6:.0f}M parameters, {c.num_hidden_layers} "
        f"layers, hidden {c.hidden_size}, heads {c.num_attention_heads} / KV "
        f"{c.num_key_value_heads}, MLP {c.intermediate_size}, {args.dtype}, {eng.device}"
    )
    print(
        f"{len(prompts)} requests: prompt tokens {sum(p for p, _ in lengths)} "
        f"(mean {sum(p for p, _ in lengths) / len(lengths):.0f}), output tokens {sum(outs)} "
        f"(mean {sum(outs) / len(outs):.0f})"
    )

    # The machine may be shared: rounds alternate between the systems and the best time of
    # each is kept, so a burst of outside load does not land on one side only.
    for e in engines.values():
        run_engine(e, prompts[:2], [2, 2])  # warm-up
    orders = {"arrival": [False], "sorted": [True], "both": [False, True]}[args.hf_order]
    settings = [(b, o) for b in (int(x) for x in args.hf_batch_sizes.split(",")) for o in orders]
    t_ours = {m: float("inf") for m in engines}
    t_hf = {k: float("inf") for k in settings}
    for r in range(args.rounds):
        print(f"round {r + 1}:", end="", flush=True)
        for m, e in engines.items():
            t = run_engine(e, prompts, outs)
            print(f" ours ({m}) {t:.1f} s,", end="", flush=True)
            t_ours[m] = min(t_ours[m], t)
        for b, o in settings:
            t = run_hf(hf, prompts, outs, b, pad, o)
            print(f" transformers {_label(b, o)} {t:.1f} s,", end="", flush=True)
            t_hf[(b, o)] = min(t_hf[(b, o)], t)
        print()
    n_out, n_all = sum(outs), sum(outs) + sum(len(p) for p in prompts)
    for m, t in t_ours.items():
        print(
            f"ours ({m}): {t:7.1f} s  {n_out / t:8.1f} output tok/s  {n_all / t:8.1f} total tok/s"
        )
    for b, o in settings:
        t = t_hf[(b, o)]
        print(
            f"transformers: {t:7.1f} s  {n_out / t:8.1f} output tok/s  "
            f"{n_all / t:8.1f} total tok/s  ({_label(b, o)})"
        )
    for o in orders:
        best = min(t for (_, so), t in t_hf.items() if so == o)
        ratios = ", ".join(f"{m} {best / t:.2f}x" for m, t in t_ours.items())
        print(
            f"throughput ratio (ours / best transformers, {'sorted' if o else 'arrival'} "
            f"order): {ratios}"
        )

    prompt = random_prompt(32, vocab, rng)
    ours_1 = {m: 0.0 for m in engines}
    hf_1 = 0.0
    for _ in range(args.repeats):
        for m, e in engines.items():
            ours_1[m] = max(ours_1[m], engine_decode_rate(e, prompt, args.single_output))
        hf_1 = max(hf_1, hf_decode_rate(hf, prompt, args.single_output, pad))
    step_bytes = decode_step_bytes(hf)
    bandwidth = copy_bandwidth(max(1 << 30, 2 * step_bytes), eng.device)
    roofline = bandwidth / step_bytes
    print(
        f"single request decode (best of {args.repeats}): "
        + ", ".join(f"ours ({m}) {v:.1f} tok/s" for m, v in ours_1.items())
        + f", transformers {hf_1:.1f} tok/s; ratios "
        + ", ".join(f"{m} {v / hf_1:.2f}x" for m, v in ours_1.items())
    )
    print(
        f"memory roofline: {step_bytes / 1e6:.0f} MB of weights per step at {bandwidth / 1e9:.1f}"
        f" GB/s (a tensor copy, read + write) -> {roofline:.1f} tok/s; "
        + ", ".join(f"ours ({m}) {v / roofline:.0%}" for m, v in ours_1.items())
        + f", transformers {hf_1 / roofline:.0%} of it"
    )


if __name__ == "__main__":
    main()
