"""Tool calling: OpenAI's `tools` and `tool_choice` on chat, for the choices that force a call.

- a named function (`{"type": "function", "function": {"name": N}}`): the answer is N's
  arguments, JSON that its `parameters` schema accepts;
- `"required"`: one call or more, each of any of the tools, as a JSON list of
  `{"name": ..., "parameters": {...}}`;
- `"none"`: a text answer.

The tools are shown to the chat template either way. A forced call is a grammar (the engine's
structured output), so the model cannot answer otherwise, and the answer comes back as
`message.tool_calls` with finish_reason `tool_calls`. `"auto"`, the default when tools are sent,
needs a parser of the model's own tool-call format in free text, which this worker does not
have: a 400 that says what to send instead (vLLM answers the same without its
--enable-auto-tool-choice).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from phasefleet.engine.sampling_params import Grammar
from phasefleet.server.errors import bad_request
from phasefleet.server.openai_protocol import (
    ChatCompletionRequest,
    FunctionCall,
    NamedToolChoice,
    Tool,
    ToolCall,
)

ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}
AUTO_REFUSED = (
    "tool_choice 'auto' (the default when tools are sent) needs a parser of this model's own "
    "tool-call format, which this worker does not have; send tool_choice 'required', "
    "{'type': 'function', 'function': {'name': ...}} or 'none'"
)


def tool_grammar(req: ChatCompletionRequest) -> Grammar | None:
    """The grammar the request's tool_choice forces; None for a text answer. A 400 naming the
    field when the tools and tool_choice do not fit together."""
    tools = req.tools or []
    choice = req.tool_choice or ("auto" if tools else "none")
    if not tools and choice != "none":
        raise bad_request("tool_choice needs tools", "tool_choice")
    if choice == "none":
        return None
    if choice == "auto":
        raise bad_request(AUTO_REFUSED, "tool_choice")
    if choice == "required":
        return Grammar("json", json.dumps(_calls_schema(tools)))
    assert isinstance(choice, NamedToolChoice)
    named = [t for t in tools if t.function.name == choice.function.name]
    if not named:
        raise bad_request(
            f"tool_choice names the function '{choice.function.name}', which is not in tools",
            "tool_choice",
        )
    return Grammar("json", json.dumps(named[0].function.parameters or ANY_ARGUMENTS))


def _calls_schema(tools: list[Tool]) -> dict[str, Any]:
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
    return {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}


def forces_call(req: ChatCompletionRequest) -> bool:
    return bool(req.tools) and (
        isinstance(req.tool_choice, NamedToolChoice) or req.tool_choice == "required"
    )


def tool_calls(req: ChatCompletionRequest, text: str) -> list[ToolCall] | None:
    """The answer's tool calls; None when it is not one (a text answer, or a list of calls cut
    short by max_tokens). A named function's arguments are the text as it is (a prefix when
    cut short, as OpenAI's)."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return [_call(choice.function.name, text)]
    if not forces_call(req):
        return None
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    return [_call(c["name"], _compact(c["parameters"])) for c in calls]


def _compact(value: Any) -> str:
    """JSON as the grammar writes it: no whitespace."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def finish_reason(req: ChatCompletionRequest, reason: str | None) -> str | None:
    """'tool_calls' for a forced call the grammar completed, else the engine's reason."""
    return "tool_calls" if forces_call(req) and reason == "stop" else reason


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=arguments)
    )
