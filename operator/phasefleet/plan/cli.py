"""`phasefleet plan`: size a service for a request trace and an SLO.

Reads the trace, builds the model's speed curves on the GPU (a roofline from the model's shape
and the GPU's published bandwidth and FLOP/s, or curves measured by bench/autoscale_measure.py),
searches aggregated workers at several token budgets and disaggregated pools in the simulator,
prints the candidates side by side and writes an InferenceService for the cheapest one that
meets the SLO. A trace that names its prompts' blocks (Mooncake's `hash_ids`) has the workers'
prefix cache modelled, with the host tier that `--host-kv-cache-gib` adds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from phasefleet.api.contract import KV_CACHE_DTYPES
from phasefleet.plan.gpus import GPUS

DEFAULT_MODEL = "llama-3-8b"  # the built-in shape when --model is not given
LINK_GBPS = {"cpu": 0.87}  # KV hand-off GB/s where GPUS has none: loopback, bench/RESULTS.md
HOST_GBPS = {"cpu": 5.0}  # host tier to pool GB/s where GPUS has none: a memory copy, assumed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, required=True, help=".csv or .jsonl (docs/plan.md)")
    parser.add_argument("--ttft-ms", type=float, required=True, help="time to first token")
    parser.add_argument("--tpot-ms", type=float, required=True, help="time per output token")
    parser.add_argument(
        "--percentile",
        type=float,
        default=0.99,
        help="share of requests that must meet both targets (default 0.99)",
    )
    parser.add_argument("--gpu", choices=(*GPUS, "cpu"), default="h100")
    parser.add_argument(
        "--model",
        type=Path,
        help=f"a model folder or its config.json (default: the {DEFAULT_MODEL} shape)",
    )
    parser.add_argument(
        "--curves", type=Path, help="measured curves (bench/autoscale_measure.py); --gpu cpu"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the workers' KV pool: auto (the model's dtype) or fp8 (one byte a value: twice the "
        "KV tokens of bf16, half the KV a decode step reads and a hand-off sends)",
    )
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="plan as if no prompt shared a prefix, even where the trace's hash_ids say so",
    )
    parser.add_argument(
        "--host-kv-cache-gib",
        type=float,
        default=0.0,
        help="each worker's host tier of prefix cache (runtime.hostKvCacheSize), modelled from "
        "the trace's hash_ids (default 0: none)",
    )
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=512,
        help="prompt tokens per hash id of the trace (default 512, as Mooncake's)",
    )
    parser.add_argument("--max-gpus", type=int, default=64, help="the largest fleet tried")
    parser.add_argument("--max-model-len", type=int, help="default: the trace's longest request")
    parser.add_argument("--name", default="planned", help="the InferenceService's name")
    parser.add_argument("--hf-repo", help="the model's Hugging Face repository, for the YAML")
    parser.add_argument(
        "--output", "-o", type=Path, help="write the InferenceService here (default NAME.yaml)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        from phasefleet.plan.report import plan_service
    except ImportError as exc:  # numpy comes with the engine or plan extras
        needs = f"phasefleet plan needs numpy: pip install 'phasefleet[plan]' ({exc})"
        print(needs, file=sys.stderr)
        return 2
    try:
        return plan_service(args)
    except ValueError as exc:
        print(f"phasefleet plan: {exc}", file=sys.stderr)
        return 2
