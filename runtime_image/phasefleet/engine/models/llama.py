"""The Llama-family decoder in torch: Llama, Qwen2 (qkv bias, tied embeddings), Qwen3 (an
RMSNorm on each query and key head before RoPE, a head size of its own), Mistral, Phi-3 (fused
projections in its checkpoints, RoPE on part of each head for Phi-4-mini), Gemma, Gemma 2 and
Gemma 3 (traits.py lists how each differs from Llama), and the mixture-of-experts Mixtral,
Qwen2-MoE and Qwen3-MoE (their MLPs in moe.py).

Parameter names match the Hugging Face checkpoints, so a safetensors state dict loads as is.
Activations are flat over the batch: [T, hidden] for T tokens of all scheduled requests.
With a TPGroup the model is one rank's part of a tensor-parallel worker (parallel/shard.py): it
holds its heads, its slice of the MLP and of the vocabulary, and all-reduces after o_proj,
down_proj and the embedding.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from phasefleet.engine.attention.metadata import AttentionMetadata
from phasefleet.engine.attention.torch_paged import paged_attention
from phasefleet.engine.models.cpu_linear import pack_linears
from phasefleet.engine.models.fused import FUSED_PARTS, MLP, fuse_linears, local_width
from phasefleet.engine.models.meta import meta_linear
from phasefleet.engine.models.moe import SparseMoeBlock
from phasefleet.engine.models.moe_shape import MOE_MODEL_TYPES, is_moe_layer
from phasefleet.engine.models.rope import apply_rope, head_dim, rotary_dim
from phasefleet.engine.models.traits import GEMMA_MODEL_TYPES, ModelTraits, model_traits
from phasefleet.engine.parallel.group import TPGroup
from phasefleet.engine.parallel.shard import Shard

SUPPORTED_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "mistral", "phi3", *GEMMA_MODEL_TYPES, *MOE_MODEL_TYPES,
)  # fmt: skip

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)


def attention_biases(config: Any) -> tuple[bool, bool]:
    """(q/k/v have biases, o_proj has one): Qwen2's are on q/k/v only (Qwen2-MoE's config says
    so in qkv_bias); Llama-style configs set both at once with attention_bias."""
    both = bool(getattr(config, "attention_bias", False))
    if config.model_type == "qwen2":
        return True, False
    if config.model_type == "qwen2_moe":
        return bool(getattr(config, "qkv_bias", True)), False
    return both, both


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float, in_float32: bool) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32, times `scale` (which broadcasts): in float32
    (Gemma's 1 + w) or in x's dtype after the cast (Llama's w), as transformers orders it."""
    if x.dtype == torch.float32:  # one op for the normalizing, bit for bit the lines below
        return torch.rms_norm(x, (x.shape[-1],), None, eps) * scale
    wide = x.float()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    if in_float32:
        return (normed * scale).to(x.dtype)
    return scale * normed.to(x.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * w; with `offset` (Gemma), * (1 + w) with the product in float32 too: that
    scale is computed once, by `fold_offset` after the weights load, not per call."""

    def __init__(self, size: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset
        self.register_buffer("offset_scale", None, persistent=False)  # float32 1 + w

    def fold_offset(self) -> None:
        if self.offset:
            self.offset_scale = self.weight.detach().float() + 1.0

    def scale(self) -> torch.Tensor:
        """What normalized x is multiplied by: w, or Gemma's 1 + w (float32)."""
        if not self.offset:
            return self.weight
        assert self.offset_scale is not None, "fold_offset() after the weights load"
        return self.offset_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and not self.offset:
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one op
        return rms_norm(x, self.scale(), self.eps, self.offset)


class Attention(nn.Module):
    def __init__(self, config: Any, tp: TPGroup | None, traits: ModelTraits, index: int) -> None:
        super().__init__()
        shard = tp.shard if tp is not None else Shard(0, 1)
        self.tp = tp
        self.num_heads = len(shard.heads(config))  # this rank's
        self.num_kv_heads = len(shard.kv_heads(config))
        self.head_dim = head_dim(config)
        self.rotary_dim = rotary_dim(config)
        self.scale = traits.attn_scale
        self.softcap = traits.attn_softcap
        self.window = traits.windows[index]  # tokens a query looks back; None: all
        self.local_rope = self.window is not None and traits.local_rope_theta is not None
        qkv_bias, o_bias = attention_biases(config)
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)  # row-parallel
        self.qkv_proj: nn.Linear | None = None  # set by fuse(), after loading
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if traits.qk_norm:  # the same weights on every rank
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, traits.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, traits.norm_offset)
        # both norms' scales, one row per q then k head: the heads normalized in one call
        self.register_buffer("qk_scale", None, persistent=False)

    def fold_qk_norm(self) -> None:
        """After the norms' own folding: q_norm's scale for every query head, then k_norm's."""
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.scale(), self.k_norm.scale()
            rows = (q.expand(self.num_heads, -1), k.expand(self.num_kv_heads, -1))
            self.qk_scale = torch.cat(rows).contiguous()

    def fuse(self) -> None:
        """One matmul for q, k and v instead of three (fewer kernel launches per layer)."""
        self.qkv_proj = fuse_linears([getattr(self, p) for p in FUSED_PARTS["qkv_proj"]])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x: [T, hidden]; cos, sin: [T, 1, head_dim] -> [T, hidden]."""
        if self.qkv_proj is None:
            raise RuntimeError("Attention runs fused: call fuse() once the weights are loaded")
        t, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, heads + 2 * kv_heads, self.head_dim)
        qk = qkv[:, : heads + kv_heads]
        if self.q_norm is not None:
            assert self.qk_scale is not None, "fold_norms() after the weights load"
            qk = rms_norm(qk, self.qk_scale, self.q_norm.eps, self.q_norm.offset)
        if self.rotary_dim == self.head_dim:
            qk = apply_rope(qk, cos, sin)  # q and k heads in one pass
        else:  # the tables cover the rotary part only
            rotated = apply_rope(qk[..., : self.rotary_dim], cos, sin)
            qk = torch.cat([rotated, qk[..., self.rotary_dim :]], dim=-1)
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.window, self.softcap)
        out = self.o_proj(o.reshape(t, heads * self.head_dim))
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, tp: TPGroup | None, traits: ModelTraits, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, tp, traits, index)
        self.mlp: MLP | SparseMoeBlock
        if is_moe_layer(config, index):
            self.mlp = SparseMoeBlock(config, tp)
        else:
            width = local_width(int(config.intermediate_size), tp)
            bias = bool(getattr(config, "mlp_bias", False))
            self.mlp = MLP(config.hidden_size, width, bias, tp, traits.activation)
        hidden, eps, offset = config.hidden_size, config.rms_norm_eps, traits.norm_offset
        self.input_layernorm = RMSNorm(hidden, eps, offset)
        # Llama: before the MLP; with sandwich norms, on the attention's output
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if traits.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class DecoderModel(nn.Module):
    def __init__(self, config: Any, tp: TPGroup | None, traits: ModelTraits) -> None:
        super().__init__()
        rows = tp.shard.vocab_rows(config) if tp is not None else config.vocab_size
        self.embed_tokens = nn.Embedding(rows, config.hidden_size)  # vocabulary-parallel
        self.layers = nn.ModuleList(
            DecoderLayer(config, tp, traits, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, traits.norm_offset)


def _rope_rows(
    tables: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [P, rotary] -> the positions' rows, [T, 1, rotary] each."""
    return tables[0][positions].unsqueeze(1), tables[1][positions].unsqueeze(1)


