"""How a Generation reaches the client: Server-Sent Events, or one body once it finishes.

Either way a client that goes away aborts its engine requests, which frees their KV blocks:
a streaming response is cancelled by Starlette when the client disconnects (and then closes
its body generator and the Generation); a non-streaming one races collection against the
disconnect.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from phasefleet.server.errors import APIError
from phasefleet.server.generation import Generation

if TYPE_CHECKING:
    from phasefleet.engine.llm_engine import RequestOutput


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


class GenerationStream(StreamingResponse):
    """Closes its body generator and its Generation however the response ends: Starlette
    cancels the send when the client leaves, and a generator left suspended at a `yield` (or
    never started) would run its `finally` only when garbage collected."""

    def __init__(
        self,
        gen: Generation,
        content: AsyncGenerator[Any, None],
        media_type: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self.gen = gen
        self.content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.content.aclose()
            finally:
                self.gen.close()


def sse_response(gen: Generation, chunks: AsyncIterator[str]) -> StreamingResponse:
    """`data: <chunk>` events, then `data: [DONE]`; an error after the 200 goes in-band."""

    async def events() -> AsyncGenerator[str, None]:
        try:
            async for chunk in chunks:
                yield f"data: {chunk}\n\n"
        except APIError as err:
            # Headers (200) are gone already; report in-band, as OpenAI's API does.
            yield f"data: {json.dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"

    return GenerationStream(
        gen, events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _final_outputs(gen: Generation) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(gen.prompts)
    async for event in gen.events():
        if event.output.finished:
            finals[event.index] = event.output
    return [out for out in finals if out is not None]


async def _disconnected(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_or_abort(gen: Generation, raw: Request) -> list[RequestOutput]:
    """Every choice's final output, or ClientDisconnected (after aborting) if the client left."""
    collect = asyncio.ensure_future(_final_outputs(gen))
    watch = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():
            collect.cancel()
            gen.close()
    if not collect.done():
        raise ClientDisconnected()
    return collect.result()
