"""The prefix cache's host tier: blocks the device pool evicts are saved to host memory and
loaded back for a later prompt that starts with them (engine/host_prefix_cache.py,
engine/host_kv_store.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phasefleet.engine.block_pool import hash_block
from phasefleet.engine.config import EngineConfig
from phasefleet.engine.host_kv_store import HostKVStore, memory_left
from phasefleet.engine.host_prefix_cache import HostPrefixCache, KVMove
from phasefleet.engine.kv_cache_manager import KVCacheManager
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.request import Request
from phasefleet.engine.sampling_params import SamplingParams
from tests.engine.factories import (
    engine_config,
    finish_all,
    make_requests,
    make_scheduler,
    pull_kv,
    random_prompts,
)

ModelPath = Callable[[str], Path]
Greedy = Callable[[str, list[int], int], list[int]]
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def block(n: int) -> tuple[int, tuple[int, ...]]:
    """(hash, tokens) of a made-up first block."""
    tokens = (n, n + 1)
    return hash_block(None, list(tokens)), tokens


# -- the index (scheduler side) --


def test_saves_fill_free_slots_then_take_the_least_recently_used() -> None:
    host = HostPrefixCache(2)
    (h1, t1), (h2, t2), (h3, t3) = block(1), block(2), block(3)
    host.save(7, h1, None, t1)
    host.save(8, h2, None, t2)
    host.save(7, h1, None, t1)  # already here: only marked used, nothing copied
    host.save(9, h3, None, t3)  # evicts h2, the least recently used
    assert host.take_moves() == [KVMove(7, 0, True), KVMove(8, 1, True), KVMove(9, 1, True)]
    assert host.lookup(h2, None, list(t2)) is None
    assert host.lookup(h1, None, list(t1)) == 0 and host.lookup(h3, None, list(t3)) == 1
    assert host.take_moves() == [] and host.usage() == 1.0


def test_a_lookup_checks_the_tokens_and_the_parent() -> None:
    host = HostPrefixCache(1)
    h, tokens = block(1)
    host.save(3, h, None, tokens)
    assert host.lookup(h, None, [1, 9]) is None
    assert host.lookup(h, 5, list(tokens)) is None


def test_pinned_slots_are_never_overwritten_and_a_save_without_room_is_dropped() -> None:
    host = HostPrefixCache(1)
    (h1, t1), (h2, t2) = block(1), block(2)
    host.save(3, h1, None, t1)
    host.pin([h1])
    host.save(4, h2, None, t2)
    host.unpin()
    assert host.drops_total == 1 and host.lookup(h1, None, list(t1)) == 0
    host.load(h1, 5)
    assert host.take_moves() == [KVMove(3, 0, True), KVMove(5, 0, False)]


def test_the_index_refuses_no_slots() -> None:
    with pytest.raises(ValueError, match="num_slots must be >= 1"):
        HostPrefixCache(0)


# -- the KV cache manager with a host tier --


def admit(kv: KVCacheManager, req: Request) -> None:
    hit = kv.find_prefix(req)
    assert kv.can_admit(req, hit)
    kv.admit(req, hit)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed(req)


def test_an_evicted_prefix_is_saved_and_comes_back_as_host_hits() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4, host_slots=8)
    first, other = make_requests(2, 12)  # 3 blocks each, a pool of 4 usable
    admit(kv, first)
    kv.free(first)
    admit(kv, other)  # takes the free block, then evicts first's oldest-freed two
    saves = kv.take_moves()
    assert [m.to_host for m in saves] == [True, True]
    again = Request("again", first.prompt_token_ids, first.params, 9.0)
    hit = kv.find_prefix(again)
    # first's blocks were freed tail first: its tail went first, its head is still cached
    assert len(hit.block_ids) == 1 and len(hit.host_hashes) == 2
    assert hit.num_blocks == 3 and hit.num_tokens == 11  # the last token is recomputed
    assert kv.cached_tokens(first.prompt_token_ids, None) == 12
    kv.free(other)
    kv.admit(again, hit)
    moves = kv.take_moves()
    loads = [m for m in moves if not m.to_host]
    assert moves[: -len(loads)] == [m for m in moves if m.to_host]  # saves of other's first
    assert [m.block_id for m in loads] == kv.block_tables["again"][1:]
    assert sorted(m.slot for m in loads) == sorted(m.slot for m in saves)


def test_a_prompt_logprobs_request_and_a_cache_off_manager_skip_the_host_tier() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_caching=False, host_slots=8)
    assert kv.host is None
    (req,) = make_requests(1, 12)
    admit(kv, req)
    kv.free(req)
    assert kv.take_moves() == []


# -- the engine: answers unchanged, prompts loaded instead of computed --


def host_engine(folder: Path, slots: int = 64, **kw: object) -> LLMEngine:
    plain = LLMEngine(engine_config(folder, num_kv_blocks=2, block_size=4, device="cpu"))
    gib = slots * plain.runner.host_block_bytes() / 2**30
    config = engine_config(folder, block_size=4, host_kv_cache_gib=gib, **kw)
    return LLMEngine(config)


def test_a_prompt_evicted_from_the_pool_is_loaded_back_and_answers_alike(
    tiny_model: ModelPath, hf_greedy: Greedy
) -> None:
    engine = host_engine(tiny_model("llama"), num_kv_blocks=17)  # one prompt's worth
    first, other = random_prompts([40, 44], seed=21)
    (out1,) = engine.generate([first], GREEDY)
    engine.generate([other], GREEDY)  # evicts first's blocks: saved to host memory
    (out2,) = engine.generate([first + out1.output_token_ids + [7, 8, 9]], GREEDY)
    stats = engine.stats()
    assert stats.prefix_cache_hits_total >= 44  # first and 4 of its answer: 11 blocks
    assert stats.host_kv_cache_hits_total >= 24  # the pool kept its oldest 3, the rest came back
    assert 0 < stats.host_kv_cache_usage <= 1
    expected = hf_greedy("llama", first + out1.output_token_ids + [7, 8, 9], GREEDY.max_tokens)
    assert out1.output_token_ids == hf_greedy("llama", first, GREEDY.max_tokens)
    assert out2.output_token_ids == expected


def test_the_host_tier_saves_prompt_computation(tiny_model: ModelPath) -> None:
    """Sessions take turns on a pool too small for all of them: with the tier each turn
    computes only its new tokens, and the answers are those of an engine without it."""
    sessions = random_prompts([36, 36, 36], seed=22)
    turns: dict[str, list[list[int]]] = {"with": [], "without": []}
    computed = {}
    for name, gib in (("with", 64), ("without", 0)):
        if gib:
            engine = host_engine(tiny_model("llama"), slots=gib, num_kv_blocks=16)
        else:
            engine = LLMEngine(
                engine_config(tiny_model("llama"), num_kv_blocks=16, block_size=4, device="cpu")
            )
        history = [list(s) for s in sessions]
        for turn in range(3):
            for i in range(len(history)):
                (out,) = engine.generate([history[i]], GREEDY)
                turns[name].append(out.output_token_ids)
                history[i] += out.output_token_ids + [11 + turn, 12 + i]
        computed[name] = engine.stats().prompt_tokens_total - engine.stats().prefix_cache_hits_total
    assert turns["with"] == turns["without"]
    assert computed["with"] < computed["without"] / 2


def test_float8_pool_blocks_go_to_host_memory_and_back(tiny_model: ModelPath) -> None:
    engine = host_engine(tiny_model("llama"), num_kv_blocks=15, kv_cache_dtype="fp8")
    reference = LLMEngine(
        engine_config(tiny_model("llama"), num_kv_blocks=64, kv_cache_dtype="fp8")
    )
    first, other = random_prompts([40, 44], seed=23)
    engine.generate([first], GREEDY)
    engine.generate([other], GREEDY)
    (out,) = engine.generate([first], GREEDY)
    assert engine.stats().host_kv_cache_hits_total >= 24  # of the 39 a full hit skips
    assert out.output_token_ids == reference.generate([first], GREEDY)[0].output_token_ids


def test_two_ranks_save_and_load_each_ranks_heads(tiny_model: ModelPath, hf_greedy: Greedy) -> None:
    engine = host_engine(
        tiny_model("llama"), num_kv_blocks=15, tensor_parallel_size=2, device="cpu"
    )
    try:
        first, other = random_prompts([40, 44], seed=24)
        engine.generate([first], GREEDY)
        engine.generate([other], GREEDY)
        (out,) = engine.generate([first], GREEDY)
        assert engine.stats().host_kv_cache_hits_total >= 24  # of the 39 a full hit skips
    finally:
        engine.close()
    assert out.output_token_ids == hf_greedy("llama", first, GREEDY.max_tokens)


def test_a_decode_worker_counts_host_blocks_as_cached_for_the_hand_off(
    tiny_model: ModelPath, hf_greedy: Greedy
) -> None:
    """The decode side asks the prefill worker to skip what its host tier holds, and the
    request continues from those blocks loaded back and the KV sent for the rest."""
    folder = tiny_model("llama")
    decode = host_engine(folder, num_kv_blocks=15)
    prefill = LLMEngine(engine_config(folder, num_kv_blocks=64, block_size=4, device="cpu"))
    first, other = random_prompts([40, 44], seed=25)
    decode.generate([first], GREEDY)
    decode.generate([other], GREEDY)  # first's blocks now in host memory
    prompt = first + [5, 6, 7, 8, 9, 10, 11, 12]
    skip = decode.cached_prefix_tokens(prompt)
    assert skip == 40
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0, ignore_eos=True)
    prefill.add_request("p", prompt, params, prefill_only=True)
    (handoff,) = finish_all(prefill).values()
    chunks = pull_kv(prefill, "p", first=skip // 4)
    decode.add_request(
        "d", prompt, params, first_token_id=handoff.output_token_ids[0], imported_kv=chunks
    )
    (done,) = finish_all(decode).values()
    assert decode.stats().host_kv_cache_hits_total >= 24  # all 40 cached, most in host memory
    assert done.output_token_ids == hf_greedy("llama", prompt, GREEDY.max_tokens)


def test_the_host_tier_needs_prefix_caching_and_room_for_a_block(tiny_model: ModelPath) -> None:
    with pytest.raises(ValueError, match="host_kv_cache_gib needs enable_prefix_caching"):
        EngineConfig(model="m", host_kv_cache_gib=1, enable_prefix_caching=False).validate()
    with pytest.raises(ValueError, match="host_kv_cache_gib must be a number of GiB >= 0"):
        EngineConfig(model="m", host_kv_cache_gib=-1).validate()
    with pytest.raises(ValueError, match="holds no KV block of"):
        LLMEngine(engine_config(tiny_model("llama"), host_kv_cache_gib=1e-9, device="cpu"))


def test_a_step_carries_the_moves_of_its_admissions_and_counts_host_hits() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, host_slots=8)
    first, other = make_requests(2, 12, max_tokens=1)
    for req in (first, other):
        sched.add_request(req)
        out = sched.schedule()
        sched.update_from_output(out, {req.request_id: 1})
    assert [m.to_host for m in out.kv_moves] == [True, True]  # other's admission evicted first's
    again = Request("again", first.prompt_token_ids, first.params, 9.0)
    sched.add_request(again)
    out = sched.schedule()
    loads = [m for m in out.kv_moves if not m.to_host]
    assert [m.block_id for m in loads] == sched.kv.block_tables["again"][1:3]
    (step,) = out.scheduled
    assert step.start == 11 and step.num_tokens == 1  # only the last prompt token is computed
    assert sched.host_cache_hits_total == 7 and sched.prefix_cache_hits_total == 11


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("staging_bytes", [1, 1 << 20], ids=["block-by-block", "whole-runs"])
def test_the_store_copies_through_its_staging_as_the_moves_say_in_their_order(
    dtype: torch.dtype, staging_bytes: int
) -> None:
    """Each move done alone, in queue order, is the reference: a slot saved twice keeps the
    later block, a slot loaded before it is saved to again gives its earlier contents; runs
    staged whole or a block at a time (a staging smaller than a block) leave the same pool."""
    moves = [
        KVMove(1, 0, True), KVMove(2, 1, True), KVMove(3, 0, True),  # slot 0: block 3 wins
        KVMove(4, 0, False), KVMove(5, 1, False),
        KVMove(6, 0, True), KVMove(7, 0, False),  # slot 0 now holds block 6
    ]  # fmt: skip
    torch.manual_seed(0)
    pool = [tuple(torch.randn(8, 4, 2, 3).to(dtype) for _ in range(2)) for _ in range(2)]
    expected = [[c.clone() for c in pair] for pair in pool]
    slots: dict[int, list[list[torch.Tensor]]] = {}
    for move in moves:
        if move.to_host:
            slots[move.slot] = [[c[move.block_id].clone() for c in pair] for pair in expected]
        else:
            for pair, saved in zip(expected, slots[move.slot], strict=True):
                for cache, block in zip(pair, saved, strict=True):
                    cache[move.block_id] = block
    store = HostKVStore([pool], [(pool, 0)], 2, staging_bytes)  # type: ignore[list-item]
    assert store.staging_blocks == (1 if staging_bytes == 1 else 2)  # at most the slots
    store.apply(moves)
    for layer, want in zip(pool, expected, strict=True):
        for cache, wanted in zip(layer, want, strict=True):
            assert torch.equal(cache.float(), wanted.float())
    assert torch.equal(pool[0][0][4].float(), pool[0][0][3].float())  # what the moves say


def test_memory_left_is_the_tighter_of_the_host_and_the_container(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 9000 kB\nMemAvailable: 4000 kB\n")
    assert memory_left(tmp_path) == 4000 * 1024
    cgroup = tmp_path / "sys/fs/cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.max").write_text("3000000\n")
    (cgroup / "memory.current").write_text("2500000\n")
    (cgroup / "memory.stat").write_text("anon 1000000\ninactive_file 500000\n")
    assert memory_left(tmp_path) == 3000000 - (2500000 - 500000)
    (cgroup / "memory.max").write_text("max\n")
    assert memory_left(tmp_path) == 4000 * 1024
    assert memory_left(tmp_path / "nowhere") is None


def test_a_host_tier_larger_than_the_memory_left_is_refused(
    tiny_model: ModelPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("phasefleet.engine.llm_engine.memory_left", lambda: 1 << 20)
    with pytest.raises(ValueError, match="more than the 0.0 GiB of memory this worker has left"):
        LLMEngine(engine_config(tiny_model("llama"), host_kv_cache_gib=0.5, device="cpu"))


@pytest.mark.parametrize("speculative", [0, 2])
def test_preemption_and_shared_prefixes_under_a_small_pool_answer_as_a_large_one(
    tiny_model: ModelPath, speculative: int
) -> None:
    """Many requests at once over three shared prefixes, on a pool that preempts and evicts
    (prompt-lookup drafts too): the host tier's saves and loads leave every answer as an engine
    with room for everything gives it."""
    heads = random_prompts([24, 32, 20], seed=30)
    tails = random_prompts([5, 9, 13, 3] * 3, seed=31)
    prompts = [heads[i % 3] + tail for i, tail in enumerate(tails)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    folder = tiny_model("llama")
    small = host_engine(folder, num_kv_blocks=24, num_speculative_tokens=speculative)
    large = LLMEngine(
        engine_config(folder, num_kv_blocks=256, block_size=4, num_speculative_tokens=speculative)
    )
    for _ in range(2):  # the second round finds the first's prefixes, on the device or the host
        got = [r.output_token_ids for r in small.generate(prompts, params)]
        want = [r.output_token_ids for r in large.generate(prompts, params)]
        assert got == want
    stats = small.stats()
    assert stats.num_preemptions_total > 0 and stats.host_kv_cache_hits_total > 0
