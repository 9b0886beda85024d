"""The KV pool's element type: the model's dtype, or with `kv_cache_dtype` fp8 float8 e4m3
(one byte: twice the blocks of a bfloat16 pool, four times a float32 one's, in the same memory).

Float8 keys and values are stored unscaled (a scale of 1, vLLM's default for `fp8`), saturating
at +-448, and read back into the model's dtype by every attention path, so a step's own chunk
attends to its keys as they are stored too: the answers are those of the model with its keys
(after RoPE) and values rounded to float8.
"""

from __future__ import annotations

import torch

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = torch.finfo(FLOAT8).max


def kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """EngineConfig.kv_cache_dtype ("auto": the model's, "fp8") -> the pool's torch dtype."""
    return FLOAT8 if kv_cache_dtype == "fp8" else model_dtype


def as_rows(cache: torch.Tensor) -> torch.Tensor:
    """A pool (or a view of it) as index_select / index_copy_ take it on every device: a float8
    pool as its bytes (the CPU has no float8 kernel for index_copy_), any other as it is."""
    return cache.view(torch.uint8) if cache.dtype == FLOAT8 else cache


def select_rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache.index_select(0, index), for a float8 pool too."""
    return as_rows(cache).index_select(0, index).view(cache.dtype)


def to_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the pool's `dtype`; to float8, saturating (a plain cast makes NaN out of range)."""
    if dtype == FLOAT8 and x.dtype != FLOAT8:
        return x.clamp(-FLOAT8_MAX, FLOAT8_MAX).to(dtype)
    return x.to(dtype)
