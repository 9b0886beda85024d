"""What each family changes in the decoder, read from its config: per-layer sliding windows,
Gemma's norms, scale and RoPE bases, an image-text folder's decoder, and clear refusals."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from phasefleet.engine.models.llama import RMSNorm
from phasefleet.engine.models.traits import decoder_config, load_decoder_config, model_traits


def config(model_type: str, **fields: object) -> Any:
    return AutoConfig.for_model(model_type, **{"num_hidden_layers": 4, **fields})


def test_windows_per_layer_follow_the_family() -> None:
    assert model_traits(config("mistral", sliding_window=8)).windows == (8, 8, 8, 8)
    assert model_traits(config("mistral", sliding_window=None)).windows == (None,) * 4
    # Qwen2 slides past max_window_layers only when use_sliding_window says so
    on = config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert model_traits(on).windows == (None, None, 8, 8)
    off = config("qwen2", use_sliding_window=False, sliding_window=8, max_window_layers=2)
    assert model_traits(off).windows == (None,) * 4
    llama = config("llama")
    assert model_traits(llama).windows == (None,) * 4


def test_gemma3_traits_match_its_config() -> None:
    # its own pattern: 5 sliding layers in 6
    gemma3 = config(
        "gemma3_text", num_hidden_layers=6, sliding_window=512, query_pre_attn_scalar=144,
        rope_local_base_freq=10000.0, head_dim=256,
    )  # fmt: skip
    traits = model_traits(gemma3)
    assert traits.windows == (512, 512, 512, 512, 512, None)
    assert traits.attn_scale == 144**-0.5  # not head_dim's
    assert traits.local_rope_theta == 10000.0
    assert traits.qk_norm and traits.norm_offset and traits.sandwich_norms and traits.embed_scale
    assert traits.activation == "gelu_tanh"
    gemma = model_traits(config("gemma", head_dim=64, hidden_act="gelu"))
    assert gemma.norm_offset and gemma.embed_scale and not gemma.sandwich_norms
    assert gemma.activation == "gelu" and gemma.local_rope_theta is None
    llama = model_traits(config("llama"))
    assert not (llama.norm_offset or llama.embed_scale or llama.qk_norm)
    assert llama.activation == "silu" and llama.final_softcap is None


def test_settings_we_do_not_implement_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="hidden activation 'relu2' is not supported"):
        model_traits(config("llama", hidden_act="relu2"))
    with pytest.raises(ValueError, match="use_bidirectional_attention=true is not supported"):
        model_traits(config("gemma3_text", use_bidirectional_attention=True))


def test_gemma2_caps_scores_and_logits_and_gemma3_does_not() -> None:
    gemma2 = model_traits(
        config("gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
               query_pre_attn_scalar=256, head_dim=128)
    )  # fmt: skip
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (50.0, 30.0)
    assert gemma2.attn_scale == 256**-0.5 and gemma2.sandwich_norms and not gemma2.qk_norm
    assert gemma2.windows == (4096, None, 4096, None)  # every other layer slides
    # transformers ignores a Gemma 3 config's attention cap: so do we
    gemma3 = model_traits(config("gemma3_text", attn_logit_softcapping=50.0))
    assert gemma3.attn_softcap is None


def test_another_model_type_is_refused_naming_what_is_supported() -> None:
    from phasefleet.engine.models.llama import CausalLM

    with (
        torch.device("meta"),
        pytest.raises(ValueError, match="'olmo2' is not supported; .*gemma3_text"),
    ):
        CausalLM(config("olmo2", hidden_size=64, num_attention_heads=4))


def test_an_image_text_folder_serves_its_text_config(
    tiny_model: Callable[[str], Path],
) -> None:
    folder = tiny_model("gemma3_vision")
    whole = AutoConfig.from_pretrained(folder)
    assert whole.model_type == "gemma3"
    decoder = load_decoder_config(folder)
    assert decoder.model_type == "gemma3_text" and decoder is not whole
    assert decoder.hidden_size == whole.text_config.hidden_size
    llama = config("llama")
    assert decoder_config(llama) is llama


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_offset_norm_is_gemmas_bit_for_bit(dtype: torch.dtype) -> None:
    """(1 + w) in float32, the product rounded once to the model's dtype, as transformers."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(0)
    theirs = Gemma3RMSNorm(64, eps=1e-6)
    ours = RMSNorm(64, 1e-6, offset=True)
    with torch.no_grad():
        theirs.weight.normal_(0, 0.5)
        ours.weight.copy_(theirs.weight)
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    ours.fold_offset()
    x = torch.randn(5, 64).to(dtype) * 3
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_and_k_heads_normalized_in_one_call_as_by_their_own_norms(
    dtype: torch.dtype, offset: bool
) -> None:
    """The layer folds q_norm's and k_norm's scales into one [q + k heads, head_dim] tensor:
    bit for bit each head through its own norm (Qwen3's, Gemma 3's)."""
    from phasefleet.engine.models.llama import rms_norm

    torch.manual_seed(0)
    heads, kv_heads, dim = 6, 2, 16
    q_norm, k_norm = RMSNorm(dim, 1e-6, offset), RMSNorm(dim, 1e-6, offset)
    with torch.no_grad():
        q_norm.weight.normal_(0, 0.5)
        k_norm.weight.normal_(1, 0.5)
    q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
    q_norm.fold_offset()
    k_norm.fold_offset()
    scale = torch.cat([q_norm.scale().expand(heads, -1), k_norm.scale().expand(kv_heads, -1)])
    qk = (torch.randn(5, heads + kv_heads, dim) * 3).to(dtype)
    each = torch.cat([q_norm(qk[:, :heads]), k_norm(qk[:, heads:])], dim=1)
    assert torch.equal(rms_norm(qk, scale, 1e-6, offset), each)
