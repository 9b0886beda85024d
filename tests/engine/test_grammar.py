"""Structured output through the whole engine: JSON schemas, regexes and choices. The reference is
transformers' greedy decoding on the same weights with the grammar's mask applied as a logits
processor (llguidance driven directly, one token at a time); every answer is also checked with
the grammar's own tools (jsonschema for a schema, `re` for a regex)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from phasefleet.engine.grammar import (
    GrammarCompiler,
    fill_masks,
    grammar_text,
    mask_words,
)
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.request import Request
from phasefleet.engine.sampling_params import Grammar, SamplingParams
from phasefleet.engine.speculation import NgramProposer
from phasefleet.engine.tokenizer import eos_token_ids
from tests.engine.factories import engine_config, finish_all, random_prompts

MODEL = "llama"
MAX_TOKENS = 48
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["answer", "count", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-c]{2,4}"
CHOICES = ["red", "green", "blue and more"]
GBNF = 'root ::= "sum(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'  # GBNF, as vLLM takes
SUM = r"sum\([1-9][0-9]?(,[1-9][0-9]?)*\)"  # the same language, to check answers by
GRAMMARS = {
    "schema": Grammar("json", json.dumps(SCHEMA)),
    "regex": Grammar("regex", REGEX),
    "choice": Grammar("choice", json.dumps(CHOICES)),
    "grammar": Grammar("grammar", GBNF),
}


def obeys(name: str, text: str) -> bool:
    if name == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if name == "regex":
        return re.fullmatch(REGEX, text) is not None
    if name == "grammar":
        return re.fullmatch(SUM, text) is not None
    return text in CHOICES


def allowed(matcher: Any, vocab: int) -> torch.Tensor:
    """[V] bool: the tokens an llguidance matcher allows next."""
    words = np.zeros(mask_words(vocab), dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    bits = (words[:, None] >> np.arange(32)) & 1
    return torch.from_numpy(bits.reshape(-1)[:vocab].astype(bool))


Reference = Callable[[list[int], Grammar], list[int]]


@pytest.fixture(scope="module")
def reference(tiny_model: Callable[[str], Path]) -> Reference:
    """transformers' greedy answer with every token the grammar does not allow at -inf (no
    cache, one request), up to the grammar's end or an end-of-sequence token."""
    folder = tiny_model(MODEL)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eng = LLMEngine(engine_config(folder, num_kv_blocks=8))  # for its tokenizer and eos ids
    vocab = int(eng.hf_config.vocab_size)
    eos = eos_token_ids(folder, eng.hf_config, eng.tokenizer)
    ll_tokenizer = llguidance.hf.from_tokenizer(eng.tokenizer, n_vocab=vocab, eos_token=sorted(eos))

    def run(prompt: list[int], grammar: Grammar) -> list[int]:
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar_text(grammar))
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                token = int(logits.masked_fill(~allowed(matcher, vocab), float("-inf")).argmax())
                ids.append(token)
                if token in eos or (matcher.consume_token(token) and matcher.is_stopped()):
                    break
        return ids[len(prompt) :]

    return run


def _engine(folder: Path, **kw: Any) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    return LLMEngine(engine_config(folder, block_size=4, **kw))


