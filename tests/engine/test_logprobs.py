"""Logprobs, prompt logprobs and min_tokens in the engine, against transformers on the same
weights: every logprob is the log-softmax of transformers' raw logits (float32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.outputs import RequestOutput, TokenLogprob
from phasefleet.engine.sampling_params import SamplingParams
from tests.engine.factories import engine_config, random_prompts

TOLERANCE = 1e-4  # nats; float32 forward passes that batch differently


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def folder(tiny_model: Callable[[str], Path], request: pytest.FixtureRequest) -> Path:
    """Llama, and Gemma 2, whose logits are capped by tanh (greedy choices cannot see it)."""
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def hf_logprobs(folder: Path) -> Callable[[list[int]], torch.Tensor]:
    """token ids -> [len, V] log-softmax of transformers' logits at every position."""
    from transformers import AutoModelForCausalLM

    # eager: SDPA drops Gemma 2's score softcapping
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return run


def run(
    folder: Path, prompts: list[list[int]], params: SamplingParams, **kw: object
) -> list[tuple[RequestOutput, list[TokenLogprob], list[TokenLogprob] | None]]:
    """Final outputs with every step's logprobs gathered, and the prompt logprobs."""
    eng = LLMEngine(engine_config(folder, **kw))
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        eng.add_request(rid, prompt, SamplingParams(**vars(params)))
    steps: dict[str, list[TokenLogprob]] = {rid: [] for rid in ids}
    prompt_lps: dict[str, list[TokenLogprob] | None] = {rid: None for rid in ids}
    final: dict[str, RequestOutput] = {}
    while len(final) < len(ids):
        for out in eng.step():
            steps[out.request_id] += out.logprobs or []
            if out.prompt_logprobs is not None:
                assert prompt_lps[out.request_id] is None  # delivered once
                prompt_lps[out.request_id] = out.prompt_logprobs
            if out.finished:
                final[out.request_id] = out
    return [(final[r], steps[r], prompt_lps[r]) for r in ids]


def check(entry: TokenLogprob, reference: torch.Tensor, num_top: int) -> None:
    """entry against one position's reference log-softmax [V]."""
    assert entry.logprob == pytest.approx(float(reference[entry.token_id]), abs=TOLERANCE)
    assert len(entry.top) == num_top
    values, _ = reference.topk(num_top)
    assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=TOLERANCE)
    for token, value in entry.top:
        assert value == pytest.approx(float(reference[token]), abs=TOLERANCE)


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0), dict(temperature=1.3, top_p=0.8, top_k=20, seed=5)],
    ids=["greedy", "sampled"],
)
def test_output_logprobs_are_transformers_log_softmax(
    folder: Path, hf_logprobs: Callable[[list[int]], torch.Tensor], sampling: dict[str, object]
) -> None:
    prompts = random_prompts([5, 23, 40], seed=3)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, **sampling)  # type: ignore[arg-type]
    # A small step budget splits the prompts into chunks that share steps with decodes.
    results = run(folder, prompts, params, block_size=4, max_num_batched_tokens=16)
    for prompt, (out, steps, prompt_lps) in zip(prompts, results, strict=True):
        assert prompt_lps is None
        assert [e.token_id for e in steps] == out.output_token_ids
        reference = hf_logprobs(prompt + out.output_token_ids)
        for i, entry in enumerate(steps):
            # Raw logits, before temperature and top-p: what vLLM returns by default.
            check(entry, reference[len(prompt) - 1 + i], 3)


def test_prompt_logprobs_are_transformers_log_softmax_despite_the_prefix_cache(
    folder: Path, hf_logprobs: Callable[[list[int]], torch.Tensor]
) -> None:
    [prompt] = random_prompts([37], seed=4)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    # The same prompt twice: the second would hit the prefix cache, whose blocks have no
    # logits, so it is computed in full; chunks of 8 tokens.
    results = run(folder, [prompt, prompt], params, block_size=4, max_num_batched_tokens=8)
    reference = hf_logprobs(prompt)
    for _, steps, prompt_lps in results:
        assert steps == []
        assert prompt_lps is not None
        assert [e.token_id for e in prompt_lps] == prompt[1:]
        for position, entry in enumerate(prompt_lps):
            check(entry, reference[position], 2)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached(folder: Path) -> None:
    [prompt] = random_prompts([9], seed=6)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    [(plain, _, _)] = run(folder, [prompt], greedy)
    first, third = plain.output_token_ids[0], plain.output_token_ids[2]
    # Stopping on the greedy first token ends the request at once.
    stop_first = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[first])
    [(short, _, _)] = run(folder, [prompt], stop_first)
    assert short.output_token_ids == [first] and short.finish_reason == "stop"
    # With min_tokens the stop tokens are masked for the first 3 tokens, then end it.
    masked = SamplingParams(
        max_tokens=12, temperature=0, stop_token_ids=[first, third], min_tokens=3, logprobs=0
    )
    [(out, steps, _)] = run(folder, [prompt], masked)
    assert len(out.output_token_ids) >= 3
    assert first not in out.output_token_ids[:3] and third not in out.output_token_ids[:3]
    # The logprobs stay the raw ones: the masked token keeps its (finite) logprob.
    assert all(e.logprob > float("-inf") and e.top == [] for e in steps)
    if out.finish_reason == "stop":
        assert out.output_token_ids[-1] in (first, third)
