"""One replica's speed, as the simulators read it: prefill seconds for a prompt, decode step
seconds for a batch, KV capacity, batch limit, start-up time and the KV hand-off.

`roofline(model, gpu)` derives them from a model's shape and a GPU's published bandwidth and
FLOP/s, with the efficiency factors of `Efficiency` (assumptions until a GPU measures them:
bench/gpu_check.py). Curves measured on a CPU come from bench/autoscale_measure.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from phasefleet.engine.models.moe_shape import MOE_MODEL_TYPES, is_moe_layer, moe_shape
from phasefleet.plan.gpus import Gpu


@dataclass(frozen=True)
class Curves:
    name: str
    prefill: tuple[float, float, float]  # seconds = a + b n + c n^2, n prompt tokens
    decode: tuple[float, float, float]  # step seconds = d0 + d1 batch + d2 kv_tokens (sum)
    kv_capacity_tokens: int  # KV cache of one replica, tokens
    max_num_seqs: int  # requests in one decode batch
    startup_s: float  # process start (or pod scheduled) to serving
    handoff_bytes_per_s: float  # KV hand-off bandwidth between a prefill and a decode replica
    kv_bytes_per_token: int
    chunk_tokens: int = 2048  # the prefill's chunk (the engine's max_num_batched_tokens)
    streamed: bool = True  # each chunk's KV is sent as it is computed (False: pulled after)
    first_token_waits_for_kv: bool = False  # the client gets token 1 once the KV has landed
    layer_groups: int = 1  # streamed: a chunk's KV goes in this many pieces during its pass

    def prefill_s(self, tokens: float, cached: float = 0.0) -> float:
        """A prompt of `tokens` whose first `cached` are in the prefix cache: only the rest is
        computed, each attending to every token before it."""
        a, b, c = self.prefill
        return a + b * (tokens - cached) + c * (tokens * tokens - cached * cached)

    def decode_step_s(self, batch: float, kv_tokens: float) -> float:
        d0, d1, d2 = self.decode
        return d0 + d1 * batch + d2 * kv_tokens

    def handoff_s(self, prompt_tokens: float, cached: float = 0.0) -> float:
        """Seconds from the first token until the prompt's KV is on the decode replica.
        Pulled: the whole prompt's KV, sent after the prefill. Streamed: the `cached` prefix's
        KV at once, then chunk k's when chunk k is computed (chunk k finishes at prefill_s of
        the prompt so far), behind the chunks before it on the link; what remains after the
        last chunk is the tail. With `layer_groups` G, each 1/G of a chunk's layers is sent as
        soon as the forward pass is through it (the pass takes the chunk's time evenly over
        its layers)."""
        per_token = self.kv_bytes_per_token / self.handoff_bytes_per_s
        if not self.streamed:
            return prompt_tokens * per_token
        groups = self.layer_groups
        done, sent, began = cached, cached * per_token, 0.0
        while done < prompt_tokens:
            chunk = min(self.chunk_tokens, prompt_tokens - done)
            done += chunk
            ended = self.prefill_s(done, cached)
            for g in range(1, groups + 1):
                ready = began + (ended - began) * g / groups
                sent = max(sent, ready) + chunk * per_token / groups
            began = ended
        return max(0.0, sent - self.prefill_s(prompt_tokens, cached))


@dataclass(frozen=True)
class Efficiency:
    prefill_mfu: float = 0.5  # share of peak bf16 FLOP/s a prefill step reaches
    decode_hbm_efficiency: float = 0.8  # share of HBM bandwidth a decode step reaches
    decode_mfu: float = 0.35  # compute side of a large decode batch
    step_overhead_s: float = 0.004  # scheduling, sampling, launch per step (CUDA graphs on)
    gpu_memory_utilization: float = 0.9  # of the GPU's memory, as vLLM's default
    activation_overhead_bytes: float = 4e9  # activations, CUDA graphs, allocator slack
    max_num_seqs: int = 256
    startup_s: float = 60.0  # assumed: pod start, weights from local NVMe, CUDA graphs


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    active_params: float | None = None  # a mixture of experts': those one token runs through
    kv_dtype_bytes: int | None = None  # the KV pool's element, when not the model's (fp8: 1)

    @property
    def flop_params(self) -> float:
        """The parameters a token's FLOPs scale with (2 FLOPs each)."""
        return self.params if self.active_params is None else self.active_params

    @property
    def kv_bytes_per_token(self) -> int:
        element = self.kv_dtype_bytes or self.dtype_bytes
        return self.layers * self.kv_heads * self.head_dim * 2 * element

    @classmethod
    def from_config(cls, path: Path) -> ModelShape:
        """A Llama-style decoder (or a mixture of experts of that shape: Mixtral, Qwen's MoE
        models) from its Hugging Face config.json (or the folder holding it); ValueError naming
        a missing field."""
        file = path / "config.json" if path.is_dir() else path
        config = _decoder_fields(json.loads(file.read_text()))
        try:
            hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
            heads, mlp = int(config["num_attention_heads"]), int(config["intermediate_size"])
            vocab = int(config["vocab_size"])
        except KeyError as exc:
            raise ValueError(f"{file}: no {exc.args[0]} (a Llama-style config is needed)") from None
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o, k, v
        embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
        params = active = layers * attention + embeddings
        moe = _moe(config, file)
        for layer in range(layers):
            if moe is None or not is_moe_layer(moe, layer):
                params, active = params + 3 * hidden * mlp, active + 3 * hidden * mlp
                continue
            shape = moe_shape(moe)
            assert shape is not None
            router = hidden * shape.experts + (hidden if shape.shared_width else 0)
            shared = 3 * hidden * shape.shared_width + router
            params += 3 * hidden * shape.width * shape.experts + shared
            active += 3 * hidden * shape.width * shape.top_k + shared
        dtype = 4 if str(config.get("torch_dtype", "bfloat16")) == "float32" else 2
        name = str(config.get("_name_or_path") or file.parent.name or "model")
        return cls(
            name, float(params), layers, hidden, kv_heads, head_dim, dtype,
            active_params=None if moe is None else float(active),
        )  # fmt: skip


