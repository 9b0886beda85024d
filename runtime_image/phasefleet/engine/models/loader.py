"""Builds a CausalLM from a Hugging Face folder: config.json plus *.safetensors.

Each checkpoint tensor is read once and copied straight into its place: the fused q/k/v and
gate/up weights are allocated on the device in the model's dtype and filled slice by slice, the
others are moved (and cast) one at a time; a mixture-of-experts layer's experts go into its
stacked weights, expert by expert; checkpoints that name or fuse tensors otherwise (Mixtral,
Phi-3) are read through checkpoint.py, and an FP8 checkpoint's weights are dequantized as they
are read (fp8.py). The host never holds more than one tensor of the checkpoint, and nothing is
concatenated or cast after loading. A tensor-parallel rank reads the same files and keeps its
own slice of each tensor (parallel/shard.py).
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from phasefleet.engine.models.checkpoint import our_tensors
from phasefleet.engine.models.fp8 import dequantized, fp8_scheme
from phasefleet.engine.models.fused import FUSED_PARTS
from phasefleet.engine.models.llama import CausalLM
from phasefleet.engine.models.meta import no_init
from phasefleet.engine.models.rope import head_dim, rope_tables
from phasefleet.engine.parallel.group import TPGroup

logger = logging.getLogger(__name__)

IGNORED = ("rotary_emb.inv_freq",)  # old checkpoints store the rope frequencies
# ...layers.3.mlp.experts.7.gate_proj.weight: one expert's projection
_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class Place:
    """Where a checkpoint tensor goes: rows [start, start + shape[0]) of a fused parameter, or
    a whole parameter (start None); of its `expert`th matrix when the parameter stacks experts."""

    target: str
    shape: torch.Size
    start: int | None = None
    expert: int | None = None


def read_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's *.safetensors files, one at a time, on the host."""
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)


def places(unfused: dict[str, torch.Size]) -> dict[str, Place]:
    """Checkpoint name -> its Place in the fused model, from the unfused model's shapes."""
    out: dict[str, Place] = {}
    for name, shape in unfused.items():
        expert = _EXPERT.match(name)
        if expert is not None:  # moe.SparseMoeBlock stacks them: gate and up, then down
            block, index, projection = expert[1], int(expert[2]), expert[3]
            if projection == "down_proj":
                out[name] = Place(f"{block}.experts_down", shape, None, index)
            else:
                start = 0 if projection == "gate_proj" else shape[0]
                out[name] = Place(f"{block}.experts_gate_up", shape, start, index)
            continue
        module_name, _, param = name.rpartition(".")  # model.layers.0.self_attn.q_proj, weight
        parent, _, module = module_name.rpartition(".")
        for fused, parts in FUSED_PARTS.items():
            if module in parts:
                before = parts[: parts.index(module)]
                start = sum(unfused[f"{parent}.{p}.{param}"][0] for p in before)
                out[name] = Place(f"{parent}.{fused}.{param}", shape, start)
                break
        else:
            out[name] = Place(name, shape)
    return out


def load_model(
    folder: str | Path,
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TPGroup | None = None,
) -> CausalLM:
    """The fused model (this rank's part of it with `tp`) with the folder's weights in `dtype`
    on `device`, rope tables set. Raises ValueError when the weights do not match the config."""
    folder = Path(folder)
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"model folder {folder} has no *.safetensors files")
    scheme = fp8_scheme(config)
    if scheme is not None:
        logger.info(
            "FP8 checkpoint (%s): weights dequantized to %s at load, activations not quantized",
            scheme.describe(), dtype,
        )  # fmt: skip
    with torch.device("meta"), no_init():
        whole = {k: v.shape for k, v in CausalLM(config).state_dict().items()}
        model = CausalLM(config, tp)
        unfused = {k: v.shape for k, v in model.state_dict().items()}
        model.fuse()
    if model.tie_word_embeddings:
        unfused.pop("lm_head.weight", None)
    where = places(unfused)
    dim = head_dim(config)
    fused_shapes = {k: v.shape for k, v in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    unexpected: list[str] = []
    mismatch = f"weights in {folder} do not match {config.model_type}"
    checkpoint = dequantized(folder, read_checkpoint(folder), scheme, device)
    for stored, tensors in _our_tensors(checkpoint, config, mismatch):
        for name, tensor in tensors:
            place = where.get(name)
            if place is None:
                if not name.endswith(IGNORED) and not (
                    model.tie_word_embeddings and name == "lm_head.weight"
                ):
                    unexpected.append(stored)
                continue
            if tensor.shape != whole[name]:
                raise ValueError(
                    f"{mismatch}: {name} has shape {tuple(tensor.shape)}, the config makes it "
                    f"{tuple(whole[name])}"
                )
            if tp is not None:
                tensor = tp.shard.take(name, tensor, config, dim)
            _put(state, place, tensor, fused_shapes, device, dtype)
            seen.add(name)
    missing = sorted(set(where) - seen)
    if missing or unexpected:
        raise ValueError(
            f"weights in {folder} do not match {config.model_type}: "
            f"missing {missing[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=True, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)
    model.fold_norms()
    model.eval()
    cos, sin = rope_tables(config, max_positions)
    model.rope_cos = cos.to(device=device, dtype=dtype)
    model.rope_sin = sin.to(device=device, dtype=dtype)
    local_theta = model.traits.local_rope_theta
    if local_theta is not None:  # Gemma 3's windowed layers: their own base, unscaled
        local = copy.copy(config)
        local.rope_theta, local.rope_scaling = local_theta, None
        cos, sin = rope_tables(local, max_positions)
        model.local_rope = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
    return model


def _our_tensors(
    checkpoint: Iterator[tuple[str, torch.Tensor]], config: Any, mismatch: str
) -> Iterator[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """Each checkpoint tensor's name, with the tensors it holds in our names (checkpoint.py)."""
    for stored, tensor in checkpoint:
        try:
            yield stored, list(our_tensors(stored, tensor, config))
        except ValueError as exc:
            raise ValueError(f"{mismatch}: {exc}") from None


def _put(
    state: dict[str, torch.Tensor],
    place: Place,
    tensor: torch.Tensor,
    fused_shapes: dict[str, torch.Size],
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Puts a checkpoint tensor (this rank's part) in its place: a whole parameter moved and
    cast, or rows of a fused parameter (of one expert of a stacked one), allocated on first use."""
    if place.start is None and place.expert is None:
        state[place.target] = _to(tensor, device, dtype)
        return
    if place.target not in state:
        state[place.target] = torch.empty(fused_shapes[place.target], dtype=dtype, device=device)
    into = state[place.target]
    if place.expert is not None:
        into = into[place.expert]
    if place.start is not None:
        into = into[place.start : place.start + tensor.shape[0]]
    into.copy_(tensor.to(device))


def _to(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The checkpoint's bytes to the device, then cast there (a GPU casts faster than the host;
    on the host, a tensor already in place is not copied)."""
    return tensor.to(device).to(dtype)
