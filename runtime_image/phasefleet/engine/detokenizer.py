"""IncrementalDetokenizer: output text that only grows, with stop-string handling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=...)` as a function of the ids.

    For a fast tokenizer whose class keeps transformers' own `decode` and `_decode`, the same
    text straight from the Rust tokenizer: transformers' wrapper adds ~40 us of Python a call
    (argument conversion, attribute hooks), which a decode step pays twice per running request
    (bench/RESULTS.md, "The host's share of a decode step"). Any other tokenizer goes through
    its own `decode`.
    """
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    cls, skip = type(tokenizer), skip_special_tokens
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is PreTrainedTokenizerFast._decode
    ):
        rust_decode = tokenizer._tokenizer.decode
        if tokenizer.clean_up_tokenization_spaces:
            clean_up = tokenizer.clean_up_tokenization
            return lambda ids: str(clean_up(rust_decode(ids, skip_special_tokens=skip)))
        return lambda ids: str(rust_decode(ids, skip_special_tokens=skip))
    return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=skip))


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, a few tokens at a time.

    Decodes only a short window of tokens per update (from `prefix_offset`), so the cost per token
    does not grow with the output. Text that could still change is held back: an incomplete UTF-8
    tail (decoded as U+FFFD) and any suffix that could be the start of a stop string.
    """

    def __init__(
        self, decode: Callable[[list[int]], str], stop: list[str], include_stop: bool = False
    ) -> None:
        """`decode`: the tokenizer's, from `decoder` (made once per tokenizer, not per request).
        `include_stop`: the text ends after the stop string found, not before it."""
        self._decode = decode
        self.stop = stop
        self.include_stop = include_stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self._tokens: list[int] = []
        self._prefix_offset = 0  # tokens before this are fully in `_text`
        self._read_offset = 0  # tokens before this have been turned into text
        self._text = ""  # all text decoded so far
        self.stopped = False  # a stop string was found; text ends before it

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
        cut, found = -1, ""
        for s in self.stop:
            i = self._text.find(s, search_from)
            if i != -1 and (cut == -1 or i < cut):
                cut, found = i, s
        if cut != -1:
            self._text = self._text[: cut + len(found) if self.include_stop else cut]
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
