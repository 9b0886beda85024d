"""The loader reads each checkpoint tensor once into its place: fused q/k/v and gate/up rows in
the checkpoint's order, the dtype cast, shards, tied embeddings, and a clear error for a
checkpoint that does not match its config."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from phasefleet.engine.models.loader import load_model, places

CPU = torch.device("cpu")


def load(folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    return load_model(folder, AutoConfig.from_pretrained(folder), dtype, CPU, 64)


def copy_with(
    src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], object], shards: int = 1
) -> Path:
    """The model folder `src` copied to `dst` with its tensors edited, in `shards` files."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    state = load_file(str(src / "model.safetensors"))
    edit(state)
    names = sorted(state)
    for i in range(shards):
        part = {n: state[n].contiguous() for n in names[i::shards]}
        save_file(part, str(dst / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    return dst


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_fused_weights_are_the_checkpoints_rows_in_order(
    tiny_model: Callable[[str], Path], name: str
) -> None:
    folder = tiny_model(name)
    state = load_file(str(folder / "model.safetensors"))
    model = load(folder)
    layer = model.model.layers[1]
    p = "model.layers.1"
    qkv = [state[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"]
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(qkv))
    gate_up = [state[f"{p}.mlp.{x}_proj.weight"] for x in ("gate", "up")]
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat(gate_up))
    assert torch.equal(layer.self_attn.o_proj.weight, state[f"{p}.self_attn.o_proj.weight"])
    if name == "qwen2":  # q/k/v biases are fused too; the output projection is the embedding
        biases = [state[f"{p}.self_attn.{x}_proj.bias"] for x in "qkv"]
        assert torch.equal(layer.self_attn.qkv_proj.bias, torch.cat(biases))
        assert model.lm_head is None
    assert not any(param.requires_grad for param in model.parameters())


def test_cast_to_the_engine_dtype_and_shards_load_alike(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = tiny_model("llama")
    sharded = copy_with(folder, tmp_path / "sharded", lambda s: None, shards=3)
    whole, parts = load(folder, torch.bfloat16), load(sharded, torch.bfloat16)
    for (name, a), (_, b) in zip(
        whole.state_dict().items(), parts.state_dict().items(), strict=True
    ):
        assert a.dtype == torch.bfloat16, name
        assert torch.equal(a, b), name


def test_a_checkpoint_that_does_not_match_says_what_is_wrong(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = tiny_model("llama")
    k = "model.layers.0.self_attn.k_proj.weight"
    missing = copy_with(folder, tmp_path / "missing", lambda s: s.pop(k))
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.self_attn.k_proj.weight'\]"):
        load(missing)
    extra = copy_with(folder, tmp_path / "extra", lambda s: s.update(extra=torch.zeros(2)))
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        load(extra)

    def narrow(s: dict[str, torch.Tensor]) -> None:
        s[k] = s[k][:-1]

    wrong = copy_with(folder, tmp_path / "wrong", narrow)
    rows, cols = load_file(str(folder / "model.safetensors"))[k].shape
    with pytest.raises(
        ValueError, match=rf"k_proj.weight has shape \({rows - 1}, {cols}\), the config makes it"
    ):
        load(wrong)
    ignored = copy_with(  # old checkpoints store rope frequencies: not an error
        folder,
        tmp_path / "ignored",
        lambda s: s.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}),
    )
    load(ignored)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(json.loads((folder / "config.json").read_text())))
    with pytest.raises(ValueError, match="has no \\*.safetensors files"):
        load(empty)


def test_an_image_text_checkpoint_loads_its_decoder_in_either_layout(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """transformers saves Gemma 3's decoder as language_model.model.*, its newer layout as
    model.language_model.*: both load; the vision tower is left out, a stray tensor is not."""
    from phasefleet.engine.models.traits import load_decoder_config

    folder = tiny_model("gemma3_vision")
    state = load_file(str(folder / "model.safetensors"))
    assert any(k.startswith("vision_tower.") for k in state)
    config = load_decoder_config(folder)
    embed = state["language_model.model.embed_tokens.weight"]

    def loaded(path: Path) -> Any:
        return load_model(path, config, torch.float32, CPU, 64)

    assert torch.equal(loaded(folder).model.embed_tokens.weight, embed)

    def newer(s: dict[str, torch.Tensor]) -> None:
        for name in list(s):
            moved = name.replace("language_model.model.", "model.language_model.")
            s["model." + moved if moved.startswith("vision_tower.") else moved] = s.pop(name)

    relaid = copy_with(folder, tmp_path / "newer", newer)
    assert torch.equal(loaded(relaid).model.embed_tokens.weight, embed)
    stray = copy_with(folder, tmp_path / "stray", lambda s: s.update(stray=torch.zeros(2)))
    with pytest.raises(ValueError, match=r"unexpected \['stray'\]"):
        loaded(stray)


def test_places_offsets_follow_the_parts_order() -> None:
    shapes = {
        "l.attn.q_proj.weight": torch.Size([8, 4]),
        "l.attn.k_proj.weight": torch.Size([2, 4]),
        "l.attn.v_proj.weight": torch.Size([2, 4]),
        "l.mlp.gate_proj.weight": torch.Size([6, 4]),
        "l.mlp.up_proj.weight": torch.Size([6, 4]),
        "l.attn.o_proj.weight": torch.Size([4, 8]),
    }
    where = places(shapes)
    assert [(where[f"l.attn.{x}_proj.weight"].start) for x in "qkv"] == [0, 8, 10]
    assert where["l.attn.v_proj.weight"].target == "l.attn.qkv_proj.weight"
    assert where["l.mlp.up_proj.weight"].start == 6
    assert where["l.mlp.up_proj.weight"].target == "l.mlp.gate_up_proj.weight"
    assert where["l.attn.o_proj.weight"].start is None


def test_a_phi3_fused_projection_of_another_size_is_refused_naming_it() -> None:
    """Phi-3's qkv_proj / gate_up_proj are split by the config's sizes; rows that do not add
    up are a ValueError naming the tensor, not a silent misplacement."""
    from types import SimpleNamespace

    from phasefleet.engine.models.checkpoint import our_tensors

    config = SimpleNamespace(
        model_type="phi3", hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=6,
    )  # fmt: skip
    qkv = torch.arange(16 * 8.0).view(16, 8)  # q 8 rows, k 4, v 4
    parts = dict(our_tensors("model.layers.0.self_attn.qkv_proj.weight", qkv, config))
    assert [p.shape[0] for p in parts.values()] == [8, 4, 4]
    assert torch.equal(parts["model.layers.0.self_attn.k_proj.weight"], qkv[8:12])
    with pytest.raises(ValueError, match="gate_up_proj.weight has 10 rows, the config makes 12"):
        list(our_tensors("model.layers.0.mlp.gate_up_proj.weight", torch.zeros(10, 8), config))
