"""The measuring process of bench/gpu_check.py: runs in-process checks one after the other in
one process (one CUDA context) and writes each result to the partial folder as soon as the check
ends. `NAME.started` tells the supervisor which check runs now, so it can stop one that overruns
its limit (a hang, a sticky CUDA error) and start a fresh process for the rest.

    python bench/gpu_runner.py --partial DIR --work DIR --device cuda CHECK [CHECK ...]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from gpu_report import CHECKS, CheckContext, CheckResult, NotRun, Status


def device_info(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {"name": platform.processor() or platform.machine()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info["name"] = props.name
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["memory_gib"] = round(props.total_memory / 2**30, 1)
        info["sms"] = props.multi_processor_count
        info["cuda"] = torch.version.cuda
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["torch"] = torch.__version__
    info["transformers"] = transformers.__version__
    info["python"] = platform.python_version()
    return info


def run_check(name: str, ctx: CheckContext) -> CheckResult:
    """One check; whatever it raises becomes its result, with what it measured so far."""
    where = next(c.where for c in CHECKS if c.name == name)
    module, function = where.split(":")
    data: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        status, summary = getattr(importlib.import_module(module), function)(ctx, data)
        result = CheckResult(Status(status), summary, data=data)
    except NotRun as exc:
        result = CheckResult(Status.NOT_RUN, error=str(exc), data=data)
    except Exception as exc:
        tail = "".join(traceback.format_exception(exc)[-6:])
        result = CheckResult(Status.FAILED, error=f"{type(exc).__name__}: {exc}\n{tail}", data=data)
    result.seconds = time.perf_counter() - started
    gc.collect()  # the next check starts with the memory this one held given back
    if ctx.device == "cuda":
        import torch

        torch.cuda.empty_cache()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--partial", type=Path, required=True, help="where results go, one per check")
    p.add_argument("--work", type=Path, required=True, help="scratch folder")
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--smollm2-cache", type=Path, default=None)
    p.add_argument("--smollm2-missing", default="")
    p.add_argument("checks", nargs="+")
    args = p.parse_args()
    ctx = CheckContext(args.device, args.quick, args.work, args.smollm2_cache, args.smollm2_missing)
    args.partial.mkdir(parents=True, exist_ok=True)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        for name in args.checks:
            result = CheckResult(Status.FAILED, error="--device cuda, but torch sees no GPU")
            (args.partial / f"{name}.json").write_text(json.dumps(result.to_json()))
        return 1
    if args.device == "cpu":  # which CPU linear is faster is no GPU claim: skip timing them
        os.environ.setdefault("PHASEFLEET_CPU_LINEAR", "torch")
    (args.partial / "_device.json").write_text(json.dumps(device_info(args.device)))
    for name in args.checks:
        (args.partial / f"{name}.started").write_text(str(time.time()))
        print(f"[gpu_runner] {name} ...", flush=True)
        result = run_check(name, ctx)
        print(f"[gpu_runner] {name}: {result.status} {result.summary}", flush=True)
        if result.error:
            print(result.error, file=sys.stderr, flush=True)
        tmp = args.partial / f"{name}.json.tmp"
        tmp.write_text(json.dumps(result.to_json(), default=str))
        tmp.replace(args.partial / f"{name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
