"""The KV hand-off's engine parts: held blocks on the prefill side, imported KV on the decode
side, leases, and the wire layout."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phasefleet.engine.kv_convert import convert_chunks
from phasefleet.engine.kv_transfer import KVChunk, KVLayout, LeaseTable
from phasefleet.engine.llm_engine import LLMEngine, RequestOutput
from phasefleet.engine.request import Request, RequestStatus
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.scheduler import Scheduler
from tests.engine.factories import (
    DEVICE,
    engine_config,
    finish_all,
    make_requests,
    make_scheduler,
    pull_kv,
    random_prompts,
)


def run_to_finish(sched: Scheduler) -> list[Request]:
    """Steps until every request is finished, sampling tokens 7000, 7001, ..."""
    tokens = iter(range(7000, 8000))
    finished = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sampled = {s.request.request_id: next(tokens) for s in out.scheduled if s.sample}
        finished += [r for r in sched.update_from_output(out, sampled) if r.is_finished]
    return finished


def test_prefill_only_request_finishes_with_handoff_and_keeps_its_blocks() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    (req,) = make_requests(1, 10, max_tokens=16)
    req.prefill_only = True
    sched.add_request(req)
    (done,) = run_to_finish(sched)
    assert done.finish_reason == "handoff"
    assert len(done.output_token_ids) == 1
    held = sched.kv.held[req.request_id]
    assert len(held) == 3  # 10 prompt tokens + 1 output token in blocks of 4
    free_before = sched.kv.pool.num_free_blocks
    assert sched.kv.release(req.request_id)
    assert sched.kv.pool.num_free_blocks == free_before + 3
    assert not sched.kv.release(req.request_id)


def test_prefill_only_request_that_ends_naturally_frees_its_blocks() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    (req,) = make_requests(1, 10, max_tokens=1)  # its whole answer is the first token
    req.prefill_only = True
    sched.add_request(req)
    (done,) = run_to_finish(sched)
    assert done.finish_reason == "length"
    assert sched.kv.held == {}
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_imported_prompt_is_not_recomputed_and_its_blocks_are_loaded() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    (req,) = make_requests(1, 10, max_tokens=4)
    req.output_token_ids = [555]  # the first token, sampled by the prefill worker
    req.num_imported_tokens = 10
    sched.add_request(req)
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.start, s.num_tokens, s.sample) == (10, 1, True)  # only the first token's KV
    assert out.imports == [(req, 0)]
    assert sched.prompt_tokens_total == 0  # prefilled elsewhere


def test_import_skips_blocks_the_prefix_cache_already_has() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    (first,) = make_requests(1, 10, max_tokens=1)
    sched.add_request(first)
    run_to_finish(sched)  # caches the first two full blocks of this prompt
    (again,) = make_requests(1, 10, max_tokens=4, prefix="again")
    again.output_token_ids = [555]
    again.num_imported_tokens = 10
    sched.add_request(again)
    out = sched.schedule()
    assert out.imports == [(again, 2)]  # blocks 0 and 1 are hits; load from block 2 on


def test_preempted_import_recomputes_its_prompt() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    (req,) = make_requests(1, 10, max_tokens=4)
    req.output_token_ids = [555]
    req.num_imported_tokens = 10
    sched.add_request(req)
    sched.schedule()
    sched._preempt(req)
    assert req.status is RequestStatus.WAITING
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.start, s.num_tokens) == (0, 11)  # prompt + first token, computed here
    assert out.imports == []


def test_leases_expire_on_the_injected_clock_but_not_under_a_reader() -> None:
    now = [100.0]
    table = LeaseTable(duration=30.0, clock=lambda: now[0])
    table.add("a", [1, 2], 7)
    table.add("b", [3], 2)
    lease = table.pin("a")
    assert lease is not None and lease.block_ids == [1, 2]
    now[0] = 131.0
    assert [x.request_id for x in table.pop_expired()] == ["b"]  # "a" is being read
    assert table.pop("a") is None  # still pinned
    table.unpin(lease)
    assert table.pin("a") is None  # expired, no reader: cannot be pulled any more
    assert [x.request_id for x in table.pop_expired()] == ["a"]
    assert len(table) == 0


def test_lease_pop_ends_a_live_lease_once() -> None:
    table = LeaseTable(duration=30.0, clock=lambda: 0.0)
    table.add("a", [1], 3)
    popped = table.pop("a")
    assert popped is not None and popped.block_ids == [1]
    assert table.pop("a") is None


def test_layout_sizes_and_what_cannot_be_converted() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
    assert layout.block_bytes() == 2 * 2 * 4 * 2 * 8 * 2
    other = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
    assert layout.unconvertible(other) is None  # block size and dtype convert
    deeper = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
    assert layout.unconvertible(deeper) == "num_layers differs (here 2, sender 3)"
    rotated = KVLayout(2, 2, 8, 4, "bfloat16", rope="longrope-long")
    assert layout.unconvertible(rotated) == "rope differs (here default, sender longrope-long)"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_reads_and_writes_blocks_in_wire_order(
    tiny_model: Callable[[str], Path], dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoConfig

    from phasefleet.engine import kv_export
    from phasefleet.engine.model_runner import ModelRunner

    folder = tiny_model("llama")
    config = AutoConfig.from_pretrained(folder)
    sender = ModelRunner(folder, config, dtype, torch.device(DEVICE), 4, 64)
    receiver = ModelRunner(folder, config, dtype, torch.device(DEVICE), 4, 64)
    sender.allocate_kv(6)
    receiver.allocate_kv(6)
    gen = torch.Generator().manual_seed(0)
    for keys, values in sender.kv_caches:
        keys.copy_(torch.randn(keys.shape, generator=gen).to(keys.dtype))
        values.copy_(torch.randn(values.shape, generator=gen).to(values.dtype))
    layout = sender.kv_layout()
    index = torch.tensor([4, 1, 2], device=sender.device)
    wire = b"".join(  # layer-major: each layer's keys, then its values
        bytes(c.index_select(0, index).cpu().view(torch.uint8).numpy())
        for pair in sender.kv_caches
        for c in pair
    )
    block = layout.payload_bytes(1) // (2 * layout.num_layers)  # one layer's keys, one block
    # One chunk; whole layers per chunk; a layer's keys in pieces of one block: the same bytes.
    for chunk_bytes, count in ((32 << 20, 1), (6 * block, 2), (block, 6 * layout.num_layers)):
        monkeypatch.setattr(kv_export, "CHUNK_BYTES", chunk_bytes)
        chunks = [bytes(c) for c in sender.read_kv([4, 1, 2])]  # each chunk's memory is reused
        assert b"".join(chunks) == wire and len(chunks) == count, chunk_bytes
    payload = wire
    assert len(payload) == layout.payload_bytes(3)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    receiver.write_kv([3, 0], data, first_block=1)  # the sender's blocks 1 and 2
    for (sk, sv), (rk, rv) in zip(sender.kv_caches, receiver.kv_caches, strict=True):
        assert torch.equal(rk[3], sk[1]) and torch.equal(rk[0], sk[2])
        assert torch.equal(rv[3], sv[1]) and torch.equal(rv[0], sv[2])
        assert not rk[1].any()  # untouched blocks stay as they were


def _engine(folder: Path, **kw: object) -> LLMEngine:
    return LLMEngine(engine_config(folder, num_kv_blocks=64, block_size=4, **kw))


def _prefill(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int) -> RequestOutput:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_request(rid, prompt, params, prefill_only=True)
    return finish_all(engine)[rid]


@pytest.mark.parametrize("length", [7, 8, 13])  # inside, at and across block boundaries
def test_disaggregated_greedy_equals_transformers(
    tiny_model: Callable[[str], Path],
    hf_greedy: Callable[[str, list[int], int], list[int]],
    length: int,
) -> None:
    (prompt,) = random_prompts([length], seed=length)
    prefill, decode = _engine(tiny_model("llama")), _engine(tiny_model("llama"))
    first = _prefill(prefill, "r", prompt, max_tokens=10)
    assert first.finish_reason == "handoff" and len(first.output_token_ids) == 1
    assert prefill.stats().num_kv_leases == 1
    payload = pull_kv(prefill, "r")
    assert prefill.release_kv("r") and not prefill.release_kv("r")
    assert prefill.kv.pool.num_free_blocks == prefill.kv.pool.num_usable_blocks
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    decode.add_request(
        "r", prompt, params, first_token_id=first.output_token_ids[0], imported_kv=payload
    )
    out = finish_all(decode)["r"]
    assert decode.stats().prompt_tokens_total == 0  # nothing recomputed
    assert out.output_token_ids == hf_greedy("llama", prompt, 10)
    assert out.finish_reason == "length"


def test_decode_without_kv_recomputes_and_matches(
    tiny_model: Callable[[str], Path], hf_greedy: Callable[[str, list[int], int], list[int]]
) -> None:
    (prompt,) = random_prompts([11], seed=3)
    decode = _engine(tiny_model("llama"))
    first = hf_greedy("llama", prompt, 1)[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    decode.add_request("r", prompt, params, first_token_id=first)
    out = finish_all(decode)["r"]
    assert out.output_token_ids == hf_greedy("llama", prompt, 6)
    assert decode.stats().prompt_tokens_total == 11


def test_pulled_prompt_becomes_a_prefix_cache_entry_on_the_decode_side(
    tiny_model: Callable[[str], Path],
) -> None:
    (prompt,) = random_prompts([13], seed=5)
    prefill, decode = _engine(tiny_model("llama")), _engine(tiny_model("llama"))
    first = _prefill(prefill, "a", prompt, max_tokens=4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    decode.add_request(
        "a",
        prompt,
        params,
        first_token_id=first.output_token_ids[0],
        imported_kv=pull_kv(prefill, "a"),
    )
    finish_all(decode)
    decode.add_request("b", prompt, params)
    out = finish_all(decode)["b"]
    assert out.num_cached_tokens == 12  # three full blocks of 4, pulled, now cached


def test_expired_lease_frees_its_blocks_and_is_counted(tiny_model: Callable[[str], Path]) -> None:
    now = [0.0]
    prefill = _engine(tiny_model("llama"))
    prefill.leases = LeaseTable(duration=30.0, clock=lambda: now[0])
    (prompt,) = random_prompts([9], seed=7)
    _prefill(prefill, "r", prompt, max_tokens=4)
    assert prefill.kv.pool.num_free_blocks < prefill.kv.pool.num_usable_blocks
    now[0] = 31.0
    prefill.step()
    assert prefill.pin_kv("r") is None
    stats = prefill.stats()
    assert (stats.num_kv_leases, stats.num_kv_lease_expiries_total) == (0, 1)
    assert prefill.kv.pool.num_free_blocks == prefill.kv.pool.num_usable_blocks


def test_prefill_that_ends_for_good_leases_nothing(tiny_model: Callable[[str], Path]) -> None:
    prefill = _engine(tiny_model("llama"))
    (prompt,) = random_prompts([9], seed=8)
    out = _prefill(prefill, "r", prompt, max_tokens=1)
    assert out.finish_reason == "length"
    assert prefill.stats().num_kv_leases == 0
    assert prefill.kv.pool.num_free_blocks == prefill.kv.pool.num_usable_blocks


def test_imported_kv_of_the_wrong_size_is_refused(tiny_model: Callable[[str], Path]) -> None:
    decode = _engine(tiny_model("llama"))
    params = SamplingParams(max_tokens=4, temperature=0)
    short = [KVChunk(0, 1, torch.zeros(3, dtype=torch.uint8))]
    with pytest.raises(ValueError, match="the chunk at block 0 .expected 0. holds 3 bytes"):
        decode.add_request("r", [5, 6, 7], params, first_token_id=9, imported_kv=short)
    block = decode.kv_layout.block_bytes()
    gap = [KVChunk(0, 1, torch.zeros(block, dtype=torch.uint8))] * 2  # block 0 twice
    with pytest.raises(ValueError, match="at block 0 .expected 1."):
        decode.add_request("r", list(range(5, 13)), params, first_token_id=9, imported_kv=gap)
    too_long = [KVChunk(0, 2, torch.zeros(2 * block, dtype=torch.uint8))]
    with pytest.raises(ValueError, match="covers 2 blocks, more than the 3-token prompt's 1"):
        decode.add_request("r", [5, 6, 7], params, first_token_id=9, imported_kv=too_long)
    assert not decode.has_unfinished_requests()


def test_a_partial_import_recomputes_only_the_tail(
    tiny_model: Callable[[str], Path], hf_greedy: Callable[[str, list[int], int], list[int]]
) -> None:
    """A stream cut after two of the prompt's four blocks: those load, the rest is prefilled."""
    (prompt,) = random_prompts([14], seed=12)
    prefill, decode = _engine(tiny_model("llama")), _engine(tiny_model("llama"))
    first = _prefill(prefill, "r", prompt, max_tokens=8)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    decode.add_request(
        "r", prompt, params, first_token_id=first.output_token_ids[0],
        imported_kv=pull_kv(prefill, "r", 0, 2),
    )  # fmt: skip
    out = finish_all(decode)["r"]
    assert out.output_token_ids == hf_greedy("llama", prompt, 8)
    assert decode.stats().prompt_tokens_total == 14 - 8  # the two blocks of 4 were not computed


