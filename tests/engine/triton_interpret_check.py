"""Run in a subprocess by test_fast_paths.py, with TRITON_INTERPRET=1 set: checks the split-K
Triton paged-decode kernel on CPU through Triton's interpreter, against SDPA in float32 and
inside the engine against transformers.

usage: python triton_interpret_check.py MODEL_DIR [MODEL_DIR ...]   (prints "ok" at the end)
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
import triton.language as tl
import triton.runtime.interpreter as interpreter

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("set TRITON_INTERPRET=1")

# The interpreter turns scalars into 1-element arrays, which numpy 2 refuses as loop bounds.
_patch = interpreter._patch_lang_tensor


def _patched(tensor: Any, *scope: Any) -> None:  # triton 3.6 passes a patch scope
    _patch(tensor, *scope)
    tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])


interpreter._patch_lang_tensor = _patched

# The interpreter keeps bfloat16 as its uint16 bits, and its tl.dot multiplies those bits
# (triton-lang/triton#11584, unsupported upstream): widen bf16 operands to float32 first, as
# the tensor cores do (exact products, float32 sums).
_dot = interpreter.InterpreterBuilder.create_dot


def _dot_widened(self: Any, a: Any, b: Any, *rest: Any) -> Any:
    a, b = (self.cast_impl(x, tl.float32) if x.dtype == tl.bfloat16 else x for x in (a, b))
    return _dot(self, a, b, *rest)


interpreter.InterpreterBuilder.create_dot = _dot_widened

from phasefleet.engine.attention import triton_decode  # noqa: E402
from phasefleet.engine.attention.triton_decode import (  # noqa: E402
    TILE,
    DecodeWorkspace,
    paged_decode,
    plan_splits,
)
from phasefleet.engine.kv_dtype import FLOAT8, to_kv  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # max abs error


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """SDPA per request in float32 over the keys its table lists -> [B, H, D] float32."""
    out = torch.empty(q.shape)
    for i in range(q.shape[0]):
        n = int(context_lens[i])
        keys = k_cache[block_tables[i]].flatten(0, 1)[:n].float()
        values = v_cache[block_tables[i]].flatten(0, 1)[:n].float()
        lo = max(0, n - window) if window else 0
        out[i] = F.scaled_dot_product_attention(
            q[i].float()[None, :, None],
            keys[lo:].transpose(0, 1)[None],
            values[lo:].transpose(0, 1)[None],
            scale=scale,
            enable_gqa=True,
        )[0, :, 0]
    return out


def make_batch(
    contexts: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    dtype: torch.dtype,
    table_dtype: torch.dtype = torch.long,
) -> dict[str, Any]:
    """One decode per context, its blocks scattered over the pool, tables one block wider than
    the longest and padded with the null block 0, which holds NaN: reading it shows."""
    gen = torch.Generator().manual_seed(len(contexts) * 1000 + heads * 10 + dim)
    counts = [-(-c // block_size) for c in contexts]
    ids = (torch.randperm(sum(counts), generator=gen) + 1).tolist()
    width = max(counts) + 1
    tables = []
    for n in counts:
        tables.append(ids[:n] + [0] * (width - n))
        ids = ids[n:]
    pool = (sum(counts) + 1, block_size, kv_heads, dim)
    k_cache, v_cache = (torch.randn(pool, generator=gen).to(dtype) for _ in range(2))
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    return {
        "q": torch.randn(len(contexts), heads, dim, generator=gen).to(dtype),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": torch.tensor(tables, dtype=table_dtype),
        "context_lens": torch.tensor(contexts),
    }


def expect_close(batch: dict[str, Any], window: int | None, label: str, **options: Any) -> None:
    got = paged_decode(**batch, scale=0.3, sliding_window=window, **options)
    want = reference(**batch, scale=0.3, window=window)
    err = (got.float() - want).abs().max().item()
    if not err <= TOLERANCE[got.dtype]:  # NaN fails too
        sys.exit(f"{label}, window {window}, {options}: off the reference by {err}")


def check_small_shapes() -> None:
    """GROUP 1, 3, 8 with head_dim 12 (padded to 16), 64, 32, each in every cache dtype, and
    sliding windows of 6 and 40 tokens, int32 block tables. Splits are one 32-token tile here,
    so the 77-token context runs as 3 splits (the planned grid has 3) and the others as one."""
    contexts = [5, 1, 77, 12]
    dtypes = list(TOLERANCE)
    for i, (heads, kv_heads, dim) in enumerate(((4, 4, 12), (9, 3, 64), (16, 2, 32))):
        for dtype in dtypes:
            batch = make_batch(contexts, heads, kv_heads, dim, 4, dtype, torch.int32)
            label = f"{dtype} {heads}/{kv_heads} heads of {dim}"
            expect_close(batch, None, label, min_split_tokens=32)
            if dtype == dtypes[i]:
                for window in (6, 40):
                    expect_close(batch, window, label, min_split_tokens=32)
    expect_close(batch, None, "one split", min_split_tokens=32, num_splits=1)


def check_float8_pools() -> None:
    """A float8 pool (kv_cache_dtype fp8) under float32 and bfloat16 queries: the kernel reads
    keys and values as stored, in the queries' dtype, and its output is in that dtype."""
    for dtype in (torch.float32, torch.bfloat16):
        batch = make_batch([5, 1, 77, 12], 9, 3, 64, 4, dtype)
        batch["k_cache"], batch["v_cache"] = (
            to_kv(batch[c], FLOAT8) for c in ("k_cache", "v_cache")
        )
        got = paged_decode(**batch, scale=0.3, min_split_tokens=32)
        read_back = {
            **batch,
            "k_cache": batch["k_cache"].to(dtype),
            "v_cache": batch["v_cache"].to(dtype),
        }
        err = (got.float() - reference(**read_back, scale=0.3, window=None)).abs().max().item()
        if got.dtype != dtype or not err <= TOLERANCE[dtype]:
            sys.exit(f"float8 pool, {dtype} queries: {got.dtype} output, off by {err}")


