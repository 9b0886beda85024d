"""Runtime LoRA adapters across the fleet: the router's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's bodies) go to every ready worker of every pool, and the router
loads what it loaded onto workers that join later (a scaled-up or restarted worker starts with
its `--lora-modules` only). Workers need `--enable-runtime-lora`; without it they answer 404
and so does the router.

What the router loaded is its own memory: a restarted router, or another replica of it, does not
know it, and a worker that joins then gets only its start-up adapters. Adapters every replica
must serve belong in `--lora-modules` (the CRD's `spec.lora`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
from fastapi.responses import PlainTextResponse, Response

from phasefleet.router.pool import WorkerState
from phasefleet.router.upstream import Upstream, error_message
from phasefleet.server.errors import APIError
from phasefleet.server.openai_protocol import (
    LORA_ALREADY_LOADED,
    LORA_NOT_FOUND,
    LoadLoraAdapter,
    UnloadLoraAdapter,
)

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 300.0  # one worker's load: reads the adapter's weights, maybe from the Hub
RETRY_S = 30.0  # before a failed load onto a joining worker is tried again
UNREACHABLE = 0  # WorkerAnswer.status of a worker that could not be reached
LOAD_PATH = "/v1/load_lora_adapter"  # the workers' endpoints (server/lora_admin.py)
UNLOAD_PATH = "/v1/unload_lora_adapter"


@dataclass(frozen=True)
class WorkerAnswer:
    url: str
    status: int  # HTTP status; UNREACHABLE when the request failed
    body: bytes

    def code(self) -> str | None:
        """The `code` of an OpenAI-shaped error body."""
        try:
            return str(json.loads(self.body)["error"]["code"])
        except (ValueError, KeyError, TypeError):
            return None

    def has_adapter(self) -> bool:
        """To a load: the worker has the adapter now (loaded, or it had it already)."""
        return self.status == 200 or self.code() == LORA_ALREADY_LOADED

    def describe(self) -> str:
        if self.status == UNREACHABLE:
            return f"{self.url}: unreachable ({self.body.decode(errors='replace')})"
        return f"{self.url}: {self.status} {error_message(self.body)}"


class FleetAdapters:
    def __init__(self, upstream: Upstream, own_authorization: dict[str, str]) -> None:
        self.upstream = upstream
        self.own_authorization = own_authorization  # for loads onto joining workers
        self.sources: dict[str, str] = {}  # adapter name -> lora_path, loaded through here
        self._next_try: dict[tuple[str, str], float] = {}  # (url, name) -> clock; inf: loading
        self._loads: dict[tuple[str, str], asyncio.Task[None]] = {}  # loads onto joiners

    async def _post(
        self, url: str, path: str, body: str, authorization: dict[str, str]
    ) -> WorkerAnswer:
        try:
            answer = await self.upstream.client.post(
                url + path,
                content=body,
                headers={"content-type": "application/json", **authorization},
                timeout=LOAD_TIMEOUT_S,
            )
        except httpx.HTTPError as exc:
            return WorkerAnswer(url, UNREACHABLE, f"{type(exc).__name__}: {exc}".encode())
        return WorkerAnswer(url, answer.status_code, answer.content)

    async def load(
        self, body: LoadLoraAdapter, workers: list[WorkerState], authorization: dict[str, str]
    ) -> Response:
        """Loads the adapter on every worker (with the client's `authorization` header);
        remembered once a worker has newly loaded it."""
        if not workers:
            return _no_worker()
        payload = body.model_dump_json()
        answers = await asyncio.gather(
            *(self._post(w.url, LOAD_PATH, payload, authorization) for w in workers)
        )
        name = body.lora_name
        added = [a for a in answers if a.status == 200]
        loaded = [a for a in answers if a.has_adapter()]
        failed = [a for a in answers if a not in loaded]
        if not added:  # loaded nowhere new: each worker's own answer (already loaded, a bad path)
            return _failure([a for a in answers if a.status != 200])
        self.sources[name] = body.lora_path
        have = {a.url for a in loaded}
        for worker in workers:
            if worker.url in have:
                worker.adapters = worker.adapters | {name}
        message = f"Success: LoRA adapter '{name}' added on {len(loaded)} of {len(answers)} workers"
        if failed:
            logger.warning("LoRA adapter %s not loaded on: %s", name, _described(failed))
            message += f"; not on {_described(failed)} (tried again every {RETRY_S:g} s)"
        logger.info("LoRA adapter %s loaded from %s on %d workers", name, body.lora_path, len(have))
        return PlainTextResponse(message + ".")

    async def unload(
        self, body: UnloadLoraAdapter, workers: list[WorkerState], authorization: dict[str, str]
    ) -> Response:
        """Unloads the adapter from every worker and forgets it, even where a worker refused
        (409 while its requests run): the client retries, and nothing loads it again."""
        name = body.lora_name
        self.sources.pop(name, None)
        for key in [k for k in self._loads if k[1] == name]:
            self._loads.pop(key).cancel()
        for key in [k for k in self._next_try if k[1] == name]:
            del self._next_try[key]
        if not workers:
            return _no_worker()
        payload = body.model_dump_json()
        answers = await asyncio.gather(
            *(self._post(w.url, UNLOAD_PATH, payload, authorization) for w in workers)
        )
        removed = {a.url for a in answers if a.status == 200}
        absent = {a.url for a in answers if a.status == 404 and a.code() == LORA_NOT_FOUND}
        for worker in workers:
            if worker.url in removed | absent:
                worker.adapters = worker.adapters - {name}
        failed = [a for a in answers if a.url not in removed | absent]
        if failed:
            return _failure(failed, done=f"removed from {len(removed)} workers")
        if not removed:
            return APIError(
                404,
                f"LoRA adapter '{name}' is not loaded on any worker",
                param="lora_name",
                code=LORA_NOT_FOUND,
            ).response()
        logger.info("LoRA adapter %s unloaded from %d workers", name, len(removed))
        return PlainTextResponse(
            f"Success: LoRA adapter '{name}' removed from {len(removed)} workers."
        )

    def reconcile(self, workers: Iterable[WorkerState], now: float) -> None:
        """Starts loading each remembered adapter onto the ready workers that lack it (one load
        per worker and adapter at a time; a failed one is tried again after RETRY_S)."""
        for worker in workers:
            for name, path in self.sources.items():
                key = (worker.url, name)
                if name in worker.adapters or self._next_try.get(key, 0.0) > now:
                    continue
                self._next_try[key] = math.inf
                body = LoadLoraAdapter(lora_name=name, lora_path=path)
                self._loads[key] = asyncio.create_task(self._load_onto(worker, body, now))

    async def _load_onto(self, worker: WorkerState, body: LoadLoraAdapter, now: float) -> None:
        key = (worker.url, body.lora_name)
        try:
            payload = body.model_dump_json()
            answer = await self._post(worker.url, LOAD_PATH, payload, self.own_authorization)
        finally:
            self._loads.pop(key, None)
        if answer.has_adapter():
            self._next_try.pop(key, None)
            worker.adapters = worker.adapters | {body.lora_name}
            logger.info("LoRA adapter %s loaded on %s, which joined", body.lora_name, worker.url)
        else:
            self._next_try[key] = now + RETRY_S
            logger.warning("loading LoRA adapter %s failed: %s", body.lora_name, answer.describe())

    def forget(self, urls: Iterable[str]) -> None:
        """Workers that left the pools: no retries kept for them."""
        gone = set(urls)
        for key in [k for k in self._next_try if k[0] in gone]:
            del self._next_try[key]

    async def aclose(self) -> None:
        tasks = list(self._loads.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _described(answers: list[WorkerAnswer]) -> str:
    return "; ".join(a.describe() for a in answers)


def _no_worker() -> Response:
    return APIError(
        503,
        "no ready worker to load or unload the LoRA adapter on",
        type="service_unavailable",
        code="no_ready_worker",
        headers={"Retry-After": "1"},
    ).response()


def _failure(failed: list[WorkerAnswer], done: str | None = None) -> Response:
    """The answer when workers failed: their own status when they agree on a 4xx (a bad path,
    an adapter in use), 502 otherwise; the message names each worker and what it said."""
    statuses = {a.status for a in failed}
    status = statuses.pop() if len(statuses) == 1 else 502
    if not 400 <= status < 500:
        status = 502
    codes = {a.code() for a in failed}
    code = codes.pop() if len(codes) == 1 else None
    messages = {error_message(a.body) for a in failed}
    if status != 502 and len(messages) == 1 and done is None:
        message = messages.pop()  # every worker said the same: a bad path, a bad name
    else:
        message = _described(failed)
    if done is not None:
        message = f"{done}; failed on {message}"
    kind = "invalid_request_error" if status < 500 else "bad_gateway"
    return APIError(status, message, type=kind, code=code).response()
