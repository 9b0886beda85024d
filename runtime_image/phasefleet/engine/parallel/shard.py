"""Shard: which slice of each weight, head and vocabulary row one tensor-parallel rank holds.

Megatron's split of a Llama-family decoder over `size` ranks:
- column-parallel (output rows split): q/k/v by heads, gate/up by the MLP's width (each
  expert's of a mixture-of-experts model, whose router every rank holds whole); each rank
  computes its heads and its part of the MLP with no communication;
- row-parallel (input columns split): o_proj and down_proj; each rank's partial sums are added
  by one all-reduce, after which every rank holds the whole residual stream;
- vocabulary-parallel: the embedding's and the output projection's rows, padded to a multiple of
  `size`; the embedding is all-reduced (each token's row lives on one rank), the logits gathered.
KV heads are split like the query heads when `size` divides them; when there are fewer KV heads
than ranks, each KV head is replicated on `size / kv_heads` ranks (the ones whose query heads
read it). Plain arithmetic: no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from phasefleet.engine.models.moe_shape import mlp_widths

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _kv_heads(config: Any) -> int:
    return int(config.num_key_value_heads or config.num_attention_heads)


def unsupported(config: Any, size: int) -> str | None:
    """Why `size` ranks cannot split this model's shape; None when they can."""
    heads, kv = int(config.num_attention_heads), _kv_heads(config)
    if size < 1:
        return f"tensor_parallel_size must be >= 1, got {size}"
    if heads % size:
        return f"tensor_parallel_size {size} must divide the model's {heads} attention heads"
    if kv % size and size % kv:
        return (
            f"tensor_parallel_size {size} must divide the model's {kv} KV heads or be a "
            f"multiple of them"
        )
    for field, width in mlp_widths(config).items():
        if width % size:
            return f"tensor_parallel_size {size} must divide the model's {field} {width}"
    return None


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int

    def heads(self, config: Any) -> range:
        """The query heads this rank computes."""
        per = int(config.num_attention_heads) // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_shards(self, config: Any) -> int:
        """Distinct groups the KV heads fall into across the ranks (the KV layout's
        head_shards): `size`, or the KV heads themselves when they are fewer."""
        return min(self.size, _kv_heads(config))

    def kv_shard(self, config: Any) -> int:
        """Which of the kv_shards this rank holds (ranks holding a replica share one)."""
        return self.rank * self.kv_shards(config) // self.size

    def kv_heads(self, config: Any) -> range:
        """The KV heads this rank holds (its query heads read only these)."""
        per = _kv_heads(config) // self.kv_shards(config)
        first = self.kv_shard(config) * per
        return range(first, first + per)

    def split(self, width: int) -> range:
        """This rank's part of an MLP `width` wide (a dense MLP, an expert, a shared expert)."""
        per = width // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def mlp(self, config: Any) -> range:
        return self.split(int(config.intermediate_size))

    def vocab_rows(self, config: Any) -> int:
        """Rows of the embedding (and the output projection) on each rank, padding included."""
        return -(-int(config.vocab_size) // self.size)

    def vocab_start(self, config: Any) -> int:
        return self.rank * self.vocab_rows(config)

    def take(self, name: str, tensor: torch.Tensor, config: Any, head_dim: int) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (whole, as the checkpoint stores it)."""
        if self.size == 1:
            return tensor
        module, _, param = name.rpartition(".")
        kind = module.rpartition(".")[2]
        if name in VOCAB:
            rows, start = self.vocab_rows(config), self.vocab_start(config)
            part = tensor[start : start + rows]
            if part.shape[0] < rows:  # the last rank's padding: zero rows, never chosen
                pad = part.new_zeros(rows - part.shape[0], *part.shape[1:])
                part = torch.cat([part, pad])
            return part
        if kind in COLUMN:
            if kind == "q_proj":
                units, width = self.heads(config), head_dim
            elif kind in ("k_proj", "v_proj"):
                units, width = self.kv_heads(config), head_dim
            else:  # a dense MLP's or an expert's gate/up: their own rows say how wide
                units, width = self.split(int(tensor.shape[0])), 1
            return tensor[units.start * width : units.stop * width]
        if kind in ROW:
            if param == "bias":  # added once, after the all-reduce: rank 0 carries it
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            cols = int(tensor.shape[1]) // self.size
            return tensor[:, self.rank * cols : (self.rank + 1) * cols]
        return tensor
