"""Linears for the CPU: per weight shape and row bucket, oneDNN with the weight reordered once
at load into its blocked layout, or `F.linear` (MKL), whichever was faster when both were
timed at load (linear_plan.py; cached in memory and in ~/.cache/phasefleet).

Packing pays most at the row counts of batched decode steps, where `F.linear` re-packs the
weight on every call (about 2x on the 2-core AVX-512 machine in float32); at 1-2 rows MKL's
matrix-vector kernels can win, by shape (see docs/engine.md). The ops are torch's own
(`torch.ops.mkldnn`, what inductor's CPU freezing uses); they are private, so a self-check at
load falls back to `F.linear` if they are missing or disagree.
PHASEFLEET_CPU_LINEAR=onednn|torch forces one path for every shape and row count.

oneDNN builds (and caches, 1024 entries by default) one primitive per input shape, ~1 ms each.
A server sees every row count from 1 to the token budget, so rows are padded up to a bucket
(exact to 16, then 8 buckets per doubling, at most 12.5% padding): about 70 shapes per weight
up to 2048 rows, all of which stay cached.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time

import torch
import torch.nn.functional as F
from torch import nn

from phasefleet.engine.models.linear_plan import (
    CALIBRATION_ROWS,
    LinearPlan,
    Measure,
    PlanCache,
    cache_file_from_env,
)

log = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 64  # oneDNN picks its blocking for this many rows; any row count still works
EXACT_ROWS = 16  # row counts up to this are not padded
BUCKETS_PER_DOUBLING = 8
MEASURE_S = 1e-3  # timing one path at one row count: repeat passes for about this long
MAX_PASSES = 20  # ... but at most this many (and at least one)
# Up to this many rows a matmul is bound by reading its weight, and its speed depends on where
# the weight comes from: such row counts are timed inside a pass over the model's weights in
# order, as a decode step reads them (STEP_PASS_BYTES of them at most, then the shape's own).
# Above it a matmul does >= 8 float32 FLOPs per weight byte it reads: one weight is timed.
COLD_MAX_ROWS = 16
STEP_PASS_BYTES = 1 << 30

_PLANS: dict[str, LinearPlan] = {}  # this process's plans, by plan_key()


def padded_rows(rows: int) -> int:
    """The bucket a row count is padded to: itself up to EXACT_ROWS, then the next multiple of
    1/BUCKETS_PER_DOUBLING of its power of two."""
    if rows <= EXACT_ROWS:
        return rows
    step = (1 << ((rows - 1).bit_length() - 1)) // BUCKETS_PER_DOUBLING
    return -(-rows // step) * step


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x: [rows, in] -> [rows, out] through oneDNN, rows padded up to their bucket."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    x = F.pad(x, (0, 0, 0, padded - rows)) if padded != rows else x.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return y[:rows] if padded != rows else y


class CpuLinear(nn.Module):
    """y = x @ W.T + b for 2-D x, through oneDNN or F.linear per row bucket as `plan` says
    (plan None: oneDNN at every row count). Holds the packed weight, the plain one, or both
    when the plan uses both paths."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, plan: LinearPlan | None = None
    ) -> None:
        super().__init__()
        paths = {"onednn"} if plan is None else plan.paths()
        self.plan = plan
        self.packed = _pack(weight) if "onednn" in paths else None
        self.weight = weight.detach() if "torch" in paths else None
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or (
            self.plan is not None and self.plan.path_at(x.shape[0]) == "torch"
        ):
            return F.linear(x, self.weight, self.bias)  # type: ignore[arg-type]
        return _packed_linear(x, self.packed, self.bias)


def forced_path() -> str:
    """PHASEFLEET_CPU_LINEAR: auto (timed per shape), onednn or torch."""
    forced = os.environ.get("PHASEFLEET_CPU_LINEAR", "auto")
    if forced not in ("auto", "onednn", "torch"):
        raise ValueError(f"PHASEFLEET_CPU_LINEAR must be auto, onednn or torch, got {forced!r}")
    return forced


def choose_cpu_linear(device: torch.device, dtype: torch.dtype) -> str:
    """'onednn' on a CPU with a working oneDNN for this dtype (the model's linears become
    CpuLinears: timed per shape, or all oneDNN when forced), else 'torch' (nn.Linear)."""
    forced = forced_path()
    if forced == "torch" or device.type != "cpu":
        return "torch"
    problem = _onednn_problem(dtype)
    if problem is None:
        return "onednn"
    if forced == "onednn":
        raise ValueError(f"PHASEFLEET_CPU_LINEAR=onednn is not usable here: {problem}")
    log.info("oneDNN linears are off (%s); using F.linear", problem)
    return "torch"


def _onednn_problem(dtype: torch.dtype) -> str | None:
    """Why packed linears cannot be used for dtype, or None when a small self-check passes."""
    if dtype not in PACKABLE_DTYPES:
        return f"dtype {dtype} is not one of {PACKABLE_DTYPES}"
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(5, 32, generator=gen).to(dtype)
    try:
        got = CpuLinear(weight, bias)(x).float()
    except (RuntimeError, AttributeError) as err:
        return f"oneDNN linear failed: {err}"
    want = F.linear(x.float(), weight.float(), bias.float())
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
        return "oneDNN linear disagrees with F.linear"
    return None


