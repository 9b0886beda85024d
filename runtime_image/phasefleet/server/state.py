"""WorkerState: what every handler of one worker shares, and the checks they all make."""

from __future__ import annotations

import asyncio
import functools
import hmac
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from phasefleet.api.boundary import LocalLoad, PhaseBoundary
from phasefleet.api.contract import (
    INTERNAL_TOKEN_HEADER,
    LATE_AFTER_HEADER,
    PREFILL_BACKLOG_HEADER,
    PREFILL_SPEED_HEADER,
    PREFILL_URL_HEADER,
    TPOT_TARGET_HEADER,
)
from phasefleet.engine.grammar import GrammarCompiler
from phasefleet.engine.sampling_params import Grammar, SamplingParams
from phasefleet.server.api_keys import ApiKeys
from phasefleet.server.async_engine import AsyncEngine
from phasefleet.server.errors import APIError, bad_request, unavailable
from phasefleet.server.handoff import HandoffClient, RemotePrefill
from phasefleet.server.metrics import WorkerMetrics
from phasefleet.server.pooling import Pooling
from phasefleet.server.sampling_defaults import SamplingDefaults

ROLES = ("both", "prefill", "decode")


def _number(headers: Mapping[str, str], name: str) -> float | None:
    """A header's non-negative finite number; None: absent or not one."""
    try:
        value = float(headers[name])
    except (KeyError, ValueError):
        return None
    return value if 0 <= value < float("inf") else None


T = TypeVar("T")


def _tokenizer_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")