# Gemma3TextConfig's defaults, which the released Gemma 3 4B config leaves to it
GEMMA3_TEXT_DEFAULTS = dict(
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208,
    tie_word_embeddings=True,
)  # fmt: skip


def _decoder_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of the decoder a worker serves: an image-text config's text_config (Gemma 3
    4B and up; the vision tower is not served), keeping the checkpoint's dtype."""
    text = config.get("text_config")
    if not isinstance(text, dict) or "hidden_size" in config:
        return config
    dtype = {"torch_dtype": config["torch_dtype"]} if "torch_dtype" in config else {}
    defaults = GEMMA3_TEXT_DEFAULTS if text.get("model_type") == "gemma3_text" else {}
    return {**defaults, **dtype, **text}


def _moe(config: dict[str, object], file: Path) -> SimpleNamespace | None:
    """The config as moe_shape reads it, for a mixture-of-experts model; None for a dense one."""
    if config.get("model_type") not in MOE_MODEL_TYPES:
        return None
    namespace = SimpleNamespace(**config)
    try:
        moe_shape(namespace)
    except AttributeError as exc:
        raise ValueError(f"{file}: no {exc.name} (a mixture-of-experts config needs it)") from None
    return namespace


def roofline(model: ModelShape, gpu: Gpu, eff: Efficiency = Efficiency()) -> Curves:
    """Prefill is compute-bound (2 x params FLOPs per token plus causal attention; a mixture of
    experts' active params); a decode step reads every weight and the batch's KV once
    (memory-bound; pessimistic for a mixture of experts at small batches, which reads only the
    chosen experts), with the batch's FLOPs as a second term that only matters for large
    batches of short contexts. ValueError when the weights leave no room for KV."""
    prefill_flops = gpu.bf16_flops * eff.prefill_mfu
    per_token = 2 * model.flop_params / prefill_flops
    # causal attention: QK^T and PV, 2 x 2 x n^2/2 x hidden FLOPs per layer
    per_token_sq = 2 * model.layers * model.hidden / prefill_flops
    hbm = gpu.hbm_bytes_per_s * eff.decode_hbm_efficiency
    weights = model.dtype_bytes * model.params
    free = gpu.memory_bytes * eff.gpu_memory_utilization - weights - eff.activation_overhead_bytes
    if free <= 0:
        raise ValueError(
            f"{model.name}: {weights / 1e9:.0f} GB of weights leave no KV cache on one "
            f"{gpu.name}; it needs tensor parallelism"
        )
    # step = overhead + weights / hbm + kv bytes / hbm + 2 x params FLOPs per sequence at
    # decode_mfu: the terms are added, not overlapped (pessimistic for large batches)
    per_seq = 2 * model.flop_params / (gpu.bf16_flops * eff.decode_mfu)
    kv = model.kv_bytes_per_token
    kv_pool = ", float8 KV" if model.kv_dtype_bytes == 1 else ""
    return Curves(
        name=f"{model.name} on {gpu.name} (roofline{kv_pool})",
        prefill=(eff.step_overhead_s, per_token, per_token_sq),
        decode=(eff.step_overhead_s + weights / hbm, per_seq, kv / hbm),
        kv_capacity_tokens=int(free // kv),
        max_num_seqs=eff.max_num_seqs,
        startup_s=eff.startup_s,
        handoff_bytes_per_s=gpu.link_bytes_per_s,
        kv_bytes_per_token=kv,
    )


def fit_prefill(tokens: np.ndarray, seconds: np.ndarray) -> tuple[float, float, float]:
    """Least squares of seconds = a + b n + c n^2 with c >= 0 (else a straight line)."""
    design = np.stack([np.ones_like(tokens), tokens, tokens * tokens], axis=1)
    coef = np.linalg.lstsq(design, seconds, rcond=None)[0]
    if coef[2] < 0:
        coef = np.append(np.linalg.lstsq(design[:, :2], seconds, rcond=None)[0], 0.0)
    return float(coef[0]), float(coef[1]), float(coef[2])


def fit_decode(
    batch: np.ndarray, kv: np.ndarray, seconds: np.ndarray
) -> tuple[float, float, float]:
    """Least squares of step seconds = d0 + d1 batch + d2 kv_tokens."""
    design = np.stack([np.ones_like(batch), batch, kv], axis=1)
    coef = np.linalg.lstsq(design, seconds, rcond=None)[0]
    return float(coef[0]), float(coef[1]), float(coef[2])


def measured(
    path: Path,
    kv_bytes_per_token: int,
    handoff_bytes_per_s: float,
    clock: str = "cpu",
    max_num_seqs: int = 64,
) -> Curves:
    """Curves fitted to what bench/autoscale_measure.py measured of our engine (its JSON): the
    steps' process CPU time (`clock="cpu"`: what the engine costs, without the time slices
    other processes took) or wall time (what they took while measured)."""
    m = json.loads(path.read_text())
    prefill = {int(n): s for n, s in m[f"prefill_{clock}_s"].items()}
    points = [(k.split("x"), s) for k, s in m[f"decode_step_{clock}_s"].items()]
    batch = np.array([float(b) for (b, _), _ in points])
    kv = np.array([float(b) * (float(c) + m["decode_steps"] / 2) for (b, c), _ in points])
    return Curves(
        name=f"{m.get('model', path.stem)}, measured ({clock} time, {m.get('threads', 1)} thread)",
        prefill=fit_prefill(np.array(list(prefill), float), np.array(list(prefill.values()))),
        decode=fit_decode(batch, kv, np.array([s for _, s in points])),
        kv_capacity_tokens=int(m["kv_capacity_tokens"]),
        max_num_seqs=max_num_seqs,
        startup_s=float(np.median(m["startup_s"])),
        handoff_bytes_per_s=handoff_bytes_per_s,
        kv_bytes_per_token=kv_bytes_per_token,
    )
