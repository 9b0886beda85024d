"""Prefill attention (attention/prefill.py) against SDPA with a dense mask, its plan of pieces,
and the memory it takes at a long context."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from phasefleet.engine.attention import prefill
from phasefleet.engine.attention.metadata import PrefillSeq
from phasefleet.engine.attention.prefill import (
    Piece,
    Visibility,
    attend_math,
    piece_mask,
    plan,
    prefill_attention,
)

SCALE = 0.3
LEAD = 3  # decode rows ahead of the prefills in the flat batch


@dataclass
class Batch:
    q: torch.Tensor  # [T, H, D], LEAD decode rows then each chunk's queries
    k: torch.Tensor  # [T, Hkv, D], the step's new keys (already in the pool)
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    prefills: list[PrefillSeq]
    keys: list[torch.Tensor]  # each prefill's whole context [ctx_len, Hkv, D], for the reference
    values: list[torch.Tensor]


def make_batch(
    chunks: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    dtype: torch.dtype = torch.float32,
    block_size: int = 4,
    dim: int = 16,
    seed: int = 0,
) -> Batch:
    """chunks: (first query position, q_len) per prefill. Each context is written to blocks
    scattered over the pool, as a busy pool leaves them."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = [-(-(first + q_len) // block_size) for first, q_len in chunks]
    pool_blocks = sum(nblocks) + 5
    k_cache = torch.zeros(pool_blocks, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = (torch.randperm(pool_blocks - 1, generator=gen) + 1).tolist()  # block 0: null
    qs = [torch.randn(LEAD, heads, dim, generator=gen).to(dtype)]
    ks = [torch.randn(LEAD, kv_heads, dim, generator=gen).to(dtype)]
    vs = [torch.randn(LEAD, kv_heads, dim, generator=gen).to(dtype)]
    prefills, keys, values = [], [], []
    start = LEAD
    for (first, q_len), n in zip(chunks, nblocks, strict=True):
        ctx = first + q_len
        table = torch.tensor([free.pop() for _ in range(n)])
        kk = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype)
        vv = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype)
        pos = torch.arange(ctx)
        slots = table[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, kv_heads, dim)[slots] = kk
        v_cache.view(-1, kv_heads, dim)[slots] = vv
        qs.append(torch.randn(q_len, heads, dim, generator=gen).to(dtype))
        ks.append(kk[first:])
        vs.append(vv[first:])
        prefills.append(PrefillSeq(start=start, q_len=q_len, ctx_len=ctx, block_table=table))
        keys.append(kk)
        values.append(vv)
        start += q_len
    return Batch(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, prefills, keys, values
    )


def dense_mask(first: int, q_len: int, window: int | None) -> torch.Tensor:
    """[q_len, first + q_len] bool: lower-right causal, within the window."""
    q_pos = torch.arange(first, first + q_len).unsqueeze(1)
    k_pos = torch.arange(first + q_len).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def reference(batch: Batch, i: int, window: int | None) -> torch.Tensor:
    """Prefill i by SDPA with a dense mask, in float32 -> [q_len, H, D]."""
    seq = batch.prefills[i]
    q = batch.q[seq.start : seq.start + seq.q_len].float().transpose(0, 1)[None]
    k = batch.keys[i].float().transpose(0, 1)[None]
    v = batch.values[i].float().transpose(0, 1)[None]
    mask = dense_mask(seq.ctx_len - seq.q_len, seq.q_len, window)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)
    return o[0].transpose(0, 1)


def run(batch: Batch, window: int | None, tile: int | None = None) -> torch.Tensor:
    return prefill_attention(
        batch.q,
        batch.k,
        batch.v,
        batch.k_cache,
        batch.v_cache,
        batch.prefills,
        SCALE,
        window,
        tile=tile,
    )


def check(batch: Batch, got: torch.Tensor, window: int | None, tol: float) -> None:
    assert got.shape == (batch.q.shape[0] - LEAD, *batch.q.shape[1:])
    assert got.dtype == batch.q.dtype
    for i, seq in enumerate(batch.prefills):
        rows = got[seq.start - LEAD : seq.start - LEAD + seq.q_len].float()
        torch.testing.assert_close(rows, reference(batch, i, window), rtol=tol, atol=tol)


# name -> ((first query position, q_len), window); block size 4
CASES = {
    "no_prefix": ((0, 13), None),
    "chunk_after_prefix": ((10, 7), None),  # ctx 17: not a multiple of the block size
    "full_prefix_hit": ((37, 1), None),  # only the last prompt token is computed
    "window_within_chunk": ((0, 30), 7),
    "window_across_chunks": ((25, 20), 9),
}
DTYPES = {"fp32": (torch.float32, 1e-5), "bf16": (torch.bfloat16, 2e-2)}


