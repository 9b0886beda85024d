"""The worker's /internal/* endpoint: the prefill side of the KV hand-off.

    POST /internal/prefill   a PrefillRequest -> a stream of frames (server/kv_wire.py): the
                             layout, each chunk's KV as soon as a step computed it, the first
                             token the moment it is sampled, the last chunk's KV, the end

The prompt is prefilled as a prefill-only request; its KV is read out of the pool between
steps (blocks whose KV is complete are never written again while the request or its lease
holds them) and sent while the next chunk is computed. When the stream ends, or the decode
worker goes away, the blocks are let go. Every call needs the service's internal token in the
X-PhaseFleet-Internal-Token header; a worker started without a token refuses it: 401, and
nothing changes.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import APIRouter, Depends, Request

from phasefleet.api.contract import INTERNAL_TOKEN_HEADER
from phasefleet.engine.kv_cache_manager import cdiv
from phasefleet.engine.kv_transfer import KVLayout
from phasefleet.engine.outputs import RequestOutput
from phasefleet.server.async_engine import AsyncEngine, EngineOptions
from phasefleet.server.errors import APIError
from phasefleet.server.generation import Generation, checked
from phasefleet.server.kv_wire import (
    MEDIA_TYPE,
    MIN_WIRE_VERSION,
    WIRE_VERSION,
    EndFrame,
    ErrorFrame,
    FirstFrame,
    KVFrame,
    LayoutWire,
    PrefillRequest,
    StartFrame,
    encode_header,
)
from phasefleet.server.responses import GenerationStream

logger = logging.getLogger("phasefleet.handoff")

FRAME_BYTES = 16 << 20  # KV bytes per frame at most (one block more when a block is larger)
SEND_BYTES = 4 << 20  # a frame's payload is read and sent in pieces of about this much


def check_token(request: Request) -> None:
    expected = request.app.state.worker.internal_token
    given = request.headers.get(INTERNAL_TOKEN_HEADER, "")
    if not expected or not hmac.compare_digest(given.encode(), expected.encode()):
        raise APIError(
            401,
            "internal endpoints need the service's internal token "
            f"(header {INTERNAL_TOKEN_HEADER})",
            type="authentication_error",
            code="invalid_internal_token",
        )


def check_version(body: PrefillRequest) -> None:
    """This worker answers wire versions MIN_WIRE_VERSION to WIRE_VERSION; a decode worker that
    asks for another prefills locally."""
    if not MIN_WIRE_VERSION <= body.wire_version <= WIRE_VERSION:
        raise APIError(
            409,
            f"the hand-off's wire version {body.wire_version} is not one this prefill worker "
            f"answers ({MIN_WIRE_VERSION} to {WIRE_VERSION}): the decode and prefill pools run"
            " different releases; "
            "the decode worker prefills locally until both run the same image",
            param="wire_version",
            code="wire_version_mismatch",
        )


def internal_routes() -> APIRouter:
    routes = APIRouter(prefix="/internal", dependencies=[Depends(check_token)])

    @routes.post("/prefill")
    async def prefill(body: PrefillRequest, request: Request) -> GenerationStream:
        state = request.app.state.worker
        check_version(body)
        state.check_accepting()
        ids = state.check_token_ids(body.prompt_token_ids, "prompt_token_ids")
        params = checked(body.sampling())
        state.check_logit_bias(params.logit_bias)
        if params.allowed_token_ids is not None:
            state.check_token_ids(params.allowed_token_ids, "allowed_token_ids")
        for word in params.bad_words:
            state.check_token_ids(word, "bad_words")
        if params.grammar is not None:
            await state.check_grammar(params.grammar, "grammar")
        if body.lora is not None:
            state.check_lora(body.lora, "lora")
        gen = Generation(
            state.engine,
            state.metrics,
            [ids],
            [params],
            time.monotonic(),
            "prompt_token_ids",
            request_id=f"prefill-{body.request_id}",
            options=[EngineOptions(prefill_only=True)],
            late_after_s=body.late_after_s,
            lora=body.lora,
            priority=body.priority if state.scheduling_policy == "priority" else 0,
        )
        await gen.start()  # a refusal here is an HTTP error, before any frame
        layout = state.engine.kv_layout
        skip = body.skip_tokens // layout.block_size
        frames = _frames(state.engine, gen, layout, len(ids), skip)
        return GenerationStream(gen, frames, media_type=MEDIA_TYPE)

    return routes


async def _frames(
    engine: AsyncEngine, gen: Generation, layout: KVLayout, num_tokens: int, skip: int
) -> AsyncGenerator[bytes | memoryview, None]:
    """The stream: start, KV as it is computed, the first token, the rest of the KV, end."""
    num_blocks = cdiv(num_tokens, layout.block_size)
    sent = min(skip, num_blocks)
    per_frame = max(1, FRAME_BYTES // layout.block_bytes())
    yield encode_header(
        StartFrame(
            layout=LayoutWire.of(layout),
            num_prompt_tokens=num_tokens,
            num_blocks=num_blocks,
            skip_blocks=sent,
        )
    )
    last: RequestOutput | None = None
    try:
        async for event in gen.events():
            last = event.output
            if last.new_token_ids:
                yield encode_header(_first(last))
            blocks = last.kv_blocks or []
            for start in range(sent, len(blocks), per_frame):
                part = blocks[start : start + per_frame]
                nbytes = len(part) * layout.block_bytes()
                yield encode_header(KVFrame(first_block=start, num_blocks=len(part), nbytes=nbytes))
                async for piece in _read(engine, last, part):
                    yield piece
            sent = max(sent, len(blocks))
        yield encode_header(EndFrame(num_blocks=sent - min(skip, num_blocks)))
    except Exception as exc:  # anything after the start frame: say so in the stream
        logger.warning("hand-off stream of %s failed: %s", gen.request_id, exc)
        yield encode_header(ErrorFrame(reason="pull_failed", detail=" ".join(str(exc).split())))
    finally:  # the stream ended, or its reader left (GenerationStream then aborts the request,
        # which ends a lease this stream did not get to read)
        if last is not None and last.finish_reason == "handoff":
            await engine.release_kv(last.request_id)  # nothing else reads this lease


def _first(out: RequestOutput) -> FirstFrame:
    logprob = out.logprobs[0] if out.logprobs else None
    return FirstFrame(
        first_token_id=out.new_token_ids[0],
        logprob=None if logprob is None else logprob.logprob,
        top=[] if logprob is None else list(logprob.top),
        finish_reason=out.finish_reason or "handoff",
        num_cached_tokens=out.num_cached_tokens,
    )


async def _read(
    engine: AsyncEngine, out: RequestOutput, block_ids: list[int]
) -> AsyncIterator[memoryview]:
    """The blocks' KV in wire order, in pieces of SEND_BYTES read off the event loop, each
    sent before the next is read into the same memory (the transport has sent or copied it by
    then). A finished request's blocks are its lease's: pinned meanwhile, so it cannot expire
    under the read."""
    lease = engine.pin_kv(out.request_id) if out.finished else None
    if out.finished and lease is None:
        raise RuntimeError(f"the lease of {out.request_id} expired before its KV was sent")
    pieces = engine.read_kv(block_ids, SEND_BYTES)
    try:
        while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
            yield piece
    finally:
        if lease is not None:
            engine.unpin_kv(lease)
