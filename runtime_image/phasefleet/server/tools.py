"""Tool calling: OpenAI's `tools` and `tool_choice` on chat, for the choices that force a call.

- a named function (`{"type": "function", "function": {"name": N}}`): the answer is N's
  arguments, JSON that its `parameters` schema accepts;
- `"required"`: one call or more, each of any of the tools, as a JSON list of
  `{"name": ..., "parameters": {...}}` (exactly one with `parallel_tool_calls: false`);
- `"none"`: a text answer;
- `"auto"`, the default when tools are sent: free text, whose calls a parser of the model's own
  format finds (`--tool-call-parser`: server/tool_parsers.py), the first alone with
  `parallel_tool_calls: false` (the later ones are dropped); without a parser, a
  400 that says what to send instead (vLLM answers the same without its
  --enable-auto-tool-choice).

The tools are shown to the chat template either way. A forced call is a grammar (the engine's
structured output), so the model cannot answer otherwise. Calls come back as
`message.tool_calls` with finish_reason `tool_calls`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from phasefleet.engine.sampling_params import Grammar
from phasefleet.server.errors import bad_request
from phasefleet.server.openai_protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    Delta,
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolCallDelta,
)
from phasefleet.server.tool_parsers import split_calls, splitter

ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}
AUTO_REFUSED = (
    "tool_choice 'auto' (the default when tools are sent) needs a parser of this model's own "
    "tool-call format, which this worker was not started with (--tool-call-parser); send "
    "tool_choice 'required', {'type': 'function', 'function': {'name': ...}} or 'none'"
)


def tool_grammar(req: ChatCompletionRequest, parser: str | None) -> Grammar | None:
    """The grammar the request's tool_choice forces; None for a text answer (with `parser`,
    'auto' is one: its calls are found in the text). A 400 naming the field when the tools and
    tool_choice do not fit together."""
    tools = req.tools or []
    choice = req.tool_choice or ("auto" if tools else "none")
    if not tools and choice != "none":
        raise bad_request("tool_choice needs tools", "tool_choice")
    if choice == "none":
        return None
    if choice == "auto":
        if parser is None:
            raise bad_request(AUTO_REFUSED, "tool_choice")
        return None
    if not isinstance(choice, NamedToolChoice):  # "required"
        return Grammar("json", json.dumps(_calls_schema(tools, req.parallel_tool_calls)))
    named = [t for t in tools if t.function.name == choice.function.name]
    if not named:
        raise bad_request(
            f"tool_choice names the function '{choice.function.name}', which is not in tools",
            "tool_choice",
        )
    return Grammar("json", json.dumps(named[0].function.parameters or ANY_ARGUMENTS))


def _calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    one_call = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "parameters": t.function.parameters or ANY_ARGUMENTS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
    return schema if parallel else {**schema, "maxItems": 1}


def forces_call(req: ChatCompletionRequest) -> bool:
    return bool(req.tools) and (
        isinstance(req.tool_choice, NamedToolChoice) or req.tool_choice == "required"
    )


def parses_calls(req: ChatCompletionRequest, parser: str | None) -> bool:
    """tool_choice 'auto' with a parser: the answer is free text, its calls found in it."""
    return bool(req.tools) and parser is not None and req.tool_choice in (None, "auto")


def answer(
    req: ChatCompletionRequest, parser: str | None, text: str, reason: str | None
) -> tuple[AssistantMessage, str | None]:
    """A whole answer as the message and finish_reason a client gets."""
    if parser is not None and parses_calls(req, parser):
        content, found = split_calls(parser, text)
        if not req.parallel_tool_calls:
            found = found[:1]
        if not found:
            return AssistantMessage(content=text), reason
        calls = [_call(c.name, c.arguments) for c in found]
        return AssistantMessage(content=content.strip() or None, tool_calls=calls), _called(reason)
    forced = _forced_calls(req, text)
    if forced is None:
        return AssistantMessage(content=text), reason
    return AssistantMessage(content=None, tool_calls=forced), _called(reason)


def _forced_calls(req: ChatCompletionRequest, text: str) -> list[ToolCall] | None:
    """A forced answer's calls; None when it is not one (a text answer, or a list of calls cut
    short by max_tokens). A named function's arguments are the text as it is (a prefix when
    cut short, as OpenAI's)."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice) and req.tools:
        return [_call(choice.function.name, text)]
    if not forces_call(req):
        return None
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    return [_call(c["name"], _compact(c["parameters"])) for c in calls]


def _called(reason: str | None) -> str | None:
    """'tool_calls' for an answer that ended on its own with calls, else the engine's reason."""
    return "tool_calls" if reason == "stop" else reason


def _compact(value: Any) -> str:
    """JSON as the grammar writes it: no whitespace."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=_call_id(), function=FunctionCall(name=name, arguments=arguments))


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceStream:
    """One streamed choice's deltas: text as it comes; a named function's arguments as they
    come, the first piece with the call's id and name; a list of forced calls whole with the
    last chunk (its text when it is not one: cut short); with a parser, text with each call
    whole once its block closes (text that could begin one held back until it is decided)."""

    def __init__(self, req: ChatCompletionRequest, parser: str | None) -> None:
        self.req = req
        self.splitter = (
            splitter(parser) if parser is not None and parses_calls(req, parser) else None
        )
        self.call_id = _call_id()
        self.started = False  # a named function's call has had its first piece

    def delta(self, text: str, finished: bool, whole: str) -> Delta:
        """`text`: what is new; `whole`: the answer so far."""
        choice = self.req.tool_choice
        if self.splitter is not None:
            content, found = self.splitter.feed(text, finished)
            first = len(self.splitter.calls_found) - len(found)
            if not self.req.parallel_tool_calls:  # the first call alone
                found = found[: max(0, 1 - first)]
            calls = [_call(c.name, c.arguments) for c in found]
            return Delta(content=content or None, tool_calls=_deltas(calls, first) or None)
        if isinstance(choice, NamedToolChoice) and self.req.tools:
            if not text:
                return Delta()
            first, self.started = not self.started, True
            call = ToolCallDelta(
                index=0,
                id=self.call_id if first else None,
                type="function" if first else None,
                function=FunctionCallDelta(
                    name=choice.function.name if first else None, arguments=text
                ),
            )
            return Delta(tool_calls=[call])
        if not forces_call(self.req):
            return Delta(content=text) if text else Delta()
        if not finished:
            return Delta()
        forced = _forced_calls(self.req, whole)
        return Delta(content=whole) if forced is None else Delta(tool_calls=_deltas(forced, 0))

    def finish_reason(self, reason: str | None) -> str | None:
        called = forces_call(self.req) or (self.splitter is not None and self.splitter.calls_found)
        return _called(reason) if called else reason


def _deltas(calls: list[ToolCall], first: int) -> list[ToolCallDelta]:
    return [
        ToolCallDelta(
            index=first + k,
            id=call.id,
            type="function",
            function=FunctionCallDelta(name=call.function.name, arguments=call.function.arguments),
        )
        for k, call in enumerate(calls)
    ]
