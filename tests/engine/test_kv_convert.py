"""KV converted between layouts of one model shape: block size, dtype and head shards."""

from __future__ import annotations

import pytest
import torch

from phasefleet.engine.kv_convert import chunk_tokens, convert_chunks, tokens_chunk
from phasefleet.engine.kv_transfer import KVChunk, KVLayout

LAYERS, HEADS, DIM, TOKENS = 2, 4, 8, 21


def layout(block_size: int, dtype: str = "float32", shards: int = 1) -> KVLayout:
    return KVLayout(LAYERS, HEADS, DIM, block_size, dtype, head_shards=shards)


def kv(tokens: int = TOKENS) -> torch.Tensor:
    return torch.randn(LAYERS, 2, tokens, HEADS, DIM, generator=torch.Generator().manual_seed(0))


def sent(tokens: torch.Tensor, sender: KVLayout, per_chunk: int) -> list[KVChunk]:
    """`tokens` (padded to whole blocks) as the sender's chunks of `per_chunk` blocks."""
    bs = sender.block_size
    blocks = -(-tokens.shape[2] // bs)
    padded = torch.zeros(LAYERS, 2, blocks * bs, HEADS, DIM)
    padded[:, :, : tokens.shape[2]] = tokens
    return [
        tokens_chunk(padded[:, :, b * bs : min(b + per_chunk, blocks) * bs], sender, b)
        for b in range(0, blocks, per_chunk)
    ]


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_a_chunk_reads_back_as_the_tokens_it_was_made_of(shards: int) -> None:
    sender = layout(4, shards=shards)
    tokens = kv(12)
    chunk = tokens_chunk(tokens, sender, first_block=3)
    assert (chunk.first_block, chunk.num_blocks) == (3, 3)
    assert chunk.payload.numel() == sender.payload_bytes(3)
    assert torch.equal(chunk_tokens(chunk, sender), tokens)


def test_one_shard_is_the_plain_layer_major_layout() -> None:
    """Per layer: the keys of every block, then the values, [blocks, block_size, heads, dim]."""
    tokens = kv(8)
    payload = tokens_chunk(tokens, layout(4), 0).payload.view(torch.float32)
    plain = tokens.reshape(LAYERS, 2, 2, 4, HEADS, DIM)
    assert torch.equal(payload, plain.reshape(-1))


def test_block_size_dtype_and_shards_convert_and_the_last_block_is_padded() -> None:
    tokens = kv()
    sender, receiver = layout(4, "float32", shards=2), layout(8, "bfloat16")
    out = convert_chunks(sent(tokens, sender, 2), sender, receiver, TOKENS)
    assert [(c.first_block, c.num_blocks) for c in out] == [(0, 3)]
    got = chunk_tokens(out[0], receiver)
    assert got.dtype == torch.bfloat16 and got.shape[2] == 24
    assert torch.equal(got[:, :, :TOKENS], tokens.to(torch.bfloat16))


def test_conversion_starts_past_the_receivers_cache_hits_and_drops_a_partial_block() -> None:
    """The decode side holds 16 tokens (blocks of 8); the sender (blocks of 4) sends from its
    block 2 on. Cut at token 20, no whole receiver block past the hits arrived; cut at 24, its
    block 2 (tokens 16-23) did."""
    tokens = kv(40)
    sender, receiver = layout(4), layout(8)
    chunks = [c for c in sent(tokens, sender, 1) if 2 <= c.first_block < 5]  # tokens 8-19
    assert convert_chunks(chunks, sender, receiver, 40, from_token=16) == []
    chunks = [c for c in sent(tokens, sender, 1) if 2 <= c.first_block < 6]  # tokens 8-23
    (out,) = convert_chunks(chunks, sender, receiver, 40, from_token=16)
    assert (out.first_block, out.num_blocks) == (2, 1)
    assert torch.equal(chunk_tokens(out, receiver), tokens[:, :, 16:24])


def test_another_model_shape_is_refused() -> None:
    sender = KVLayout(LAYERS, HEADS // 2, DIM, 4, "float32")
    assert layout(4).unconvertible(sender) == "num_kv_heads differs (here 4, sender 2)"
    with pytest.raises(ValueError, match="num_kv_heads differs"):
        convert_chunks([], sender, layout(4), TOKENS)
