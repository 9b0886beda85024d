"""BlockPool: the fixed set of KV blocks, their ref counts and the prefix-cache index.

Block 0 is the null block: never handed out, used to pad block tables. A block whose ref count
drops to zero goes to the back of the free queue but keeps its hash, so a later prompt with the
same prefix can take it back; it loses the hash only when it is reused (least recently freed
first). With a host tier (engine/host_prefix_cache.py) `on_evict` is told of each cached block
it is about to lose, while the block still holds its KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

NULL_BLOCK_ID = 0


def hash_block(parent_hash: int | None, token_ids: list[int]) -> int:
    """128-bit hash of one full block, chained through the hash of the block before it."""
    h = hashlib.blake2b(digest_size=16)
    h.update((parent_hash or 0).to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    """Tokens of a cached full block, checked on every prefix lookup."""


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_count = 1  # pinned forever
        # block_id -> None, oldest-freed first
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block_id
        # (block_id, hash, parent hash, tokens) of a cached block being reused
        self.on_evict: Callable[[int, int, int | None, tuple[int, ...]], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: list[int]) -> int | None:
        """A cached block holding exactly these tokens after this parent, or None."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block_id

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (pulling them out of the free queue)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with ref count 1; evicts the least recently freed cached blocks."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            block_hash = block.block_hash
            if block_hash is not None:
                if self._cached.get(block_hash) == block_id:
                    del self._cached[block_hash]
                    if self.on_evict is not None:
                        self.on_evict(block_id, block_hash, block.parent_hash, block.token_ids)
                block.block_hash, block.parent_hash, block.token_ids = None, None, ()
            block.ref_count = 1
            out.append(block_id)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; pass tail blocks first so they are evicted first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block_id == NULL_BLOCK_ID or block.ref_count <= 0:
                raise ValueError(f"block {block_id} is not allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def cache(
        self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: list[int]
    ) -> None:
        """Record a full, computed block under its hash (first writer wins)."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.parent_hash, block.token_ids = (
            block_hash,
            parent_hash,
            tuple(token_ids),
        )
        self._cached[block_hash] = block_id
