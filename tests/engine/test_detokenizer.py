"""Incremental detokenizing: text only grows, UTF-8 tails and stop-string prefixes wait."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from phasefleet.engine.detokenizer import IncrementalDetokenizer, decoder


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Callable[[str], Path]) -> object:
    return AutoTokenizer.from_pretrained(tiny_model("llama"))


def feed(
    tok: object, text: str, stop: list[str], include_stop: bool = False
) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(decoder(tok), stop, include_stop)
    seen = []
    for t in tok.encode(text, add_special_tokens=False):  # type: ignore[attr-defined]
        detok.update([t])
        seen.append(detok.text(final=False))
        if detok.stopped:
            break
    return detok, seen


def test_text_round_trips_and_only_grows(tokenizer: object) -> None:
    text = "Héllo wörld, 日本語 and emoji 🙂 done."
    detok, seen = feed(tokenizer, text, [])
    assert detok.text(final=True) == text
    for before, after in zip(seen, seen[1:], strict=False):
        assert after.startswith(before)
    assert all("\ufffd" not in s for s in seen)  # half characters are held back


def test_stop_string_is_cut_and_its_prefix_held_back(tokenizer: object) -> None:
    detok, seen = feed(tokenizer, "one two STOP three", ["STOP"])
    assert detok.stopped
    assert detok.text(final=True) == "one two "
    assert all(not s.endswith("ST") and "STOP" not in s for s in seen)
    for before, after in zip(seen, seen[1:], strict=False):
        assert after.startswith(before)


def test_prefix_of_a_stop_string_is_released_at_the_end(tokenizer: object) -> None:
    detok, seen = feed(tokenizer, "count to ST", ["STOP"])
    assert not detok.stopped
    assert not seen[-1].endswith("ST")
    detok.flush()
    assert detok.text(final=True) == "count to ST"


def test_stop_string_spanning_tokens(tokenizer: object) -> None:
    detok, _ = feed(tokenizer, "the quick brown fox", ["k br"])
    assert detok.stopped
    assert detok.text(final=True) == "the quic"


def test_the_stop_string_stays_when_asked(tokenizer: object) -> None:
    detok, seen = feed(tokenizer, "one two STOP three", ["three", "STOP"], include_stop=True)
    assert detok.stopped and detok.text(final=True) == "one two STOP"  # the first found
    assert all("STOP" not in s for s in seen[:-1])


@pytest.mark.parametrize("clean_up", [False, True])
def test_decoder_gives_transformers_text(tiny_model: Callable[[str], Path], clean_up: bool) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model("llama"))
    tok.clean_up_tokenization_spaces = clean_up
    specials = [i for i in (tok.bos_token_id, tok.eos_token_id) if i is not None]
    assert specials
    texts = ["Héllo wörld , 日本語 🙂 isn't it ?", "a . b , c ! do n't", "  two  spaces "]
    cases = [tok.encode(t, add_special_tokens=False) for t in texts]
    cases += [specials + cases[0] + specials, [specials[0]], [], list(range(len(tok)))[:300]]
    decode = decoder(tok)
    for ids in cases:
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True)


def test_decoder_skips_transformers_wrapper_for_fast_tokenizers(
    tokenizer: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    def wrapper(*args: object, **kwargs: object) -> str:
        raise AssertionError("went through transformers' decode")

    ids = tokenizer.encode("plain text", add_special_tokens=False)  # type: ignore[attr-defined]
    expected = tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
    monkeypatch.setattr(tokenizer, "decode", wrapper)
    monkeypatch.setattr(tokenizer, "_decode", wrapper)
    assert decoder(tokenizer)(ids) == expected


def test_decoder_keeps_a_tokenizer_that_decodes_its_own_way(tokenizer: object) -> None:
    class Shouting(type(tokenizer)):  # type: ignore[misc]
        def decode(self, token_ids: object, **kwargs: object) -> str:
            return str(super().decode(token_ids, **kwargs)).upper()

    shouting = Shouting.from_pretrained(tokenizer.name_or_path)  # type: ignore[attr-defined]
    ids = shouting.encode("quiet words", add_special_tokens=False)
    assert decoder(shouting)(ids) == "QUIET WORDS"
