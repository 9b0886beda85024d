"""The workers' prefix cache, as the simulators model it from a trace's block ids.

A trace with `hash_ids` (Mooncake's: one id per 512 prompt tokens, equal ids for equal
prefixes) says which prompts share a prefix. Each simulated replica keeps:
- a device cache of `kv_capacity_tokens / block_tokens` blocks, least recently used out (a
  prompt's tail before its head), as the engine's pool keeps the blocks of finished prompts
  until it needs them (the blocks in use by running requests are among the most recently
  used, so a full-size LRU stands for both);
- optionally a host tier of `host_tokens / block_tokens` blocks, which receives every block the
  device cache drops (docs/engine.md, "The host tier").

A prompt finds the blocks of its prefix on the device, then, from the first device miss, in
host memory, as the engine looks them up, in whole KV blocks of the engine's (16 tokens); at
least its last token is computed. Host hits are copied to the device first, at
`host_bytes_per_s`. Found tokens are not computed: the prefill costs `Curves.prefill_s(n,
cached)`.

Routing is the router's own code (`phasefleet.router.policy`) under either policy: with
`prefix_aware`, its PrefixIndex remembers which replica last served each block id and the rank
functions weigh that against load; without, they rank by load alone. The router hashes the
first 16 Ki characters of a prompt in 64-character chunks; at `CHARS_PER_TOKEN`, that is the
first 4,096 tokens, so only the block ids within them route.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from phasefleet.plan.trace import Trace
from phasefleet.router.policy import (
    MAX_PREFIX_CHUNKS,
    PREFIX_CHUNK_CHARS,
    PREFIX_INDEX_CAPACITY,
    PrefixIndex,
)

CHARS_PER_TOKEN = 4  # English text in a Llama 3 tokenizer, roughly


@dataclass(frozen=True)
class PrefixCaching:
    """What the simulators model of the workers' prefix cache."""

    host_tokens: int = 0  # each replica's host tier, in KV tokens (0: none)
    host_bytes_per_s: float = 25e9  # host-to-device copy rate of that tier's blocks
    prefix_aware: bool = True  # the router's policy: prefix-aware, or least-loaded (False)
    kv_block_tokens: int = 16  # the engine's KV block: only whole blocks are cached


@dataclass
class PrefixStats:
    prompt_tokens: int = 0  # of the prompts looked up (each request once, preemptions aside)
    device_tokens: int = 0  # found in a device cache
    host_tokens: int = 0  # found in a host tier

    @property
    def found_share(self) -> float:
        found = self.device_tokens + self.host_tokens
        return found / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_share(self) -> float:
        return self.host_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class ReplicaCache:
    """One replica's cached blocks by id: the device's and its host tier's, LRU each."""

    def __init__(self, device_blocks: int, host_blocks: int) -> None:
        self.device: OrderedDict[int, None] = OrderedDict()
        self.host: OrderedDict[int, None] = OrderedDict()
        self.device_blocks, self.host_blocks = device_blocks, host_blocks

    def lookup(self, ids: Sequence[int]) -> tuple[int, int]:
        """(blocks found on the device, then in host memory) at the start of `ids`."""
        on_device = 0
        while on_device < len(ids) and ids[on_device] in self.device:
            on_device += 1
        in_host = 0
        while on_device + in_host < len(ids) and ids[on_device + in_host] in self.host:
            in_host += 1
        return on_device, in_host

    def store(self, ids: Sequence[int]) -> None:
        """A prompt's blocks are on the device now, the most recently used, its head last (the
        engine frees a request's blocks tail first, so a prefix's head outlives its tail);
        those the device cache drops go to the host tier, whose oldest are dropped."""
        for block in reversed(ids):
            self.device[block] = None
            self.device.move_to_end(block)
            if block in self.host:
                self.host.move_to_end(block)
        while len(self.device) > self.device_blocks:
            dropped, _ = self.device.popitem(last=False)
            if self.host_blocks:
                self.host[dropped] = None
                self.host.move_to_end(dropped)
        while len(self.host) > self.host_blocks:
            self.host.popitem(last=False)


class PrefixModel:
    """The prefix cache of one simulated fleet: the replicas' caches, the router's index of
    who served which prefix, and what was found."""

    def __init__(
        self, trace: Trace, caching: PrefixCaching, kv_capacity_tokens: int, kv_bytes: int
    ) -> None:
        if trace.blocks is None:
            raise ValueError(f"{trace.name}: modelling the prefix cache needs the trace's hash_ids")
        self.trace, self.caching, self.kv_bytes = trace, caching, kv_bytes
        self.blocks = trace.blocks
        bt = trace.block_tokens
        self.device_blocks = max(1, kv_capacity_tokens // bt)
        self.host_blocks = caching.host_tokens // bt
        router_tokens = MAX_PREFIX_CHUNKS * PREFIX_CHUNK_CHARS // CHARS_PER_TOKEN
        self.routed = max(1, router_tokens // bt)  # the leading block ids the router sees
        capacity = PREFIX_INDEX_CAPACITY * PREFIX_CHUNK_CHARS // CHARS_PER_TOKEN // bt
        self.index = PrefixIndex(max(1, capacity))
        self.looked_up = np.zeros(len(trace.arrival), bool)
        self.stats = PrefixStats()

    def new_cache(self) -> ReplicaCache:
        return ReplicaCache(self.device_blocks, self.host_blocks)

    def matched(self, i: int) -> dict[str, int]:
        """Replica name -> leading routed blocks of request i's prompt it served last."""
        return self.index.match(self.blocks[i][: self.routed])

    def routed_to(self, i: int, name: str) -> None:
        self.index.record(self.blocks[i][: self.routed], name)

    def admit(self, cache: ReplicaCache, i: int, tokens: float) -> tuple[float, float]:
        """Request i's prompt (of `tokens`, its answer so far included after a preemption)
        starts on the replica of `cache`: (tokens found, seconds to load the host part)."""
        ids = self.blocks[i]
        bt = self.trace.block_tokens
        prompt = int(self.trace.prompt[i])
        on_device, in_host = cache.lookup(ids)
        cache.store(ids)
        found = min((on_device + in_host) * bt, prompt, int(tokens) - 1)
        found -= found % self.caching.kv_block_tokens
        from_host = max(0, found - on_device * bt)
        if not self.looked_up[i]:
            self.looked_up[i] = True
            self.stats.prompt_tokens += prompt
            self.stats.device_tokens += found - from_host
            self.stats.host_tokens += from_host
        return float(found), from_host * self.kv_bytes / self.caching.host_bytes_per_s

    def forget(self, name: str) -> None:
        """A replica left: the router forgets what it served."""
        self.index.forget(name)
