"""A pool's bookkeeping across refreshes: who takes new work, who only finishes, who is gone.

Discovery is faked here (a list the test edits); the workers' polls go over real HTTP to ports
where nothing listens, so every worker polls unhealthy unless the test says otherwise.
"""

from __future__ import annotations

import asyncio

from phasefleet.router.config import RouterConfig
from phasefleet.router.discovery import Endpoint
from phasefleet.router.dispatch import Router
from phasefleet.router.metrics import RouterMetrics
from phasefleet.router.policy import WorkerLoad, prefill_backlog_s
from phasefleet.router.pool import RATE_WEIGHT, WorkerPool, WorkerState
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


def test_a_workers_prefill_throughput_is_measured_from_its_counters() -> None:
    def load(tokens: float, busy: float) -> WorkerLoad:
        return WorkerLoad(0, 0, 0.0, prompt_tokens_total=tokens, busy_seconds_total=busy)

    state = WorkerState("http://p:8000")
    state.observe(load(1000, 1.0))
    assert state.prefill_rate is None  # one poll: no growth to measure yet
    state.observe(load(3000, 2.0))  # 2000 tokens in 1 busy second
    assert state.prefill_rate == 2000
    state.observe(load(3000, 2.01))  # idle between the polls: no sample
    assert state.prefill_rate == 2000
    state.observe(load(7000, 3.01))  # 4000 tokens/s: the average moves part of the way
    assert state.prefill_rate == 2000 + RATE_WEIGHT * 2000
    state.observe(load(10, 0.5))  # restarted: its counters went back, no sample
    assert state.prefill_rate == 2000 + RATE_WEIGHT * 2000
    assert state.load == load(10, 0.5)


def test_the_router_picks_a_prefill_worker_whose_backlog_it_can_state_in_seconds() -> None:
    url = "http://p:8000"
    listed = ListedEndpoints()
    prefill = WorkerPool("prefill", listed, Upstream())
    decode = WorkerPool("decode", ListedEndpoints(), prefill.upstream)
    config = RouterConfig(served_model_name="m", policy="least-loaded", internal_token="t")
    router = Router(
        config, {"prefill": prefill, "decode": decode}, prefill.upstream, RouterMetrics("m")
    )
    state = prefill.workers[url] = WorkerState(url, healthy=True)
    state.load = WorkerLoad(0, 1, 0.0, prefill_pending=300, prefill_waiting=900)
    chosen = router.choose_prefill([])
    assert chosen is not None and chosen.url == url
    assert prefill_backlog_s(chosen) is None  # its throughput is not measured yet
    state.prefill_rate = 2400.0
    chosen = router.choose_prefill([])
    assert chosen is not None and prefill_backlog_s(chosen) == 0.5
    asyncio.run(prefill.upstream.aclose())


def test_an_adapters_requests_go_only_to_the_workers_that_have_it() -> None:
    p1, p2, d1, d2 = "http://p1:1", "http://p2:1", "http://d1:1", "http://d2:1"
    prefill = WorkerPool("prefill", ListedEndpoints(), Upstream())
    decode = WorkerPool("decode", ListedEndpoints(), prefill.upstream)
    config = RouterConfig(served_model_name="m", policy="round-robin", internal_token="t")
    pools = {"prefill": prefill, "decode": decode}
    router = Router(config, pools, prefill.upstream, RouterMetrics("m"))
    for pool, url, adapters in [
        (prefill, p1, {"sql"}), (prefill, p2, set()), (decode, d1, set()), (decode, d2, {"sql"}),
    ]:  # fmt: skip
        pool.workers[url] = WorkerState(url, healthy=True, adapters=frozenset(adapters))
    assert router.loaded_adapters() == {"sql"}
    assert decode.has_adapter("sql") and not decode.has_adapter("poet")
    for _ in range(4):  # round-robin would alternate: the adapter pins both choices
        assert router.choose(decode, [], set(), adapter="sql") == d2
        chosen = router.choose_prefill([], "sql")
        assert chosen is not None and chosen.url == p1
    assert router.choose(decode, [], {d2}, adapter="sql") is None  # tried: no fallback
    assert {router.choose(decode, [], set()) for _ in range(4)} == {d1, d2}  # base model
    prefill.workers[p1].adapters = frozenset()
    assert router.choose_prefill([], "sql") is None  # the decode worker prefills it
    assert router.choose_prefill([], "m") is not None  # the base model: any prefill worker
    asyncio.run(prefill.upstream.aclose())
