"""POST /v1/completions: a text or token-id prompt (or a batch of them), streamed or not, with
`logprobs` (the legacy shape) and `echo` (the prompt before the output; with `logprobs`, the
prompt tokens' logprobs too, the first one null)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

from phasefleet.server.generation import (
    Generation,
    check_queue_room,
    check_supported,
    output_budget,
    sampling_params,
    truncated,
)
from phasefleet.server.logprobs import (
    CompletionLogprobs,
    completion_logprobs,
    prompt_logprob_dicts,
)
from phasefleet.server.openai_protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from phasefleet.server.responses import collect_or_abort, sse_response
from phasefleet.server.state import WorkerState
from phasefleet.server.structured import checked_grammar
from phasefleet.server.token_rules import token_rules

if TYPE_CHECKING:
    from phasefleet.engine.llm_engine import RequestOutput
    from phasefleet.engine.outputs import TokenLogprob

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def num_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> int:
    """How many prompts a `prompt` (or embeddings' `input`) holds: a text, token ids, or a
    list of either."""
    if isinstance(prompt, str) or not prompt or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def prompts_of(
    prompt: str | list[int] | list[str] | list[list[int]], state: WorkerState, field: str
) -> list[list[int]]:
    """Token ids of every prompt in `prompt` (request field `field`); tokenizes, so it runs on
    the tokenizer thread."""
    if isinstance(prompt, str):
        return [state.check_token_ids(state.encode(prompt), field)]
    if not prompt:
        return [state.check_token_ids([], field)]
    if all(isinstance(p, int) for p in prompt):
        return [state.check_token_ids([int(p) for p in prompt], field)]  # type: ignore[arg-type]
    batch: list[list[int]] = []
    for item in prompt:
        ids = state.encode(item) if isinstance(item, str) else list(item)  # type: ignore[arg-type]
        batch.append(state.check_token_ids(ids, field))
    return batch


def echo_texts(req: CompletionRequest, prompts: list[list[int]], state: WorkerState) -> list[str]:
    """Each prompt as `echo` shows it: a text prompt as sent, token ids (or a prompt
    `truncate_prompt_tokens` cut) decoded (tokenizer thread)."""
    prompt = req.prompt
    single = isinstance(prompt, str) or all(isinstance(p, int) for p in prompt)
    items = [prompt] if single else list(prompt)
    cut = req.truncate_prompt_tokens is not None
    return [
        item if isinstance(item, str) and not cut else str(state.tokenizer.decode(ids))
        for item, ids in zip(items, prompts, strict=True)
    ]


@dataclass
class Echo:
    """What one choice's answer shows before its output with `echo`."""

    text: str  # the prompt's text
    token_ids: list[int]  # the prompt's tokens


async def create_completion(req: CompletionRequest, raw: Request, state: WorkerState) -> Response:
    arrival = time.monotonic()
    lora = state.check_model(req.model)
    check_supported(req)
    state.check_logit_bias(req.logit_bias_ids())
    state.check_accepting()
    check_queue_room(num_prompts(req.prompt), req.n, state.engine.max_queue_len, "prompt")
    grammar = await checked_grammar(req, state)
    rules = await token_rules(req, state)
    prompts = await state.off_loop(prompts_of, req.prompt, state, "prompt")
    max_len = state.engine.max_model_len
    prompts = [truncated(p, req.truncate_prompt_tokens, max_len) for p in prompts]
    texts = await state.off_loop(echo_texts, req, prompts, state) if req.echo else []
    requested = req.max_tokens if "max_tokens" in req.model_fields_set else None
    # the engine's count: echo's logprobs, vLLM's prompt_logprobs, or the larger of the two
    asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    prompt_logprobs = max(asked) if asked else None
    default = state.sampling_defaults.max_tokens_or(DEFAULT_MAX_TOKENS)
    choice_prompts, params, echoes = [], [], []
    for p, prompt in enumerate(prompts):
        budget = output_budget(len(prompt), requested, default, max_len, "prompt")
        for sample in range(req.n):
            choice_prompts.append(prompt)
            params.append(
                sampling_params(
                    req,
                    budget,
                    sample,
                    state.sampling_defaults,
                    req.logprobs,
                    prompt_logprobs,
                    grammar,
                    rules,
                )  # fmt: skip
            )
            echoes.append(Echo(texts[p], prompt) if req.echo else None)
    gen = Generation(
        state.engine,
        state.metrics,
        choice_prompts,
        params,
        arrival,
        "prompt",
        remote=state.remote_prefill(raw.headers, choice_prompts, lora),
        late_after_s=state.late_after_s(raw.headers),
        priority=state.check_priority(req.priority),
        lora=lora,
    )
    await gen.start()
    response_id = f"cmpl-{gen.request_id}"
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        chunks = _chunks(gen, req, state, prompts, echoes, response_id, include_usage)
        return sse_response(gen, chunks)
    finals = await collect_or_abort(gen, raw)
    choices = []
    for i, out in enumerate(finals):
        echo = echoes[i]
        logprobs = prompt_part = None
        if req.logprobs is not None:
            entries = gen.logprobs[i]
            echoed = _top(gen.prompt_logprobs[i], req.logprobs)
            logprobs, _ = await state.off_loop(
                _logprobs, state, echo, echoed, entries, out.output_token_ids, 0
            )
        if req.prompt_logprobs is not None:
            entries = gen.prompt_logprobs[i] or []
            prompt_part = await state.off_loop(
                prompt_logprob_dicts,
                state.tokenizer,
                choice_prompts[i],
                entries,
                req.prompt_logprobs,
            )
        choices.append(
            CompletionChoice(
                index=i,
                text=(echo.text if echo else "") + out.text,
                logprobs=logprobs,
                finish_reason=out.finish_reason,
                prompt_token_ids=choice_prompts[i] if req.return_token_ids else None,
                token_ids=list(out.output_token_ids) if req.return_token_ids else None,
                prompt_logprobs=prompt_part,
            )
        )
    body = CompletionResponse(
        id=response_id, model=req.model, choices=choices, usage=_usage(prompts, finals)
    )
    return Response(body.model_dump_json(), media_type="application/json")


def _logprobs(
    state: WorkerState,
    echo: Echo | None,
    prompt_entries: list[TokenLogprob] | None,
    entries: list[TokenLogprob],
    token_ids: list[int],
    text_offset: int,
) -> tuple[CompletionLogprobs, int]:
    """Logprobs of the echoed prompt (if any) then of `token_ids`, from `text_offset` on."""
    all_entries: list[TokenLogprob | None] = list(entries)
    all_ids = list(token_ids)
    if echo is not None:
        prompt_part = [None, *(prompt_entries or [])]
        prompt_part += [None] * (len(echo.token_ids) - len(prompt_part))
        all_entries = prompt_part + all_entries
        all_ids = echo.token_ids + all_ids
    return completion_logprobs(state.tokenizer, all_entries, all_ids, text_offset)


def _top(entries: list[TokenLogprob] | None, num_top: int) -> list[TokenLogprob] | None:
    """`entries` with at most `num_top` alternatives each (the engine computed the larger of
    echo's and prompt_logprobs' counts)."""
    if entries is None or all(len(e.top) <= num_top for e in entries):
        return entries
    return [replace(e, top=e.top[:num_top]) for e in entries]


def _usage(prompts: list[list[int]], finals: list[RequestOutput]) -> Usage:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(out.output_token_ids) for out in finals)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


