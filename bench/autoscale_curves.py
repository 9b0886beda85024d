"""The curves the autoscaling bench replays: an 8B Llama on one H100 SXM from its roofline
(`phasefleet.plan.curves.roofline` with its stated `Efficiency`; no GPU was used), and the bench
model on this CPU as bench/autoscale_measure.py measured it (bench/autoscale_cpu.json).
"""

from __future__ import annotations

from pathlib import Path

from phasefleet.plan.curves import Curves, ModelShape, measured, roofline
from phasefleet.plan.gpus import GPUS

CPU_JSON = Path(__file__).with_name("autoscale_cpu.json")

# Llama 3 8B: 32 layers, hidden 4096, 32 heads / 8 KV heads of 128, MLP 14336, vocab 128256, bf16
LLAMA_8B = ModelShape("8B Llama-shaped", 8.03e9, 32, 4096, 8, 128)
BENCH_KV_BYTES_PER_TOKEN = 12 * 4 * 64 * 2 * 4  # bench preset: layers x KV heads x dim x K,V x fp32
CPU_HANDOFF_BYTES_PER_S = 0.06e9  # the replay's own pulls in bench/RESULTS.md (run B)


def h100_8b() -> Curves:
    return roofline(LLAMA_8B, GPUS["h100"])


def cpu_curves(path: Path = CPU_JSON, clock: str = "cpu", max_num_seqs: int = 64) -> Curves:
    """The bench model on this CPU, one thread per worker, fitted to the steps' process CPU
    time (`clock="cpu"`) or wall time."""
    return measured(path, BENCH_KV_BYTES_PER_TOKEN, CPU_HANDOFF_BYTES_PER_S, clock, max_num_seqs)
