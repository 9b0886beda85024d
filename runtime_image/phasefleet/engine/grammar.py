"""Structured output: a request's `Grammar` (a JSON schema, a regex, a choice of strings, a
context-free grammar) as a matcher that says, before each token, which tokens may come next.

llguidance does the work (imported on first use). `GrammarCompiler` holds the tokenizer in
llguidance's form, built once on first use (0.3 s for SmolLM2's 49k vocabulary) and shared by
every thread that compiles; it compiles each grammar once (a small cache of fresh matchers) and
hands out copies. `GrammarMatcher` is one request's place in its grammar: it writes the tokens
allowed next as a bitmask row and takes each token the request keeps. JSON is generated without
whitespace between tokens of the grammar (`{"a":1}`), so a model cannot wander in whitespace.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Collection
from typing import Any

import numpy as np

from phasefleet.engine.sampling_params import Grammar

CACHED_GRAMMARS = 64  # compiled grammars kept (fresh matchers to copy), most recently used
PARALLEL_MASKS = 4  # from this many grammar rows in a step, their masks are computed in parallel
PARALLEL_MIN_CPUS = 4  # ... on a host with at least this many CPUs (2: no gain, bench/RESULTS.md)


def mask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row: bit t % 32 of word t // 32 is token t."""
    return (vocab_size + 31) // 32


def grammar_text(grammar: Grammar) -> str:
    """The grammar in llguidance's form; ValueError (naming what is wrong) when it is not
    well-formed."""
    from llguidance import LLMatcher

    if grammar.kind == "json":
        try:
            schema = json.loads(grammar.spec)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("the JSON schema must be an object or a boolean")
        # no whitespace between the JSON's tokens: a model cannot wander in whitespace
        return LLMatcher.grammar_from_json_schema(
            grammar.spec, defaults={"whitespace_flexible": False}
        )
    if grammar.kind == "regex":
        return LLMatcher.grammar_from_regex(grammar.spec)
    if grammar.kind == "choice":
        try:
            choices = json.loads(grammar.spec)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"the choices are not JSON: {exc}") from None
        if not (
            isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)
        ):
            raise ValueError("the choices must be a non-empty list of non-empty strings")
        # a Lark string literal takes JSON's escapes
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if grammar.kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            return LLMatcher.grammar_from_lark(any_to_lark(grammar.spec))
        except Exception as exc:  # the GBNF converter raises bare Exceptions ("No 'root' rule")
            raise ValueError(f"the grammar does not parse: {exc}") from None
    raise ValueError(f"unknown grammar kind {grammar.kind!r}")


def fill_masks(
    matchers: list[GrammarMatcher], words: np.ndarray, parallel: bool | None = None
) -> None:
    """Writes matcher k's allowed tokens into words[k] (words: [G, mask_words(V)] int32,
    C-contiguous), on llguidance's threads (the GIL released) when `parallel`; None: from
    PARALLEL_MASKS matchers on a host of PARALLEL_MIN_CPUS. A failed grammar allows nothing: see
    `GrammarMatcher.error`."""
    if parallel is None:
        parallel = len(matchers) >= PARALLEL_MASKS and (os.cpu_count() or 1) >= PARALLEL_MIN_CPUS
    if not parallel:
        for k, matcher in enumerate(matchers):
            matcher.fill(words[k])
        return
    if not words.flags.c_contiguous or words.dtype != np.int32:
        raise ValueError("the masks must be one C-contiguous int32 array")
    targets = [(matcher._inner, k) for k, matcher in enumerate(matchers) if matcher.active]
    for k, matcher in enumerate(matchers):
        if not matcher.active:
            matcher.fill(words[k])
    if targets:
        _executor().unsafe_compute_mask_ptr(
            targets, words.ctypes.data, words.shape[1] * 4, len(words)
        )


@functools.cache
def _executor() -> Any:
    from llguidance import LLExecutor

    return LLExecutor()  # threads: 80% of the CPUs, at most 32


