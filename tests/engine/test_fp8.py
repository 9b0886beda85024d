"""FP8 checkpoints (engine/models/fp8.py), their weights dequantized at load. The reference is
transformers with compressed-tensors on the same checkpoint (it decompresses FP8 weights on the
CPU); the fine-grained `fp8` format, which transformers reads only on a GPU, is checked against
the same values stored in compressed-tensors' block format."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.models.fp8 import dequantize, fp8_scheme
from phasefleet.engine.models.loader import load_model
from phasefleet.engine.sampling_params import SamplingParams
from tests.engine.factories import engine_config, random_prompts

ModelPath = Callable[[str], Path]

FMAX = torch.finfo(torch.float8_e4m3fn).max
BLOCK = (32, 16)  # divides the tiny models' weights, as compressed-tensors needs (the edges of
# partial blocks: test_dequantize_scales_per_tensor_row_or_block)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
CPU = torch.device("cpu")


def quantize(weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> float8 values and their scales (one, [out, 1], or per BLOCK)."""
    w = weight.float()
    if strategy == "tensor":
        scale = (w.abs().amax() / FMAX).reshape(1)
        full = scale
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FMAX
        full = scale
    else:
        rows, cols = BLOCK
        scale = torch.zeros(-(-w.shape[0] // rows), -(-w.shape[1] // cols))
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                part = w[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
                scale[i, j] = part.abs().amax() / FMAX
        full = scale.repeat_interleave(rows, 0)[: w.shape[0]].repeat_interleave(cols, 1)
        full = full[:, : w.shape[1]]
    return (w / full).clamp(-FMAX, FMAX).to(torch.float8_e4m3fn), scale


def fp8_copy(
    src: Path,
    dst: Path,
    strategy: str,
    fmt: str = "compressed-tensors",
    activations: bool = False,
    kv_scales: bool = False,
) -> Path:
    """`src` with every linear projection's weight in float8 (the MoE router and the output
    head left as they are), in `fmt`: compressed-tensors (weight-only, or W8A8 with dynamic
    activations) or the `fp8` format (`weight_scale_inv` per block; per tensor without one,
    with static activation scales)."""
    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not name.endswith("proj.weight"):
            out[name] = tensor
            continue
        out[name], scale = quantize(tensor, strategy)
        suffix = "_scale_inv" if fmt == "fp8" and strategy == "block" else "_scale"
        out[name + suffix] = scale.to(torch.bfloat16 if strategy == "channel" else torch.float32)
        if activations and fmt == "fp8":
            out[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.02])
        if kv_scales and name.endswith("k_proj.weight"):
            attn = name.removesuffix("k_proj.weight")
            out[attn + "k_scale"], out[attn + "v_scale"] = torch.tensor(0.1), torch.tensor(0.1)
    (dst / "model.safetensors").unlink()
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(strategy, fmt, activations, kv_scales)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def quantization_config(strategy: str, fmt: str, activations: bool, kv: bool) -> dict[str, Any]:
    if fmt == "fp8":
        qc: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3"}
        qc["activation_scheme"] = "static" if activations else "dynamic"
        if strategy == "block":
            qc["weight_block_size"] = list(BLOCK)
        return qc
    weights: dict[str, Any] = {
        "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
    }  # fmt: skip
    if strategy == "block":
        weights["block_structure"] = list(BLOCK)
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    kv_scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head", "re:.*mlp\\.gate$"],
        "kv_cache_scheme": kv_scheme if kv else None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts if activations else None,
            }
        },
    }


def ours(folder: Path) -> dict[str, torch.Tensor]:
    model = load_model(folder, AutoConfig.from_pretrained(folder), torch.float32, CPU, 64)
    return model.state_dict()