@dataclass
class WorkerState:
    engine: AsyncEngine
    tokenizer: Any  # a Hugging Face tokenizer; used on the tokenizer thread only (`off_loop`)
    vocab_size: int  # rows of the model's embedding: token ids must be below it
    served_model_name: str
    role: str  # both | prefill | decode
    metrics: WorkerMetrics
    draining: bool = False
    max_request_bytes: int | None = None  # a larger request body gets 413; None: no limit
    internal_token: str | None = None  # the service's token for /internal/*; None: refused
    handoff: HandoffClient | None = None  # decode side: talks to prefill workers
    # Decode side: which prompts are prefilled here rather than on the router's prefill worker.
    boundary: PhaseBoundary = field(default_factory=PhaseBoundary)
    # the service's TPOT target, bounding local prefill, where the router sends none
    tpot_target_s: float | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))  # Unix seconds
    # Tokenizing and chat templating run here, one at a time (a Hugging Face tokenizer is not
    # safe to share between threads), so a long prompt never blocks the event loop and /health.
    tokenizer_thread: ThreadPoolExecutor = field(default_factory=_tokenizer_thread)
    # Structured output's grammars, shared with the engine; None: made on first use
    grammars: GrammarCompiler | None = None
    # finds tool calls in a chat's free text (tool_choice 'auto': server/tools.py); None: none
    tool_call_parser: str | None = None
    # splits a chat answer's thought (reasoning_content) from its content (server/reasoning.py)
    reasoning_parser: str | None = None
    # the tokens of the thought's end (</think>) as the tokenizer writes it: a grammar starts
    # after them when a reasoning parser is set
    thought_end_ids: tuple[int, ...] = ()
    # the LoRA adapters the engine loaded: a request names one as its `model`
    lora_names: tuple[str, ...] = ()
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter are served (server/lora_admin.py)
    runtime_lora: bool = False
    # keys a client must send as `Authorization: Bearer <key>` (server/auth.py); none: open
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    # for the sampling fields a request leaves out (server/sampling_defaults.py)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # how /v1/embeddings pools this model (server/pooling.py)
    pooling: Pooling = field(default_factory=Pooling)
    # the engine's scheduling policy: a request's `priority` needs "priority"
    scheduling_policy: str = "fcfs"

    @functools.cached_property
    def decoders(self) -> dict[bool, Callable[[list[int]], str]]:
        """The tokenizer's decode for detokenizers (`detokenizer.decoder`), made once, by
        skip_special_tokens."""
        from phasefleet.engine.detokenizer import decoder

        return {skip: decoder(self.tokenizer, skip) for skip in (True, False)}

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the tokenizer thread; what it raises (an APIError) is raised here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_thread, functools.partial(fn, *args))

    def remote_prefill(
        self, headers: Mapping[str, str], prompts: list[list[int]], lora: str | None = None
    ) -> RemotePrefill | None:
        """Where this request's prompt is prefilled: on the prefill worker the router named (in
        the prefill-URL header, honoured only with the internal token), or here (None) when
        there is none, several choices, or the phase boundary says so (api/boundary.py: the
        uncached part's length, the prefill worker's backlog the router sent, this worker's
        own prefill and inter-token latency, held to the TPOT target the router sent)."""
        url = headers.get(PREFILL_URL_HEADER)
        if url is None or self.handoff is None or self.internal_token is None or len(prompts) != 1:
            return None
        given = headers.get(INTERNAL_TOKEN_HEADER, "")
        if not hmac.compare_digest(given.encode(), self.internal_token.encode()):
            return None
        cached = self.engine.cached_prefix_tokens(prompts[0], lora)
        uncached = len(prompts[0]) - cached
        backlog_ms = _number(headers, PREFILL_BACKLOG_HEADER)
        speed = _number(headers, PREFILL_SPEED_HEADER)  # prompt tokens/s, the pools' hardware
        backlog_s = backlog_ms / 1000 if backlog_ms is not None and speed else None
        prefill_s = uncached / speed if speed else 0.0
        tpot_ms = _number(headers, TPOT_TARGET_HEADER)
        tpot_s = tpot_ms / 1000 if tpot_ms else self.tpot_target_s
        remote = self.boundary.remote(uncached, backlog_s, self.local_load(prefill_s, tpot_s))
        if remote != self.boundary.fixed(uncached):
            self.metrics.boundary_moves["remote" if remote else "local"].inc()
        if not remote:
            return None
        return RemotePrefill(self.handoff, url, self.first_token_text, cached)

    @staticmethod
    def late_after_s(headers: Mapping[str, str]) -> float | None:
        """The TTFT target the router sent with this request (late prompts last); None: none,
        or not a positive number, so the engine's own applies."""
        ms = _number(headers, LATE_AFTER_HEADER)
        return ms / 1000 if ms else None

    def local_load(self, prefill_s: float, tpot_target_s: float | None) -> LocalLoad:
        stats, m = self.engine.stats(), self.metrics
        if stats is None:
            return LocalLoad(0, None, tpot_target_s, prefill_s, decoding=0)
        tokens = stats.prefill_tokens_pending + stats.prefill_tokens_waiting
        return LocalLoad(
            tokens, m.recent_itl_s, tpot_target_s, prefill_s, m.recent_output_tokens,
            stats.num_running,
        )  # fmt: skip

    async def first_token_text(self, token: int, params: SamplingParams) -> tuple[str, bool]:
        """The text a first token adds and whether a stop string ends the request there."""

        def detokenize() -> tuple[str, bool]:
            from phasefleet.engine.detokenizer import IncrementalDetokenizer

            decode = self.decoders[params.skip_special_tokens]
            detok = IncrementalDetokenizer(decode, params.stop, params.include_stop_str_in_output)
            detok.update([token])
            if detok.stopped:
                detok.flush()
                return detok.text(final=True), True
            return detok.text(final=False), False

        return await self.off_loop(detokenize)

    def check_model(self, model: str) -> str | None:
        """The LoRA adapter a request's `model` names, None for the base model; 404 for
        anything else."""
        if model == self.served_model_name:
            return None
        if model in self.lora_names:
            return model
        served = ", ".join(f"'{name}'" for name in (self.served_model_name, *self.lora_names))
        raise APIError(
            404,
            f"the model '{model}' does not exist; this worker serves {served}",
            param="model",
            code="model_not_found",
        )

    def check_lora(self, name: str, param: str) -> None:
        """A hand-off's adapter must be loaded here too (409: the decode worker prefills
        locally)."""
        if name not in self.lora_names:
            raise APIError(
                409,
                f"LoRA adapter '{name}' is not loaded on this prefill worker: give both pools "
                "the same --lora-modules",
                param=param,
                code="lora_not_loaded",
            )

    def check_priority(self, priority: int) -> int:
        """A request's priority (400 naming it when this worker does not schedule by one)."""
        if priority != 0 and self.scheduling_policy != "priority":
            raise bad_request(
                f"priority {priority} needs priority scheduling, which this worker is not "
                "started with (--scheduling-policy priority; spec.runtime.schedulingPolicy)",
                "priority",
            )
        return priority

    def check_accepting(self) -> None:
        if self.draining:
            raise unavailable("the worker is draining and takes no new requests", "draining")
        problem = self.engine.liveness()
        if problem == "engine_failed":
            raise unavailable("the engine failed and the worker is exiting", "engine_failed")
        if problem == "engine_stalled":
            raise unavailable("the engine has stopped making progress", "engine_stalled")
        if problem == "rank_failed":
            raise unavailable(f"{self.engine.rank_failure()}; the worker is exiting", "rank_failed")
        if not self.engine.ready:
            raise unavailable("the model is still loading", "not_ready")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    async def check_grammar(self, grammar: Grammar, field: str) -> None:
        """A 400 naming `field` when the grammar cannot be compiled. Compiled once (the engine
        copies it from the shared compiler), on a thread of its own: llguidance releases the
        GIL, and a large grammar holds up no other request's prompt. The compiler's first use
        reads the tokenizer, so that part runs on the tokenizer thread."""
        if self.grammars is None:
            eos = {self.tokenizer.eos_token_id} - {None}
            self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, eos)
        try:
            if not self.grammars.prepared:
                await self.off_loop(self.grammars.prepare)
            await asyncio.to_thread(self.grammars.matcher, grammar)
        except ValueError as exc:
            raise bad_request(f"{field} cannot be used: {exc}", field) from None

    def check_logit_bias(self, bias: Mapping[int, float]) -> None:
        if bias:
            self.check_token_ids(sorted(bias), "logit_bias")

    def check_token_ids(self, ids: list[int], field: str) -> list[int]:
        if not ids:
            raise bad_request(f"{field} must not be empty", field)
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise bad_request(
                f"{field} holds token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})",
                field,
            )
        return ids
