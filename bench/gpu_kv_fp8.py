"""A float8 KV pool (`--kv-cache-dtype fp8`) against a bf16 one on a Llama-3-8B-shaped model
with random bf16 weights: the blocks each gets from the memory free after loading, and a decode
step's time at batch 8 and 64 over a 2k-token context (CUDA graphs and the Triton kernel, which
reads one byte a value and casts in registers), each engine loaded alone."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from gpu_models import llama3_8b_config
from gpu_report import CheckContext, Status
from gpu_roofline import decode_batch, load_random

from phasefleet.engine.config import MAX_GRAPH_BATCH

BATCHES = (8, 64)


def kv_fp8(ctx: CheckContext, data: dict[str, Any]) -> tuple[Status, str]:
    cuda = ctx.device == "cuda"
    folder = llama3_8b_config(ctx)
    prompt = 2048 if not ctx.quick else 32
    for kv in ("auto", "fp8"):
        pool: dict[str, Any] = {}
        eng = load_random(ctx, folder, pool, kv_cache_dtype=kv)
        runner = eng.runner
        pool["decode_backend"] = runner.decode_backend
        pool["kv_dtype"] = eng.kv_layout.dtype
        pool["blocks"] = eng.stats().num_free_blocks
        pool["tokens"] = pool["blocks"] * runner.block_size
        if cuda and runner.decode_backend == "triton":
            started = time.perf_counter()
            runner.enable_decode_graphs(min(max(BATCHES), MAX_GRAPH_BATCH))
            pool["graph_capture_seconds"] = time.perf_counter() - started
        per_token = runner.block_bytes() // runner.block_size
        pool["decode"] = [decode_batch(eng, b, prompt, cuda, per_token) for b in BATCHES]
        data[kv] = pool
        del eng, runner
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    which = "device_ms" if cuda else "wall_ms"

    def ms(row: dict[str, Any]) -> float:
        return float(row.get(which) or row["wall_ms"])

    steps = [
        f"b={a['batch']} {ms(a):.2f} -> {ms(f):.2f} ms"
        for a, f in zip(data["auto"]["decode"], data["fp8"]["decode"], strict=True)
    ]
    summary = (
        f"KV tokens {data['auto']['tokens']} (bf16) -> {data['fp8']['tokens']} (float8, "
        f"{data['fp8']['tokens'] / data['auto']['tokens']:.2f}x); decode step "
        f"({'device' if cuda else 'wall'}) {', '.join(steps)}"
    )
    return (Status.OK if cuda else Status.NOT_APPLICABLE), summary
