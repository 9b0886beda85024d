"""Tensor parallelism on the CPU (gloo, one process and one thread per rank): greedy output at
N ranks equals transformers on every model family, KV heads split and replicated, the hand-off
between workers at different degrees, and a rank that dies."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from phasefleet.engine.kv_convert import convert_chunks
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.outputs import TokenLogprob
from phasefleet.engine.parallel.shard import Shard, unsupported
from phasefleet.engine.request import Request
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.tiny import make_tiny
from tests.engine.factories import engine_config, finish_all, pull_kv, random_prompts

HFGreedy = Callable[[str, list[int], int], list[int]]
ModelPath = Callable[[str], Path]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _engine(folder: Path, size: int, **kw: object) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 96)
    kw.setdefault("block_size", 4)
    return LLMEngine(engine_config(folder, device="cpu", tensor_parallel_size=size, **kw))


@pytest.fixture(scope="module")
def engines(tiny_model: ModelPath) -> Iterator[Callable[[str, int], LLMEngine]]:
    """engines(model, N) -> one engine per model and degree for the module, closed after it."""
    made: dict[tuple[str, int], LLMEngine] = {}

    def get(name: str, size: int) -> LLMEngine:
        if (name, size) not in made:
            made[name, size] = _engine(tiny_model(name), size, max_num_batched_tokens=24)
        return made[name, size]

    yield get
    for engine in made.values():
        engine.close()


def _check(engine: LLMEngine, name: str, hf_greedy: HFGreedy, seed: int) -> None:
    prompts = random_prompts([3, 17, 40, 9], seed=seed)  # chunked, beside decodes
    for prompt, out in zip(prompts, engine.generate(prompts, GREEDY), strict=True):
        assert out.output_token_ids == hf_greedy(name, prompt, GREEDY.max_tokens)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "phi3",
        "gemma2",
        "gemma3",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
    ],  # fmt: skip
)
def test_two_ranks_match_transformers(
    name: str, engines: Callable[[str, int], LLMEngine], hf_greedy: HFGreedy
) -> None:
    engine = engines(name, 2)
    assert engine.kv_layout.head_shards == 2  # 2 KV heads, one per rank
    _check(engine, name, hf_greedy, seed=1)


def test_four_ranks_over_two_kv_heads_replicate_them_and_match_transformers(
    engines: Callable[[str, int], LLMEngine], hf_greedy: HFGreedy
) -> None:
    engine = engines("llama", 4)  # 4 query heads, 2 KV heads: each KV head on 2 ranks
    assert engine.kv_layout.head_shards == 2 and engine.kv_layout.num_kv_heads == 2
    _check(engine, "llama", hf_greedy, seed=2)


def test_one_kv_head_over_two_ranks_matches_transformers(
    tmp_path: Path, hf_greedy: HFGreedy, tiny_model: ModelPath
) -> None:
    from transformers import AutoModelForCausalLM

    folder = make_tiny(tmp_path / "mqa", arch="llama", seed=6, num_kv_heads=1)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = _engine(folder, 2)
    try:
        assert engine.kv_layout.head_shards == 1
        (prompt,) = random_prompts([21], seed=3)
        (out,) = engine.generate([prompt], GREEDY)
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(GREEDY.max_tokens):
                ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.output_token_ids == ids[len(prompt) :]
    finally:
        engine.close()


def test_drafts_verified_over_two_ranks_match_transformers(
    tiny_model: ModelPath, hf_greedy: HFGreedy
) -> None:
    """Speculative decoding: every rank computes the drafted chunk and its verify rows. The
    drafts are the reference's next tokens with the third one wrong (accepted, then not)."""
    engine = _engine(tiny_model("llama"), 2, num_speculative_tokens=3, max_num_batched_tokens=24)
    prompts = random_prompts([9, 30], seed=4)
    reference = [hf_greedy("llama", p, GREEDY.max_tokens) for p in prompts]

    def draft(req: Request, _: object) -> None:
        done = len(req.output_token_ids)
        guess = reference[int(req.request_id)][done : done + 3]
        req.draft_token_ids = guess[:2] + [(t + 1) % 500 for t in guess[2:]]

    engine._draft = draft  # type: ignore[method-assign, assignment]
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(**vars(GREEDY)))
        outputs = finish_all(engine)
        assert [outputs[str(i)].output_token_ids for i in range(2)] == reference
        assert 0 < engine.scheduler.accepted_tokens_total < engine.scheduler.draft_tokens_total
    finally:
        engine.close()