def test_an_import_past_the_decode_sides_prefix_hits_loads_only_its_blocks(
    tiny_model: Callable[[str], Path], hf_greedy: Callable[[str, list[int], int], list[int]]
) -> None:
    (prompt,) = random_prompts([14], seed=13)
    prefill, decode = _engine(tiny_model("llama")), _engine(tiny_model("llama"))
    decode.add_request("warm", prompt[:9], SamplingParams(max_tokens=1, temperature=0))
    finish_all(decode)  # blocks 0 and 1 (tokens 0-7) are now cached here
    computed = decode.stats().prompt_tokens_total
    first = _prefill(prefill, "r", prompt, max_tokens=6)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    decode.add_request(
        "r", prompt, params, first_token_id=first.output_token_ids[0],
        imported_kv=pull_kv(prefill, "r", 2),  # blocks 2 and 3 only: skip_blocks = 2
    )  # fmt: skip
    out = finish_all(decode)["r"]
    assert out.output_token_ids == hf_greedy("llama", prompt, 6)
    assert decode.stats().prompt_tokens_total == computed  # nothing of this prompt computed
    # Without those hits the import has a gap before it: dropped, the prompt recomputed.
    cold = _engine(tiny_model("llama"))
    cold.add_request(
        "r", prompt, params, first_token_id=first.output_token_ids[0],
        imported_kv=pull_kv(prefill, "r", 2),
    )  # fmt: skip
    assert finish_all(cold)["r"].output_token_ids == out.output_token_ids
    assert cold.stats().prompt_tokens_total == 14