class CausalLM(nn.Module):
    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        """`tp`: this rank's group when the model is split over several ranks (None: whole)."""
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.config = config
        self.traits = model_traits(config)
        self.tp = tp
        shard = tp.shard if tp is not None else Shard(0, 1)
        self.vocab_size = int(config.vocab_size)
        self.vocab_start = shard.vocab_start(config) if tp is not None else 0
        self.num_heads = len(shard.heads(config))  # this rank's query and KV heads
        self.num_kv_heads = len(shard.kv_heads(config))
        self.model = DecoderModel(config, tp, self.traits)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied: None until pack_for_cpu(), and compute_logits reads the embedding.
        self.lm_head: nn.Module | None = None
        if not self.tie_word_embeddings:
            rows = self.model.embed_tokens.weight.shape[0]  # vocabulary-parallel, as the embedding
            self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        self.linear_backend = "torch"  # or pack_for_cpu()'s summary of the paths
        self.rope_cos: torch.Tensor | None = None  # [max_positions, rotary_dim], set by the loader
        self.rope_sin: torch.Tensor | None = None  # sin with its first half negated (rope.py)
        # the windowed layers' own tables when traits.local_rope_theta is set (Gemma 3)
        self.local_rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] long -> final hidden states [T, hidden]."""
        if self.rope_cos is None or self.rope_sin is None:
            raise RuntimeError("rope tables are not set; load the model with load_model()")
        shared = _rope_rows((self.rope_cos, self.rope_sin), positions)
        local = shared if self.local_rope is None else _rope_rows(self.local_rope, positions)
        x = self._embed(input_ids)
        if self.traits.embed_scale:  # sqrt(hidden) rounded to the model's dtype, as trained
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            cos, sin = local if cast(DecoderLayer, layer).self_attn.local_rope else shared
            x = layer(x, cos, sin, kv, meta)
        return self.model.norm(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return cast(torch.Tensor, self.model.embed_tokens(input_ids))
        weight = self.model.embed_tokens.weight
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= weight.shape[0])  # another rank's row
        x = F.embedding(local.masked_fill(outside, 0), weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(1), 0))

    def fuse(self) -> None:
        """Merge q/k/v and gate/up projections (FUSED_PARTS). The loader fuses the model while
        it is still on the meta device and fills the fused weights from the checkpoint."""
        for layer in self.model.layers:
            decoder = cast(DecoderLayer, layer)
            decoder.self_attn.fuse()
            decoder.mlp.fuse()

    def fold_norms(self) -> None:
        """Once the weights load: Gemma's norms' 1 + w, and each layer's q and k norm scales
        as one tensor."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fold_offset()
        for module in self.modules():
            if isinstance(module, Attention):
                module.fold_qk_norm()

    def pack_for_cpu(self) -> None:
        """Every linear, the output projection included, to a CpuLinear: oneDNN's packed layout
        or F.linear per row bucket (CPU only; see cpu_linear.py). A tied output projection that
        uses oneDNN gets its own packed copy of the embedding."""
        if self.lm_head is None:
            embed = self.model.embed_tokens.weight
            head = meta_linear(embed.shape[1], embed.shape[0], bias=False)
            head.weight = embed
            self.lm_head = head
        self.linear_backend = pack_linears(self)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, hidden] -> logits [B, vocab] float32 (every rank runs it: the
        vocabulary-parallel logits are gathered)."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = cast(torch.Tensor, self.lm_head(hidden))
        if self.tp is not None:
            logits = self.tp.gather_last(logits)[:, : self.vocab_size]
        cap = self.traits.final_softcap
        if cap is not None:
            return torch.tanh(logits.float() / cap) * cap
        return logits.float()
