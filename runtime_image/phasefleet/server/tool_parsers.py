"""Tool calls in a model's free text (chat's tool_choice 'auto'), one splitter per format, each
fed the answer piece by piece as it streams (`feed`) and giving back its content and its calls:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the
  text, the format Hermes' and Qwen2.5's (and later Qwen's) chat templates ask for. A block that
  is not such JSON, or is never closed, stays in the text.
- `llama3_json`: an answer that is nothing but calls, `{"name": ..., "parameters": {...}}`, one or
  more separated by `;` (Llama 3.1-3.3's JSON tool calling, after an optional `<|python_tag|>`);
  any other answer is text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from phasefleet.api.contract import TOOL_CALL_PARSERS  # the worker's --tool-call-parser

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text


class Splitter(Protocol):
    calls_found: list[Call]

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]: ...


def splitter(parser: str) -> Splitter:
    if parser == "hermes":
        return HermesSplitter()
    if parser == "llama3_json":
        return Llama3JsonSplitter()
    raise ValueError(f"tool-call parser must be one of {TOOL_CALL_PARSERS}, got {parser!r}")


def split_calls(parser: str, text: str) -> tuple[str, list[Call]]:
    """A whole answer's content and calls."""
    return splitter(parser).feed(text, final=True)


@dataclass
class HermesSplitter:
    """Splits text, fed piece by piece, into content and calls. Text that could begin a call
    is held back until it is decided; a call comes out once its block is closed."""

    _pending: str = ""
    calls_found: list[Call] = field(default_factory=list)

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]:
        """The content and the calls that `text` completes (with `final`, everything held)."""
        self._pending += text
        content, calls = "", []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = 0 if final else _open_prefix(self._pending)
                cut = len(self._pending) - keep
                content, self._pending = content + self._pending[:cut], self._pending[cut:]
                break
            content += self._pending[:start]
            end = self._pending.find(CLOSE, start)
            if end < 0:
                if final:  # never closed: text
                    content, self._pending = content + self._pending[start:], ""
                else:
                    self._pending = self._pending[start:]
                break
            block = self._pending[start : end + len(CLOSE)]
            call = _call_of(block[len(OPEN) : -len(CLOSE)])
            if call is None:
                content += block
            else:
                calls.append(call)
            self._pending = self._pending[end + len(CLOSE) :]
        self.calls_found += calls
        return content, calls


def _open_prefix(text: str) -> int:
    """Length of the longest tail of `text` that begins OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


@dataclass
class Llama3JsonSplitter:
    """Text streams on unless the answer opens with `{` (after whitespace and an optional
    `<|python_tag|>`): then it is held to the end and is calls if every part of it is one."""

    _held: str = ""
    _calls: bool | None = None  # None: undecided yet
    calls_found: list[Call] = field(default_factory=list)

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]:
        if self._calls is False:
            return text, []
        self._held += text
        if self._calls is None:
            self._calls = _opens_calls(self._held, final)
        if not self._calls:
            if self._calls is None and not final:
                return "", []  # undecided: held
            self._calls = False
            held, self._held = self._held, ""
            return held, []
        if not final:
            return "", []
        held, self._held = self._held, ""
        calls = _json_calls(held.lstrip().removeprefix(PYTHON_TAG))
        if calls is None:
            return held, []
        self.calls_found += calls
        return "", calls


def _opens_calls(text: str, final: bool) -> bool | None:
    """Whether an answer beginning with `text` is calls: known from its first character past
    whitespace and the python tag; None while that has not come (and not `final`)."""
    rest = text.lstrip()
    if PYTHON_TAG.startswith(rest) and not final:  # nothing yet, or part of the tag
        return None
    rest = rest.removeprefix(PYTHON_TAG).lstrip()
    if not rest:
        return None if not final else False
    return rest.startswith("{")


def _json_calls(text: str) -> list[Call] | None:
    """`{call}; {call}; ...` -> the calls, or None when any part is not one."""
    decoder, calls, at = json.JSONDecoder(), list[Call](), 0
    while True:
        at = len(text) - len(text[at:].lstrip(" \t\n;"))
        if at == len(text):
            return calls or None
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call_of_value(value)
        if call is None:
            return None
        calls.append(call)


def _call_of(body: str) -> Call | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _call_of_value(value)


def _call_of_value(value: object) -> Call | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return Call(value["name"], arguments)
    return Call(value["name"], json.dumps(arguments, ensure_ascii=False))
