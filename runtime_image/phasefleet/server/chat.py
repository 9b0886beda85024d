"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template; `logprobs`
and `top_logprobs` give choices[].logprobs.content; with --reasoning-parser, a thought comes
back as `reasoning_content` (server/reasoning.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from phasefleet.server import tools
from phasefleet.server.errors import bad_request
from phasefleet.server.generation import (
    Generation,
    check_queue_room,
    check_supported,
    output_budget,
    sampling_params,
    truncated,
)
from phasefleet.server.logprobs import chat_logprobs, prompt_logprob_dicts
from phasefleet.server.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    Delta,
    Usage,
)
from phasefleet.server.reasoning import ReasoningStream, split_reasoning
from phasefleet.server.responses import collect_or_abort, sse_response
from phasefleet.server.state import WorkerState
from phasefleet.server.structured import checked_grammar
from phasefleet.server.token_rules import token_rules

if TYPE_CHECKING:
    from phasefleet.engine.llm_engine import RequestOutput


def render(req: ChatCompletionRequest, state: WorkerState) -> list[int]:
    """The prompt's token ids; templates and tokenizes, so it runs on the tokenizer thread."""
    messages = [_template_message(m) for m in req.messages]
    definitions = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        ids = state.tokenizer.apply_chat_template(
            messages,
            tools=definitions,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tokenize=True,
            **(req.chat_template_kwargs or {}),
        )
    except Exception as exc:  # jinja raises whatever the template author chose
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
    if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return state.check_token_ids(list(ids), "messages")


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: an earlier answer's tool calls and a tool's result
    (`tool_call_id`) go through as sent."""
    message: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name is not None:
        message["name"] = m.name
    extra = m.model_extra or {}
    for key in ("tool_calls", "tool_call_id"):
        if key in extra:
            message[key] = extra[key]
    return message


def _usage(prompt: list[int], finals: list[RequestOutput]) -> Usage:
    completion_tokens = sum(len(out.output_token_ids) for out in finals)
    return Usage(
        prompt_tokens=len(prompt),
        completion_tokens=completion_tokens,
        total_tokens=len(prompt) + completion_tokens,
    )


@dataclass
class StartedChat:
    """A chat request validated, rendered and handed to the engine."""

    gen: Generation
    prompt: list[int]  # the rendered prompt's token ids
    thinks: str | None  # the reasoning parser that splits the answer


async def start_chat(req: ChatCompletionRequest, raw: Request, state: WorkerState) -> StartedChat:
    """Checks, renders and starts `req` (a 4xx APIError for what cannot be served)."""
    arrival = time.monotonic()
    lora = state.check_model(req.model)
    check_supported(req)
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request(
            "continue_final_message continues the last message, add_generation_prompt opens a"
            " new one: set add_generation_prompt to false",
            "continue_final_message",
        )
    state.check_logit_bias(req.logit_bias_ids())
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    state.check_accepting()
    check_queue_room(1, req.n, state.engine.max_queue_len, "messages")
    grammar = await checked_grammar(req, state)
    rules = await token_rules(req, state)
    if grammar is not None and state.reasoning_parser is not None:  # the thought goes first
        grammar = replace(grammar, after=state.thought_end_ids)
    prompt = await state.off_loop(render, req, state)
    prompt = truncated(prompt, req.truncate_prompt_tokens, state.engine.max_model_len)
    budget = output_budget(
        len(prompt),
        req.requested_max_tokens(),
        state.sampling_defaults.max_tokens_or(None),
        state.engine.max_model_len,
        "messages",
    )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = [
        sampling_params(
            req, budget, i, state.sampling_defaults, logprobs, req.prompt_logprobs, grammar, rules
        )
        for i in range(req.n)
    ]
    gen = Generation(
        state.engine,
        state.metrics,
        [prompt] * req.n,
        params,
        arrival,
        "messages",
        remote=state.remote_prefill(raw.headers, [prompt] * req.n, lora),
        late_after_s=state.late_after_s(raw.headers),
        priority=state.check_priority(req.priority),
        lora=lora,
    )
    await gen.start()
    return StartedChat(gen, prompt, state.reasoning_parser)


async def create_chat_completion(
    req: ChatCompletionRequest, raw: Request, state: WorkerState
) -> Response:
    started = await start_chat(req, raw, state)
    gen, prompt, thinks = started.gen, started.prompt, started.thinks
    response_id = f"chatcmpl-{gen.request_id}"
    if req.stream:
        created = int(time.time())
        return sse_response(gen, _chunks(gen, req, state, prompt, thinks, response_id, created))
    finals = await collect_or_abort(gen, raw)
    ids = req.return_token_ids
    choices = []
    for i, out in enumerate(finals):
        message, reason = message_of(req, state, thinks, out.text, out.finish_reason)
        content_logprobs = None
        if req.logprobs:
            content_logprobs = await state.off_loop(chat_logprobs, state.tokenizer, gen.logprobs[i])
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                logprobs=content_logprobs,
                finish_reason=reason,
                prompt_token_ids=prompt if ids else None,
                token_ids=list(out.output_token_ids) if ids else None,
            )
        )
    prompt_part = None
    if req.prompt_logprobs is not None:
        entries = gen.prompt_logprobs[0] or []
        prompt_part = await state.off_loop(
            prompt_logprob_dicts, state.tokenizer, prompt, entries, req.prompt_logprobs
        )
    body = ChatCompletionResponse(
        id=response_id,
        model=req.model,
        choices=choices,
        usage=_usage(prompt, finals),
        prompt_logprobs=prompt_part,
    )
    return Response(body.model_dump_json(), media_type="application/json")


def message_of(
    req: ChatCompletionRequest,
    state: WorkerState,
    thinks: str | None,
    text: str,
    reason: str | None,
) -> tuple[AssistantMessage, str | None]:
    """A whole answer's message: its thought apart, then its tool calls found in the rest."""
    if thinks is None:
        return tools.answer(req, state.tool_call_parser, text, reason)
    split = split_reasoning(thinks, text)
    if split.content is None:  # all thought (cut short while thinking)
        return AssistantMessage(content=None, reasoning_content=split.reasoning), reason
    message, reason = tools.answer(req, state.tool_call_parser, split.content, reason)
    message.reasoning_content = split.reasoning
    return message, reason