@functools.cache
def _machine() -> str:
    """The CPU as far as matmul speed goes: model name, torch's ISA level, a hash of the flags."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not flags:
                    name = value.strip()
                if key.strip() == "flags":
                    flags = value.strip()
                    break
    except OSError:
        pass
    digest = hashlib.sha1(flags.encode()).hexdigest()[:10]
    return f"{name}|{torch.backends.cpu.get_cpu_capability()}|flags {digest}"


def plan_key(weight: torch.Tensor, has_bias: bool) -> str:
    """Everything a timing depends on, as the plans' cache key."""
    out_f, in_f = weight.shape
    return (
        f"torch {torch.__version__}|{_machine()}|threads {torch.get_num_threads()}|"
        f"{weight.dtype}|{out_f}x{in_f}|bias {has_bias}"
    )


def _step_pass(
    weights: list[torch.Tensor], model: list[torch.Tensor]
) -> list[tuple[torch.Tensor, bool]]:
    """The weights a timing pass at a small row count runs, in order, each marked True when it
    is one of `weights` (the shape being timed): the model's weights as a decode step reads
    them, so the caches hold what they hold in a real step (timing one weight over and over
    reads it from cache: on a 32 MiB-L3 machine F.linear at 1 row looked as fast as oneDNN from
    cache and was 1.6x slower from memory; with a 480 MiB L3 even 48 MiB of copies stayed
    cached). At most STEP_PASS_BYTES of the model, then any of `weights` not reached yet."""
    ids = {id(w) for w in weights}
    chosen: list[tuple[torch.Tensor, bool]] = []
    size = 0
    for w in model:
        if size >= STEP_PASS_BYTES:
            break
        chosen.append((w, id(w) in ids))
        size += w.numel() * w.element_size()
    seen = {id(w) for w, _ in chosen}
    return chosen + [(w, True) for w in weights if id(w) not in seen]


def _measure(
    weights: list[torch.Tensor], bias: torch.Tensor | None, model: list[torch.Tensor]
) -> Measure:
    """measure(path, rows): best seconds per call of that path on a random [rows, in] input.
    Up to COLD_MAX_ROWS rows a pass is _step_pass(weights, model): the other weights run
    F.linear and only the calls of this shape are timed; above, a pass is one weight. Passes
    repeat for about MEASURE_S (wall time, or CPU time with one torch thread). The first oneDNN
    pass of a row count, which builds its primitive, is not timed. Copies and packs nothing
    until called: a cached plan times nothing."""
    passes_by_size: dict[bool, list[tuple[torch.Tensor, bool]]] = {}  # small rows? -> pass
    packed: dict[int, torch.Tensor] = {}  # id of a weight of this shape -> its packed copy
    gen = torch.Generator().manual_seed(0)
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    warm: set[int] = set()

    def measure(path: str, rows: int) -> float:
        small = rows <= COLD_MAX_ROWS
        if small not in passes_by_size:
            passes_by_size[small] = _step_pass(weights, model) if small else [(weights[0], True)]
        run = passes_by_size[small]
        for w, timed in run:
            key = (rows, w.shape[1])
            if key not in inputs:
                inputs[key] = torch.randn(rows, w.shape[1], generator=gen).to(w.dtype)
            if timed and path == "onednn" and id(w) not in packed:
                packed[id(w)] = _pack(w)
        # One thread: its CPU time, which other processes' time slices do not inflate.
        tick = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter

        def one_pass() -> float:
            took = 0.0
            for w, timed in run:
                x = inputs[(rows, w.shape[1])]
                if not timed:
                    F.linear(x, w)
                    continue
                start = tick()
                if path == "onednn":
                    _packed_linear(x, packed[id(w)], bias)
                else:
                    F.linear(x, w, bias)
                took += tick() - start
            return took

        if path == "onednn" and rows not in warm:
            one_pass()  # builds and caches oneDNN's primitive for this shape
            warm.add(rows)
        best, spent, passes = float("inf"), 0.0, 0
        while passes == 0 or (spent < MEASURE_S and passes < MAX_PASSES):
            took = one_pass()
            best, spent, passes = min(best, took), spent + took, passes + 1
        return best / sum(timed for _, timed in run)

    return measure


def pack_linears(module: nn.Module) -> str:
    """Replace every nn.Linear under module by a CpuLinear: timed per weight shape (cached),
    or all oneDNN when PHASEFLEET_CPU_LINEAR=onednn. Returns a summary of the paths taken."""
    linears = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    plans: dict[str, LinearPlan | None] = {}
    measured = forced_path() == "auto"
    start = time.perf_counter()
    cache = PlanCache(cache_file_from_env(), _PLANS)
    by_key: dict[str, list[nn.Linear]] = {}
    for _, _, lin in linears:
        by_key.setdefault(plan_key(lin.weight, lin.bias is not None), []).append(lin)
    model = [lin.weight.detach() for _, _, lin in linears]  # in the order a step runs them
    for key, same in by_key.items():
        weights = [lin.weight.detach() for lin in same]
        bias = None if same[0].bias is None else same[0].bias.detach()
        plans[key] = (
            cache.get(key, _measure(weights, bias, model), CALIBRATION_ROWS) if measured else None
        )
    for parent, name, lin in linears:
        plan = plans[plan_key(lin.weight, lin.bias is not None)]
        setattr(parent, name, CpuLinear(lin.weight, lin.bias, plan))
    if not measured:
        return "onednn"
    summary = "; ".join(
        f"{key.split('|')[-2]} {plan.describe()}" for key, plan in plans.items() if plan is not None
    )
    took = time.perf_counter() - start
    where = cache.file or "memory"
    log.info(
        "CPU linear paths (chosen in %.2f s; %d of %d shapes timed, the rest read from %s): %s",
        took, cache.timed, len(plans), where, summary,
    )  # fmt: skip
    return f"timed per shape ({took:.2f} s at load, {cache.timed} timed): {summary}"
