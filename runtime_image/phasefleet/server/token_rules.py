"""vLLM's token restrictions from the API: `allowed_token_ids` (only these may be sampled) and
`bad_words` (never in the output), checked and tokenized here so that a bad one is a 400 naming
its field before anything is queued. The engine applies them (engine/sampler.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phasefleet.engine.sampling_params import MAX_BAD_WORDS
from phasefleet.server.errors import bad_request
from phasefleet.server.openai_protocol import SamplingFields
from phasefleet.server.state import WorkerState

MAX_BAD_WORD_STRINGS = MAX_BAD_WORDS // 2  # each word is two sequences at most (bad_word_ids)


@dataclass(frozen=True)
class TokenRules:
    allowed_token_ids: list[int] | None = None  # None: any token
    bad_words: list[list[int]] = field(default_factory=list)  # token sequences


async def token_rules(req: SamplingFields, state: WorkerState) -> TokenRules:
    allowed = None
    if req.allowed_token_ids is not None:
        allowed = state.check_token_ids(list(req.allowed_token_ids), "allowed_token_ids")
    words = req.bad_words or []
    if len(words) > MAX_BAD_WORD_STRINGS:
        raise bad_request(
            f"bad_words holds {len(words)} words, more than {MAX_BAD_WORD_STRINGS}", "bad_words"
        )
    if any(not w.strip() for w in words):
        raise bad_request("bad_words must not hold an empty or blank word", "bad_words")
    bad = await state.off_loop(bad_word_ids, words, state.tokenizer) if words else []
    return TokenRules(allowed, bad)


def bad_word_ids(words: list[str], tokenizer: Any) -> list[list[int]]:
    """Each word's tokens as written (leading spaces dropped) and after a space, as it reads
    inside a sentence (vLLM's two forms); each distinct sequence once."""
    sequences: list[list[int]] = []
    for word in words:
        text = word.lstrip()
        for form in (text, " " + text):
            ids = [int(t) for t in tokenizer.encode(form, add_special_tokens=False)]
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
