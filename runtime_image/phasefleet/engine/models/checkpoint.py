"""A checkpoint's tensors as our model names them: Mixtral's experts renamed, Phi-3's fused
projections split into the separate ones the loader places (and tensor parallelism slices), an
image-text checkpoint's decoder under our names and its vision tower left out."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from phasefleet.engine.models.rope import head_dim

_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJECTION = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}
# An image-text checkpoint's decoder, as transformers saves it and as its newer layout does
_DECODER_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
}
# ... and the parts a text-only server leaves out: the vision tower and its projection
_VISION_PREFIXES = (
    "vision_tower.", "multi_modal_projector.", "model.vision_tower.",
    "model.multi_modal_projector.",
)  # fmt: skip


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's name as our model calls it (Mixtral's experts are renamed, an
    image-text checkpoint's decoder loses its prefix)."""
    for prefix, ours in _DECODER_PREFIXES.items():
        if name.startswith(prefix):
            name = ours + name.removeprefix(prefix)
            break
    if ".block_sparse_moe." not in name:
        return name
    name = _MIXTRAL_EXPERT.sub(lambda m: f".mlp.experts.{m[1]}.{_MIXTRAL_PROJECTION[m[2]]}.", name)
    return name.replace(".block_sparse_moe.", ".mlp.")


def our_tensors(name: str, tensor: torch.Tensor, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs one checkpoint tensor holds, in our model's names. Phi-3 stores
    q/k/v as one qkv_proj and gate/up as one gate_up_proj: they come out as their parts (views,
    no copy), in the order the config's head counts and MLP width give. An image-text
    checkpoint's vision tower holds none."""
    if name.startswith(_VISION_PREFIXES):
        return
    module, _, param = name.rpartition(".")
    parent, _, kind = module.rpartition(".")
    if config.model_type == "phi3" and kind in ("qkv_proj", "gate_up_proj"):
        if kind == "qkv_proj":
            dim = head_dim(config)
            kv = int(config.num_key_value_heads or config.num_attention_heads) * dim
            sizes = {"q_proj": config.num_attention_heads * dim, "k_proj": kv, "v_proj": kv}
        else:
            width = int(config.intermediate_size)
            sizes = {"gate_proj": width, "up_proj": width}
        start = 0
        for part, rows in sizes.items():
            yield f"{parent}.{part}.{param}", tensor[start : start + rows]
            start += rows
        if start != tensor.shape[0]:
            raise ValueError(
                f"{name} has {tensor.shape[0]} rows, the config makes {start} ({', '.join(sizes)})"
            )
        return
    yield checkpoint_name(name), tensor