def test_prompt_logprobs_at_two_ranks_equal_one_ranks(
    engines: Callable[[str, int], LLMEngine], tiny_model: ModelPath
) -> None:
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, logprobs=2)
    (prompt,) = random_prompts([30], seed=4)
    one = _engine(tiny_model("llama"), 1, max_num_batched_tokens=24)
    want, got = (
        _prompt_logprobs(one, prompt, params),
        _prompt_logprobs(engines("llama", 2), prompt, params),
    )
    assert len(got) == len(want) == 29  # over two chunks of 24 tokens
    for a, b in zip(got, want, strict=True):
        assert (a.token_id, [t for t, _ in a.top]) == (b.token_id, [t for t, _ in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def _prompt_logprobs(
    engine: LLMEngine, prompt: list[int], params: SamplingParams
) -> list[TokenLogprob]:
    engine.add_request("lp", prompt, params)
    found: list[TokenLogprob] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            found += out.prompt_logprobs or []
    return found


@pytest.mark.parametrize(("sender", "receiver"), [(2, 1), (1, 2), (2, 4), (4, 1)])
def test_handoff_between_degrees_matches_transformers(
    sender: int,
    receiver: int,
    engines: Callable[[str, int], LLMEngine],
    tiny_model: ModelPath,
    hf_greedy: HFGreedy,
) -> None:
    """The prefill side's KV, read from each of its ranks in its own layout, converted to the
    decode side's and written into each of its ranks: nothing recomputed, greedy output equals
    transformers'."""
    one = _engine(tiny_model("llama"), 1, max_num_batched_tokens=24)
    prefill = one if sender == 1 else engines("llama", sender)
    decode = one if receiver == 1 else engines("llama", receiver)
    (prompt,) = random_prompts([19], seed=10 + sender * 10 + receiver)
    rid = f"handoff-{sender}-{receiver}"
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prefill.add_request(rid, prompt, params, prefill_only=True)
    first = finish_all(prefill)[rid]
    sent = pull_kv(prefill, rid)
    assert prefill.release_kv(rid)
    chunks = convert_chunks(sent, prefill.kv_layout, decode.kv_layout, len(prompt))
    before = decode.stats().prompt_tokens_total
    decode.add_request(
        rid, prompt, params, first_token_id=first.output_token_ids[0], imported_kv=chunks
    )
    out = finish_all(decode)[rid]
    assert decode.stats().prompt_tokens_total == before  # nothing recomputed
    assert out.output_token_ids == hf_greedy("llama", prompt, 10)


def test_a_degree_that_does_not_split_the_heads_is_refused_before_any_rank_starts(
    tiny_model: ModelPath,
) -> None:
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        _engine(tiny_model("llama"), 3)


def test_a_rank_that_dies_fails_the_next_step_with_its_reason(tiny_model: ModelPath) -> None:
    engine = _engine(tiny_model("qwen2"), 2)
    try:
        ranks = engine.runner.ranks
        assert ranks is not None and ranks.failure() is None
        (prompt,) = random_prompts([5], seed=5)
        engine.generate([prompt], GREEDY)  # serves
        pid = ranks.procs[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        ranks.procs[0].join(10)
        assert ranks.failure() == "tensor-parallel rank 1 exited (signal 9)"
        engine.add_request("after", prompt, GREEDY)
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            engine.step()
    finally:
        engine.close()


def test_shards_split_heads_mlp_and_vocabulary() -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(
        num_attention_heads=8, num_key_value_heads=2, intermediate_size=12, vocab_size=10
    )
    shards = [Shard(r, 4) for r in range(4)]
    assert [list(s.heads(config)) for s in shards] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # 2 KV heads over 4 ranks: ranks 0-1 hold head 0 (query heads 0-3 read it), 2-3 head 1
    assert [list(s.kv_heads(config)) for s in shards] == [[0], [0], [1], [1]]
    assert [s.kv_shard(config) for s in shards] == [0, 0, 1, 1]
    assert shards[3].mlp(config) == range(9, 12)
    embed = torch.arange(20.0).view(10, 2)
    assert shards[3].take("model.embed_tokens.weight", embed, config, 1).tolist() == [
        [18.0, 19.0],
        [0.0, 0.0],
        [0.0, 0.0],
    ]  # 3 rows per rank, the last padded with zeros
    down = torch.arange(24.0).view(2, 12)
    assert shards[1].take("model.layers.0.mlp.down_proj.weight", down, config, 1).shape == (2, 3)
    bias = torch.ones(2)
    assert not shards[1].take("model.layers.0.self_attn.o_proj.bias", bias, config, 1).any()
    assert shards[0].take("model.layers.0.self_attn.o_proj.bias", bias, config, 1).all()
    assert unsupported(config, 3) is not None and unsupported(config, 8) is not None
    assert unsupported(config, 4) is None
