"""GPU checks of the attention and decode paths: the Triton paged-decode kernel against the torch
path at real shapes, captured decode graphs against eager steps, and which SDPA kernel a prefill
actually runs. On the CPU each runs what it can (the torch path, the graph path eagerly, the CPU
op names) and reports n/a: the claims are about CUDA."""

from __future__ import annotations

import os
import time
from typing import Any
from unittest import mock

import torch
from gpu_models import real_heads
from gpu_report import CheckContext, Status
from gpu_roofline import seconds_per_call

from phasefleet.engine.attention.metadata import AttentionMetadata, DecodeGroup, decode_masks
from phasefleet.engine.attention.torch_paged import paged_attention
from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams

BF16_TOLERANCE = 2e-2  # max abs error against float32, as tests/engine/test_attention.py allows
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # Llama 3 8B's attention, the default block
FUSED = {"flash", "mem_efficient", "cudnn"}


def _decode_inputs(
    contexts: list[int], heads: int, kv_heads: int, dim: int, device: str, seed: int = 0
) -> dict[str, Any]:
    """One decode per context length, blocks scattered over a pool in random order."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-c // BLOCK) for c in contexts]
    ids = (torch.randperm(sum(counts), generator=gen) + 1).tolist()  # block 0 is the null block
    width, tables, slots, start = max(counts), [], [], 0
    for c, n in zip(contexts, counts, strict=True):
        row = ids[start : start + n]
        start += n
        tables.append(row + [0] * (width - n))
        slots.append(row[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK)
    pool = (sum(counts) + 1, BLOCK, kv_heads, dim)
    b = len(contexts)
    return {
        "q": torch.randn(b, heads, dim, generator=gen),
        "k": torch.randn(b, kv_heads, dim, generator=gen),
        "v": torch.randn(b, kv_heads, dim, generator=gen),
        "k_cache": torch.randn(pool, generator=gen),
        "v_cache": torch.randn(pool, generator=gen),
        "tables": torch.tensor(tables, device=device),
        "ctx": torch.tensor(contexts, device=device),
        "slots": torch.tensor(slots, device=device),
    }


def _on(t: dict[str, Any], dtype: torch.dtype, device: str) -> dict[str, Any]:
    """The inputs' tensors in `dtype` on `device` (copies: the call writes the new KV)."""
    names = ("q", "k", "v", "k_cache", "v_cache")
    return {**t, **{n: t[n].to(device, dtype, copy=True) for n in names}}


def _attend(t: dict[str, Any], backend: str, window: int | None) -> torch.Tensor:
    """paged_attention over prepared inputs (`_on`), as the model runner calls it."""
    q = t["q"]
    groups = []
    if backend == "torch":
        matmuls = q.device.type == "cpu" and q.dtype != torch.float32  # as the runner does
        masks, biases = decode_masks(t["ctx"], t["tables"].shape[1] * BLOCK, {window}, matmuls)
        groups = [
            DecodeGroup(
                start=0, size=q.shape[0], block_tables=t["tables"], masks=masks, biases=biases
            )
        ]
    meta = AttentionMetadata(
        slot_mapping=t["slots"],
        num_decode_tokens=q.shape[0],
        decode_block_tables=t["tables"],
        decode_context_lens=t["ctx"],
        decode_groups=groups,
        prefills=[],
        decode_backend=backend,
    )
    scale = q.shape[-1] ** -0.5
    return paged_attention(q, t["k"], t["v"], t["k_cache"], t["v_cache"], meta, scale, window)


def triton_kernel(ctx: CheckContext, data: dict[str, Any]) -> tuple[Status, str]:
    cuda = ctx.device == "cuda"
    heads, kv_heads, dim = (HEADS, KV_HEADS, HEAD_DIM) if not ctx.quick else (8, 2, 16)
    contexts = [1, 15, 16, 17, 100, 1000, 4096, 8191] if not ctx.quick else [1, 5, 17, 40]
    data["shape"] = {"heads": heads, "kv_heads": kv_heads, "head_dim": dim, "block_size": BLOCK}
    data["contexts"] = contexts
    t = _decode_inputs(contexts, heads, kv_heads, dim, ctx.device)
    fp32, bf16 = _on(t, torch.float32, ctx.device), _on(t, torch.bfloat16, ctx.device)
    worst = 0.0
    for window in (None, 1000 if not ctx.quick else 6):
        ref = _attend(fp32, "torch", window)
        torch_out = _attend(bf16, "torch", window).float()
        row: dict[str, Any] = {"torch_vs_fp32": (torch_out - ref).abs().max().item()}
        if cuda:
            tri = _attend(bf16, "triton", window).float()
            row["triton_vs_fp32"] = (tri - ref).abs().max().item()
            row["triton_vs_torch"] = (tri - torch_out).abs().max().item()
            worst = max(worst, row["triton_vs_fp32"])
        data[f"max_abs_error_window_{window}"] = row
    if not cuda:
        return Status.NOT_APPLICABLE, "no CUDA: torch path only (the kernel: tests/engine)"
    timings = []
    for b, c in ((1, 8192), (8, 2048), (64, 1024)):
        big = _on(
            _decode_inputs([c] * b, heads, kv_heads, dim, ctx.device, 1), torch.bfloat16, "cuda"
        )
        row = {"batch": b, "context": c}
        for backend in ("triton", "torch"):
            call = lambda t=big, name=backend: _attend(t, name, None)  # noqa: E731
            row[f"{backend}_us"] = 1e6 * seconds_per_call(call, 10, cuda=True)
        timings.append(row)
    data["timings"] = timings  # one layer's decode attention, KV write included
    status = Status.OK if worst <= BF16_TOLERANCE else Status.FAILED
    return status, f"max abs error vs float32 {worst:.2e} (tolerance {BF16_TOLERANCE})"


