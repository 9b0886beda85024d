"""POST /v1/responses: OpenAI's Responses API for text and function tools, as a chat underneath.

`instructions` become a system message and `input` (a string, or messages whose content is a
string or `input_text` / `output_text` parts) the conversation; `max_output_tokens`,
`temperature` and `top_p` sample it; `text.format` (`json_object`, or `json_schema` with the
schema in the format) shapes it as chat's `response_format` does. The answer is one `message`
output item with one `output_text` part (and, with --reasoning-parser, a `reasoning` item before
it); streamed, it is OpenAI's event sequence (`response.created` ...
`response.reasoning_text.delta` ... `response.output_text.delta` ... `response.completed`, or
`response.incomplete` when cut short), each event named in an `event:` line and numbered by
`sequence_number`.

Function tools are chat's (server/tools.py): a call comes back as a `function_call` item after
the message (none when the answer is calls alone). Streamed, a named function's arguments come
as they are generated (its item opened at the first piece); other calls come whole once the
answer is done. Earlier calls and their outputs in `input` become chat's tool calls and tool
messages.

Stateless: responses are not stored (`store` is accepted, nothing can be retrieved), so
`previous_response_id` is a 400.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from phasefleet.server.chat import StartedChat, StreamedChoice, message_of, start_chat
from phasefleet.server.errors import APIError
from phasefleet.server.openai_protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
    ResponsesRequest,
    ToolCall,
    ToolCallDelta,
)
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
        self.calls: list[ToolCall] = []  # function calls, after the message (if any)
        self.cut_short = False  # finished at max_output_tokens
        self.streamed_items = 0  # output items a stream has opened

    def next_index(self) -> int:
        """The output_index of the next item a stream opens."""
        self.streamed_items += 1
        return self.streamed_items - 1

    def has_message(self) -> bool:
        """An answer of calls alone has no message item."""
        return bool(self.text) or not self.calls

    def call_item(self, call: ToolCall) -> dict[str, Any]:
        return {
            "type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}",
            "call_id": call.id, "name": call.function.name,
            "arguments": call.function.arguments, "status": "completed",
        }  # fmt: skip

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
        if self.has_message():
            items.append(self.message(done=True))
        return items + [self.call_item(c) for c in self.calls]

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
            "tools": self.req.tools or [],
            "tool_choice": self.req.tool_choice or "auto",
            "parallel_tool_calls": self.req.parallel_tool_calls,
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
    message, _ = message_of(chat, state, started.thinks, final.text, final.finish_reason)
    answer.reasoning = message.reasoning_content
    answer.text = message.content or ""
    answer.calls = message.tool_calls or []
    return Response(json.dumps(answer.body(answer.status())), media_type="application/json")


async def _events(
    answer: _Answer, started: StartedChat, chat: ChatCompletionRequest, state: WorkerState
) -> AsyncIterator[dict[str, Any]]:
    """OpenAI's event sequence for one streamed response (without sequence numbers): the
    reasoning item and the message as their text comes, then each function call whole."""
    yield {"type": "response.created", "response": answer.body("in_progress")}
    yield {"type": "response.in_progress", "response": answer.body("in_progress")}
    streamed = StreamedChoice(chat, state.tool_call_parser, started.thinks)
    at = {"item_id": answer.message_id, "content_index": 0}
    opened = False
    thought = _Thought(answer, started.thinks)
    forced = isinstance(chat.tool_choice, NamedToolChoice) and chat.tools
    named = _NamedCall(answer) if forced else None
    text, reason = "", None  # the whole answer, once finished: its calls are read from it
    async for event in started.gen.events():
        out = event.output
        delta = out.text[len(streamed.sent) :]
        streamed.sent = out.text
        piece = streamed.delta(delta, out.finished)
        for e in thought.piece(piece.reasoning_content or ""):
            yield e
        if named is not None and piece.tool_calls:
            for e in thought.close():
                yield e
            for e in named.pieces(piece.tool_calls):
                yield e
        if piece.content and not opened:
            opened = True
            for e in thought.close():
                yield e
            at["output_index"] = answer.next_index()
            for e in _message_start(answer, at):
                yield e
        if piece.content:
            answer.text += piece.content
            yield {"type": "response.output_text.delta", **at, "delta": piece.content,
                   "logprobs": []}  # fmt: skip
        if out.finished:
            answer.output_tokens = len(out.output_token_ids)
            answer.cut_short = out.finish_reason == "length"
            text, reason = out.text, out.finish_reason
    message, _ = message_of(chat, state, started.thinks, text, reason)  # as a whole response's
    answer.calls = message.tool_calls or []
    if named is not None and named.at is not None and answer.calls:  # streamed already
        answer.calls[0] = answer.calls[0].model_copy(update={"id": named.call_id})
        for e in named.close(answer.calls[0]):
            yield e
    if not opened:
        for e in thought.close():
            yield e
        if answer.has_message():  # an empty answer: its message all the same
            opened = True
            at["output_index"] = answer.next_index()
            for e in _message_start(answer, at):
                yield e
    if opened:
        yield {"type": "response.output_text.done", **at, "text": answer.text, "logprobs": []}
        yield {"type": "response.content_part.done", **at, "part": answer.part()}
        done = answer.message(done=True)
        yield {"type": "response.output_item.done", "output_index": at["output_index"],
               "item": done}  # fmt: skip
    for call in answer.calls[1 if named is not None and named.at is not None else 0 :]:
        item = answer.call_item(call)
        index = {"output_index": answer.next_index(), "item_id": item["id"]}
        yield {"type": "response.output_item.added", "output_index": index["output_index"],
               "item": {**item, "arguments": "", "status": "in_progress"}}  # fmt: skip
        yield {"type": "response.function_call_arguments.delta", **index,
               "delta": item["arguments"]}  # fmt: skip
        yield {"type": "response.function_call_arguments.done", **index,
               "arguments": item["arguments"]}  # fmt: skip
        yield {"type": "response.output_item.done", "output_index": index["output_index"],
               "item": item}  # fmt: skip
    yield {"type": f"response.{answer.status()}", "response": answer.body(answer.status())}


def _message_start(answer: _Answer, at: dict[str, Any]) -> list[dict[str, Any]]:
    message = answer.message(done=False)
    return [
        {"type": "response.output_item.added", "output_index": at["output_index"],
         "item": message},
        {"type": "response.content_part.added", **at, "part": answer.part("")},
    ]  # fmt: skip


class _NamedCall:
    """A stream's call of the named function (tool_choice naming it): its item opened at the
    first piece of its arguments, each piece a `response.function_call_arguments.delta`, closed
    once the answer is done."""

    def __init__(self, answer: _Answer) -> None:
        self.answer = answer
        self.call_id = ""  # chat's id for the call, from its first piece
        self.at: dict[str, Any] | None = None  # output_index and item_id once open

    def pieces(self, deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
        events = []
        for delta in deltas:
            if self.at is None:
                self.call_id = delta.id or ""
                self.at = {"output_index": self.answer.next_index(),
                           "item_id": f"fc_{self.call_id.removeprefix('call_')}"}  # fmt: skip
                name = delta.function.name if delta.function else None
                item = {"type": "function_call", "id": self.at["item_id"], "call_id": self.call_id,
                        "name": name, "arguments": "", "status": "in_progress"}  # fmt: skip
                events.append({"type": "response.output_item.added",
                               "output_index": self.at["output_index"], "item": item})  # fmt: skip
            arguments = delta.function.arguments if delta.function else None
            if arguments:
                events.append({"type": "response.function_call_arguments.delta", **self.at,
                               "delta": arguments})  # fmt: skip
        return events

    def close(self, call: ToolCall) -> list[dict[str, Any]]:
        assert self.at is not None
        item = self.answer.call_item(call)
        return [
            {"type": "response.function_call_arguments.done", **self.at,
             "arguments": item["arguments"]},
            {"type": "response.output_item.done", "output_index": self.at["output_index"],
             "item": item},
        ]  # fmt: skip


class _Thought:
    """A stream's reasoning item: opened at the thought's first piece, its text streamed as
    `response.reasoning_text.delta`, closed before the message (or at the end)."""

    def __init__(self, answer: _Answer, thinks: str | None) -> None:
        self.answer, self.thinks = answer, thinks
        self.at: dict[str, Any] | None = None  # item_id, output_index, content_index once open
        self.closed = False

    def _open(self) -> dict[str, Any]:
        self.answer.reasoning = ""
        self.at = {"item_id": self.answer.reasoning_id, "output_index": self.answer.next_index(),
                   "content_index": 0}  # fmt: skip
        item = {**self.answer.reasoning_item(), "status": "in_progress", "content": []}
        return {"type": "response.output_item.added", "output_index": self.at["output_index"],
                "item": item}  # fmt: skip

    def piece(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = [self._open()] if self.at is None else []
        assert self.at is not None and self.answer.reasoning is not None
        self.answer.reasoning += text
        events.append({"type": "response.reasoning_text.delta", **self.at, "delta": text})
        return events

    def close(self) -> list[dict[str, Any]]:
        """The item's end; for a thought the template opened that stayed empty (deepseek_r1),
        the whole item all the same."""
        if self.closed or (self.at is None and self.thinks != "deepseek_r1"):
            return []
        self.closed = True
        events = [self._open()] if self.at is None else []
        assert self.at is not None
        item = self.answer.reasoning_item()
        events.append({"type": "response.reasoning_text.done", **self.at,
                       "text": self.answer.reasoning or ""})  # fmt: skip
        events.append({"type": "response.output_item.done", "output_index": self.at["output_index"],
                       "item": item})  # fmt: skip
        return events


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
