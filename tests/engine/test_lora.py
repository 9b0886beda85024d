"""LoRA adapters in the engine: answers equal PEFT's on transformers, adapters mixed in one batch,
prefix caching per adapter, and the adapters it refuses."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.lora import LoraError, read_adapter
from phasefleet.engine.request import Request
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.speculation import NgramProposer
from phasefleet.engine.tiny import make_tiny
from phasefleet.engine.tiny_lora import make_tiny_lora
from tests.engine.factories import engine_config, finish_all, peft_greedy, random_prompts

MODEL = "llama"
N = 10


@pytest.fixture(scope="module")
def adapters(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Three adapters of the tiny llama: ours on every projection (rank 4), ours on attention
    only (rank 8, rsLoRA off), and one PEFT made and saved itself (rank 2, q and v)."""
    base = tiny_model(MODEL)
    root = tmp_path_factory.mktemp("loras")
    every = make_tiny_lora(root / "every", base, rank=4, seed=1)
    attention = make_tiny_lora(
        root / "attention", base, rank=8, alpha=4, seed=2,
        targets=("q_proj", "k_proj", "v_proj", "o_proj"),
    )  # fmt: skip
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_config = LoraConfig(r=2, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                             init_lora_weights=False)  # fmt: skip
    get_peft_model(model, peft_config).save_pretrained(str(root / "peft"))
    return {"every": every, "attention": attention, "peft": root / "peft"}


def _engine(folder: Path, adapters: dict[str, Path], **kw: Any) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 96)
    config = engine_config(
        folder, block_size=4, lora_adapters={k: str(v) for k, v in adapters.items()}, **kw
    )
    return LLMEngine(config)


def test_mixed_batch_answers_equal_peft_for_each_adapter(
    tiny_model: Callable[[str], Path], adapters: dict[str, Path]
) -> None:
    """The base model and three adapters in one batch, prompts prefilled in chunks across
    steps: each answer is PEFT's greedy answer with the same adapter, and the adapters do
    change the answers. Steps with most slots in use run every slot's columns; steps with few
    only theirs (alone, or beside base rows): both paths are PEFT's."""
    base = tiny_model(MODEL)
    eng = _engine(base, adapters, max_num_batched_tokens=20)
    names: list[str | None] = [None, "every", "attention", "peft", "every"]
    prompts = random_prompts([13, 17, 9, 21, 11], seed=11)
    greedy = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    outputs = eng.generate(prompts, greedy, names)
    answers = [o.output_token_ids for o in outputs]
    for name, prompt, answer in zip(names, prompts, answers, strict=True):
        adapter = None if name is None else adapters[name]
        assert answer == peft_greedy(base, adapter, prompt, N), name
    # the same prompt under each adapter: four different answers
    same = [prompts[0]] * 4
    differ = eng.generate(same, greedy, [None, "every", "attention", "peft"])
    assert len({tuple(o.output_token_ids) for o in differ}) == 4
    few: list[str | None] = [None, "peft", None]  # one slot of three, beside base rows
    outs = eng.generate(prompts[:3], greedy, few)
    for name, prompt, out in zip(few, prompts[:3], outs, strict=True):
        assert out.output_token_ids == peft_greedy(
            base, None if name is None else adapters[name], prompt, N
        ), name
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


def test_prefix_cache_is_kept_apart_per_adapter(
    tiny_model: Callable[[str], Path], adapters: dict[str, Path]
) -> None:
    """A prompt computed under one adapter gives no prefix-cache hit to the base model or to
    another adapter, and hits under the same adapter; answers stay PEFT's."""
    base = tiny_model(MODEL)
    eng = _engine(base, adapters)
    prompt = random_prompts([24], seed=12)[0]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    (first,) = eng.generate([prompt], greedy, ["every"])
    assert eng.cached_prefix_tokens(prompt, "every") == 24
    assert eng.cached_prefix_tokens(prompt) == 0
    assert eng.cached_prefix_tokens(prompt, "attention") == 0
    (again,) = eng.generate([prompt], greedy, ["every"])
    assert again.num_cached_tokens > 0 and again.output_token_ids == first.output_token_ids
    (plain,) = eng.generate([prompt], greedy, [None])
    assert plain.num_cached_tokens == 0
    assert plain.output_token_ids == peft_greedy(base, None, prompt, 4)


