"""The router's FastAPI app: the worker's OpenAI surface, /tokenize, /detokenize, /version,
/health and /metrics.

Generation and tokenizer bodies are not validated here: they go to a worker as received, and the
worker's 400/404 comes back unchanged, so the router and the workers can never disagree on what a
valid request is; /openapi.json declares the worker's request bodies all the same
(phasefleet.router.openapi). /v1/models is a worker's list, with the LoRA adapters other workers
of the pool have loaded and the router's own start as `created`, so it is the same whichever
worker answers; /version is the router's own. /v1/load_lora_adapter and /v1/unload_lora_adapter
go to every worker (phasefleet.router.adapters).

The pools refresh in a background task started by the app's lifespan; the first
refresh completes before the router takes requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from phasefleet.router.adapters import LOAD_PATH, UNLOAD_PATH
from phasefleet.router.dispatch import GENERATION_PATHS, Router
from phasefleet.router.openapi import publish_worker_bodies
from phasefleet.router.pool import WorkerPool
from phasefleet.server.auth import ApiKeyAuth
from phasefleet.server.errors import APIError, install_error_handlers
from phasefleet.server.openai_protocol import LoadLoraAdapter, UnloadLoraAdapter
from phasefleet.server.tokenize import package_version

logger = logging.getLogger(__name__)

# Status code logged for a request whose client left before the answer (nginx's convention).
CLIENT_CLOSED_REQUEST = 499
WORKER_QUERY_TIMEOUT = 5.0  # seconds for a worker's /v1/models or tokenizer answer


async def _refresh_forever(router: Router) -> None:
    # Rounds start every interval however long the last one took (a slow poll times out after
    # a second), so a change in the pools is seen within two intervals.
    interval = router.config.refresh_interval
    next_round = time.monotonic() + interval
    while True:
        await asyncio.sleep(max(0.0, next_round - time.monotonic()))
        next_round = max(next_round + interval, time.monotonic())
        try:
            await router.refresh()
        except Exception:  # one bad round must not stop discovery for good
            logger.exception("refreshing the worker pools failed")


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _unless_client_leaves(raw: Request, work: Awaitable[Response]) -> Response:
    """The answer, or 499 after cancelling `work` if the client left first. Cancelling closes
    the connection to the worker, which aborts the request there and frees its KV blocks. Once
    a stream is open, Starlette watches for the disconnect itself."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


def authorization(raw: Request) -> dict[str, str]:
    """The client's Authorization header, passed on to the workers (server/auth.py)."""
    value = raw.headers.get("authorization")
    return {} if value is None else {"authorization": value}


async def _from_a_worker(
    router: Router, path: str, body: bytes | None, auth: dict[str, str]
) -> httpx.Response | None:
    """The answer of the first ready worker of the generation pool that answers `path` (GET, or
    POST `body`) below 500: for what every worker answers alike (its model, its tokenizer)."""
    for candidate in router.generation_pool.candidates(router.clock()):
        url = f"{candidate.url}{path}"
        with contextlib.suppress(httpx.HTTPError):
            if body is None:
                answer = await router.upstream.client.get(
                    url, headers=auth, timeout=WORKER_QUERY_TIMEOUT
                )
            else:
                headers = {"content-type": "application/json", **auth}
                answer = await router.upstream.client.post(
                    url, content=body, headers=headers, timeout=WORKER_QUERY_TIMEOUT
                )
            if answer.status_code < 500:
                return answer
    return None


def _add_adapter_cards(listing: dict[str, Any], pool: WorkerPool) -> None:
    """Adds a card, like the answering worker's base model card, for each LoRA adapter that
    only other workers of the pool have loaded."""
    cards = listing.get("data", [])
    base = next((c for c in cards if isinstance(c, dict) and not c.get("parent")), None)
    if base is None:
        return
    listed = {c.get("id") for c in cards if isinstance(c, dict)}
    for name in sorted(pool.loaded_adapters() - listed):
        cards.append({**base, "id": name, "root": name, "parent": base["id"]})


def _no_worker(router: Router) -> Response:
    return APIError(
        503,
        f"no ready worker in {router.generation_pool.describe()} could answer",
        type="service_unavailable",
        code="no_ready_worker",
        headers={"Retry-After": "1"},
    ).response()


def build_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.refresh()
        task = asyncio.create_task(_refresh_forever(router))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await router.adapters.aclose()
            await router.upstream.aclose()
            for pool in router.pools.values():
                await pool.discovery.aclose()

    app = FastAPI(title="PhaseFleet router", lifespan=lifespan)
    started_at = int(time.time())  # /v1/models' `created`, the same in every answer
    app.state.router = router
    install_error_handlers(app)
    if router.config.api_keys:
        app.add_middleware(ApiKeyAuth, keys=router.config.api_keys)

    @app.get("/health")
    async def health() -> JSONResponse:
        # The router is up even with no worker ready: requests then get a 503 that names the
        # pool, which says more than a Service with no endpoints.
        ready = {name: pool.ready_count() for name, pool in router.pools.items()}
        return JSONResponse({"status": "ok", "ready_workers": ready})

    @app.get("/health/live")
    async def live() -> JSONResponse:
        # Liveness: the event loop answers. Worker trouble is never a reason to restart it.
        return JSONResponse({"status": "alive"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(raw: Request) -> JSONResponse:
        answer = await _from_a_worker(router, "/v1/models", None, authorization(raw))
        if answer is not None and answer.status_code == 200:
            listing = answer.json()
            _add_adapter_cards(listing, router.generation_pool)
            for card in listing.get("data", []):
                card["created"] = started_at
            return JSONResponse(listing)
        card = {
            "id": router.config.served_model_name,
            "object": "model",
            "created": started_at,
            "owned_by": "phasefleet",
            "root": router.config.served_model_name,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": package_version()})

    async def relay(raw: Request) -> Response:
        answer = await _from_a_worker(router, raw.url.path, await raw.body(), authorization(raw))
        if answer is None:
            return _no_worker(router)
        content_type = answer.headers.get("content-type")
        return Response(answer.content, answer.status_code, media_type=content_type)

    @app.post(LOAD_PATH)
    async def load_lora_adapter(body: LoadLoraAdapter, raw: Request) -> Response:
        return await router.adapters.load(body, router.ready_workers(), authorization(raw))

    @app.post(UNLOAD_PATH)
    async def unload_lora_adapter(body: UnloadLoraAdapter, raw: Request) -> Response:
        return await router.adapters.unload(body, router.ready_workers(), authorization(raw))

    app.add_api_route("/tokenize", relay, methods=["POST"])
    app.add_api_route("/detokenize", relay, methods=["POST"])

    async def generation(raw: Request) -> Response:
        arrival = router.clock()
        body = await raw.body()
        work = router.generate(raw.url.path, body, arrival, authorization(raw))
        return await _unless_client_leaves(raw, work)

    for path in GENERATION_PATHS:
        app.add_api_route(path, generation, methods=["POST"])

    publish_worker_bodies(app)
    return app
