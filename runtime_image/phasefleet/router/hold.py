"""Requests held while their pool has no ready worker (a pool scaled to zero, waking).

A request that finds no ready worker waits here, up to `hold_seconds`, instead of failing at
once; at most `max_held` wait per pool. When a refresh finds a ready worker the pool's held
requests are released in arrival order (their futures are resolved in that order, so their
tasks resume in it). A request past the wait bound, or one that finds the queue full, is not
held: the router answers it 503 with Retry-After. A request whose client leaves is cancelled,
which frees its place. `hold_seconds` 0 turns holding off (503 at once, the router's default).
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_HOLD_SECONDS = 0.0  # the router alone: no holding; the operator passes the spec's
DEFAULT_MAX_HELD = 256  # requests per pool


class Held(enum.Enum):
    """How a hold ended."""

    RELEASED = "released"  # the pool has a ready worker: try it
    FULL = "full"  # max_held requests were already waiting: not held
    TIMED_OUT = "timed_out"  # waited hold_seconds, no worker came
    OFF = "off"  # holding is off (hold_seconds 0)


@dataclass
class HeldRequests:
    hold_seconds: float = DEFAULT_HOLD_SECONDS  # longest wait for a ready worker; 0: off
    max_held: int = DEFAULT_MAX_HELD  # requests held per pool at once
    on_change: Callable[[str, int], None] = lambda pool, held: None  # e.g. a gauge's set
    waiting: dict[str, deque[asyncio.Future[None]]] = field(default_factory=dict)

    def count(self, pool: str) -> int:
        return len(self.waiting.get(pool, ()))

    async def wait(self, pool: str) -> Held:
        """Waits for `release(pool)`, at most `hold_seconds`."""
        if self.hold_seconds <= 0:
            return Held.OFF
        queue = self.waiting.setdefault(pool, deque())
        if len(queue) >= self.max_held:
            return Held.FULL
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(future)
        self.on_change(pool, len(queue))
        try:
            await asyncio.wait_for(future, self.hold_seconds)
        except TimeoutError:
            return Held.TIMED_OUT
        finally:
            if future in queue:  # timed out or cancelled (the client left): free the place
                queue.remove(future)
                self.on_change(pool, len(queue))
        return Held.RELEASED

    def release(self, pool: str) -> int:
        """Wakes every request held for `pool`, oldest first; returns how many."""
        queue = self.waiting.get(pool)
        if not queue:
            return 0
        released = 0
        while queue:
            future = queue.popleft()
            if not future.done():
                future.set_result(None)
                released += 1
        self.on_change(pool, 0)
        return released
