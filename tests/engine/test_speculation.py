"""Speculative decoding by prompt lookup: the proposer, the acceptance rule, the scheduler's
draft steps, and the engine's output, which must be greedy decoding's (and a seeded sampled
request's own) token for token whether drafts are right, wrong or half right."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.outputs import RequestOutput
from phasefleet.engine.request import Request
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.scheduler import Scheduler, SchedulerOutput
from phasefleet.engine.speculation import NgramProposer, accept
from tests.engine.factories import (
    engine_config,
    finish_all,
    make_requests,
    make_scheduler,
    random_prompts,
)

HFGreedy = Callable[[str, list[int], int], list[int]]
ModelPath = Callable[[str], Path]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def proposer(tokens: list[int], k: int = 3, lo: int = 1, hi: int = 3) -> NgramProposer:
    p = NgramProposer(k, lo, hi)
    p.extend(tokens)
    return p


def test_the_draft_follows_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    # "1 2 3" recurs at the end: after its earlier occurrence came 4 5 6
    assert proposer([1, 2, 3, 4, 5, 6, 9, 1, 2, 3]).propose(8) == [4, 5, 6]
    # two earlier occurrences of "7 8": the latest one's continuation
    assert proposer([7, 8, 1, 7, 8, 2, 3, 7, 8]).propose(8) == [2, 3, 7]
    # the longest n-gram wins over a later, shorter match
    tokens = [5, 6, 7, 1, 1, 9, 7, 2, 5, 6, 7]
    assert proposer(tokens).propose(8) == [1, 1, 9]
    assert proposer(tokens, lo=1, hi=1).propose(8) == [2, 5, 6]  # "7" alone: its latest
    assert proposer([1, 2, 3, 1, 2]).propose(8) == [3, 1, 2]  # runs into the suffix itself
    assert proposer([1, 2, 3, 4, 1, 2]).propose(1) == [3]  # the limit (max_tokens left)
    assert proposer([1, 2, 3, 4], lo=1).propose(8) == []  # nothing recurs
    assert proposer([4, 2, 3, 4], lo=2).propose(8) == []  # "4" recurs, but 1 < min_ngram
    assert proposer([1, 2, 3, 1, 2]).propose(0) == []


def brute_force_draft(tokens: list[int], k: int, lo: int, hi: int, limit: int) -> list[int]:
    """The rule, spelled out: for n from hi down to lo, the latest earlier n-gram equal to the
    last n tokens; the tokens after it."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + min(k, limit)]
    return []


def test_the_proposer_agrees_with_the_rule_spelled_out() -> None:
    rng = np.random.default_rng(3)
    for case in range(400):
        vocab = int(rng.integers(2, 12))  # small vocabularies: many partial matches
        tokens = rng.integers(0, vocab, int(rng.integers(1, 60))).tolist()
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 6))
        limit = int(rng.integers(0, 7))
        got = proposer(tokens, k=4, lo=lo, hi=hi).propose(limit)
        assert got == brute_force_draft(tokens, 4, lo, hi, limit), (case, tokens, lo, hi)


def test_the_context_grows_and_a_distant_occurrence_is_past_the_lookback() -> None:
    from phasefleet.engine import speculation

    p = proposer([1, 2, 3])
    for token in range(100, 200):
        p.extend([token])
    p.extend([1, 2])
    assert p.size == 105 and p.propose(8) == [3, 100, 101]
    old, speculation.LOOKBACK = speculation.LOOKBACK, 50
    try:
        assert p.propose(8) == []  # the occurrence is 103 tokens back
    finally:
        speculation.LOOKBACK = old


