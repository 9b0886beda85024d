"""Loading and unloading LoRA adapters while the worker runs (vLLM's endpoints and bodies), with
`--enable-runtime-lora` only: POST /v1/load_lora_adapter {lora_name, lora_path} and
POST /v1/unload_lora_adapter {lora_name}. The adapter goes into a free slot of `--max-loras`
on the engine thread, between steps; an adapter still in use is not unloaded (409)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from phasefleet.engine.lora import LoraError
from phasefleet.server.adapters import parse_lora_modules, resolve_adapters
from phasefleet.server.errors import APIError, bad_request
from phasefleet.server.hub import ModelFetchError
from phasefleet.server.openai_protocol import (
    LORA_ALREADY_LOADED,
    LORA_IN_USE,
    LORA_NOT_FOUND,
    LoadLoraAdapter,
    UnloadLoraAdapter,
)
from phasefleet.server.state import WorkerState

logger = logging.getLogger(__name__)


def lora_admin_routes() -> APIRouter:
    routes = APIRouter(prefix="/v1")

    @routes.post("/load_lora_adapter", response_class=PlainTextResponse)
    async def load(body: LoadLoraAdapter, request: Request) -> str:
        state: WorkerState = request.app.state.worker
        name = body.lora_name
        if name in state.lora_names:
            raise APIError(
                400,
                f"LoRA adapter '{name}' is already loaded",
                param="lora_name",
                code=LORA_ALREADY_LOADED,
            )
        try:
            source = parse_lora_modules([f"{name}={body.lora_path}"], state.served_model_name)
            folders = await asyncio.to_thread(resolve_adapters, source)
            await state.engine.call(lambda engine: engine.load_lora(name, folders[name]))
        except (ValueError, ModelFetchError) as exc:  # LoraError is a ValueError
            raise bad_request(
                str(exc).replace("--lora-modules", "lora_path"), "lora_path"
            ) from None
        state.lora_names = (*state.lora_names, name)
        logger.info("LoRA adapter %s loaded from %s", name, body.lora_path)
        return f"Success: LoRA adapter '{name}' added successfully."

    @routes.post("/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload(body: UnloadLoraAdapter, request: Request) -> str:
        state: WorkerState = request.app.state.worker
        name = body.lora_name
        if name not in state.lora_names:
            raise APIError(
                404, f"LoRA adapter '{name}' is not loaded", param="lora_name", code=LORA_NOT_FOUND
            )
        try:
            await state.engine.call(lambda engine: engine.unload_lora(name))
        except LoraError as exc:
            raise APIError(409, str(exc), param="lora_name", code=LORA_IN_USE) from None
        state.lora_names = tuple(n for n in state.lora_names if n != name)
        logger.info("LoRA adapter %s unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    return routes
