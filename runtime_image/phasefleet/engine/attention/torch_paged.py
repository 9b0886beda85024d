"""Paged attention. The pure-torch path runs on CPU and GPU; decodes can go to the Triton kernel.

Keys and values of one layer live in a pool of blocks, k_cache/v_cache: [num_blocks, block_size,
kv_heads, head_dim]. New keys are scattered into their slots, then each query gathers the blocks
of its request through its block table and runs scaled_dot_product_attention. Decodes run in
groups of similar context length, so padding every gather to the longest one in the batch does
not multiply the bytes copied. On the CPU, SDPA is slow for bfloat16/float16 one-token queries
(its flash kernel runs 4-7x longer than float32), so there a group with a `bias` runs as two
batched matmuls with a float32 softmax instead, the arithmetic of transformers' eager attention.
All of a step's prefills go through one call of prefill.py. A float8 pool (kv_dtype.py) is read
back into the queries' dtype wherever it is read, and a step's own keys and values are rounded
to it before any attention, so every query sees them as stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phasefleet.engine.attention import triton_decode
from phasefleet.engine.attention.metadata import AttentionMetadata, DecodeGroup
from phasefleet.engine.attention.prefill import prefill_attention
from phasefleet.engine.kv_dtype import as_rows, select_rows, to_kv


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """k, v: [T, kv_heads, head_dim], in the pool's dtype, into their slots ([T] long) of the
    layer's pool."""
    for cache, new in ((k_cache, k), (v_cache, v)):
        as_rows(cache.view(-1, *new.shape[1:])).index_copy_(0, slots, as_rows(new))


def grouped_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per request as two batched matmuls. q: [n, H, D]; keys, values: [n, Hkv, S, D];
    bias: [n, 1, 1, S] float32 additive mask -> [n, H, D]. Query head h reads kv head
    h // (H / Hkv), as in SDPA's enable_gqa. `softcap`: scores become cap * tanh(scores / cap)
    before the mask (Gemma 2)."""
    n, heads, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(n, kv_heads, heads // kv_heads, dim)  # [n, Hkv, G, D]
    scores = torch.matmul(grouped, keys.contiguous().transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + bias
    probs = torch.softmax(scores, dim=-1).to(q.dtype)  # [n, Hkv, G, S]
    return torch.matmul(probs, values.contiguous()).reshape(n, heads, dim)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads, head_dim]. `window`:
    the layer's sliding window in tokens (None: the whole context); `softcap`: scores capped
    by tanh (Gemma 2; no fused kernel takes it, so its decodes run as matmuls, their groups
    carrying biases)."""
    k, v = to_kv(k, k_cache.dtype), to_kv(v, v_cache.dtype)  # a no-op but in a float8 pool
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    k, v = k.to(q.dtype), v.to(q.dtype)  # attend to the keys and values as stored
    parts = []  # outputs in batch order: the decodes (one part per group), then each prefill
    n_dec = meta.num_decode_tokens
    if n_dec and meta.decode_backend == "triton":
        parts.append(
            triton_decode.paged_decode(
                q[:n_dec],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                scale,
                window,
                workspace=meta.decode_workspace,
            )
        )
    elif n_dec:
        parts += [
            _decode_group(q, k_cache, v_cache, group, scale, window, softcap)
            for group in meta.decode_groups
        ]
    if meta.prefills:
        parts.append(
            prefill_attention(q, k, v, k_cache, v_cache, meta.prefills, scale, window, softcap)
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # one part: no copy


def _decode_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """The group's one-token queries against its blocks -> [size, heads, head_dim]."""
    end = group.start + group.size
    shape = (group.size, -1, k_cache.shape[2], k_cache.shape[3])
    if group.first_block is not None:
        blocks = slice(group.first_block, group.first_block + group.block_tables.shape[1])
        keys = k_cache[blocks].view(shape).transpose(1, 2)  # [1, Hkv, S, D], a view
        values = v_cache[blocks].view(shape).transpose(1, 2)
    else:
        # index_select, not k_cache[tables]: advanced indexing is far slower on a big pool
        flat = group.block_tables.reshape(-1)
        keys = select_rows(k_cache, flat).view(shape).transpose(1, 2)  # [n, Hkv, S, D]
        values = select_rows(v_cache, flat).view(shape).transpose(1, 2)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a float8 pool's, read back
    if group.biases:
        bias = group.biases[window]
        return grouped_decode_attention(q[group.start : end], keys, values, bias, scale, softcap)
    if softcap is not None:
        raise ValueError("attention softcapping needs the decode groups' biases (matmul path)")
    o = F.scaled_dot_product_attention(
        q[group.start : end].unsqueeze(2),  # [n, H, 1, D]
        keys,
        values,
        attn_mask=group.masks[window],
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(2)
