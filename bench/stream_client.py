"""One streamed completion, timed token by token on the client."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestTiming:
    sent: float  # seconds on the replay clock (perf_counter minus the replay's start)
    prompt_tokens: int
    token_times: list[float] = field(default_factory=list)  # one per token event, same clock
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and len(self.token_times) > 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    def gaps(self) -> list[tuple[float, float]]:
        """(wall time of the later token, seconds since the token before) per gap."""
        t = self.token_times
        return [(t[i], t[i] - t[i - 1]) for i in range(1, len(t))]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return None if n < 2 else (self.token_times[-1] - self.token_times[0]) / (n - 1)


async def stream_completion(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    prompt_token_ids: list[int],
    max_tokens: int,
    clock_zero: float,  # perf_counter value that the replay clock counts from
) -> RequestTiming:
    body = {
        "model": model,
        "prompt": prompt_token_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,  # every token event carries its ids, even with no text yet
    }
    timing = RequestTiming(time.perf_counter() - clock_zero, len(prompt_token_ids))
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                timing.error = f"status {response.status_code}: {(await response.aread())[:200]!r}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter() - clock_zero
                payload = line[6:]
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    timing.error = str(chunk["error"])[:200]
                    break
                for choice in chunk.get("choices", []):
                    if choice.get("token_ids"):
                        timing.token_times.append(now)
    except httpx.HTTPError as exc:
        timing.error = repr(exc)
    return timing