def test_greedy_answers_under_each_grammar_equal_transformers(
    tiny_model: Callable[[str], Path],
    reference: Reference,
    hf_greedy: Callable[[str, list[int], int], list[int]],
) -> None:
    """Each grammar and a plain row in one batch, prompts prefilled in chunks: each answer is
    transformers' under the same mask, obeys its grammar and ends with 'stop' when the grammar
    is complete; the plain row is plain greedy."""
    eng = _engine(tiny_model(MODEL), max_num_batched_tokens=24)
    prompts = random_prompts([19, 11, 23, 17, 9], seed=7)
    grammars = list(GRAMMARS.items())
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, grammar=g) for _, g in grammars]
    params.append(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    outputs = eng.generate(prompts, params)
    for (name, grammar), prompt, out in zip(grammars, prompts, outputs, strict=False):
        assert out.output_token_ids == reference(prompt, grammar), name
        assert out.finish_reason == "stop" and obeys(name, out.text), (name, out.text)
    assert outputs[-1].output_token_ids == hf_greedy(MODEL, prompts[-1], 12)
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


def test_sampled_answers_obey_and_do_not_depend_on_the_batch_or_preemption(
    tiny_model: Callable[[str], Path],
) -> None:
    """Seeded rows at temperature 1: every answer obeys its grammar, and each is the same alone
    as in a crowded batch whose requests are preempted and recomputed mid-answer."""
    folder = tiny_model(MODEL)
    names = list(GRAMMARS) * 3
    prompts = random_prompts([13 + i for i in range(len(names))], seed=8)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, grammar=GRAMMARS[name])
        for i, name in enumerate(names)
    ]
    crowded = _engine(folder, num_kv_blocks=20, max_num_batched_tokens=64)
    together = crowded.generate(prompts, params)
    assert crowded.stats().num_preemptions_total > 0
    alone = _engine(folder)
    for name, prompt, p, out in zip(names, prompts, params, together, strict=True):
        assert obeys(name, out.text), (name, out.text)
        assert alone.generate([prompt], p)[0].output_token_ids == out.output_token_ids
    assert len({out.text for out in together}) > len(GRAMMARS)  # the seeds were used


def test_a_grammar_complete_at_max_tokens_ends_with_stop(tiny_model: Callable[[str], Path]) -> None:
    eng = _engine(tiny_model(MODEL))
    (prompt,) = random_prompts([10], seed=9)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, grammar=GRAMMARS["choice"])
    n = len(eng.generate([prompt], params)[0].output_token_ids)
    exact = SamplingParams(max_tokens=n, temperature=0, grammar=GRAMMARS["choice"])
    assert eng.generate([prompt], exact)[0].finish_reason == "stop"
    if n > 1:
        short = SamplingParams(max_tokens=n - 1, temperature=0, grammar=GRAMMARS["choice"])
        assert eng.generate([prompt], short)[0].finish_reason == "length"


def test_the_first_token_of_a_hand_off_follows_the_grammar(
    tiny_model: Callable[[str], Path], reference: Reference
) -> None:
    """The prefill side samples the first token under the grammar; the decode side takes it into
    its own matcher, and refuses one the grammar does not allow (nothing queued)."""
    folder = tiny_model(MODEL)
    (prompt,) = random_prompts([12], seed=10)
    grammar = GRAMMARS["schema"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, grammar=grammar)
    prefill, decode = _engine(folder), _engine(folder)
    prefill.add_request("r", prompt, params, prefill_only=True)
    first = finish_all(prefill)["r"]
    assert first.finish_reason == "handoff" and prefill.release_kv("r")
    decode.add_request("r", prompt, params, first_token_id=first.output_token_ids[0])
    out = finish_all(decode)["r"]
    assert out.output_token_ids == reference(prompt, grammar)
    assert json.loads(out.text) == json.loads(prefill.generate([prompt], params)[0].text)
    not_json = prefill.tokenizer.encode("x", add_special_tokens=False)[0]
    with pytest.raises(ValueError, match="does not follow the response's grammar"):
        decode.add_request("bad", prompt, params, first_token_id=not_json)
    assert not decode.has_unfinished_requests()


