"""The shape of a mixture-of-experts model, read from its config (any object with the config's
fields as attributes; no torch, so that `phasefleet plan` reads it too): how many experts, how
wide, which layers have them. The layers themselves are in moe.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoeShape:
    experts: int
    top_k: int
    width: int  # each expert's MLP width
    renormalize: bool  # the k chosen weights scaled to sum to 1
    shared_width: int  # Qwen2-MoE's shared expert, run on every token (0: none)


def moe_shape(config: Any) -> MoeShape | None:
    """The experts of a mixture-of-experts model; None for a dense one."""
    kind = getattr(config, "model_type", None)
    if kind == "mixtral":
        return MoeShape(
            int(config.num_local_experts),
            int(config.num_experts_per_tok),
            int(config.intermediate_size),
            renormalize=True,
            shared_width=0,
        )
    if kind in ("qwen2_moe", "qwen3_moe"):
        return MoeShape(
            int(config.num_experts),
            int(config.num_experts_per_tok),
            int(config.moe_intermediate_size),
            renormalize=bool(config.norm_topk_prob),
            shared_width=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
        )
    return None


def is_moe_layer(config: Any, index: int) -> bool:
    """Whether decoder layer `index` has experts (Qwen's MoE models may keep some dense)."""
    shape = moe_shape(config)
    if shape is None or shape.experts == 0:
        return False
    if config.model_type == "mixtral":
        return True
    sparse_step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = getattr(config, "mlp_only_layers", None) or []
    return index not in dense and (index + 1) % sparse_step == 0


def has_dense_layers(config: Any) -> bool:
    if moe_shape(config) is None:
        return True
    return not all(is_moe_layer(config, i) for i in range(int(config.num_hidden_layers)))


def mlp_widths(config: Any) -> dict[str, int]:
    """Each MLP width the model has, by its config field (tensor parallelism splits each)."""
    shape = moe_shape(config)
    widths: dict[str, int] = {}
    if has_dense_layers(config):
        widths["intermediate_size"] = int(config.intermediate_size)
    if shape is not None:
        mixtral = config.model_type == "mixtral"
        widths["intermediate_size" if mixtral else "moe_intermediate_size"] = shape.width
        if shape.shared_width:
            widths["shared_expert_intermediate_size"] = shape.shared_width
    return widths


def activation_width(config: Any, every_expert: bool = False) -> int:
    """Elements per token the widest MLP layer holds at once (gate, up and their product);
    `every_expert`: on the "every" path, which runs each token through every expert."""
    dense = 3 * int(config.intermediate_size) if has_dense_layers(config) else 0
    shape = moe_shape(config)
    if shape is None:
        return dense
    experts = shape.experts if every_expert else shape.top_k
    return max(dense, 3 * (experts * shape.width + shape.shared_width))
