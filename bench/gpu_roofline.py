"""Our engine on a Llama-3-8B-shaped model (random bf16 weights made on the device) against the
device's own limits, measured in the same run: a decode step against the HBM roofline (the bytes
it must read, weights plus the KV it attends to, over the bandwidth of a large device-to-device
copy), and a 2k-token prefill against the FLOP/s of a large bf16 matmul.

Per decode batch size: the step's wall time (engine.step(), scheduling and sampling included),
its span in CUDA events, and the device time of the forward alone (back-to-back replays of the
step's CUDA graph); 1 - device / wall is the share of the step the GPU waits for the host.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from gpu_models import decode_weight_bytes, layer_params, llama3_8b_config, random_weights
from gpu_report import CheckContext, Status

from phasefleet.engine.config import MAX_GRAPH_BATCH, EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams

BATCHES = (1, 8, 64)
TIMED_STEPS = 20
GIB = 2**30


def seconds_per_call(fn: Callable[[], object], reps: int, cuda: bool) -> float:
    """Seconds per call: CUDA events around `reps` calls after one warm-up; on the CPU the best
    of `reps` single calls."""
    fn()
    if not cuda:
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / 1000 / reps


def _copy_bytes_per_s(n: int, device: str, reps: int) -> float:
    """Bytes read plus written per second by a device-to-device copy of n bytes."""
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * n / seconds_per_call(lambda: dst.copy_(src), reps, device == "cuda")


def _matmul_flops_per_s(m: int, device: str, reps: int) -> float:
    """FLOP/s of an [m, m] x [m, m] bf16 matmul."""
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    return 2 * m**3 / seconds_per_call(lambda: a @ b, reps, device == "cuda")


def device_peaks(device: str, quick: bool) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s."""
    cuda = device == "cuda"
    n = (2 * GIB if cuda else 256 * 2**20) if not quick else 64 * 2**20
    m = (8192 if cuda else 1024) if not quick else 256
    reps = 10 if cuda else 3
    peaks = {
        "copy_bytes_per_s": _copy_bytes_per_s(n, device, reps),
        "copy_bytes": n,
        "matmul_flops_per_s": _matmul_flops_per_s(m, device, reps),
        "matmul_size": m,
    }
    if cuda:
        torch.cuda.empty_cache()
    return peaks


