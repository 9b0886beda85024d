"""A pool's bookkeeping across refreshes: who takes new work, who only finishes, who is gone.

Discovery is faked here (a list the test edits); the workers' polls go over real HTTP to ports
where nothing listens, so every worker polls unhealthy unless the test says otherwise.
"""

from __future__ import annotations

import asyncio

from phasefleet.router.discovery import Endpoint
from phasefleet.router.pool import WorkerPool
from phasefleet.router.upstream import Upstream
from tests.server.worker_proc import free_port


class ListedEndpoints:
    """Discovery whose answer the test sets (or makes fail)."""

    def __init__(self) -> None:
        self.answer: list[Endpoint] = []
        self.error: Exception | None = None

    def describe(self) -> str:
        return "a test list"

    async def endpoints(self) -> list[Endpoint]:
        if self.error is not None:
            raise self.error
        return list(self.answer)

    async def aclose(self) -> None:
        pass


def test_terminating_workers_finish_and_departed_ones_go_once_idle() -> None:
    a, b = (f"http://127.0.0.1:{free_port()}" for _ in range(2))

    async def scenario() -> None:
        listed = ListedEndpoints()
        upstream = Upstream()
        pool = WorkerPool("worker", listed, upstream)
        listed.answer = [Endpoint(a), Endpoint(b)]
        assert await pool.refresh() == []
        assert pool.ready_count() == 0  # listed, but /health does not answer
        for state in pool.workers.values():
            state.healthy = True  # as if their polls had passed
        assert {c.url for c in pool.candidates(0.0)} == {a, b}

        pool.acquire(b)
        listed.answer = [Endpoint(a), Endpoint(b, ready=False)]  # b terminates
        await pool.refresh()
        pool.workers[a].healthy = True
        assert [c.url for c in pool.candidates(0.0)] == [a]
        assert pool.workers[b].inflight == 1  # still known: its request runs on

        listed.answer = [Endpoint(a)]  # b's endpoint is gone, its request still open
        assert await pool.refresh() == []
        assert b in pool.workers and not pool.workers[b].ready
        pool.release(b)
        assert await pool.refresh() == [b]
        assert b not in pool.workers

        listed.error = RuntimeError("403 forbidden")
        await pool.refresh()  # discovery fails: keep what was known, say why
        assert a in pool.workers
        assert pool.discovery_error == "RuntimeError: 403 forbidden"
        await upstream.aclose()

    asyncio.run(scenario())


def test_busy_and_down_marks() -> None:
    a = f"http://127.0.0.1:{free_port()}"

    async def scenario() -> None:
        listed = ListedEndpoints()
        listed.answer = [Endpoint(a)]
        upstream = Upstream()
        pool = WorkerPool("worker", listed, upstream)
        await pool.refresh()
        pool.workers[a].healthy = True
        pool.mark_busy(a, until=10.0)
        assert [c.busy for c in pool.candidates(now=5.0)] == [True]
        assert [c.busy for c in pool.candidates(now=11.0)] == [False]
        pool.mark_down(a)
        assert pool.candidates(now=11.0) == []
        await upstream.aclose()

    asyncio.run(scenario())
