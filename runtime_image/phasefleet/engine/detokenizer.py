"""IncrementalDetokenizer: output text that only grows, with stop-string handling."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, a few tokens at a time.

    Decodes only a short window of tokens per update (from `prefix_offset`), so the cost per token
    does not grow with the output. Text that could still change is held back: an incomplete UTF-8
    tail (decoded as U+FFFD) and any suffix that could be the start of a stop string.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self._tokens: list[int] = []
        self._prefix_offset = 0  # tokens before this are fully in `_text`
        self._read_offset = 0  # tokens before this have been turned into text
        self._text = ""  # all text decoded so far
        self.stopped = False  # a stop string was found; text ends before it

    def _decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def update(self, new_token_ids: list[int]) -> None:
        if self.stopped:
            return
        self._tokens.extend(new_token_ids)
        window = self._tokens[self._prefix_offset :]
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(window)
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return  # wait for the rest of a multi-byte character
        old_len = len(self._text)
        self._text += full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        if self.stop:
            self._find_stop(old_len)

    def flush(self) -> None:
        """At the end: decode whatever is left, even an incomplete character."""
        if self.stopped or self._read_offset == len(self._tokens):
            return
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        old_len = len(self._text)
        if full_text.startswith(prefix_text):
            self._text += full_text[len(prefix_text) :]
        self._read_offset = len(self._tokens)
        if self.stop:
            self._find_stop(old_len)

    def _find_stop(self, old_len: int) -> None:
        search_from = max(0, old_len - self._max_stop + 1)
        cut = -1
        for s in self.stop:
            i = self._text.find(s, search_from)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            self._text = self._text[:cut]
            self.stopped = True

    def text(self, final: bool) -> str:
        """The text safe to show: all of it when final, else without a possible stop prefix."""
        if final or self.stopped or not self.stop:
            return self._text
        text = self._text
        for k in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return text[:-k]
        return text
