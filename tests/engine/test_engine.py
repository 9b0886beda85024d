"""LLMEngine behaviour: stops, limits, abort, errors, seeds, streaming text, stats."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phasefleet.engine import llm_engine
from phasefleet.engine.config import EngineConfig
from phasefleet.engine.detokenizer import IncrementalDetokenizer
from phasefleet.engine.llm_engine import LLMEngine, RequestOutput
from phasefleet.engine.model_runner import resolve_dtype
from phasefleet.engine.sampling_params import SamplingParams
from tests.engine.factories import engine_config, random_prompts

ModelPath = Callable[[str], Path]


@pytest.fixture
def eng(tiny_model: ModelPath) -> LLMEngine:
    return LLMEngine(engine_config(tiny_model("llama"), num_kv_blocks=64))


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)  # type: ignore[arg-type]


def run_one(eng: LLMEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    eng.add_request("x", prompt, params)
    outs: list[RequestOutput] = []
    while eng.has_unfinished_requests():
        outs.extend(o for o in eng.step() if o.request_id == "x")
    return outs


def stop_string_case(eng: LLMEngine) -> tuple[list[int], RequestOutput, str]:
    """A prompt, its 30-token greedy output, and a 3-character stop string taken from inside
    that output (past the first 8 characters, clear of partial UTF-8)."""
    prompt = random_prompts([12], seed=9)[0]
    (full,) = eng.generate([prompt], greedy(30, ignore_eos=True))
    text = full.text
    start = next(i for i in range(8, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    return prompt, full, text[start : start + 3]


def test_outputs_carry_their_step_tokens_and_the_last_all(eng: LLMEngine) -> None:
    outs = run_one(eng, random_prompts([10])[0], greedy(6, ignore_eos=True))
    assert [len(o.new_token_ids) for o in outs] == [1] * 6
    assert all(o.output_token_ids == [] for o in outs[:-1])
    assert outs[-1].finished
    assert outs[-1].output_token_ids == [t for o in outs for t in o.new_token_ids]


def test_engine_identity(eng: LLMEngine, tiny_model: ModelPath) -> None:
    assert eng.model_name == tiny_model("llama").name
    assert eng.max_model_len == 2048
    assert eng.tokenizer.chat_template
    ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == eng.tokenizer.bos_token_id


def test_max_tokens_finishes_with_length(eng: LLMEngine) -> None:
    (out,) = eng.generate(random_prompts([10]), greedy(7, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.output_token_ids) == 7
    assert out.num_prompt_tokens == 10
    assert out.first_scheduled_time is not None


def test_stop_token_ids_finish_and_are_kept(eng: LLMEngine) -> None:
    prompt = random_prompts([12], seed=7)[0]
    (full,) = eng.generate([prompt], greedy(20, ignore_eos=True))
    stop = full.output_token_ids[5]
    (out,) = eng.generate([prompt], greedy(20, ignore_eos=True, stop_token_ids=[stop]))
    first = full.output_token_ids.index(stop)
    assert out.output_token_ids == full.output_token_ids[: first + 1]
    assert out.finish_reason == "stop"


def test_eos_stops_unless_ignored(eng: LLMEngine) -> None:
    prompt = random_prompts([12], seed=8)[0]
    (full,) = eng.generate([prompt], greedy(20, ignore_eos=True))
    eos = full.output_token_ids[3]
    eng.scheduler.eos_token_ids = frozenset({eos})  # make a token the model emits the eos
    (stopped,) = eng.generate([prompt], greedy(20))
    assert stopped.finish_reason == "stop"
    assert stopped.output_token_ids == full.output_token_ids[: full.output_token_ids.index(eos) + 1]
    (ignored,) = eng.generate([prompt], greedy(20, ignore_eos=True))
    assert ignored.output_token_ids == full.output_token_ids


def test_stop_string_cuts_the_text_and_text_only_grows(eng: LLMEngine) -> None:
    prompt, full, stop = stop_string_case(eng)
    outs = run_one(eng, prompt, greedy(30, ignore_eos=True, stop=[stop]))
    final = outs[-1]
    assert final.finished and final.finish_reason == "stop"
    assert final.text == full.text[: full.text.index(stop)]
    for before, after in zip(outs, outs[1:], strict=False):
        assert after.text.startswith(before.text)
        assert stop not in after.text
    assert len(final.output_token_ids) < 30


def test_abort_frees_blocks_and_reports_abort(eng: LLMEngine) -> None:
    total = eng.stats().num_total_blocks
    prompts = random_prompts([40, 30, 20], seed=10)
    for i, p in enumerate(prompts):
        eng.add_request(f"a{i}", p, greedy(50, ignore_eos=True))
    eng.step()
    eng.step()
    stats = eng.stats()
    assert stats.num_running == 3 and stats.num_free_blocks < total
    assert 0 < stats.kv_cache_usage <= 1
    eng.abort_request("a1")
    eng.abort_request("nope")  # unknown: no-op
    outs = eng.step()
    aborted = [o for o in outs if o.request_id == "a1"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    eng.abort_request("a0")
    eng.abort_request("a2")
    eng.abort_request("a2")  # twice: no-op
    eng.step()
    assert not eng.has_unfinished_requests()
    stats = eng.stats()
    assert stats.num_free_blocks == total and stats.kv_cache_usage == 0.0


def test_abort_of_a_waiting_request(eng: LLMEngine) -> None:
    eng.add_request("w", [5, 6, 7], greedy(4))
    eng.abort_request("w")
    (out,) = eng.step()
    assert out.finish_reason == "abort" and out.output_token_ids == []
    assert eng.stats().num_waiting == 0


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], greedy(4), "prompt must contain at least one token"),
        ([1] * 2040, greedy(10), "must fit max_model_len"),
        ([1] * 10, greedy(4000), "must fit max_model_len"),
        ([1] * 1000, greedy(100), "more than the whole pool"),
        ([100000], greedy(4), "prompt token ids must be in"),
        ([1, 2], SamplingParams(top_p=0), "top_p must be"),
    ],
)
def test_add_request_rejects(
    eng: LLMEngine, prompt: list[int], params: SamplingParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        eng.add_request("bad", prompt, params)
    assert not eng.has_unfinished_requests()


def test_duplicate_request_id_is_rejected(eng: LLMEngine) -> None:
    eng.add_request("dup", [1, 2, 3], greedy(2))
    with pytest.raises(ValueError, match="already"):
        eng.add_request("dup", [1, 2, 3], greedy(2))


def test_seeded_sampling_is_reproducible_in_any_batch(eng: LLMEngine) -> None:
    prompt = random_prompts([15], seed=11)[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    (alone,) = eng.generate([prompt], params)
    others = random_prompts([7, 30], seed=12)
    batch = eng.generate(
        [others[0], prompt, others[1]],
        [SamplingParams(max_tokens=9, ignore_eos=True), params, greedy(20, ignore_eos=True)],
    )
    assert batch[1].output_token_ids == alone.output_token_ids
    (other_seed,) = eng.generate([prompt], SamplingParams(max_tokens=16, seed=99, ignore_eos=True))
    assert other_seed.output_token_ids != alone.output_token_ids


def test_step_outputs_carry_new_tokens_and_growing_totals(eng: LLMEngine) -> None:
    outs = run_one(eng, random_prompts([9], seed=13)[0], greedy(5, ignore_eos=True))
    assert [len(o.new_token_ids) for o in outs] == [1] * 5
    assert outs[-1].output_token_ids == [o.new_token_ids[0] for o in outs]
    stats = eng.stats()
    assert stats.prompt_tokens_total == 9 and stats.generation_tokens_total == 5


def test_busy_seconds_grow_while_a_request_runs_and_not_while_idle(eng: LLMEngine) -> None:
    assert eng.stats().busy_seconds_total == 0.0
    started = time.perf_counter()
    run_one(eng, random_prompts([12], seed=15)[0], greedy(8, ignore_eos=True))
    busy = eng.stats().busy_seconds_total
    assert 0 < busy <= time.perf_counter() - started
    for _ in range(3):  # idle: steps with nothing to run, and time passing between them
        assert eng.step() == []
        time.sleep(0.02)
    assert eng.stats().busy_seconds_total == busy


def test_waiting_and_pending_prefill_stats(tiny_model: ModelPath) -> None:
    config = engine_config(tiny_model("llama"), max_num_batched_tokens=16, max_num_seqs=1)
    eng = LLMEngine(config)
    for i, p in enumerate(random_prompts([40, 5], seed=14)):
        eng.add_request(f"s{i}", p, greedy(2))
    eng.step()
    stats = eng.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.prefill_tokens_pending == 24
    assert stats.prefill_tokens_waiting == 5  # the queued prompt: the autoscaler's backlog too


def test_a_prompt_past_the_ttft_target_is_served_after_a_fresh_one(tiny_model: ModelPath) -> None:
    """late_after_s (the worker's --late-after-ms): a prompt that waited 5 s, past a 1 s
    target, gets its first token after one that just arrived; it is still answered in full."""
    config = engine_config(tiny_model("llama"), max_num_seqs=1, late_after_s=1.0)
    eng = LLMEngine(config)
    old, fresh = random_prompts([8, 8], seed=15)
    eng.add_request("old", old, greedy(2), arrival_time=time.monotonic() - 5.0)
    eng.add_request("fresh", fresh, greedy(2))
    first: list[str] = []
    done: dict[str, RequestOutput] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id not in first:
                first.append(out.request_id)
            if out.finished:
                done[out.request_id] = out
    assert first == ["fresh", "old"]
    assert len(done["old"].output_token_ids) == 2 and eng.stats().late_prompts_total == 1
    fcfs = LLMEngine(engine_config(tiny_model("llama"), max_num_seqs=1))
    fcfs.add_request("old", old, greedy(2), arrival_time=time.monotonic() - 5.0)
    fcfs.add_request("fresh", fresh, greedy(2))
    assert fcfs.step()[0].request_id == "old"
    # no target in the config, one with each request (what the router's header gives)
    sent = LLMEngine(engine_config(tiny_model("llama"), max_num_seqs=1))
    sent.add_request("old", old, greedy(2), arrival_time=time.monotonic() - 5.0, late_after_s=1)
    sent.add_request("fresh", fresh, greedy(2), late_after_s=1.0)
    assert sent.step()[0].request_id == "fresh"
    with pytest.raises(ValueError, match="late_after_s must be > 0"):
        sent.add_request("bad", fresh, greedy(2), late_after_s=0.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs(tiny_model: ModelPath, dtype: str) -> None:
    config = EngineConfig(model=str(tiny_model("qwen2")), device="cpu", dtype=dtype)
    eng = LLMEngine(config)
    assert eng.runner.decode_as_matmuls  # SDPA is slow for 16-bit decodes on the CPU
    outs = eng.generate(random_prompts([8, 20]), greedy(6, ignore_eos=True))
    assert [len(o.output_token_ids) for o in outs] == [6, 6]


def test_bad_model_folder_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_stop_string_on_the_last_allowed_token_reports_stop(eng: LLMEngine) -> None:
    prompt, full, stop = stop_string_case(eng)
    tokens = full.output_token_ids
    k = next(k for k in range(1, 31) if stop in eng.tokenizer.decode(tokens[:k]))
    (out,) = eng.generate([prompt], greedy(k, ignore_eos=True, stop=[stop]))
    assert out.output_token_ids == tokens[:k]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]


def test_dtype_auto_is_float32_on_cpu_and_16_bit_on_cuda(
    tiny_model: ModelPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", torch.bfloat16, cpu) == "float32"
    assert resolve_dtype("auto", torch.bfloat16, cuda) == "bfloat16"
    assert resolve_dtype("auto", "float16", cuda) == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_dtype("auto", torch.float32, cuda) == "bfloat16"
    assert resolve_dtype("auto", None, cuda) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_dtype("auto", torch.float32, cuda) == "float16"
    assert resolve_dtype("bfloat16", torch.float32, cpu) == "bfloat16"  # explicit wins
    eng = LLMEngine(EngineConfig(model=str(tiny_model("llama")), device="cpu"))
    assert eng.dtype == "float32"
    assert eng.runner.dtype == torch.float32


class BrokenDetokenizer(IncrementalDetokenizer):
    """Raises from the detokenizer (update) or from the stop-string search."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str], where: str) -> None:
        super().__init__(decode, stop)
        self.where = where

    def update(self, new_token_ids: list[int]) -> None:
        if self.where == "detokenizer":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        super().update(new_token_ids)

    def _find_stop(self, old_len: int) -> None:
        raise RuntimeError("injected stop-string fault")


def inject(eng: LLMEngine, request_id: str, fault: str) -> None:
    """Break one running request the way a real fault would."""
    if fault == "nan":
        eng._live[request_id].row.params.temperature = float("nan")  # past validation
    else:
        eng._live[request_id].detok = BrokenDetokenizer(eng._decoders[True], ["zzz-never"], fault)


def run_batch(eng: LLMEngine, fault: str | None) -> dict[str, RequestOutput]:
    """Four neighbours (greedy, seeded, a stop string) and a fifth request that a fault hits
    after three steps; each request's final output."""
    prompts = random_prompts([9, 17, 12, 30, 14], seed=21)
    params = [
        greedy(12, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.9, top_p=0.8, seed=5, ignore_eos=True),
        greedy(10, ignore_eos=True, stop=["zzz-never"]),
        SamplingParams(max_tokens=11, temperature=1.3, top_k=40, seed=6, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
    ]
    ids = ["n0", "n1", "n2", "n3", "victim"]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        eng.add_request(rid, prompt, p)
    final: dict[str, RequestOutput] = {}
    steps = 0
    while eng.has_unfinished_requests():
        if steps == 3 and fault is not None:
            inject(eng, "victim", fault)
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
    return final


@pytest.mark.parametrize("fault", ["nan", "detokenizer", "stop_string"])
def test_a_fault_in_one_request_leaves_its_batch_untouched(eng: LLMEngine, fault: str) -> None:
    clean = run_batch(eng, None)
    total = eng.stats().num_total_blocks
    faulty = run_batch(eng, fault)
    victim = faulty.pop("victim")
    assert victim.finish_reason == "error" and victim.error
    if fault != "nan":  # the injected fault itself, not another one on its way
        assert "injected" in victim.error
    assert len(victim.output_token_ids) < len(clean["victim"].output_token_ids)
    assert faulty.keys() == {"n0", "n1", "n2", "n3"}
    for rid, out in faulty.items():
        assert out.output_token_ids == clean[rid].output_token_ids, rid
        assert (out.text, out.finish_reason) == (clean[rid].text, clean[rid].finish_reason)
    assert eng.stats().num_free_blocks == total  # the victim's blocks are back
    again = run_batch(eng, None)  # and the engine serves on as before
    assert {r: o.output_token_ids for r, o in again.items()} == {
        r: o.output_token_ids for r, o in clean.items()
    }


def test_a_seed_torch_cannot_take_is_refused_and_nothing_is_queued(eng: LLMEngine) -> None:
    # The seed of issue 8: it used to be queued before its generator failed, and every later
    # step then raised KeyError.
    with pytest.raises(ValueError, match=r"^seed must be"):
        eng.add_request("big", [1, 2, 3], SamplingParams(max_tokens=4, seed=2**64))
    assert not eng.has_unfinished_requests()
    (out,) = eng.generate([[1, 2, 3]], greedy(4, ignore_eos=True))
    assert out.finish_reason == "length"


def test_a_request_whose_setup_fails_is_not_queued(
    eng: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("no detokenizer today")

    monkeypatch.setattr(llm_engine, "IncrementalDetokenizer", broken)
    with pytest.raises(RuntimeError, match="no detokenizer"):
        eng.add_request("s", [1, 2, 3], SamplingParams(max_tokens=4, seed=1))
    monkeypatch.undo()
    assert not eng.has_unfinished_requests()
    assert eng.step() == []
    eng.add_request("s", [1, 2, 3], greedy(2))  # the id is free again
    assert [o.finish_reason for o in eng.step() + eng.step()][-1] == "length"


def test_generation_config_names_more_end_tokens(
    eng: LLMEngine, tiny_model: ModelPath, tmp_path: Path
) -> None:
    """A chat model's end-of-turn token lives in generation_config.json's eos_token_id: the
    engine stops there too; a broken file is refused naming it."""
    import json
    import shutil

    prompt = random_prompts([12], seed=8)[0]
    (full,) = eng.generate([prompt], greedy(20, ignore_eos=True))
    end = full.output_token_ids[4]
    folder = Path(shutil.copytree(tiny_model("llama"), tmp_path / "chat"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, 1]}))
    (stopped,) = LLMEngine(engine_config(folder)).generate([prompt], greedy(20))
    assert stopped.finish_reason == "stop"
    assert stopped.output_token_ids == full.output_token_ids[: full.output_token_ids.index(end) + 1]
    (folder / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="generation_config.json is not a JSON object"):
        LLMEngine(engine_config(folder))


def test_requests_are_served_by_priority_under_the_priority_policy(
    tiny_model: Callable[[str], Path],
) -> None:
    """One sequence at a time: the urgent request, queued last, is served right after the one
    already running; without the policy a priority is refused."""
    eng = LLMEngine(
        engine_config(tiny_model("llama"), max_num_seqs=1, scheduling_policy="priority")
    )
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompts = random_prompts([5, 5, 5, 5], seed=40)
    eng.add_request("first", prompts[0], params)
    eng.step()  # first is running
    for name, prompt, priority in zip(
        ["batch-a", "batch-b", "urgent"], prompts[1:], [2, 2, -1], strict=True
    ):
        eng.add_request(name, prompt, params, priority=priority)
    eng.add_embedding_request("embed", prompts[0], priority=1)
    finished = []
    while eng.has_unfinished_requests():
        finished += [o.request_id for o in eng.step() if o.finished]
    assert finished == ["first", "urgent", "embed", "batch-a", "batch-b"]
    plain = LLMEngine(engine_config(tiny_model("llama")))
    with pytest.raises(ValueError, match="priority 1 needs the priority scheduling policy"):
        plain.add_request("r", prompts[0], params, priority=1)
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        EngineConfig(model="m", scheduling_policy="lifo").validate()
