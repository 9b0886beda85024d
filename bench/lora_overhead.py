"""What LoRA adapters cost a decode step: the same engine, the same batch, with no adapter
loaded (the baseline), with slots loaded but every row on the base model, with every row on one
adapter, and with the rows spread over all adapters; each as a ratio of the baseline, measured
side by side in this process (engines built one after the other, steps interleaved per round).

    .venv/bin/python bench/lora_overhead.py                       # bench preset, B=16, rank 16
    .venv/bin/python bench/lora_overhead.py --model smollm2 --slots 1,4
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.tiny import make_tiny
from phasefleet.engine.tiny_lora import make_tiny_lora

CACHE = Path.home() / ".cache/phasefleet"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="model folder or short name (default: the bench preset)")
    p.add_argument("--batch", type=int, default=16, help="requests decoding together")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", default="1,4", help="adapter slot counts to measure")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per case")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    return p.parse_args()


def model_folder(name: str | None) -> Path:
    """A model folder, or a short name's (smollm2, tiny); default: the bench preset's."""
    if name is None:
        folder = CACHE / "bench-models" / "bench-llama"
        return folder if (folder / "config.json").is_file() else make_tiny(folder, preset="bench")
    from phasefleet.server.named_models import named_model_folder

    return named_model_folder(name) or Path(name)


def decoding_engine(
    folder: Path, adapters: dict[str, str], loras: list[str | None], prompt_len: int
) -> LLMEngine:
    """An engine with `len(loras)` requests admitted and past their prefill."""
    config = EngineConfig(
        model=str(folder), device="cpu", dtype="float32", lora_adapters=adapters,
        max_lora_rank=16, num_kv_blocks=512, max_num_seqs=len(loras),
    )  # fmt: skip
    eng = LLMEngine(config)
    params = SamplingParams(max_tokens=100_000 // 100, temperature=0, ignore_eos=True)
    for i, lora in enumerate(loras):
        eng.add_request(f"r{i}", list(range(5, 5 + prompt_len)), params, lora=lora)
    while eng.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running
    ):
        eng.step()
    return eng


def time_steps(eng: LLMEngine, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    folder = model_folder(args.model)
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    slot_counts = [int(s) for s in args.slots.split(",")]
    names = [f"a{i}" for i in range(max(slot_counts))]
    paths = {n: str(make_tiny_lora(root / n, folder, rank=args.rank, seed=i)) for i, n in
             enumerate(names)}  # fmt: skip
    b = args.batch
    cases: dict[str, LLMEngine] = {
        "no adapters (baseline)": decoding_engine(folder, {}, [None] * b, 32)
    }
    for k in slot_counts:
        loaded = {n: paths[n] for n in names[:k]}
        cases[f"{k} slot(s), base rows"] = decoding_engine(folder, loaded, [None] * b, 32)
        cases[f"{k} slot(s), one adapter"] = decoding_engine(folder, loaded, ["a0"] * b, 32)
        if k > 1:
            spread: list[str | None] = [names[i % k] for i in range(b)]
            cases[f"{k} slot(s), {k} adapters"] = decoding_engine(folder, loaded, spread, 32)
    times: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case, eng in cases.items():
            times[case].append(time_steps(eng, args.steps))
    base = statistics.median(times["no adapters (baseline)"])
    print(f"model {folder.name}, B={b}, rank {args.rank}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")  # fmt: skip
    print(f"{'case':32} {'ms/step':>8} {'x baseline':>10}")
    for case, ts in times.items():
        median = statistics.median(ts)
        print(f"{case:32} {median * 1000:8.2f} {median / base:10.2f}")


if __name__ == "__main__":
    main()
