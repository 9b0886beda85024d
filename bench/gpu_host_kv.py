"""The prefix cache's host tier (`--host-kv-cache-gib`) on a Llama-3-8B-shaped model with random
bf16 weights: a 2k-token prompt's blocks saved to pinned host memory and loaded back into other
blocks (the runner's copies, as the scheduler queues them), timed on the device against
prefilling the same prompt, and the loaded keys and values compared bit for bit."""

from __future__ import annotations

import time
from typing import Any

import torch
from gpu_models import llama3_8b_config
from gpu_report import CheckContext, Status
from gpu_roofline import load_random

from phasefleet.engine.host_prefix_cache import KVMove
from phasefleet.engine.sampling_params import SamplingParams


def _timed_ms(cuda: bool, run: Any) -> float:
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1000


def host_kv(ctx: CheckContext, data: dict[str, Any]) -> tuple[Status, str]:
    cuda = ctx.device == "cuda"
    tokens = 32 if ctx.quick else 2048
    eng = load_random(ctx, llama3_8b_config(ctx), data, host_kv_cache_gib=0.01 if ctx.quick else 2)
    runner = eng.runner
    n = tokens // runner.block_size
    if eng.stats().num_free_blocks < 2 * n or eng.kv.host is None or eng.kv.host.num_slots < n:
        raise RuntimeError(f"the pool or the host tier holds fewer than {n} blocks")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, eng.hf_config.vocab_size, (tokens,), generator=gen).tolist()
    once = SamplingParams(max_tokens=1)
    eng.generate([prompt[:64]], once)  # warm-up
    data["prefill_ms"] = _timed_ms(cuda, lambda: eng.generate([prompt], once))
    sources, targets = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
    keys = runner.kv_caches[-1][0]
    keys[sources] = torch.randn(keys[sources].shape, device=keys.device).to(keys.dtype)
    saved = keys[sources].clone()
    saves = [KVMove(b, s, to_host=True) for s, b in enumerate(sources)]
    loads = [KVMove(b, s, to_host=False) for s, b in enumerate(targets)]
    data["save_ms"] = _timed_ms(cuda, lambda: runner.move_kv(saves))
    data["load_ms"] = _timed_ms(cuda, lambda: runner.move_kv(loads))
    data["loaded_equal"] = bool(torch.equal(keys[targets], saved))
    data["tokens"] = tokens
    data["bytes"] = n * runner.host_block_bytes()
    gbps = data["bytes"] / data["load_ms"] / 1e6
    summary = (
        f"{tokens} tokens ({data['bytes'] / 2**20:.0f} MiB of KV): prefill {data['prefill_ms']:.1f}"
        f" ms; to host {data['save_ms']:.1f} ms, back {data['load_ms']:.1f} ms ({gbps:.1f} GB/s):"
        f" a host hit costs {data['load_ms'] / data['prefill_ms']:.1%} of recomputing; loaded "
        f"KV {'equal' if data['loaded_equal'] else 'DIFFERENT'}"
    )
    if not data["loaded_equal"]:
        return Status.FAILED, summary
    return (Status.OK if cuda else Status.NOT_APPLICABLE), summary
