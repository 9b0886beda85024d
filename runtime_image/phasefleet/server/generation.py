"""Generation: one HTTP request's trip through the engine, shared by completions and chat.

It turns validated request fields into per-choice SamplingParams, submits the engine requests,
maps engine-side refusals onto HTTP errors, yields the engine's events and observes the latency
histograms as tokens arrive.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from phasefleet.engine.kv_convert import convert_chunks
from phasefleet.engine.outputs import RequestOutput, TokenLogprob
from phasefleet.server.async_engine import (
    AsyncEngine,
    EngineNotReadyError,
    EngineOptions,
    EngineStepError,
    Event,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from phasefleet.server.errors import (
    bad_request,
    engine_failed,
    queue_full,
    request_failed,
    unavailable,
)
from phasefleet.server.handoff import (
    Arrivals,
    First,
    Handoff,
    HandoffFailed,
    Received,
    RemotePrefill,
    wants_remote,
)
from phasefleet.server.metrics import WorkerMetrics
from phasefleet.server.openai_protocol import SamplingFields
from phasefleet.server.sampling_defaults import SamplingDefaults

if TYPE_CHECKING:
    from phasefleet.engine.sampling_params import Grammar, SamplingParams
    from phasefleet.server.token_rules import TokenRules

__all__ = ["EngineOptions", "Generation"]


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    choice: int,
    defaults: SamplingDefaults,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    grammar: Grammar | None = None,
    rules: TokenRules | None = None,
) -> SamplingParams:
    """The engine's SamplingParams for choice `choice`; a choice's seed is `seed + choice`.
    `defaults`: for the sampling fields the request leaves out (the model's, or the API's).
    `logprobs`, `prompt_logprobs`: alternatives per token, None for no logprobs. `grammar`: the
    request's structured output (server/structured.py). `rules`: its allowed tokens and bad
    words (server/token_rules.py)."""
    from phasefleet.engine.sampling_params import SamplingParams

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=defaults.temperature if req.temperature is None else req.temperature,
        top_p=defaults.top_p if req.top_p is None else req.top_p,
        top_k=defaults.top_k if req.top_k is None else req.top_k,
        seed=None if req.seed is None else req.seed + choice,
        stop=stop,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=(
            defaults.repetition_penalty
            if req.repetition_penalty is None
            else req.repetition_penalty
        ),
        min_p=defaults.min_p if req.min_p is None else req.min_p,
        logit_bias=req.logit_bias_ids(),
        allowed_token_ids=None if rules is None else rules.allowed_token_ids,
        bad_words=[] if rules is None else [list(w) for w in rules.bad_words],
        grammar=grammar,
    )
    return checked(params)


def checked(params: SamplingParams) -> SamplingParams:
    """The params if the engine accepts them, else a 400 that names the field."""
    try:
        params.validate()
    except ValueError as exc:
        # SamplingParams names the field first: "<field> must be ..., got ...".
        raise bad_request(str(exc), str(exc).split(" ", 1)[0]) from None
    return params


def check_supported(req: SamplingFields) -> None:
    for name in req.unsupported():
        raise bad_request(f"'{name}' is not supported by this worker", name)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs is not served with stream: true", "prompt_logprobs")


def check_queue_room(num_prompts: int, n: int, max_queue_len: int, prompt_field: str) -> None:
    """A request of more engine requests (prompts x n) than the whole waiting queue holds can
    never be admitted: 400, not a 429 that retrying cannot fix."""
    if num_prompts * n > max_queue_len:
        raise bad_request(
            f"{num_prompts} prompt(s) x n={n} is {num_prompts * n} engine requests, more than "
            f"this worker's whole waiting queue ({max_queue_len}); send fewer per request",
            "n" if n > max_queue_len else prompt_field,
        )


def truncated(prompt: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: the model's
    maximum length); None: the whole prompt."""
    if keep is None:
        return prompt
    limit = max_model_len if keep == -1 else keep
    return prompt[-limit:] if len(prompt) > limit else prompt


def output_budget(
    prompt_len: int, requested: int | None, default: int | None, max_model_len: int, field: str
) -> int:
    """max_tokens for a prompt: what was asked for, else the default, within the context."""
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens and the prompt has "
            f"{prompt_len}; shorten the prompt",
            field,
        )
    if requested is not None:
        if requested > room:
            raise bad_request(
                f"max_tokens is {requested} but only {room} tokens fit after the "
                f"{prompt_len}-token prompt (maximum context length {max_model_len})",
                "max_tokens",
            )
        return requested
    return room if default is None else min(default, room)


@dataclass
class ChoiceTiming:
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens: int = 0
    queue_time_observed: bool = False


