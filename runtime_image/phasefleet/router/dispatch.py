"""One generation request through the router: pick a worker, retry before the first token,
relay the answer.

A request goes to the best worker by the policy. Until its first token is on the way to the
client, any failure (refused connection, reset, 5xx, 503 draining, an in-band error, a stream
that ends early) sends it to the next worker, at most `max_attempts` workers in all; a 429 does
too, and if every worker tried was full the client gets 429 with Retry-After. A 4xx other than
429 is the request's fault: passed through unchanged, not retried. Once a token has been sent,
a failure ends that stream with an error event and `data: [DONE]`; nothing else is touched.

Pools: aggregated mode has one, `worker`. In disaggregated mode the router knows `prefill` and
`decode`: a request goes to a decode worker, with the prefill worker picked for it (prefix
affinity balanced with prompt-token backlog) and the internal token in two headers; the decode
worker runs the KV hand-off itself, or prefills locally when its cache already holds most of
the prompt (docs/architecture.md "Prefill to decode hand-off"). With no ready prefill worker the
decode worker prefills every prompt itself.

A request whose `model` is a LoRA adapter goes only to workers that have it loaded (each says so
on /metrics), and its prompt to a prefill worker that has it, or to none (the decode worker
prefills it); an adapter no worker of the pool has goes anywhere, and the worker's 404 names what
it serves.

An embedding (/v1/embeddings) is a prompt and nothing after it: in disaggregated mode it goes to
a prefill worker (a decode worker where none is ready), with no hand-off.

A request that finds no ready worker in the generation pool (a pool scaled to zero, waking) is
held until one is ready, within the bounds of `phasefleet.router.hold`; past them it gets 503
with Retry-After.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from phasefleet.api.contract import (
    INTERNAL_TOKEN_HEADER,
    LATE_AFTER_HEADER,
    PREFILL_BACKLOG_HEADER,
    PREFILL_SPEED_HEADER,
    PREFILL_URL_HEADER,
    TPOT_TARGET_HEADER,
)
from phasefleet.router.adapters import FleetAdapters
from phasefleet.router.config import RouterConfig
from phasefleet.router.hold import Held, HeldRequests
from phasefleet.router.metrics import RouterMetrics, StreamTimer
from phasefleet.router.policy import (
    Candidate,
    PrefixIndex,
    prefill_backlog_s,
    prefix_chunks,
    rank,
    rank_prefill,
)
from phasefleet.router.pool import WorkerPool, WorkerState
from phasefleet.router.upstream import (
    Event,
    Upstream,
    classify,
    error_message,
    event_data,
    sse_events,
)
from phasefleet.server.errors import APIError

logger = logging.getLogger(__name__)

RESPONSES_PATH = "/v1/responses"
EMBEDDINGS_PATH = "/v1/embeddings"
# generate()'s
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", RESPONSES_PATH, EMBEDDINGS_PATH)
DEFAULT_RETRY_AFTER = 1  # seconds, when a worker's 429 says nothing
HELD_RETRY_AFTER = 5  # seconds, after a hold that no worker ended (the pool is still waking)
PASSED_HEADERS = ("content-type", "retry-after")  # kept from a worker's error answer


def forward_headers(config: RouterConfig, prefill: Candidate | None) -> dict[str, str]:
    """What a generation request is forwarded with besides its body: the service's TTFT target
    (late prompts last); with a prefill worker, its URL and the service's token, its backlog and
    throughput once measured, and the TPOT target that bounds the decode worker's own prefills."""
    headers = {"content-type": "application/json"}
    if config.late_after_ms is not None:
        headers[LATE_AFTER_HEADER] = str(config.late_after_ms)
    if prefill is None or not config.internal_token:
        return headers
    headers[PREFILL_URL_HEADER] = prefill.url
    headers[INTERNAL_TOKEN_HEADER] = config.internal_token
    if config.tpot_target_ms is not None:
        headers[TPOT_TARGET_HEADER] = str(config.tpot_target_ms)
    backlog_s = prefill_backlog_s(prefill)
    if backlog_s is not None and prefill.prefill_rate:  # a backlog implies the rate
        headers[PREFILL_BACKLOG_HEADER] = f"{backlog_s * 1000:.0f}"
        headers[PREFILL_SPEED_HEADER] = f"{prefill.prefill_rate:.0f}"
    return headers


