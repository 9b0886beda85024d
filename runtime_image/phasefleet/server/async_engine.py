"""AsyncEngine: drives one LLMEngine from a single background thread for an asyncio server.

The engine is not thread-safe, so exactly one thread (the engine thread) builds it and calls
`add_request`, `abort_request`, `step` and `stats`. The event loop hands it commands through a
list guarded by a condition variable; the engine thread applies them between steps, steps while
anything is unfinished, sleeps on the condition when idle, and sends each step's outputs back
with one `loop.call_soon_threadsafe` call. Every HTTP request gets a `RequestStream`, which may
cover several engine requests (n > 1, or a batch of prompts); its events are tagged with the
choice index.

Failure policy: a fault of one request (its setup in `add_request`, its sampling or detokenizing
in a step) fails that request alone; the engine reports it and the worker answers that request
with a 500. An exception from `step()` itself fails every request then in the engine (a step is
one batch, so the culprit is unknown) with an engine error (HTTP 500), aborts them, and the
worker keeps serving. `MAX_CONSECUTIVE_STEP_FAILURES` failed steps in a row, a failure to build
the engine, or anything escaping the engine thread's loop mean the engine is broken for good:
`fatal_error` is set, `on_fatal` runs (the CLI then exits non-zero) and new requests are refused.

Liveness: the engine thread notes when it starts each round of work (commands, then one step).
`liveness()` reports the engine stalled when one round has run longer than `stall_timeout`
seconds (a stuck step), and failed when the thread is gone; idle waiting is never a stall.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from phasefleet.engine.kv_transfer import KVChunk, KVLayout, Lease
    from phasefleet.engine.llm_engine import EngineStats, LLMEngine, RequestOutput
    from phasefleet.engine.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3
DEFAULT_STALL_TIMEOUT = 120.0  # seconds one round of engine work may take before it is stalled
IDLE_WAIT_SECONDS = 0.05  # a step computed nothing: the longest wait before stepping again
RANK_CHECK_SECONDS = 1.0  # how often an idle tensor-parallel worker looks at its ranks
LEASE_CHECK_SECONDS = 1.0  # while idle with KV leased, how often expired leases are freed


class QueueFullError(Exception):
    """The waiting queue holds `limit` requests already."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"waiting queue is full ({limit})")
        self.limit = limit


class EngineNotReadyError(Exception):
    """The engine is still loading, or is broken for good."""


class EngineStepError(Exception):
    """The engine raised while running a step that included this request."""


class RequestFailedError(Exception):
    """The engine could not take this request for a reason of its own (not a bad value)."""


@dataclass
class Event:
    """One step's news for one choice of a RequestStream."""

    index: int  # choice index within the HTTP request
    output: RequestOutput
    time: float  # time.monotonic() right after the step that produced it


@dataclass
class EngineOptions:
    """The hand-off forms of one engine request (LLMEngine.add_request's keywords)."""

    prefill_only: bool = False  # prefill role: stop after the first token, lease the KV
    first_token_id: int | None = None  # decode role: continue from this first token
    imported_kv: list[KVChunk] | None = None  # decode role: the prompt's KV that arrived
    importing_from: int | None = None  # decode role: more KV follows (import_kv), from block
    embed: bool = False  # an embedding (LLMEngine.add_embedding_request): its params unused


@dataclass
class _Add:
    stream: RequestStream
    prompts: list[list[int]]  # one per choice
    params: list[SamplingParams]  # one per choice
    options: list[EngineOptions] | None  # one per choice, or None: plain requests
    late_after_s: float | None = None  # their TTFT target (late prompts last); None: the engine's
    lora: str | None = None  # their LoRA adapter; None: the base model
    priority: int = 0  # their rank under the priority policy


@dataclass
class _Release:
    request_id: str  # a leased prefill whose KV the decode worker has
    done: asyncio.Future[bool]  # True when a lease was ended


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]  # run on the engine thread between steps
    done: asyncio.Future[Any]  # its result, or what it raised


@dataclass
class _Import:
    request_id: str
    chunk: KVChunk | None  # None: the import ended
    first_token_id: int | None = None  # with the end: the prefill worker's first token