def test_accept_keeps_the_agreeing_prefix_then_the_models_token() -> None:
    assert accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all right: k + 1 tokens
    assert accept([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the model's token at the first miss
    assert accept([4, 5, 6], [8, 5, 6, 7]) == [8]  # wrong at once: one token, as without
    assert accept([], [3]) == [3]


def decoding(n: int = 2, length: int = 8, **kw: object) -> tuple[list[Request], Scheduler]:
    """n requests past their prompts (one token out), on a fresh scheduler."""
    sched = make_scheduler(**kw)  # type: ignore[arg-type]
    reqs = make_requests(n, length, max_tokens=10)
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, {r.request_id: 7 for r in reqs})
    return reqs, sched


def test_a_draft_is_scheduled_with_the_last_token_and_verified() -> None:
    (a, b), sched = decoding()
    a.draft_token_ids = [11, 12, 13]
    out = sched.schedule()
    first, second = out.scheduled
    assert (first.request, first.num_tokens, first.draft, first.sample) == (
        a,
        4,
        [11, 12, 13],
        True,
    )
    assert (second.num_tokens, second.draft) == (1, [])
    assert out.num_batched_tokens == 5 and a.draft_token_ids == []
    assert len(first.block_ids) * 4 >= first.start + 4  # blocks for every draft position
    # the model agreed with 11 and 12, then chose 21; b's token: 30
    sched.update_from_output(
        out, {a.request_id: 99, b.request_id: 30}, {a.request_id: [11, 12, 21]}
    )
    assert a.output_token_ids == [7, 11, 12, 21] and a.num_new_tokens == 3
    assert a.num_computed_tokens == 8 + 1 + 2  # the last known token and the two accepted
    assert b.output_token_ids == [7, 30] and b.num_new_tokens == 1
    assert (sched.draft_tokens_total, sched.accepted_tokens_total) == (3, 2)
    assert sched.generation_tokens_total == 2 + 3 + 1


def test_a_draft_is_cut_to_the_budget_and_dropped_without_blocks() -> None:
    (a, b), sched = decoding()
    sched.max_num_batched_tokens = 5
    a.draft_token_ids = [11, 12, 13, 14, 15]
    out = sched.schedule()
    # 5 tokens of budget: b's decode first, then a's last known token and 3 guesses
    assert [(s.request, s.num_tokens) for s in out.scheduled] == [(a, 4), (b, 1)]
    assert out.scheduled[0].draft == [11, 12, 13]
    # a pool with no block to spare: the draft waits, nothing is preempted
    (c, d), tight = decoding(length=7, num_blocks=5, block_size=4)
    c.draft_token_ids = [11, 12, 13, 14]
    out = tight.schedule()
    assert out.preempted == [] and out.scheduled[0].draft == []
    assert [s.num_tokens for s in out.scheduled] == [1, 1]
    assert tight.kv.pool.num_free_blocks == 0
    # one block free, which the later decode may need: the draft leaves it
    (e, f), kept = decoding(length=7, num_blocks=6, block_size=4)
    e.draft_token_ids = [11, 12]
    out = kept.schedule()
    assert out.preempted == [] and out.scheduled[0].draft == []
    assert [s.num_tokens for s in out.scheduled] == [1, 1]


def test_a_stop_inside_the_accepted_draft_ends_the_request_there() -> None:
    sched = make_scheduler(eos_token_ids=(2,))
    (req,) = make_requests(1, 8, max_tokens=10)
    req.params = SamplingParams(max_tokens=10, temperature=0)
    sched.add_request(req)
    sched.update_from_output(sched.schedule(), {req.request_id: 7})
    req.draft_token_ids = [11, 2, 13]
    out = sched.schedule()
    sched.update_from_output(out, {req.request_id: 5}, {req.request_id: [11, 2, 13]})
    assert req.output_token_ids == [7, 11, 2] and req.finish_reason == "stop"
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks  # freed


def test_max_tokens_inside_the_draft_ends_the_request() -> None:
    sched = make_scheduler()
    (req,) = make_requests(1, 8, max_tokens=3)
    sched.add_request(req)
    sched.update_from_output(sched.schedule(), {req.request_id: 7})
    req.draft_token_ids = [11, 12, 13]  # more than max_tokens leaves: the engine would not
    out = sched.schedule()
    sched.update_from_output(out, {req.request_id: 14}, {req.request_id: [11, 12, 13]})
    assert req.output_token_ids == [7, 11, 12] and req.finish_reason == "length"


def oracle_engine(
    folder: Path, reference: dict[str, list[int]], wrong_at: int | None, **kw: object
) -> LLMEngine:
    """An engine whose drafts are the reference continuation (k = 4), with the token at
    draft index `wrong_at` changed (None: all right)."""
    eng = LLMEngine(engine_config(folder, num_speculative_tokens=4, **kw))

    def draft(req: Request, drafts: NgramProposer) -> None:
        done = len(req.output_token_ids)
        guess = reference[req.request_id][done : done + min(4, req.params.max_tokens - done - 1)]
        if wrong_at is not None and wrong_at < len(guess):
            guess[wrong_at] = (guess[wrong_at] + 1) % 500
        req.draft_token_ids = guess

    eng._draft = draft  # type: ignore[method-assign]
    return eng


@pytest.mark.parametrize("wrong_at", [None, 0, 2], ids=["right", "wrong_first", "wrong_third"])
@pytest.mark.parametrize("name", ["llama", "gemma3", "mistral_sw"])
def test_output_is_greedy_decodings_whatever_the_drafts(
    name: str, wrong_at: int | None, tiny_model: ModelPath, hf_greedy: HFGreedy
) -> None:
    """Drafts verified beside other requests' prompt chunks (a small budget, small blocks);
    a sliding window shorter than the prompts for gemma3 and mistral_sw."""
    prompts = random_prompts([5, 30, 17], seed=7)
    reference = {f"r{i}": hf_greedy(name, p, GREEDY.max_tokens) for i, p in enumerate(prompts)}
    eng = oracle_engine(
        tiny_model(name), reference, wrong_at, block_size=4, max_num_batched_tokens=24,
        num_kv_blocks=96,
    )  # fmt: skip
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(**vars(GREEDY)))
    steps, outputs = 0, {}
    while eng.has_unfinished_requests():
        steps += 1
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
    assert outputs == reference
    s = eng.scheduler
    assert s.draft_tokens_total > 0
    if wrong_at is None:  # 24 tokens in steps of up to 5: far fewer steps than tokens
        assert s.accepted_tokens_total == s.draft_tokens_total and steps < 16
    elif wrong_at == 0:
        assert s.accepted_tokens_total == 0
    else:  # the first two of each draft, or a shorter draft whole
        assert 0 < s.accepted_tokens_total < s.draft_tokens_total
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


