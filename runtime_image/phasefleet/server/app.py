"""The worker's FastAPI app: OpenAI endpoints, /health (readiness), /health/live (liveness),
/metrics.

The engine starts in the app's lifespan (it needs the running event loop) and loads the model in
its own thread, so /health answers 503 while the model loads instead of refusing connections.
/health says whether to send this worker work; /health/live only whether to restart it: it stays
200 while loading and draining, and fails when the engine is broken or stalled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from phasefleet.server.auth import ApiKeyAuth
from phasefleet.server.body_limit import BodyLimit
from phasefleet.server.chat import create_chat_completion
from phasefleet.server.completions import create_completion
from phasefleet.server.embeddings import EmbeddingRequest, create_embeddings
from phasefleet.server.errors import install_error_handlers
from phasefleet.server.internal import internal_routes
from phasefleet.server.lora_admin import lora_admin_routes
from phasefleet.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    ResponsesRequest,
)
from phasefleet.server.responses import ClientDisconnected
from phasefleet.server.responses_api import create_response
from phasefleet.server.state import WorkerState
from phasefleet.server.tokenize import tokenizer_routes

# Status code logged for a request whose client left before the answer (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


def build_app(state: WorkerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(state.engine.stop)
            state.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="PhaseFleet worker", lifespan=lifespan)
    app.state.worker = state
    install_error_handlers(app)
    if state.max_request_bytes is not None:
        app.add_middleware(BodyLimit, max_bytes=state.max_request_bytes)
    if state.api_keys:
        app.add_middleware(ApiKeyAuth, keys=state.api_keys)  # outermost: checked first

    async def on_client_gone(_: Request, __: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    app.add_exception_handler(ClientDisconnected, on_client_gone)
    app.include_router(internal_routes())
    app.include_router(tokenizer_routes(state))
    if state.runtime_lora:
        app.include_router(lora_admin_routes())

    @app.get("/health")
    async def health() -> JSONResponse:
        engine = state.engine
        problem = engine.liveness()
        if problem is not None:
            status = problem
        elif state.draining:
            status = "draining"
        elif not engine.ready:
            status = "loading"
        else:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/health/live")
    async def live() -> JSONResponse:
        problem = state.engine.liveness()
        if problem is not None:
            return JSONResponse({"status": problem}, status_code=503)
        return JSONResponse({"status": "alive"})

    @app.get("/v1/models")
    async def models() -> ModelList:
        base, max_len = state.served_model_name, state.engine.max_model_len or None
        cards = [ModelCard(id=base, created=state.started_at, root=base, max_model_len=max_len)]
        cards += [
            ModelCard(
                id=name, created=state.started_at, root=name, parent=base, max_model_len=max_len
            )
            for name in state.lora_names
        ]
        return ModelList(data=cards)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(req, raw, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(req, raw, state)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Response:
        return await create_embeddings(req, raw, state)

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request) -> Response:
        return await create_response(req, raw, state)

    return app
