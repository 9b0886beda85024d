"""AttentionMetadata: where each step's tokens sit in the batch and in the KV pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from phasefleet.engine.attention.triton_decode import DecodeWorkspace


@dataclass
class PrefillSeq:
    start: int  # index of its first query token in the flat batch
    q_len: int  # query tokens this step
    ctx_len: int  # tokens it attends to, cached prefix plus this chunk
    block_table: torch.Tensor  # [ceil(ctx_len / block_size)] long, its blocks in order


@dataclass
class DecodeGroup:
    start: int  # index of its first request among the decodes (= in the flat batch)
    size: int  # requests in the group
    block_tables: torch.Tensor  # [size, max_blocks] long, padded with the null block
    # sliding window (None: no window) -> [size, 1, 1, max_blocks * block_size] bool,
    # True = attend; one per window the model's layers use
    masks: dict[int | None, torch.Tensor]
    first_block: int | None = None  # size 1 with consecutive block ids: read a view, no gather
    # the masks as float32, 0 = attend, -inf = not: set when the group runs as two matmuls
    # instead of SDPA (CPU, 16-bit dtypes; see torch_paged.py); empty otherwise
    biases: dict[int | None, torch.Tensor] = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long, flat KV slot (block_id * block_size + offset) per token
    num_decode_tokens: int  # the first this-many tokens are one-token queries, one per request
    decode_block_tables: torch.Tensor  # [B_dec, max_blocks] long, padded with the null block
    decode_context_lens: torch.Tensor  # [B_dec] long, tokens each decode attends to
    decode_groups: list[DecodeGroup]  # torch path: decodes of similar length, one SDPA call each
    prefills: list[PrefillSeq]  # the multi-token queries, in batch order after the decodes
    decode_backend: str = "torch"  # "torch" (gather + SDPA) or "triton" (paged kernel)
    # triton: the split kernel's scratch, preallocated (a captured graph); None: per call
    decode_workspace: DecodeWorkspace | None = None


def mask_to_bias(mask: torch.Tensor) -> torch.Tensor:
    """bool mask (True = attend) -> float32 additive mask, 0 where True and -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


def decode_masks(
    context_lens: torch.Tensor, num_keys: int, windows: set[int | None], as_bias: bool
) -> tuple[dict[int | None, torch.Tensor], dict[int | None, torch.Tensor]]:
    """A group's masks for each of the windows, and their biases when `as_bias` (else {})."""
    masks = {w: decode_mask(context_lens, num_keys, w) for w in windows}
    return masks, {w: mask_to_bias(m) for w, m in masks.items()} if as_bias else {}


def decode_mask(context_lens: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """context_lens: [B] long -> [B, 1, 1, num_keys] bool: key j is visible to the query at
    position ctx - 1 when j < ctx (and j > ctx - 1 - window with a sliding window)."""
    ctx = context_lens.unsqueeze(1)  # [B, 1]
    key_pos = torch.arange(num_keys, device=context_lens.device).unsqueeze(0)  # [1, S]
    mask = key_pos < ctx
    if window is not None:
        mask &= key_pos > ctx - 1 - window
    return mask[:, None, None, :]