def _random_prompt(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(5, vocab, (n,), generator=gen).tolist()


def decode_batch(
    eng: LLMEngine, b: int, prompt_len: int, cuda: bool, kv_bytes_per_token: int
) -> dict[str, Any]:
    """b requests of prompt_len tokens, prefilled, then TIMED_STEPS decode steps timed."""
    gen = torch.Generator().manual_seed(b)
    vocab = eng.hf_config.vocab_size
    # The first requests prefilled decode beside the later ones' prefill chunks (mixed steps):
    # their answers must outlast every prefill step, the warm-up, the timed and the eager steps.
    prefill_steps = -(-b * prompt_len // eng.config.max_num_batched_tokens)
    params = SamplingParams(
        max_tokens=prefill_steps + TIMED_STEPS + 40, temperature=0, ignore_eos=True
    )
    ids = [f"decode{b}-{i}" for i in range(b)]
    for rid in ids:
        eng.add_request(rid, _random_prompt(gen, prompt_len, vocab), params)
    while eng.stats().num_waiting or eng.stats().prefill_tokens_pending:
        eng.step()
    for _ in range(3):
        eng.step()
    generated_before = eng.stats().generation_tokens_total
    walls, spans = [], []
    for _ in range(TIMED_STEPS):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        outs = eng.step()
        walls.append(time.perf_counter() - t)
        if cuda:
            end.record()
            end.synchronize()
            spans.append(start.elapsed_time(end) / 1000)
        if len(outs) != b:
            raise RuntimeError(f"a decode step of {b} requests returned {len(outs)} outputs")
    generated_after = eng.stats().generation_tokens_total
    row: dict[str, Any] = {"batch": b, "wall_ms": 1000 * statistics.median(walls)}
    row["event_ms"] = 1000 * statistics.median(spans) if spans else None
    graphs = eng.runner.graphs
    if graphs is not None and b in graphs.graphs:
        graph = graphs.graphs[b]
        row["device_ms"] = 1000 * seconds_per_call(
            graph.replay, 10, cuda
        )  # same inputs, same slots
        eng.runner.graphs = None
        eager = []
        for _ in range(5):
            t = time.perf_counter()
            eng.step()
            eager.append(time.perf_counter() - t)
        eng.runner.graphs = graphs
        row["eager_wall_ms"] = 1000 * statistics.median(eager)
    # mean context of the timed steps: the prompt plus the mean answer so far, over the window
    context = prompt_len + (generated_before + generated_after) / (2 * b)
    row["context"] = context
    row["kv_bytes_read"] = b * context * kv_bytes_per_token
    for rid in ids:
        eng.abort_request(rid)
    eng.step()
    return row


def prefill(eng: LLMEngine, tokens: int, cuda: bool) -> float:
    """Seconds of the fastest of 3 one-step prefills of a fresh `tokens`-token prompt (after a
    first one that warms up)."""
    gen = torch.Generator().manual_seed(7)
    times = []
    for i in range(4):
        prompt = _random_prompt(gen, tokens, eng.hf_config.vocab_size)
        eng.add_request(f"prefill-{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()  # the whole prompt fits the step's token budget; sampling synchronises
        times.append(time.perf_counter() - t)
        if eng.has_unfinished_requests():
            raise RuntimeError(f"a {tokens}-token prefill took more than one step")
    return min(times[1:])


def load_random(
    ctx: CheckContext,
    folder: Path,
    data: dict[str, Any],
    kv_cache_dtype: str = "auto",
    host_kv_cache_gib: float = 0.0,
) -> LLMEngine:
    """The engine on `folder`'s shape with random bf16 weights made on the device, decode
    graphs off (the caller captures them, timed); data["load_seconds"]: how long it took."""
    started = time.perf_counter()
    device = torch.device(ctx.device)
    with random_weights(device), mock.patch.dict(os.environ, {"PHASEFLEET_CUDA_GRAPHS": "0"}):
        eng = LLMEngine(
            EngineConfig(
                model=str(folder), device=ctx.device, dtype="bfloat16", max_model_len=4096,
                max_num_seqs=max(BATCHES), max_num_batched_tokens=2048,
                kv_cache_dtype=kv_cache_dtype, host_kv_cache_gib=host_kv_cache_gib,
            )
        )  # fmt: skip
    data["load_seconds"] = time.perf_counter() - started
    return eng


def roofline(ctx: CheckContext, data: dict[str, Any]) -> tuple[Status, str]:
    cuda = ctx.device == "cuda"
    peaks = device_peaks(ctx.device, ctx.quick)
    data["peaks"] = peaks
    folder = llama3_8b_config(ctx)
    if cuda:
        free, total = torch.cuda.mem_get_info()
        data["device_memory_before_load_gib"] = {"free": free / GIB, "total": total / GIB}
    eng = load_random(ctx, folder, data)
    runner, config = eng.runner, eng.hf_config
    data["decode_backend"] = runner.decode_backend
    stats = eng.stats()
    data["kv_after_load"] = {
        "free_blocks": stats.num_free_blocks,
        "block_bytes": runner.block_bytes(),
        "free_gib": stats.num_free_blocks * runner.block_bytes() / GIB,
        "tokens": stats.num_free_blocks * runner.block_size,
    }
    if cuda:  # freed by the allocator but kept in its cache: invisible to the KV pool's sizing
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        data["kv_after_load"]["allocator_cached_gib"] = cached / GIB
    if cuda and runner.decode_backend == "triton":  # as LLMEngine enables them
        started = time.perf_counter()
        runner.enable_decode_graphs(min(max(BATCHES), MAX_GRAPH_BATCH))
        data["graph_capture_seconds"] = time.perf_counter() - started
    weights = decode_weight_bytes(config, runner.dtype.itemsize)
    data["decode_weight_bytes"] = weights
    kv_per_token = runner.block_bytes() // runner.block_size
    bandwidth = peaks["copy_bytes_per_s"]
    rows = []
    for b in BATCHES:
        row = decode_batch(eng, b, 1024 if not ctx.quick else 32, cuda, kv_per_token)
        roof_ms = 1000 * (weights + row["kv_bytes_read"]) / bandwidth
        row["roofline_ms"] = roof_ms
        row["roofline_fraction_wall"] = roof_ms / row["wall_ms"]
        if row.get("device_ms"):
            row["roofline_fraction_device"] = roof_ms / row["device_ms"]
            row["host_idle_fraction"] = 1 - row["device_ms"] / row["wall_ms"]
        rows.append(row)
        data["decode"] = rows
    tokens = 2048 if not ctx.quick else 128
    seconds = prefill(eng, tokens, cuda)
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    flops = 2 * tokens * config.num_hidden_layers * layer_params(config)
    flops += 2 * config.hidden_size * config.vocab_size  # the last token's logits
    flops += 2 * tokens * tokens * heads * runner.head_dim * layers  # causal QK^T and PV
    data["prefill"] = {
        "tokens": tokens,
        "seconds": seconds,
        "flops": flops,
        "flops_per_s": flops / seconds,
        "matmul_fraction": flops / seconds / peaks["matmul_flops_per_s"],
    }
    which = "roofline_fraction_device" if cuda else "roofline_fraction_wall"
    parts = [f"b={r['batch']} {r.get(which, 0):.2f}" for r in rows]
    if cuda:
        parts = [
            f"{part} (host idle {r.get('host_idle_fraction', 0):.0%})"
            for part, r in zip(parts, rows, strict=True)
        ]
    summary = (
        f"decode at {', '.join(parts)} of the HBM roofline ({'device' if cuda else 'wall'} "
        "time); "
        f"{tokens}-token prefill {data['prefill']['matmul_fraction']:.2f} of matmul FLOP/s"
    )
    return (Status.OK if cuda else Status.NOT_APPLICABLE), summary
