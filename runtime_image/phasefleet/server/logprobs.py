"""OpenAI's two logprobs shapes, built from the engine's TokenLogprobs.

Completions (the legacy shape): `tokens`, `token_logprobs`, `top_logprobs` (one dict per token:
the chosen token and the `logprobs` most likely ones) and `text_offset` (each token's character
offset, counted over the token texts). Chat: `content`, one entry per token with `token`,
`logprob`, `bytes` and its `top_logprobs` list. A token's text is what the tokenizer decodes for it
alone (part of a multi-byte character decodes to U+FFFD); its `bytes` are the token's own bytes
for a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen), else the text's UTF-8 bytes. The builders
decode, so they run on the tokenizer thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from phasefleet.engine.outputs import TokenLogprob

MIN_LOGPROB = -9999.0  # what a -inf logprob is reported as (JSON has no infinity), as vLLM does


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class PromptLogprob(BaseModel):
    """One entry of vLLM's `prompt_logprobs`."""

    logprob: float
    rank: int  # 1: the most likely token
    decoded_token: str


# vLLM's `prompt_logprobs`: None for the first prompt token, then one dict per token, keyed by
# token id (as a string, JSON's keys are), of that token and the most likely ones
PromptLogprobs = list[dict[str, PromptLogprob] | None]


def prompt_logprob_dicts(
    tokenizer: Any, prompt: Sequence[int], entries: Sequence[TokenLogprob], num_top: int
) -> PromptLogprobs:
    """vLLM's shape for a prompt's logprobs (`entries`: its tokens after the first)."""
    result: PromptLogprobs = [None]
    for k, token_id in enumerate(prompt[1:]):
        if k >= len(entries):  # none computed (as echo, which shows these as None too)
            result.append(None)
            continue
        entry = entries[k]
        if entry.rank is None:  # the engine ranks every prompt logprob (model_runner)
            raise RuntimeError(f"prompt token {k + 1}'s logprob has no rank")
        ranked = {token_id: (entry.logprob, entry.rank)}
        for rank, (other, logprob) in enumerate(entry.top[:num_top], start=1):
            ranked.setdefault(other, (logprob, rank))
        result.append(
            {
                str(token): PromptLogprob(
                    logprob=_reported(logprob), rank=rank, decoded_token=_text(tokenizer, token)
                )
                for token, (logprob, rank) in ranked.items()
            }
        )
    return result


def _reported(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # NaN becomes MIN_LOGPROB too


def _text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id], skip_special_tokens=False) or "")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes byte b as one character: itself when printable, else chr(256 + k)
    for the k-th byte that is not."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + k): b for k, b in enumerate(others)})
    return alphabet


BYTE_LEVEL = _byte_level_alphabet()


def _bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.decoder).__name__ == "ByteLevel":
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if piece is not None and all(ch in BYTE_LEVEL for ch in piece):
            return [BYTE_LEVEL[ch] for ch in piece]
    return list(text.encode())


def completion_logprobs(
    tokenizer: Any,
    entries: Sequence[TokenLogprob | None],
    token_ids: Sequence[int],
    text_offset: int,
) -> tuple[CompletionLogprobs, int]:
    """The logprobs of `token_ids` (an entry of None: the token has none, as an echoed prompt's
    first), the first one at `text_offset`; and the offset after the last."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = _text(tokenizer, token_id)
        result.tokens.append(text)
        result.text_offset.append(text_offset)
        text_offset += len(text)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_reported(entry.logprob))
        top = {text: _reported(entry.logprob)}
        for other, logprob in entry.top:
            top.setdefault(_text(tokenizer, other), _reported(logprob))
        result.top_logprobs.append(top)
    return result, text_offset


def chat_logprobs(tokenizer: Any, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = _text(tokenizer, token_id)
        return TopLogprob(
            token=text, logprob=_reported(logprob), bytes=_bytes(tokenizer, token_id, text)
        )

    content = []
    for entry in entries:
        chosen = top(entry.token_id, entry.logprob)
        alternatives = [top(token_id, logprob) for token_id, logprob in entry.top]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)
