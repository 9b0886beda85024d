"""HostStaging: a step's small inputs (token ids, positions, slots, sampling settings, block
table updates) written on the host into one buffer and sent to the device in one copy.

On CUDA the host buffer is pinned and the copy is non-blocking: the host goes on preparing while
the copy is in flight. Reusing the buffer next step is safe because every step ends with a
device-to-host read of the sampled tokens, which the copy precedes on the stream: one upload
per step. On the CPU there is nothing to copy: the arrays are used where they are.

    staging = HostStaging(device)
    ids = staging.add(np.asarray(tokens, np.int64))   # a handle, not a tensor yet
    ...
    tensors = staging.upload()                         # one copy
    input_ids = tensors[ids]                           # [T] int64 on the device
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 8  # bytes: every array starts at a multiple, so any dtype can be viewed in place
_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
          np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool}  # fmt: skip


class HostStaging:
    def __init__(self, device: torch.device, copy: bool, capacity: int = 1 << 16) -> None:
        """`copy`: send the arrays to device memory of their own (True on a GPU; on the CPU,
        tests set it to run the GPU path's host side), else use them in place."""
        self.device = device
        self.copy = copy
        self.pinned = device.type == "cuda"
        self._host = self._alloc_host(capacity)  # uint8
        self._dev: torch.Tensor | None = None  # uint8 on the device, as large as _host
        self._parts: list[tuple[int, np.ndarray]] = []  # (byte offset, array)
        self._size = 0

    def _alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def add(self, array: np.ndarray) -> int:
        """Queues a 1-D array for this step's upload; returns its handle."""
        if array.dtype not in _TORCH:
            raise ValueError(f"staging takes {sorted(map(str, _TORCH))} arrays, got {array.dtype}")
        offset = -(-self._size // ALIGN) * ALIGN
        self._parts.append((offset, np.ascontiguousarray(array).reshape(-1)))
        self._size = offset + array.nbytes
        return len(self._parts) - 1

    def upload(self) -> list[torch.Tensor]:
        """Every queued array as a tensor on the device, by handle, in one copy; then empties
        the queue for the next step."""
        parts, size = self._parts, self._size
        self._parts, self._size = [], 0
        if not self.copy:  # tensors over the arrays themselves
            return [torch.from_numpy(a) for _, a in parts]
        if size > self._host.numel():
            self._host = self._alloc_host(max(size, 2 * self._host.numel()))
            self._dev = None
        host = self._host.numpy()
        for offset, a in parts:
            host[offset : offset + a.nbytes] = a.view(np.uint8)
        if self._dev is None:
            self._dev = torch.empty(self._host.numel(), dtype=torch.uint8, device=self.device)
        self._dev[:size].copy_(self._host[:size], non_blocking=True)
        return [self._dev[offset : offset + a.nbytes].view(_TORCH[a.dtype]) for offset, a in parts]
