"""Small factories for engine tests: schedulers, requests, prompts, tiny-model settings, and
the device the engine runs on (PHASEFLEET_TEST_DEVICE)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from phasefleet.api.contract import DEFAULT_LATE_LIMIT_S
from phasefleet.engine.config import EngineConfig
from phasefleet.engine.kv_cache_manager import KVCacheManager
from phasefleet.engine.kv_transfer import KVChunk
from phasefleet.engine.request import Request
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.scheduler import Scheduler

if TYPE_CHECKING:
    from phasefleet.engine.llm_engine import LLMEngine, RequestOutput


def _test_device() -> str:
    device = os.environ.get("PHASEFLEET_TEST_DEVICE", "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"PHASEFLEET_TEST_DEVICE must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("PHASEFLEET_TEST_DEVICE=cuda, but torch sees no GPU here")
    return device


# Where the engine runs in the tests that compare it with transformers or move KV (the hand-off);
# the reference stays transformers on the CPU in float32. Tests of CPU-only paths say "cpu".
DEVICE = _test_device()
CUDA_TEST_KV_BLOCKS = 8193  # on CUDA when a test gives none: auto takes 85% of the GPU per engine


def engine_config(folder: Path, **kw: object) -> EngineConfig:
    """An EngineConfig for `folder` on DEVICE (unless kw has a device); on CUDA in float32 (auto
    is bfloat16 there) and with CUDA_TEST_KV_BLOCKS unless the test sets num_kv_blocks."""
    device = str(kw.pop("device", DEVICE))
    if device == "cuda":
        kw.setdefault("dtype", "float32")
        kw.setdefault("num_kv_blocks", CUDA_TEST_KV_BLOCKS)
    return EngineConfig(model=str(folder), device=device, **kw)  # type: ignore[arg-type]


# name -> make_tiny arguments; each model is written once per test session.
TINY_MODELS: dict[str, dict[str, object]] = {
    "llama": dict(arch="llama", seed=1),  # 4 heads, 2 kv heads: GQA
    "qwen2": dict(arch="qwen2", seed=2),  # qkv bias, tied embeddings
    "qwen3": dict(arch="qwen3", seed=6),  # q/k norms, head_dim 2 x hidden / heads, tied
    "mistral": dict(arch="mistral", seed=3),
    "llama31": dict(arch="llama", seed=4, rope_scaling="llama3"),
    "mistral_sw": dict(arch="mistral", seed=5, sliding_window=12),  # window < prompt lengths
    "phi3": dict(arch="phi3", seed=10),  # fused qkv / gate_up in the checkpoint, 3/4 rotary
    "qwen2_sw": dict(arch="qwen2", seed=11, sliding_window=12),  # the second layer slides
    "gemma": dict(arch="gemma", seed=12),  # (1 + w) norms, scaled embeddings, GELU (tanh)
    # sandwich norms, scores and logits capped by tanh, the first layer slides
    "gemma2": dict(arch="gemma2", seed=15, sliding_window=12),
    # sandwich norms, q/k norms, its own score scale; the first layer slides (its own RoPE
    # base), the second does not (linearly scaled RoPE)
    "gemma3": dict(arch="gemma3_text", seed=13, sliding_window=12),
    # an image-text checkpoint (Gemma 3 4B and up): its decoder served, the vision tower left
    "gemma3_vision": dict(arch="gemma3", seed=14, sliding_window=12),
    # mixture of experts: 8 experts, 2 per token (Qwen2-MoE: a shared expert, one dense layer)
    "mixtral": dict(arch="mixtral", seed=7),
    "qwen2_moe": dict(arch="qwen2_moe", seed=8),
    "qwen3_moe": dict(arch="qwen3_moe", seed=9),  # q/k norms, renormalized top-k
}


def make_scheduler(
    num_blocks: int = 8,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    enable_caching: bool = True,
    eos_token_ids: tuple[int, ...] = (),
    clock: Callable[[], float] = lambda: 123.0,
    late_after_s: float | None = None,
    late_limit_s: float = DEFAULT_LATE_LIMIT_S,
    policy: str = "fcfs",
    host_slots: int = 0,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching, host_slots)
    return Scheduler(
        kv,
        max_num_batched_tokens,
        max_num_seqs,
        max_model_len,
        eos_token_ids=eos_token_ids,
        clock=clock,
        late_after_s=late_after_s,
        late_limit_s=late_limit_s,
        policy=policy,
    )


def make_requests(
    n: int, length: int, max_tokens: int = 16, first_token: int = 100, prefix: str = "r"
) -> list[Request]:
    """n requests of `length` distinct prompt tokens each (no shared prefixes)."""
    return [
        Request(
            request_id=f"{prefix}{i}",
            prompt_token_ids=list(range(first_token + i * 1000, first_token + i * 1000 + length)),
            params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
            arrival_time=float(i),
        )
        for i in range(n)
    ]


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from transformers with PEFT's LoRA adapter applied (None: the base
    model alone), no KV cache: the reference for the engine's adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def contains(tokens: list[int], word: list[int]) -> bool:
    """Whether `word` appears in `tokens`, its tokens consecutive."""
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 500) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in lengths]


def finish_all(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Steps the engine until no request is left; each finished request's final output."""
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def pull_kv(engine: LLMEngine, rid: str, first: int = 0, end: int | None = None) -> list[KVChunk]:
    """The leased prompt's blocks first .. end - 1 (default: all) as one chunk, read as a
    decode worker's pull reads them (pinned meanwhile)."""
    lease = engine.pin_kv(rid)
    assert lease is not None
    blocks = lease.block_ids[first:end]
    try:
        payload = b"".join(bytes(chunk) for chunk in engine.runner.read_kv(blocks))
    finally:
        engine.unpin_kv(lease)
    return [KVChunk(first, len(blocks), torch.frombuffer(bytearray(payload), dtype=torch.uint8))]
