"""Mixture-of-experts layers: each way of running the experts equals transformers' own MoE block,
the path a step takes, Mixtral's checkpoint names, tensor-parallel widths, and LoRA adapters on
an MoE model (attention only). The whole models' greedy answers are checked against transformers
in test_correctness.py and, over two ranks, in test_tensor_parallel.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from phasefleet.engine.lora import LoraError
from phasefleet.engine.models import moe, moe_shape
from phasefleet.engine.models.checkpoint import checkpoint_name
from phasefleet.engine.models.loader import load_model
from phasefleet.engine.parallel.shard import Shard, unsupported
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.tiny_lora import make_tiny_lora
from tests.engine.factories import engine_config, peft_greedy, random_prompts

ModelPath = Callable[[str], Path]
ARCHES = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("path", moe.PATHS)
@pytest.mark.parametrize("name", ARCHES)
def test_every_path_equals_the_transformers_block(
    name: str, path: str, tokens: int, tiny_model: ModelPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer 0's experts on random hidden states, each path forced: transformers' block (its
    routing, top-k, renormalization and shared expert) gives the same output."""
    folder = tiny_model(name)
    config = AutoConfig.from_pretrained(folder)
    ours = load_model(folder, config, torch.float32, torch.device("cpu"), 64)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    block = ours.model.layers[0].mlp
    assert isinstance(block, moe.SparseMoeBlock)
    monkeypatch.setattr(moe, "choose_path", lambda *_: path)
    x = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        got = block(x)
        layer = theirs.model.layers[0]
        reference = layer.block_sparse_moe if name == "mixtral" else layer.mlp
        want = reference(x.unsqueeze(0))[0][0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_path_follows_the_step_size() -> None:
    shape = moe_shape.MoeShape(experts=8, top_k=2, width=32, renormalize=True, shared_width=0)
    assert moe.choose_path(4, shape, on_cuda=True) == "gathered"  # 4 x 2 slots <= 8 experts
    assert moe.choose_path(5, shape, on_cuda=True) == "every"  # no host sync: graphs capture it
    assert moe.choose_path(256, shape, on_cuda=True) == "every"
    assert moe.choose_path(257, shape, on_cuda=True) == "sorted"  # prefill
    for tokens in (1, 5, 300):  # no graphs on the CPU, and a host sync costs nothing there
        assert moe.choose_path(tokens, shape, on_cuda=False) == "sorted"


def test_mixtral_names_become_ours() -> None:
    assert (
        checkpoint_name("model.layers.3.block_sparse_moe.experts.11.w1.weight")
        == "model.layers.3.mlp.experts.11.gate_proj.weight"
    )
    assert checkpoint_name("model.layers.0.block_sparse_moe.experts.0.w2.weight").endswith(
        "mlp.experts.0.down_proj.weight"
    )
    assert checkpoint_name("model.layers.0.block_sparse_moe.experts.0.w3.weight").endswith(
        "mlp.experts.0.up_proj.weight"
    )
    assert (
        checkpoint_name("model.layers.0.block_sparse_moe.gate.weight")
        == "model.layers.0.mlp.gate.weight"
    )
    assert checkpoint_name("model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )


def test_layers_widths_and_tensor_parallel_splits(tiny_model: ModelPath) -> None:
    """Qwen2-MoE's tiny keeps its last layer dense; every width is split over the ranks, and a
    degree that does not divide one is refused naming that width's field."""
    config = AutoConfig.from_pretrained(tiny_model("qwen2_moe"))
    assert [moe_shape.is_moe_layer(config, i) for i in range(2)] == [True, False]
    assert moe_shape.mlp_widths(config) == {
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
    }
    mixtral = AutoConfig.from_pretrained(tiny_model("mixtral"))
    assert moe_shape.mlp_widths(mixtral) == {"intermediate_size": 128}  # each expert's
    assert unsupported(config, 2) is None
    config.moe_intermediate_size = 66
    assert unsupported(config, 4) == "tensor_parallel_size 4 must divide the model's " + (
        "moe_intermediate_size 66"
    )
    expert = torch.arange(64 * 3).reshape(64, 3).float()  # an expert's gate_proj, 64 rows
    name = "model.layers.0.mlp.experts.5.gate_proj.weight"
    assert torch.equal(Shard(1, 2).take(name, expert, config, 16), expert[32:])


def test_lora_adapts_attention_and_refuses_experts(tiny_model: ModelPath, tmp_path: Path) -> None:
    """An attention adapter on Qwen2-MoE answers as PEFT does; one on the MLPs too is refused
    naming the expert layer (the dense layer alone could take it)."""
    from phasefleet.engine.llm_engine import LLMEngine

    base = tiny_model("qwen2_moe")
    attention = make_tiny_lora(
        tmp_path / "attention", base, rank=4, seed=1,
        targets=("q_proj", "k_proj", "v_proj", "o_proj"),
    )  # fmt: skip
    engine = LLMEngine(engine_config(base, lora_adapters={"attention": str(attention)}))
    prompt = random_prompts([11], seed=3)[0]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    (out,) = engine.generate([prompt], greedy, ["attention"])
    assert out.output_token_ids == peft_greedy(base, attention, prompt, 6)
    assert out.output_token_ids != peft_greedy(base, None, prompt, 6)
    every = make_tiny_lora(tmp_path / "every", base, rank=4, seed=2)
    with pytest.raises(LoraError, match=r"layer 0 has experts, not one (gate|up|down)_proj"):
        LLMEngine(engine_config(base, lora_adapters={"every": str(every)}))
