"""A worker with the prefix cache's host tier (`--host-kv-cache-gib`) over real HTTP: a prompt the
small pool evicted comes back from host memory, with the same answer, counted on /metrics."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from phasefleet.api.contract import Metric
from tests.server.worker_proc import Worker, run_worker


@pytest.fixture(scope="module")
def worker(tiny_model: Path) -> Iterator[Worker]:
    flags = ["--num-kv-blocks", "20", "--block-size", "4", "--host-kv-cache-gib", "0.01"]
    with run_worker(tiny_model, *flags) as w:
        yield w


def test_an_evicted_prompt_is_loaded_back_with_the_same_answer(worker: Worker) -> None:
    rng = random.Random(3)
    first, other = ([rng.randrange(10, 400) for _ in range(n)] for n in (40, 44))
    client = worker.client()

    def answer(prompt: list[int]) -> str:
        done = client.completions.create(
            model=worker.model, prompt=prompt, max_tokens=4, temperature=0
        )
        return done.choices[0].text

    before = answer(first)
    answer(other)  # a pool of 19 blocks holds one of them: first's tail goes to host memory
    assert worker.metric(Metric.HOST_KV_CACHE_USAGE_PERC) > 0
    assert answer(first) == before
    # all of first but its last token is cached: its head on the device, its tail on the host
    assert worker.counter(Metric.PREFIX_CACHE_HITS_TOTAL) == 39
    assert worker.counter(Metric.HOST_KV_CACHE_HITS_TOTAL) > 0