async def _chunks(
    gen: Generation,
    req: CompletionRequest,
    state: WorkerState,
    prompts: list[list[int]],
    echoes: list[Echo | None],
    response_id: str,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())
    sent_text = [""] * len(gen.prompts)
    started = [False] * len(gen.prompts)
    text_offsets = [0] * len(gen.prompts)
    finals: list[RequestOutput] = []
    every_token = req.return_token_ids or req.logprobs is not None
    async for event in gen.events():
        out, i = event.output, event.index
        delta = out.text[len(sent_text[i]) :]
        if not (delta or out.finished or (every_token and out.new_token_ids)):
            continue
        sent_text[i] = out.text
        echo = None if started[i] else echoes[i]  # the prompt goes first, once
        logprobs = None
        if req.logprobs is not None:
            logprobs, text_offsets[i] = await state.off_loop(
                _logprobs,
                state,
                echo,
                out.prompt_logprobs,
                out.logprobs or [],
                out.new_token_ids,
                text_offsets[i],
            )
        choice = CompletionChoice(
            index=i,
            text=(echo.text if echo else "") + delta,
            logprobs=logprobs,
            finish_reason=out.finish_reason if out.finished else None,
            token_ids=list(out.new_token_ids) if req.return_token_ids else None,
            prompt_token_ids=gen.prompts[i] if req.return_token_ids and not started[i] else None,
        )
        started[i] = True
        if out.finished:
            finals.append(out)
        chunk = CompletionResponse(
            id=response_id, created=created, model=req.model, choices=[choice]
        )
        yield chunk.model_dump_json()
    if include_usage:
        chunk = CompletionResponse(
            id=response_id,
            created=created,
            model=req.model,
            choices=[],
            usage=_usage(prompts, finals),
        )
        yield chunk.model_dump_json()
