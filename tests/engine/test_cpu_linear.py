"""The oneDNN packed linears used on CPU: row buckets, results against F.linear, the choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phasefleet.engine.models.cpu_linear import (
    EXACT_ROWS,
    PackedLinear,
    choose_cpu_linear,
    pack_linears,
    padded_rows,
)

CPU = torch.device("cpu")


def test_padded_rows_are_exact_when_small_and_within_an_eighth_above() -> None:
    assert [padded_rows(r) for r in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))
    assert [padded_rows(r) for r in (17, 18, 19, 33, 65, 100, 2048, 2049)] == [
        18,
        18,
        20,
        36,
        72,
        104,
        2048,
        2304,
    ]
    for rows in range(1, 9000):
        padded = padded_rows(rows)
        assert rows <= padded < rows * 1.125 + 1
        assert padded_rows(padded) == padded  # a bucket pads to itself


def test_row_counts_up_to_2048_fall_in_few_buckets() -> None:
    # oneDNN caches 1024 primitives; 5 weight shapes x these buckets must fit with room to spare.
    assert len({padded_rows(r) for r in range(1, 2049)}) <= 80


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 17, 100])
def test_packed_linear_matches_f_linear(
    dtype: torch.dtype, tol: float, bias: bool, rows: int
) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    got = PackedLinear(weight, b)(x)
    assert got.shape == (rows, 96) and got.dtype == dtype
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_packed_linear_takes_a_non_contiguous_input() -> None:
    weight = torch.randn(32, 16)
    x = torch.randn(16, 6).t()  # [6, 16], transposed view
    torch.testing.assert_close(PackedLinear(weight, None)(x), F.linear(x, weight))


def test_pack_linears_replaces_nested_linears_only() -> None:
    inner = nn.Sequential(nn.ReLU(), nn.Linear(8, 4))
    model = nn.Sequential(nn.Linear(8, 8), inner)
    x = torch.randn(3, 8)
    want = model(x)
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(inner[1], PackedLinear)
    assert isinstance(inner[0], nn.ReLU)
    torch.testing.assert_close(model(x), want)


def test_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHASEFLEET_CPU_LINEAR", raising=False)
    assert choose_cpu_linear(CPU, torch.float32) == "onednn"
    assert choose_cpu_linear(CPU, torch.bfloat16) == "onednn"
    assert choose_cpu_linear(CPU, torch.float16) == "torch"  # not packed: falls back quietly
    assert choose_cpu_linear(torch.device("cuda"), torch.float32) == "torch"
    monkeypatch.setenv("PHASEFLEET_CPU_LINEAR", "torch")
    assert choose_cpu_linear(CPU, torch.float32) == "torch"
    monkeypatch.setenv("PHASEFLEET_CPU_LINEAR", "onednn")
    with pytest.raises(ValueError, match="not usable here: dtype torch.float16"):
        choose_cpu_linear(CPU, torch.float16)
    monkeypatch.setenv("PHASEFLEET_CPU_LINEAR", "mkl")
    with pytest.raises(ValueError, match="PHASEFLEET_CPU_LINEAR must be"):
        choose_cpu_linear(CPU, torch.float32)
