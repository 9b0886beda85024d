"""make_tiny_lora: a random LoRA adapter for a model folder, in PEFT's format (what
`PeftModel.save_pretrained` writes), for tests and local demos of several adapters at once."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from phasefleet.engine.lora import ADAPTER_FILE, CONFIG_FILE, PART_OF


def make_tiny_lora(
    out: str | Path,
    base: str | Path,
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 0,
    targets: tuple[str, ...] = tuple(PART_OF),
    std: float = 0.3,
) -> Path:
    """Writes an adapter of `rank` on `targets` of every layer of the model in `base`, with
    both factors random (std `std`), so it changes the model's answers."""
    config = AutoConfig.from_pretrained(base)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {  # projection -> (in, out)
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for part in targets:
            where = "self_attn" if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{where}.{part}"
            n_in, n_out = shapes[part]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * std
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_FILE))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2))
    return out
