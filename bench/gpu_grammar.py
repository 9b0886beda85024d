"""GPU check `grammar_masks`: structured output's per-step host work on the lent machine's CPUs
(bench/grammar_host.py's measurement): SmolLM2's vocabulary, a JSON schema per row, the masks
computed one by one beside on llguidance's threads, B = 1, 16, 64. The sampler computes them in
parallel only on hosts of engine/grammar.py's PARALLEL_MIN_CPUS; this is where that is measured
on a GPU host's cores. --quick: the tiny model's tokenizer, B = 4, a few steps."""

from __future__ import annotations

from typing import Any

import numpy as np
from gpu_models import smollm2, tiny
from gpu_report import CheckContext, Status
from grammar_host import measure

from phasefleet.engine.tokenizer import load_tokenizer


def grammar_masks(ctx: CheckContext, data: dict[str, Any]) -> tuple[Status, str]:
    folder = tiny(ctx) if ctx.quick else smollm2(ctx)
    batches = [4] if ctx.quick else [1, 16, 64]
    result = measure(load_tokenizer(folder), batches, 5 if ctx.quick else 100)
    for key, value in result.items():
        if isinstance(value, dict):  # one batch size: medians in ms
            data[key] = {mode: round(float(np.median(t)) * 1e3, 3) for mode, t in value.items()}
        else:
            data[key] = value
    last = data[f"B={batches[-1]}"]
    ratio = last["one_by_one"] / max(last["parallel"], 1e-9)
    return Status.OK, (
        f"B={batches[-1]} on {data['cpus']} CPUs: masks one by one {last['one_by_one']} ms, "
        f"in parallel {last['parallel']} ms ({ratio:.1f}x), as the runner takes them "
        f"{last['masks']} ms; inputs {last['inputs']} ms against {last['plain']} ms plain"
    )