class StreamedChoice:
    """One streamed choice: the text given out so far, its thought apart (with a reasoning
    parser), then its content through the tool-call stream."""

    def __init__(self, req: ChatCompletionRequest, parser: str | None, thinks: str | None):
        self.tools = tools.ChoiceStream(req, parser)
        self.thought = ReasoningStream(thinks) if thinks is not None else None
        self.sent = ""  # the answer's text so far
        self.content = ""  # of it, past the thought

    def delta(self, text: str, finished: bool) -> Delta:
        """The chunk's delta for `text`, the answer's new text."""
        thought = ""
        if self.thought is not None:
            thought, text = self.thought.feed(text, finished)
        self.content += text
        piece = self.tools.delta(text, finished, self.content)
        if thought:
            piece.reasoning_content = thought
        return piece


async def _chunks(
    gen: Generation,
    req: ChatCompletionRequest,
    state: WorkerState,
    prompt: list[int],
    thinks: str | None,
    response_id: str,
    created: int,
) -> AsyncIterator[str]:
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    ids = req.return_token_ids

    def chunk(choices: list[ChatChunkChoice]) -> str:
        return ChatCompletionChunk(
            id=response_id, created=created, model=req.model, choices=choices
        ).model_dump_json()

    # The first chunk of each choice carries the role, as OpenAI's does.
    yield chunk(
        [
            ChatChunkChoice(
                index=i,
                delta=Delta(role="assistant", content=""),
                prompt_token_ids=prompt if ids else None,
            )
            for i in range(req.n)
        ]
    )
    finals: list[RequestOutput] = []
    choices = [StreamedChoice(req, state.tool_call_parser, thinks) for _ in range(req.n)]
    async for event in gen.events():
        out, i = event.output, event.index
        streamed = choices[i]
        delta = out.text[len(streamed.sent) :]
        if not (delta or out.finished or ((ids or req.logprobs) and out.new_token_ids)):
            continue
        streamed.sent = out.text
        if out.finished:
            finals.append(out)
        piece = streamed.delta(delta, out.finished)
        if piece == Delta() and not out.finished and not ids and not req.logprobs:
            continue  # text held back (a call being written, a tag): nothing to send yet
        logprobs = None
        if req.logprobs:
            logprobs = await state.off_loop(chat_logprobs, state.tokenizer, out.logprobs or [])
        choice = ChatChunkChoice(
            index=i,
            delta=piece,
            logprobs=logprobs,
            finish_reason=streamed.tools.finish_reason(out.finish_reason) if out.finished else None,
            token_ids=list(out.new_token_ids) if ids else None,
        )
        yield chunk([choice])
    if include_usage:
        yield ChatCompletionChunk(
            id=response_id,
            created=created,
            model=req.model,
            choices=[],
            usage=_usage(prompt, finals),
        ).model_dump_json()
