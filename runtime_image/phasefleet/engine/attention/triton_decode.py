"""Paged decode attention in Triton, split over the context (flash-decoding): the decode path on
CUDA (optional).

Two kernels per call. `split_kernel`, grid (request, KV head, split): one program reads one
contiguous range of a request's context for all GROUP query heads that share the KV head, so
each key and value is loaded once per group. It gathers TILE tokens at a time straight from the
pool through the block table (no gather copy), scores the group as one [GROUP_P, D] x [D, TILE]
tl.dot (GROUP padded to 16, tl.dot's smallest M), keeps an online softmax, and writes its
partial (max, sum, unnormalised output) to a workspace. `combine_kernel`, grid (request, query
head), merges a request's partials. A request whose context fits one split writes its output
directly and the merge skips it; a call planned with one split launches no merge at all.

The grid's split count is planned on the host from the batch and the block table's width (what
a captured graph knows), never from the context lengths on the device; each request then cuts
its own context into at most that many splits of at least `min_split_tokens`, so a short context
in a graph captured for long ones is not split needlessly. Only tiles inside the context (and
the sliding window) are read, so a block table padded to a fixed width costs nothing. Importing
this module never fails: `available()` says whether Triton is there. A float8 pool's keys and
values are read as stored and cast to the queries' dtype in registers (one byte per value read).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    tl = None

TILE = 32  # tokens per inner step, gathered across block boundaries; tl.dot needs >= 16
MIN_SPLIT_TOKENS = 256  # a split reads at least this much context (a multiple of TILE)
MAX_SPLITS = 128  # per request: fills 2 x 132 SMs at batch 1 down to 3 KV heads
TARGET_PROGRAMS_PER_SM = 2
DEFAULT_SMS = 132  # an H100's, for planning where no GPU is visible (the interpreter)
LOG2E = 1.4426950408889634


def available() -> bool:
    return triton is not None


def supports(block_size: int) -> bool:
    """Block sizes the engine routes to the kernel: powers of two (>= 2). The kernel gathers
    token by token and is indifferent to the size; only powers of two are tested."""
    return block_size >= 2 and block_size & (block_size - 1) == 0


def plan_splits(
    batch: int,
    kv_heads: int,
    max_tokens: int,
    num_sms: int = DEFAULT_SMS,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
) -> int:
    """Splits per request: enough (request, KV head, split) programs for TARGET_PROGRAMS_PER_SM
    per SM, but none shorter than min_split_tokens of max_tokens, and at most MAX_SPLITS."""
    fill = -(-TARGET_PROGRAMS_PER_SM * num_sms // (batch * kv_heads))
    by_length = -(-max_tokens // min_split_tokens)
    return max(1, min(fill, by_length, MAX_SPLITS))


@dataclass
class DecodeWorkspace:
    """The splits' partials, allocated once so that a captured decode allocates nothing here.
    Row r = request * splits + split; one workspace serves every layer (they run in turn)."""

    acc: torch.Tensor  # [rows, heads, head_dim] float32, unnormalised outputs
    max: torch.Tensor  # [rows, heads] float32, running max of the scores, in log2 units
    sum: torch.Tensor  # [rows, heads] float32, softmax denominators at that max

    @classmethod
    def allocate(
        cls, rows: int, heads: int, head_dim: int, device: torch.device | str
    ) -> DecodeWorkspace:
        acc = torch.empty(rows, heads, head_dim, dtype=torch.float32, device=device)
        stats = torch.empty(2, rows, heads, dtype=torch.float32, device=device)
        return cls(acc, stats[0], stats[1])

    @classmethod
    def for_batches(
        cls,
        max_batch: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        max_tokens: int,
        device: torch.device | str,
    ) -> DecodeWorkspace:
        """Room for any batch up to max_batch with block tables of up to max_tokens (width x
        block_size): at most max_batch + 2 x SMs / kv_heads rows (b * ceil(2 x SMs / (b x
        kv_heads)) for each b); Llama 3 8B up to batch 256 with 8k tables on an H100: 256 rows,
        4 MiB."""
        sms = _num_sms(torch.device(device))
        rows = max(b * plan_splits(b, kv_heads, max_tokens, sms) for b in range(1, max_batch + 1))
        return cls.allocate(rows, heads, head_dim, device)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


if triton is not None:

    @triton.jit
    def _split_bounds(ctx_lens, b, window, splits, min_tiles, TILE: tl.constexpr):
        """This request's context [start, ctx), its first tile, tiles per split, live splits."""
        # A one-lane load summed to a scalar: the same as tl.load(ctx_lens + b) when compiled,
        # and a true 0-d value in the interpreter (loop bounds there must be 0-d).
        ctx = tl.sum(tl.load(ctx_lens + b + tl.arange(0, 1)), axis=0).to(tl.int32)
        start = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
        first = start // TILE
        n_tiles = tl.cdiv(ctx, TILE) - first
        per_split = tl.maximum(tl.cdiv(n_tiles, splits), min_tiles)
        return ctx, start, first, n_tiles, per_split, tl.cdiv(n_tiles, per_split)

    @triton.jit
    def split_kernel(
        Q,  # [B, H, D]
        K,  # [num_blocks, BLOCK, Hkv, D]
        V,
        Out,  # [B, H, D]
        Acc,  # [B * splits, H, D] float32
        Max,  # [B * splits, H] float32
        Sum,
        tables,  # [B, width] int, padded with the null block
        ctx_lens,  # [B] int, >= 1
        qk_scale,  # softmax scale * log2(e): the softmax runs in exp2
        window,  # tokens; 0: no sliding window
        splits,  # the grid's third axis
        min_tiles,  # a split reads at least this many tiles
        stride_qb,
        stride_qh,
        stride_kn,
        stride_kt,
        stride_kh,
        stride_tb,
        stride_ob,
        stride_oh,
        GROUP: tl.constexpr,  # query heads per KV head
        GROUP_P: tl.constexpr,  # GROUP padded to a power of two >= 16
        BLOCK: tl.constexpr,
        TILE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
        PRECISION: tl.constexpr,  # "ieee": float32 queries, not rounded to tf32; 16-bit: ignored
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        heads = tl.num_programs(1) * GROUP
        ctx, start, first, n_tiles, per_split, live = _split_bounds(
            ctx_lens, b, window, splits, min_tiles, TILE
        )
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, BLOCK_D)
        t = tl.arange(0, TILE)
        h = kvh * GROUP + g
        gmask = g < GROUP
        dmask = d < HEAD_DIM
        qmask = gmask[:, None] & dmask[None, :]
        q_ptr = Q + b * stride_qb + h[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr, mask=qmask, other=0.0)  # [GROUP_P, BLOCK_D]
        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
        lo = first + split * per_split
        hi = tl.minimum(lo + per_split, first + n_tiles)  # lo >= hi: a split past the context
        for j in range(lo, hi):
            pos = j * TILE + t
            valid = (pos >= start) & (pos < ctx)
            block = tl.load(tables + b * stride_tb + pos // BLOCK, mask=valid, other=0)
            row = block.to(tl.int64) * stride_kn + (pos % BLOCK) * stride_kt + kvh * stride_kh
            kv_mask = valid[None, :] & dmask[:, None]
            k = tl.load(K + row[None, :] + d[:, None], mask=kv_mask, other=0.0)  # [BLOCK_D, TILE]
            k = k.to(q.dtype)  # a float8 pool's keys in the queries' dtype (else a no-op)
            s = tl.dot(q, k, input_precision=PRECISION)
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # [GROUP_P, TILE]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            v_mask = valid[:, None] & dmask[None, :]
            v = tl.load(V + row[:, None] + d[None, :], mask=v_mask, other=0.0).to(q.dtype)
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out_ptr = Out + b * stride_ob + h[:, None] * stride_oh + d[None, :]
        out = (acc / l_i[:, None]).to(Out.dtype.element_ty)
        tl.store(out_ptr, out, mask=qmask & (live == 1) & (split == 0))
        keep = gmask & (live > 1) & (split < live)
        r = (b * splits + split) * heads + h  # [GROUP_P] rows of the workspace
        tl.store(Max + r, m_i, mask=keep)
        tl.store(Sum + r, l_i, mask=keep)
        acc_ptr = Acc + r[:, None] * HEAD_DIM + d[None, :]
        tl.store(acc_ptr, acc, mask=keep[:, None] & dmask[None, :])

    @triton.jit
    def combine_kernel(
        Out,  # [B, H, D]
        Acc,  # [B * splits, H, D] float32
        Max,  # [B * splits, H] float32
        Sum,
        ctx_lens,
        window,
        splits,
        min_tiles,
        stride_ob,
        stride_oh,
        TILE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        heads = tl.num_programs(1)
        ctx, start, first, n_tiles, per_split, live = _split_bounds(
            ctx_lens, b, window, splits, min_tiles, TILE
        )
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        m = tl.max(tl.full([1], float("-inf"), tl.float32), axis=0)
        total = tl.sum(tl.zeros([1], tl.float32), axis=0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for split in range(0, tl.where(live > 1, live, 0)):  # one live split wrote Out itself
            r = (b * splits + split) * heads + h
            m_s = tl.load(Max + r)
            m_new = tl.maximum(m, m_s)
            alpha = tl.exp2(m - m_new)
            beta = tl.exp2(m_s - m_new)
            total = total * alpha + tl.load(Sum + r) * beta
            acc = acc * alpha + tl.load(Acc + r * HEAD_DIM + d, mask=dmask, other=0.0) * beta
            m = m_new
        out = (acc / total).to(Out.dtype.element_ty)
        tl.store(Out + b * stride_ob + h * stride_oh + d, out, mask=dmask & (live > 1))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    workspace: DecodeWorkspace | None = None,
    num_splits: int | None = None,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
) -> torch.Tensor:
    """q: [B, H, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, width] (null
    block padded); context_lens [B] (>= 1 each) -> [B, H, D]. Without a workspace one is
    allocated per call; num_splits overrides the plan (tests)."""
    if triton is None:
        raise RuntimeError("triton is not installed; use the torch attention path")
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("paged_decode needs the last dimension of q and the caches contiguous")
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache strides {v_cache.stride()} differ from k_cache's")
    if min_split_tokens < TILE or min_split_tokens % TILE:
        raise ValueError(f"min_split_tokens must be a multiple of {TILE}, got {min_split_tokens}")
    max_tokens = block_tables.shape[1] * block_size
    if sliding_window:
        max_tokens = min(max_tokens, sliding_window + TILE)  # the window plus tile alignment
    splits = num_splits or plan_splits(
        batch, kv_heads, max_tokens, _num_sms(q.device), min_split_tokens
    )
    if workspace is None:
        rows = batch * splits if splits > 1 else 1  # one split: the partials are never written
        workspace = DecodeWorkspace.allocate(rows, heads, head_dim, q.device)
    elif splits > 1 and (
        workspace.acc.shape[0] < batch * splits or workspace.acc.shape[1:] != (heads, head_dim)
    ):
        raise ValueError(
            f"the workspace holds {tuple(workspace.acc.shape)}; this call needs at least "
            f"({batch * splits}, {heads}, {head_dim}): size it with DecodeWorkspace.for_batches"
        )
    group = heads // kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    window, min_tiles = sliding_window or 0, min_split_tokens // TILE
    out = torch.empty_like(q)
    split_kernel[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        out,
        workspace.acc,
        workspace.max,
        workspace.sum,
        block_tables,
        context_lens,
        scale * LOG2E,
        window,
        splits,
        min_tiles,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_P=max(16, triton.next_power_of_2(group)),
        BLOCK=block_size,
        TILE=TILE,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if splits > 1:
        combine_kernel[(batch, heads)](
            out,
            workspace.acc,
            workspace.max,
            workspace.sum,
            context_lens,
            window,
            splits,
            min_tiles,
            out.stride(0),
            out.stride(1),
            TILE=TILE,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
        )
    return out
