"""SamplingParams: how one request picks its tokens and when it stops, and the bounds of each field.

The bounds below are the one definition: `SamplingParams.validate` enforces them in the engine and
the worker's API models (`phasefleet.server.openai_protocol`) declare the same ones, so a value out
of range is a 400 naming the field before it reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

MAX_TEMPERATURE = 100.0
"""Highest temperature; far past OpenAI's 2, and sampling is near uniform long before it."""
MIN_TOP_K = -1
"""top_k of -1 or 0 disables top-k; a top_k above the vocabulary keeps every token."""
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
"""A request's seed, taken as its unsigned 64-bit value (negatives wrap, as torch's manual_seed
maps them); the sampler hashes it with the token's position."""
API_SEED_MAX = 2**63 - 1
"""The API's `seed` is a signed 64-bit integer, as OpenAI's; choice i samples with seed + i, which
stays within SEED_MAX for any number of choices up to MAX_N."""
MAX_N = 16
"""Choices one API request may ask for (each is one engine request)."""
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
"""Stop strings are searched in each new piece of text on the engine thread, so both are bounded."""
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
"""Most alternatives (top logprobs) per token, as vLLM's default max_logprobs and OpenAI's
top_logprobs."""
MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY], as OpenAI's."""
MAX_REPETITION_PENALTY = 2.0
"""repetition_penalty lies in (0, MAX_REPETITION_PENALTY], as vLLM's; 1 is off."""
MAX_LOGIT_BIAS = 100.0
"""A logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as OpenAI's."""
MAX_LOGIT_BIAS_TOKENS = 300
"""Tokens one request may bias: each is a (row, token) entry of every step's upload."""
GrammarKind = Literal["json", "regex", "choice", "grammar"]
GRAMMAR_KINDS: tuple[str, ...] = get_args(GrammarKind)
MAX_ALLOWED_TOKEN_IDS = 1 << 18
"""allowed_token_ids holds at most this many ids (a 262k vocabulary's)."""
MAX_BAD_WORDS = 128
"""bad_words holds at most this many token sequences, each of at most MAX_BAD_WORD_TOKENS."""
MAX_BAD_WORD_TOKENS = 64
MAX_GRAMMAR_CHARS = 100_000
MAX_GRAMMAR_AFTER = 16  # tokens of the sequence that opens a grammar (Grammar.after)
"""The longest grammar text (a JSON schema, a regex, the choices as JSON) a request may send."""


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match (structured output; engine/grammar.py compiles it)."""

    kind: GrammarKind
    """One of GRAMMAR_KINDS: 'json' (a JSON value that a JSON schema accepts), 'regex',
    'choice' (exactly one of a list of strings), or 'grammar' (a context-free grammar, in Lark's
    syntax or GBNF's, as vLLM takes)."""
    spec: str
    """json: the JSON schema as JSON text ('{"type": "object"}' for any object); regex: the
    pattern; choice: the allowed strings as a JSON list; grammar: its text. At most
    MAX_GRAMMAR_CHARS characters."""
    after: tuple[int, ...] = ()
    """The tokens that open the grammar (a reasoning model's end of thought, as its tokenizer
    writes it): until the prompt or the output holds them, any token goes. (): from the first
    token. At most MAX_GRAMMAR_AFTER."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    """Most output tokens to generate, >= 1."""
    temperature: float = 1.0
    """Softmax temperature in [0, MAX_TEMPERATURE]; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p, (0, 1]."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 or 0 disables."""
    seed: int | None = None
    """Seed of this request's draws, in [SEED_MIN, SEED_MAX]: same seed, same
    tokens."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (at most MAX_STOP_STRINGS, each 1..MAX_STOP_STRING_CHARS characters); the
    output text ends before the first one found."""
    skip_special_tokens: bool = True
    """Special tokens (end of turn, tool markers) are left out of the output text."""
    include_stop_str_in_output: bool = False
    """The stop string found stays at the end of the output text (vLLM's)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that finish the request (the token is kept in output_token_ids); at most
    MAX_STOP_TOKEN_IDS."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    min_tokens: int = 0
    """Output tokens before the end-of-sequence token and stop_token_ids may be sampled (they
    are masked until then), in [0, max_tokens]."""
    logprobs: int | None = None
    """Per output token: its logprob and the logprobs of the `logprobs` most likely tokens, in
    [0, MAX_LOGPROBS]; None computes none."""
    prompt_logprobs: int | None = None
    """Per prompt token after the first: the same, in [0, MAX_LOGPROBS]; None computes none.
    Such a prompt is always computed in full (the prefix cache has no logits)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output (OpenAI's), in
    [-MAX_PENALTY, MAX_PENALTY]; 0 is off."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it is already in the output (OpenAI's),
    in [-MAX_PENALTY, MAX_PENALTY]; 0 is off."""
    repetition_penalty: float = 1.0
    """A token already in the prompt or the output has its logit divided by this when positive,
    multiplied when negative (transformers' and vLLM's), in (0, MAX_REPETITION_PENALTY]."""
    min_p: float = 0.0
    """Drop tokens whose probability is under min_p x the most likely token's (after
    temperature, top-k and top-p), in [0, 1]; 0 is off."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> a number added to its logit before sampling, in [-MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS]; at most MAX_LOGIT_BIAS_TOKENS tokens."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be sampled (vLLM's), 1 to MAX_ALLOWED_TOKEN_IDS of them; None:
    any."""
    bad_words: list[list[int]] = field(default_factory=list)
    """Token sequences the output never contains (vLLM's `bad_words`, which the server
    tokenizes): a sequence's last token is masked wherever the output so far ends with the rest
    of it (a one-token sequence: everywhere)."""
    grammar: Grammar | None = None
    """The output must match it (tokens it does not allow are masked); the request stops when the
    grammar is complete. None: any output."""

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value is out of range."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be a number in [0, {MAX_TEMPERATURE}], got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < MIN_TOP_K:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(
                f"seed must be None or an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}"
            )
        if (
            not isinstance(self.stop, list)
            or len(self.stop) > MAX_STOP_STRINGS
            or not all(_is_stop_string(s) for s in self.stop)
        ):
            raise ValueError(
                f"stop must be a list of at most {MAX_STOP_STRINGS} strings of 1 to "
                f"{MAX_STOP_STRING_CHARS} characters, got {_short(self.stop)}"
            )
        if (
            not isinstance(self.stop_token_ids, list)
            or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
            or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids)
        ):
            raise ValueError(
                f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} non-negative "
                f"integers, got {_short(self.stop_token_ids)}"
            )
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens ({self.max_tokens})], "
                f"got {self.min_tokens!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )

        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(
                    f"{name} must be a number in [{-MAX_PENALTY}, {MAX_PENALTY}], got {value!r}"
                )
        rep = self.repetition_penalty
        if not _is_number(rep) or not 0 < rep <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {rep!r}"
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        bias = self.logit_bias
        if (
            not isinstance(bias, dict)
            or len(bias) > MAX_LOGIT_BIAS_TOKENS
            or not all(_is_int(t) and t >= 0 for t in bias)
            or not all(_is_number(v) and abs(v) <= MAX_LOGIT_BIAS for v in bias.values())
        ):
            raise ValueError(
                f"logit_bias must map at most {MAX_LOGIT_BIAS_TOKENS} non-negative token ids to"
                f" numbers in [{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {_short(bias)}"
            )
        allowed = self.allowed_token_ids
        if allowed is not None and not (
            isinstance(allowed, list)
            and 0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS
            and all(_is_int(t) and t >= 0 for t in allowed)
        ):
            raise ValueError(
                f"allowed_token_ids must be None or a list of 1 to {MAX_ALLOWED_TOKEN_IDS} "
                f"non-negative token ids, got {_short(allowed)}"
            )
        words = self.bad_words
        if not (
            isinstance(words, list)
            and len(words) <= MAX_BAD_WORDS
            and all(
                isinstance(w, list)
                and 0 < len(w) <= MAX_BAD_WORD_TOKENS
                and all(_is_int(t) and t >= 0 for t in w)
                for w in words
            )
        ):
            raise ValueError(
                f"bad_words must be a list of at most {MAX_BAD_WORDS} token sequences of 1 to "
                f"{MAX_BAD_WORD_TOKENS} non-negative ids, got {_short(words)}"
            )
        grammar = self.grammar
        if grammar is not None and not (
            isinstance(grammar, Grammar)
            and grammar.kind in GRAMMAR_KINDS
            and isinstance(grammar.spec, str)
            and 0 < len(grammar.spec) <= MAX_GRAMMAR_CHARS
            and isinstance(grammar.after, tuple)
            and len(grammar.after) <= MAX_GRAMMAR_AFTER
            and all(isinstance(t, int) and t >= 0 for t in grammar.after)
        ):
            raise ValueError(
                f"grammar must be None or a Grammar of kind {' / '.join(GRAMMAR_KINDS)} with a "
                f"spec of 1 to {MAX_GRAMMAR_CHARS} characters (after: at most "
                f"{MAX_GRAMMAR_AFTER} token ids), got {_short(grammar)}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """The output's counts change this request's logits (presence or frequency penalty)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def repeats_seen(self) -> bool:
        """The tokens of the prompt and the output change its logits (repetition penalty)."""
        return self.repetition_penalty != 1

    @property
    def masks_or_shifts_logits(self) -> bool:
        """A bias, the repetition penalty, min-p, a grammar or allowed tokens: each applies to
        the first token too, and each rides in the sampler's adjustments."""
        return (
            bool(self.logit_bias)
            or self.repeats_seen
            or self.min_p > 0
            or self.grammar is not None
            or self.allowed_token_ids is not None
        )

    @property
    def changes_first_token(self) -> bool:
        """A setting that applies before any output: the above, or bad words."""
        return self.masks_or_shifts_logits or bool(self.bad_words)

    @property
    def adjusts_logits(self) -> bool:
        """The sampler uploads adjustments for it: the above, or a penalty on the output's
        repeats (bad words are banned tokens, not adjustments)."""
        return self.masks_or_shifts_logits or self.penalized


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def _is_stop_string(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_STOP_STRING_CHARS


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
