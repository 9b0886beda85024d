"""Run in a subprocess by test_triton_decode.py, with TRITON_INTERPRET=1 set: checks the Triton
paged-decode kernel on CPU through Triton's interpreter, alone and inside the engine.

usage: python triton_interpret_check.py MODEL_DIR [MODEL_DIR ...]   (prints "ok" at the end)
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
import triton.runtime.interpreter as interpreter

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("set TRITON_INTERPRET=1")

# The interpreter turns scalars into 1-element arrays, which numpy 2 refuses as loop bounds.
_patch = interpreter._patch_lang_tensor


def _patched(tensor: Any, *scope: Any) -> None:  # triton 3.6 passes a patch scope
    _patch(tensor, *scope)
    tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])


interpreter._patch_lang_tensor = _patched

from phasefleet.engine.attention.triton_decode import paged_decode  # noqa: E402


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    ctx: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        n = int(ctx[i])
        keys = k_cache[tables[i]].flatten(0, 1)[:n]
        values = v_cache[tables[i]].flatten(0, 1)[:n]
        lo = max(0, n - window) if window else 0
        out[i] = F.scaled_dot_product_attention(
            q[i][None, :, None],
            keys[lo:].transpose(0, 1)[None],
            values[lo:].transpose(0, 1)[None],
            scale=scale,
            enable_gqa=True,
        )[0, :, 0]
    return out


def check_kernel() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks, block_size, kv_heads, heads, head_dim = 24, 4, 2, 6, 12  # head_dim not a power of 2
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.tensor([[3, 7, 0, 0, 0], [9, 0, 0, 0, 0], [1, 2, 4, 5, 11], [6, 8, 10, 0, 0]])
    ctx = torch.tensor([5, 1, 19, 12])
    q = torch.randn(4, heads, head_dim, generator=gen)
    for window in (None, 6):
        got = paged_decode(q, k_cache, v_cache, tables, ctx, 0.3, window)
        want = reference(q, k_cache, v_cache, tables, ctx, 0.3, window)
        err = (got - want).abs().max().item()
        if err > 1e-5:
            sys.exit(f"kernel differs from the reference by {err} (window {window})")


def check_engine(folder: str) -> None:
    from transformers import AutoModelForCausalLM

    from phasefleet.engine.config import EngineConfig
    from phasefleet.engine.llm_engine import LLMEngine
    from phasefleet.engine.sampling_params import SamplingParams

    os.environ["PHASEFLEET_ATTENTION"] = "triton"
    eng = LLMEngine(EngineConfig(model=folder, device="cpu", block_size=4, num_kv_blocks=64))
    if eng.runner.decode_backend != "triton":
        sys.exit("the engine did not pick the triton backend")
    prompts = [[5 + i for i in range(n)] for n in (3, 14, 21)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, eng.generate(prompts, params), strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(params.max_tokens):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        if out.output_token_ids != ids[len(prompt) :]:
            sys.exit(f"{folder}: engine with the triton kernel differs from transformers")


if __name__ == "__main__":
    check_kernel()
    for model in sys.argv[1:]:
        check_engine(model)
    print("ok")
