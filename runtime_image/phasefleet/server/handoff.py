"""The decode side of the KV hand-off: ask a prefill worker to prefill a prompt and stream its KV
back (server/kv_wire.py); the first token arrives the moment it is sampled, the KV of each chunk
as the prefill worker computes it, the last chunk's just after the first token.

Every failure here is survivable: no stream from the prefill worker means this worker prefills
the prompt itself; a stream that breaks after the first token leaves the blocks that arrived,
and only the rest of the prompt is recomputed here. `HandoffFailed.reason` and
`Received.failure` say which, for the failures counter. A request that wants prompt logprobs
(echo) is prefilled here: see `wants_remote`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phasefleet.api.contract import INTERNAL_TOKEN_HEADER
from phasefleet.engine.kv_transfer import KVChunk, KVLayout
from phasefleet.engine.outputs import TokenLogprob
from phasefleet.server.kv_stream import StreamedPrefill, StreamError, stream_prefill
from phasefleet.server.kv_wire import PREFILL_PATH, FirstFrame, PrefillRequest, StartFrame

if TYPE_CHECKING:
    from phasefleet.engine.sampling_params import SamplingParams


class HandoffFailed(Exception):
    """The prefill worker gave no first token; `reason` is a metric label: prefill_unreachable,
    prefill_refused."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def wants_remote(params: SamplingParams) -> bool:
    """Whether a prefill worker can do this request's prefill: not when it wants the prompt's
    logprobs, which only the worker that computes every prompt position has."""
    return params.prompt_logprobs is None


@dataclass
class First:
    """What the prefill worker sent before (and with) its first token."""

    token_id: int
    finish_reason: str  # 'handoff' (the KV follows) or a final reason (stop, length)
    num_prompt_tokens: int
    num_cached_tokens: int
    logprob: TokenLogprob | None
    layout: KVLayout

    @classmethod
    def of(cls, start: StartFrame, first: FirstFrame) -> First:
        return cls(
            token_id=first.first_token_id,
            finish_reason=first.finish_reason,
            num_prompt_tokens=start.num_prompt_tokens,
            num_cached_tokens=first.num_cached_tokens,
            logprob=None
            if first.logprob is None
            else TokenLogprob(first.first_token_id, first.logprob, list(first.top)),
            layout=start.layout.layout(),
        )


@dataclass
class Received:
    """The KV that arrived: chunks consecutive from the first block sent, as the engine takes
    them; `failure` names why the stream stopped short (None when it ended cleanly)."""

    chunks: list[KVChunk]
    nbytes: int
    seconds: float  # from the request to the end of the stream
    failure: str | None


@dataclass
class HandoffClient:
    """One decode worker's way to the prefill workers."""

    token: str  # the service's internal token
    connect_timeout: float = 5.0  # seconds to reach a prefill worker
    first_timeout: float = 120.0  # seconds for the first token (the prompt may queue there)
    stall_timeout: float = 30.0  # seconds without a byte once the first token came

    async def prefill(
        self,
        prefill_url: str,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        skip_tokens: int,
    ) -> tuple[First, asyncio.Future[Received]]:
        """The first token (raises HandoffFailed when none comes), and the KV still arriving."""
        loop = asyncio.get_running_loop()
        first: asyncio.Future[First] = loop.create_future()

        def on_first(start: StartFrame, frame: FirstFrame) -> None:  # the reading thread
            loop.call_soon_threadsafe(_settle, first, First.of(start, frame))

        body = PrefillRequest.of(request_id, prompt, params, skip_tokens).model_dump_json()
        started = time.monotonic()
        reading = asyncio.ensure_future(
            asyncio.to_thread(
                stream_prefill,
                prefill_url.rstrip("/") + PREFILL_PATH,
                {INTERNAL_TOKEN_HEADER: self.token},
                body.encode(),
                on_first,
                self.connect_timeout,
                self.first_timeout,
                self.stall_timeout,
            )
        )
        waiting: set[asyncio.Future[object]] = {first, reading}  # type: ignore[arg-type]
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not first.done():  # the stream ended (or failed) before a first token
            try:
                result = await reading
            except StreamError as exc:
                raise HandoffFailed(str(exc.reason), exc.detail) from None
            raise HandoffFailed("prefill_refused", f"no first token: {result.failure}")
        return first.result(), asyncio.ensure_future(_received(reading, started))


async def _received(reading: asyncio.Future[StreamedPrefill], started: float) -> Received:
    result = await reading
    import torch

    chunks = [
        KVChunk(c.first_block, c.num_blocks, torch.frombuffer(c.payload, dtype=torch.uint8))
        for c in result.chunks
    ]
    failure = None if result.failure is None else str(result.failure.reason)
    return Received(
        chunks, sum(len(c.payload) for c in result.chunks), time.monotonic() - started, failure
    )


def _settle(future: asyncio.Future[First], value: First) -> None:
    if not future.done():
        future.set_result(value)


@dataclass
class RemotePrefill:
    """How one request on a decode worker gets its prompt prefilled elsewhere."""

    client: HandoffClient
    prefill_url: str  # the prefill worker the router picked
    # (first token, stop strings) -> (its text, whether a stop string ended it); tokenizer thread
    first_token_text: Callable[[int, list[str]], Awaitable[tuple[str, bool]]]
    cached_tokens: int = 0  # prompt tokens this worker's prefix cache holds (an estimate)
