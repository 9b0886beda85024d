"""vLLM's token restrictions in the engine: allowed_token_ids (every other token masked) and
bad_words (a word's last token masked wherever the output ends with the rest of it), against
transformers' greedy decoding with the same rules applied by hand, with and without drafts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampler import SamplingRow
from phasefleet.engine.sampling_params import SamplingParams
from tests.engine.factories import contains, engine_config, random_prompts
from tests.engine.test_speculation import oracle_engine

ModelPath = Callable[[str], Path]
TOKENS = 20


def test_bad_words_ban_a_words_last_token_after_the_rest_of_it() -> None:
    row = SamplingRow(SamplingParams(max_tokens=8, bad_words=[[9], [1, 2, 3], [4, 5]]))
    row.output_ids.extend([7, 1])
    assert row.bad_words_banned([]) == [9]  # [1, 2] not yet complete
    assert row.bad_words_banned([2]) == [9, 3]  # a draft token completes its prefix
    row.output_ids.extend([2, 4])
    assert row.bad_words_banned([]) == [9, 5]
    assert row.bad_words_banned([1, 2]) == [9, 3]
    assert SamplingRow(SamplingParams(max_tokens=8, bad_words=[[4, 5]])).bad_words_banned([]) == []


def hf_restricted(
    folder: Path, prompt: list[int], allowed: list[int] | None, bad: list[list[int]]
) -> list[int]:
    """transformers' greedy tokens with the rules applied to its logits by hand."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids: list[int] = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
            if allowed is not None:
                keep = torch.zeros_like(logits, dtype=torch.bool)
                keep[allowed] = True
                logits[~keep] = float("-inf")
            for word in bad:
                if len(word) == 1 or out[len(out) - len(word) + 1 :] == word[:-1]:
                    logits[word[-1]] = float("-inf")
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


@pytest.mark.parametrize("drafts", [False, True], ids=["plain", "drafted"])
def test_allowed_tokens_and_bad_words_give_transformers_tokens_under_the_same_rules(
    tiny_model: ModelPath, drafts: bool
) -> None:
    """Drafted: each request's drafts are its unrestricted greedy tokens, which run into the
    banned words and the disallowed tokens; every draft position is masked after the draft
    tokens before it, so the output is the same as without drafts."""
    folder = tiny_model("llama")
    (prompt,) = random_prompts([12], seed=3)
    plain = LLMEngine(engine_config(folder, block_size=4))
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    (free,) = plain.generate([prompt], greedy)
    f = free.output_token_ids
    assert f[0] != f[3]  # else the first token alone would look like the word's start
    rules = {
        "allowed": (sorted({*f[::2], 1, 2, 3}), []),
        # steps of right drafts cover tokens 1-5, 6-10, ...: f[3], f[4] are drafts of one step
        "bad": (None, [[f[3], f[4]], [f[9], f[10], f[11]], [f[15]]]),
        "both": (sorted({*f, 4, 5}), [[f[0], f[1]], [f[3]]]),
    }
    expected = {k: hf_restricted(folder, prompt, a, b) for k, (a, b) in rules.items()}
    for k, (allowed, bad) in rules.items():
        assert expected[k] != f, k  # each rule bites
        assert allowed is None or set(expected[k]) <= set(allowed)
        assert not any(contains(expected[k], w) for w in bad)
    params = {
        k: SamplingParams(
            max_tokens=TOKENS, temperature=0, ignore_eos=True, allowed_token_ids=a, bad_words=b
        )
        for k, (a, b) in rules.items()
    }
    if drafts:
        eng = oracle_engine(folder, {k: f for k in rules}, None, block_size=4)
    else:
        eng = LLMEngine(engine_config(folder, block_size=4))
    for k, p in params.items():
        eng.add_request(k, prompt, p)
    got = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.output_token_ids
    assert got == expected
    if drafts:
        s = eng.scheduler
        assert 0 < s.accepted_tokens_total < s.draft_tokens_total


def test_tokens_outside_the_vocabulary_and_rules_that_leave_no_token_are_refused(
    tiny_model: ModelPath,
) -> None:
    eng = LLMEngine(engine_config(tiny_model("llama")))
    vocab = eng.hf_config.vocab_size
    for field, value in (("allowed_token_ids", [1, vocab]), ("bad_words", [[1], [2, vocab]])):
        params = SamplingParams(max_tokens=2, **{field: value})  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"{field} token ids must be in"):
            eng.add_request("r", [1, 2], params)
    eos = sorted(eng.scheduler.eos_token_ids)
    impossible = [
        {"allowed_token_ids": [5, 6], "bad_words": [[5], [6]]},
        {"allowed_token_ids": [eos[0], 7], "bad_words": [[7]], "min_tokens": 1},
        {"allowed_token_ids": [7], "stop_token_ids": [7], "min_tokens": 2},
    ]
    for rules in impossible:
        with pytest.raises(ValueError, match="allowed_token_ids holds no token that may be"):
            eng.add_request("r", [1, 2], SamplingParams(max_tokens=2, **rules))  # type: ignore[arg-type]
    possible = {"allowed_token_ids": [eos[0], 7], "bad_words": [[7]], "min_tokens": 0}
    eng.add_request("ok", [1, 2], SamplingParams(max_tokens=2, **possible))  # type: ignore[arg-type]
    for field, value in (("allowed_token_ids", []), ("bad_words", [[]])):
        with pytest.raises(ValueError, match=field):
            SamplingParams(max_tokens=2, **{field: value}).validate()  # type: ignore[arg-type]
