"""Rotary position embedding tables, using transformers' RoPE init functions."""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Types whose frequencies do not depend on the sequence length at run time.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def head_dim(config: Any) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def rotary_dim(config: Any) -> int:
    """The leading part of each head RoPE turns (all of it unless partial_rotary_factor says)."""
    return int(head_dim(config) * float(getattr(config, "partial_rotary_factor", 1.0) or 1.0))


def rope_type(config: Any) -> str:
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        return str(scaling.get("rope_type", scaling.get("type", "default")))
    return "default"


def long_factors_from(config: Any) -> int | None:
    """LongRoPE (Phi-3's and Phi-4-mini's 128k models): the longest max_model_len served with
    its short factors (original_max_position_embeddings); a longer one turns every position to
    the long factors. None: not LongRoPE."""
    if rope_type(config) != "longrope":
        return None
    original = getattr(config, "original_max_position_embeddings", None)  # as transformers reads
    return int(original or config.max_position_embeddings)


def rope_variant(config: Any, max_positions: int) -> str:
    """The rotation a KV cache was written with, as the hand-off compares it: the RoPE type, and
    for LongRoPE which factors max_positions chose ("longrope-long" / "longrope-short"). Two
    workers of one model whose variants differ hold KV rotated differently."""
    short_up_to = long_factors_from(config)
    if short_up_to is None:
        return rope_type(config)
    return "longrope-long" if max_positions > short_up_to else "longrope-short"


def rope_tables(config: Any, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin_rot: [max_positions, rotary dim] float32 on CPU (the head, or the part of it
    partial_rotary_factor gives), scaled like transformers does; sin_rot is sin with its first
    half negated, as apply_rope() takes it. LongRoPE's factors are chosen once, for every
    position, by max_positions (the engine's max_model_len), as vLLM does: transformers turns
    to the long ones when the sequence, not the limit, passes the original length.
    """
    kind = rope_type(config)
    if kind not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported; "
            f"supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    if kind == "default":  # plain RoPE; transformers 5 dropped it from ROPE_INIT_FUNCTIONS
        dim = rotary_dim(config)
        base = config.rope_theta
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        attention_scaling = 1.0
    elif kind == "longrope":  # the long factors when max_positions passes the original length
        init = ROPE_INIT_FUNCTIONS[kind]
        inv_freq, attention_scaling = init(config, torch.device("cpu"), max_positions)
    else:
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [P, rotary dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin() * attention_scaling
    half = sin.shape[-1] // 2
    return emb.cos() * attention_scaling, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin_rot: [T, 1, head_dim], rows picked by position from the
    tables of rope_tables(). transformers' `x * cos + rotate_half(x) * sin` in four ops: with
    x = (x1, x2), rotate_half(x) * sin = (-x2 * s1, x1 * s2) = roll(x) * (-s1, s2), bit for
    bit (negation is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_rot
