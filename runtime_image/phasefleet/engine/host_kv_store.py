"""HostKVStore: the host memory behind the prefix cache's second tier (the runner's side of
engine/host_prefix_cache.py), and the copies between it and the KV pool.

One tensor per group of KV heads (a tensor-parallel worker's ranks that hold the same heads
share it): [slots, layers, 2 (keys, values), block_size, kv_heads, head_dim] in the pool's
dtype, pinned on CUDA so the copies run on the stream without a wait. A save reads the first
rank holding each group; a load writes every rank. The moves run in their queue order on the
current stream (a slot loaded from and then saved to is read first); rank 0 waits for the
copies it made into other ranks' devices, which their own processes read next.

A run of moves one way goes through a staging tensor on the pool's device, [blocks, layers, 2,
block_size, kv_heads, head_dim], so that each block crosses between device and host as one
contiguous copy (an 8B model's block: 2 MiB, not 64 copies of 32 KiB): a save gathers the
run's blocks from every layer into it (one gather a layer and kind) and copies each block out
to its slot; a load copies each slot in and scatters them into every layer. The staging is
made once per device, at most STAGING_BYTES (a run longer than that goes in pieces); on CUDA
the copies are asynchronous, ordered on the stream with the kernels that gather and scatter
(the next piece's gather waits for this one's copies).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

import torch

from phasefleet.engine.host_prefix_cache import KVMove
from phasefleet.engine.kv_dtype import as_rows
from phasefleet.engine.models.llama import KVCache

STAGING_BYTES = 64 << 20  # a run's staging on the device, at most (one block if larger)


class HostKVStore:
    def __init__(
        self,
        shards: list[KVCache],
        rank_shards: list[tuple[KVCache, int]],
        num_slots: int,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        """`shards`: one pool per group of KV heads (the rank that saves it); `rank_shards`:
        every rank's pool with the group it holds."""
        keys = shards[0][0][0]
        shape = (num_slots, len(shards[0]), 2, *keys.shape[1:])  # [slots, L, 2, bs, H, D]
        pin = keys.device.type == "cuda"
        self.shards = shards
        self.rank_shards = rank_shards
        # empty, not zeros: a slot is read only after a save has written it
        self.slots = [torch.empty(shape, dtype=keys.dtype, pin_memory=pin) for _ in shards]
        self.devices = list(dict.fromkeys(c[0][0].device for c, _ in rank_shards))  # rank 0's first
        slot_bytes = self.slots[0][0].numel() * self.slots[0].element_size()
        self.staging_blocks = max(1, min(num_slots, staging_bytes // slot_bytes))
        self._staging: dict[torch.device, torch.Tensor] = {}  # made at first use

    @torch.inference_mode()
    def apply(self, moves: list[KVMove]) -> None:
        # With several devices each copies on its own stream: a run waits for the runs before it
        # that touched the same host memory the other way.
        pending = False
        for run in _runs(moves):
            if pending:
                _synchronize(self.devices)
            for start in range(0, len(run), self.staging_blocks):
                piece = run[start : start + self.staging_blocks]
                (self._save if run[0].to_host else self._load)(piece)
            pending = len(self.devices) > 1
        if moves:  # the other ranks' processes read their pools next
            _synchronize(self.devices[1:])

    def _staged(self, device: torch.device, blocks: int) -> torch.Tensor:
        """The first `blocks` of the device's staging, [blocks, L, 2, bs, H, D]."""
        staging = self._staging.get(device)
        if staging is None:
            shape = (self.staging_blocks, *self.slots[0].shape[1:])
            staging = torch.empty(shape, dtype=self.slots[0].dtype, device=device)
            self._staging[device] = staging
        return staging[:blocks]

    def _save(self, run: list[KVMove]) -> None:
        for store, caches in zip(self.slots, self.shards, strict=True):
            device = caches[0][0].device
            blocks = _index((m.block_id for m in run), device)
            staged = self._staged(device, len(run))
            for layer, pair in enumerate(caches):
                for which, cache in enumerate(pair):
                    rows = as_rows(staged[:, layer, which])
                    torch.index_select(as_rows(cache), 0, blocks, out=rows)
            for k, move in enumerate(run):  # into pinned memory: asynchronous on CUDA
                store[move.slot].copy_(staged[k], non_blocking=True)

    def _load(self, run: list[KVMove]) -> None:
        for caches, shard in self.rank_shards:
            store, device = self.slots[shard], caches[0][0].device
            staged = self._staged(device, len(run))
            for k, move in enumerate(run):
                staged[k].copy_(store[move.slot], non_blocking=True)
            blocks = _index((m.block_id for m in run), device)
            for layer, pair in enumerate(caches):
                for which, cache in enumerate(pair):
                    as_rows(cache).index_copy_(0, blocks, as_rows(staged[:, layer, which]))


def memory_left(root: Path = Path("/")) -> int | None:
    """Bytes of memory this process may still take: the kernel's MemAvailable, bounded by its
    cgroup's limit less its working set (cgroup v2, a container's: usage less the inactive
    page cache, as the kubelet counts it); None where neither is readable."""
    bounds = []
    with contextlib.suppress(OSError, ValueError):
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                bounds.append(int(line.split()[1]) * 1024)
    with contextlib.suppress(OSError, ValueError):
        cgroup = root / "sys/fs/cgroup"
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
            used = int((cgroup / "memory.current").read_text()) - int(stat.get("inactive_file", 0))
            bounds.append(int(limit) - used)
    return min(bounds) if bounds else None


def _runs(moves: list[KVMove]) -> list[list[KVMove]]:
    """The moves cut into runs of one direction, in order, none writing one slot (a save) or
    one block (a load) twice, so that each run's copies may go at once."""
    runs: list[list[KVMove]] = []
    written: set[int] = set()
    for move in moves:
        target = move.slot if move.to_host else move.block_id
        if not runs or runs[-1][0].to_host != move.to_host or target in written:
            runs.append([])
            written = set()
        runs[-1].append(move)
        written.add(target)
    return runs


def _index(values: Iterable[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long).to(device)


def _synchronize(devices: list[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
