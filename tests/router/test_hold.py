"""Requests held while a pool has no ready worker (scaled to zero, waking): the bounds (count and
wait), release by priority then arrival, a full queue making room for a request that ranks
before its last, a client that leaves frees its place; and through a real router
process, held requests answered once a worker joins, and 503 with Retry-After past the bound."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx

from phasefleet.router.hold import Held, HeldRequests
from tests.router.router_proc import run_router
from tests.server.worker_proc import run_worker

HELD = 'phasefleet_router_requests_held{model_name="tiny",role="router",worker_pool="worker"}'


def make_held(hold_seconds: float = 30.0, max_held: int = 8) -> tuple[HeldRequests, list[int]]:
    seen: list[int] = []  # what the gauge was set to, in order
    held = HeldRequests(hold_seconds, max_held, on_change=lambda pool, n: seen.append(n))
    return held, seen


def test_held_requests_are_released_in_arrival_order() -> None:
    async def scenario() -> None:
        held, seen = make_held()
        order: list[int] = []

        async def request(i: int) -> None:
            assert await held.wait("worker") is Held.RELEASED
            order.append(i)

        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(request(i)))
            await asyncio.sleep(0)  # each one reaches the queue before the next arrives
        assert held.count("worker") == 5
        assert held.release("decode") == 0  # another pool's release leaves them waiting
        assert held.release("worker") == 5
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3, 4]
        assert held.count("worker") == 0
        assert seen == [1, 2, 3, 4, 5, 0]

    asyncio.run(scenario())


def test_a_request_past_the_count_bound_is_not_held() -> None:
    async def scenario() -> None:
        held, _ = make_held(max_held=2)
        waiting = [asyncio.create_task(held.wait("worker")) for _ in range(2)]
        await asyncio.sleep(0)
        assert await held.wait("worker") is Held.FULL
        held.release("worker")
        assert await asyncio.gather(*waiting) == [Held.RELEASED, Held.RELEASED]

    asyncio.run(scenario())


def test_held_requests_are_released_by_priority_then_arrival() -> None:
    async def scenario() -> None:
        held, _ = make_held()
        order: list[str] = []

        async def request(name: str, priority: int) -> None:
            assert await held.wait("worker", priority) is Held.RELEASED
            order.append(name)

        tasks = []
        for name, priority in [("batch", 5), ("a", 0), ("urgent", -2), ("b", 0)]:
            tasks.append(asyncio.create_task(request(name, priority)))
            await asyncio.sleep(0)
        assert held.release("worker") == 4
        await asyncio.gather(*tasks)
        assert order == ["urgent", "a", "b", "batch"]

    asyncio.run(scenario())


def test_a_full_queue_makes_room_for_a_request_that_ranks_before_its_last() -> None:
    """The last in line (the lowest priority, the latest of it) leaves for one that ranks
    before it; one that does not is refused, as is any when all rank before it."""

    async def scenario() -> None:
        held, seen = make_held(max_held=2)
        batch = asyncio.create_task(held.wait("worker", 5))
        normal = asyncio.create_task(held.wait("worker", 0))
        await asyncio.sleep(0)
        assert await held.wait("worker", 5) is Held.FULL  # ranks after batch: not held
        urgent = asyncio.create_task(held.wait("worker", -1))
        await asyncio.sleep(0)
        assert await batch is Held.FULL  # out of the queue, for urgent
        assert held.count("worker") == 2
        assert await held.wait("worker", 0) is Held.FULL  # after normal (same rank, later)
        held.release("worker")
        assert await asyncio.gather(normal, urgent) == [Held.RELEASED, Held.RELEASED]
        assert seen == [1, 2, 2, 0]

    asyncio.run(scenario())


def test_a_request_past_the_wait_bound_times_out_and_frees_its_place() -> None:
    async def scenario() -> None:
        held, seen = make_held(hold_seconds=0.05, max_held=1)
        assert await held.wait("worker") is Held.TIMED_OUT
        assert held.count("worker") == 0
        assert seen == [1, 0]
        assert held.release("worker") == 0

    asyncio.run(scenario())


def test_a_client_that_leaves_while_held_frees_its_place() -> None:
    async def scenario() -> None:
        held, seen = make_held(max_held=1)
        leaving = asyncio.create_task(held.wait("worker"))
        await asyncio.sleep(0)
        assert held.count("worker") == 1
        leaving.cancel()  # what the app does when the client disconnects
        await asyncio.gather(leaving, return_exceptions=True)
        assert held.count("worker") == 0
        staying = asyncio.create_task(held.wait("worker"))  # the freed place is taken
        await asyncio.sleep(0)
        held.release("worker")
        assert await staying is Held.RELEASED
        assert seen == [1, 0, 1, 0]

    asyncio.run(scenario())


def test_holding_off_answers_at_once() -> None:
    async def scenario() -> None:
        held, seen = make_held(hold_seconds=0)
        assert await held.wait("worker") is Held.OFF
        assert seen == []

    asyncio.run(scenario())


def test_requests_held_while_the_pool_is_empty_are_answered_once_a_worker_joins(
    tiny_model: Path, tmp_path: Path
) -> None:
    members = tmp_path / "workers.json"
    members.write_text(json.dumps({"worker": []}))
    args = ("--workers-file", str(members), "--refresh-interval", "0.2", "--hold-seconds", "60")
    with run_router(*args) as router:
        answers: list[httpx.Response] = []

        def ask() -> None:
            body = {"model": "tiny", "prompt": "Wake up", "max_tokens": 4, "temperature": 0}
            answers.append(httpx.post(f"{router.base_url}/v1/completions", json=body, timeout=90))

        clients = [threading.Thread(target=ask) for _ in range(6)]
        for client in clients:
            client.start()
        with run_worker(tiny_model) as worker:
            assert router.metrics()[HELD] == 6  # all waited while the worker started
            members.write_text(json.dumps({"worker": [worker.base_url]}))
            for client in clients:
                client.join(timeout=60)
        assert [a.status_code for a in answers] == [200] * 6
        assert all(a.json()["usage"]["completion_tokens"] == 4 for a in answers)
        assert router.metrics()[HELD] == 0


def test_a_request_held_past_the_bound_gets_503_with_retry_after(tmp_path: Path) -> None:
    members = tmp_path / "workers.json"
    members.write_text(json.dumps({"worker": []}))
    args = ("--workers-file", str(members), "--hold-seconds", "0.5")
    with run_router(*args) as router:
        body = {"model": "tiny", "prompt": "Anyone?", "max_tokens": 4}
        answer = httpx.post(f"{router.base_url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "5"
        error = answer.json()["error"]
        assert error["code"] == "no_ready_worker"
        assert error["type"] == "service_unavailable"
        assert "none became ready within 0.5 s" in error["message"]
