"""oneDNN linears for the CPU: each weight is reordered once, at load, into oneDNN's blocked
layout, so a matmul does not re-pack it on every call.

On a 2-core AVX-512 machine this halves the time of a decode step's matmuls at batch 1-64
against `F.linear` (MKL) in float32, and is ~1.3x for bfloat16; see docs/engine.md. The ops are
torch's own (`torch.ops.mkldnn`, what inductor's CPU freezing uses); they are private, so a
self-check at load falls back to `F.linear` if they are missing or disagree.
PHASEFLEET_CPU_LINEAR=onednn|torch forces one path.

oneDNN builds (and caches, 1024 entries by default) one primitive per input shape, ~1 ms each.
A server sees every row count from 1 to the token budget, so rows are padded up to a bucket
(exact to 16, then 8 buckets per doubling, at most 12.5% padding): about 70 shapes per weight
up to 2048 rows, all of which stay cached.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 64  # oneDNN picks its blocking for this many rows; any row count still works
EXACT_ROWS = 16  # row counts up to this are not padded
BUCKETS_PER_DOUBLING = 8


def padded_rows(rows: int) -> int:
    """The bucket a row count is padded to: itself up to EXACT_ROWS, then the next multiple of
    1/BUCKETS_PER_DOUBLING of its power of two."""
    if rows <= EXACT_ROWS:
        return rows
    step = (1 << ((rows - 1).bit_length() - 1)) // BUCKETS_PER_DOUBLING
    return -(-rows // step) * step


class PackedLinear(nn.Module):
    """y = x @ W.T + b for 2-D x, with W held in oneDNN's layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padded = padded_rows(rows)
        x = F.pad(x, (0, 0, 0, padded - rows)) if padded != rows else x.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y[:rows] if padded != rows else y


def choose_cpu_linear(device: torch.device, dtype: torch.dtype) -> str:
    """'onednn' on a CPU with a working oneDNN for this dtype, else 'torch'."""
    forced = os.environ.get("PHASEFLEET_CPU_LINEAR", "auto")
    if forced not in ("auto", "onednn", "torch"):
        raise ValueError(f"PHASEFLEET_CPU_LINEAR must be auto, onednn or torch, got {forced!r}")
    if forced == "torch" or device.type != "cpu":
        return "torch"
    problem = _onednn_problem(dtype)
    if problem is None:
        return "onednn"
    if forced == "onednn":
        raise ValueError(f"PHASEFLEET_CPU_LINEAR=onednn is not usable here: {problem}")
    log.info("oneDNN linears are off (%s); using F.linear", problem)
    return "torch"


def _onednn_problem(dtype: torch.dtype) -> str | None:
    """Why packed linears cannot be used for dtype, or None when a small self-check passes."""
    if dtype not in PACKABLE_DTYPES:
        return f"dtype {dtype} is not one of {PACKABLE_DTYPES}"
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(5, 32, generator=gen).to(dtype)
    try:
        got = PackedLinear(weight, bias)(x).float()
    except (RuntimeError, AttributeError) as err:
        return f"oneDNN linear failed: {err}"
    want = F.linear(x.float(), weight.float(), bias.float())
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
        return "oneDNN linear disagrees with F.linear"
    return None


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under module by a PackedLinear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            count += 1
        else:
            count += pack_linears(child)
    return count