@dataclass
class Generation:
    engine: AsyncEngine
    metrics: WorkerMetrics
    prompts: list[list[int]]  # one per choice
    params: list[SamplingParams]  # one per choice
    arrival_time: float
    prompt_field: str  # the request field that holds the prompt: "prompt" or "messages"
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    options: list[EngineOptions] | None = None  # one per choice: the hand-off forms
    remote: RemotePrefill | None = None  # prefill on another worker (one prompt, n = 1)
    late_after_s: float | None = None  # the TTFT target the router sent; None: the engine's
    lora: str | None = None  # the LoRA adapter the request named; None: the base model
    priority: int = 0  # its rank under the priority policy (lower first)
    stream: RequestStream | None = None
    timings: list[ChoiceTiming] = field(default_factory=list)
    # Per choice, as events pass: the output tokens' logprobs, and the prompt's (if asked for)
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    prompt_logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    _first: Event | None = None  # the first token, from the prefill worker
    _rest: asyncio.Task[RequestStream] | None = None  # pull the KV, then decode here

    async def start(self) -> None:
        """Submit and wait until the engine has added every request (or refused one). With a
        remote prefill: wait for the first token; the decode is queued as the KV arrives."""
        self.timings = [ChoiceTiming() for _ in self.prompts]
        self.logprobs = [[] for _ in self.prompts]
        self.prompt_logprobs = [None for _ in self.prompts]
        if self.remote is not None and len(self.prompts) == 1 and wants_remote(self.params[0]):
            try:
                self.engine.check_room(1)
            except QueueFullError as exc:
                raise queue_full(exc.limit) from None
            except EngineNotReadyError:
                raise unavailable("the engine is not ready", "not_ready") from None
            if await self._prefill_remotely(self.remote):
                return
        if not any(o.prefill_only for o in self.options or []):  # not done for another worker
            self.metrics.prefills["local"].inc(len(self.prompts))
        self.stream = await self._submit(self.options, reserved=False)

    async def _submit(self, options: list[EngineOptions] | None, reserved: bool) -> RequestStream:
        ids = [f"{self.request_id}-{i}" for i in range(len(self.prompts))]
        try:
            stream = self.engine.submit(
                ids, self.prompts, self.params, self.arrival_time, options, reserved,
                self.late_after_s, self.lora, self.priority,
            )  # fmt: skip
        except QueueFullError as exc:
            raise queue_full(exc.limit) from None
        except ValueError as exc:  # more engine requests than the whole queue
            raise bad_request(str(exc), "n") from None
        except EngineNotReadyError:
            raise unavailable("the engine is not ready", "not_ready") from None
        self.stream = stream
        try:
            await self.stream.accepted
        except ValueError as exc:  # the engine names a sampling field first, else the prompt
            self.close()
            named = str(exc).split(" ", 1)[0]
            sampling = {f.name for f in dataclasses.fields(self.params[0])}
            raise bad_request(str(exc), named if named in sampling else self.prompt_field) from None
        except RequestFailedError as exc:
            self.close()
            raise request_failed(str(exc)) from None
        except EngineStepError as exc:
            self.close()
            raise engine_failed(str(exc)) from None
        except BaseException:
            self.close()
            raise
        return stream

    async def _prefill_remotely(self, remote: RemotePrefill) -> bool:
        """Asks the prefill worker for the prompt; False when it did not take it (the prompt is
        then prefilled here). In this engine's layout the request is queued here with the
        first chunk of KV (not while the prompt waits in the prefill worker's queue) and its
        blocks filled as the rest arrives, chunk by chunk while the prompt is prefilled there;
        it is computed once all of it has arrived (or the stream broke: then only what is
        missing is computed, the first token too if none came)."""
        prompt, params = self.prompts[0], self.params[0]
        try:
            handoff = await remote.client.open(
                remote.prefill_url,
                self.request_id,
                prompt,
                params,
                remote.cached_tokens,
                self.late_after_s,
                self.lora,
                self.priority,
            )
        except HandoffFailed as exc:
            self.metrics.kv_transfer_failures[exc.reason].inc()
            return False
        layout = self.engine.kv_layout
        importing = layout is not None and layout == handoff.start.layout.layout()
        first_token = asyncio.ensure_future(handoff.first())
        stream: RequestStream | None = None
        try:
            if importing:  # KV before the first token: queue the request now
                began = handoff.arrivals.begun
                either: set[asyncio.Future[Any]] = {first_token, began}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                if began.done():
                    stream = await self._import_as_it_arrives(handoff)
            first = await first_token
        except HandoffFailed as exc:
            self.metrics.kv_transfer_failures[exc.reason].inc()
            if stream is None:
                return False
            self.metrics.prefills["local"].inc()  # what arrived is used; the rest computed here
            self.engine.end_import(self._engine_id, None)
            return True
        except BaseException:  # the client left: the queued request goes too
            first_token.cancel()
            self.close()
            raise
        self.metrics.prefills["remote"].inc()
        text, stopped = await remote.first_token_text(first.token_id, params)
        final = stopped or first.finish_reason != "handoff"
        output = RequestOutput(
            request_id=self._engine_id,
            new_token_ids=[first.token_id],
            output_token_ids=[first.token_id] if final else [],
            text=text,
            finished=final,
            finish_reason=("stop" if stopped else first.finish_reason) if final else None,
            num_prompt_tokens=first.num_prompt_tokens,
            num_cached_tokens=first.num_cached_tokens,
            first_scheduled_time=None,
            logprobs=None if first.logprob is None else [first.logprob],
        )
        self._first = Event(0, output, time.monotonic())
        if final:  # the stream ends on its own; nothing of it is needed
            if stream is not None:
                stream.close()
            return True
        if importing:
            self._rest = asyncio.create_task(self._decode_once_arrived(stream, first, handoff))
        else:
            self._rest = asyncio.create_task(
                self._convert_then_decode(first, handoff.arrivals, remote.cached_tokens)
            )
        return True

    @property
    def _engine_id(self) -> str:
        return f"{self.request_id}-0"

    async def _import_as_it_arrives(self, handoff: Handoff) -> RequestStream:
        """Queues the request, its first token to come; each chunk goes into its blocks."""
        arrived = handoff.arrivals.follow(
            lambda chunk: self.engine.import_kv(self._engine_id, chunk)
        )
        options = [EngineOptions(imported_kv=arrived, importing_from=handoff.start.skip_blocks)]
        return await self._submit(options, reserved=True)

    async def _decode_once_arrived(
        self, stream: RequestStream | None, first: First, handoff: Handoff
    ) -> RequestStream:
        """Queues the request if it is not yet (the first token came first: it went to the
        client before this), then hands the engine the first token once the KV is in."""
        if stream is None:
            stream = await self._import_as_it_arrives(handoff)
        try:
            self._count(await handoff.arrivals.done)
        finally:
            self.engine.end_import(self._engine_id, first.token_id)
        return stream

    async def _convert_then_decode(
        self, first: First, arrivals: Arrivals, cached_tokens: int
    ) -> RequestStream:
        """KV in another block size, dtype or head split: converted once all of it is here."""
        received = await arrivals.done
        chunks = arrivals.take()
        layout = self.engine.kv_layout
        if layout is None or (chunks and layout.unconvertible(first.layout)):
            chunks = []  # recompute the prompt here instead
            self.metrics.kv_transfer_failures["layout_mismatch"].inc()
        elif chunks:
            chunks = await asyncio.to_thread(
                convert_chunks, chunks, first.layout, layout, len(self.prompts[0]), cached_tokens
            )
        self._count(received)
        options = [EngineOptions(first_token_id=first.token_id, imported_kv=chunks)]
        return await self._submit(options, reserved=True)

    def _count(self, received: Received) -> None:
        if received.failure is not None:  # what arrived loads; the rest is recomputed here
            self.metrics.kv_transfer_failures[received.failure].inc()
        self.metrics.kv_transfer_seconds.observe(received.seconds)
        self.metrics.kv_transfer_bytes.inc(received.nbytes)

    async def events(self) -> AsyncIterator[Event]:
        if self._first is not None:
            first, self._first = self._first, None
            self._observe(first)
            yield first
            if first.output.finished:
                return
        if self._rest is not None:
            rest, self._rest = self._rest, None
            self.stream = await rest
        if self.stream is None:
            raise RuntimeError("Generation.start() was not awaited")
        try:
            async for event in self.stream:
                self._observe(event)
                if event.output.finish_reason == "error":
                    raise request_failed(
                        f"the engine could not finish this request: {event.output.error}"
                    )
                yield event
        except EngineStepError as exc:
            raise engine_failed(str(exc)) from None
        finally:
            self.close()

    def close(self) -> None:
        if self._rest is not None:  # the client left between the first token and the decode
            self._rest.cancel()
            self._rest.add_done_callback(_close_stream)
        if self.stream is not None:
            self.stream.close()

    def _observe(self, event: Event) -> None:
        """Keeps the event's logprobs and observes the latency histograms."""
        out, timing, m = event.output, self.timings[event.index], self.metrics
        if out.logprobs:
            self.logprobs[event.index].extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[event.index] = out.prompt_logprobs
        if not timing.queue_time_observed and out.first_scheduled_time is not None:
            m.request_queue_time.observe(max(0.0, out.first_scheduled_time - self.arrival_time))
            timing.queue_time_observed = True
        if out.new_token_ids:
            if timing.first_token_time is None:
                timing.first_token_time = event.time
                m.time_to_first_token.observe(event.time - self.arrival_time)
            elif timing.last_token_time is not None:
                m.observe_itl(event.time - timing.last_token_time)
            timing.last_token_time = event.time
            timing.num_tokens += len(out.new_token_ids)
        if out.finished and out.finish_reason not in ("abort", "error"):
            m.e2e_request_latency.observe(event.time - self.arrival_time)
            if out.finish_reason != "embedded":  # an embedding is no answer of 0 tokens
                m.observe_answer(timing.num_tokens)
            first, last = timing.first_token_time, timing.last_token_time
            if first is not None and last is not None and timing.num_tokens > 1:
                m.time_per_output_token.observe((last - first) / (timing.num_tokens - 1))


def _close_stream(task: asyncio.Task[RequestStream]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()