class GrammarMatcher:
    """One request's place in its grammar. A grammar with `after` tokens (Grammar.after) lets
    every token through until they have been written (`open` with the prompt first: they may
    be there already), then its own."""

    def __init__(self, inner: Any, after: tuple[int, ...] = ()) -> None:
        self._inner = inner  # an llguidance LLMatcher
        self.after = after
        self.active = not after  # the grammar shapes the next token
        self._recent: list[int] = []  # the last len(after) tokens while not yet active

    def open_if_in(self, tokens: list[int]) -> None:
        """Opens the grammar when `tokens` (the prompt) hold its `after` tokens."""
        n = len(self.after)
        if not self.active and any(
            tuple(tokens[i : i + n]) == self.after for i in range(len(tokens) - n + 1)
        ):
            self.active = True

    def fill(self, words: np.ndarray) -> None:
        """Writes the tokens allowed next into `words` ([mask_words(V)] int32, contiguous)."""
        self._write_mask(self.active, words)

    def _write_mask(self, active: bool, words: np.ndarray) -> None:
        if not active:
            words.fill(-1)  # every bit: any token
            return
        self._inner.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def _waited(self, recent: list[int], token: int) -> tuple[list[int], bool]:
        """While the grammar waits for its `after` tokens: the last len(after) tokens once
        `token` is written, and whether they open it."""
        recent = [*recent, token][-len(self.after) :]
        return recent, tuple(recent) == self.after

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, the grammar takes in a row from here, up to
        the one that completes it (a draft is cut there: speculation.py); while the grammar
        waits for its `after` tokens, any token, up to the one that opens it. The matcher is
        left where it was."""
        if not self.active:
            recent = self._recent
            for i, token in enumerate(tokens):
                recent, opened = self._waited(recent, token)
                if opened:
                    return i + 1
            return len(tokens)
        taken = 0
        for token in tokens:
            if self._inner.validate_tokens([token]) != 1:  # none once the grammar is complete
                break
            self._inner.consume_token(token)
            taken += 1
        if taken:
            self._inner.rollback(taken)
        return taken

    def fill_after(self, tokens: list[int], words: np.ndarray) -> None:
        """As `fill`, at the place `tokens` lead to (a `valid_prefix`: a draft position's);
        the matcher is left where it was."""
        active, recent, taken = self.active, self._recent, 0
        for token in tokens:
            if active:
                self._inner.consume_token(token)
                taken += 1
            else:
                recent, active = self._waited(recent, token)
        self._write_mask(active, words)
        if taken:
            self._inner.rollback(taken)

    @property
    def error(self) -> str | None:
        """Why the grammar failed (it then allows nothing), or None."""
        return str(self._inner.get_error()) if self._inner.is_error() else None

    def accept(self, token: int) -> None:
        """Moves past `token`; ValueError, the matcher unchanged, when the grammar does not allow
        it there."""
        if not self.active:
            self._recent, self.active = self._waited(self._recent, token)
            return
        if self._inner.validate_tokens([token]) != 1:
            raise ValueError(f"token {token} does not follow the response's grammar")
        self._inner.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (but the end of the sequence)."""
        return self.active and bool(self._inner.is_stopped()) and not self._inner.is_error()

    def copy(self) -> GrammarMatcher:
        twin = GrammarMatcher(self._inner.deep_copy(), self.after)
        twin.active, twin._recent = self.active, list(self._recent)
        return twin


class GrammarCompiler:
    """Matchers for one tokenizer; thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        """`tokenizer`: a Hugging Face fast tokenizer; `vocab_size`: the model's (the logits'
        width); `eos_token_ids`: the tokens that end a sequence, allowed once it is complete."""
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[Grammar, GrammarMatcher] = OrderedDict()

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A matcher at the grammar's start; ValueError naming what is wrong with the grammar."""
        with self._lock:
            fresh = self._cache.get(grammar)
            if fresh is not None:
                self._cache.move_to_end(grammar)
                return fresh.copy()
        fresh = self._compile(grammar)  # outside the lock: a large grammar takes a while
        with self._lock:
            self._cache[grammar] = fresh
            if len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return fresh.copy()

    def _compile(self, grammar: Grammar) -> GrammarMatcher:
        from llguidance import LLMatcher

        inner = LLMatcher(self.prepare(), grammar_text(grammar), log_level=0)
        if inner.is_error():
            raise ValueError(inner.get_error())
        return GrammarMatcher(inner, grammar.after)

    @property
    def prepared(self) -> bool:
        return self._ll_tokenizer is not None

    def prepare(self) -> Any:
        """The tokenizer in llguidance's form, built on first use: the one step that reads the
        Hugging Face tokenizer (run it where that tokenizer is used); ValueError if it is not a
        fast one."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                if not getattr(self._tokenizer, "is_fast", False):
                    raise ValueError("structured output needs a model with a fast tokenizer")
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._ll_tokenizer