def test_prompt_lookup_drafts_in_the_engine_give_the_tokens_of_no_drafts(
    tiny_model: ModelPath, hf_greedy: HFGreedy
) -> None:
    """The real proposer (n-grams of 1 token up: a random model repeats few) on repeated
    patterns: greedy requests get transformers' tokens, a seeded sampled one its own tokens of
    a run without drafts, and so does one with a penalty."""
    prompts = [[5, 9, 13, 21] * 8, [7, 8, 9] * 10 + [3], random_prompts([20], seed=2)[0]]
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    plain = LLMEngine(engine_config(tiny_model("llama"), block_size=4))
    (sampled_alone,) = plain.generate([prompts[0]], seeded)
    eng = LLMEngine(
        engine_config(
            tiny_model("llama"), num_speculative_tokens=3, prompt_lookup_min=1, block_size=4
        )
    )
    for i, p in enumerate(prompts):
        eng.add_request(f"g{i}", p, SamplingParams(**vars(GREEDY)))
    eng.add_request("sampled", prompts[0], SamplingParams(**vars(seeded)))
    penalized = SamplingParams(**{**vars(GREEDY), "frequency_penalty": 0.5})
    eng.add_request("penalized", prompts[0], penalized)
    drafted: set[str] = set()
    finals: dict[str, RequestOutput] = {}
    while eng.has_unfinished_requests():
        drafted |= {r.request_id for r in eng.scheduler.running if r.draft_token_ids}
        finals |= {out.request_id: out for out in eng.step() if out.finished}
    assert {"g0", "penalized"} <= drafted
    assert (
        finals["penalized"].output_token_ids
        == plain.generate([prompts[0]], penalized)[0].output_token_ids
    )
    assert finals["sampled"].output_token_ids == sampled_alone.output_token_ids
    for i, prompt in enumerate(prompts):
        assert finals[f"g{i}"].output_token_ids == hf_greedy("llama", prompt, GREEDY.max_tokens)
    assert eng.scheduler.draft_tokens_total > 0


@pytest.mark.parametrize("wrong_at", [None, 1], ids=["right", "wrong_second"])
def test_a_seeded_sampled_request_draws_the_same_tokens_with_drafts(
    wrong_at: int | None, tiny_model: ModelPath
) -> None:
    """Each draft position draws with its own position's seeded noise, as one step at a time
    would: the tokens are those of the run without drafts (top-k, top-p and temperature on)."""
    params = SamplingParams(max_tokens=24, temperature=1.5, top_p=0.95, top_k=50, seed=11,
                            ignore_eos=True)  # fmt: skip
    prompts = random_prompts([5, 30, 17], seed=8)
    plain = LLMEngine(engine_config(tiny_model("llama"), block_size=4))
    reference = {
        f"r{i}": out.output_token_ids for i, out in enumerate(plain.generate(prompts, params))
    }
    eng = oracle_engine(tiny_model("llama"), reference, wrong_at, block_size=4,
                        max_num_batched_tokens=24, num_kv_blocks=96)  # fmt: skip
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(**vars(params)))
    outputs = {k: v.output_token_ids for k, v in finish_all(eng).items()}
    assert outputs == reference
    s = eng.scheduler
    assert s.draft_tokens_total > 0
    if wrong_at is None:
        assert s.accepted_tokens_total == s.draft_tokens_total
    else:  # the first of each draft, or a draft of one whole
        assert 0 < s.accepted_tokens_total < s.draft_tokens_total


