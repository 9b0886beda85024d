"""KVCacheManager: each request's block table, on top of the BlockPool (and, with host
slots, the prefix cache's second tier in host memory: engine/host_prefix_cache.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from phasefleet.engine.block_pool import BlockPool, hash_block
from phasefleet.engine.host_prefix_cache import HostPrefixCache, KVMove
from phasefleet.engine.request import Request


@dataclass
class PrefixHit:
    block_ids: list[int]
    """Cached device blocks that hold the request's leading full blocks."""
    num_tokens: int
    """Tokens whose KV the hit provides (the last token is always recomputed)."""
    host_hashes: list[int] = field(default_factory=list)
    """The full blocks after those, found in host memory: loaded into fresh device blocks."""

    @property
    def num_blocks(self) -> int:
        """Leading blocks whose KV is cached, on the device or in host memory."""
        return len(self.block_ids) + len(self.host_hashes)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, host_slots: int = 0
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        # the second tier: evicted cached blocks saved to host slots (none: off)
        self.host = HostPrefixCache(host_slots) if host_slots and enable_caching else None
        if self.host is not None:
            self.pool.on_evict = self.host.save
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[int]] = {}  # request_id -> hashes of its full blocks
        self._num_registered: dict[str, int] = {}  # request_id -> leading blocks already cached
        self.held: dict[str, list[int]] = {}  # request_id -> blocks kept after a hand-off

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else request.prefix_salt
            hashes.append(hash_block(parent, request.token_ids(i * bs, (i + 1) * bs)))
        return hashes

    def find_prefix(self, request: Request) -> PrefixHit:
        """The longest run of cached leading full blocks: on the device, then in host memory;
        pure, takes no references. None for a request that wants prompt logprobs: they need
        every prompt position's logits."""
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return PrefixHit([], 0)
        bs = self.block_size
        num_tokens = request.num_tokens
        hashes = self._block_hashes(request, num_tokens // bs)
        hit = self._lookup(
            hashes, request.prefix_salt, lambda i: request.token_ids(i * bs, (i + 1) * bs)
        )
        # A full hit still computes the last token: its logits give the next token.
        hit.num_tokens = min(hit.num_blocks * bs, num_tokens - 1)
        return hit

    def cached_tokens(self, token_ids: list[int], salt: int | None) -> int:
        """Leading tokens of `token_ids` whose KV is cached (device or host), for a prompt
        whose first block's parent hash is `salt`; pure."""
        if not self.enable_caching:
            return 0
        bs, hashes, parent = self.block_size, [], salt
        for i in range(len(token_ids) // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return (
            self._lookup(hashes, salt, lambda i: token_ids[i * bs : (i + 1) * bs]).num_blocks * bs
        )

    def _lookup(
        self, hashes: list[int], salt: int | None, tokens_of: Callable[[int], list[int]]
    ) -> PrefixHit:
        """Device hits from the first block on, then host hits from the first device miss on
        (a device block after that is recomputed, not looked for)."""
        hit = PrefixHit([], 0)
        for i, block_hash in enumerate(hashes):
            parent = hashes[i - 1] if i else salt
            tokens = tokens_of(i)
            if not hit.host_hashes:
                block_id = self.pool.lookup(block_hash, parent, tokens)
                if block_id is not None:
                    hit.block_ids.append(block_id)
                    continue
            if self.host is None or self.host.lookup(block_hash, parent, tokens) is None:
                break
            hit.host_hashes.append(block_hash)
        return hit

    def can_admit(self, request: Request, hit: PrefixHit) -> bool:
        """Whether the blocks for the request's whole current token sequence are available."""
        needed = self.blocks_needed(request.num_tokens) - len(hit.block_ids)
        # Hit blocks sitting in the free queue stop being free once touched.
        reclaimed = sum(1 for b in hit.block_ids if self.pool.is_free(b))
        return needed <= self.pool.num_free_blocks - reclaimed

    def admit(self, request: Request, hit: PrefixHit) -> None:
        """Take the hit blocks and allocate the rest of the request's current tokens, the first
        of them loaded from the host hits' slots (queued moves)."""
        self.pool.touch(hit.block_ids)
        needed = self.blocks_needed(request.num_tokens) - len(hit.block_ids)
        if self.host is not None:
            self.host.pin(hit.host_hashes)  # this allocation's saves must not overwrite them
        fresh = self.pool.allocate(needed)
        if self.host is not None:
            for block_hash, block_id in zip(hit.host_hashes, fresh, strict=False):
                self.host.load(block_hash, block_id)
            self.host.unpin()
        self.block_tables[request.request_id] = hit.block_ids + fresh

    def take_moves(self) -> list[KVMove]:
        """The host tier's copies queued since the last call, in the order they must run."""
        return self.host.take_moves() if self.host is not None else []

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Make room for KV of `num_tokens` tokens in total; False if the pool is out of blocks."""
        table = self.block_tables[request.request_id]
        needed = self.blocks_needed(num_tokens) - len(table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            return False
        table.extend(self.pool.allocate(needed))
        return True

    def cache_computed(self, request: Request) -> None:
        """Register the request's computed full blocks in the prefix cache."""
        if not self.enable_caching:
            return
        bs = self.block_size
        num_full = min(request.num_computed_tokens, request.num_tokens) // bs
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:  # most decode steps: no block filled since the last
            return
        hashes = self._block_hashes(request, num_full)
        table = self.block_tables[request.request_id]
        self._num_registered[request.request_id] = num_full
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else request.prefix_salt
            self.pool.cache(table[i], hashes[i], parent, request.token_ids(i * bs, (i + 1) * bs))

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so its tail is evicted before its prefix)."""
        table = self.block_tables.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        if table is not None:
            self.pool.free(list(reversed(table)))

    def hold(self, request: Request) -> list[int]:
        """Keep a finished request's blocks (referenced, cached blocks still shared) until
        `release`; the prefill side of a hand-off."""
        table = self.block_tables.pop(request.request_id)
        self._num_registered.pop(request.request_id, None)
        self.held[request.request_id] = table
        return table

    def release(self, request_id: str) -> bool:
        """Free blocks kept by `hold`; False when none are held for the id."""
        table = self.held.pop(request_id, None)
        if table is None:
            return False
        self.pool.free(list(reversed(table)))
        return True

    def forget(self, request: Request) -> None:
        """Drop the request's cached hashes once it is finished for good."""
        self._hashes.pop(request.request_id, None)
