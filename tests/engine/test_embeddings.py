"""Embedding requests: the last prompt token's final hidden state, as transformers' base model
gives it, whole or chunked, beside generating requests, from prefix-cache hits and over two
tensor-parallel ranks; they sample nothing and free their blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from phasefleet.engine.llm_engine import LLMEngine, RequestOutput
from phasefleet.engine.sampling_params import SamplingParams
from tests.engine.factories import engine_config, finish_all, random_prompts

MODELS = ["llama", "qwen3", "qwen2_moe"]


def hf_last_hidden(folder: Path, prompt: list[int]) -> np.ndarray:
    """transformers' base model: the last token's final hidden state (after the last norm)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0, -1]
    return hidden.numpy()


def embed_all(eng: LLMEngine, prompts: list[list[int]]) -> list[RequestOutput]:
    for i, prompt in enumerate(prompts):
        eng.add_embedding_request(f"e{i}", prompt)
    final = finish_all(eng)
    return [final[f"e{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("name", MODELS)
def test_an_embedding_is_the_last_tokens_final_hidden_state(
    tiny_model: Callable[[str], Path], name: str
) -> None:
    folder = tiny_model(name)
    prompts = random_prompts([5, 23], seed=31)
    eng = LLMEngine(engine_config(folder, max_num_batched_tokens=8))  # the long one is chunked
    outputs = embed_all(eng, prompts)
    for out, prompt in zip(outputs, prompts, strict=True):
        assert out.finish_reason == "embedded" and out.output_token_ids == []
        assert out.num_prompt_tokens == len(prompt)
        assert out.embedding is not None and out.embedding.dtype == np.float32
        np.testing.assert_allclose(out.embedding, hf_last_hidden(folder, prompt), atol=2e-4)
    assert eng.stats().generation_tokens_total == 0
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_usable_blocks  # cached, not held


def test_embeddings_beside_generation_and_from_the_prefix_cache(
    tiny_model: Callable[[str], Path],
) -> None:
    folder = tiny_model("llama")
    prompt = random_prompts([40], seed=32)[0]
    eng = LLMEngine(engine_config(folder, block_size=8))
    alone = embed_all(eng, [prompt])[0]
    eng.add_request("g", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    eng.add_embedding_request("again", prompt)  # all cached: the last token is computed again
    final = finish_all(eng)
    again, generated = final["again"], final["g"]
    assert again.num_cached_tokens == 39
    assert again.embedding is not None and alone.embedding is not None
    np.testing.assert_allclose(again.embedding, alone.embedding, atol=1e-5)
    assert len(generated.output_token_ids) == 6  # the generating request went on as ever


def test_an_embedding_of_a_whole_context_is_taken_and_a_longer_one_refused(
    tiny_model: Callable[[str], Path],
) -> None:
    eng = LLMEngine(engine_config(tiny_model("llama"), max_model_len=16))
    out = embed_all(eng, random_prompts([16], seed=33))[0]  # no room left to generate: fine
    assert out.embedding is not None
    with pytest.raises(ValueError, match="must fit max_model_len"):
        eng.add_embedding_request("long", random_prompts([17], seed=33)[0])
    with pytest.raises(ValueError, match="at least one token"):
        eng.add_embedding_request("empty", [])


def test_an_aborted_embedding_finishes_without_one(tiny_model: Callable[[str], Path]) -> None:
    eng = LLMEngine(engine_config(tiny_model("llama")))
    eng.add_embedding_request("e", random_prompts([9], seed=34)[0])
    eng.abort_request("e")
    (out,) = eng.step()
    assert out.finish_reason == "abort" and out.embedding is None
    assert not eng.has_unfinished_requests()


def test_a_cached_embedding_beside_decodes_stays_off_the_decode_graphs(
    tiny_model: Callable[[str], Path],
) -> None:
    """A fully cached prompt computes one token, like a decode: the step still runs eagerly, so
    the hidden state is there to take (the graphs give logits only)."""
    folder = tiny_model("llama")
    prompt = random_prompts([16], seed=35)[0]
    eng = LLMEngine(engine_config(folder, device="cpu", block_size=4, num_kv_blocks=64))
    eng.runner.enable_decode_graphs(max_batch=4, capture=False)
    first = embed_all(eng, [prompt])[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    eng.add_request("g", random_prompts([5], seed=36)[0], params)
    eng.step()  # g is decoding now
    eng.add_embedding_request("again", prompt)
    final = finish_all(eng)
    assert final["again"].num_cached_tokens == 15 and len(final["g"].output_token_ids) == 4
    assert final["again"].embedding is not None and first.embedding is not None
    np.testing.assert_allclose(final["again"].embedding, first.embedding, atol=1e-5)


def test_embeddings_over_two_tensor_parallel_ranks(tiny_model: Callable[[str], Path]) -> None:
    folder = tiny_model("qwen3")
    prompts = random_prompts([7, 30], seed=37)
    config = engine_config(folder, device="cpu", tensor_parallel_size=2, num_kv_blocks=64)
    eng = LLMEngine(config)
    try:
        outputs = embed_all(eng, prompts)
    finally:
        eng.close()
    for out, prompt in zip(outputs, prompts, strict=True):
        assert out.embedding is not None
        np.testing.assert_allclose(out.embedding, hf_last_hidden(folder, prompt), atol=2e-4)
