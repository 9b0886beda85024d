"""Router overhead: the same requests straight to a worker and through the router, interleaved,
one at a time."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import httpx
from latency_stats import pct
from stream_client import stream_completion


@dataclass(frozen=True)
class Overhead:
    pairs: int
    direct_ttft_p50: float  # seconds
    router_ttft_p50: float
    direct_itl_p50: float
    router_itl_p50: float


async def measure_overhead(
    client: httpx.AsyncClient,
    router_url: str,
    worker_url: str,
    model: str,
    pairs: int,
    prompt_tokens: int,
    max_tokens: int,
    vocab_size: int,
) -> Overhead:
    rng = random.Random(1)
    ttft: dict[str, list[float]] = {"direct": [], "router": []}
    itl: dict[str, list[float]] = {"direct": [], "router": []}
    for i in range(pairs):
        order = [("direct", worker_url), ("router", router_url)]
        if i % 2:
            order.reverse()  # neither path always goes first
        for name, url in order:
            # a fresh prompt each time: no prefix-cache hit favours either path
            prompt = [rng.randrange(10, vocab_size) for _ in range(prompt_tokens)]
            t = await stream_completion(client, url, model, prompt, max_tokens, time.perf_counter())
            if not t.ok:
                raise RuntimeError(f"{name} request failed: {t.error}")
            ttft[name].append(t.ttft)
            itl[name].extend(gap for _, gap in t.gaps())
    return Overhead(
        pairs=pairs,
        direct_ttft_p50=pct(ttft["direct"], 50),
        router_ttft_p50=pct(ttft["router"], 50),
        direct_itl_p50=pct(itl["direct"], 50),
        router_itl_p50=pct(itl["router"], 50),
    )
