"""`phasefleet serve --autoscale`, run as a user would: load over a tiny TTFT target grows the
prefill pool; when the load stops it shrinks back after the window, while long streams are still
running, and every stream ends with all its tokens."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx2
import openai

from tests.local.test_serve import children_of, ctrl_c_leaves_nothing
from tests.server.worker_proc import free_port

STARTUP_TIMEOUT = 240.0  # seconds: three processes load the model on a shared 2-core machine
WINDOW = 6.0  # --scale-down-window (seconds)
PROMPT_REPEATS = 60  # the load's prompts: about 1000 tokens, so the prefill pool is busy
SHORT_TOKENS = 8  # and short answers
LONG_TOKENS = 1900  # long streams (a few seconds on an idle machine; the model allows 2048)
SENDERS = 8
LONG_STREAMS = 4  # started with the load
LONG_IN_FLIGHT = 2  # then kept this many mid-answer until the pool shrinks: however fast the
# machine streams, some are running at the shrink, and the one decode worker is not flooded
# (a queue there holds prompts' KV on the prefill workers and keeps their TTFT term up)


def serve_command(model: Path, port: int, run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "phasefleet.cli", "serve", "--model", str(model),
        "--served-model-name", "tiny", "--port", str(port), "--run-dir", str(run_dir),
        "--worker-args", "--num-kv-blocks 1024 --remote-prefill-min-tokens 0",
        "--router-args", "--refresh-interval 0.5",
        "--autoscale", "--max", "prefill=2", "--max", "decode=1",
        "--ttft-ms", "1", "--interval", "1", "--signal-window", "2",
        "--scale-down-window", str(WINDOW),
    ]  # fmt: skip


async def stream(
    client: openai.AsyncOpenAI, prompt: str, max_tokens: int, started: asyncio.Event | None = None
) -> tuple[str | None, int]:
    """(finish reason, completion tokens) of one streamed completion."""
    chunks = await client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    reason, tokens = None, 0
    async for chunk in chunks:
        if chunk.choices:
            reason = chunk.choices[0].finish_reason or reason
            if started is not None:
                started.set()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return reason, tokens


class Serve:
    """The `phasefleet serve` process: its output and its worker list (the router's file)."""

    def __init__(self, proc: subprocess.Popen[bytes], run_dir: Path) -> None:
        self.proc = proc
        self.run_dir = run_dir

    def output(self) -> str:
        return (self.run_dir / "serve.out").read_text(errors="replace")

    def pool_size(self, pool: str) -> int:
        members = json.loads((self.run_dir / "workers.json").read_text())
        return len(members[pool])

    async def until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, f"no {what} after {timeout:.0f}s:\n{self.output()}"
            await asyncio.sleep(0.2)


async def load_then_quiet(serve: Serve, url: str) -> float:
    """Returns the seconds from the load's end (no new request) to the prefill pool's shrink."""
    # Idle pooled connections are dropped after 2 s, before the router's server closes them
    # (5 s keep-alive): a new stream sent on one the server is closing fails with a connection
    # error before reaching the router (it failed a CI run so), and max_retries=0 does not retry.
    limits = httpx2.Limits(max_connections=100, max_keepalive_connections=100, keepalive_expiry=2.0)
    http_client = openai.DefaultAsyncHttpx2Client(limits=limits)
    client = openai.AsyncOpenAI(
        base_url=url, api_key="unused", max_retries=0, timeout=300, http_client=http_client
    )
    quiet = asyncio.Event()

    async def keep_sending(sender: int) -> list[tuple[str | None, int]]:
        done: list[tuple[str | None, int]] = []
        while not quiet.is_set():
            prompt = (
                f"Sender {sender} asks about request {len(done)} of the night " * PROMPT_REPEATS
            )
            done.append(await stream(client, prompt, SHORT_TOKENS))
        return done

    try:
        senders = [asyncio.create_task(keep_sending(i)) for i in range(SENDERS)]
        await serve.until(lambda: serve.pool_size("prefill") == 2, 120, "second prefill worker")
        starts = [asyncio.Event() for _ in range(LONG_STREAMS)]
        longs = [
            asyncio.create_task(stream(client, f"A long tale, part {i}", LONG_TOKENS, started))
            for i, started in enumerate(starts)
        ]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 60)
        quiet.set()
        load_ended = time.monotonic()
        shrunk = asyncio.Event()

        async def keep_long_streams_in_flight() -> None:
            while not shrunk.is_set():
                if sum(not task.done() for task in longs) < LONG_IN_FLIGHT:
                    part = f"A long tale, part {len(longs)}"
                    longs.append(asyncio.create_task(stream(client, part, LONG_TOKENS)))
                await asyncio.sleep(0.2)

        starter = asyncio.create_task(keep_long_streams_in_flight())
        short = [result for s in await asyncio.gather(*senders) for result in s]
        await serve.until(lambda: serve.pool_size("prefill") == 1, 90, "scale-down")
        shrunk.set()
        shrank_after = time.monotonic() - load_ended
        still_running = sum(not task.done() for task in longs)
        await starter
        long = await asyncio.gather(*longs)
    finally:
        await client.close()
    assert still_running > 0, f"every long stream ended before the scale-down:\n{serve.output()}"
    assert len(short) >= SENDERS
    assert [r for r in short if r != ("length", SHORT_TOKENS)] == []
    assert long == [("length", LONG_TOKENS)] * len(longs)
    return shrank_after


def test_serve_autoscale_grows_prefill_on_ttft_and_shrinks_without_losing_a_stream(
    tiny_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = (tmp_path / "serve.out").open("wb")
    proc = subprocess.Popen(
        serve_command(tiny_model, port, tmp_path),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
    )
    serve = Serve(proc, tmp_path)
    try:
        asyncio.run(
            serve.until(lambda: "PhaseFleet is serving" in serve.output(), STARTUP_TIMEOUT, "fleet")
        )
        shrank_after = asyncio.run(load_then_quiet(serve, f"http://127.0.0.1:{port}/v1"))
        assert shrank_after >= WINDOW, serve.output()  # lower asks for a whole window first
        out = serve.output()
        assert "autoscaling every 1s (prefill 1..2, decode 1..1" in out
        assert "prefill 1->2: " in out  # TTFT, or the backlog or busy time it comes from
        assert "prefill 2->1: " in out
        assert "decode stays at 1" in out
        retired = [line for line in out.splitlines() if "prefill: retiring prefill-" in line]
        assert len(retired) == 1
        leaving = retired[0].split("retiring ")[1].split()[0]
        asyncio.run(
            serve.until(lambda: f"{leaving} drained and stopped" in serve.output(), 60, "drain")
        )
        fleet = children_of(proc.pid)
        assert len(fleet) >= 3  # router, prefill worker, decode worker
        ctrl_c_leaves_nothing(proc, fleet, serve.output)  # the loop stops, then all drains
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
