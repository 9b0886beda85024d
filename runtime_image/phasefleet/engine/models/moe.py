"""Mixture-of-experts MLPs: Mixtral, Qwen2-MoE (with its shared expert) and Qwen3-MoE.

A router (`gate`) scores every expert for each token; the top k run, their outputs weighted by
the routing softmax (renormalized over the k chosen where the model says so). While loading,
the experts are the checkpoint's gated MLPs (`experts.<e>.gate_proj` ...; checkpoint.py reads
Mixtral's names as these); `fuse()` replaces them by two stacked weights, gate/up
[E, 2w, hidden] and down [E, hidden, w], which the loader fills expert by expert. Under tensor
parallelism every rank holds every expert's slice of the width w (as the dense MLP's split)
and the router whole; one all-reduce follows the sum.

Three ways to run the chosen experts (`choose_path`); the first two have no host sync, so CUDA
graphs capture them:
- "gathered": on CUDA, few tokens (tokens x k <= E, a small decode batch): the chosen experts'
  weights are gathered per token (a copy) and run as one batched matmul; only the chosen
  experts are read.
- "every": on CUDA, up to MAX_GRAPH_BATCH tokens: every expert runs on every token, the
  unchosen ones weighted 0 (a decode batch reads nearly every expert anyway once tokens x k
  passes E).
- "sorted": prefill on CUDA, and every step on the CPU: token slots sorted by expert and each
  expert run on its own rows; one host sync for the rows per expert, no copies, no wasted FLOPs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from phasefleet.engine.config import MAX_GRAPH_BATCH
from phasefleet.engine.models.fused import MLP, local_width
from phasefleet.engine.models.moe_shape import MoeShape, moe_shape

if TYPE_CHECKING:
    from phasefleet.engine.parallel.group import TPGroup

PATHS = ("gathered", "every", "sorted")


def choose_path(tokens: int, shape: MoeShape, on_cuda: bool) -> str:
    """How a step of `tokens` tokens runs its experts (see the module's docstring)."""
    if not on_cuda:  # a host sync is free and there are no graphs: no copies, no waste
        return "sorted"
    if tokens * shape.top_k <= shape.experts:
        return "gathered"
    if tokens <= MAX_GRAPH_BATCH:
        return "every"
    return "sorted"


class SparseMoeBlock(nn.Module):
    def __init__(self, config: Any, tp: TPGroup | None) -> None:
        super().__init__()
        shape = moe_shape(config)
        if shape is None:
            raise ValueError(f"{config.model_type} has no experts")
        if bool(getattr(config, "mlp_bias", False)):
            raise ValueError(f"{config.model_type} with mlp_bias=true is not supported")
        self.shape = shape
        self.tp = tp
        hidden = int(config.hidden_size)
        width = local_width(shape.width, tp)  # this rank's slice of each expert
        self.gate = nn.Linear(hidden, shape.experts, bias=False)  # the router, whole everywhere
        # The checkpoint's layout until fuse() stacks them; no all-reduce inside (done once).
        self.experts: nn.ModuleList | None = nn.ModuleList(
            MLP(hidden, width, bias=False, tp=None) for _ in range(shape.experts)
        )
        self.experts_gate_up: nn.Parameter | None = None  # [E, 2w, hidden], set by fuse()
        self.experts_down: nn.Parameter | None = None  # [E, hidden, w]
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shape.shared_width:
            self.shared_expert = MLP(
                hidden, local_width(shape.shared_width, tp), bias=False, tp=None
            )
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def fuse(self) -> None:
        """The experts' weights stacked, gate and up concatenated (the loader fills them)."""
        if self.experts is None:
            return
        first = cast(MLP, self.experts[0])
        gate_up = torch.empty(
            len(self.experts),
            2 * first.gate_proj.weight.shape[0],
            first.gate_proj.weight.shape[1],
            dtype=first.gate_proj.weight.dtype,
            device=first.gate_proj.weight.device,
        )
        down = torch.empty(
            len(self.experts),
            *first.down_proj.weight.shape,
            dtype=gate_up.dtype,
            device=gate_up.device,
        )
        self.experts_gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.experts_down = nn.Parameter(down, requires_grad=False)
        self.experts = None
        if self.shared_expert is not None:
            self.shared_expert.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        if self.experts_gate_up is None or self.experts_down is None:
            raise RuntimeError("SparseMoeBlock runs fused: call fuse() once the weights are loaded")
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.shape.top_k, dim=-1)  # [T, k]
        if self.shape.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        path = choose_path(x.shape[0], self.shape, x.is_cuda)
        out = self.run_experts(x, weights, chosen, path)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def run_experts(
        self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, path: str
    ) -> torch.Tensor:
        """The weighted sum of the chosen experts' outputs (this rank's part), one of PATHS."""
        if path == "gathered":
            return self._gathered(x, weights, chosen)
        if path == "every":
            return self._every(x, weights, chosen)
        if path == "sorted":
            return self._sorted(x, weights, chosen)
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.experts_gate_up is not None and self.experts_down is not None
        return self.experts_gate_up, self.experts_down

    def _gathered(
        self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor:
        gate_up, down = self._stacked()
        t, k = chosen.shape
        slots = x.repeat_interleave(k, dim=0).unsqueeze(1)  # [T*k, 1, hidden]
        flat = chosen.reshape(-1)
        h = torch.bmm(slots, gate_up[flat].transpose(1, 2))  # [T*k, 1, 2w]
        g, u = h.chunk(2, dim=-1)
        y = torch.bmm(F.silu(g) * u, down[flat].transpose(1, 2))  # [T*k, 1, hidden]
        return (y.view(t, k, -1) * weights.unsqueeze(-1)).sum(dim=1)

    def _every(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        gate_up, down = self._stacked()
        per_expert = torch.zeros(
            x.shape[0], gate_up.shape[0], dtype=weights.dtype, device=x.device
        ).scatter_(1, chosen, weights)  # [T, E]: 0 where not chosen
        h = torch.matmul(x.unsqueeze(0), gate_up.transpose(1, 2))  # [E, T, 2w]
        g, u = h.chunk(2, dim=-1)
        y = torch.matmul(F.silu(g) * u, down.transpose(1, 2))  # [E, T, hidden]
        return (y * per_expert.t().unsqueeze(-1)).sum(dim=0)

    def _sorted(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        gate_up, down = self._stacked()
        k = chosen.shape[1]
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()  # the host sync
        tokens = order // k
        slots = x[tokens]  # token slots grouped by expert
        ys = torch.empty_like(slots)
        start = 0
        for expert, n in enumerate(rows):
            if n == 0:
                continue
            part = slice(start, start + n)
            g, u = F.linear(slots[part], gate_up[expert]).chunk(2, dim=-1)
            ys[part] = F.linear(F.silu(g) * u, down[expert])
            start += n
        ys = ys * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, tokens, ys)
