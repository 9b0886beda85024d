"""Paged decode attention as one Triton kernel: the faster decode path on CUDA (optional).

Each program computes one (request, query head): it walks the request's block table, loads one
KV block at a time straight from the pool (no gather copy) and keeps an online softmax. Only the
blocks inside the context (and the sliding window) are read, so a block table padded to a fixed
width costs nothing, which is what CUDA graphs need. Importing this module never fails:
`available()` says whether Triton is there.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    tl = None


def available() -> bool:
    return triton is not None


def supports(block_size: int) -> bool:
    """The kernel loads a whole block at once: its size must be a power of two (>= 2)."""
    return block_size >= 2 and block_size & (block_size - 1) == 0


_kernel: Any = None


def _build_kernel() -> Any:
    if triton is None or tl is None:
        raise RuntimeError("triton is not installed; use the torch attention path")

    @triton.jit
    def paged_decode_kernel(
        Q,  # [B, H, D]
        K,  # [num_blocks, BLOCK, Hkv, D]
        V,
        Out,  # [B, H, D]
        tables,  # [B, max_blocks] int
        ctx_lens,  # [B] int
        scale,
        window,  # tokens; 0: no sliding window
        stride_qb,
        stride_qh,
        stride_kn,
        stride_kt,
        stride_kh,
        stride_tb,
        stride_ob,
        stride_oh,
        GROUP: tl.constexpr,  # query heads per kv head
        BLOCK: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        q = tl.load(Q + b * stride_qb + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
        # A one-lane load summed to a scalar: the same as tl.load(ctx_lens + b) when compiled,
        # and a true 0-d value in the interpreter (loop bounds there must be 0-d).
        ctx = tl.sum(tl.load(ctx_lens + b + tl.arange(0, 1)), axis=0).to(tl.int32)
        start = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
        offs = tl.arange(0, BLOCK)
        m_i = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        l_i = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for j in range(start // BLOCK, tl.cdiv(ctx, BLOCK)):
            block = tl.load(tables + b * stride_tb + j).to(tl.int64)
            pos = j * BLOCK + offs
            valid = (pos < ctx) & (pos >= start)
            base = block * stride_kn + offs[:, None] * stride_kt + kvh * stride_kh + d[None, :]
            lmask = valid[:, None] & dmask[None, :]
            k = tl.load(K + base, mask=lmask, other=0.0).to(tl.float32)  # [BLOCK, BLOCK_D]
            s = tl.sum(k * q[None, :], axis=1) * scale
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(V + base, mask=lmask, other=0.0).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
        out = acc / l_i
        tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=dmask)

    return paged_decode_kernel


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [B, H, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks];
    context_lens [B] (>= 1 each) -> [B, H, D]."""
    global _kernel
    if triton is None:
        raise RuntimeError("triton is not installed; use the torch attention path")
    if _kernel is None:
        _kernel = _build_kernel()
    b, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("paged_decode needs the last dimension of q and the caches contiguous")
    out = torch.empty_like(q)
    _kernel[(b, heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        context_lens,
        scale,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=heads // kv_heads,
        BLOCK=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out
