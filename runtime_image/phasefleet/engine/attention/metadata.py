"""AttentionMetadata: where each step's tokens sit in the batch and in the KV pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSeq:
    start: int  # index of its first query token in the flat batch
    q_len: int  # query tokens this step
    ctx_len: int  # tokens it attends to, cached prefix plus this chunk
    block_table: torch.Tensor  # [ceil(ctx_len / block_size)] long, its blocks in order
    mask: torch.Tensor | None  # [q_len, ctx_len] bool (True = attend); None: plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long, flat KV slot (block_id * block_size + offset) per token
    num_decode_tokens: int  # the first this-many tokens are one-token queries, one per request
    decode_block_tables: torch.Tensor  # [B_dec, max_blocks] long, padded with the null block
    decode_mask: torch.Tensor  # [B_dec, 1, 1, max_blocks * block_size] bool, True = attend
    prefills: list[PrefillSeq]  # the multi-token queries, in batch order after the decodes
