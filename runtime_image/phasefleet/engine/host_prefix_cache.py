"""HostPrefixCache: the prefix cache's second tier, KV blocks kept in host memory (the
scheduler's side; the runner's is engine/host_kv_store.py).

A cached full block that the device pool evicts (BlockPool reuses it for other tokens) is saved
to a host slot first. A prompt whose leading blocks miss on the device but are found here gets
fresh device blocks, loaded from their slots before the step's forward pass, and computes only
what follows. This side is plain Python: it indexes the slots (block hash -> slot, least
recently used first) and queues the copies as `KVMove`s; the runner applies them, in queue
order, after the scheduler's step and before anything writes to the pool. Queue order makes a
slot that is loaded from and later saved to in one step read before it is overwritten; the
slots an admission loads from are pinned while its blocks are allocated, so that allocation's
own saves never take them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class KVMove:
    block_id: int  # device block
    slot: int  # host slot
    to_host: bool  # True: save the block into the slot; False: load the slot into the block


@dataclass(frozen=True)
class HostEntry:
    slot: int
    parent_hash: int | None
    token_ids: tuple[int, ...]  # checked on every lookup, as on the device


class HostPrefixCache:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()  # hash -> entry, LRU first
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        self._pinned: set[int] = set()  # hashes of the blocks an admission is loading
        self.moves: list[KVMove] = []  # queued for the runner, in the order they must run
        self.drops_total = 0  # evicted blocks not saved: every slot pinned

    def usage(self) -> float:
        return len(self._entries) / self.num_slots

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: list[int]) -> int | None:
        """The slot holding exactly these tokens after this parent, or None; pure."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.parent_hash != parent_hash or entry.token_ids != tuple(token_ids):
            return None
        return entry.slot

    def save(
        self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]
    ) -> None:
        """Queues a copy of an evicted device block into a slot: a free one, else the least
        recently used one not pinned (none: the block is dropped). A block already here is
        only marked used."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h in self._entries if h not in self._pinned), None)
            if victim is None:
                self.drops_total += 1
                return
            slot = self._entries.pop(victim).slot
        self._entries[block_hash] = HostEntry(slot, parent_hash, token_ids)
        self.moves.append(KVMove(block_id, slot, to_host=True))

    def pin(self, block_hashes: list[int]) -> None:
        """Keeps these blocks' slots from being overwritten until `unpin` (an admission's
        loads)."""
        self._pinned.update(block_hashes)

    def unpin(self) -> None:
        self._pinned.clear()

    def load(self, block_hash: int, block_id: int) -> None:
        """Queues a copy of a slot into a device block, marking it used."""
        self._entries.move_to_end(block_hash)
        self.moves.append(KVMove(block_id, self._entries[block_hash].slot, to_host=False))

    def take_moves(self) -> list[KVMove]:
        moves, self.moves = self.moves, []
        return moves
