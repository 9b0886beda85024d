"""Model folders for the GPU checks, made once per run in the scratch folder: the tests' tiny
Llama, small models with real head shapes, a Llama-3-8B config whose random weights are made on
the device while the engine loads it, and SmolLM2 from the carried cache."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from gpu_report import CheckContext, NotRun

from phasefleet.engine.models import loader
from phasefleet.engine.models.llama import CausalLM
from phasefleet.engine.tiny import make_tiny

# Llama 3 8B: 32 layers, hidden 4096, 32 heads / 8 KV heads of 128, MLP 14336, vocab 128256
LLAMA3_8B = dict(
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
)
QUICK_8B = dict(
    hidden_size=256,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    intermediate_size=512,
    vocab_size=512,
)


def _made(folder: Path, make: Callable[[Path], object]) -> Path:
    """`folder`, made by `make` unless a finished one is there (make_tiny writes its
    phasefleet-tiny.json last)."""
    if not (folder / "phasefleet-tiny.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        make(folder)
    return folder


def tiny(ctx: CheckContext) -> Path:
    """The tests' GQA Llama (4 heads / 2 KV heads of 16, wide init: decisive greedy choices)."""
    return _made(ctx.work / "tiny-llama", lambda f: make_tiny(f, arch="llama", seed=1))


def real_heads(ctx: CheckContext) -> Path:
    """Two layers with Llama 3 8B's attention (32 heads / 8 KV heads of 128), small MLP and
    vocab; the tiny model with --quick."""
    if ctx.quick:
        return tiny(ctx)
    sizes: dict[str, Any] = dict(hidden_size=4096, num_layers=2, num_heads=32, num_kv_heads=8)
    sizes.update(intermediate_size=2048, vocab_size=1024)
    return _made(
        ctx.work / "real-heads",
        lambda f: make_tiny(f, arch="llama", seed=2, init_std=0.02, dtype="bfloat16", **sizes),
    )


def kv_layout_8b(ctx: CheckContext) -> Path:
    """Llama 3 8B's KV layout (32 layers, 8 KV heads of 128: 128 KiB a token in bf16) with
    small weights (hidden 1024 = 8 heads of 128, MLP 1024, vocab 512): a hand-off moves the
    8B model's bytes. Two tiny layers with --quick."""
    sizes: dict[str, Any]
    if ctx.quick:
        sizes = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    else:
        sizes = dict(hidden_size=1024, num_layers=32, num_heads=8, num_kv_heads=8)
    sizes.update(intermediate_size=1024 if not ctx.quick else 128, vocab_size=512)
    sizes.update(max_position_embeddings=4096)
    return _made(
        ctx.work / "kv-layout-8b",
        lambda f: make_tiny(f, arch="llama", seed=3, init_std=0.02, dtype="bfloat16", **sizes),
    )


def _shape_folder(ctx: CheckContext, name: str) -> tuple[Path, dict[str, Any]] | None:
    """A folder for a model's shape alone: the tiny model's tokenizer and an empty
    model.safetensors (load it inside `random_weights`), and the tokenizer's special token ids
    for its config; None when it is already made."""
    folder = ctx.work / name
    if (folder / "config.json").is_file():
        return None
    folder.mkdir(parents=True, exist_ok=True)
    source = tiny(ctx)
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / file).is_file():
            shutil.copy(source / file, folder / file)
    (folder / "model.safetensors").write_bytes(b"")  # never read: random_weights replaces it
    tok = json.loads((source / "config.json").read_text())
    return folder, dict(bos_token_id=tok.get("bos_token_id"), eos_token_id=tok.get("eos_token_id"))


