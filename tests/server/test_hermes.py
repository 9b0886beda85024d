"""Hermes-style tool calls found in free text, whole and as the text streams in."""

from __future__ import annotations

import json

from phasefleet.server.hermes import Call, HermesSplitter, split_calls

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


def test_calls_are_taken_out_of_the_text_and_what_is_not_a_call_stays() -> None:
    assert split_calls(ANSWER) == (CONTENT, CALLS)
    assert split_calls("no calls here") == ("no calls here", [])
    unclosed = 'a <tool_call>{"name": "f", "arguments": {}}'
    assert split_calls(unclosed) == (unclosed, [])
    assert split_calls('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>') == (
        "",
        [Call("f", '{"x": 1}')],
    )


def test_streamed_piece_by_piece_gives_the_same_and_holds_back_a_possible_call() -> None:
    for size in (1, 3, 7, len(ANSWER)):
        splitter, content, calls = HermesSplitter(), "", list[Call]()
        pieces = [ANSWER[i : i + size] for i in range(0, len(ANSWER), size)]
        for k, piece in enumerate(pieces):
            text, found = splitter.feed(piece, final=k == len(pieces) - 1)
            assert "get_" not in text  # a call never leaks out as text
            content, calls = content + text, calls + found
        assert (content, calls) == (CONTENT, CALLS), size
        assert splitter.calls_found == CALLS
    splitter = HermesSplitter()
    assert splitter.feed("so <tool", final=False) == ("so ", [])  # may begin a call: held
    assert splitter.feed("bar", final=False) == ("<toolbar", [])  # it did not
