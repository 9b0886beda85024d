"""KV received in the sender's layout, converted to this worker's: prefill and decode pools are
rolled separately, so one may run another block size, KV dtype or split of its KV heads.

Only the model's shape must agree (layers, KV heads, head dim). The chunks are read as tokens
([layers, K/V, tokens, heads, head_dim]), cast, and cut again into this worker's blocks: the
block holding the prompt's last token is padded, any other partial block is dropped (its
tokens are recomputed, as for a cut stream). This is a copy of the whole prompt's KV; a fleet
whose pools share a layout never pays it.
"""

from __future__ import annotations

import torch

from phasefleet.engine.kv_cache_manager import cdiv
from phasefleet.engine.kv_dtype import to_kv
from phasefleet.engine.kv_transfer import KVChunk, KVLayout


def _torch_dtype(layout: KVLayout) -> torch.dtype:
    dtype = getattr(torch, layout.dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype


def chunk_tokens(chunk: KVChunk, layout: KVLayout) -> torch.Tensor:
    """A chunk's KV as [layers, 2, num_blocks x block_size, kv_heads, head_dim] (a view when
    its heads are in one shard)."""
    shards, heads = layout.head_shards, layout.num_kv_heads
    blocks = chunk.payload.view(_torch_dtype(layout)).view(
        layout.num_layers,
        2,
        shards,
        chunk.num_blocks,
        layout.block_size,
        heads // shards,
        layout.head_dim,
    )
    tokens = blocks.permute(0, 1, 3, 4, 2, 5, 6)  # the shards' heads side by side
    return tokens.reshape(layout.num_layers, 2, -1, heads, layout.head_dim)


def tokens_chunk(tokens: torch.Tensor, layout: KVLayout, first_block: int) -> KVChunk:
    """[layers, 2, n x block_size, kv_heads, head_dim] as n blocks of `layout` from
    `first_block` on."""
    shards, bs = layout.head_shards, layout.block_size
    num_layers, _, num_tokens, heads, head_dim = tokens.shape
    num_blocks = num_tokens // bs
    blocks = tokens.reshape(num_layers, 2, num_blocks, bs, shards, heads // shards, head_dim)
    wire = to_kv(blocks.permute(0, 1, 4, 2, 3, 5, 6), _torch_dtype(layout)).contiguous()
    return KVChunk(first_block, num_blocks, wire.view(torch.uint8).reshape(-1))


def convert_chunks(
    chunks: list[KVChunk],
    sender: KVLayout,
    receiver: KVLayout,
    num_prompt_tokens: int,
    from_token: int = 0,
) -> list[KVChunk]:
    """Consecutive chunks of `sender`'s blocks as one chunk of `receiver`'s, from the receiver
    block that holds `from_token` (the receiver's prefix-cache hits end there) on; [] when no
    whole receiver block arrived."""
    why = receiver.unconvertible(sender)
    if why is not None:
        raise ValueError(f"KV cannot be converted: {why}")
    if not chunks:
        return []
    start = chunks[0].first_block * sender.block_size
    tokens = torch.cat([chunk_tokens(c, sender) for c in chunks], dim=2)
    end = min(start + tokens.shape[2], num_prompt_tokens)
    bs = receiver.block_size
    first = cdiv(max(start, from_token), bs)
    last = cdiv(end, bs) if end == num_prompt_tokens else end // bs
    if last <= first:
        return []
    kept = tokens[:, :, first * bs - start : end - start]
    pad = (last - first) * bs - kept.shape[2]
    if pad:
        kept = torch.cat([kept, kept.new_zeros(*kept.shape[:2], pad, *kept.shape[3:])], dim=2)
    return [tokens_chunk(kept, receiver, first)]
