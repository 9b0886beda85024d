"""`phasefleet make-tiny`: writes a small random model and a real tokenizer to a folder.

The folder looks like a Hugging Face model (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template), so transformers and our engine both load it. Weights
are random with a wide init (std `init_std`), which makes greedy choices decisive: token-for-token
comparisons between implementations then do not hinge on rounding.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ARCHES = (
    "llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3_text", "gemma3",
    "mixtral", "qwen2_moe", "qwen3_moe",
)  # fmt: skip
# image-text arch -> its decoder's: written with a small vision tower, served as text
DECODER_ARCH = {"gemma3": "gemma3_text"}
TINY_VISION = dict(
    model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, image_size=28, patch_size=14,
)  # fmt: skip
MOE_ARCHES = ("mixtral", "qwen2_moe", "qwen3_moe")
GEMMA_ARCHES = ("gemma", "gemma2", "gemma3_text")
GEMMA_NORM_STD = 2.0  # std of the random w in Gemma's (1 + w) norm scales
GEMMA2_SOFTCAPS = (5.0, 3.0)  # attention scores, logits (Gemma 2 2B's: 50, 30)
# Mixture-of-experts sizes, any preset: experts per layer, experts each token runs
MOE_SIZES: dict[str, int] = dict(num_experts=8, num_experts_per_tok=2)

# name -> sizes; "tiny" is for tests, the "bench" ones (~100-150M parameters) for the CPU
# benchmark (`bench/engine_throughput.py --preset`).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=2048,
        init_std=0.3,
    ),
    "bench": dict(
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        vocab_size=16384,
        max_position_embeddings=4096,
        init_std=0.05,
    ),
    # The shape: full multi-head attention and a 4x MLP (GPT-2 small widths).
    "bench-mha": dict(
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        intermediate_size=3072,
        vocab_size=16384,
        max_position_embeddings=4096,
        init_std=0.05,
    ),
    # A wider GQA model (head_dim 64 as above), fewer layers to keep the benchmark short.
    "bench-wide": dict(
        hidden_size=1024,
        num_layers=8,
        num_heads=16,
        num_kv_heads=4,
        intermediate_size=2816,
        vocab_size=16384,
        max_position_embeddings=4096,
        init_std=0.05,
    ),
}

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)  # Qwen3's switch: enable_thinking false opens the answer with an empty thought

# Training text for the tokenizer (written for this project).
CORPUS = """\
PhaseFleet serves language models with prefill and decode running as separate phases.
The prefill worker reads the whole prompt at once, fills the key value cache and writes the first
token; the decode worker then writes the answer one token at a time, reading the cache each step.
A scheduler spends a token budget every step: decodes first, then prompt chunks, then new requests.
Blocks of sixteen tokens hold the cache, and a request keeps a table of the blocks it owns.
When two prompts share a prefix, the second one finds the first one's blocks by their hash.
If memory runs out, the newest request is preempted and recomputed later, so nothing is lost.
Questions and answers: what is the capital of France? Paris. How many legs does a spider have?
Eight. Write a short poem about the sea. The sea is wide, the sea is deep, it sings the sailors
off to sleep. Count from one to ten: one, two, three, four, five, six, seven, eight, nine, ten.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols ( ) [ ] { } < > = + - * / % & | ! ? . , ; :
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="folder to write the model into (created)")
    parser.add_argument("--arch", choices=ARCHES, default="llama", help="model family")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="base sizes")
    parser.add_argument("--seed", type=int, default=0, help="random seed of weights")
    parser.add_argument("--hidden-size", type=int, help="model width")
    parser.add_argument("--num-layers", type=int, help="decoder layers")
    parser.add_argument("--num-heads", type=int, help="attention heads")
    parser.add_argument("--num-kv-heads", type=int, help="key/value heads (GQA when < heads)")
    parser.add_argument("--intermediate-size", type=int, help="MLP width")
    parser.add_argument("--vocab-size", type=int, help="embedding rows (>= tokenizer size)")
    parser.add_argument("--max-position-embeddings", type=int, help="longest sequence, tokens")
    parser.add_argument("--init-std", type=float, help="std of the random weights")
    parser.add_argument(
        "--sliding-window",
        type=int,
        help="sliding window, tokens: every layer's (Mistral, Mixtral, Phi-3), every other "
        "layer's (Gemma 2, Gemma 3), the second half's (Qwen2, Qwen3)",
    )
    parser.add_argument("--num-experts", type=int, help="experts per layer (MoE arches)")
    parser.add_argument("--num-experts-per-tok", type=int, help="experts per token (MoE arches)")
    parser.add_argument(
        "--rope-scaling", choices=["none", "llama3"], default="none", help="RoPE scaling kind"
    )
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="saved dtype"
    )


def run(args: argparse.Namespace) -> int:
    keys = [
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "init_std",
        "sliding_window",
        *MOE_SIZES,
    ]
    sizes = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    path = make_tiny(
        args.dir,
        arch=args.arch,
        seed=args.seed,
        preset=args.preset,
        rope_scaling=None if args.rope_scaling == "none" else args.rope_scaling,
        dtype=args.dtype,
        **sizes,
    )
    print(f"wrote a random {args.arch} model to {path}")
    return 0


