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
