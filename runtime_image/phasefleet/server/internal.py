"""The worker's /internal/* endpoints: the prefill side of the KV hand-off.

    POST   /internal/prefill          prompt token ids + sampling -> first token + KV reference
    GET    /internal/kv/{request_id}  the leased KV, raw bytes in wire layout, streamed
    DELETE /internal/kv/{request_id}  end the lease (the decode worker has its copy)

Every call needs the service's internal token in the X-PhaseFleet-Internal-Token header; a
worker started without a token refuses them all. Without it: 401, and nothing changes.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from phasefleet.api.contract import INTERNAL_TOKEN_HEADER
from phasefleet.engine.sampling_params import MAX_LOGPROBS, SEED_MAX, SEED_MIN, SamplingParams
from phasefleet.server.async_engine import EngineOptions
from phasefleet.server.errors import APIError
from phasefleet.server.generation import Generation, checked


class PrefillRequest(BaseModel):
    """One prompt to prefill; the sampling fields choose the first token."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=200)
    prompt_token_ids: list[int] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


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


def internal_routes() -> APIRouter:
    routes = APIRouter(prefix="/internal", dependencies=[Depends(check_token)])

    @routes.post("/prefill")
    async def prefill(body: PrefillRequest, request: Request) -> JSONResponse:
        state = request.app.state.worker
        state.check_accepting()
        ids = state.check_token_ids(body.prompt_token_ids, "prompt_token_ids")
        params = checked(
            SamplingParams(
                max_tokens=body.max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                logprobs=body.logprobs,
            )
        )
        gen = Generation(
            state.engine,
            state.metrics,
            [ids],
            [params],
            time.monotonic(),
            "prompt_token_ids",
            request_id=f"prefill-{body.request_id}",
            options=[EngineOptions(prefill_only=True)],
        )
        await gen.start()
        last = None
        async for event in gen.events():
            last = event.output
        if last is None or not last.output_token_ids:
            raise APIError(500, "the prefill produced no token", type="server_error")
        kv = None
        if last.finish_reason == "handoff":
            kv = {
                "request_id": last.request_id,
                "num_tokens": last.num_prompt_tokens,
                "layout": state.engine.kv_layout.to_wire(),
            }
        first = None
        if last.logprobs:
            first = {"logprob": last.logprobs[0].logprob, "top": last.logprobs[0].top}
        return JSONResponse(
            {
                "first_token_id": last.output_token_ids[0],
                "first_logprob": first,
                "finish_reason": last.finish_reason,
                "num_prompt_tokens": last.num_prompt_tokens,
                "num_cached_tokens": last.num_cached_tokens,
                "kv": kv,
            }
        )

    @routes.get("/kv/{request_id}")
    async def pull(request_id: str, request: Request) -> Response:
        state = request.app.state.worker
        source = state.engine.kv_source()
        lease = None if source is None else source.pin_kv(request_id)
        if source is None or lease is None:
            raise APIError(
                404,
                f"no KV is leased for {request_id!r} (unknown, released or expired)",
                code="lease_not_found",
            )
        size = state.engine.kv_layout.payload_bytes(len(lease.block_ids))

        def chunks() -> Iterator[memoryview]:  # Starlette iterates it in a thread pool
            try:
                yield from source.read_kv(lease)  # a memoryview: no extra copy
            finally:
                source.unpin_kv(lease)

        headers = {"content-length": str(size), "x-kv-num-tokens": str(lease.num_tokens)}
        return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)

    @routes.delete("/kv/{request_id}")
    async def release(request_id: str, request: Request) -> Response:
        state = request.app.state.worker
        if not await state.engine.release_kv(request_id):
            raise APIError(
                404,
                f"no KV is leased for {request_id!r} (unknown, released or expired)",
                code="lease_not_found",
            )
        return Response(status_code=204)

    return routes