def test_a_chunked_prefill_only_request_names_its_blocks_as_each_chunk_completes(
    tiny_model: Callable[[str], Path],
) -> None:
    prefill = _engine(tiny_model("llama"), max_num_batched_tokens=6)
    (prompt,) = random_prompts([15], seed=14)  # 4 blocks of 4, the last one partial
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prefill.add_request("r", prompt, params, prefill_only=True)
    seen: list[tuple[list[int], list[int] | None]] = []
    while prefill.has_unfinished_requests():
        seen += [(o.new_token_ids, o.kv_blocks) for o in prefill.step()]
    lease = prefill.pin_kv("r")
    assert lease is not None
    blocks = lease.block_ids
    # chunks of 6 tokens: after 6 one full block, after 12 three, then the first token
    assert seen == [([], blocks[:1]), ([], blocks[:3]), (seen[-1][0], blocks)]
    assert len(seen[-1][0]) == 1 and len(blocks) == 4


def test_aborting_a_leased_prefill_frees_its_blocks_unless_a_pull_reads_them(
    tiny_model: Callable[[str], Path],
) -> None:
    """The prefill's reader went away after the request finished: the abort its stream sends
    ends the lease at once (a pinned lease is left for its reader to release)."""
    prefill = _engine(tiny_model("llama"))
    (prompt,) = random_prompts([9], seed=9)
    _prefill(prefill, "r", prompt, max_tokens=4)
    lease = prefill.pin_kv("r")
    assert lease is not None
    prefill.abort_request("r")
    assert prefill.stats().num_kv_leases == 1  # being read
    prefill.unpin_kv(lease)
    prefill.abort_request("r")
    stats = prefill.stats()
    assert (stats.num_kv_leases, stats.num_kv_lease_expiries_total) == (0, 0)
    assert prefill.kv.pool.num_free_blocks == prefill.kv.pool.num_usable_blocks
    assert prefill.step() == []  # no output for an abort of a finished request