def test_a_prefill_whose_grammar_ends_at_the_first_token_stops_and_leases_nothing(
    tiny_model: Callable[[str], Path],
) -> None:
    eng = _engine(tiny_model(MODEL))
    (prompt,) = random_prompts([8], seed=11)
    one_byte = SamplingParams(max_tokens=8, temperature=0, grammar=Grammar("choice", '["a"]'))
    eng.add_request("r", prompt, one_byte, prefill_only=True)
    out = finish_all(eng)["r"]
    assert (out.finish_reason, out.text) == ("stop", "a")
    assert eng.stats().num_kv_leases == 0
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        (Grammar("json", "{not json"), "the JSON schema is not JSON"),
        (Grammar("json", "[1, 2]"), "must be an object or a boolean"),
        (Grammar("json", '{"type": "bogus"}'), "bogus"),
        (Grammar("regex", "[0-9"), "unclosed character class"),
        (Grammar("choice", "[]"), "non-empty list of non-empty strings"),
        (Grammar("choice", '["a", ""]'), "non-empty list of non-empty strings"),
        (Grammar("grammar", "root ::= ("), "the grammar does not parse"),
        (Grammar("grammar", 'other ::= "a"'), "No 'root' rule found"),
        (Grammar("json", "[" * 5000 + "]" * 5000), "the JSON schema is not JSON"),
        (Grammar("grammar", "start: undefined_rule"), "undefined_rule"),
    ],
)
def test_a_grammar_that_cannot_work_is_refused_before_it_is_queued(
    tiny_model: Callable[[str], Path], grammar: Grammar, message: str
) -> None:
    eng = _engine(tiny_model(MODEL), num_kv_blocks=16)
    with pytest.raises(ValueError, match=re.escape(message)):
        eng.add_request("r", [5, 6, 7], SamplingParams(grammar=grammar))
    assert not eng.has_unfinished_requests()


def test_the_compiler_compiles_once_and_hands_out_independent_matchers(
    tiny_model: Callable[[str], Path],
) -> None:
    eng = _engine(tiny_model(MODEL), num_kv_blocks=16)
    compiler = GrammarCompiler(eng.tokenizer, int(eng.hf_config.vocab_size), {1})
    grammar = GRAMMARS["choice"]
    first, second = compiler.matcher(grammar), compiler.matcher(grammar)
    assert len(compiler._cache) == 1
    words = np.zeros(mask_words(compiler.vocab_size), dtype=np.int32)
    first.fill(words)
    assert first.error is None
    allowed = np.flatnonzero(((words[:, None] >> np.arange(32)) & 1).reshape(-1))
    starts = {eng.tokenizer.decode([int(t)]) for t in allowed}
    assert starts and all(any(c.startswith(s) for c in CHOICES) for s in starts)
    for token in eng.tokenizer.encode("red", add_special_tokens=False):
        first.accept(token)
    assert first.done and not second.done
    with pytest.raises(ValueError, match="does not follow"):
        first.accept(eng.tokenizer.encode("x", add_special_tokens=False)[0])


def test_masks_filled_in_parallel_equal_those_filled_one_by_one(
    tiny_model: Callable[[str], Path],
) -> None:
    eng = _engine(tiny_model(MODEL), num_kv_blocks=16)
    matchers = []
    for k, grammar in enumerate(list(GRAMMARS.values()) * 3):
        matcher = eng.grammars.matcher(grammar)
        for _ in range(k):  # each at another place in its grammar: the first token it allows
            words = np.zeros(mask_words(eng.grammars.vocab_size), dtype=np.int32)
            matcher.fill(words)
            if matcher.done:
                break
            matcher.accept(int(np.flatnonzero((words[:, None] >> np.arange(32)) & 1)[0]))
        matchers.append(matcher)
    shape = (len(matchers), mask_words(eng.grammars.vocab_size))
    parallel, one_by_one = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    fill_masks(matchers, parallel, parallel=True)
    fill_masks(matchers, one_by_one, parallel=False)
    assert np.array_equal(parallel, one_by_one) and parallel.any(axis=1).all()


