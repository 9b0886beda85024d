"""LoRA adapters: several at once in one batch, each request with its own (or none).

An adapter is a PEFT folder (adapter_config.json, adapter_model.safetensors) trained on this
worker's base model. It lives in one of `max_loras` slots. Every adapted linear keeps all slots'
factors stacked, padded to `max_lora_rank`: A [slots * parts * R, in], B [out, slots * parts * R]
with the scale folded into B, where `parts` are the checkpoint projections a fused linear holds
(q, k, v). A token's delta is ((x @ A^T) * mask) @ B^T, the mask keeping its own slot's columns
only, so a batch that mixes adapters runs two small matmuls per linear, with fixed shapes (CUDA
graphs replay it) and no host sync. A token of a request without an adapter has slot -1: a zero
mask. A step in which no token has an adapter skips the deltas.

The KV of a prompt depends on its adapter: requests with an adapter hash their blocks from the
adapter's `prefix_salt`, so they never share prefix-cache blocks with another adapter or the
base model.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from phasefleet.engine.models.moe import SparseMoeBlock

# fused linear -> the checkpoint projections whose outputs it concatenates, in order
ADAPTED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
PART_OF = {part: (fused, i) for fused, parts in ADAPTED.items() for i, part in enumerate(parts)}
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
NO_SLOT = -1  # a token without an adapter
# ...layers.3.self_attn.q_proj.lora_A.weight (PEFT may keep the adapter's name before .weight)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoraError(ValueError):
    """An adapter this worker cannot serve; the message names the adapter and the fix."""


def prefix_salt(name: str, generation: int = 0) -> int:
    """The root of an adapter's block hashes: a 128-bit hash of its name and of how many times
    an adapter of that name was loaded before (one loaded again may have other weights)."""
    key = f"{name}\0{generation}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "little")


@dataclass
class LoraAdapter:
    """One adapter read from its folder: per (layer, projection) its A [r, in] and scaled
    B [out, r], on the host."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(name: str, folder: str | Path) -> LoraAdapter:
    """Reads a PEFT LoRA folder; LoraError for what this engine does not run (DoRA, biases,
    extra trained modules, per-module ranks, targets other than the attention and MLP
    projections)."""
    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_FILE, folder / ADAPTER_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise LoraError(
            f"LoRA adapter {name!r}: {folder} must hold {CONFIG_FILE} and {ADAPTER_FILE} "
            "(a PEFT adapter saved with save_pretrained)"
        )
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type must be LORA, got {config['peft_type']}")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    if any(unsupported.values()):
        fields = ", ".join(k for k, v in unsupported.items() if v)
        raise LoraError(f"LoRA adapter {name!r}: {fields} is not supported")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    factors: dict[tuple[int, str, str], torch.Tensor] = {}
    with safe_open(str(weights_path), framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            match = _KEY.search(key)
            if match is None or match.group(2) not in PART_OF:
                raise LoraError(
                    f"LoRA adapter {name!r}: {key} is not supported; adapters may target "
                    f"{', '.join(PART_OF)}"
                )
            layer, part, which = int(match.group(1)), match.group(2), match.group(3)
            factors[(layer, part, which)] = f.get_tensor(key).float()
    weights = {}
    for (layer, part, which), a in factors.items():
        if which != "A":
            continue
        b = factors.get((layer, part, "B"))
        if b is None:
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {part} has lora_A, no lora_B")
        weights[(layer, part)] = (a, b * scale)
    if not weights:
        raise LoraError(f"LoRA adapter {name!r}: {ADAPTER_FILE} holds no LoRA weights")
    return LoraAdapter(name, rank, weights)


@dataclass(frozen=True)
class LoadedAdapter:
    slot: int  # its columns in every LoraLinear
    salt: int  # the root of its requests' prefix-cache block hashes (prefix_salt)


class LoraStep:
    """The adapter slot of each token of the current step, in a fixed device buffer (filled
    before every forward; CUDA graphs read the same memory)."""

    def __init__(self, max_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.token_slots = torch.full((max_tokens,), NO_SLOT, dtype=torch.long, device=device)
        self.active = False  # some token of the step has an adapter (known on the host)
        # the slots the step's tokens use, known on the host; None: any (a graph's step)
        self.used: list[int] | None = None
        # per used slot, [T, 1]: its tokens 1, the others 0; None where every token has it
        self.masks: dict[int, torch.Tensor | None] = {}

    def set(self, slots: torch.Tensor, used: list[int] | None, uniform: bool = False) -> None:
        """slots: [T] long on the device; `used`: the distinct slots among them, or None for
        a graph's step (it runs every slot); `uniform`: every token has the one used slot.
        The slots are copied even when no token has an adapter: a captured graph reads them
        whatever the flags say."""
        self.active = used is None or bool(used)
        self.used = used
        self.token_slots[: slots.shape[0]].copy_(slots, non_blocking=True)
        self.masks = {
            slot: None if uniform else (slots == slot).unsqueeze(1).to(self.dtype)
            for slot in used or ()
        }


class LoraLinear(nn.Module):
    """A linear plus every slot's LoRA delta for its tokens."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        part_sizes: list[int],
        max_loras: int,
        max_rank: int,
        step: LoraStep,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.step = step
        self.part_sizes = part_sizes
        self.max_rank, self.max_loras = max_rank, max_loras
        per_slot = self.per_slot = len(part_sizes) * max_rank  # columns of one slot
        width = max_loras * per_slot
        self.lora_a: torch.Tensor  # [width, in]
        self.lora_b: torch.Tensor  # [out, width]
        self.column_slot: torch.Tensor  # [width]: the slot each column belongs to
        self.register_buffer("lora_a", torch.zeros(width, in_features, dtype=dtype, device=device))
        self.register_buffer(
            "lora_b", torch.zeros(sum(part_sizes), width, dtype=dtype, device=device)
        )
        self.register_buffer("column_slot", torch.arange(width, device=device) // per_slot)

    def set_part(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """a: [r, in], b: [out_part, r] (scaled)."""
        rank = a.shape[0]
        col = (slot * len(self.part_sizes) + part) * self.max_rank
        row = sum(self.part_sizes[:part])
        self.lora_a[col : col + rank] = a.to(self.lora_a)
        self.lora_b[row : row + self.part_sizes[part], col : col + rank] = b.to(self.lora_b)

    def clear(self, slot: int) -> None:
        cols = slice(slot * self.per_slot, (slot + 1) * self.per_slot)
        self.lora_a[cols] = 0
        self.lora_b[:, cols] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]."""
        out: torch.Tensor = self.base(x)
        if not self.step.active:
            return out
        slots = self.step.token_slots[: x.shape[0]]
        used = self.step.used
        if used is None or 2 * len(used) > self.max_loras:
            mask = (slots.unsqueeze(1) == self.column_slot).to(x.dtype)  # [T, width]
            return out + ((x @ self.lora_a.t()) * mask) @ self.lora_b.t()
        for slot in used:  # few slots in use: only their columns
            cols = slice(slot * self.per_slot, (slot + 1) * self.per_slot)
            low = x @ self.lora_a[cols].t()  # [T, per_slot]
            mine = self.step.masks[slot]
            if mine is not None:
                low = low * mine
            out = out + low @ self.lora_b[:, cols].t()
        return out


class LoraSet:
    """The adapters loaded into a model, by name, each in a slot of every LoraLinear."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_tokens: int) -> None:
        """Wraps the model's adapted linears (after fusing and CPU packing)."""
        if max_loras < 1 or max_rank < 1:
            raise ValueError(
                f"max_loras and max_lora_rank must be >= 1, got {max_loras}, {max_rank}"
            )
        self.max_loras, self.max_rank = max_loras, max_rank
        weight = next(model.parameters())
        self.step = LoraStep(max_tokens, weight.device, weight.dtype)
        self.linears: dict[tuple[int, str], LoraLinear] = {}
        self.num_layers = len(model.model.layers)  # type: ignore[union-attr,arg-type]
        for index, layer in enumerate(model.model.layers):  # type: ignore[union-attr,arg-type]
            for holder in (layer.self_attn, layer.mlp):
                if isinstance(holder, SparseMoeBlock):
                    continue  # experts are not adapted: an adapter's MLP parts there are refused
                for fused, (in_features, sizes) in _shapes(model.config, holder).items():
                    wrapped = LoraLinear(
                        getattr(holder, fused), in_features, sizes, max_loras, max_rank,
                        self.step, weight.dtype, weight.device,
                    )  # fmt: skip
                    setattr(holder, fused, wrapped)
                    self.linears[(index, fused)] = wrapped
        self.loaded: dict[str, LoadedAdapter] = {}
        self.loads = 0  # adapters loaded so far: each load's blocks are salted apart

    def load(self, adapter: LoraAdapter) -> LoadedAdapter:
        """Puts an adapter in a free slot (every slot's columns are zero until then: `unload`
        clears them). LoraError when it does not fit."""
        if adapter.name in self.loaded:
            raise LoraError(f"LoRA adapter {adapter.name!r} is already loaded")
        free = sorted(set(range(self.max_loras)) - {a.slot for a in self.loaded.values()})
        if not free:
            raise LoraError(
                f"LoRA adapter {adapter.name!r}: all {self.max_loras} slots are taken "
                "(raise --max-loras)"
            )
        if adapter.rank > self.max_rank:
            raise LoraError(
                f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, more than "
                f"--max-lora-rank {self.max_rank}"
            )
        for (layer, part), (a, b) in adapter.weights.items():
            fused, index = PART_OF[part]
            linear = self.linears.get((layer, fused))
            if linear is None and layer >= self.num_layers:
                raise LoraError(f"LoRA adapter {adapter.name!r}: the model has no layer {layer}")
            if linear is None:
                raise LoraError(
                    f"LoRA adapter {adapter.name!r}: layer {layer} has experts, not one {part} "
                    "(mixture-of-experts layers take adapters on attention only)"
                )
            want = (linear.part_sizes[index], linear.lora_a.shape[1])
            if (b.shape[0], a.shape[1]) != want:
                raise LoraError(
                    f"LoRA adapter {adapter.name!r}: layer {layer} {part} is "
                    f"{a.shape[1]}->{b.shape[0]}, the model's is {want[1]}->{want[0]}: "
                    "it was trained on another base model"
                )
        slot = free[0]
        for (layer, part), (a, b) in adapter.weights.items():
            fused, index = PART_OF[part]
            self.linears[(layer, fused)].set_part(slot, index, a, b)
        self.loads += 1
        loaded = LoadedAdapter(slot, prefix_salt(adapter.name, self.loads))
        self.loaded[adapter.name] = loaded
        return loaded

    def unload(self, name: str) -> None:
        """Empties an adapter's slot (no running request may use it: the caller checks)."""
        slot = self.get(name).slot
        for linear in self.linears.values():
            linear.clear(slot)
        del self.loaded[name]

    def get(self, name: str) -> LoadedAdapter:
        if name not in self.loaded:
            raise LoraError(f"LoRA adapter {name!r} is not loaded")
        return self.loaded[name]


def _shapes(config: Any, holder: nn.Module) -> dict[str, tuple[int, list[int]]]:
    """The adapted linears of an attention or MLP module: fused name -> (input features, output
    rows of each checkpoint projection it holds)."""
    hidden = int(config.hidden_size)
    if hasattr(holder, "num_kv_heads"):  # attention
        q = int(holder.num_heads * holder.head_dim)  # type: ignore[operator]
        kv = int(holder.num_kv_heads * holder.head_dim)  # type: ignore[operator]
        return {"qkv_proj": (hidden, [q, kv, kv]), "o_proj": (q, [hidden])}
    inter = int(config.intermediate_size)
    return {"gate_up_proj": (hidden, [inter, inter]), "down_proj": (inter, [hidden])}
