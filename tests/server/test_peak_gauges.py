"""The worker's peak gauges as the metrics read them (AsyncEngine.stats): the burst's peak while
it is recent, nothing once it is older than PEAK_WINDOW_S, though an idle engine takes no step
that would refresh its stats."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from phasefleet.api.contract import PEAK_WINDOW_S
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.server.async_engine import AsyncEngine
from tests.engine.factories import engine_config, random_prompts


async def burst_then_idle(model: Path) -> None:
    engine = AsyncEngine(lambda: LLMEngine(engine_config(model)), max_queue_len=8)
    engine.start(asyncio.get_running_loop())
    try:
        while not engine.ready:
            await asyncio.sleep(0.05)
        prompts = random_prompts([9, 11, 13], seed=3)
        params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * 3
        ids = [f"b-{i}" for i in range(3)]
        stream = engine.submit(ids, prompts, params, time.monotonic())
        await stream.accepted
        async for _ in stream:
            pass
        stats = engine.stats()
        assert stats is not None and stats.num_running == 0 and stats.kv_cache_usage == 0
        assert stats.num_requests_peak == 3 and 0 < stats.kv_cache_usage_peak <= 1
        later = engine.stats(now=time.monotonic() + PEAK_WINDOW_S + 1)
        assert later is not None and (later.num_requests_peak, later.kv_cache_usage_peak) == (0, 0)
        assert later.generation_tokens_total == stats.generation_tokens_total == 12
    finally:
        engine.stop()


def test_an_idle_engines_peaks_fall_after_the_window(tiny_model: Path) -> None:
    asyncio.run(burst_then_idle(tiny_model))