def test_unknown_adapter_and_adapters_that_cannot_load_are_refused(
    tiny_model: Callable[[str], Path], adapters: dict[str, Path], tmp_path: Path
) -> None:
    base = tiny_model(MODEL)
    eng = _engine(base, {"every": adapters["every"]})
    with pytest.raises(LoraError, match="'nope' is not loaded"):
        eng.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2), lora="nope")
    assert not eng.has_unfinished_requests()
    with pytest.raises(LoraError, match="rank 8, more than --max-lora-rank 4"):
        _engine(base, {"attention": adapters["attention"]}, max_lora_rank=4)
    wider = make_tiny(tmp_path / "wider", arch=MODEL, intermediate_size=96)
    other = make_tiny_lora(tmp_path / "other", wider, rank=2)
    with pytest.raises(LoraError, match="trained on another base model"):
        _engine(base, {"other": other})
    dora = tmp_path / "dora"
    make_tiny_lora(dora, base, rank=2)
    settings = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    with pytest.raises(LoraError, match="use_dora is not supported"):
        read_adapter("dora", dora)
    with pytest.raises(LoraError, match="must hold adapter_config.json"):
        read_adapter("empty", tmp_path)
    with pytest.raises(ValueError, match="max_loras \\(1\\) must be at least"):
        _engine(base, dict(adapters), max_loras=1)


def test_adapter_files_the_engine_cannot_run_are_refused_naming_the_fix(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """A target outside the seven projections, lora_A without its lora_B, and adapters with
    tensor parallelism: each a clear error before anything is served."""
    from safetensors.torch import load_file, save_file

    from phasefleet.engine.config import EngineConfig

    base = tiny_model(MODEL)
    folder = make_tiny_lora(tmp_path / "a", base, rank=2)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    embed = {"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(2, 8)}
    save_file({**weights, **embed}, str(folder / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="embed_tokens.lora_A.weight is not supported"):
        read_adapter("a", folder)
    half = {k: v for k, v in weights.items() if ".layers.0.self_attn.q_proj.lora_B" not in k}
    save_file(half, str(folder / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="layer 0 q_proj has lora_A, no lora_B"):
        read_adapter("a", folder)
    config = EngineConfig(model=str(base), lora_adapters={"a": str(folder)}, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="not supported with tensor_parallel_size > 1"):
        config.validate()


def test_drafted_steps_of_adapter_requests_equal_peft(
    tiny_model: Callable[[str], Path], adapters: dict[str, Path]
) -> None:
    """Speculation with drafts of 3 that are each adapter's own answer (PEFT's): every draft
    position must run with its request's adapter for the draws to agree, so all drafts are
    accepted and every answer is PEFT's."""
    base = tiny_model(MODEL)
    eng = _engine(base, adapters, num_speculative_tokens=3)
    names: list[str | None] = ["every", "attention", "peft", None]
    prompts = random_prompts([13, 17, 9, 21], seed=12)
    reference = {
        f"r{i}": peft_greedy(base, None if name is None else adapters[name], prompt, N)
        for i, (name, prompt) in enumerate(zip(names, prompts, strict=True))
    }

    def draft(req: Request, drafts: NgramProposer) -> None:
        done = len(req.output_token_ids)
        req.draft_token_ids = reference[req.request_id][done : min(done + 3, N - 1)]

    eng._draft = draft  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    for i, (name, prompt) in enumerate(zip(names, prompts, strict=True)):
        eng.add_request(f"r{i}", prompt, SamplingParams(**vars(greedy)), lora=name)
    outputs = {k: v.output_token_ids for k, v in finish_all(eng).items()}
    assert outputs == reference
    s = eng.scheduler
    assert s.accepted_tokens_total == s.draft_tokens_total > 0
