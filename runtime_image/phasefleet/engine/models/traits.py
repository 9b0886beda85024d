"""How one supported family's decoder differs from Llama's, read from its config.

Llama is the plain case: RMSNorm scaled by w, SiLU-gated MLP, scores scaled by head_dim^-0.5,
one RoPE table, every layer attending to the whole context. The others change a few of these:
Qwen3 normalizes each query and key head; Mistral and Phi-3 slide a window on every layer, Qwen2
and Qwen3 with `use_sliding_window` on the layers their `layer_types` name; Gemma scales by
(1 + w) in float32, multiplies the embeddings by sqrt(hidden), gates with GELU (tanh); Gemma 2
adds norms after attention and around the MLP, a score scale of its own, every other layer
sliding, and caps scores and logits with tanh (softcapping); Gemma 3 keeps the norms and the
scale, drops the caps, adds query/key norms, and slides 5 layers in 6 with a RoPE base of their
own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phasefleet.engine.models.rope import head_dim

QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")  # a norm over each q and k head
SLIDING_WINDOW_MODEL_TYPES = ("mistral", "mixtral", "phi3")  # sliding_window on every layer
GEMMA_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
SANDWICH_NORM_MODEL_TYPES = ("gemma2", "gemma3_text")
IMAGE_TEXT_MODEL_TYPES = ("gemma3",)  # served as text: the decoder in their text_config
ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


def decoder_config(config: Any) -> Any:
    """The config of the decoder we serve: an image-text Gemma 3 folder's text_config (its
    vision tower is not loaded, and a prompt is text only), else the config itself."""
    if config.model_type in IMAGE_TEXT_MODEL_TYPES:
        return config.text_config
    return config


def load_decoder_config(folder: str | Path) -> Any:
    """decoder_config() of the folder's config.json, through transformers' AutoConfig."""
    from transformers import AutoConfig

    return decoder_config(AutoConfig.from_pretrained(folder))


@dataclass(frozen=True)
class ModelTraits:
    qk_norm: bool  # an RMSNorm over each query and key head before RoPE
    norm_offset: bool  # RMSNorm scales by (1 + w), in float32 (Gemma)
    sandwich_norms: bool  # norms on the attention's and the MLP's outputs, and before the MLP
    embed_scale: bool  # embeddings multiplied by sqrt(hidden_size) (in the model's dtype)
    activation: str  # the MLP's gate: "silu", "gelu" or "gelu_tanh"
    attn_scale: float  # scores are q . k times this
    attn_softcap: float | None  # scores = cap * tanh(scores / cap) (Gemma 2); None: as they are
    final_softcap: float | None  # logits = cap * tanh(logits / cap); None: as they are
    windows: tuple[int | None, ...]  # per layer: tokens a query looks back; None: all of them
    local_rope_theta: float | None  # RoPE base of the windowed layers (Gemma 3); None: shared


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window: every layer's for Mistral-style configs, the layers
    `layer_types` calls sliding for the others (when the config has a window at all)."""
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None) or None
    if window is None:
        return (None,) * layers
    if config.model_type in SLIDING_WINDOW_MODEL_TYPES:
        return (int(window),) * layers
    types = getattr(config, "layer_types", None)
    if not types:
        return (None,) * layers
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def model_traits(config: Any) -> ModelTraits:
    """The config's traits; ValueError for a setting we do not implement, naming it."""
    kind = config.model_type
    gemma = kind in GEMMA_MODEL_TYPES
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if name not in ACTIVATIONS:
        raise ValueError(
            f"{kind} with hidden activation {name!r} is not supported; "
            f"supported: {', '.join(ACTIVATIONS)}"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{kind} with use_bidirectional_attention=true is not supported")
    scaled = kind in SANDWICH_NORM_MODEL_TYPES  # Gemma 2 and 3 scale by query_pre_attn_scalar
    scalar = getattr(config, "query_pre_attn_scalar", None) if scaled else None
    cap = getattr(config, "final_logit_softcapping", None)
    # transformers applies it for Gemma 2 only (Gemma 3's config may name one; it is unused)
    attn_cap = getattr(config, "attn_logit_softcapping", None) if kind == "gemma2" else None
    local = getattr(config, "rope_local_base_freq", None) if kind == "gemma3_text" else None
    return ModelTraits(
        qk_norm=kind in QK_NORM_MODEL_TYPES,
        norm_offset=gemma,
        sandwich_norms=kind in SANDWICH_NORM_MODEL_TYPES,
        embed_scale=gemma,
        activation=ACTIVATIONS[name],
        attn_scale=float(scalar or head_dim(config)) ** -0.5,
        attn_softcap=float(attn_cap) if attn_cap else None,
        final_softcap=float(cap) if cap else None,
        windows=layer_windows(config),
        local_rope_theta=float(local) if local else None,
    )
