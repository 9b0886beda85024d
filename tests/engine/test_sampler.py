from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch

from phasefleet.engine.grammar import GrammarMatcher
from phasefleet.engine.sampler import (
    FAILED,
    DeviceSampling,
    SamplingBatch,
    SamplingRow,
    seed_halves,
)
from phasefleet.engine.sampler import sample as sample_batch
from phasefleet.engine.sampling_params import SEED_MAX, SEED_MIN, Grammar, SamplingParams

CPU = torch.device("cpu")


def row(seed: int | None = None, **kw: object) -> SamplingRow:
    return SamplingRow(SamplingParams(seed=seed, **kw))  # type: ignore[arg-type]


def sample(logits: torch.Tensor, rows: list[SamplingRow], position: int = 0) -> list[int]:
    """Every row samples the token at `position` (what the seeded draw hashes)."""
    batch = SamplingBatch.from_rows(rows, [position] * len(rows), logits.shape[-1])
    return sample_batch(logits, rows, DeviceSampling.direct(batch, CPU, rows, logits.shape[-1]))


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    assert sample(logits, [row(temperature=0), row(temperature=0)]) == [1, 0]


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    rows = [row(temperature=5.0, top_k=1) for _ in range(4)]
    assert sample(logits, rows) == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_best() -> None:
    logits = torch.arange(10.0).unsqueeze(0)
    seen = {sample(logits, [row(seed=s, temperature=10.0, top_k=3)])[0] for s in range(200)}
    assert seen == {7, 8, 9}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    seen = {sample(logits, [row(seed=s, top_p=0.7)])[0] for s in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    seen = {sample(logits, [row(seed=s, top_p=0.1)])[0] for s in range(50)}
    assert seen == {0}  # always keeps the top token


def test_same_seed_same_tokens_and_independent_of_batch() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1))
    a = row(seed=42, temperature=1.0)
    b = row(seed=42, temperature=1.0)
    first = [sample(logits, [a], position=p)[0] for p in range(20)]
    # b runs with other rows around it, a seeded one among them: the same sequence.
    second = []
    for p in range(20):
        batch = torch.cat([logits, logits, logits])
        rows = [row(temperature=0), b, row(seed=7, temperature=1.0)]
        second.append(sample(batch, rows, position=p)[1])
    assert first == second
    assert len(set(first)) > 1  # actually sampling, not greedy
    assert [sample(logits, [a], position=p)[0] for p in range(20)] == first  # again: same
    other = [sample(logits, [row(seed=43, temperature=1.0)], position=p)[0] for p in range(20)]
    assert other != first


def test_a_seeded_draw_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, 0.0, -100.0, 1.0]])
    counts = [0, 0, 0, 0]
    for seed in range(600):
        counts[sample(logits, [row(seed=seed, temperature=1.0)], position=seed % 7)[0]] += 1
    assert counts[2] == 0
    expected = logits.softmax(-1)[0].tolist()  # [0.212, 0.212, 0, 0.576]
    for got, p in zip(counts, expected, strict=True):
        assert abs(got / 600 - p) < 0.06, counts


def test_seeds_at_the_bounds_split_into_32_bit_halves() -> None:
    assert seed_halves(SEED_MAX) == (2**32 - 1, 2**32 - 1)
    assert seed_halves(SEED_MIN) == (0, 2**31)
    assert seed_halves(-1) == seed_halves(SEED_MAX)  # as manual_seed maps negatives
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(5))
    tokens = sample(logits, [row(seed=SEED_MAX, temperature=1.0), row(seed=SEED_MIN)], 3)
    assert all(0 <= t < 30 for t in tokens)


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, 0.0, -100.0]])
    torch.manual_seed(0)
    counts = [0, 0, 0]
    for _ in range(400):
        counts[sample(logits, [row(temperature=1.0)])[0]] += 1
    assert counts[2] == 0
    assert 120 < counts[0] < 280


def test_top_p_below_float32_range_keeps_the_top_token() -> None:
    # 5e-324 is 0 in float32: every token, the best included, used to be dropped (NaN).
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    rows = [row(seed=s, top_p=5e-324) for s in range(3)]
    assert sample(logits, rows) == logits.argmax(-1).tolist()
    assert all(r.error is None for r in rows)


