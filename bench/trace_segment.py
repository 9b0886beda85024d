"""A segment of the Azure 2023 conversation trace: arrival offsets kept, lengths scaled."""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from phasefleet.plan.trace import Trace, from_arrays

AZURE_CONV = Path(__file__).resolve().parents[2] / "shared/traces/azure2023_conv.csv"
FIRST_TOKEN_ID = 10  # ids below this are the tiny tokenizer's special and byte-fallback ids


@dataclass(frozen=True)
class TraceRequest:
    offset: float  # seconds after the segment's start
    prompt_token_ids: list[int]
    max_tokens: int  # output tokens, generated in full (ignore_eos)


def _seconds(stamp: str) -> float:
    # "2023-11-16 18:15:46.6805900": 7 fractional digits, strptime takes at most 6
    return datetime.strptime(stamp[:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()


def load_segment(
    path: Path,
    start: float,  # seconds after the trace's first request
    duration: float,  # seconds
    scale: float,  # trace token counts are divided by this
    max_prompt: int,  # tokens, after scaling
    vocab_size: int,
    seed: int = 0,
) -> list[TraceRequest]:
    """The requests that arrived in [start, start + duration), with random prompts of the scaled
    lengths (they share no prefix, so prefix caching plays no part)."""
    rng = random.Random(seed)
    with path.open() as f:
        rows = [
            (_seconds(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
            for r in csv.DictReader(f)
        ]
    first = rows[0][0]
    segment = []
    for t, context, generated in rows:
        offset = t - first - start
        if 0 <= offset < duration:
            n = max(4, min(max_prompt, round(context / scale)))
            prompt = [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]
            segment.append(TraceRequest(offset, prompt, max(2, round(generated / scale))))
    return segment


def as_trace(segment: list[TraceRequest]) -> Trace:
    """The segment as the simulators read it: arrival offsets and token counts."""
    return from_arrays(
        "segment",
        np.array([r.offset for r in segment]),
        np.array([len(r.prompt_token_ids) for r in segment]),
        np.array([r.max_tokens for r in segment]),
    )