class _Retry(Exception):
    """This worker failed the request before its first token; try another."""

    def __init__(self, reason: str, retry_after: int | None = None, answer: Response | None = None):
        super().__init__(reason)
        self.retry_after = retry_after  # set when the worker answered 429
        self.answer = answer  # the worker's own 5xx answer, passed on if no worker succeeds


class _Relay(StreamingResponse):
    """Runs `on_close` however the response ends, even if the client left before the body
    started (then the body generator never runs, so its `finally` cannot be relied on)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Any]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def error_event(message: str, path: str) -> bytes:
    """The in-band error that ends a stream the worker failed: OpenAI's `error` event on
    /v1/responses, else an error chunk and [DONE]."""
    err = APIError(500, message, type="internal_server_error", code="worker_failed")
    if path == RESPONSES_PATH:
        body = {"type": "error", **err.body()["error"]}
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    return f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()


@dataclass(frozen=True)
class RequestKey:
    """What the router reads of a generation request's body (the worker validates the rest)."""

    model: str | None  # the `model` field: the base model's served name or a LoRA adapter's
    prompt: str  # what a prefix cache keys on: the prompt after the model's name ('' if none)
    priority: int = 0  # vLLM's `priority` (lower first): the order held requests are released


def request_key(body: bytes) -> RequestKey:
    """The body's model and prefix key. The key starts with the model, since a LoRA adapter's
    KV is its own (docs/worker.md)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return RequestKey(None, "")
    if not isinstance(payload, dict):
        return RequestKey(None, "")
    model = payload.get("model") if isinstance(payload.get("model"), str) else None
    rank = payload.get("priority", 0)
    priority = rank if isinstance(rank, int) and not isinstance(rank, bool) else 0
    prompt = payload.get("messages", payload.get("prompt", payload.get("input")))
    if not prompt:
        return RequestKey(model, "", priority)
    head = f"{model}\n" if model is not None else ""
    if isinstance(prompt, str):
        return RequestKey(model, head + prompt, priority)
    # A JSON dump keeps prefixes: a conversation that grows by messages dumps to a longer text.
    return RequestKey(model, head + json.dumps(prompt, separators=(",", ":")), priority)


class Router:
    def __init__(
        self,
        config: RouterConfig,
        pools: dict[str, WorkerPool],
        upstream: Upstream,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.validate()
        if "worker" not in pools and "decode" not in pools:
            raise ValueError(f"pools must include 'worker' or 'decode', got {sorted(pools)}")
        self.config = config
        self.pools = pools
        self.upstream = upstream
        self.metrics = metrics
        self.clock = clock
        self.prefix_index = PrefixIndex()  # the generation pool's workers
        self.prefill_index = PrefixIndex()  # the prefill pool's workers
        self.turn = 0  # rotation counter for round-robin and tie-breaks
        # runtime LoRA adapters loaded through here
        self.adapters = FleetAdapters(upstream, config.own_authorization())
        self.held = HeldRequests(
            config.hold_seconds, config.max_held_requests, on_change=metrics.set_held
        )
        for name in pools:
            metrics.set_held(name, 0)

    @property
    def generation_pool(self) -> WorkerPool:
        """The pool requests are sent to: `worker` (aggregated) or `decode`."""
        return self.pools.get("worker") or self.pools["decode"]

    async def refresh(self) -> None:
        for name, pool in self.pools.items():
            gone = await pool.refresh()
            for url in gone:
                self.prefix_index.forget(url)
                self.prefill_index.forget(url)
            self.adapters.forget(gone)
            if pool.ready_count():
                released = self.held.release(name)
                if released:
                    logger.info("%s has a ready worker: %d held requests go", name, released)
        self.adapters.reconcile(self.ready_workers(), self.clock())

    def ready_workers(self) -> list[WorkerState]:
        """Every pool's ready workers (a worker in two pools once)."""
        unique = {s.url: s for pool in self.pools.values() for s in pool.ready()}
        return list(unique.values())

    def loaded_adapters(self) -> frozenset[str]:
        """The LoRA adapters some ready worker of any pool has loaded."""
        return frozenset[str]().union(*(p.loaded_adapters() for p in self.pools.values()))

    def choose_prefill(self, chunks: list[int], model: str | None = None) -> Candidate | None:
        """The prefill worker for a request in disaggregated mode; None: the decode worker
        prefills it (no prefill pool, none ready, no token to authorize the hand-off, or the
        request's LoRA adapter loaded on no prefill worker)."""
        pool = self.pools.get("prefill")
        if pool is None or not self.config.internal_token:
            return None
        adapter = model if model is not None and model in self.loaded_adapters() else None
        candidates = pool.candidates(self.clock(), adapter=adapter)
        if not candidates:
            return None
        matched = self.prefill_index.match(chunks) if chunks else {}
        url = rank_prefill(self.config.policy, candidates, self.turn, matched)[0]
        if chunks:
            self.prefill_index.record(chunks, url)
        return next(c for c in candidates if c.url == url)

    def choose(
        self, pool: WorkerPool, chunks: list[int], tried: set[str], adapter: str | None = None
    ) -> str | None:
        candidates = pool.candidates(self.clock(), exclude=tried, adapter=adapter)
        if not candidates:
            return None
        matched = (
            self._index(pool).match(chunks)
            if chunks and self.config.policy == "prefix-aware"
            else None
        )
        self.turn += 1
        return rank(self.config.policy, candidates, self.turn, matched)[0]

    async def generate(
        self, path: str, body: bytes, arrival: float, authorization: dict[str, str] | None = None
    ) -> Response:
        """POST `path` (GENERATION_PATHS) with the client's raw body and `authorization`
        header."""
        embedding = path == EMBEDDINGS_PATH
        pool = self._embedding_pool() if embedding else self.generation_pool
        key = request_key(body)
        if not pool.candidates(self.clock()):
            held = await self.held.wait(pool.name, key.priority)
            if held is Held.FULL or held is Held.TIMED_OUT:
                return self._not_woken(pool, held)
        affinity = self.config.policy == "prefix-aware" or "prefill" in self.pools
        chunks = prefix_chunks(key.prompt) if affinity else []
        prefill = None if embedding else self.choose_prefill(chunks, key.model)
        headers = forward_headers(self.config, prefill)
        headers.update(authorization or {})
        # A LoRA adapter's requests go only to the workers that have it; where none does, to
        # any (its 404 names what the worker serves).
        model = key.model
        adapter = model if model is not None and pool.has_adapter(model) else None
        tried: set[str] = set()
        retries: list[_Retry] = []
        while len(tried) < self.config.max_attempts:
            url = self.choose(pool, chunks, tried, adapter)
            if url is None:
                break
            if tried:
                self.metrics.retries.inc()
            tried.add(url)
            try:
                return await self._attempt(pool, url, path, body, headers, arrival, chunks)
            except _Retry as retry:
                logger.info("worker %s failed before the first token: %s", url, retry)
                retries.append(retry)
        return self._give_up(pool, retries)

    def _index(self, pool: WorkerPool) -> PrefixIndex:
        """Where `pool`'s prompts are remembered: the prefill pool keeps its own."""
        return self.prefill_index if pool.name == "prefill" else self.prefix_index

    def _embedding_pool(self) -> WorkerPool:
        """The prefill pool while it has a worker to take one, else the generation pool."""
        prefill = self.pools.get("prefill")
        if prefill is not None and prefill.candidates(self.clock()):
            return prefill
        return self.generation_pool

    def _not_woken(self, pool: WorkerPool, held: Held) -> Response:
        if held is Held.FULL:
            why = (
                f"{self.held.max_held} requests are held for it, none after this one in line"
                " (by priority, then arrival)"
            )
        else:
            why = f"none became ready within {self.held.hold_seconds:g} s"
        return APIError(
            503,
            f"no ready worker in {pool.describe()} and {why}; it may be waking from zero, "
            "retry later",
            type="service_unavailable",
            code="no_ready_worker",
            headers={"Retry-After": str(HELD_RETRY_AFTER)},
        ).response()

    def _give_up(self, pool: WorkerPool, retries: list[_Retry]) -> Response:
        full = [r.retry_after for r in retries if r.retry_after is not None]
        if full:
            return APIError(
                429,
                f"every worker tried in {pool.describe()} is at capacity; retry later",
                type="rate_limit_error",
                code="overloaded",
                headers={"Retry-After": str(max(full))},
            ).response()
        if retries and retries[-1].answer is not None:
            return retries[-1].answer
        if retries:
            message = f"no worker in {pool.describe()} could serve the request: {retries[-1]}"
            code = "workers_failed"
        else:
            message = f"no ready worker in {pool.describe()}"
            if pool.discovery_error:
                message += f"; discovery failed: {pool.discovery_error}"
            code = "no_ready_worker"
        return APIError(
            503,
            message,
            type="service_unavailable",
            code=code,
            headers={"Retry-After": str(DEFAULT_RETRY_AFTER)},
        ).response()

    async def _attempt(
        self,
        pool: WorkerPool,
        url: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        arrival: float,
        chunks: list[int],
    ) -> Response:
        pool.acquire(url)
        handed_off = False  # the relay owns the response and the in-flight count
        resp: httpx.Response | None = None
        try:
            try:
                resp = await self.upstream.post(url + path, body, headers)
                if resp.status_code != 200:
                    return await self._not_ok(pool, url, resp)
                if chunks and self.config.policy == "prefix-aware":
                    self._index(pool).record(chunks, url)
                if resp.headers.get("content-type", "").startswith("text/event-stream"):
                    relay = await self._open_stream(pool, url, resp, arrival, path)
                    handed_off = True
                    return relay
                content = await resp.aread()
            except httpx.HTTPError as exc:
                if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
                    pool.mark_down(url)
                raise _Retry(f"{type(exc).__name__}: {exc}") from exc
            self.metrics.e2e_request_latency.observe(self.clock() - arrival)
            return Response(content, 200, media_type=resp.headers.get("content-type"))
        finally:
            if not handed_off:
                pool.release(url)
                if resp is not None:
                    await resp.aclose()

    async def _not_ok(self, pool: WorkerPool, url: str, resp: httpx.Response) -> Response:
        content = await resp.aread()
        headers = {k: v for k, v in resp.headers.items() if k.lower() in PASSED_HEADERS}
        answer = Response(content, resp.status_code, headers=headers)
        status = resp.status_code
        if status == 429:
            retry_after = _seconds(resp.headers.get("retry-after"))
            pool.mark_busy(url, self.clock() + retry_after)
            raise _Retry("429 at capacity", retry_after=retry_after)
        if status == 503:
            pool.mark_down(url)
            raise _Retry(f"503 {error_message(content)}")
        if status >= 500:
            raise _Retry(f"{status} {error_message(content)}", answer=answer)
        return answer  # the request's own fault: the client sees the worker's answer

    async def _open_stream(
        self, pool: WorkerPool, url: str, resp: httpx.Response, arrival: float, path: str
    ) -> Response:
        """Reads up to the first token event (retryable until then), then relays the rest."""
        events = sse_events(resp)
        head: list[bytes] = []
        kind = Event.OTHER
        try:
            while kind not in (Event.TOKEN, Event.DONE):
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    raise _Retry("the stream ended before its first token") from None
                kind = classify(event)
                if kind is Event.ERROR:
                    raise _Retry(f"in-band error {error_message(event_data(event))}")
                head.append(event)
        except BaseException:
            await events.aclose()
            raise
        timer = StreamTimer(self.metrics, arrival)
        if kind is Event.TOKEN:
            timer.token(self.clock())

        async def relay() -> AsyncIterator[bytes]:
            yield b"".join(head)
            if kind is Event.DONE:
                timer.finished()
                return
            failed = False  # the worker sent an in-band error: not a finished request
            try:
                async for event in events:
                    seen = classify(event)
                    if seen is Event.TOKEN:
                        timer.token(self.clock())
                    failed = failed or seen is Event.ERROR
                    yield event
                    if seen is Event.DONE:
                        if not failed:
                            timer.finished()
                        return
                reason = "the stream ended without [DONE]"
            except httpx.HTTPError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            logger.warning("worker %s failed mid-stream: %s", url, reason)
            yield error_event(f"the worker serving this stream failed: {reason}", path)

        closed = False

        async def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                pool.release(url)
                await events.aclose()
                await resp.aclose()

        return _Relay(relay(), close)


def _seconds(value: str | None) -> int:
    try:
        return max(1, int(value)) if value else DEFAULT_RETRY_AFTER
    except ValueError:
        return DEFAULT_RETRY_AFTER