def test_temperature_below_float32_range_is_greedy() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    rows = [row(seed=1, temperature=1e-300), row(temperature=1e-40)]
    assert sample(logits, rows) == logits.argmax(-1).tolist()
    assert all(r.error is None for r in rows)


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    logits = torch.randn(5, 60, generator=torch.Generator().manual_seed(4))

    def batch() -> list[SamplingRow]:
        return [
            row(temperature=0),
            row(seed=7, temperature=0.8, top_k=20),
            row(seed=8, temperature=1.2, top_p=0.9),
            row(seed=9),
            row(temperature=0),
        ]

    clean_rows = batch()
    clean = [sample(logits, clean_rows) for _ in range(10)]  # seeded rows: the same each time
    faulty_rows = batch()
    faulty_rows[1].params.temperature = float("nan")  # a distribution that is all NaN
    bad_logits = logits.clone()
    bad_logits[4, 5] = float("nan")  # the model's own row is broken (greedy)
    faulty = [sample(bad_logits, faulty_rows) for _ in range(10)]
    for step_clean, step_faulty in zip(clean, faulty, strict=True):
        assert [step_faulty[i] for i in (0, 2, 3)] == [step_clean[i] for i in (0, 2, 3)]
        assert [step_faulty[i] for i in (1, 4)] == [FAILED] * 2
    assert [r.error is not None for r in faulty_rows] == [False, True, False, False, True]
    assert "not finite" in str(faulty_rows[1].error)
    assert all(r.error is None for r in clean_rows)


def test_minus_infinity_logits_are_masked_tokens_not_a_fault() -> None:
    logits = torch.tensor([[float("-inf"), 1.0, float("-inf"), 0.5]] * 2)
    rows = [row(temperature=0), row(seed=3, top_p=0.9)]
    assert sample(logits, rows)[0] == 1
    assert all(r.error is None for r in rows)


def test_logprobs_only_for_rows_that_ask_and_from_the_raw_logits() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    rows = [row(temperature=0, logprobs=2), row(temperature=0)]
    assert sample(logits.clone(), rows) == [1, 0]
    assert rows[1].logprobs == []
    (entry,) = rows[0].logprobs
    assert entry.token_id == 1
    raw = logits[0].log_softmax(-1)
    assert entry.logprob == float(raw[1])
    assert entry.top == [(1, float(raw[1])), (2, float(raw[2]))]
    # A temperature changes the draw, never the reported logprob.
    hot = [row(seed=1, temperature=50.0, logprobs=0)]
    token = sample(logits[:1].clone(), hot)[0]
    assert [e.logprob for e in hot[0].logprobs] == [float(raw[token])]


def test_banned_tokens_are_never_sampled_but_keep_their_raw_logprob() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    greedy = row(temperature=0, logprobs=0)
    greedy.banned = [1]
    assert sample(logits.clone(), [greedy]) == [2]
    assert [e.logprob for e in greedy.logprobs] == [float(logits[0].log_softmax(-1)[2])]
    drawn = set()
    for seed in range(50):
        sampled = row(seed=seed, temperature=1.0)
        sampled.banned = [1, 2]
        drawn.add(sample(logits.clone(), [sampled])[0])
    assert drawn == {0}


