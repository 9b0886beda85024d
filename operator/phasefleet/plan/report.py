"""What `phasefleet plan` prints and writes: the candidates side by side, and an
InferenceService for the cheapest fleet that meets the SLO."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from phasefleet.plan.cli import DEFAULT_MODEL, HOST_GBPS, LINK_GBPS
from phasefleet.plan.curves import Curves, ModelShape, measured, roofline
from phasefleet.plan.gpus import GPUS
from phasefleet.plan.prefix_cache import PrefixCaching
from phasefleet.plan.search import Outcome, Plan, Shape, Slo, search
from phasefleet.plan.trace import Trace, read_trace

# Llama 3 8B: 32 layers, hidden 4096, 8 KV heads of 128, bf16
LLAMA_3_8B = ModelShape(DEFAULT_MODEL, 8.03e9, 32, 4096, 8, 128)
WINDOW_S = 300.0  # the trace's windows for minReplicas: the quietest against the busiest
API_VERSION = "serving.phasefleet.dev/v1alpha1"


def plan_service(args: argparse.Namespace) -> int:
    if not 0.5 <= args.percentile <= 0.999:
        raise ValueError(f"--percentile must be in [0.5, 0.999], got {args.percentile}")
    if args.max_gpus < 1:
        raise ValueError(f"--max-gpus must be at least 1, got {args.max_gpus}")
    if args.block_tokens < 1:
        raise ValueError(f"--block-tokens must be at least 1, got {args.block_tokens}")
    if args.host_kv_cache_gib < 0:
        raise ValueError(f"--host-kv-cache-gib must not be negative, got {args.host_kv_cache_gib}")
    trace = read_trace(args.trace, args.block_tokens)
    slo = Slo(args.ttft_ms / 1000, args.tpot_ms / 1000, args.percentile)
    curves = _curves(args)
    context = args.max_model_len or default_context(trace)
    if int((trace.prompt + trace.output).max()) > context:
        raise ValueError(f"the trace has requests longer than --max-model-len {context}")
    prefix = _prefix(args, trace, curves)
    plan = search(trace, curves, slo, args.max_gpus, context, prefix)
    print(_table(plan, trace, curves, slo, context, args.host_kv_cache_gib))
    if plan.best is None:
        print(f"\nno fleet of at most {args.max_gpus} GPUs meets the SLO; nothing written")
        return 1
    path = args.output or Path(f"{args.name}.yaml")
    text = yaml.safe_dump(service(args, plan.best, trace, curves, slo, context), sort_keys=False)
    path.write_text(text)
    gpus = plan.best.shape.gpus
    label = f"{plan.best.shape.label(context)}, {gpus} GPU{'s' if gpus > 1 else ''}"
    print(f"\nplan: {label} -> {path}")
    return 0


def _curves(args: argparse.Namespace) -> Curves:
    model = ModelShape.from_config(args.model) if args.model else LLAMA_3_8B
    if args.kv_cache_dtype == "fp8":
        if args.gpu == "cpu":
            raise ValueError(
                "--kv-cache-dtype fp8 needs a GPU's roofline: measured CPU curves are of a "
                "float32 pool"
            )
        model = replace(model, kv_dtype_bytes=1)
    if args.gpu == "cpu":
        if args.curves is None:
            raise ValueError("--gpu cpu needs --curves (bench/autoscale_measure.py writes them)")
        kv_bytes = model.layers * model.kv_heads * model.head_dim * 2 * 4  # float32 on CPU
        return measured(args.curves, kv_bytes, LINK_GBPS["cpu"] * 1e9)
    if args.curves is not None:
        raise ValueError("--curves are measured on a CPU: use them with --gpu cpu")
    return roofline(model, GPUS[args.gpu])


def _prefix(args: argparse.Namespace, trace: Trace, curves: Curves) -> PrefixCaching | None:
    """The prefix cache to model: where the trace names its blocks, unless told not to."""
    if trace.blocks is None or args.no_prefix_cache:
        if args.host_kv_cache_gib:
            why = "--no-prefix-cache" if trace.blocks else f"{trace.name} has no hash_ids"
            raise ValueError(
                f"--host-kv-cache-gib needs the prefix cache modelled, and {why} (only a trace "
                "that names its prompts' blocks, as Mooncake's hash_ids, says what is reused)"
            )
        return None
    rate = GPUS[args.gpu].host_bytes_per_s if args.gpu in GPUS else HOST_GBPS[args.gpu] * 1e9
    host_tokens = int(args.host_kv_cache_gib * 2**30 // curves.kv_bytes_per_token)
    return PrefixCaching(host_tokens, rate)


def default_context(trace: Trace) -> int:
    """The trace's longest request, rounded up to a power of two (at least 2048 tokens)."""
    longest = int((trace.prompt + trace.output).max())
    return max(2048, 1 << math.ceil(math.log2(longest)))


