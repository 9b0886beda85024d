"""What a GPU check run records: the checks in run order, each one's outcome, and the report
written as one JSON file and a short markdown summary after every check, so a run cut short
keeps what it measured. Plain Python, no torch: the supervising process imports it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any


class Status(StrEnum):
    OK = "ok"
    FAILED = "failed"  # the claim does not hold, or the check broke (error says which)
    NOT_RUN = "not run"  # something it needs was missing (a model, time): the run is incomplete
    NOT_APPLICABLE = "n/a"  # the claim is about CUDA and this is the CPU, or --quick leaves it
    PENDING = "pending"  # not reached yet


@dataclass(frozen=True)
class Check:
    name: str
    where: str  # "module:function" of an in-process check (gpu_runner), or "pytest"
    limit_s: float  # seconds the supervisor lets it run before stopping it
    claim: str  # what it checks, one line


# Run order: the in-process measurements first (one measuring process, nothing else on the
# GPU), then both pytest runs at once.
CHECKS = [
    Check(
        "triton_kernel",
        "gpu_kernels:triton_kernel",
        120,
        "Triton paged decode = torch path (H 32 / KV 8, D 128, bf16, several contexts)",
    ),
    Check(
        "cuda_graphs",
        "gpu_kernels:cuda_graphs",
        120,
        "captured decode graphs give eager's tokens; capture time",
    ),
    Check(
        "sdpa_prefill",
        "gpu_kernels:sdpa_prefill",
        90,
        "the SDPA kernel a bf16 prefill runs (fresh prompt, chunk over a cached prefix)",
    ),
    Check(
        "greedy_bf16_tiny",
        "gpu_greedy:greedy_tiny",
        90,
        "tiny model, bf16: greedy tokens against transformers in bf16",
    ),
    Check(
        "roofline_8b",
        "gpu_roofline:roofline",
        240,
        "Llama-3-8B shape, random bf16: decode vs HBM roofline, prefill vs matmul FLOP/s",
    ),
    Check(
        "kv_fp8_8b",
        "gpu_kv_fp8:kv_fp8",
        300,
        "Llama-3-8B shape, bf16: a float8 KV pool vs a bf16 one (blocks, decode step time)",
    ),
    Check(
        "host_kv_8b",
        "gpu_host_kv:host_kv",
        180,
        "Llama-3-8B shape, bf16: a 2k-token prompt's KV to host memory and back vs its prefill",
    ),
    Check(
        "kv_handoff",
        "gpu_handoff:handoff",
        180,
        "KV hand-off between two workers (device, host, socket, device) vs a loopback socket",
    ),
    Check(
        "greedy_bf16_smollm2",
        "gpu_greedy:greedy_smollm2",
        150,
        "SmolLM2-135M, bf16: greedy tokens against transformers in bf16",
    ),
    Check(
        "grammar_masks",
        "gpu_grammar:grammar_masks",
        90,
        "structured output's masks on the host's CPUs: one by one vs llguidance's threads",
    ),
    Check(
        "lora_8b",
        "gpu_lora:lora_8b",
        240,
        "Llama-3-8B shape, bf16: a decode step with 4 rank-16 LoRA slots vs none",
    ),
    Check(
        "moe_30b",
        "gpu_moe:moe_30b",
        240,
        "Qwen3-30B-A3B shape, bf16: decode vs the roofline of the experts read; prefill FLOP/s",
    ),
    Check("engine_tests", "pytest", 360, "pytest tests/engine with the engine on the device"),
    Check("model_tests", "pytest", 360, "pytest tests/models: SmolLM2 served on the device"),
]
CHECK_NAMES = [c.name for c in CHECKS]


@dataclass
class CheckResult:
    status: Status
    summary: str = ""  # one line for the markdown table
    seconds: float = 0.0
    error: str | None = None  # failed / not run: why (with a traceback tail for an exception)
    data: dict[str, Any] = field(default_factory=dict)  # what it measured

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "status": str(self.status)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CheckResult:
        return cls(**{**raw, "status": Status(raw["status"])})


@dataclass(frozen=True)
class CheckContext:
    """What every in-process check gets."""

    device: str  # cuda | cpu
    quick: bool  # small shapes and short runs (the CPU test of this script)
    work: Path  # scratch: model folders, logs (not the output folder: it may be copied back)
    smollm2_cache: Path | None  # a PHASEFLEET_CACHE whose models/ holds SmolLM2, or None
    smollm2_missing: str = ""  # why there is none


class NotRun(Exception):
    """Raised by a check that cannot run here for a reason a caller can fix (a missing model)."""


def exit_code(results: dict[str, CheckResult]) -> int:
    """1 when any check failed, else 2 when any did not run (or never finished), else 0."""
    statuses = {r.status for r in results.values()}
    if Status.FAILED in statuses:
        return 1
    if statuses & {Status.NOT_RUN, Status.PENDING}:
        return 2
    return 0


@dataclass
class Report:
    command: str  # as typed, for RESULTS.md
    started: str  # UTC, ISO 8601
    options: dict[str, Any]  # device, quick, budget, smollm2
    device: dict[str, Any] = field(default_factory=dict)  # what the measuring process saw
    results: dict[str, CheckResult] = field(
        default_factory=lambda: {c.name: CheckResult(Status.PENDING) for c in CHECKS}
    )
    seconds: float = 0.0  # the whole run so far

    def write(self, out: Path) -> None:
        """gpu_check.json and gpu_check.md in `out`, each replaced whole (never half-written)."""
        body = {
            "command": self.command,
            "started": self.started,
            "seconds": round(self.seconds, 1),
            "exit_code": exit_code(self.results),
            "options": self.options,
            "device": self.device,
            "checks": {name: r.to_json() for name, r in self.results.items()},
        }
        _replace(out / "gpu_check.json", json.dumps(body, indent=2, default=str) + "\n")
        _replace(out / "gpu_check.md", self.markdown())

    def markdown(self) -> str:
        name = self.device.get("name", self.options.get("device", "?"))
        lines = [
            f"# GPU check: {name}",
            "",
            f"`{self.command}`, started {self.started}, {self.seconds:.0f} s, "
            f"exit code {exit_code(self.results)}.",
            "",
            "| check | status | s | result |",
            "|---|---|---|---|",
        ]
        for check in CHECKS:
            r = self.results[check.name]
            text = r.summary or check.claim
            if r.error:
                text += f" ({r.error.strip().splitlines()[0][:200]})"
            lines.append(f"| {check.name} | {r.status} | {r.seconds:.0f} | {_cell(text)} |")
        versions = ", ".join(f"{k} {v}" for k, v in self.device.items() if k != "name")
        lines += ["", f"Device: {name}; {versions}." if versions else "", ""]
        return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