def test_kv_from_a_prefill_engine_of_another_block_size_is_converted_and_matches(
    tiny_model: Callable[[str], Path],
    hf_greedy: Callable[[str, list[int], int], list[int]],
) -> None:
    """Prefill in blocks of 4, decode in blocks of 8: nothing is recomputed, greedy output
    equals transformers'."""
    (prompt,) = random_prompts([13], seed=11)
    prefill = _engine(tiny_model("llama"))
    decode = LLMEngine(engine_config(tiny_model("llama"), num_kv_blocks=32, block_size=8))
    first = _prefill(prefill, "r", prompt, max_tokens=8)
    chunks = convert_chunks(pull_kv(prefill, "r"), prefill.kv_layout, decode.kv_layout, 13)
    assert [(c.first_block, c.num_blocks) for c in chunks] == [(0, 2)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    decode.add_request(
        "r", prompt, params, first_token_id=first.output_token_ids[0], imported_kv=chunks
    )
    out = finish_all(decode)["r"]
    assert decode.stats().prompt_tokens_total == 0
    assert out.output_token_ids == hf_greedy("llama", prompt, 8)


def test_kv_streamed_in_after_admission_is_written_as_it_comes_and_matches(
    tiny_model: Callable[[str], Path],
    hf_greedy: Callable[[str, list[int], int], list[int]],
) -> None:
    """Admitted with the first chunk, the rest arriving over later steps: nothing is computed
    until the import ends, then nothing is recomputed and greedy output equals transformers'."""
    (prompt,) = random_prompts([13], seed=12)  # blocks 0-3 of 4 tokens
    prefill, decode = _engine(tiny_model("llama")), _engine(tiny_model("llama"))
    first = _prefill(prefill, "r", prompt, max_tokens=8)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    decode.add_request(
        "r",
        prompt,
        params,
        first_token_id=first.output_token_ids[0],
        imported_kv=pull_kv(prefill, "r", 0, 1),
        importing_from=0,
    )
    assert decode.step() == [] and decode.step() == []  # admitted, waiting for its KV
    assert decode.kv.pool.num_free_blocks < decode.kv.pool.num_usable_blocks
    with pytest.raises(ValueError, match="expected 1"):
        decode.import_kv("r", pull_kv(prefill, "r", 2, 3)[0])  # out of order: refused
    for block in (1, 2, 3):
        (chunk,) = pull_kv(prefill, "r", block, block + 1)
        decode.import_kv("r", chunk)
        assert decode.step() == []
    decode.end_import("r")
    out = finish_all(decode)["r"]
    assert decode.stats().prompt_tokens_total == 0
    assert out.output_token_ids == hf_greedy("llama", prompt, 8)


def test_an_import_that_ends_early_recomputes_only_the_rest(
    tiny_model: Callable[[str], Path],
    hf_greedy: Callable[[str, list[int], int], list[int]],
) -> None:
    (prompt,) = random_prompts([13], seed=13)
    prefill, decode = _engine(tiny_model("llama")), _engine(tiny_model("llama"))
    first = _prefill(prefill, "r", prompt, max_tokens=6)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    decode.add_request(
        "r", prompt, params, first_token_id=first.output_token_ids[0], importing_from=0
    )
    decode.import_kv("r", pull_kv(prefill, "r", 0, 2)[0])  # before admission: kept
    decode.end_import("r")  # the stream broke after 8 tokens
    out = finish_all(decode)["r"]
    assert decode.stats().prompt_tokens_total == 13 - 8
    assert out.output_token_ids == hf_greedy("llama", prompt, 6)
    decode.import_kv("r", pull_kv(prefill, "r", 2, 3)[0])  # a late chunk: ignored


def test_a_first_token_given_at_the_end_of_the_import_is_checked_then_decoded_from(
    tiny_model: Callable[[str], Path],
    hf_greedy: Callable[[str, list[int], int], list[int]],
) -> None:
    """Queued before its first token (the KV still on its way), the request takes the first
    token with the end of its import; one out of the vocabulary is refused, nothing changed."""
    (prompt,) = random_prompts([13], seed=14)
    prefill, decode = _engine(tiny_model("llama")), _engine(tiny_model("llama"))
    first = _prefill(prefill, "r", prompt, max_tokens=7).output_token_ids[0]
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    decode.add_request("r", prompt, params, importing_from=0)
    decode.import_kv("r", pull_kv(prefill, "r")[0])
    assert decode.step() == []  # admitted, its KV written, waiting for the end
    vocab = decode.hf_config.vocab_size
    with pytest.raises(ValueError, match=r"first_token_id must be in \[0, "):
        decode.end_import("r", vocab + 5)
    assert decode.step() == []  # still importing
    decode.end_import("r", first)
    out = finish_all(decode)["r"]
    assert out.output_token_ids == hf_greedy("llama", prompt, 7)
    assert decode.stats().prompt_tokens_total == 0
