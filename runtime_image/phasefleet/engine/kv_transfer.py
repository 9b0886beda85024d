"""KV hand-off between a prefill and a decode worker: the wire layout and the prefill side's leases.

The payload of one request is its KV blocks, layer-major: for each layer, the keys of every
block, then the values of every block; each tensor [num_blocks, block_size, num_kv_heads,
head_dim] in the layout's dtype (per head shard, when the heads are split), raw bytes, no
framing. Pure Python: the runner does the copies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class KVLayout:
    """The shape of one worker's KV blocks on the wire. KV converts between two layouts of the
    same model shape (layers, KV heads, head dim) and rotation: block size, dtype and head shards
    may differ (engine/kv_convert.py)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block
    dtype: str  # float32 | bfloat16 | float16 | float8_e4m3fn (kv_cache_dtype fp8)
    # the KV heads in this many equal groups, one per tensor-parallel rank of the worker: each
    # layer's keys (then values) are sent group after group, [blocks, block_size, kv_heads /
    # head_shards, head_dim] each; 1 is one group, the plain layout
    head_shards: int = 1
    # the rotation the keys were written with (models.rope.rope_variant): LongRoPE's short and
    # long factors give two variants of one model, whose KV cannot be shared
    rope: str = "default"

    def block_bytes(self) -> int:
        """Bytes of one block over all layers, keys and values."""
        per_tensor = self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]
        return 2 * self.num_layers * per_tensor

    def payload_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.block_bytes()

    def unconvertible(self, other: KVLayout) -> str | None:
        """Why KV in `other`'s layout cannot be converted to this one; None when it can."""
        for name in ("num_layers", "num_kv_heads", "head_dim", "rope"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs (here {mine}, sender {theirs})"
        return None


@dataclass
class KVChunk:
    """Consecutive blocks of a prompt's KV as they arrived: blocks first_block ..
    first_block + num_blocks - 1, payload layer-major within the chunk (for each layer the keys
    of its blocks, then their values; uint8, in the receiving engine's layout)."""

    first_block: int
    num_blocks: int
    payload: torch.Tensor  # uint8, num_blocks x KVLayout.block_bytes()

    @property
    def end_block(self) -> int:
        return self.first_block + self.num_blocks


@dataclass
class Lease:
    """Blocks a prefill worker keeps for one request until the decode worker has pulled them."""

    request_id: str
    block_ids: list[int]
    num_tokens: int  # prompt tokens whose KV the blocks hold
    expires_at: float  # clock() time
    readers: int = 0  # pulls in progress: an expired lease is not freed under a reader


@dataclass
class LeaseTable:
    """The prefill side's leases. Thread-safe: the engine thread adds and expires, HTTP
    handlers pin them while a pull reads the blocks."""

    duration: float  # seconds a lease lasts
    clock: Callable[[], float] = time.monotonic
    _leases: dict[str, Lease] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request_id: str, block_ids: list[int], num_tokens: int) -> Lease:
        lease = Lease(request_id, block_ids, num_tokens, self.clock() + self.duration)
        with self._lock:
            self._leases[request_id] = lease
        return lease

    def pin(self, request_id: str) -> Lease | None:
        """The live lease for a pull to read, protected from expiry until `unpin`; None when
        unknown or expired."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or (lease.readers == 0 and lease.expires_at <= self.clock()):
                return None
            lease.readers += 1
            return lease

    def unpin(self, lease: Lease) -> None:
        with self._lock:
            lease.readers -= 1

    def pop(self, request_id: str) -> Lease | None:
        """Ends a lease (the decode side is done with it); None when unknown, expired or pinned
        by a pull still reading."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.readers > 0:
                return None
            return self._leases.pop(request_id)

    def pop_expired(self) -> list[Lease]:
        """Removes and returns every expired lease no pull is reading."""
        now = self.clock()
        with self._lock:
            gone = [
                lease
                for lease in self._leases.values()
                if lease.expires_at <= now and lease.readers == 0
            ]
            for lease in gone:
                del self._leases[lease.request_id]
        return gone

    def __len__(self) -> int:
        return len(self._leases)