def test_the_masks_are_computed_once_the_forward_is_launched(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the host computes a step's grammar masks while the device runs its forward: the
    runner launches the forward first, then computes them, then samples."""
    import phasefleet.engine.model_runner as model_runner

    eng = _engine(tiny_model(MODEL))
    calls: list[str] = []
    run_step, masks = eng.runner.run_step, model_runner.grammar_masks

    def traced_run_step(*args: Any, **kw: Any) -> Any:
        calls.append("forward")
        return run_step(*args, **kw)

    def traced_masks(*args: Any, **kw: Any) -> Any:
        calls.append("masks")
        return masks(*args, **kw)

    monkeypatch.setattr(eng.runner, "run_step", traced_run_step)
    monkeypatch.setattr(model_runner, "grammar_masks", traced_masks)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, grammar=GRAMMARS["regex"])
    out = eng.generate(random_prompts([9], seed=12), params)[0]
    assert obeys("regex", out.text)
    assert calls == ["forward", "masks"] * len(out.output_token_ids)


def test_a_grammar_after_a_thought_lets_everything_through_until_it_is_written(
    tiny_model: Callable[[str], Path],
) -> None:
    """Grammar.after (a reasoning model's end of thought): every token is allowed, and none is
    checked, until those tokens are written (or were in the prompt); then the grammar's mask,
    alone or filled in parallel beside others."""
    eng = _engine(tiny_model(MODEL), num_kv_blocks=16)
    end = tuple(eng.tokenizer.encode("</think>", add_special_tokens=False))
    grammar = Grammar("choice", GRAMMARS["choice"].spec, after=end)
    matcher = eng.grammars.matcher(grammar)
    width = mask_words(eng.grammars.vocab_size)
    words = np.zeros(width, dtype=np.int32)
    matcher.fill(words)
    assert (words == -1).all() and not matcher.done
    thought = eng.tokenizer.encode("x </thi", add_special_tokens=False)
    for token in thought:
        matcher.accept(token)  # nothing is refused while thinking
    twin = matcher.copy()
    for token in end:
        matcher.accept(token)
    assert matcher.active and not twin.active
    both = np.zeros((2, width), dtype=np.int32)
    fill_masks([twin, matcher], both, parallel=True)
    plain = eng.grammars.matcher(GRAMMARS["choice"])
    alone = np.zeros(width, dtype=np.int32)
    plain.fill(alone)
    assert (both[0] == -1).all() and np.array_equal(both[1], alone)
    for token in eng.tokenizer.encode("red", add_special_tokens=False):
        matcher.accept(token)
    assert matcher.done
    opened = eng.grammars.matcher(grammar)
    opened.open_if_in([5, *end, 7])  # a prompt that closed the thought already
    assert opened.active


class ScriptedDrafts(NgramProposer):
    """Drafts of 4 read from a known continuation (its token at draft index `wrong_at` made
    wrong), instead of looked up."""

    def __init__(self, req: Request, continuation: list[int], wrong_at: int | None) -> None:
        super().__init__(4, 1, 1)
        self.req, self.continuation, self.wrong_at = req, continuation, wrong_at

    def propose(self, limit: int) -> list[int]:
        done = len(self.req.output_token_ids)
        guess = self.continuation[done : done + min(4, limit)]
        if self.wrong_at is not None and self.wrong_at < len(guess):
            guess[self.wrong_at] = (guess[self.wrong_at] + 1) % 500
        return guess


@pytest.mark.parametrize("wrong_at", [None, 1], ids=["right", "wrong_second"])
def test_drafts_under_each_grammar_give_the_answers_of_no_drafts(
    tiny_model: Callable[[str], Path], wrong_at: int | None
) -> None:
    """Greedy and seeded answers under each grammar, drafted from the answer itself and on past
    its end (an eos, then tokens the grammar refuses), right or wrong at each draft's second
    token: each answer is that of no drafts (tokens, text, 'stop'). Drafts are cut where the
    grammar refuses a token or completes, and each draft position is masked by the grammar
    after the draft tokens before it."""
    folder = tiny_model(MODEL)
    names = list(GRAMMARS) * 2
    prompts = random_prompts([19, 11, 23, 17, 13, 21, 9, 15], seed=7)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, grammar=GRAMMARS[name])
        if i < len(GRAMMARS)
        else SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, grammar=GRAMMARS[name])
        for i, name in enumerate(names)
    ]
    alone = _engine(folder).generate(prompts, params)
    eng = _engine(folder, num_speculative_tokens=4)
    eos = min(eng.scheduler.eos_token_ids)
    for i, (prompt, p, out) in enumerate(zip(prompts, params, alone, strict=True)):
        eng.add_request(f"r{i}", prompt, p)
        tail = [eos, *eng.tokenizer.encode("}}]]", add_special_tokens=False)]
        req = eng.scheduler.requests[f"r{i}"]
        eng._live[f"r{i}"].drafts = ScriptedDrafts(req, out.output_token_ids + tail, wrong_at)
    finals = finish_all(eng)
    for i, (name, out) in enumerate(zip(names, alone, strict=True)):
        got = finals[f"r{i}"]
        assert out.finish_reason == "stop" and obeys(name, out.text), (name, out.text)
        assert (got.output_token_ids, got.text, got.finish_reason) == (
            out.output_token_ids, out.text, out.finish_reason
        ), name  # fmt: skip
    s = eng.scheduler
    assert s.draft_tokens_total > 0
    if wrong_at is None:
        assert s.accepted_tokens_total == s.draft_tokens_total
    else:
        assert 0 < s.accepted_tokens_total < s.draft_tokens_total
    assert s.generation_tokens_total == sum(len(o.output_token_ids) for o in alone)
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


def test_a_matchers_draft_prefix_and_masks_leave_it_where_it_was(
    tiny_model: Callable[[str], Path],
) -> None:
    """valid_prefix cuts a draft where the grammar refuses a token or completes (while it waits
    for its `after` tokens, just after they are written); fill_after writes the mask a draft
    position has. Neither moves the matcher."""
    eng = _engine(tiny_model(MODEL), num_kv_blocks=16)
    encode = lambda text: eng.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    width = mask_words(eng.grammars.vocab_size)

    def mask(matcher: Any, before: list[int]) -> np.ndarray:
        words = np.zeros(width, dtype=np.int32)
        matcher.fill_after(before, words)
        return words

    matcher = eng.grammars.matcher(GRAMMARS["regex"])
    answer = encode("123-abc")
    start = mask(matcher, [])
    assert matcher.valid_prefix(answer) == len(answer)
    assert matcher.valid_prefix([*answer[:2], *encode("x"), *answer[2:]]) == 2
    middle = mask(matcher, answer[:2])
    twin = eng.grammars.matcher(GRAMMARS["regex"])
    for token in answer[:2]:
        twin.accept(token)
    assert np.array_equal(middle, mask(twin, [])) and not np.array_equal(middle, start)
    assert np.array_equal(mask(matcher, []), start)  # rolled back
    choice = eng.grammars.matcher(GRAMMARS["choice"])
    red = encode("red")
    eos = min(eng.scheduler.eos_token_ids)  # which a complete grammar allows
    assert choice.valid_prefix([*red, eos, *encode("red")]) == len(red)  # complete: cut there
    end = tuple(encode("</think>"))
    thinking = eng.grammars.matcher(Grammar("choice", GRAMMARS["choice"].spec, after=end))
    draft = [*encode("x "), *end, *red, *encode("!")]
    assert thinking.valid_prefix(draft) == len(draft) - len(red) - 1  # up to the end of thought
    opened = mask(thinking, draft[: len(draft) - len(red) - 1])
    fresh = eng.grammars.matcher(GRAMMARS["choice"])
    assert np.array_equal(opened, mask(fresh, []))
    assert (mask(thinking, encode("x ")) == -1).all() and not thinking.active
