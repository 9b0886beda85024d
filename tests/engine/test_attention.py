"""The decode attention kernels of the torch path against scaled_dot_product_attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phasefleet.engine.attention.metadata import decode_mask, mask_to_bias
from phasefleet.engine.attention.torch_paged import grouped_decode_attention


def test_mask_to_bias() -> None:
    mask = torch.tensor([[True, False, True]])
    assert mask_to_bias(mask).tolist() == [[0.0, float("-inf"), 0.0]]
    assert mask_to_bias(mask).dtype == torch.float32


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("window", [None, 5])
def test_grouped_decode_attention_matches_sdpa(
    dtype: torch.dtype, tol: float, window: int | None
) -> None:
    n, heads, kv_heads, keys_len, dim = 3, 6, 2, 24, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    # Keys as the pool gather leaves them: [n, S, Hkv, D] seen as [n, Hkv, S, D] (not contiguous).
    k = torch.randn(n, keys_len, kv_heads, dim, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(n, keys_len, kv_heads, dim, generator=gen).to(dtype).transpose(1, 2)
    mask = decode_mask(torch.tensor([24, 9, 1]), keys_len, window)
    got = grouped_decode_attention(q, k, v, mask_to_bias(mask), scale=0.25)
    want = F.scaled_dot_product_attention(
        q.float().unsqueeze(2), k.float(), v.float(), attn_mask=mask, scale=0.25, enable_gqa=True
    ).squeeze(2)
    assert got.shape == (n, heads, dim) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_grouped_decode_attention_caps_scores_before_the_mask() -> None:
    """Gemma 2's softcapping: cap * tanh(scores / cap), then the mask, then softmax."""
    n, heads, kv_heads, keys_len, dim, cap = 2, 4, 2, 10, 16, 1.5
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(n, kv_heads, keys_len, dim, generator=gen)
    v = torch.randn(n, kv_heads, keys_len, dim, generator=gen)
    mask = decode_mask(torch.tensor([10, 4]), keys_len, None)
    got = grouped_decode_attention(q, k, v, mask_to_bias(mask), scale=0.5, softcap=cap)
    expand = {"dim": 1, "repeats": heads // kv_heads}
    scores = q.unsqueeze(2) @ k.repeat_interleave(**expand).transpose(-1, -2) * 0.5
    capped = (torch.tanh(scores / cap) * cap).masked_fill(~mask, float("-inf"))
    want = (capped.softmax(-1) @ v.repeat_interleave(**expand)).squeeze(2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    uncapped = grouped_decode_attention(q, k, v, mask_to_bias(mask), scale=0.5)
    assert not torch.allclose(uncapped, want, atol=1e-2)
