"""POST /v1/completions: a text or token-id prompt (or a batch of them), streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

from phasefleet.server.generation import (
    Generation,
    check_queue_room,
    check_supported,
    output_budget,
    sampling_params,
)
from phasefleet.server.openai_protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from phasefleet.server.responses import collect_or_abort, sse_response
from phasefleet.server.state import WorkerState

if TYPE_CHECKING:
    from phasefleet.engine.llm_engine import RequestOutput

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def num_prompts(req: CompletionRequest) -> int:
    prompt = req.prompt
    if isinstance(prompt, str) or not prompt or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def prompts_of(req: CompletionRequest, state: WorkerState) -> list[list[int]]:
    """Token ids of every prompt; tokenizes, so it runs on the tokenizer thread."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [state.check_token_ids(state.encode(prompt), "prompt")]
    if not prompt:
        return [state.check_token_ids([], "prompt")]
    if all(isinstance(p, int) for p in prompt):
        return [state.check_token_ids([int(p) for p in prompt], "prompt")]  # type: ignore[arg-type]
    batch: list[list[int]] = []
    for item in prompt:
        ids = state.encode(item) if isinstance(item, str) else list(item)  # type: ignore[arg-type]
        batch.append(state.check_token_ids(ids, "prompt"))
    return batch


async def create_completion(req: CompletionRequest, raw: Request, state: WorkerState) -> Response:
    arrival = time.monotonic()
    state.check_model(req.model)
    check_supported(req)
    state.check_accepting()
    check_queue_room(num_prompts(req), req.n, state.engine.max_queue_len, "prompt")
    prompts = await state.off_loop(prompts_of, req, state)
    requested = req.max_tokens if "max_tokens" in req.model_fields_set else None
    max_len = state.engine.max_model_len
    choice_prompts, params = [], []
    for prompt in prompts:
        budget = output_budget(len(prompt), requested, DEFAULT_MAX_TOKENS, max_len, "prompt")
        for sample in range(req.n):
            choice_prompts.append(prompt)
            params.append(sampling_params(req, budget, sample))
    gen = Generation(
        state.engine,
        state.metrics,
        choice_prompts,
        params,
        arrival,
        "prompt",
        remote=state.remote_prefill(raw.headers, choice_prompts),
    )
    await gen.start()
    response_id = f"cmpl-{gen.request_id}"
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return sse_response(
            gen, _chunks(gen, req, prompts, response_id, include_usage, int(time.time()))
        )
    finals = await collect_or_abort(gen, raw)
    choices = [
        CompletionChoice(
            index=i,
            text=out.text,
            finish_reason=out.finish_reason,
            prompt_token_ids=choice_prompts[i] if req.return_token_ids else None,
            token_ids=list(out.output_token_ids) if req.return_token_ids else None,
        )
        for i, out in enumerate(finals)
    ]
    body = CompletionResponse(
        id=response_id, model=req.model, choices=choices, usage=_usage(prompts, finals)
    )
    return Response(body.model_dump_json(), media_type="application/json")


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
    prompts: list[list[int]],
    response_id: str,
    include_usage: bool,
    created: int,
) -> AsyncIterator[str]:
    sent_text = [""] * len(gen.prompts)
    started = [False] * len(gen.prompts)
    finals: list[RequestOutput] = []
    async for event in gen.events():
        out, i = event.output, event.index
        delta = out.text[len(sent_text[i]) :]
        if not (delta or out.finished or (req.return_token_ids and out.new_token_ids)):
            continue
        sent_text[i] = out.text
        choice = CompletionChoice(
            index=i,
            text=delta,
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
