"""Rotary position embedding tables, using transformers' RoPE init functions."""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Types whose frequencies do not depend on the sequence length at run time.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_type(config: Any) -> str:
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        return str(scaling.get("rope_type", scaling.get("type", "default")))
    return "default"


def rope_tables(config: Any, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_positions, head_dim] float32 on CPU, scaled like transformers does."""
    kind = rope_type(config)
    if kind not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported; "
            f"supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [P, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, head_dim] (rows already picked by position)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