@pytest.mark.parametrize("tile", [8, None], ids=["tile8", "tile_default"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (32, 8), (4, 4)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_matches_dense_mask_sdpa(
    case: str, heads: int, kv_heads: int, dtype: str, tile: int | None
) -> None:
    chunk, window = CASES[case]
    torch_dtype, tol = DTYPES[dtype]
    batch = make_batch([chunk], heads, kv_heads, torch_dtype)
    check(batch, run(batch, window, tile), window, tol)


@pytest.mark.parametrize("window", [None, 9])
def test_several_prefills_in_one_call(window: int | None) -> None:
    batch = make_batch([(0, 9), (10, 7), (25, 20), (37, 1), (0, 30)], 9, 3, seed=1)
    check(batch, run(batch, window, tile=8), window, 1e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_matmul_path_for_pieces_no_flash_kernel_takes(
    window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What CUDA runs for masked pieces, float32 and head sizes flash refuses.
    def math_only(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        piece: Piece,
        w: int | None,
        softcap: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mask = None if piece.vis is Visibility.ALL else piece_mask(piece, w, q.device)
        return attend_math(q, k, v, scale, mask, softcap)

    monkeypatch.setattr(prefill, "_attend", math_only)
    batch = make_batch([(10, 7), (25, 20), (0, 30)], 32, 8, seed=2)
    check(batch, run(batch, window, tile=8), window, 1e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_softcapped_scores_match_eager_attention(window: int | None) -> None:
    """Gemma 2's cap, cap * tanh(scores / cap) before the mask, as transformers' eager path;
    the first chunk too (it never takes SDPA's causal shortcut with a cap)."""
    cap = 1.5  # below the scores' spread: the cap bites
    batch = make_batch([(0, 20), (10, 7), (25, 20)], 4, 2, seed=3)
    got = prefill_attention(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.prefills, SCALE,
        window, softcap=cap, tile=8,
    )  # fmt: skip
    plain = run(batch, window, tile=8)
    for i, seq in enumerate(batch.prefills):
        q = batch.q[seq.start : seq.start + seq.q_len].transpose(0, 1)  # [H, q, D]
        k = batch.keys[i].repeat_interleave(2, dim=1).transpose(0, 1)  # [H, ctx, D]
        v = batch.values[i].repeat_interleave(2, dim=1).transpose(0, 1)
        scores = torch.tanh(q @ k.transpose(1, 2) * SCALE / cap) * cap
        mask = dense_mask(seq.ctx_len - seq.q_len, seq.q_len, window)
        want = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(0, 1)
        rows = slice(seq.start - LEAD, seq.start - LEAD + seq.q_len)
        assert torch.allclose(got[rows], want, atol=1e-5)
        assert not torch.allclose(plain[rows], want, atol=1e-2)  # the cap changed something


def test_plan_covers_each_visible_pair_once_and_no_row_sees_nothing() -> None:
    for first, q_len, window, tile in itertools.product(
        [0, 3, 10, 37], [1, 5, 20], [None, 1, 3, 9, 40], [4, 8, 64]
    ):
        count = torch.zeros(q_len, first + q_len, dtype=torch.long)
        for p in plan(first, q_len, window, tile):
            assert 0 < p.k1 - p.k0 <= tile and p.q0 < p.q1
            seen = piece_mask(p, window, torch.device("cpu"))
            assert seen.any(dim=1).all(), (first, q_len, window, tile, p)
            if p.vis is Visibility.ALL:
                assert seen.all()
            if p.vis is Visibility.CAUSAL:
                assert (p.q0, p.q1) == (p.k0, p.k1) and seen.equal(seen.tril())
            count[p.q0 - first : p.q1 - first, p.k0 : p.k1] += seen
        assert count.equal(dense_mask(first, q_len, window).long()), (first, q_len, window, tile)


def test_chunk_with_nothing_cached_before_is_one_causal_piece() -> None:
    assert plan(0, 100, None, 2048) == (Piece(0, 100, 0, 100, Visibility.CAUSAL),)
    assert plan(0, 100, 100, 2048) == (Piece(0, 100, 0, 100, Visibility.CAUSAL),)


class LargestTensor(TorchDispatchMode):
    """Records the largest storage behind any tensor an op returns, and the ops run."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops[func.overloadpacket.__name__] += 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


def dense_prefill(batch: Batch, window: int | None) -> torch.Tensor:
    """What prefill attention did before: gather the whole context, a [q_len, ctx] mask."""
    seq = batch.prefills[0]
    keys = batch.k_cache.index_select(0, seq.block_table).flatten(0, 1)[: seq.ctx_len]
    values = batch.v_cache.index_select(0, seq.block_table).flatten(0, 1)[: seq.ctx_len]
    mask = dense_mask(seq.ctx_len - seq.q_len, seq.q_len, window)
    return F.scaled_dot_product_attention(
        batch.q[seq.start :].transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        scale=SCALE,
        enable_gqa=True,
    )


@pytest.mark.parametrize("window", [None, 3000])
def test_memory_is_bounded_by_chunk_times_tile_not_by_context(window: int | None) -> None:
    q_len, ctx, tile = 256, 16384, 1024
    batch = make_batch([(ctx - q_len, q_len)], 8, 2, block_size=16, dim=64)
    bound = 4 * q_len * tile  # one piece's float32 mask; a tile's K and the accumulator are less
    with torch.inference_mode(), LargestTensor() as new:
        got = run(batch, window, tile)
    with torch.inference_mode(), LargestTensor() as old:
        want = dense_prefill(batch, window)
    torch.testing.assert_close(got, want[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert new.nbytes <= bound, new.nbytes
    # The same recorder sees the old path's context-sized gather (ctx x 2 kv heads x 64 x 4 B).
    assert old.nbytes >= ctx * 2 * 64 * 4 == 8 * bound, old.nbytes
    # The prefix was read from the pool one tile at a time (keys and values); with the window
    # only the tiles it reaches.
    first_tile = 0 if window is None else (ctx - q_len - window + 1) // tile
    assert new.ops["index_select"] == 2 * (-(-(ctx - q_len) // tile) - first_tile)