def transformers_greedy(folder: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    answers = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            answers.append(ids[len(prompt) :])
    return answers


def engine_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(engine_config(folder))
    return [out.output_token_ids for out in engine.generate(prompts, GREEDY)]


@pytest.mark.parametrize(
    ("name", "strategy"),
    [("llama", "channel"), ("llama", "tensor"), ("llama", "block"), ("qwen3_moe", "channel"),
     ("phi3", "block")],
)  # fmt: skip
def test_compressed_tensors_fp8_answers_as_transformers_does(
    tiny_model: ModelPath, tmp_path: Path, name: str, strategy: str
) -> None:
    folder = fp8_copy(tiny_model(name), tmp_path / "fp8", strategy)
    assert any(
        t.dtype == torch.float8_e4m3fn for t in load_file(folder / "model.safetensors").values()
    )
    prompts = random_prompts([9, 23], seed=4)
    assert engine_greedy(folder, prompts) == transformers_greedy(folder, prompts, GREEDY.max_tokens)


def test_an_fp8_checkpoint_split_over_two_ranks_answers_as_transformers_does(
    tiny_model: ModelPath, tmp_path: Path
) -> None:
    """Each rank dequantizes whole weights before it takes its slice: block scales never need
    slicing along the shards' boundaries."""
    folder = fp8_copy(tiny_model("llama"), tmp_path / "fp8", "block")
    config = engine_config(folder, device="cpu", tensor_parallel_size=2, num_kv_blocks=64)
    engine = LLMEngine(config)
    try:
        prompts = random_prompts([21], seed=6)
        answers = [out.output_token_ids for out in engine.generate(prompts, GREEDY)]
    finally:
        engine.close()
    assert answers == transformers_greedy(folder, prompts, GREEDY.max_tokens)


def test_dequantized_weights_are_transformers_own(tiny_model: ModelPath, tmp_path: Path) -> None:
    """The values themselves, not only the answers: each projection as compressed-tensors
    decompresses it, bit for bit, and not the unquantized model's."""
    base = tiny_model("llama")
    folder = fp8_copy(base, tmp_path / "fp8", "block")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        model(torch.tensor([[1, 2]]))  # compressed-tensors decompresses at the first forward
    reference = dict(model.named_parameters())  # (and state_dict() compresses them again)
    loaded = ours(folder)
    p = "model.layers.1"
    qkv = torch.cat([reference[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(loaded[f"{p}.self_attn.qkv_proj.weight"], qkv)
    down = reference[f"{p}.mlp.down_proj.weight"]
    assert torch.equal(loaded[f"{p}.mlp.down_proj.weight"], down)
    unquantized = load_file(base / "model.safetensors")[f"{p}.mlp.down_proj.weight"]
    assert not torch.equal(down, unquantized)
    assert torch.allclose(down, unquantized, rtol=0.07, atol=1e-3)


@pytest.mark.parametrize("strategy", ["block", "tensor"])
def test_the_fp8_format_loads_as_its_compressed_tensors_twin(
    tiny_model: ModelPath, tmp_path: Path, strategy: str
) -> None:
    """Qwen3-FP8's and DeepSeek-V3's format (`weight_scale_inv` per block), and its per-tensor
    form with static activation scales, hold the same values as compressed-tensors' block and
    tensor strategies."""
    base = tiny_model("llama")
    twin = fp8_copy(base, tmp_path / "ct", strategy)
    folder = fp8_copy(base, tmp_path / "fp8", strategy, fmt="fp8", activations=strategy == "tensor")
    assert fp8_scheme(AutoConfig.from_pretrained(folder)).block == (  # type: ignore[union-attr]
        BLOCK if strategy == "block" else None
    )
    for (name, a), (_, b) in zip(ours(folder).items(), ours(twin).items(), strict=True):
        assert torch.equal(a, b), name
    if strategy == "block":
        prompts = random_prompts([17], seed=5)
        answers = transformers_greedy(twin, prompts, GREEDY.max_tokens)
        assert engine_greedy(folder, prompts) == answers


def test_activation_and_kv_cache_scales_are_read_past(
    tiny_model: ModelPath, tmp_path: Path
) -> None:
    """A W8A8 checkpoint with KV-cache scales is served with the same weights as its
    weight-only twin: activations and the KV cache stay in the engine's dtype."""
    base = tiny_model("llama")
    w8a8 = fp8_copy(base, tmp_path / "w8a8", "channel", activations=True, kv_scales=True)
    assert "model.layers.0.self_attn.k_scale" in load_file(w8a8 / "model.safetensors")
    weight_only = fp8_copy(base, tmp_path / "w8", "channel")
    for (name, a), (_, b) in zip(ours(w8a8).items(), ours(weight_only).items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("quantization", "says"),
    [
        ({"quant_method": "awq", "bits": 4}, "quantized with 'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "quantized with 'gptq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantized with 'bitsandbytes'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not served"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two"),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
                "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
            "group_0 quantizes weights to 4-bit int",
        ),
        (
            {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
                "g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}},
            "g.weights.strategy 'group' is not served",
        ),
        (
            {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
                "g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
            "g.weights.block_structure is missing",
        ),
    ],
)  # fmt: skip
def test_other_quantizations_are_refused_naming_what_is_served(
    tiny_model: ModelPath, tmp_path: Path, quantization: dict[str, Any], says: str
) -> None:
    folder = shutil.copytree(tiny_model("llama"), tmp_path / "q")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=says):
        ours(folder)


def test_a_float8_weight_without_its_scale_is_named(tiny_model: ModelPath, tmp_path: Path) -> None:
    folder = fp8_copy(tiny_model("llama"), tmp_path / "fp8", "channel")
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight is .* no scale"):
        ours(folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no quantization_config to scale it"):
        ours(folder)


def test_dequantize_scales_per_tensor_row_or_block() -> None:
    weight = torch.ones(6, 8).to(torch.float8_e4m3fn)
    assert torch.equal(dequantize(weight, torch.tensor([0.5]), None, "w"), torch.full((6, 8), 0.5))
    rows = torch.arange(6.0)
    by_row = rows[:, None].expand(6, 8)
    assert torch.equal(dequantize(weight, rows[:, None], None, "w"), by_row)
    assert torch.equal(dequantize(weight, rows, None, "w"), by_row)
    grid = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    whole = dequantize(torch.ones(8, 8).to(torch.float8_e4m3fn), grid, (4, 4), "w")  # whole blocks
    assert torch.equal(whole, grid.repeat_interleave(4, 0).repeat_interleave(4, 1))
    edges = dequantize(weight, grid, (4, 4), "w")  # the last block row holds 2 rows
    assert torch.equal(edges, grid.repeat_interleave(4, 0)[:6].repeat_interleave(4, 1))


def test_a_scale_of_the_wrong_shape_is_named() -> None:
    weight = torch.ones(6, 8).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale of w has shape \(3, 2\).*blocks of \(4, 4\)"):
        dequantize(weight, torch.ones(3, 2), (4, 4), "w")
    with pytest.raises(ValueError, match="no block size in quantization_config"):
        dequantize(weight, torch.ones(2, 2), None, "w")