class RequestStream:
    """The outputs of one HTTP request's engine requests, as an async iterator of Events."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], arrival_time: float) -> None:
        self.engine = engine
        self.request_ids = request_ids
        self.arrival_time = arrival_time  # time.monotonic() when the HTTP request arrived
        # Resolved by the engine thread once every engine request is added (or add failed).
        self.accepted: asyncio.Future[None] = engine.loop.create_future()
        self.queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self.unfinished = set(range(len(request_ids)))
        self.closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        if not self.unfinished:
            self.close()
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.output.finished:
            self.unfinished.discard(item.index)
        return item

    def close(self) -> None:
        """Abort whatever is unfinished and stop counting this request as in flight."""
        if self.closed:
            return
        self.closed = True
        if self.unfinished:
            self.engine.abort([self.request_ids[i] for i in sorted(self.unfinished)])
        self.engine.in_flight -= 1


@dataclass
class _Tracked:
    stream: RequestStream
    index: int


@dataclass
class _Shared:
    stats: EngineStats | None = None
    pending_adds: int = 0  # engine requests submitted but not yet added by the engine thread
    commands: list[_Add | _Abort | _Release | _Import | _Call] = field(default_factory=list)


class AsyncEngine:
    def __init__(
        self,
        make_engine: Callable[[], LLMEngine],
        max_queue_len: int,
        on_fatal: Callable[[BaseException], None] | None = None,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make_engine = make_engine
        self.max_queue_len = max_queue_len
        self.on_fatal = on_fatal
        self.stall_timeout = stall_timeout  # seconds
        self.clock = clock
        self._busy_since: float | None = None  # clock() when the current round of work began
        self._cond = threading.Condition()
        self._shared = _Shared()  # guarded by _cond
        self._stop = False
        self._thread: threading.Thread | None = None
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self.loop: asyncio.AbstractEventLoop
        self.ready = False
        self.fatal_error: BaseException | None = None
        self.max_model_len = 0
        self.kv_layout: KVLayout | None = None  # set once the engine is built
        self._engine: LLMEngine | None = None
        self.in_flight = 0  # open RequestStreams; event loop only

    # -- event loop side --

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self, now: float | None = None) -> EngineStats | None:
        """The stats as of the engine thread's last step or command batch, with the peaks as of
        `now` (time.monotonic by default): an idle engine takes no step, and its peaks must
        still fall once its last burst is older than PEAK_WINDOW_S."""
        stats, engine = self._shared.stats, self._engine
        if stats is None or engine is None:
            return stats
        requests, kv_usage = engine.peaks(time.monotonic() if now is None else now)
        return replace(stats, num_requests_peak=requests, kv_cache_usage_peak=kv_usage)

    def liveness(self) -> str | None:
        """None while the engine thread lives and makes progress (loading included), else why
        not: 'engine_failed' (broken for good, or its thread is gone) or 'engine_stalled' (one
        round of work has run longer than stall_timeout)."""
        if self.fatal_error is not None:
            return "engine_failed"
        if self.rank_failure() is not None:
            return "rank_failed"
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stop:
            return "engine_failed"
        busy_since = self._busy_since
        if self.ready and busy_since is not None and self.clock() - busy_since > self.stall_timeout:
            return "engine_stalled"
        return None

    def rank_failure(self) -> str | None:
        """Why one of the engine's other tensor-parallel ranks is gone; None while all live."""
        engine = self._engine
        ranks = engine.runner.ranks if engine is not None else None
        return ranks.failure() if ranks is not None else None

    # -- the hand-off: narrow calls that are safe from any thread while the engine steps --

    def cached_prefix_tokens(self, prompt: list[int], lora: str | None = None) -> int:
        """Leading prompt tokens the prefix cache holds now (under adapter `lora`): an estimate
        (it may change before the request is admitted); 0 before the engine is ready."""
        engine = self._engine
        if engine is None or not self.ready:
            return 0
        return engine.cached_prefix_tokens(prompt, lora)

    def read_kv(self, block_ids: list[int], chunk_bytes: int) -> Iterator[memoryview]:
        """Blocks' KV in wire order, in chunks of about chunk_bytes whose memory the next
        reuses. Only blocks nothing writes meanwhile: the full blocks of a running prefill-only
        request, or a pinned lease."""
        if self._engine is None:
            raise EngineNotReadyError("the engine is not ready")
        return self._engine.runner.read_kv(block_ids, chunk_bytes)

    def pin_kv(self, request_id: str) -> Lease | None:
        """A finished prefill's lease, kept from expiring until `unpin_kv`; None if gone."""
        return self._engine.pin_kv(request_id) if self._engine is not None else None

    def unpin_kv(self, lease: Lease) -> None:
        if self._engine is not None:
            self._engine.unpin_kv(lease)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """fn(engine) on the engine thread, between steps; what it raises is raised here."""
        if not self.ready or self.fatal_error is not None:
            raise EngineNotReadyError("the engine is not ready")
        done: asyncio.Future[T] = self.loop.create_future()
        with self._cond:
            self._shared.commands.append(_Call(fn, done))
            self._cond.notify()
        return await done

    async def release_kv(self, request_id: str) -> bool:
        """Ends a lease on the engine thread; False when there was none to end."""
        done: asyncio.Future[bool] = self.loop.create_future()
        with self._cond:
            self._shared.commands.append(_Release(request_id, done))
            self._cond.notify()
        return await done

    def import_kv(self, request_id: str, chunk: KVChunk) -> None:
        """The next chunk of an importing request's KV, written into its blocks on the engine
        thread (from any thread)."""
        self._command(_Import(request_id, chunk))

    def end_import(self, request_id: str, first_token_id: int | None) -> None:
        """No more KV comes: the request goes on, after `first_token_id` if the prefill worker
        sent one, else from its own first token (from any thread)."""
        self._command(_Import(request_id, None, first_token_id))

    def _command(self, command: _Import) -> None:
        with self._cond:
            self._shared.commands.append(command)
            self._cond.notify()

    def check_room(self, num_requests: int) -> None:
        """Raises QueueFullError or EngineNotReadyError as `submit` would, queueing nothing."""
        if not self.ready or self.fatal_error is not None:
            raise EngineNotReadyError("the engine is not ready")
        with self._cond:
            stats = self._shared.stats
            waiting = self._shared.pending_adds + (stats.num_waiting if stats else 0)
        if waiting + num_requests > self.max_queue_len:
            raise QueueFullError(self.max_queue_len)

    def submit(
        self,
        request_ids: list[str],
        prompts: list[list[int]],
        params: list[SamplingParams],
        arrival_time: float,
        options: list[EngineOptions] | None = None,
        reserved: bool = False,
        late_after_s: float | None = None,
        lora: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue engine requests (one per choice); raises QueueFullError or EngineNotReadyError.
        `reserved`: the caller passed `check_room` earlier (a decode after its remote prefill),
        so a queue filled since does not refuse it. `late_after_s`: their TTFT target (late
        prompts last), else the engine's. `lora`: their adapter's name; `priority`: their rank
        under the priority policy."""
        if not self.ready or self.fatal_error is not None:
            raise EngineNotReadyError("the engine is not ready")
        if len(request_ids) > self.max_queue_len:  # would never fit: not a QueueFullError
            raise ValueError(
                f"{len(request_ids)} engine requests are more than the whole waiting queue "
                f"({self.max_queue_len})"
            )
        stream = RequestStream(self, request_ids, arrival_time)
        with self._cond:
            stats = self._shared.stats
            waiting = self._shared.pending_adds + (stats.num_waiting if stats else 0)
            if not reserved and waiting + len(request_ids) > self.max_queue_len:
                raise QueueFullError(self.max_queue_len)
            self._shared.pending_adds += len(request_ids)
            add = _Add(stream, prompts, params, options, late_after_s, lora, priority)
            self._shared.commands.append(add)
            self._cond.notify()
        self.in_flight += 1
        return stream

    def abort(self, request_ids: list[str]) -> None:
        with self._cond:
            self._shared.commands.append(_Abort(request_ids))
            self._cond.notify()

    def _deliver(self, events: Sequence[tuple[RequestStream, Any]]) -> None:
        for stream, item in events:
            if not stream.closed:
                stream.queue.put_nowait(item)

    def _resolve(self, stream: RequestStream, error: BaseException | None) -> None:
        if stream.accepted.done():
            return
        if error is None:
            stream.accepted.set_result(None)
        else:
            stream.accepted.set_exception(error)

    # -- engine thread --

    def _run(self) -> None:
        try:
            engine = self._make_engine()
        except BaseException as exc:  # a model that cannot load is fatal, whatever the cause
            logger.exception("the engine failed to start")
            self._fail_for_good(exc)
            return
        self.max_model_len = engine.max_model_len
        self.kv_layout = engine.kv_layout
        self._engine = engine
        with self._cond:
            self._shared.stats = engine.stats()
        self.ready = True
        logger.info(
            "engine ready: %s, %s on %s, linears %s, max_model_len=%d; start-up: %s",
            engine.model_name, engine.dtype, engine.device, engine.runner.model.linear_backend,
            engine.max_model_len, engine.startup.describe(),
        )  # fmt: skip
        try:
            self._loop(engine)
        except BaseException as exc:  # the loop itself broke: no request can be served now
            logger.exception("the engine loop failed")
            self._fail_for_good(exc)
        finally:
            engine.close()

    def _loop(self, engine: LLMEngine) -> None:
        failures = 0
        while True:
            with self._cond:
                if not (self._stop or self._shared.commands or engine.has_unfinished_requests()):
                    self._busy_since = None
                while not (self._stop or self._shared.commands or engine.has_unfinished_requests()):
                    ranks = engine.runner.ranks
                    if ranks is not None:  # idle, a dead rank still fails the worker
                        ranks.check()
                    if not len(engine.leases):
                        self._cond.wait(RANK_CHECK_SECONDS if ranks is not None else None)
                    elif not self._cond.wait(LEASE_CHECK_SECONDS) and engine.expire_leases():
                        self._shared.stats = engine.stats()
                if self._stop:
                    self._busy_since = None
                    return
                commands, self._shared.commands = self._shared.commands, []
            self._busy_since = self.clock()
            self._apply(engine, commands)
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                failures += 1
                logger.exception("engine step failed (%d in a row)", failures)
                self._fail_all(engine, exc)
                if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                    self._fail_for_good(exc)
                    return
                continue
            failures = 0
            now = time.monotonic()
            events: list[tuple[RequestStream, Any]] = []
            for output in outputs:
                tracked = self._tracked.get(output.request_id)
                if tracked is None:
                    continue
                if output.finished:
                    del self._tracked[output.request_id]
                events.append((tracked.stream, Event(tracked.index, output, now)))
            with self._cond:
                self._shared.stats = engine.stats()
            if events:
                self.loop.call_soon_threadsafe(self._deliver, events)
            if engine.last_step_idle:  # only requests waiting for their KV: wait for it
                with self._cond:
                    if not (self._stop or self._shared.commands):
                        self._cond.wait(IDLE_WAIT_SECONDS)

    def _apply(
        self, engine: LLMEngine, commands: list[_Add | _Abort | _Release | _Import | _Call]
    ) -> None:
        added = 0
        for command in commands:
            if isinstance(command, _Import):
                self._import(engine, command)
                continue
            if isinstance(command, _Abort):
                for request_id in command.request_ids:
                    self._tracked.pop(request_id, None)
                    engine.abort_request(request_id)  # finished already: ends its lease, if any
                continue
            if isinstance(command, _Release):
                released = engine.release_kv(command.request_id)
                self.loop.call_soon_threadsafe(_settle, command.done, released)
                continue
            if isinstance(command, _Call):
                try:
                    result = command.fn(engine)
                except Exception as exc:  # the caller's to answer; the engine goes on
                    self.loop.call_soon_threadsafe(_fail, command.done, exc)
                else:
                    self.loop.call_soon_threadsafe(_settle, command.done, result)
                continue
            added += len(command.prompts)
            stream = command.stream
            error: BaseException | None = None
            for index, (prompt, params) in enumerate(
                zip(command.prompts, command.params, strict=True)
            ):
                request_id = stream.request_ids[index]
                options = command.options[index] if command.options else EngineOptions()
                try:
                    if options.embed:
                        engine.add_embedding_request(
                            request_id,
                            prompt,
                            stream.arrival_time,
                            late_after_s=command.late_after_s,
                            lora=command.lora,
                            priority=command.priority,
                        )
                    else:
                        engine.add_request(
                            request_id,
                            prompt,
                            params,
                            arrival_time=stream.arrival_time,
                            prefill_only=options.prefill_only,
                            first_token_id=options.first_token_id,
                            imported_kv=options.imported_kv,
                            importing_from=options.importing_from,
                            late_after_s=command.late_after_s,
                            lora=command.lora,
                            priority=command.priority,
                        )
                except ValueError as exc:
                    error = exc
                    break
                except Exception as exc:  # this request's own setup failed; nothing was queued
                    logger.exception("could not add request %s", request_id)
                    error = RequestFailedError(f"the engine could not take this request: {exc!r}")
                    break
                self._tracked[request_id] = _Tracked(stream, index)
            if error is not None:
                for request_id in stream.request_ids:
                    if self._tracked.pop(request_id, None) is not None:
                        engine.abort_request(request_id)
            self.loop.call_soon_threadsafe(self._resolve, stream, error)
        with self._cond:
            self._shared.pending_adds -= added
            self._shared.stats = engine.stats()

    def _import(self, engine: LLMEngine, command: _Import) -> None:
        request_id = command.request_id
        if command.chunk is not None:
            try:
                engine.import_kv(request_id, command.chunk)
            except ValueError as exc:  # not the next chunk: what came before it is used
                logger.warning("KV for %s refused: %s", request_id, exc)
            return
        try:
            engine.end_import(request_id, command.first_token_id)
        except ValueError as exc:  # a first token it cannot take: the request fails
            tracked = self._tracked.pop(request_id, None)
            engine.abort_request(request_id)
            if tracked is not None:
                error = RequestFailedError(f"the prefill worker's first token: {exc}")
                self.loop.call_soon_threadsafe(self._deliver, [(tracked.stream, error)])

    def _fail_all(self, engine: LLMEngine, exc: Exception) -> None:
        events: list[tuple[RequestStream, Any]] = []
        for request_id, tracked in list(self._tracked.items()):
            try:
                engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort %s after a failed step", request_id)
            events.append((tracked.stream, EngineStepError(f"the engine failed: {exc!r}")))
        self._tracked.clear()
        if events:
            self.loop.call_soon_threadsafe(self._deliver, events)
        try:
            with self._cond:
                self._shared.stats = engine.stats()
        except Exception:
            logger.exception("could not read engine stats after a failed step")

    def _fail_for_good(self, exc: BaseException) -> None:
        self.fatal_error = exc
        events: list[tuple[RequestStream, Any]] = [
            (t.stream, EngineStepError(f"the engine failed: {exc!r}"))
            for t in self._tracked.values()
        ]
        self._tracked.clear()
        with self._cond:
            pending = [c.stream for c in self._shared.commands if isinstance(c, _Add)]
            releases = [c.done for c in self._shared.commands if isinstance(c, _Release)]
            calls = [c.done for c in self._shared.commands if isinstance(c, _Call)]
            self._shared.commands.clear()
            self._shared.pending_adds = 0
        for stream in pending:
            self.loop.call_soon_threadsafe(
                self._resolve, stream, EngineStepError("the engine is broken")
            )
        for done in releases:
            self.loop.call_soon_threadsafe(_settle, done, False)
        for call in calls:
            self.loop.call_soon_threadsafe(_fail, call, EngineStepError("the engine is broken"))
        if events:
            self.loop.call_soon_threadsafe(self._deliver, events)
        if self.on_fatal is not None:
            self.loop.call_soon_threadsafe(self.on_fatal, exc)


def _settle(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