def test_bias_min_p_stops_logprobs_and_penalties_give_the_outputs_of_no_drafts(
    tiny_model: ModelPath,
) -> None:
    """Right drafts of 4 (steps of 5 tokens) for a greedy request with a logit bias, a seeded
    one with min-p, one with a stop string its output completes inside a step, one with
    logprobs, and greedy and seeded ones with penalties on repeats (each draft token counted
    at the positions after it): each ends as without drafts (tokens, text, finish reason,
    each token's logprobs); the tokens after the stop are taken back (the generated-token
    count is the outputs' own)."""
    folder = tiny_model("llama")
    (prompt,) = random_prompts([12], seed=5)
    plain = LLMEngine(engine_config(folder, block_size=4))
    (free,) = plain.generate([prompt], GREEDY)
    end = next(i for i in range(8, 20) if i % 5 != 0)  # the stop's last token: inside a step
    stop = plain.tokenizer.decode(free.output_token_ids[end - 1 : end + 1])
    params = {
        "bias": SamplingParams(**{**vars(GREEDY), "logit_bias": {free.output_token_ids[3]: 4.0}}),
        "min_p": SamplingParams(max_tokens=24, temperature=1.0, min_p=0.3, seed=2, ignore_eos=True),
        "stop": SamplingParams(**{**vars(GREEDY), "stop": [stop]}),
        "logprobs": SamplingParams(**{**vars(GREEDY), "logprobs": 2}),
        "penalties": SamplingParams(**{**vars(GREEDY), "repetition_penalty": 1.3,
                                      "frequency_penalty": 0.4, "presence_penalty": 0.2}),
        "sampled_penalty": SamplingParams(max_tokens=24, temperature=0.9, seed=4,
                                          frequency_penalty=0.8, ignore_eos=True),
    }  # fmt: skip
    alone = {k: plain.generate([prompt], p)[0] for k, p in params.items()}
    plain.add_request("plain-logprobs", prompt, params["logprobs"])
    expected_logprobs = [e for out in steps_of(plain) for e in out.logprobs or []]
    stopped = alone["stop"]  # steps with drafts append tokens 0, 1-5, 6-10, ...: not its last
    assert stopped.finish_reason == "stop" and (len(stopped.output_token_ids) - 1) % 5 != 0
    reference = {k: out.output_token_ids for k, out in alone.items()}
    reference["stop"] = free.output_token_ids  # the draft runs on past the stop
    eng = oracle_engine(folder, reference, None, block_size=4)
    for k, p in params.items():
        eng.add_request(k, prompt, p)
    drafted: set[str] = set()
    outputs: list[RequestOutput] = []
    while eng.has_unfinished_requests():
        drafted |= {r.request_id for r in eng.scheduler.running if r.draft_token_ids}
        outputs += eng.step()
    finals = {out.request_id: out for out in outputs if out.finished}
    assert drafted == set(params)
    got_logprobs = [
        e for out in outputs if out.request_id == "logprobs" for e in out.logprobs or []
    ]
    assert [e.token_id for e in got_logprobs] == finals["logprobs"].output_token_ids
    assert len(got_logprobs) == len(expected_logprobs) == GREEDY.max_tokens
    for entry, want in zip(got_logprobs, expected_logprobs, strict=True):
        assert entry.token_id == want.token_id
        assert [t for t, _ in entry.top] == [t for t, _ in want.top]
        assert entry.logprob == pytest.approx(want.logprob, abs=1e-4)
    for k in ("bias", "penalties"):  # the adjustment counts
        assert free.output_token_ids != alone[k].output_token_ids, k
    for k, out in alone.items():
        got = finals[k]
        assert (got.output_token_ids, got.text, got.finish_reason) == (
            out.output_token_ids, out.text, out.finish_reason
        ), k  # fmt: skip
    s = eng.scheduler
    assert s.accepted_tokens_total == s.draft_tokens_total > 0
    assert s.generation_tokens_total == sum(len(o.output_token_ids) for o in alone.values())


def steps_of(engine: LLMEngine) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_config_refuses_bad_speculation_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[0, 16\]"):
        EngineConfig(model="m", num_speculative_tokens=17).validate()
    with pytest.raises(ValueError, match="prompt_lookup_min and prompt_lookup_max"):
        EngineConfig(model="m", prompt_lookup_min=3, prompt_lookup_max=2).validate()


def test_a_drafted_step_plan_feeds_the_draft_and_verifies_each_position() -> None:
    from phasefleet.engine.block_table import BlockTables
    from phasefleet.engine.step_plan import plan_step

    (a, b), sched = decoding()
    a.draft_token_ids = [11, 12]
    out: SchedulerOutput = sched.schedule()
    tables = BlockTables(4, 8, "cpu", separate=False)  # type: ignore[arg-type]
    plan = plan_step(out.scheduled, tables, 4, group=True)
    # b decodes (1 token), then a's chunk: its last known token 7, then the draft
    assert plan.input_ids.tolist() == [7, 7, 11, 12]
    assert plan.positions.tolist() == [8, 8, 9, 10]
    # a row per sampled position: b's, then a's last known token's and each draft token's
    assert plan.sample_index.tolist() == [0, 1, 2, 3]
    assert [s.request for s in plan.sampled] == [b, a]
    assert np.array_equal(plan.lora_slots, np.full(4, -1))
