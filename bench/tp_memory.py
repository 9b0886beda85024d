"""Memory arithmetic for tensor parallelism: per GPU, the weights, the room left for the KV cache
and how many tokens of KV that holds, for a few models on the GPUs `phasefleet plan` knows, at
degrees 1 to 8 (docs/engine.md, "Memory arithmetic for tensor parallelism").

Assumptions: bf16 weights and KV; every weight split evenly over the ranks (the engine's
Megatron split, vocabulary included; the norms are replicated and too small to count); 10% of
the card kept for activations, CUDA graphs, NCCL buffers and the CUDA context; KV heads split
over the ranks, each rank keeping at least one (replicated when the degree exceeds the KV heads).

    .venv/bin/python bench/tp_memory.py
"""

from __future__ import annotations

from phasefleet.plan.curves import ModelShape
from phasefleet.plan.gpus import GPUS

RESERVE = 0.10  # of the card: activations, graphs, NCCL, context
DEGREES = (1, 2, 4, 8)
CONTEXT = 8192  # tokens: a long chat's context, to turn tokens into sequences
MODELS = (
    ModelShape("Llama-3-8B", 8.03e9, 32, 4096, 8, 128),
    ModelShape("Llama-3-70B", 70.55e9, 80, 8192, 8, 128),
    ModelShape("Mixtral-8x22B (MoE)", 140.6e9, 56, 6144, 8, 128),
)


def kv_heads_per_rank(model: ModelShape, degree: int) -> int:
    return max(1, model.kv_heads // degree)


def row(model: ModelShape, gpu: str, degree: int) -> str:
    card = GPUS[gpu].memory_bytes
    weights = model.params * model.dtype_bytes / degree
    budget = card * (1 - RESERVE) - weights
    per_token = model.layers * kv_heads_per_rank(model, degree) * model.head_dim * 2
    per_token *= model.dtype_bytes  # K and V
    label = f"| {model.name} | {GPUS[gpu].name} | {degree} | {weights / 1e9:.1f} |"
    if budget <= 0:
        return f"{label} does not fit | | | | |"
    worker = budget / per_token  # every token's KV is spread over all the worker's ranks
    return (
        f"{label} {budget / 1e9:.1f} | {per_token / 1024:.0f} | {worker / 1e3:,.0f}k"
        f" | {worker / degree / 1e3:,.0f}k | {worker / CONTEXT:,.0f} |"
    )


def main() -> None:
    print(
        "| model | GPU | degree | weights per GPU (GB) | KV room per GPU (GB)"
        " | KV per token per GPU (KiB) | KV tokens per worker | per GPU"
        f" | {CONTEXT // 1024}k-token sequences per worker |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model in MODELS:
        for gpu in ("h100", "h200"):
            for degree in DEGREES:
                print(row(model, gpu, degree))


if __name__ == "__main__":
    main()
