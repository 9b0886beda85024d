"""Tool calls found in a model's free text, per format, whole and as the text streams in."""

from __future__ import annotations

import json

from phasefleet.server.openai_protocol import ChatCompletionRequest
from phasefleet.server.tool_parsers import Call, HermesSplitter, Splitter, split_calls, splitter
from phasefleet.server.tools import ChoiceStream, answer, tool_grammar

ANSWER = (
    "Let me look.\n"
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    '<tool_call>not json</tool_call> and <tool_call>{"name": 1}</tool_call> done <tool_'
)
CALLS = [
    Call("get_time", json.dumps({"zone": "utc"})),
    Call("get_weather", '{"city": "Oslo"}'),  # arguments already as JSON text: kept as sent
]
CONTENT = (
    'Let me look.\n\n<tool_call>not json</tool_call> and <tool_call>{"name": 1}</tool_call>'
    " done <tool_"
)


def streamed(parser: str, text: str, size: int) -> tuple[str, list[Call], Splitter]:
    """`text` fed `size` characters at a time: the content and calls given back, and the
    splitter."""
    split, content, calls = splitter(parser), "", list[Call]()
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        more, found = split.feed(piece, final=k == len(pieces) - 1)
        content, calls = content + more, calls + found
    return content, calls, split


def test_hermes_calls_are_taken_out_of_the_text_and_what_is_not_a_call_stays() -> None:
    assert split_calls("hermes", ANSWER) == (CONTENT, CALLS)
    assert split_calls("hermes", "no calls here") == ("no calls here", [])
    unclosed = 'a <tool_call>{"name": "f", "arguments": {}}'
    assert split_calls("hermes", unclosed) == (unclosed, [])
    assert split_calls(
        "hermes", '<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>'
    ) == (
        "",
        [Call("f", '{"x": 1}')],
    )


def test_hermes_streamed_piece_by_piece_gives_the_same_and_holds_back_a_possible_call() -> None:
    for size in (1, 3, 7, len(ANSWER)):
        content, calls, split = streamed("hermes", ANSWER, size)
        assert "get_" not in content  # a call never leaks out as text
        assert (content, calls) == (CONTENT, CALLS), size
        assert split.calls_found == CALLS
    split = HermesSplitter()
    assert split.feed("so <tool", final=False) == ("so ", [])  # may begin a call: held
    assert split.feed("bar", final=False) == ("<toolbar", [])  # it did not


LLAMA_CALLS = (
    ' <|python_tag|>{"name": "get_time", "parameters": {"zone": "utc"}}; '
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
)


def test_llama3_json_an_answer_of_calls_is_calls_and_anything_else_is_text() -> None:
    calls = [Call("get_time", '{"zone": "utc"}'), Call("get_weather", '{"city": "Oslo"}')]
    for size in (1, 4, len(LLAMA_CALLS)):
        content, found, split = streamed("llama3_json", LLAMA_CALLS, size)
        assert (content, found, split.calls_found) == ("", calls, calls), size
    for text in (
        "The time is noon.",  # text from the first character on
        '{"name": "f", "parameters": {}} and then some words',  # not only calls
        '{"title": "not a call"}',
        "<|python_tag|>",
        "",
    ):
        assert split_calls("llama3_json", text) == (text, []), text
        assert streamed("llama3_json", text, 2)[:2] == (text, []), text


def test_llama3_json_text_streams_as_soon_as_it_is_not_a_call() -> None:
    split = splitter("llama3_json")
    assert split.feed("  ", final=False) == ("", [])  # undecided
    assert split.feed("<|python", final=False) == ("", [])  # maybe the tag
    assert split.feed("x", final=False) == ("  <|pythonx", [])  # text after all
    assert split.feed(" more", final=False) == (" more", [])


def chat_with_tools(parallel: bool, tool_choice: str = "auto") -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": n}} for n in ("get_time", "get_weather")]
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "?"}], "tools": tools,
         "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    )  # fmt: skip


def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed() -> None:
    both, one = chat_with_tools(True), chat_with_tools(False)
    message, reason = answer(both, "hermes", ANSWER, "stop")
    assert [c.function.name for c in message.tool_calls or []] == ["get_time", "get_weather"]
    message, reason = answer(one, "hermes", ANSWER, "stop")
    assert [c.function.name for c in message.tool_calls or []] == ["get_time"]
    assert reason == "tool_calls" and message.content == CONTENT.strip()
    for size in (1, 5, len(ANSWER)):
        stream, names, text = ChoiceStream(one, "hermes"), [], ""
        pieces = [ANSWER[i : i + size] for i in range(0, len(ANSWER), size)]
        for k, piece in enumerate(pieces):
            delta = stream.delta(piece, k == len(pieces) - 1, "")
            names += [(c.index, c.function.name) for c in delta.tool_calls or [] if c.function]
            text += delta.content or ""
        assert names == [(0, "get_time")] and text == CONTENT, size
        assert stream.finish_reason("stop") == "tool_calls"


def test_parallel_tool_calls_false_makes_required_a_list_of_one() -> None:
    schema = json.loads(tool_grammar(chat_with_tools(False, "required"), None).spec)  # type: ignore[union-attr]
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    schema = json.loads(tool_grammar(chat_with_tools(True, "required"), None).spec)  # type: ignore[union-attr]
    assert "maxItems" not in schema
