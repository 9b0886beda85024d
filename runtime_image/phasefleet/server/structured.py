"""Structured output from the API: the request fields that constrain the output, as the engine's
`Grammar`. OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` (`json`, `json_object`, `regex`, `choice`, `grammar`), vLLM's older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and a chat's forced tool
call (server/tools.py); a request sets at most one. The grammar is compiled here, off the event
loop (`WorkerState.check_grammar`), so one that cannot work is a 400 naming its field before
anything is queued (the engine then copies the compiled grammar).
"""

from __future__ import annotations

import json
from typing import Any

from phasefleet.engine.sampling_params import MAX_GRAMMAR_CHARS, Grammar
from phasefleet.server.errors import bad_request
from phasefleet.server.openai_protocol import (
    ChatCompletionRequest,
    SamplingFields,
    StructuredOutputs,
)
from phasefleet.server.state import WorkerState
from phasefleet.server.tools import tool_grammar

ANY_OBJECT = '{"type": "object"}'


def requested_grammar(
    req: SamplingFields, tool_call_parser: str | None = None
) -> tuple[Grammar, str] | None:
    """The grammar the request asks for and the field that asks; a 400 when several fields ask
    or one is incomplete. `tool_call_parser`: the worker's, for a chat's tool_choice 'auto'."""
    asked: list[tuple[Grammar, str]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append((Grammar("json", ANY_OBJECT), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request(
                "response_format of type json_schema needs json_schema.schema", "response_format"
            )
        asked.append((Grammar("json", json.dumps(fmt.json_schema.json_schema)), "response_format"))
    if req.structured_outputs is not None:
        asked.append((_structured_outputs(req.structured_outputs), "structured_outputs"))
    if req.guided_json is not None:
        asked.append((Grammar("json", _schema_text(req.guided_json)), "guided_json"))
    if req.guided_regex is not None:
        asked.append((Grammar("regex", req.guided_regex), "guided_regex"))
    if req.guided_choice is not None:
        asked.append((_choice(req.guided_choice, "guided_choice"), "guided_choice"))
    if req.guided_grammar is not None:
        asked.append((Grammar("grammar", req.guided_grammar), "guided_grammar"))
    forced = tool_grammar(req, tool_call_parser) if isinstance(req, ChatCompletionRequest) else None
    if forced is not None:
        asked.append((forced, "tool_choice"))
    if len(asked) > 1:
        raise bad_request(
            f"set one way of structuring the output; this request sets {asked[0][1]} and "
            f"{asked[1][1]}",
            asked[1][1],
        )
    if not asked:
        return None
    grammar, field = asked[0]
    if not grammar.spec:
        raise bad_request(f"{field} must not be empty", field)
    if len(grammar.spec) > MAX_GRAMMAR_CHARS:
        raise bad_request(
            f"{field} is {len(grammar.spec)} characters as a grammar, more than "
            f"{MAX_GRAMMAR_CHARS}",
            field,
        )
    return grammar, field


def _structured_outputs(so: StructuredOutputs) -> Grammar:
    found = [
        Grammar("json", _schema_text(so.json_schema)) if so.json_schema is not None else None,
        Grammar("json", ANY_OBJECT) if so.json_object else None,
        Grammar("regex", so.regex) if so.regex is not None else None,
        _choice(so.choice, "structured_outputs") if so.choice is not None else None,
        Grammar("grammar", so.grammar) if so.grammar is not None else None,
    ]
    grammars = [g for g in found if g is not None]
    if len(grammars) != 1:
        raise bad_request(
            "structured_outputs must set exactly one of json, json_object, regex, choice, grammar",
            "structured_outputs",
        )
    return grammars[0]


def _choice(choices: list[str], field: str) -> Grammar:
    if not choices or not all(choices):
        raise bad_request(f"{field} must list at least one choice, none of them empty", field)
    return Grammar("choice", json.dumps(choices))


def _schema_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


async def checked_grammar(req: SamplingFields, state: WorkerState) -> Grammar | None:
    """The request's grammar, compiled once (a 400 naming the field when it cannot be)."""
    asked = requested_grammar(req, state.tool_call_parser)
    if asked is None:
        return None
    grammar, field = asked
    await state.check_grammar(grammar, field)
    return grammar
