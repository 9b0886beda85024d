"""ScrapeSource against a real worker and router process on the tiny model, with real traffic."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from phasefleet.autoscale.scrape import ScrapeSource, ScrapeTargets
from tests.router.router_proc import run_router, worker_list
from tests.server.worker_proc import run_worker

REQUESTS = 8
MAX_TOKENS = 24


def stream_one(client: openai.OpenAI, i: int) -> int:
    stream = client.completions.create(
        model="tiny",
        prompt=f"request {i}: the quick brown fox jumps over the lazy dog",
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text)


def stream_many(client: Callable[[], openai.OpenAI], n: int) -> list[int]:
    """n streams, 4 at a time, after one on this thread: the openai client's models build their
    pydantic schemas lazily, and threads building them at once can race (a PydanticUserError
    "BaseModel cannot be instantiated directly" on a slow CI run). Each stream's chunk count."""
    first = stream_one(client(), n)
    with ThreadPoolExecutor(max_workers=4) as executor:
        return [first, *executor.map(lambda i: stream_one(client(), i), range(n))]


@pytest.mark.slow
def test_scrape_source_reads_a_live_worker_and_router(tiny_model: Path) -> None:
    with (
        run_worker(tiny_model) as worker,
        run_router("--workers", worker_list(worker)) as router,
    ):
        targets = ScrapeTargets((router.base_url,), {"worker": {"w0": worker.base_url}})
        source = ScrapeSource(lambda: targets, percentile=0.9, window_s=30)
        first = source.read(now=time.monotonic())
        pool = first.pools["worker"]
        assert pool.reporting == 1 and set(pool.pods) == {"w0"}
        assert pool.running == 0 and pool.kv_usage_sum == 0
        assert first.ttft_s is None and pool.prompt_tokens_per_s is None  # one scrape so far

        assert min(stream_many(router.client, REQUESTS)) > 1

        signals = source.read(now=time.monotonic())
        pool = signals.pools["worker"]
        assert signals.ttft_s is not None and 0.0005 < signals.ttft_s < 10.0
        assert signals.tpot_s is not None and 0.0 < signals.tpot_s < 1.0
        assert signals.itl_s is not None and 0.0 < signals.itl_s < 1.0
        assert signals.request_rate is not None and signals.request_rate > 0
        assert pool.prompt_tokens_per_s is not None and pool.prompt_tokens_per_s > 0
        assert pool.generation_tokens_per_s is not None and pool.generation_tokens_per_s > 0
        assert pool.busy_fraction is not None and 0.0 < pool.busy_fraction <= 1.0
        assert pool.running == 0 and pool.waiting == 0  # all finished
