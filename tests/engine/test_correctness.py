"""Our engine against transformers on the same weights: greedy, token for token (float32), on
the CPU or, with PHASEFLEET_TEST_DEVICE=cuda, on the GPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams
from tests.engine.factories import TINY_MODELS, engine_config, random_prompts

HFGreedy = Callable[[str, list[int], int], list[int]]
ModelPath = Callable[[str], Path]

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def engine(folder: Path, **kw: object) -> LLMEngine:
    return LLMEngine(engine_config(folder, **kw))


def check(eng: LLMEngine, name: str, prompts: list[list[int]], hf_greedy: HFGreedy) -> None:
    outputs = eng.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.finished and out.finish_reason == "length"
        assert out.output_token_ids == hf_greedy(name, prompt, GREEDY.max_tokens)
    stats = eng.stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # everything freed


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_single_request_matches_transformers(
    name: str, tiny_model: ModelPath, hf_greedy: HFGreedy
) -> None:
    eng = engine(tiny_model(name))
    check(eng, name, random_prompts([37], seed=1), hf_greedy)


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_mixed_batch_through_chunked_prefill_matches_transformers(
    name: str, tiny_model: ModelPath, hf_greedy: HFGreedy
) -> None:
    # A small token budget and small blocks: prompts are split into chunks that share steps
    # with other requests' decodes.
    eng = engine(tiny_model(name), block_size=4, max_num_batched_tokens=24, num_kv_blocks=128)
    prompts = random_prompts([3, 17, 40, 64, 9, 1], seed=2)
    check(eng, name, prompts, hf_greedy)
    stats = eng.stats()
    assert stats.generation_tokens_total == 6 * GREEDY.max_tokens
    # the peak gauges remember the burst that is over: all six were running or waiting
    assert (stats.num_running, stats.num_requests_peak) == (0, 6)
    assert stats.kv_cache_usage == 0 and 0 < stats.kv_cache_usage_peak <= 1


@pytest.mark.parametrize("backend", ["onednn", "torch"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_both_cpu_linear_paths_match_transformers(
    name: str,
    backend: str,
    tiny_model: ModelPath,
    hf_greedy: HFGreedy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "torch" (F.linear) is the path CUDA runs; "onednn" the CPU default. qwen2: bias, tied.
    monkeypatch.setenv("PHASEFLEET_CPU_LINEAR", backend)
    eng = engine(
        tiny_model(name), device="cpu", block_size=4, max_num_batched_tokens=24, num_kv_blocks=128
    )
    assert eng.runner.model.linear_backend == backend
    check(eng, name, random_prompts([3, 17, 40, 9], seed=3), hf_greedy)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_prefix_cache_hits_give_the_same_tokens(
    name: str, tiny_model: ModelPath, hf_greedy: HFGreedy
) -> None:
    eng = engine(tiny_model(name), block_size=4, max_num_batched_tokens=32)
    base = random_prompts([24], seed=3)[0]
    tails = random_prompts([5, 11, 0, 2], seed=4)
    # The warm-up fills the cache; then prompts that share its prefix, one identical to it
    # (a full hit: the last token is recomputed).
    check(eng, name, [base], hf_greedy)
    assert eng.stats().prefix_cache_hits_total == 0
    prompts = [base + tail for tail in tails]
    outputs = eng.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.output_token_ids == hf_greedy(name, prompt, GREEDY.max_tokens)
        assert out.num_cached_tokens >= 20
    assert outputs[2].num_cached_tokens == 23  # full hit: all but the last prompt token
    stats = eng.stats()
    assert stats.prefix_cache_hits_total >= 4 * 20
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("name", ["llama", "mistral_sw"])
def test_forced_preemption_gives_the_same_tokens(
    name: str, tiny_model: ModelPath, hf_greedy: HFGreedy
) -> None:
    # 6 requests of up to 30 + 20 tokens need ~13 blocks each at the end; the pool has 24.
    eng = engine(tiny_model(name), block_size=4, num_kv_blocks=25, max_num_batched_tokens=64)
    prompts = random_prompts([30, 22, 14, 27, 8, 19], seed=5)
    check(eng, name, prompts, hf_greedy)
    assert eng.stats().num_preemptions_total > 0


def test_preemption_without_prefix_caching(tiny_model: ModelPath, hf_greedy: HFGreedy) -> None:
    eng = engine(
        tiny_model("llama"),
        block_size=4,
        num_kv_blocks=25,
        enable_prefix_caching=False,
    )
    prompts = random_prompts([30, 22, 14, 27], seed=6)
    check(eng, "llama", prompts, hf_greedy)
    stats = eng.stats()
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits_total == 0


def test_decodes_are_grouped_by_context_length() -> None:
    import numpy as np
    import torch

    from phasefleet.engine.block_table import BlockTables
    from phasefleet.engine.step_plan import _groups

    ctx = [4, 5, 30, 31, 100]  # blocks 1, 2, 8, 8, 25 of 4 tokens
    tables = BlockTables(8, 25, torch.device("cpu"), separate=False)
    rows = [tables.row(f"r{i}", list(range(1 + 25 * i, 26 + 25 * i)), 25) for i in range(5)]
    groups = _groups(ctx, rows, tables, 4)
    assert [(g.start, g.size) for g in groups] == [(0, 1), (1, 1), (2, 2), (4, 1)]
    assert [g.width for g in groups] == [1, 2, 8, 25]
    # A lone request whose blocks are consecutive in the pool is read as a view, not gathered.
    assert [g.first_block for g in groups] == [1, 26, None, 101]
    tables.host[rows[4], 3] = 7
    assert _groups(ctx, rows, tables, 4)[3].first_block is None
    assert np.array_equal(tables.host[rows[0], :3], [1, 2, 3])


def test_longrope_short_or_long_factors_by_max_model_len(tmp_path: Path) -> None:
    """Phi-3's LongRoPE (128k models): transformers uses the short factors while a sequence is
    within original_max_position_embeddings and the long ones, for every position, past it.
    The engine chooses once, by max_model_len (as vLLM): within the original length greedy
    equals transformers' on a short prompt; at the default (max_position_embeddings) it equals
    transformers' on a prompt longer than the original length."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from phasefleet.engine.tiny import make_tiny

    folder = make_tiny(tmp_path / "phi3-longrope", arch="phi3", seed=11)
    config = json.loads((folder / "config.json").read_text())
    half = int(config["hidden_size"] // config["num_attention_heads"] * 0.75) // 2
    config["original_max_position_embeddings"] = 64
    config["rope_scaling"] = {
        "type": "longrope",
        "short_factor": [1.0 + 0.5 * i for i in range(half)],
        "long_factor": [4.0 + i for i in range(half)],
    }
    (folder / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def reference(prompt: list[int]) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(GREEDY.max_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    short, long = random_prompts([30, 70], seed=4)
    within = engine(folder, max_model_len=64)
    assert 30 + GREEDY.max_tokens <= 64
    assert within.generate([short], GREEDY)[0].output_token_ids == reference(short)
    past = engine(folder)
    assert past.max_model_len == config["max_position_embeddings"] > 64
    assert past.generate([long], GREEDY)[0].output_token_ids == reference(long)
    # the two engines' tables differ: each comparison above sees which factors it uses
    short_cos, long_cos = within.runner.model.rope_cos, past.runner.model.rope_cos
    assert short_cos is not None and long_cos is not None
    assert not torch.equal(short_cos, long_cos[:64])
    # and their KV cannot be handed from one to the other: the layouts name the factors
    assert (within.kv_layout.rope, past.kv_layout.rope) == ("longrope-short", "longrope-long")
    assert within.kv_layout.unconvertible(past.kv_layout) == (
        "rope differs (here longrope-short, sender longrope-long)"
    )
