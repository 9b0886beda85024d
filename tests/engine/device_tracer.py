"""DeviceTracer: runs code written for a GPU on the CPU and reports what would make the GPU wait.

Tensors whose storage is registered as "device" (model weights, KV caches, the buffers the
runner keeps on its device) stand for GPU memory; every tensor an op computes from one of them,
or makes with an explicit `device=`, is device memory too, and everything else is host memory.
Under the tracer:

- an op that takes device and host tensors together is a **mix** (on a GPU: an error, or a
  hidden blocking copy), except the explicit host-to-device copy `device.copy_(host)`, which
  is an **upload** unless the host tensor is registered as pinned (a non-blocking copy);
- reading a device tensor on the host (`tolist`, `item`, `cpu`, `numpy`, `bool`, `int`,
  `float`, a host `copy_` from it) is a **sync**: the host waits for the GPU;
- moving a host tensor with `.to(device)` or `.cuda()` is an **upload**: on a GPU a blocking
  copy from pageable memory (the runner sends its inputs through one pinned staging copy);
- while `capturing`, any sync and any new host tensor is recorded too (a CUDA graph capture
  can do neither).

Not a simulator: it sees only what goes through torch's Python API (TorchFunctionMode).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", func))


class DeviceTracer(TorchFunctionMode):
    def __init__(
        self, device_tensors: Iterable[torch.Tensor] = (), pinned: Iterable[torch.Tensor] = ()
    ) -> None:
        super().__init__()
        self._device: set[int] = set()  # data_ptr of device storages
        self._pinned = {t.untyped_storage().data_ptr() for t in pinned}
        self.syncs: list[str] = []
        self.mixes: list[str] = []
        self.uploads: list[str] = []
        self.capture_faults: list[str] = []
        self.capturing = False
        for t in device_tensors:
            self.mark(t)

    def mark(self, tensor: torch.Tensor) -> None:
        """Registers the tensor's storage (and so every view of it) as device memory."""
        self._device.add(tensor.untyped_storage().data_ptr())

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._device

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        device = [t for t in tensors if self.on_device(t)]
        host = [t for t in tensors if not self.on_device(t) and t.dim() > 0]
        if device and name in READS:
            self._sync(name)
        elif host and not device and (name == "cuda" or (name == "to" and _moves(args, kwargs))):
            self.uploads.append(f"{name} of a host tensor {tuple(host[0].shape)}")
        elif name == "copy_" and tensors and not self.on_device(tensors[0]) and device:
            self._sync("copy_ to the host")
        elif name == "copy_" and tensors and self.on_device(tensors[0]) and host:
            if host[0].untyped_storage().data_ptr() not in self._pinned:
                self.uploads.append(f"copy_ from a pageable host tensor {tuple(host[0].shape)}")
        elif device and host:
            self.mixes.append(f"{name}: {len(device)} device and {len(host)} host tensors")
        result = func(*args, **kwargs)
        out, _ = tree_flatten(result)
        made_on_device = kwargs.get("device") is not None
        for r in out:
            if not isinstance(r, torch.Tensor):
                continue
            if device or made_on_device:
                self.mark(r)
            elif self.capturing and r.numel() and not self.on_device(r):
                self.capture_faults.append(f"{name} made a host tensor during capture")
        return result

    def _sync(self, what: str) -> None:
        self.syncs.append(what)
        if self.capturing:
            self.capture_faults.append(f"{what} synced during capture")


def _moves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a `.to(...)` call names a device (not only a dtype)."""
    targets = [*args[1:], kwargs.get("device")]
    return any(isinstance(t, (torch.device, str)) for t in targets)
