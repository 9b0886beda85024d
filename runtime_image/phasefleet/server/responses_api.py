"""POST /v1/responses: OpenAI's Responses API for text, as a chat underneath.

`instructions` become a system message and `input` (a string, or messages whose content is a
string or `input_text` / `output_text` parts) the conversation; `max_output_tokens`,
`temperature` and `top_p` sample it; `text.format` (`json_object`, or `json_schema` with the
schema in the format) shapes it as chat's `response_format` does. The answer is one `message`
output item with one `output_text` part (and, with --reasoning-parser, a `reasoning` item before
it); streamed, it is OpenAI's event sequence (`response.created` ...
`response.output_text.delta` ... `response.completed`, or `response.incomplete` when cut short),
each event named in an `event:` line and numbered by `sequence_number`.

Stateless: responses are not stored (`store` is accepted, nothing can be retrieved), so
`previous_response_id` is a 400, as are `tools` (served on /v1/chat/completions).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from phasefleet.server.chat import StartedChat, StreamedChoice, start_chat
from phasefleet.server.errors import APIError
from phasefleet.server.openai_protocol import ChatCompletionRequest, ResponsesRequest
from phasefleet.server.reasoning import split_reasoning
from phasefleet.server.responses import GenerationStream, collect_or_abort
from phasefleet.server.state import WorkerState


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class _Answer:
    """One response's state and the JSON objects OpenAI's shape gives it."""

    def __init__(self, req: ResponsesRequest, started: StartedChat) -> None:
        self.req = req
        self.id = f"resp_{started.gen.request_id}"
        self.message_id = _item_id("msg")
        self.reasoning_id = _item_id("rs")
        self.created_at = int(time.time())
        self.input_tokens = len(started.prompt)
        self.output_tokens = 0
        self.text = ""
        self.reasoning: str | None = None
        self.cut_short = False  # finished at max_output_tokens

    def message(self, done: bool) -> dict[str, Any]:
        content = [self.part()] if done else []
        status = "completed" if done else "in_progress"
        return {
            "type": "message", "id": self.message_id, "status": status, "role": "assistant",
            "content": content,
        }  # fmt: skip

    def part(self, text: str | None = None) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text if text is None else text,
                "annotations": [], "logprobs": []}  # fmt: skip

    def reasoning_item(self) -> dict[str, Any]:
        return {
            "type": "reasoning", "id": self.reasoning_id, "status": "completed", "summary": [],
            "content": [{"type": "reasoning_text", "text": self.reasoning or ""}],
        }  # fmt: skip

    def output(self) -> list[dict[str, Any]]:
        items = [self.reasoning_item()] if self.reasoning is not None else []
        return [*items, self.message(done=True)]

    def body(self, status: str) -> dict[str, Any]:
        finished = status in ("completed", "incomplete")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.req.model,
            "output": self.output() if finished else [],
            "instructions": self.req.instructions,
            "max_output_tokens": self.req.max_output_tokens,
            "temperature": self.req.temperature,
            "top_p": self.req.top_p,
            "metadata": self.req.metadata or {},
            "previous_response_id": None,
            "store": False,
            "text": {"format": self.req.text_format()},
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if self.cut_short else None,
            "usage": self.usage() if finished else None,
        }

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }

    def status(self) -> str:
        return "incomplete" if self.cut_short else "completed"


async def create_response(req: ResponsesRequest, raw: Request, state: WorkerState) -> Response:
    chat = req.as_chat()
    started = await start_chat(chat, raw, state)
    answer = _Answer(req, started)
    if req.stream:
        events = _events(answer, started, chat, state)
        return GenerationStream(
            started.gen, _framed(events), "text/event-stream", {"Cache-Control": "no-cache"}
        )
    (final,) = await collect_or_abort(started.gen, raw)
    answer.output_tokens = len(final.output_token_ids)
    answer.cut_short = final.finish_reason == "length"
    answer.text = final.text
    if started.thinks is not None:
        split = split_reasoning(started.thinks, final.text)
        answer.reasoning, answer.text = split.reasoning, split.content or ""
    return Response(json.dumps(answer.body(answer.status())), media_type="application/json")


async def _events(
    answer: _Answer, started: StartedChat, chat: ChatCompletionRequest, state: WorkerState
) -> AsyncIterator[dict[str, Any]]:
    """OpenAI's event sequence for one streamed response (without sequence numbers)."""
    yield {"type": "response.created", "response": answer.body("in_progress")}
    yield {"type": "response.in_progress", "response": answer.body("in_progress")}
    streamed = StreamedChoice(chat, state.tool_call_parser, started.thinks)
    at = {"item_id": answer.message_id, "content_index": 0}
    opened = False
    thought = ""
    async for event in started.gen.events():
        out = event.output
        delta = out.text[len(streamed.sent) :]
        streamed.sent = out.text
        piece = streamed.delta(delta, out.finished)
        thought += piece.reasoning_content or ""
        if (piece.content or out.finished) and not opened:
            opened = True
            if thought or started.thinks == "deepseek_r1":
                answer.reasoning = thought
                item = answer.reasoning_item()
                yield {"type": "response.output_item.added", "output_index": 0, "item": item}
                yield {"type": "response.output_item.done", "output_index": 0, "item": item}
            index = 1 if answer.reasoning is not None else 0
            at["output_index"] = index
            message = answer.message(done=False)
            yield {"type": "response.output_item.added", "output_index": index, "item": message}
            yield {"type": "response.content_part.added", **at, "part": answer.part("")}
        if piece.content:
            answer.text += piece.content
            yield {"type": "response.output_text.delta", **at, "delta": piece.content,
                   "logprobs": []}  # fmt: skip
        if out.finished:
            answer.output_tokens = len(out.output_token_ids)
            answer.cut_short = out.finish_reason == "length"
    yield {"type": "response.output_text.done", **at, "text": answer.text, "logprobs": []}
    yield {"type": "response.content_part.done", **at, "part": answer.part()}
    done = answer.message(done=True)
    yield {"type": "response.output_item.done", "output_index": at["output_index"], "item": done}
    yield {"type": f"response.{answer.status()}", "response": answer.body(answer.status())}


async def _framed(events: AsyncIterator[dict[str, Any]]) -> AsyncGenerator[str, None]:
    """Server-sent events as OpenAI frames them: `event: <type>` then `data: <json>`, each
    numbered; an error after the 200 is an `error` event."""
    number = 0
    try:
        async for event in events:
            event["sequence_number"] = number
            number += 1
            yield f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
    except APIError as err:
        body = {"type": "error", "sequence_number": number, **err.body()["error"]}
        yield f"event: error\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"