def _greedy(eng: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    return [o.output_token_ids for o in eng.generate(prompts, params)]


def cuda_graphs(ctx: CheckContext, data: dict[str, Any]) -> tuple[Status, str]:
    cuda = ctx.device == "cuda"
    config = EngineConfig(
        model=str(real_heads(ctx)),
        device=ctx.device,
        dtype="float32",
        num_kv_blocks=512,
        max_model_len=1024,
        max_num_seqs=16,
        enable_prefix_caching=False,  # both runs compute every prompt the same way
    )
    with mock.patch.dict(os.environ, {"PHASEFLEET_CUDA_GRAPHS": "0"}):
        eng = LLMEngine(config)
    data["decode_backend"] = eng.runner.decode_backend
    started = time.perf_counter()
    eng.runner.enable_decode_graphs(config.max_num_seqs, capture=cuda)
    graphs = eng.runner.graphs
    if graphs is None:
        raise RuntimeError("enable_decode_graphs left no graphs")
    data["capture_seconds"] = time.perf_counter() - started if cuda else None
    data["captured_batch_sizes"] = graphs.sizes
    replays: list[int] = []
    run = graphs.run

    def counted(*inputs: torch.Tensor) -> torch.Tensor:
        replays.append(len(inputs[0]))  # input_ids: one per request
        return run(*inputs)

    graphs.run = counted  # type: ignore[method-assign,assignment]  # count the replays
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 30, 77, 200, 513] if not ctx.quick else [3, 9, 17, 5, 12]
    prompts = [torch.randint(5, 500, (n,), generator=gen).tolist() for n in lengths]
    max_tokens = [24, 20, 16, 12, 8]  # batches of 5 down to 1, padded to 8, 4, 2, 1
    with_graphs = _greedy(eng, prompts, max_tokens)
    eng.runner.graphs = None
    eager = _greedy(eng, prompts, max_tokens)
    diverged = [
        next((i for i, (a, b) in enumerate(zip(g, e, strict=True)) if a != b), None)
        for g, e in zip(with_graphs, eager, strict=True)
    ]
    data.update(graph_steps=len(replays), graph_batch_sizes=sorted(set(replays)))
    data["first_divergence"] = diverged
    same = all(d is None for d in diverged)
    if not same or not replays:
        why = "no step went through the graphs" if same else f"diverged at {diverged}"
        return Status.FAILED, f"graph decode vs eager: {why}"
    if not cuda:
        return Status.NOT_APPLICABLE, "no CUDA: the graph path ran eagerly, same tokens"
    return Status.OK, (
        f"same tokens in {len(replays)} graph steps; capture {data['capture_seconds']:.2f} s "
        f"for {len(graphs.sizes)} batch sizes"
    )


def _sdpa_backend(ops: list[str]) -> str:
    names = {
        "_scaled_dot_product_flash_attention_for_cpu": "cpu_flash",
        "_scaled_dot_product_flash_attention": "flash",
        "_scaled_dot_product_efficient_attention": "mem_efficient",
        "_scaled_dot_product_cudnn_attention": "cudnn",
        "_scaled_dot_product_attention_math": "math",
    }
    for op, backend in names.items():  # the CPU flash name first: it contains the CUDA one
        if any(o.endswith(op) for o in ops):
            return backend
    return "unknown"


def _profile_prefill(eng: LLMEngine, rid: str, prompt: list[int], cuda: bool) -> dict[str, Any]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    eng.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    with profile(activities=activities) as prof:
        while eng.has_unfinished_requests():
            eng.step()
    ops = sorted({e.name for e in prof.events() if "scaled_dot_product" in e.name})
    kernels = [  # the device's own events: kernel names
        (e.self_device_time_total, e.key)
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
    ]
    top = [name[:120] for _, name in sorted(kernels, reverse=True)[:6]]
    return {"sdpa_ops": ops, "backend": _sdpa_backend(ops), "top_kernels": top}


def sdpa_prefill(ctx: CheckContext, data: dict[str, Any]) -> tuple[Status, str]:
    cuda = ctx.device == "cuda"
    eng = LLMEngine(
        EngineConfig(
            model=str(real_heads(ctx)),
            device=ctx.device,
            dtype="bfloat16",
            num_kv_blocks=512,
            max_model_len=2048,
        )
    )
    gen = torch.Generator().manual_seed(4)
    n = 1024 if not ctx.quick else 64
    warm, prompt, tail = (torch.randint(5, 500, (k,), generator=gen).tolist() for k in (n, n, 256))
    _profile_prefill(eng, "warm-up", warm, cuda)  # first calls: kernel choice, cuBLAS handles
    data["fresh"] = _profile_prefill(eng, "fresh", prompt, cuda)
    # the first half of `prompt` is in the prefix cache now: a chunk over cached blocks
    data["cached_prefix"] = _profile_prefill(eng, "cached", prompt[: n // 2] + tail, cuda)
    fresh, cached = data["fresh"]["backend"], data["cached_prefix"]["backend"]
    summary = f"fresh {n}-token prompt: {fresh}; chunk over a cached prefix: {cached}"
    if cached == "math":
        data["note"] = (
            "math: no fused SDPA kernel takes GQA with a mask (flash takes no mask, "
            "mem-efficient no GQA), so chunks over cached prefixes materialise the scores"
        )
    if not cuda:
        return Status.NOT_APPLICABLE, summary
    return (Status.OK if fresh in FUSED else Status.FAILED), summary
