"""A float8 KV pool (`kv_cache_dtype="fp8"`, engine/kv_dtype.py): its answers against
transformers with its keys (after RoPE) and values rounded to float8 the same way, through
chunked prefill, prefix-cache hits, sliding windows, softcapped decodes and the hand-off."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from phasefleet.engine.kv_convert import convert_chunks
from phasefleet.engine.kv_dtype import FLOAT8, to_kv
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams
from tests.engine.factories import engine_config, finish_all, pull_kv, random_prompts
from tests.engine.test_speculation import oracle_engine

ModelPath = Callable[[str], Path]
Greedy = Callable[[str, list[int], int], list[int]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def rounded(x: torch.Tensor) -> torch.Tensor:
    return to_kv(x, FLOAT8).to(x.dtype)


@pytest.fixture(scope="module")
def fp8_reference(tiny_model: ModelPath) -> Iterator[Greedy]:
    """reference(model, prompt, n) -> n greedy tokens of transformers whose attention sees its
    keys and values rounded to float8: its `apply_rotary_pos_emb` rounds the rotated keys, a
    hook on each v_proj the values (no KV cache: every step from scratch)."""
    patches: list[tuple[Any, Any]] = []
    models: dict[str, torch.nn.Module] = {}

    def rounding_rope(original: Any) -> Any:
        def rope(q: torch.Tensor, k: torch.Tensor, *args: Any, **kw: Any) -> Any:
            q, k = original(q, k, *args, **kw)
            return q, rounded(k)

        return rope

    def run(name: str, prompt: list[int], n: int) -> list[int]:
        if name not in models:
            eager = {"attn_implementation": "eager"} if name.startswith("gemma2") else {}
            model = AutoModelForCausalLM.from_pretrained(
                tiny_model(name), dtype=torch.float32, **eager
            ).eval()
            module: Any = sys.modules[type(model.model.layers[0].self_attn).__module__]
            if not any(m is module for m, _ in patches):
                patches.append((module, module.apply_rotary_pos_emb))
                module.apply_rotary_pos_emb = rounding_rope(module.apply_rotary_pos_emb)
            for layer in model.model.layers:
                layer.self_attn.v_proj.register_forward_hook(lambda m, i, out: rounded(out))
            models[name] = model
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(models[name](torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    yield run
    for module, original in patches:
        module.apply_rotary_pos_emb = original


def fp8_engine(folder: Path, **kw: object) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("block_size", 4)
    return LLMEngine(engine_config(folder, kv_cache_dtype="fp8", **kw))


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral_sw", "gemma2"])
def test_fp8_pool_answers_as_transformers_with_rounded_keys_and_values(
    tiny_model: ModelPath, fp8_reference: Greedy, hf_greedy: Greedy, name: str
) -> None:
    """Prompts longer than a step's budget (their later chunks read the earlier ones' keys
    from the pool), beside decodes; a sliding window (mistral_sw); softcapped scores read as
    matmuls (gemma2)."""
    engine = fp8_engine(tiny_model(name), max_num_batched_tokens=16)
    assert engine.kv_layout.dtype == "float8_e4m3fn"
    prompts = random_prompts([37, 5, 22], seed=7)
    outputs = engine.generate(prompts, GREEDY)
    answers = [out.output_token_ids for out in outputs]
    assert answers == [fp8_reference(name, p, GREEDY.max_tokens) for p in prompts]
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_the_rounding_is_what_the_reference_checks(
    tiny_model: ModelPath, fp8_reference: Greedy, hf_greedy: Greedy
) -> None:
    """The reference's rounding changes answers (so the test above can fail): on some prompt
    of these, float8 keys and values give other tokens than float32 ones."""
    prompts = random_prompts([30, 31, 32, 33, 34, 35], seed=3)
    assert any(fp8_reference("llama", p, 24) != hf_greedy("llama", p, 24) for p in prompts)


@pytest.mark.parametrize("wrong_at", [None, 1])
def test_drafts_verified_against_a_float8_pool_change_no_token(
    tiny_model: ModelPath, fp8_reference: Greedy, wrong_at: int | None
) -> None:
    """A step that verifies drafts reads its own new keys as stored, as a one-token step
    does: the same tokens with every draft right, or one wrong."""
    prompts = random_prompts([15, 28], seed=13)
    reference = {f"r{i}": fp8_reference("llama", p, 10) for i, p in enumerate(prompts)}
    engine = oracle_engine(tiny_model("llama"), reference, wrong_at, kv_cache_dtype="fp8")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for rid, prompt in zip(reference, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    answers = {rid: out.output_token_ids for rid, out in finish_all(engine).items()}
    assert answers == reference
    assert engine.stats().spec_draft_tokens_total > 0


def test_prefix_cache_hits_read_the_stored_keys(
    tiny_model: ModelPath, fp8_reference: Greedy
) -> None:
    engine = fp8_engine(tiny_model("llama"))
    (base,) = random_prompts([24], seed=8)
    engine.generate([base], GREEDY)
    longer = base + random_prompts([6], seed=9)[0]
    (out,) = engine.generate([longer], GREEDY)
    assert engine.stats().prefix_cache_hits_total >= 20
    assert out.output_token_ids == fp8_reference("llama", longer, GREEDY.max_tokens)


def test_two_ranks_keep_float8_pools_and_answer_alike(
    tiny_model: ModelPath, fp8_reference: Greedy
) -> None:
    """Each rank allocates its own float8 pool (its KV heads), and the hand-off reads both."""
    engine = fp8_engine(tiny_model("llama"), tensor_parallel_size=2, device="cpu")
    try:
        prompts = random_prompts([26, 9], seed=12)
        answers = [out.output_token_ids for out in engine.generate(prompts, GREEDY)]
        assert engine.kv_layout.head_shards == 2
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        engine.add_request("p", prompts[0], params, prefill_only=True)
        finish_all(engine)
        (chunk,) = pull_kv(engine, "p")
        assert chunk.payload.numel() == chunk.num_blocks * engine.kv_layout.block_bytes()
    finally:
        engine.close()
    assert answers == [fp8_reference("llama", p, GREEDY.max_tokens) for p in prompts]


def test_a_block_of_fp8_is_a_quarter_of_float32s(tiny_model: ModelPath) -> None:
    plain = LLMEngine(engine_config(tiny_model("llama"), num_kv_blocks=8, device="cpu"))
    fp8 = fp8_engine(tiny_model("llama"), num_kv_blocks=8, block_size=16, device="cpu")
    assert plain.runner.block_bytes() == 4 * fp8.runner.block_bytes()
    assert plain.kv_layout.block_bytes() == 4 * fp8.kv_layout.block_bytes()


@pytest.mark.parametrize("decode_kv", ["fp8", "auto"])
def test_an_fp8_prefill_pool_hands_off_its_blocks(
    tiny_model: ModelPath, fp8_reference: Greedy, decode_kv: str
) -> None:
    """To an fp8 decode pool as they are (one byte a value on the wire): the rounded model's
    answer. To a float32 one converted, the values as stored: nothing recomputed, the first
    token the rounded model's (its later keys are the decode pool's own, unrounded)."""
    (prompt,) = random_prompts([19], seed=10)
    prefill = fp8_engine(tiny_model("llama"))
    decode = LLMEngine(
        engine_config(tiny_model("llama"), num_kv_blocks=64, block_size=4, kv_cache_dtype=decode_kv)
    )
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prefill.add_request("r", prompt, params, prefill_only=True)
    first = finish_all(prefill)["r"]
    chunks = pull_kv(prefill, "r")
    if decode_kv == "auto":
        assert chunks[0].payload.numel() == 5 * prefill.kv_layout.block_bytes()
        chunks = convert_chunks(chunks, prefill.kv_layout, decode.kv_layout, len(prompt))
    decode.add_request(
        "r", prompt, params, first_token_id=first.output_token_ids[0], imported_kv=chunks
    )
    out = finish_all(decode)["r"]
    assert decode.stats().prompt_tokens_total == 0  # nothing recomputed
    expected = fp8_reference("llama", prompt, 10)
    assert out.output_token_ids[0] == expected[0]
    if decode_kv == "fp8":
        assert out.output_token_ids == expected


def test_keys_past_the_float8_range_saturate_rather_than_turn_nan() -> None:
    x = torch.tensor([1000.0, -1000.0, 1.0])
    assert to_kv(x, FLOAT8).float().tolist() == [448.0, -448.0, 1.0]
    assert torch.tensor([1000.0]).to(FLOAT8).float().isnan().all()  # what a plain cast does