def check_real_shape() -> None:
    """Llama 3 8B's attention (32 heads over 8 KV heads of 128, bf16, 16-token blocks) with the
    default plan: a mixed batch (the 300-token context runs as 2 splits, the rest as one) and a
    lone long request, through a workspace sized as a runner would, reused across calls."""
    if (plan_splits(5, 8, 20 * 16), plan_splits(1, 8, 20 * 16)) != (2, 2):
        sys.exit("the plan for the 8B shape is not 2 splits: the check no longer splits")
    workspace = DecodeWorkspace.for_batches(8, 32, 8, 128, 20 * 16, "cpu")
    mixed = make_batch([1, 15, 16, 17, 300], 32, 8, 128, 16, torch.bfloat16)
    for window in (None, 100):
        expect_close(mixed, window, "8B shape, mixed batch", workspace=workspace)
    expect_close(mixed, None, "8B shape, one split", num_splits=1)
    lone = make_batch([300], 32, 8, 128, 16, torch.bfloat16)
    expect_close(lone, None, "8B shape, batch 1", workspace=workspace)
    try:
        paged_decode(**lone, scale=0.3, workspace=DecodeWorkspace.allocate(1, 32, 128, "cpu"))
    except ValueError as e:
        if "DecodeWorkspace.for_batches" not in str(e):
            sys.exit(f"a small workspace's error does not name the fix: {e}")
    else:
        sys.exit("a workspace too small for the plan was accepted")


def check_engine(folder: str) -> None:
    from transformers import AutoModelForCausalLM

    from phasefleet.engine.config import EngineConfig
    from phasefleet.engine.llm_engine import LLMEngine
    from phasefleet.engine.sampling_params import SamplingParams

    def split_early(*args: Any, **kwargs: Any) -> torch.Tensor:
        return paged_decode(*args, min_split_tokens=TILE, num_splits=2, **kwargs)

    # one-tile splits, so that the 40-token prompt's decodes run as 2 splits; a grid of 2, not
    # the plan's (tables as wide as max_model_len): the interpreter runs empty programs slowly
    triton_decode.paged_decode = split_early
    os.environ["PHASEFLEET_ATTENTION"] = "triton"
    eng = LLMEngine(EngineConfig(model=folder, device="cpu", block_size=4, num_kv_blocks=64))
    if eng.runner.decode_backend != "triton":
        sys.exit("the engine did not pick the triton backend")
    prompts = [[5 + i for i in range(n)] for n in (3, 14, 40)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, eng.generate(prompts, params), strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(params.max_tokens):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        if out.output_token_ids != ids[len(prompt) :]:
            sys.exit(f"{folder}: engine with the triton kernel differs from transformers")
    # a float8 pool: the kernel's answers are the torch path's (which test_kv_fp8.py holds to
    # transformers with keys and values rounded alike)
    answers = {}
    for backend in ("triton", "torch"):
        os.environ["PHASEFLEET_ATTENTION"] = backend
        config = EngineConfig(
            model=folder, device="cpu", block_size=4, num_kv_blocks=64, kv_cache_dtype="fp8"
        )
        fp8 = LLMEngine(config)
        if fp8.runner.decode_backend != backend:
            sys.exit(f"the float8 engine did not pick the {backend} backend")
        answers[backend] = [o.output_token_ids for o in fp8.generate(prompts, params)]
    if answers["triton"] != answers["torch"]:
        sys.exit(f"{folder}: a float8 pool's answers differ between triton and torch")


if __name__ == "__main__":
    check_small_shapes()
    check_float8_pools()
    check_real_shape()
    for model in sys.argv[1:]:
        check_engine(model)
    print("ok")
