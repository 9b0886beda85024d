"""The decode side of the KV hand-off: ask a prefill worker to prefill a prompt and stream its KV
back (server/kv_wire.py); the first token arrives the moment it is sampled, the KV of each chunk
as the prefill worker computes it, the last chunk's just after the first token.

Every failure here is survivable: no stream from the prefill worker means this worker prefills
the prompt itself; a stream that breaks leaves the blocks that arrived, and only the rest of the
prompt is recomputed here (with the first token, if the break came before it).
`HandoffFailed.reason` and `Received.failure` say which, for the failures counter. A request
that wants prompt logprobs (echo) is prefilled here: see `wants_remote`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from phasefleet.api.contract import INTERNAL_TOKEN_HEADER
from phasefleet.engine.kv_transfer import KVChunk, KVLayout
from phasefleet.engine.outputs import TokenLogprob
from phasefleet.server.kv_stream import StreamChunk, StreamedPrefill, StreamError, stream_prefill
from phasefleet.server.kv_wire import PREFILL_PATH, FirstFrame, PrefillRequest, StartFrame

if TYPE_CHECKING:
    from phasefleet.engine.sampling_params import SamplingParams


T = TypeVar("T")


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
    first_block: int  # the first block the stream sends (the ones before are cache hits here)

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
            first_block=start.skip_blocks,
        )


@dataclass
class Received:
    """How the stream ended (its KV went through `Arrivals`): `failure` names why it stopped
    short (None when it ended cleanly)."""

    nbytes: int
    seconds: float  # from the request to the end of the stream
    failure: str | None


class Arrivals:
    """The KV of one hand-off as it arrives, on the event loop: chunks are kept until `follow`
    takes them and names who gets each later one; `begun` resolves with the first chunk,
    `done` when the stream has ended."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.begun: asyncio.Future[None] = loop.create_future()  # the first chunk is here
        self.done: asyncio.Future[Received] = loop.create_future()
        self._kept: list[KVChunk] = []
        self._follower: Callable[[KVChunk], None] | None = None

    def take(self) -> list[KVChunk]:
        """The chunks kept so far (all of them, once `done` has resolved), no longer kept."""
        kept, self._kept = self._kept, []
        return kept

    def follow(self, follower: Callable[[KVChunk], None]) -> list[KVChunk]:
        """The chunks kept so far; each later one goes to `follower`, in order, not kept."""
        self._follower = follower
        return self.take()

    def put(self, chunk: KVChunk) -> None:
        if not self.begun.done():
            self.begun.set_result(None)
        if self._follower is None:
            self._kept.append(chunk)
        else:
            self._follower(chunk)


@dataclass
class HandoffClient:
    """One decode worker's way to the prefill workers."""

    token: str  # the service's internal token
    connect_timeout: float = 5.0  # seconds to reach a prefill worker
    first_timeout: float = 120.0  # seconds for the first token (the prompt may queue there)
    stall_timeout: float = 30.0  # seconds without a byte once the first token came

    async def open(
        self,
        prefill_url: str,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        skip_tokens: int,
        late_after_s: float | None = None,
        lora: str | None = None,
        priority: int = 0,
    ) -> Handoff:
        """The hand-off once the prefill worker has taken the prompt (HandoffFailed when it
        does not): its layout, the KV as it arrives, then the first token. `late_after_s`:
        the prompt's TTFT target there (late prompts last); `lora`: its adapter, which the
        prefill worker must have loaded too; `priority`: its rank there (priority policy)."""
        loop = asyncio.get_running_loop()
        started: asyncio.Future[StartFrame] = loop.create_future()
        first: asyncio.Future[First] = loop.create_future()
        arrivals = Arrivals(loop)

        def on_start(start: StartFrame) -> None:  # the reading thread
            loop.call_soon_threadsafe(_settle, started, start)

        def on_first(start: StartFrame, frame: FirstFrame) -> None:  # the reading thread
            loop.call_soon_threadsafe(_settle, first, First.of(start, frame))

        def on_chunk(chunk: StreamChunk) -> None:  # the reading thread, in stream order
            loop.call_soon_threadsafe(arrivals.put, _kv_chunk(chunk))

        body = PrefillRequest.of(
            request_id, prompt, params, skip_tokens, late_after_s, lora, priority
        ).model_dump_json()
        began = time.monotonic()
        reading = asyncio.ensure_future(
            asyncio.to_thread(
                stream_prefill,
                prefill_url.rstrip("/") + PREFILL_PATH,
                {INTERNAL_TOKEN_HEADER: self.token},
                body.encode(),
                on_start,
                on_first,
                on_chunk,
                self.connect_timeout,
                self.first_timeout,
                self.stall_timeout,
            )
        )
        waiting: set[asyncio.Future[object]] = {started, reading}  # type: ignore[arg-type]
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():  # it raised (a stream that ends returned after its start)
            try:
                await reading
            except StreamError as exc:
                raise HandoffFailed(str(exc.reason), exc.detail) from None
            raise HandoffFailed("prefill_refused", "the stream ended before it started")
        reading.add_done_callback(partial(_ended, arrivals.done, began))
        return Handoff(started.result(), arrivals, first, reading)


@dataclass
class Handoff:
    """One prompt's hand-off, taken by the prefill worker: the layout and blocks it sends
    (`start`), the KV as it arrives, and the first token to come."""

    start: StartFrame
    arrivals: Arrivals
    _first: asyncio.Future[First]
    _reading: asyncio.Future[StreamedPrefill]

    async def first(self) -> First:
        """The first token; HandoffFailed when the stream ended without one (the KV that
        arrived stays in `arrivals`)."""
        waiting: set[asyncio.Future[object]] = {self._first, self._reading}  # type: ignore[arg-type]
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if self._first.done():  # settled before the reading thread returned, if it sent one
            return self._first.result()
        result = await self._reading
        failure = result.failure
        if failure is None:
            raise HandoffFailed("prefill_refused", "the stream ended without a first token")
        raise HandoffFailed(str(failure.reason), failure.detail)


def _kv_chunk(chunk: StreamChunk) -> KVChunk:
    import torch

    return KVChunk(
        chunk.first_block, chunk.num_blocks, torch.frombuffer(chunk.payload, dtype=torch.uint8)
    )


def _ended(
    done: asyncio.Future[Received], started: float, reading: asyncio.Future[StreamedPrefill]
) -> None:
    """Resolves `done` as the reading thread ended (its error, e.g. a bug in the reader, too)."""
    if done.done():
        return
    if reading.cancelled():
        done.cancel()
    elif (error := reading.exception()) is not None:
        done.set_exception(error)
    else:
        result = reading.result()
        failure = None if result.failure is None else str(result.failure.reason)
        done.set_result(Received(result.nbytes, time.monotonic() - started, failure))


def _settle(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


@dataclass
class RemotePrefill:
    """How one request on a decode worker gets its prompt prefilled elsewhere."""

    client: HandoffClient
    prefill_url: str  # the prefill worker the router picked
    # (first token, its request's sampling) -> (its text, whether a stop string ended it); on
    # the tokenizer thread
    first_token_text: Callable[[int, SamplingParams], Awaitable[tuple[str, bool]]]
    cached_tokens: int = 0  # prompt tokens this worker's prefix cache holds (an estimate)
