"""Prefill attention: a step's multi-token queries against their cached prefix and themselves,
with no dense mask and no gather of a whole context.

A chunk's q_len queries are the last q_len of its ctx_len positions (causal aligned to the lower
right); with a sliding window W, query p sees keys p - W + 1 .. p. A chunk with nothing cached
before it (and no window shorter than it) is one SDPA call with is_causal. Otherwise the keys are
cut into tiles of at most `tile` positions: the cached prefix from position 0, read from the pool
by an index_select of the tile's blocks, and the chunk from its first position, read from the
step's own k and v. Position arithmetic splits each tile's queries into at most three pieces:
the tile's own positions (a square on the diagonal: top-left causal), the rows that see the
whole tile, and the rows the window cuts (a [rows, tile] mask). Rows that see nothing of a tile
are left out, so no row of a piece is fully masked. Each piece runs a fused kernel that returns
its log-sum-exp, and the pieces merge into a float32 accumulator of the chunk's rows: memory is
the chunk's rows plus one tile, whatever the context length.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention

from phasefleet.engine.attention.metadata import PrefillSeq
from phasefleet.engine.kv_dtype import select_rows

# Keys per tile, by device type. CPU: as fast as any larger tile for a 2048-token chunk at a 16k
# context, with less memory (docs/engine.md). CUDA (not measured): large, so the float32 merges
# of the chunk's rows stay small beside each tile's flash call; its K/V is 64 MiB at 8B shapes.
KEY_TILE = {"cpu": 2048, "cuda": 16384}
# Keys per tile with softcapping: scores are [heads, chunk, tile] float32 (16 heads, a 2048-token
# chunk: 256 MiB)
SOFTCAP_TILE = 2048


class Visibility(Enum):
    ALL = "all"  # every row sees every key of the piece: no mask
    CAUSAL = "causal"  # a square on the diagonal, row i sees keys 0..i: SDPA's is_causal
    MASKED = "masked"  # the window cuts it: a mask built from positions


@dataclass(frozen=True)
class Piece:
    q0: int  # first query position (absolute, in the request)
    q1: int  # one past the last query position
    k0: int  # first key position
    k1: int  # one past the last key position; k1 - k0 <= tile
    vis: Visibility


@functools.lru_cache(maxsize=4096)
def plan(first: int, q_len: int, window: int | None, tile: int) -> tuple[Piece, ...]:
    """The pieces that cover a chunk whose queries are positions first .. first + q_len - 1,
    tile by tile in key order (a tile's pieces are consecutive)."""
    end = first + q_len
    w = end if window is None else window
    starts = [*range(0, first, tile), *range(first, end, tile)]
    pieces = []
    for k0, k1 in zip(starts, [*starts[1:], end], strict=True):
        row, last = max(first, k0), min(end, k1 - 1 + w)  # rows past `last` see none of it
        if k0 >= first:  # a tile of the chunk itself: its own positions first
            vis = Visibility.CAUSAL if k1 - k0 <= w else Visibility.MASKED
            pieces.append(Piece(k0, k1, k0, k1, vis))
            row = k1
        full = min(last, k0 + w)  # rows before it still see key k0
        if row < full:
            pieces.append(Piece(row, full, k0, k1, Visibility.ALL))
        if max(row, full) < last:
            pieces.append(Piece(max(row, full), last, k0, k1, Visibility.MASKED))
    return tuple(pieces)


def piece_mask(piece: Piece, window: int | None, device: torch.device) -> torch.Tensor:
    """[q1 - q0, k1 - k0] bool, True = attend: causal, and within the window."""
    q_pos = torch.arange(piece.q0, piece.q1, device=device).unsqueeze(1)
    k_pos = torch.arange(piece.k0, piece.k1, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefills: list[PrefillSeq],
    scale: float,
    window: int | None,
    softcap: float | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim], already written to the pool
    ([num_blocks, block_size, kv_heads, head_dim]) -> [sum of q_len, heads, head_dim], the
    prefills' outputs in batch order. One call for all prefills, so a varlen kernel can replace
    the loop over them; `tile` defaults to KEY_TILE for the device. `softcap` (Gemma 2): scores
    capped by tanh, which no fused kernel here takes: every piece runs as attend_math, in
    tiles of at most SOFTCAP_TILE keys (its scores are materialized)."""
    tile = tile or KEY_TILE.get(q.device.type, KEY_TILE["cpu"])
    if softcap is not None:
        tile = min(tile, SOFTCAP_TILE)
    parts = [
        _prefill(q, k, v, k_cache, v_cache, seq, scale, window, tile, softcap) for seq in prefills
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # one part: no copy


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: PrefillSeq,
    scale: float,
    window: int | None,
    tile: int,
    softcap: float | None,
) -> torch.Tensor:
    end = seq.start + seq.q_len
    first = seq.ctx_len - seq.q_len  # position of the chunk's first query
    qh = q[seq.start : end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
    if first == 0 and (window is None or seq.q_len <= window) and softcap is None:
        o = F.scaled_dot_product_attention(
            qh,
            k[seq.start : end].transpose(0, 1).unsqueeze(0),  # [1, Hkv, q_len, D]
            v[seq.start : end].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)
    acc = torch.zeros(qh.shape, dtype=torch.float32, device=q.device)  # [1, H, q_len, D]
    lse = torch.full(qh.shape[:3], float("-inf"), device=q.device)  # [1, H, q_len]
    pieces = plan(first, seq.q_len, window, tile)
    for (k0, k1), same_tile in itertools.groupby(pieces, key=lambda p: (p.k0, p.k1)):
        keys, values = _tile_kv(k, v, k_cache, v_cache, seq, first, k0, k1)
        for piece in same_tile:
            rows = slice(piece.q0 - first, piece.q1 - first)
            out, out_lse = _attend(qh[:, :, rows], keys, values, scale, piece, window, softcap)
            _merge(acc[:, :, rows], lse[:, :, rows], out, out_lse)
    return acc[0].transpose(0, 1).to(q.dtype)


def _tile_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: PrefillSeq,
    first: int,
    k0: int,
    k1: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions k0 .. k1 - 1 -> two [1, Hkv, k1 - k0, D]: the chunk's from
    the step's own k, v; the prefix's by an index_select of the blocks holding them."""
    if k0 >= first:
        lo = seq.start + k0 - first
        keys, values = k[lo : lo + k1 - k0], v[lo : lo + k1 - k0]
    else:
        bs = k_cache.shape[1]
        blocks = seq.block_table[k0 // bs : -(-k1 // bs)]
        skip = k0 % bs
        keys = select_rows(k_cache, blocks).flatten(0, 1)[skip : skip + k1 - k0].to(k.dtype)
        values = select_rows(v_cache, blocks).flatten(0, 1)[skip : skip + k1 - k0].to(v.dtype)
    return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    piece: Piece,
    window: int | None,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One piece: q [1, H, r, D]; keys, values [1, Hkv, n, D] -> (out [1, H, r, D] in q's
    dtype, log-sum-exp [1, H, r] float32). Both flash ops take grouped K/V heads as they are."""
    causal = piece.vis is Visibility.CAUSAL
    if softcap is not None:
        mask = None if piece.vis is Visibility.ALL else piece_mask(piece, window, q.device)
        return attend_math(q, keys, values, scale, mask, softcap)
    if q.device.type == "cpu":
        bias = None
        if piece.vis is Visibility.MASKED:  # this op wants an additive mask in q's dtype
            seen = piece_mask(piece, window, q.device)
            bias = torch.zeros(seen.shape, dtype=q.dtype).masked_fill_(~seen, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, keys, values, 0.0, causal, attn_mask=bias, scale=scale
        )
        return out, lse
    if piece.vis is not Visibility.MASKED and _flash_fits(q, keys, values, causal):
        # On CUDA this op's is_causal is aligned to the lower right; our CAUSAL pieces are square.
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, keys, values, 0.0, causal, False, scale=scale
        )
        return res[0], res[1]
    mask = None if piece.vis is Visibility.ALL else piece_mask(piece, window, q.device)
    return attend_math(q, keys, values, scale, mask)


def _flash_fits(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool) -> bool:
    """Whether torch's CUDA flash kernel takes these inputs (16-bit, head_dim, GPU arch)."""
    if q.shape[-1] % 8:  # SDPA pads such heads before this op; we leave them to attend_math
        return False
    return bool(can_use_flash_attention(SDPAParams(q, keys, values, None, 0.0, causal, True)))


def attend_math(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention as matmuls, for inputs no flash kernel takes: q [1, H, r, D]; keys, values
    [1, Hkv, n, D]; mask [r, n] bool or None -> (out [1, H, r, D], lse [1, H, r] float32).
    Query head h reads kv head h // (H / Hkv); scores are [H, r, n] float32, one piece's,
    capped to softcap * tanh(scores / softcap) when `softcap` is set."""
    _, heads, rows, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(kv_heads, heads // kv_heads, rows, dim)  # [Hkv, G, r, D]
    scores = torch.matmul(grouped, keys[0].unsqueeze(1).transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, G, r]
    probs = torch.exp(scores.sub_(lse.unsqueeze(-1))).to(values.dtype)
    out = torch.matmul(probs, values[0].unsqueeze(1))  # [Hkv, G, r, D]
    return out.reshape(1, heads, rows, dim), lse.reshape(1, heads, rows)


def _merge(acc: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor) -> None:
    """Folds a piece into the running result, in place: acc [1, H, r, D] float32 (softmax-
    weighted values so far), lse [1, H, r] (log of their weight; -inf where nothing yet)."""
    new = torch.logaddexp(lse, out_lse)
    acc.mul_((lse - new).exp_().unsqueeze(-1))
    acc.add_(out.float() * (out_lse - new).exp_().unsqueeze(-1))
    lse.copy_(new)