def test_allowed_tokens_all_banned_fail_their_row_alone() -> None:
    """allowed_token_ids that a step's bans leave empty (a stop token held back by min_tokens,
    a bad word): that row fails with a reason naming the rules; its neighbour samples."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 2)
    stuck = row(temperature=0, allowed_token_ids=[2, 3], bad_words=[[3]])
    stuck.banned = [2]
    free = row(temperature=0, allowed_token_ids=[2, 3])
    assert sample(logits, [stuck, free]) == [FAILED, 3]
    assert stuck.error is not None and "allowed_token_ids" in stuck.error
    assert free.error is None


def adjusted(
    logits: torch.Tensor, rows: list[SamplingRow], drafted: list[list[int]] | None = None
) -> torch.Tensor:
    """The logits the sampler draws from: bias and penalties applied."""
    from phasefleet.engine.sampler import _biased_and_penalized

    batch = SamplingBatch.from_rows(rows, [0] * len(rows), logits.shape[-1], drafted)
    settings = DeviceSampling.direct(batch, CPU, rows, logits.shape[-1])
    assert settings.adjustments is not None
    return _biased_and_penalized(logits.clone(), settings.adjustments, settings.prompt_pairs(rows))


def test_logit_bias_is_added_to_its_tokens_only() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [5.0, 0.0, 1.0, 2.0]])
    rows = [row(temperature=0, logit_bias={0: 10.0, 3: -2.5}), row(temperature=0)]
    want = logits.clone()
    want[0, 0] += 10.0
    want[0, 3] -= 2.5
    assert torch.equal(adjusted(logits, rows), want)
    assert sample(logits, rows) == [0, 0]
    banned = row(temperature=0, logit_bias={1: -100.0})
    assert sample(logits[:1], [banned]) == [2]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_seen() -> None:
    """Tokens in the prompt or the output, each once, as transformers'
    RepetitionPenaltyLogitsProcessor; a row without it is untouched."""
    logits = torch.tensor([[2.0, -2.0, 4.0, 3.0, -1.0], [2.0, -2.0, 4.0, 3.0, -1.0]])
    penalized = row(temperature=0, repetition_penalty=2.0)
    penalized.prompt_ids = torch.tensor([0, 1]).numpy()
    penalized.output_ids = [1, 2, 2]  # 1 is in both: penalized once
    got = adjusted(logits, [penalized, row(temperature=0)])
    assert got[0].tolist() == [1.0, -4.0, 2.0, 3.0, -1.0]
    assert torch.equal(got[1], logits[1])
    assert sample(logits, [penalized, row(temperature=0)]) == [3, 2]


def test_a_rows_prompt_goes_to_the_device_once() -> None:
    """The first step's upload carries the prompt's tokens and the row keeps a copy of its own;
    later steps send only the output's, and the prompt is penalized all the same."""
    logits = torch.tensor([[2.0, -2.0, 4.0, 3.0, -1.0]])
    r = row(temperature=0, repetition_penalty=2.0)
    r.prompt_ids = torch.tensor([0, 1]).numpy()
    first = SamplingBatch.from_rows([r], [0], 5)
    assert first.adjustments is not None and first.adjustments.new_prompt_ids.tolist() == [0, 1]
    settings = DeviceSampling.direct(first, CPU, [r], 5)
    assert settings.adjustments is not None
    settings.prompt_pairs([r])
    assert r.prompt_on_device is not None and r.prompt_on_device.tolist() == [0, 1]
    settings.adjustments.new_prompt_ids.fill_(4)  # the upload buffer, reused by the next step
    assert r.prompt_on_device.tolist() == [0, 1]  # a copy of its own
    r.output_ids = [2]
    later = SamplingBatch.from_rows([r], [1], 5)
    assert later.adjustments is not None and later.adjustments.new_prompt_ids.size == 0
    assert later.new_prompts == [] and later.adjustments.prompt_lengths.tolist() == [2]
    assert adjusted(logits, [r])[0].tolist() == [1.0, -4.0, 2.0, 3.0, -1.0]


def test_a_repetition_penalty_below_float32s_range_still_samples() -> None:
    """1e-300 is a valid penalty (> 0) that float32 holds as 0: the seen tokens' logits become
    the largest finite ones instead of inf (a 'sampling failed' the API fuzzing found)."""
    logits = torch.tensor([[2.0, -2.0, 4.0, 3.0, -1.0]])
    for seed in (None, 3):
        favoured = row(seed=seed, temperature=0 if seed is None else 1.0, repetition_penalty=1e-300)
        favoured.prompt_ids = torch.tensor([0, 1]).numpy()
        assert sample(logits.clone(), [favoured]) == [0]  # the positive seen token wins outright
        assert favoured.error is None


def test_output_counts_grow_past_their_first_arrays() -> None:
    r = row(frequency_penalty=1.0)
    r.output_ids = [t % 40 for t in range(100)]  # 40 distinct tokens: the arrays double twice
    ids, counts = r.output_counts()
    assert ids.tolist() == list(range(40))
    assert counts.tolist() == [3.0] * 20 + [2.0] * 20
    r.output_ids.append(39)
    assert r.output_counts()[1][39] == 3.0


