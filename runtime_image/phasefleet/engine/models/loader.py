"""Builds a CausalLM from a Hugging Face folder: config.json plus *.safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from phasefleet.engine.models.cpu_linear import choose_cpu_linear
from phasefleet.engine.models.llama import CausalLM
from phasefleet.engine.models.rope import rope_tables


def load_model(
    folder: str | Path, config: Any, dtype: torch.dtype, device: torch.device, max_positions: int
) -> CausalLM:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {folder} has no *.safetensors files")
    with torch.device("meta"):
        model = CausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    state = {k: v for k, v in state.items() if "rotary_emb.inv_freq" not in k}
    if model.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"weights in {folder} do not match {config.model_type}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model = model.to(device=device, dtype=dtype).eval()
    model.fuse()
    if choose_cpu_linear(device, dtype) == "onednn":
        model.pack_for_cpu()
    cos, sin = rope_tables(config, max_positions)
    model.rope_cos = cos.to(device=device, dtype=dtype)
    model.rope_sin = sin.to(device=device, dtype=dtype)
    return model
