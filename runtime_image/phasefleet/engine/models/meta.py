"""Modules built on the meta device (shapes only) without the work their initialisers do there.

An initialiser or a cat on the meta device runs through torch's Python decompositions, and the
first one imports torch._dynamo or sympy: 0.4-0.7 s of a worker's start-up on this CPU
(bench/RESULTS.md, "Worker start-up"), for weights the checkpoint replaces anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

_LOCK = threading.RLock()  # reentrant: meta_linear inside a no_init block


@contextmanager
def no_init() -> Iterator[None]:
    """torch.nn.init's initialisers as no-ops inside. One thread at a time (tensor-parallel
    ranks load in threads), so each restores what it saved; a nested block restores the no-ops
    and the outer one the initialisers."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    with _LOCK:
        saved = {n: getattr(nn.init, n) for n in names}
        for n in names:
            setattr(nn.init, n, _keep)
        try:
            yield
        finally:
            for n, fn in saved.items():
                setattr(nn.init, n, fn)


def _keep(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def meta_linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """An uninitialised nn.Linear on the meta device, for its weights to be assigned."""
    with no_init():
        return nn.Linear(in_features, out_features, bias=bias, device="meta")


def cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along dim 0; of meta tensors, only the shape."""
    first = tensors[0]
    if first.is_meta:
        rows = sum(t.shape[0] for t in tensors)
        return torch.empty((rows, *first.shape[1:]), dtype=first.dtype, device="meta")
    return torch.cat(tensors, dim=0)