def llama3_8b_config(ctx: CheckContext) -> Path:
    """A folder the engine loads as Llama 3 8B (config.json, the tiny model's tokenizer, an
    empty model.safetensors): load it inside `random_weights`. Two small layers with --quick."""
    from transformers import LlamaConfig

    name = "llama3-8b-shape" if not ctx.quick else "llama3-8b-quick"
    made = _shape_folder(ctx, name)
    if made is None:
        return ctx.work / name
    folder, tokens = made
    s = QUICK_8B if ctx.quick else LLAMA3_8B
    LlamaConfig(
        hidden_size=s["hidden_size"],
        num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"],
        intermediate_size=s["intermediate_size"],
        vocab_size=s["vocab_size"],
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        dtype="bfloat16",
        **tokens,
    ).save_pretrained(folder)
    return folder


# Qwen3-30B-A3B: 48 layers, hidden 2048, 32 heads / 4 KV heads of 128, 128 experts 768 wide,
# 8 per token (renormalized), vocab 151936; --quick: two small layers, 8 experts, 2 per token
QWEN3_30B_A3B = dict(
    hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, vocab_size=151936,
)  # fmt: skip
QUICK_MOE = dict(
    hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
    head_dim=32, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
    num_experts_per_tok=2, vocab_size=512,
)  # fmt: skip


def qwen3_moe_config(ctx: CheckContext) -> Path:
    """A folder the engine loads as Qwen3-30B-A3B (as llama3_8b_config: load it inside
    `random_weights`); two small layers with --quick."""
    from transformers import Qwen3MoeConfig

    name = "qwen3-30b-a3b-shape" if not ctx.quick else "qwen3-moe-quick"
    made = _shape_folder(ctx, name)
    if made is None:
        return ctx.work / name
    folder, tokens = made
    Qwen3MoeConfig(
        **(QUICK_MOE if ctx.quick else QWEN3_30B_A3B),
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=8192,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        dtype="bfloat16",
        **tokens,
    ).save_pretrained(folder)
    return folder


@contextmanager
def random_weights(device: torch.device, std: float = 0.02) -> Iterator[None]:
    """While active, the engine's loader reads random weights made on `device` (norms at 1),
    one tensor at a time, instead of the safetensors files: an 8B model in seconds, through
    the engine's own load_model (placing, fusing, rope tables, the dtype cast) and everything
    after it."""

    def read_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder)
        dtype = getattr(torch, str(config.dtype).removeprefix("torch."))
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in CausalLM(config).state_dict().items()}
        gen = torch.Generator(device=device).manual_seed(0)
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape, dtype=dtype, device=device)
            else:
                t = torch.randn(shape, dtype=dtype, device=device, generator=gen)
                yield name, t.mul_(std)

    with mock.patch.object(loader, "read_checkpoint", read_checkpoint):
        yield


def smollm2(ctx: CheckContext) -> Path:
    """SmolLM2's Hugging Face folder in the carried cache, converted there from its .gguf once
    if only that was carried; NotRun when none was given."""
    if ctx.smollm2_cache is None:
        raise NotRun(ctx.smollm2_missing)
    os.environ["PHASEFLEET_CACHE"] = str(ctx.smollm2_cache)  # this process and its children
    from phasefleet.server.named_models import SMOLLM2, models_dir, named_model_folder

    folder = models_dir() / SMOLLM2.folder_name
    if (folder / "config.json").is_file():
        return folder
    made = named_model_folder(SMOLLM2.name)  # the .gguf is there: converts, never downloads
    if made is None:
        raise NotRun(f"no SmolLM2 folder in {ctx.smollm2_cache}")
    return made


def layer_params(config: Any) -> int:
    """Weights of one decoder layer of a Llama-family config (biases left out)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * dim, config.num_key_value_heads * dim
    return hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden


def decode_weight_bytes(config: Any, element_bytes: int) -> int:
    """Bytes of weights one decode step reads: every layer, the final norm and the output
    projection; of the input embedding only the batch's rows (nothing, here), unless it is tied
    (then it is the output projection). From the config: the CPU path packs its linears into
    buffers that model.parameters() no longer lists."""
    layers = config.num_hidden_layers * layer_params(config)
    return element_bytes * (layers + config.hidden_size * (1 + config.vocab_size))
