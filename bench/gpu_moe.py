"""GPU check `moe_30b`: our engine on a Qwen3-30B-A3B-shaped mixture of experts (random bf16
weights made on the device) against the device's own limits, measured in the same run.

A decode step reads the weights outside the experts, and of each layer's experts those its
batch's tokens chose: with random routing E x (1 - (1 - k/E)^B) of E for B tokens. Over the
bandwidth of a large device copy that is the step's roofline; the step's time (wall, and the
device alone by replaying its CUDA graph) is compared with it at B = 1, 8 and 64, with the
expert path each batch takes (models/moe.py: "gathered" copies the chosen experts, "every" runs
all of them, both graph-captured). A 2048-token prefill ("sorted": each expert on its own rows)
is compared with the FLOP/s of a large bf16 matmul, counting the active parameters' FLOPs.
--quick: two small layers (8 experts, 2 per token) on the CPU.
"""

from __future__ import annotations

import time
from typing import Any

from gpu_models import qwen3_moe_config
from gpu_report import CheckContext, Status
from gpu_roofline import BATCHES, GIB, decode_batch, device_peaks, load_random, prefill

from phasefleet.engine.config import MAX_GRAPH_BATCH
from phasefleet.engine.models.moe import choose_path
from phasefleet.engine.models.moe_shape import MoeShape, moe_shape


def expected_experts(shape: MoeShape, tokens: int) -> float:
    """Distinct experts `tokens` tokens choose in one layer when each picks k of E at random."""
    return shape.experts * (1 - (1 - shape.top_k / shape.experts) ** tokens)


def parameter_counts(config: Any, shape: MoeShape) -> tuple[int, int, int]:
    """(weights outside the experts that a decode step reads, one expert's weights, the
    active parameters of one token's FLOPs)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + hidden * shape.experts  # + the router
    per_layer += 2 * hidden + 2 * config.head_dim  # norms
    outside = layers * per_layer + hidden * (1 + config.vocab_size)  # final norm, lm_head
    expert = 3 * hidden * shape.width
    active = outside + layers * shape.top_k * expert
    return outside, expert, active


def moe_30b(ctx: CheckContext, data: dict[str, Any]) -> tuple[Status, str]:
    cuda = ctx.device == "cuda"
    peaks = device_peaks(ctx.device, ctx.quick)
    data["peaks"] = peaks
    eng = load_random(ctx, qwen3_moe_config(ctx), data)
    runner, config = eng.runner, eng.hf_config
    shape = moe_shape(config)
    assert shape is not None
    data["kv_after_load_gib"] = eng.stats().num_free_blocks * runner.block_bytes() / GIB
    if cuda and runner.decode_backend == "triton":  # as LLMEngine enables them
        started = time.perf_counter()
        runner.enable_decode_graphs(min(max(BATCHES), MAX_GRAPH_BATCH))
        data["graph_capture_seconds"] = time.perf_counter() - started
    outside, expert, active = parameter_counts(config, shape)
    element = runner.dtype.itemsize
    data.update(outside_params=outside, expert_params=expert, active_params=active)
    kv_per_token = runner.block_bytes() // runner.block_size
    bandwidth = peaks["copy_bytes_per_s"]
    rows = []
    for b in BATCHES:
        row = decode_batch(eng, b, 1024 if not ctx.quick else 32, cuda, kv_per_token)
        row["path"] = choose_path(b, shape, cuda)
        row["experts_read"] = expected_experts(shape, b)
        weights = outside + config.num_hidden_layers * row["experts_read"] * expert
        row["roofline_ms"] = 1000 * (weights * element + row["kv_bytes_read"]) / bandwidth
        row["roofline_fraction_wall"] = row["roofline_ms"] / row["wall_ms"]
        if row.get("device_ms"):
            row["roofline_fraction_device"] = row["roofline_ms"] / row["device_ms"]
        rows.append(row)
        data["decode"] = rows
    tokens = 2048 if not ctx.quick else 128
    seconds = prefill(eng, tokens, cuda)
    flops = 2 * tokens * active
    flops += (
        2
        * tokens
        * tokens
        * config.num_attention_heads
        * config.head_dim
        * (config.num_hidden_layers)
    )  # causal QK^T and PV
    data["prefill"] = {
        "tokens": tokens,
        "seconds": seconds,
        "path": choose_path(tokens, shape, cuda),
        "flops_per_s": flops / seconds,
        "matmul_fraction": flops / seconds / peaks["matmul_flops_per_s"],
    }
    which = "roofline_fraction_device" if cuda else "roofline_fraction_wall"
    parts = [f"b={r['batch']} ({r['path']}) {r.get(which, 0):.2f}" for r in rows]
    summary = (
        f"decode at {', '.join(parts)} of the roofline of the experts read "
        f"({'device' if cuda else 'wall'} time); {tokens}-token prefill "
        f"{data['prefill']['matmul_fraction']:.2f} of matmul FLOP/s"
    )
    return (Status.OK if cuda else Status.NOT_APPLICABLE), summary
