"""Logit bias and the penalties on repeats, through the whole engine, against transformers'
own logits processors on the same weights (greedy, float32): RepetitionPenaltyLogitsProcessor
and SequenceBiasLogitsProcessor as they are, and OpenAI's presence and frequency penalties
written as a processor of the same kind (transformers has none)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams
from tests.engine.factories import engine_config, random_prompts

MODEL = "llama"
STEPS = 24


class OpenAIPenalties(LogitsProcessor):
    """logit - count x frequency - (count > 0) x presence, counting the answer's tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        answer = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, answer, torch.ones_like(answer, dtype=scores.dtype)
        )
        penalized = scores - counts * self.frequency - (counts > 0).float() * self.presence
        return cast(torch.FloatTensor, penalized)


Reference = Callable[[list[int], LogitsProcessorList], list[int]]


@pytest.fixture(scope="module")
def reference(tiny_model: Callable[[str], Path]) -> Reference:
    """The greedy answer transformers gives with these processors (one request, no cache)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model(MODEL), dtype=torch.float32).eval()

    def run(prompt: list[int], processors: LogitsProcessorList) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(STEPS):
                logits = model(ids).logits[:, -1].float()
                scores = processors(cast(torch.LongTensor, ids), cast(torch.FloatTensor, logits))
                ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=1)
        return ids[0, len(prompt) :].tolist()

    return run


def greedy(**settings: Any) -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, **settings)


def cases(prompt: list[int]) -> list[tuple[SamplingParams, LogitsProcessorList]]:
    """(our params, transformers' processors) for the same sampling: plain greedy, then each
    setting, then the bias again with presence and frequency penalties (this random model
    hardly repeats a token unless a bias makes it), then all of them."""
    bias = {prompt[-1]: 5.0, 7: -50.0}
    hf_bias: list[list[list[int] | float]] = [[[token], value] for token, value in bias.items()]
    return [
        (greedy(), LogitsProcessorList()),
        (
            greedy(repetition_penalty=1.8),
            LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.8)]),
        ),
        (
            greedy(repetition_penalty=0.6),  # under 1: favours repeats
            LogitsProcessorList([RepetitionPenaltyLogitsProcessor(0.6)]),
        ),
        (
            greedy(logit_bias=bias),
            LogitsProcessorList([SequenceBiasLogitsProcessor(hf_bias)]),
        ),
        (
            greedy(logit_bias=bias, presence_penalty=1.5, frequency_penalty=0.7),
            LogitsProcessorList(
                [SequenceBiasLogitsProcessor(hf_bias), OpenAIPenalties(len(prompt), 1.5, 0.7)]
            ),
        ),
        (  # all of them, in vLLM's order: bias, repetition, frequency and presence
            greedy(
                logit_bias=bias, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5
            ),
            LogitsProcessorList(
                [
                    SequenceBiasLogitsProcessor(hf_bias),
                    RepetitionPenaltyLogitsProcessor(1.3),
                    OpenAIPenalties(len(prompt), 0.5, 0.5),
                ]
            ),
        ),
    ]


def test_each_setting_in_one_batch_matches_transformers(
    tiny_model: Callable[[str], Path], reference: Reference
) -> None:
    """Every setting beside the others in one batch, prompts prefilled in chunks; each changes
    the answer (from plain greedy; the penalties from the bias alone)."""
    eng = LLMEngine(
        engine_config(tiny_model(MODEL), block_size=4, max_num_batched_tokens=24, num_kv_blocks=128)
    )
    prompt = random_prompts([19], seed=5)[0]
    settings = cases(prompt)
    outputs = eng.generate([prompt] * len(settings), [p for p, _ in settings])
    answers = [out.output_token_ids for out in outputs]
    for (params, processors), answer in zip(settings, answers, strict=True):
        assert answer == reference(prompt, processors), params
    plain, _, _, biased, biased_penalized, _ = answers
    assert all(answer != plain for answer in answers[1:])
    assert biased_penalized != biased
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


def test_a_preempted_request_keeps_its_counts(
    tiny_model: Callable[[str], Path], reference: Reference
) -> None:
    """Too few blocks for all: requests are preempted and recomputed mid-answer, and the
    penalties still see every token they had written."""
    eng = LLMEngine(
        engine_config(tiny_model(MODEL), block_size=4, max_num_batched_tokens=64, num_kv_blocks=24)
    )
    prompts = random_prompts([11, 13, 9, 12], seed=6)
    params = SamplingParams(
        max_tokens=STEPS, temperature=0, ignore_eos=True, repetition_penalty=1.5,
        frequency_penalty=0.8,
    )  # fmt: skip
    outputs = eng.generate(prompts, params)
    assert eng.stats().num_preemptions_total > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        processors = LogitsProcessorList(
            [RepetitionPenaltyLogitsProcessor(1.5), OpenAIPenalties(len(prompt), 0.0, 0.8)]
        )
        assert out.output_token_ids == reference(prompt, processors)


def test_a_bias_token_outside_the_vocabulary_is_refused(
    tiny_model: Callable[[str], Path],
) -> None:
    eng = LLMEngine(engine_config(tiny_model(MODEL), num_kv_blocks=32))
    vocab = eng.hf_config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token ids must be in \[0, {vocab}\)"):
        eng.add_request("r", [1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}))
    assert not eng.has_unfinished_requests()
