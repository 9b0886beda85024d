"""Requests held while their pool has no ready worker (a pool scaled to zero, waking).

A request that finds no ready worker waits here, up to `hold_seconds`, instead of failing at
once; at most `max_held` wait per pool. When a refresh finds a ready worker the pool's held
requests are released by their `priority` (the request body's, vLLM's: lower first; 0 when
absent), in arrival order within one (their futures are resolved in that order, so their tasks
resume in it). A request past the wait bound is not held any more, and one that finds the queue
full is not held either, unless it ranks before the last held one: that one leaves the queue in
its place. Either way the router answers the one left out 503 with Retry-After. A request whose
client leaves is cancelled, which frees its place. `hold_seconds` 0 turns holding off (503 at
once, the router's default).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_HOLD_SECONDS = 0.0  # the router alone: no holding; the operator passes the spec's
DEFAULT_MAX_HELD = 256  # requests per pool


class Held(enum.Enum):
    """How a hold ended."""

    RELEASED = "released"  # the pool has a ready worker: try it
    FULL = "full"  # max_held requests that rank before it were waiting: not held (any more)
    TIMED_OUT = "timed_out"  # waited hold_seconds, no worker came
    OFF = "off"  # holding is off (hold_seconds 0)


@dataclass(order=True)
class _Waiter:
    priority: int
    arrival: int  # a counter: the order requests came in
    future: asyncio.Future[Held] = field(compare=False)


@dataclass
class HeldRequests:
    hold_seconds: float = DEFAULT_HOLD_SECONDS  # longest wait for a ready worker; 0: off
    max_held: int = DEFAULT_MAX_HELD  # requests held per pool at once
    on_change: Callable[[str, int], None] = lambda pool, held: None  # e.g. a gauge's set
    waiting: dict[str, list[_Waiter]] = field(default_factory=dict)
    _arrivals: itertools.count[int] = field(default_factory=itertools.count)

    def count(self, pool: str) -> int:
        return len(self.waiting.get(pool, ()))

    async def wait(self, pool: str, priority: int = 0) -> Held:
        """Waits for `release(pool)`, at most `hold_seconds`."""
        if self.hold_seconds <= 0:
            return Held.OFF
        queue = self.waiting.setdefault(pool, [])
        me = _Waiter(priority, next(self._arrivals), asyncio.get_running_loop().create_future())
        if len(queue) >= self.max_held:
            last = max(queue)
            if not me < last:
                return Held.FULL
            queue.remove(last)  # it ranks after this one: out of the queue, answered FULL
            last.future.set_result(Held.FULL)
        queue.append(me)
        self.on_change(pool, len(queue))
        try:
            return await asyncio.wait_for(asyncio.shield(me.future), self.hold_seconds)
        except TimeoutError:
            return Held.TIMED_OUT
        finally:
            if me in queue:  # timed out or cancelled (the client left): free the place
                queue.remove(me)
                self.on_change(pool, len(queue))

    def release(self, pool: str) -> int:
        """Wakes every request held for `pool`, by priority, then arrival; returns how many."""
        queue = self.waiting.get(pool)
        if not queue:
            return 0
        released = 0
        for waiter in sorted(queue):
            if not waiter.future.done():
                waiter.future.set_result(Held.RELEASED)
                released += 1
        queue.clear()
        self.on_change(pool, 0)
        return released
