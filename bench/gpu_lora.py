"""GPU check `lora_8b`: what LoRA adapters cost a decode step on a Llama-3-8B-shaped model (random
bf16 weights made on the device): the same decode batches on an engine without adapter slots,
then on one with four rank-16 adapters on every projection, every row on one adapter (the
decode graphs run every slot's columns), then rows spread over all four. The ratio to the
first is the adapters' cost; engines built one after the other in this process, a small fixed
KV pool each. --quick: two small layers on the CPU, B = 4."""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from gpu_models import llama3_8b_config, random_weights
from gpu_report import CheckContext, Status

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.tiny_lora import make_tiny_lora

ADAPTERS = 4
RANK = 16
PROMPT = 512
STEPS = 20


def _engine(ctx: CheckContext, folder: Path, adapters: dict[str, str], batch: int) -> LLMEngine:
    blocks = batch * (PROMPT + STEPS + 16) // 16 + 64
    with random_weights(torch.device(ctx.device)):
        return LLMEngine(
            EngineConfig(
                model=str(folder), device=ctx.device, dtype="bfloat16", max_model_len=2048,
                max_num_seqs=batch, max_num_batched_tokens=2048, num_kv_blocks=blocks,
                lora_adapters=adapters, max_lora_rank=RANK,
            )
        )  # fmt: skip


def _step_ms(eng: LLMEngine, loras: list[str | None], prompt_len: int, steps: int) -> float:
    """Median wall ms of a decode step of len(loras) requests, one adapter (or none) each."""
    gen = torch.Generator().manual_seed(len(loras))
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i, lora in enumerate(loras):
        prompt = torch.randint(5, eng.hf_config.vocab_size, (prompt_len,), generator=gen)
        eng.add_request(f"r{i}-{lora}", prompt.tolist(), params, lora=lora)
    while eng.stats().num_waiting or eng.stats().prefill_tokens_pending:
        eng.step()
    eng.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()  # samples: waits for the device
        times.append(time.perf_counter() - t)
    while eng.has_unfinished_requests():
        eng.step()
    return 1000 * statistics.median(times)


def lora_8b(ctx: CheckContext, data: dict[str, Any]) -> tuple[Status, str]:
    cuda = ctx.device == "cuda"
    folder = llama3_8b_config(ctx)
    batches = [4] if ctx.quick else [8, 64]
    prompt_len, steps = (32, 4) if ctx.quick else (PROMPT, STEPS)
    names = [f"a{i}" for i in range(ADAPTERS)]
    adapters = {
        n: str(make_tiny_lora(ctx.work / f"lora-8b-{n}", folder, rank=RANK, seed=i, std=0.005))
        for i, n in enumerate(names)
    }
    rows = []
    for b in batches:
        row: dict[str, Any] = {"batch": b}
        eng = _engine(ctx, folder, {}, b)
        row["no_adapters_ms"] = _step_ms(eng, [None] * b, prompt_len, steps)
        del eng
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        eng = _engine(ctx, folder, adapters, b)
        row["graphs"] = eng.runner.graphs is not None
        row["base_rows_ms"] = _step_ms(eng, [None] * b, prompt_len, steps)
        row["one_adapter_ms"] = _step_ms(eng, ["a0"] * b, prompt_len, steps)
        spread: list[str | None] = [names[i % ADAPTERS] for i in range(b)]
        row["four_adapters_ms"] = _step_ms(eng, spread, prompt_len, steps)
        for key in ("base_rows", "one_adapter", "four_adapters"):
            row[f"{key}_ratio"] = row[f"{key}_ms"] / row["no_adapters_ms"]
        del eng
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        rows.append(row)
        data["decode"] = rows
    parts = [
        f"B={r['batch']}: {r['one_adapter_ratio']:.2f}x one adapter, "
        f"{r['four_adapters_ratio']:.2f}x four ({r['no_adapters_ms']:.1f} ms without)"
        for r in rows
    ]
    summary = f"decode step with {ADAPTERS} rank-{RANK} slots vs none: " + "; ".join(parts)
    return (Status.OK if cuda else Status.NOT_APPLICABLE), summary
