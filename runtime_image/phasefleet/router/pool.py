"""A pool of workers (`worker`, `prefill` or `decode`): who is there, who is ready, how loaded.

`refresh()` asks discovery for the endpoints, then polls every worker's /health and /metrics at
once (its load, and the LoRA adapters it has loaded). Between refreshes the router adds what it
sees itself: requests it has open on a worker, a 429 (busy for a while), a refused connection or
a 503 (out until a poll says healthy again).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from dataclasses import dataclass

from phasefleet.router.discovery import Discovery
from phasefleet.router.policy import Candidate, WorkerLoad
from phasefleet.router.upstream import Upstream

logger = logging.getLogger(__name__)

RATE_MIN_BUSY_S = 0.05  # busy seconds between two polls for a throughput sample
RATE_WEIGHT = 0.3  # a new sample's weight in the moving average of the throughput


@dataclass
class WorkerState:
    url: str
    ready: bool = True  # discovery: False while terminating (finishes, takes nothing new)
    healthy: bool = False  # last /health poll was 200 and no failure seen since
    load: WorkerLoad | None = None  # last /metrics poll
    inflight: int = 0  # requests this router has open on it
    busy_until: float = 0.0  # monotonic seconds; answered 429 until then
    prefill_rate: float | None = None  # prompt tokens per busy second, a moving average
    adapters: frozenset[str] = frozenset()  # LoRA adapters loaded, as of the last poll

    def observe(self, load: WorkerLoad) -> None:
        """Takes a new poll's load; updates the throughput from its counters' growth since
        the last (a counter that went back, a restarted worker, gives no sample)."""
        old, self.load = self.load, load
        if old is None or old.prompt_tokens_total is None or old.busy_seconds_total is None:
            return
        if load.prompt_tokens_total is None or load.busy_seconds_total is None:
            return
        tokens = load.prompt_tokens_total - old.prompt_tokens_total
        busy = load.busy_seconds_total - old.busy_seconds_total
        if busy < RATE_MIN_BUSY_S or tokens <= 0:
            return
        sample = tokens / busy
        rate = self.prefill_rate
        self.prefill_rate = sample if rate is None else rate + RATE_WEIGHT * (sample - rate)


class WorkerPool:
    def __init__(self, name: str, discovery: Discovery, upstream: Upstream) -> None:
        self.name = name  # the pool: worker, prefill or decode
        self.discovery = discovery
        self.upstream = upstream
        self.workers: dict[str, WorkerState] = {}
        self.discovery_error: str | None = None  # why the last endpoints() call failed

    def describe(self) -> str:
        return f"pool '{self.name}' ({self.discovery.describe()})"

    async def refresh(self) -> list[str]:
        """One discovery + poll round; returns the URLs that left the pool."""
        try:
            endpoints = await self.discovery.endpoints()
            self.discovery_error = None
        except Exception as exc:  # keep the last known workers; say why in the next 503
            self.discovery_error = f"{type(exc).__name__}: {exc}"
            logger.warning("discovery of %s failed: %s", self.describe(), self.discovery_error)
            endpoints = None
        gone: list[str] = []
        if endpoints is not None:
            seen = {e.url: e for e in endpoints}
            for url, endpoint in seen.items():
                state = self.workers.setdefault(url, WorkerState(url))
                state.ready = endpoint.ready
            for url in [u for u in self.workers if u not in seen]:
                if self.workers[url].inflight == 0:
                    del self.workers[url]
                    gone.append(url)
                else:  # finishing its requests: keep it, send nothing new
                    self.workers[url].ready = False
        states = list(self.workers.values())
        polls = await asyncio.gather(*(self.upstream.poll(s.url) for s in states))
        for state, poll in zip(states, polls, strict=True):
            if poll.healthy != state.healthy:
                logger.info("worker %s in %s: %s", state.url, self.name, _word(poll.healthy))
            state.healthy = poll.healthy
            state.adapters = poll.adapters
            if poll.load is not None:
                state.observe(poll.load)
            else:
                state.load = None
        return gone

    def candidates(
        self, now: float, exclude: Collection[str] = (), adapter: str | None = None
    ) -> list[Candidate]:
        """The ready workers not in `exclude`; with `adapter`, only those that have it."""
        return [
            Candidate(s.url, s.load, s.inflight, s.busy_until > now, s.prefill_rate)
            for s in self.ready()
            if s.url not in exclude and (adapter is None or adapter in s.adapters)
        ]

    def ready(self) -> list[WorkerState]:
        return [s for s in self.workers.values() if s.ready and s.healthy]

    def ready_count(self) -> int:
        return len(self.ready())

    def has_adapter(self, name: str) -> bool:
        """Whether a ready worker of this pool has the LoRA adapter `name` loaded."""
        return any(name in s.adapters for s in self.ready())

    def loaded_adapters(self) -> frozenset[str]:
        """The LoRA adapters some ready worker of this pool has loaded."""
        return frozenset[str]().union(*(s.adapters for s in self.ready()))

    def acquire(self, url: str) -> None:
        if url in self.workers:
            self.workers[url].inflight += 1

    def release(self, url: str) -> None:
        if url in self.workers:
            self.workers[url].inflight = max(0, self.workers[url].inflight - 1)

    def mark_down(self, url: str) -> None:
        """Refused a connection or answered 503: no new requests until a poll says healthy."""
        state = self.workers.get(url)
        if state is not None and state.healthy:
            state.healthy = False
            logger.info("worker %s in %s: down until its next good poll", url, self.name)

    def mark_busy(self, url: str, until: float) -> None:
        state = self.workers.get(url)
        if state is not None:
            state.busy_until = max(state.busy_until, until)


def _word(healthy: bool) -> str:
    return "healthy" if healthy else "unhealthy"
