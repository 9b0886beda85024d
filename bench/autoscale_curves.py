"""One replica's speed, as the autoscaling simulator reads it: prefill seconds for a prompt,
decode step seconds for a batch, KV capacity, batch limit and start-up time.

Two sources: `cpu_curves()` reads what bench/autoscale_measure.py measured on our engine on this
CPU (bench/autoscale_cpu.json); `h100_8b()` derives an 8B Llama-shaped model on one H100 SXM
from its roofline, with the efficiency factors stated in `H100_ASSUMPTIONS`. No GPU was used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CPU_JSON = Path(__file__).with_name("autoscale_cpu.json")


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

    def prefill_s(self, tokens: float) -> float:
        a, b, c = self.prefill
        return a + b * tokens + c * tokens * tokens

    def decode_step_s(self, batch: float, kv_tokens: float) -> float:
        d0, d1, d2 = self.decode
        return d0 + d1 * batch + d2 * kv_tokens

    def handoff_s(self, prompt_tokens: float) -> float:
        """Seconds from the first token until the prompt's KV is on the decode replica.
        Pulled: the whole prompt's KV, sent after the prefill. Streamed: chunk k's KV is sent
        when chunk k is computed (chunk k finishes at prefill_s of the prompt so far), behind
        the chunks before it on the link; what remains after the last chunk is the tail. With
        `layer_groups` G, each 1/G of a chunk's layers is sent as soon as the forward pass is
        through it (the pass takes the chunk's time evenly over its layers)."""
        per_token = self.kv_bytes_per_token / self.handoff_bytes_per_s
        if not self.streamed:
            return prompt_tokens * per_token
        groups = self.layer_groups
        done = sent = began = 0.0
        while done < prompt_tokens:
            chunk = min(self.chunk_tokens, prompt_tokens - done)
            done += chunk
            ended = self.prefill_s(done)
            for g in range(1, groups + 1):
                ready = began + (ended - began) * g / groups
                sent = max(sent, ready) + chunk * per_token / groups
            began = ended
        return max(0.0, sent - self.prefill_s(prompt_tokens))


# 8B Llama-shaped (Llama 3 8B: 32 layers, hidden 4096, 32 heads / 8 KV heads of 128, MLP 14336,
# vocab 128256) in bf16 on one H100 SXM 80 GB.
PARAMS = 8.03e9
LAYERS, HIDDEN = 32, 4096
KV_BYTES_PER_TOKEN = LAYERS * 8 * 128 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16
HBM_BYTES_PER_S = 3.35e12
BF16_FLOPS = 989e12  # dense
H100_ASSUMPTIONS = {
    "prefill_mfu": 0.5,  # share of peak bf16 FLOP/s a prefill step reaches
    "decode_hbm_efficiency": 0.8,  # share of HBM bandwidth a decode step reaches
    "decode_mfu": 0.35,  # compute side of a large decode batch
    "step_overhead_s": 0.004,  # scheduling, sampling, launch per step (CUDA graphs on)
    "gpu_memory_utilization": 0.9,  # of 80 GB, as vLLM's default
    "activation_overhead_bytes": 4e9,  # activations, CUDA graphs, allocator slack
    "max_num_seqs": 256,
    "startup_s": 60.0,  # assumed: pod start, 16 GB weights from local NVMe, CUDA graphs
    "handoff_bytes_per_s": 50e9,  # assumed: one 400 Gb/s RDMA NIC per GPU (DGX H100)
}


def h100_8b() -> Curves:
    """Roofline: prefill is compute-bound (2 x params FLOPs per token plus causal attention);
    a decode step reads every weight and the batch's KV once (memory-bound), with the batch's
    FLOPs as a second term that only matters for large batches of short contexts."""
    a = H100_ASSUMPTIONS
    prefill_flops = BF16_FLOPS * a["prefill_mfu"]
    per_token = 2 * PARAMS / prefill_flops
    # causal attention: QK^T and PV, 2 x 2 x n^2/2 x hidden FLOPs per layer
    per_token_sq = 2 * LAYERS * HIDDEN / prefill_flops
    hbm = HBM_BYTES_PER_S * a["decode_hbm_efficiency"]
    weights = 2 * PARAMS
    free = 80e9 * a["gpu_memory_utilization"] - weights - a["activation_overhead_bytes"]
    # step = overhead + weights / hbm + kv bytes / hbm + 2 x params FLOPs per sequence at
    # decode_mfu: the terms are added, not overlapped (pessimistic for large batches)
    per_seq = 2 * PARAMS / (BF16_FLOPS * a["decode_mfu"])
    return Curves(
        name="8B Llama-shaped, H100 SXM (roofline)",
        prefill=(a["step_overhead_s"], per_token, per_token_sq),
        decode=(
            a["step_overhead_s"] + weights / hbm,
            per_seq,
            KV_BYTES_PER_TOKEN / hbm,
        ),
        kv_capacity_tokens=int(free // KV_BYTES_PER_TOKEN),
        max_num_seqs=int(a["max_num_seqs"]),
        startup_s=a["startup_s"],
        handoff_bytes_per_s=a["handoff_bytes_per_s"],
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
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


BENCH_KV_BYTES_PER_TOKEN = 12 * 4 * 64 * 2 * 4  # bench preset: layers x KV heads x dim x K,V x fp32


def cpu_curves(path: Path = CPU_JSON, clock: str = "cpu", max_num_seqs: int = 64) -> Curves:
    """The bench model on this CPU, one thread per worker (bench/autoscale_measure.py), fitted
    to the steps' process CPU time (`clock="cpu"`: what the engine costs, without the time
    slices other processes took) or wall time (what it took while measured)."""
    m = json.loads(path.read_text())
    prefill = {int(n): s for n, s in m[f"prefill_{clock}_s"].items()}
    points = [(k.split("x"), s) for k, s in m[f"decode_step_{clock}_s"].items()]
    batch = np.array([float(b) for (b, _), _ in points])
    kv = np.array([float(b) * (float(c) + m["decode_steps"] / 2) for (b, c), _ in points])
    return Curves(
        name=f"make-tiny --preset bench, this CPU, 1 thread (measured, {clock} time)",
        prefill=fit_prefill(np.array(list(prefill), float), np.array(list(prefill.values()))),
        decode=fit_decode(batch, kv, np.array([s for _, s in points])),
        kv_capacity_tokens=int(m["kv_capacity_tokens"]),
        max_num_seqs=max_num_seqs,
        startup_s=float(np.median(m["startup_s"])),
        handoff_bytes_per_s=0.06e9,  # the replay's own pulls in bench/RESULTS.md (run B)
        kv_bytes_per_token=BENCH_KV_BYTES_PER_TOKEN,
    )