def test_presence_and_frequency_penalties_follow_the_output_counts() -> None:
    """OpenAI's: logit - count x frequency - (count > 0) x presence, over the output only."""
    logits = torch.zeros(1, 4)
    r = row(presence_penalty=0.5, frequency_penalty=0.25)
    r.prompt_ids = torch.tensor([3]).numpy()  # the prompt does not count
    r.output_ids = [0, 1, 1]
    assert adjusted(logits, [r])[0].tolist() == [-0.75, -1.0, 0.0, 0.0]
    r.output_ids.extend([0, 0])  # the engine appends; counts catch up, not recount
    ids, counts = r.output_counts()
    assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == {0: 3.0, 1: 2.0}
    assert adjusted(logits, [r])[0].tolist() == [-1.25, -1.0, 0.0, 0.0]
    negative = row(presence_penalty=-2.0)  # a negative penalty favours repeats
    negative.output_ids = [2]
    assert adjusted(logits, [negative])[0].tolist() == [0.0, 0.0, 2.0, 0.0]


def test_a_draft_position_counts_the_draft_tokens_before_it_as_output() -> None:
    """A drafted request's rows (speculation.py): its last known token's, then each draft
    token's; at each, the draft tokens before it add to the output's counts."""
    r = row(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    r.output_ids = [0, 0, 1]
    logits = torch.ones(3, 4)
    got = adjusted(logits, [r, r, r], drafted=[[], [0], [0, 2]])
    # counts: row 0 {0: 2, 1: 1}; row 1 {0: 3, 1: 1}; row 2 {0: 3, 1: 1, 2: 1}
    assert got.tolist() == [
        [0.5 - 0.5 - 0.5, 0.5 - 0.25 - 0.5, 1.0, 1.0],
        [0.5 - 0.75 - 0.5, 0.5 - 0.25 - 0.5, 1.0, 1.0],
        [0.5 - 0.75 - 0.5, 0.5 - 0.25 - 0.5, 0.5 - 0.25 - 0.5, 1.0],
    ]


def test_min_p_drops_tokens_under_its_share_of_the_best() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    seen = {sample(probs.log(), [row(seed=s, min_p=0.35)])[0] for s in range(300)}
    assert seen == {0, 1}  # 0.15 < 0.35 x 0.5 <= 0.3
    seen = {sample(probs.log(), [row(seed=s, min_p=1.0)])[0] for s in range(50)}
    assert seen == {0}  # the best token always stays
    from phasefleet.engine.sampler import _probs

    rows = [row(seed=1, min_p=0.35), row(seed=1)]
    batch = SamplingBatch.from_rows(rows, [0, 0], 4)
    got = _probs(probs.log().repeat(2, 1), DeviceSampling.direct(batch, CPU, rows, 4))
    torch.testing.assert_close(got[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(got[1], probs[0])  # min_p off: the distribution as it was


class FixedMask:
    """A grammar matcher (the GrammarMatcher boundary) that allows a fixed set of tokens, or
    has failed."""

    def __init__(self, allowed: list[int], error: str | None = None) -> None:
        self.allowed, self.error = allowed, error

    def fill(self, words: np.ndarray) -> None:
        bits = words.view(np.uint32)
        for token in self.allowed:
            bits[token // 32] |= np.uint32(1 << (token % 32))


def ruled(allowed: list[int], error: str | None = None, **kw: Any) -> SamplingRow:
    r = row(grammar=Grammar("regex", "x"), **kw)
    r.matcher = cast(GrammarMatcher, FixedMask(allowed, error))
    return r


def test_a_grammar_row_samples_only_what_its_mask_allows() -> None:
    """Tokens in several mask words (bit 31 and a last, partial word included), greedy and
    drawn; a row without a grammar beside them is unchanged; logprobs stay the raw ones."""
    vocab = 70
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5))
    allowed = [3, 31, 32, 69]
    best_allowed = allowed[int(logits[0, allowed].argmax())]
    rows = [ruled(allowed, temperature=0, logprobs=0), row(temperature=0), ruled([40], seed=1)]
    assert sample(logits.clone(), rows) == [best_allowed, int(logits[1].argmax()), 40]
    assert [e.logprob for e in rows[0].logprobs] == [float(logits[0].log_softmax(-1)[best_allowed])]
    drawn = {
        sample(logits[:1].clone(), [ruled(allowed, seed=s, temperature=5.0)])[0] for s in range(60)
    }
    assert drawn == set(allowed)


def test_a_failed_grammar_fails_its_row_alone() -> None:
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(6))
    rows = [ruled([1, 2], error="lexer fuel exhausted", temperature=0), row(temperature=0)]
    assert sample(logits.clone(), rows) == [FAILED, int(logits[1].argmax())]
    assert rows[0].error == "the response's grammar failed: lexer fuel exhausted"
    assert rows[1].error is None
