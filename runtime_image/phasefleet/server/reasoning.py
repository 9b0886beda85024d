"""A reasoning model's thought apart from its answer (vLLM's `--reasoning-parser`): a chat
answer's text up to `</think>` comes back as `reasoning_content` (DeepSeek's and vLLM's field),
the rest as `content`, without the newlines that open it.

- `qwen3`: the model opens its thought itself: an answer that begins with `<think>` (after
  whitespace) thinks until `</think>`, or to its end when cut short; any other answer is all
  content (thinking off: Qwen3's template closed an empty thought in the prompt).
- `deepseek_r1`: the template opens the thought in the prompt (DeepSeek-R1, QwQ,
  Qwen3-*-Thinking-2507): every answer starts in it, a `<think>` the model writes anyway is
  dropped, and an answer without `</think>` is all thought.

A streamed answer is split the same way as it comes (`ReasoningStream`): the pieces of each part
join to exactly what the whole answer gives.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from phasefleet.api.contract import REASONING_PARSERS  # the worker's --reasoning-parser

START, END = "<think>", "</think>"


def thought_end_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokens of END as the tokenizer writes it (one special token in Qwen3's and
    DeepSeek-R1's): a grammar (structured output, a forced tool call) starts after them."""
    return tuple(tokenizer.encode(END, add_special_tokens=False))


class _Part(enum.Enum):
    UNDECIDED = "undecided"  # qwen3, before the answer's first non-space text
    THOUGHT = "thought"
    ANSWER = "answer"


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the answer has no thought
    content: str | None  # None: the answer is all thought


def split_reasoning(parser: str, text: str) -> Split:
    """A whole answer's thought and content."""
    stream = ReasoningStream(parser)
    thought, content = stream.feed(text, finished=True)
    if not stream.thought_seen:
        return Split(None, content)
    return Split(thought, content or None)  # nothing after the thought: no content


class ReasoningStream:
    """One streamed answer: feed(new text) -> (thought, content) to send now. A tail that could
    begin a tag (or newlines that may open the content) is held until the next piece decides."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {parser!r}")
        self.parser = parser
        self.part = _Part.UNDECIDED if parser == "qwen3" else _Part.THOUGHT
        self.held = ""  # text not given out yet
        self.start_possible = parser == "deepseek_r1"  # a leading <think> is dropped
        self.thought_seen = parser == "deepseek_r1"
        self.answer_started = False  # the content's opening newlines are behind us

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self.held += text
        thought, content = "", ""
        while True:
            if self.part is _Part.UNDECIDED:
                if not self._decide(finished):
                    break
            elif self.part is _Part.THOUGHT:
                piece, done = self._until_end(finished)
                thought += piece
                if not done:
                    break
                self.part = _Part.ANSWER
            else:
                content += self._answer(finished)
                break
        return thought, content

    def _decide(self, finished: bool) -> bool:
        """qwen3: does the answer open with <think>? False while the held text cannot tell."""
        body = self.held.lstrip()
        if body.startswith(START):
            self.held = body[len(START) :]
            self.part, self.thought_seen = _Part.THOUGHT, True
            return True
        if (START.startswith(body) or not body) and not finished:
            return False
        self.part = _Part.ANSWER
        return True

    def _until_end(self, finished: bool) -> tuple[str, bool]:
        """The thought's text up to </think> (consumed), and whether it was found."""
        if self.start_possible:
            body = self.held.lstrip()
            if body.startswith(START):
                self.held, self.start_possible = body[len(START) :], False
            elif (START.startswith(body) or not body) and not finished:
                return "", False
            else:
                self.start_possible = False
        end = self.held.find(END)
        if end >= 0:
            piece, self.held = self.held[:end], self.held[end + len(END) :]
            return piece, True
        keep = 0 if finished else _partial_tag(self.held, END)
        piece, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return piece, False

    def _answer(self, finished: bool) -> str:
        if not self.answer_started:
            self.held = self.held.lstrip("\n")
            if not self.held and not finished:
                return ""
            self.answer_started = True
        piece, self.held = self.held, ""
        return piece


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (to hold back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