def _table(
    plan: Plan, trace: Trace, curves: Curves, slo: Slo, context: int, host_gib: float = 0.0
) -> str:
    q = f"p{slo.percentile * 100:g}"
    cached = any(c.prefix is not None for c in plan.candidates)
    lines = [
        f"{trace.name}: {len(trace.arrival)} requests over {trace.duration / 60:.1f} min; "
        f"{curves.name}",
        f"SLO: TTFT {slo.ttft_s * 1000:g} ms, TPOT {slo.tpot_s * 1000:g} ms, for "
        f"{slo.percentile:.1%} of requests; searched in {plan.seconds:.1f} s",
    ]
    if cached:
        tier = f", a host tier of {host_gib:g} GiB per worker" if host_gib else ""
        lines.append(f"prefix cache modelled from the trace's block ids{tier}")
    extra = " router | prompt tokens cached |" if cached else ""
    lines += [
        "",
        f"| fleet | GPUs | attainment | TTFT {q} | TPOT {q} | good req/s per GPU |{extra} meets |",
        "|---|---|---|---|---|---|---|" + ("---|---|" if cached else ""),
    ]
    for c in sorted(plan.candidates, key=lambda c: (not c.meets(slo), c.shape.gpus)):
        mark = "best" if c is plan.best else ("yes" if c.meets(slo) else "no")
        found = ""
        if c.prefix is not None:
            host = f" ({c.prefix.host_share:.0%} from host)" if host_gib else ""
            found = f" {c.shape.router} | {c.prefix.found_share:.0%}{host} |"
        lines.append(
            f"| {c.shape.label(context)} | {c.shape.gpus} | {c.attainment:.2%} | "
            f"{c.ttft_p * 1000:.0f} ms | {c.tpot_p * 1000:.1f} ms | {c.goodput_per_gpu:.3g} "
            f"|{found} {mark} |"
        )
    return "\n".join(lines)


def quiet_share(trace: Trace, tokens: np.ndarray) -> float:
    """The quietest window's tokens against the busiest's (1.0 for a trace of one window)."""
    windows = np.floor(trace.arrival / WINDOW_S).astype(np.int64)
    sums = np.bincount(windows, weights=tokens.astype(np.float64))
    if len(sums) < 2:
        return 1.0
    full = sums[:-1] if trace.duration % WINDOW_S else sums  # the last window may be cut short
    return float(full.min() / full.max()) if full.max() > 0 else 1.0


def service(
    args: argparse.Namespace,
    best: Outcome,
    trace: Trace,
    curves: Curves,
    slo: Slo,
    context: int,
) -> dict[str, Any]:
    """The InferenceService for `best`: its sizes as maxReplicas (the trace's busiest windows
    need them), the quietest window's share of them as minReplicas, the autoscaler on, and the
    router policy and host tier it was modelled with."""
    shape = best.shape
    gpu = args.gpu != "cpu"
    spec: dict[str, Any] = {
        "model": {"hf": {"repoId": args.hf_repo or "replace-me/model"}, "maxModelLen": context},
        "mode": shape.mode,
    }
    if shape.mode == "aggregated":
        share = quiet_share(trace, trace.prompt + trace.output)
        spec["worker"] = _pool(shape.workers, share, shape, curves, gpu)
    else:
        spec["prefill"] = _pool(shape.prefill, quiet_share(trace, trace.prompt), shape, curves, gpu)
        spec["decode"] = _pool(shape.decode, quiet_share(trace, trace.output), shape, curves, gpu)
        spec["runtime"] = {"remotePrefillMinTokens": 0}  # every prompt handed off, as simulated
    if args.kv_cache_dtype != "auto":  # the pool the curves were sized with
        spec.setdefault("runtime", {})["kvCacheDtype"] = args.kv_cache_dtype
    if args.host_kv_cache_gib:
        mib = round(args.host_kv_cache_gib * 1024)
        size = f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{max(1, mib)}Mi"
        spec.setdefault("runtime", {})["hostKvCacheSize"] = size
    if shape.router != "least-loaded":  # the CRD's default
        spec["router"] = {"policy": shape.router}
    spec["slo"] = {
        "ttftMs": max(1, round(slo.ttft_s * 1000)),
        "tpotMs": max(1, round(slo.tpot_s * 1000)),
        "percentile": slo.percentile,
    }
    spec["autoscaling"] = {"enabled": True, "gpuBudget": shape.gpus} if gpu else {"enabled": True}
    return {
        "apiVersion": API_VERSION,
        "kind": "InferenceService",
        "metadata": {"name": args.name},
        "spec": spec,
    }


def _pool(size: int, share: float, shape: Shape, curves: Curves, gpu: bool) -> dict[str, Any]:
    pool: dict[str, Any] = {
        "replicas": size,
        "minReplicas": max(1, min(size, math.ceil(size * share))),
        "maxReplicas": size,
        "maxNumBatchedTokens": shape.chunk_tokens,
        "maxNumSeqs": curves.max_num_seqs,
    }
    if gpu:
        pool["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    return pool