def make_tiny(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    preset: str = "tiny",
    rope_scaling: str | None = None,
    dtype: str = "float32",
    **sizes: Any,
) -> Path:
    """Write a random `arch` model with the preset's sizes (overridden by `sizes`) to `path`."""
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {', '.join(ARCHES)}, got {arch!r}")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    unknown = set(sizes) - set(PRESETS[preset]) - {"sliding_window", *MOE_SIZES}
    if unknown:
        raise ValueError(f"unknown size argument(s): {', '.join(sorted(unknown))}")
    s = {**PRESETS[preset], **(MOE_SIZES if arch in MOE_ARCHES else {}), **sizes}
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _write_tokenizer(out, s["vocab_size"])
    _write_model(out, arch, seed, s, rope_scaling, dtype, tokenizer)
    return out


def _write_tokenizer(out: Path, vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(
            f"vocab_size must be >= {tok.get_vocab_size()} (the byte-level tokenizer), "
            f"got {vocab_size}"
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out, save_jinja_files=False)
    return fast


def _moe_config(arch: str, s: dict[str, Any]) -> dict[str, Any]:
    """The config fields of a mixture-of-experts `arch`; {} for a dense one. Mixtral's experts
    are intermediate_size wide; Qwen's half of it, with Qwen2-MoE's shared expert and one dense
    layer (the last, through mlp_only_layers) as intermediate_size."""
    if arch == "mixtral":
        return dict(
            num_local_experts=s["num_experts"], num_experts_per_tok=s["num_experts_per_tok"]
        )
    if arch not in ("qwen2_moe", "qwen3_moe"):
        return {}
    out = dict(
        num_experts=s["num_experts"],
        num_experts_per_tok=s["num_experts_per_tok"],
        moe_intermediate_size=s["intermediate_size"] // 2,
        norm_topk_prob=arch == "qwen3_moe",  # as Qwen3-30B-A3B; Qwen1.5-MoE does not
        decoder_sparse_step=1,
        mlp_only_layers=[s["num_layers"] - 1] if arch == "qwen2_moe" else [],
    )
    if arch == "qwen2_moe":
        out["shared_expert_intermediate_size"] = s["intermediate_size"]
    return out


def _window_config(arch: str, s: dict[str, Any]) -> dict[str, Any]:
    """Per-layer sliding windows when `sliding_window` is given: Gemma 2's and 3's on every other
    layer (Gemma 3's 5 in 6, shrunk to fit a few layers), Qwen's past max_window_layers."""
    window = s.get("sliding_window")
    layers = s["num_layers"]
    if arch in ("gemma2", "gemma3_text"):  # always slide; 4096 (the default) cuts no test
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return dict(sliding_window=window or 4096, layer_types=types)
    if arch in ("qwen2", "qwen3") and window:
        return dict(use_sliding_window=True, sliding_window=window, max_window_layers=layers // 2)
    return {}


def _write_model(
    out: Path,
    arch: str,
    seed: int,
    s: dict[str, Any],
    rope_scaling: str | None,
    dtype: str,
    tokenizer: Any,
) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    image_text, arch = arch, DECODER_ARCH.get(arch, arch)
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    kwargs: dict[str, Any] = dict(
        hidden_size=s["hidden_size"],
        num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"],
        intermediate_size=s["intermediate_size"],
        vocab_size=s["vocab_size"],
        max_position_embeddings=s["max_position_embeddings"],
        initializer_range=s["init_std"],
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=arch in ("qwen2", "qwen3", *GEMMA_ARCHES),
    )
    if arch in ("qwen3", "qwen3_moe", *GEMMA_ARCHES):
        # as Qwen3-0.6B: heads twice hidden_size / num_heads (Gemma's are wider than that too)
        kwargs["head_dim"] = 2 * s["hidden_size"] // s["num_heads"]
    if arch in ("mistral", "mixtral", "phi3"):
        kwargs["sliding_window"] = s.get("sliding_window")
    kwargs.update(_window_config(arch, s))
    if arch in ("gemma2", "gemma3_text"):  # their own score scale
        kwargs["query_pre_attn_scalar"] = s["hidden_size"] // s["num_heads"]
    if arch == "gemma3_text":  # as Gemma 3 4B: scaled global RoPE
        kwargs["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    if arch == "gemma2":  # caps small enough to bite on the wide init's scores and logits
        kwargs["attn_logit_softcapping"] = GEMMA2_SOFTCAPS[0]
        kwargs["final_logit_softcapping"] = GEMMA2_SOFTCAPS[1]
    if arch == "phi3":  # as Phi-4-mini: RoPE turns the first 3/4 of each head
        kwargs["partial_rotary_factor"] = 0.75
    kwargs.update(_moe_config(arch, s))
    if rope_scaling == "llama3":
        kwargs["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": max(64, s["max_position_embeddings"] // 8),
        }
    elif rope_scaling is not None:
        raise ValueError(f"rope_scaling must be None or 'llama3', got {rope_scaling!r}")
    config = AutoConfig.for_model(arch, **kwargs)
    if image_text != arch:  # 4 image tokens of a 2x2 grid of patches
        config = AutoConfig.for_model(
            image_text, text_config=config.to_dict(), vision_config=TINY_VISION,
            mm_tokens_per_image=4,
        )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch in GEMMA_ARCHES:
        # Their norms scale by (1 + w) and transformers starts w at 0, which leaves the scaled
        # embeddings to decide every greedy choice: random w makes attention count too.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, GEMMA_NORM_STD)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    summary = {"arch": image_text, "seed": seed, **s}
    (out / "phasefleet-tiny.json").write_text(json.dumps(summary) + "\n")
