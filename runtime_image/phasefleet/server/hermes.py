"""Hermes-style tool calls in free text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
the format Hermes and Qwen2.5 (and later Qwen) chat templates ask their models for, found in an
answer as it streams. A block that is not such JSON, or is never closed, stays in the text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_CALL_PARSERS = ("hermes",)  # the worker's --tool-call-parser choices (a light import)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text


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


def split_calls(text: str) -> tuple[str, list[Call]]:
    """A whole answer's content and calls."""
    return HermesSplitter().feed(text, final=True)


def _open_prefix(text: str) -> int:
    """Length of the longest tail of `text` that begins OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def _call_of(body: str) -> Call | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return Call(value["name"], arguments)
    return Call(value["name"], json.dumps(arguments, ensure_ascii=False))
