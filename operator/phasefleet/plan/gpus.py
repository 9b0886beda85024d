"""The GPUs `phasefleet plan` knows: published memory, HBM bandwidth and dense bf16 FLOP/s, and
the KV hand-off bandwidth assumed between two replicas."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float  # dense
    link_bytes_per_s: float  # assumed KV hand-off bandwidth between two replicas
    host_bytes_per_s: float  # assumed copy rate from the host tier of prefix cache to the GPU


# Published specifications (SXM parts; dense bf16). The links are assumptions: one RDMA NIC
# per GPU (400 Gb/s for H100/H200, 200 Gb/s for A100) and 100 GbE for the L40S; the host
# tier's copies (one per block, 2 MiB for an 8B model: docs/engine.md, "The host tier"), under
# half of PCIe's 64 GB/s (Gen5: H100, H200) or 32 GB/s (Gen4) until a GPU measures them.
GPUS = {
    "h100": Gpu("H100 SXM 80 GB", 80e9, 3.35e12, 989e12, 50e9, 25e9),
    "h200": Gpu("H200 SXM 141 GB", 141e9, 4.8e12, 989e12, 50e9, 25e9),
    "a100": Gpu("A100 SXM 80 GB", 80e9, 2.039e12, 312e12, 25e9, 12.5e9),
    "l40s": Gpu("L40S 48 GB", 48e9, 0.864e12, 362e12, 12.5e9, 12.5e9),
}
