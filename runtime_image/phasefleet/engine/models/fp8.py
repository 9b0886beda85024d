"""FP8 checkpoints, served by dequantizing their weights at load: each float8 weight times its
scales, in float32, which the loader then casts to the engine's dtype.

Two formats: compressed-tensors' float-quantized one (a scale per tensor, per output row or per
block: llm-compressor's FP8 and FP8-dynamic models), and the fine-grained `fp8` one (a scale per
128 x 128 block, `weight_scale_inv`: Qwen3's FP8 releases, DeepSeek-V3; without a block size, a
scale per tensor). The weights then take the engine dtype's memory, not the checkpoint's, and
activations are not quantized (a W8A8 checkpoint's activation and KV-cache scales are read past):
the answers are those of the checkpoint's own weights at 16 or 32 bits, as vLLM serves FP8
checkpoints on GPUs without FP8 arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

WEIGHT_SCALES = ("weight_scale", "weight_scale_inv")  # compressed-tensors' and fp8's names
UNUSED_SCALES = ("input_scale", "output_scale", "k_scale", "v_scale")  # activations, KV cache
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SERVED = (
    "unquantized checkpoints and FP8 ones (quant_method 'fp8', or 'compressed-tensors' with "
    "8-bit float weights in the float-quantized format)"
)
STRATEGIES = ("tensor", "channel", "block")  # compressed-tensors' weight strategies served


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's float8 weights are scaled: a scale per tensor or per output row, as
    each scale's shape says, or per block of `block` (rows, columns) where the format has one."""

    method: str  # "fp8" or "compressed-tensors"
    block: tuple[int, int] | None

    def describe(self) -> str:
        where = f"per {self.block[0]}x{self.block[1]} block" if self.block else "per tensor or row"
        return f"{self.method}, scales {where}"


def fp8_scheme(config: Any) -> Fp8Scheme | None:
    """The scheme of config.json's `quantization_config`; None for an unquantized checkpoint.
    Raises ValueError, naming the method and what is served, for any other quantization."""
    qc = getattr(config, "quantization_config", None)
    if not qc:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config.fmt {qc['fmt']!r} is not served; only e4m3")
        return Fp8Scheme("fp8", _block(qc.get("weight_block_size"), "weight_block_size"))
    if method == "compressed-tensors":
        return Fp8Scheme("compressed-tensors", _compressed_tensors_block(qc))
    raise ValueError(f"the checkpoint is quantized with {method!r}; PhaseFleet serves {SERVED}")


def _compressed_tensors_block(qc: dict[str, Any]) -> tuple[int, int] | None:
    blocks: set[tuple[int, int]] = set()
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        fmt = group.get("format") or qc.get("format")
        where = f"quantization_config.config_groups.{name}"
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(
                f"{where} quantizes weights to {weights.get('num_bits')}-bit "
                f"{weights.get('type')}; PhaseFleet serves {SERVED}"
            )
        if fmt != "float-quantized":
            raise ValueError(f"{where} is stored as {fmt!r}; PhaseFleet serves {SERVED}")
        strategy = weights.get("strategy")
        if strategy not in STRATEGIES:
            raise ValueError(
                f"{where}.weights.strategy {strategy!r} is not served; one of "
                f"{', '.join(STRATEGIES)}"
            )
        if strategy == "block":
            field = f"{where}.weights.block_structure"
            block = _block(weights.get("block_structure"), field)
            if block is None:
                raise ValueError(f"{field} is missing; the block strategy needs it")
            blocks.add(block)
    if len(blocks) > 1:
        raise ValueError(f"quantization_config has several block shapes {sorted(blocks)}")
    return blocks.pop() if blocks else None


def _block(value: Any, field: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise ValueError(f"{field} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def dequantized(
    folder: Path,
    checkpoint: Iterator[tuple[str, torch.Tensor]],
    scheme: Fp8Scheme | None,
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every float8 weight dequantized on `device` (float32) and
    the scales left out. Raises ValueError for a float8 weight without a scale, or in a
    checkpoint whose config names no FP8 scheme."""
    scales = _weight_scales(folder) if scheme is not None else {}
    for name, tensor in checkpoint:
        if scheme is not None and name.endswith(WEIGHT_SCALES + UNUSED_SCALES):
            continue
        if tensor.dtype not in FLOAT8:
            yield name, tensor
            continue
        if scheme is None:
            raise ValueError(
                f"{name} is {tensor.dtype} but config.json has no quantization_config to scale it"
            )
        scale = scales.get(f"{name}_scale", scales.get(f"{name}_scale_inv"))
        if scale is None:
            raise ValueError(f"{name} is {tensor.dtype} but the checkpoint has no scale for it")
        yield name, dequantize(tensor.to(device), scale.to(device), scheme.block, name)


def _weight_scales(folder: Path) -> dict[str, torch.Tensor]:
    """Every weight scale of the folder's *.safetensors files (small: one per tensor, row or
    block), read before the weights they scale."""
    scales: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name.endswith(WEIGHT_SCALES):
                    scales[name] = f.get_tensor(name)
    return scales


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, name: str
) -> torch.Tensor:
    """weight [out, in] in float8 times its scale: one value, [out] or [out, 1] (per row), or
    [ceil(out / rows), ceil(in / columns)] with `block` (the last block of each dimension may be
    partial) -> float32 [out, in]."""
    w = weight.to(torch.float32)  # a new tensor: scaled in place
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return w.mul_(s.reshape(()))
    rows_out, cols_in = w.shape
    if s.shape in ((rows_out,), (rows_out, 1)):
        return w.mul_(s.reshape(rows_out, 1))
    if block is not None:
        rows, cols = block
        grid = (-(-rows_out // rows), -(-cols_in // cols))
        if s.shape == grid and rows_out % rows == 0 and cols_in % cols == 0:
            w.view(grid[0], rows, grid[1], cols).mul_(s[:, None, :, None])
            return w
        if s.shape == grid:  # partial blocks at the edges
            per_row = s.repeat_interleave(rows, dim=0)[:rows_out]
            return w.mul_(per_row.repeat_interleave(cols, dim=1)[:, :cols_in])
    raise ValueError(
        f"the scale of {name} has shape {tuple(s.shape)}, which fits a weight of "
        f"{tuple(w.shape)} neither per tensor, per row nor per block "
        f"({'no block size in quantization_config' if block is None else f'blocks of {block}'})"
    )
