"""Scaling a pool down while streams run loses none of them: the fleet takes a decode worker out
of the router's list, then drains it (SIGTERM), and every stream it was serving finishes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from phasefleet.local.fleet import Fleet, FleetConfig
from tests.server.worker_proc import free_port

MAX_TOKENS = 1500  # streams still running 1.5 s after the first token, on an idle machine too
PROMPTS = [f"Stream {i} of the evening tide" for i in range(12)]


@pytest.fixture
def fleet(tiny_model: Path, tmp_path: Path) -> Iterator[Fleet]:
    config = FleetConfig(
        model=str(tiny_model),
        served_model_name="tiny",
        port=free_port(),
        pools={"prefill": 1, "decode": 2},
        run_dir=tmp_path,
        worker_args=["--num-kv-blocks", "1024", "--remote-prefill-min-tokens", "0"],
        router_args=["--refresh-interval", "0.5"],
        drain_timeout=120.0,  # six 1500-token streams; a loaded CI machine once took over 60 s
    )
    fleet = Fleet(config)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


async def stream(
    client: openai.AsyncOpenAI, prompt: str, started: threading.Event
) -> tuple[str, str | None, int]:
    chunks = await client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, reason, tokens = "", None, 0
    async for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
            started.set()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, reason, tokens


def test_scaling_decode_down_during_streams_loses_none(fleet: Fleet) -> None:
    started = threading.Event()
    results: list[tuple[str, str | None, int]] = []

    async def run_all() -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=300
        )
        try:
            results.extend(await asyncio.gather(*(stream(client, p, started) for p in PROMPTS)))
        finally:
            await client.close()

    runner = threading.Thread(target=lambda: asyncio.run(run_all()))
    runner.start()
    assert started.wait(120)
    leaving = fleet.workers["decode"][0]
    fleet.retire(leaving)  # out of the router's list
    time.sleep(1.5)  # the router has re-read it
    running = httpx.get(f"{leaving.url}/metrics", timeout=10).text
    assert 'phasefleet_num_requests_running{model_name="tiny",role="decode"} 0.0' not in running
    fleet.drain(leaving)  # SIGTERM while it still serves streams
    assert leaving.popen is not None and leaving.popen.returncode == 0  # drained, not killed
    runner.join(300)
    assert not runner.is_alive()
    assert [(reason, tokens) for _, reason, tokens in results] == [("length", MAX_TOKENS)] * 12
    # Each stream is the same text the fleet gives that prompt now, on the one decode worker left.
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0)
    for prompt, (text, _, _) in list(zip(PROMPTS, results, strict=True))[:3]:
        again = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert again.choices[0].text == text
