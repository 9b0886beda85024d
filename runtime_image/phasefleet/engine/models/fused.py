"""Fused projections and the gated MLP every supported model uses (dense, or one expert).

The loader fills a fused linear slice by slice from the checkpoint's separate projections
(FUSED_PARTS), so one matmul replaces two or three and nothing is concatenated after loading.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from phasefleet.engine.models.meta import cat_rows, meta_linear

if TYPE_CHECKING:
    from phasefleet.engine.parallel.group import TPGroup

# fused projection -> the checkpoint's projections whose outputs it concatenates, in order
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_linears(parts: list[nn.Linear]) -> nn.Linear:
    """A Linear whose output is the concatenation of the parts' outputs."""
    weight = cat_rows([p.weight for p in parts])
    fused = meta_linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if parts[0].bias is not None:
        fused.bias = nn.Parameter(cat_rows([p.bias for p in parts]), requires_grad=False)
    return fused


def local_width(width: int, tp: TPGroup | None) -> int:
    """This rank's part of an MLP `width` wide (all of it without tensor parallelism)."""
    return width if tp is None else len(tp.shard.split(width))


def _gate(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The gate's activation: "silu", "gelu" (exact) or "gelu_tanh" (tanh approximation)."""
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), `width` wide on this rank, act as `activation` names it
    (_gate); with `tp`, the rank's partial sums are all-reduced (row-parallel down_proj)."""

    def __init__(
        self, hidden: int, width: int, bias: bool, tp: TPGroup | None, activation: str = "silu"
    ) -> None:
        super().__init__()
        self.tp = tp
        self.activation = activation
        self.gate_proj = nn.Linear(hidden, width, bias=bias)
        self.up_proj = nn.Linear(hidden, width, bias=bias)
        self.down_proj = nn.Linear(width, hidden, bias=bias)  # row-parallel
        self.gate_up_proj: nn.Linear | None = None  # set by fuse(), after loading

    def fuse(self) -> None:
        self.gate_up_proj = fuse_linears([getattr(self, p) for p in FUSED_PARTS["gate_up_proj"]])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            raise RuntimeError("MLP runs fused: call fuse() once the weights are loaded")
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.down_proj(_gate(gate, self.activation) * up)
        return out if self.tp is None else self.tp.all_reduce(out)
