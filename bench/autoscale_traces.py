"""The traces the autoscaling replay runs: arrival times and token counts, rate-scaled, and the
harder variants (bursts compressed in time, a 10x spike).

sharegpt_8k_stats.csv has no timestamps: its requests (in file order) get the arrival times of
azure2023_conv.csv, one per Azure arrival, cycling through the file.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

TRACES = Path(__file__).resolve().parents[2] / "shared/traces"
CONTEXT = 131072  # tokens, prompt + output (Llama 3.1 8B)
NAMES = ("azure2023_conv", "mooncake_conversation", "mooncake_synthetic", "sharegpt_8k")


@dataclass(frozen=True)
class Trace:
    name: str
    arrival: np.ndarray  # seconds from the first request, sorted, float64 [N]
    prompt: np.ndarray  # prompt tokens [N]
    output: np.ndarray  # output tokens, at least 1 [N]
    note: str = ""  # how it was made from the file

    @property
    def duration(self) -> float:
        return float(self.arrival[-1]) if len(self.arrival) else 0.0


def _sorted(name: str, t: np.ndarray, p: np.ndarray, o: np.ndarray, note: str) -> Trace:
    order = np.argsort(t, kind="stable")
    t = t[order] - t[order][0]
    return Trace(name, t, p[order].astype(np.int64), np.maximum(o[order], 1).astype(np.int64), note)


def _azure(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    # "2023-11-16 18:15:46.6805900": 7 fractional digits, strptime takes at most 6
    stamps = [datetime.strptime(r["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f") for r in rows]
    t = np.array([s.timestamp() for s in stamps])
    p = np.array([int(r["ContextTokens"]) for r in rows])
    o = np.array([int(r["GeneratedTokens"]) for r in rows])
    return t, p, o


def load(name: str, folder: Path = TRACES) -> Trace:
    if name == "azure2023_conv":
        return _sorted(name, *_azure(folder / "azure2023_conv.csv"), note="file as is")
    if name.startswith("mooncake"):
        with (folder / f"{name}.jsonl").open() as f:
            rows = [json.loads(line) for line in f if line.strip()]
        t = np.array([r["timestamp"] / 1000 for r in rows])
        p = np.array([r["input_length"] for r in rows])
        o = np.array([r["output_length"] for r in rows])
        p = np.minimum(p, CONTEXT - o)  # an 8B Llama's context; a few synthetic prompts are longer
        note = f"prompts cut to {CONTEXT} - output tokens; prefix reuse (hash_ids) not modelled"
        return _sorted(name, t, p, o, note=note)
    if name == "sharegpt_8k":
        with (folder / "sharegpt_8k_stats.csv").open() as f:
            rows = list(csv.DictReader(f))
        times = _azure(folder / "azure2023_conv.csv")[0]
        times = np.sort(times - times.min())
        n = len(times)
        p = np.array([int(rows[i % len(rows)]["num_prefill_tokens"]) for i in range(n)])
        o = np.array([int(rows[i % len(rows)]["num_decode_tokens"]) for i in range(n)])
        note = "no timestamps: azure2023_conv's arrival times, requests in file order"
        return _sorted(name, times, p, o, note=note)
    raise ValueError(f"trace must be one of {', '.join(NAMES)}, got {name!r}")


def scale_rate(trace: Trace, factor: float, seed: int = 0) -> Trace:
    """`factor` times the request rate with the same arrival shape: each request is kept
    floor(factor) times plus once more with probability frac(factor); copies arrive within
    0.5 s after the original (uniform), so shape at scales over a second is unchanged."""
    rng = np.random.default_rng(seed)
    copies = np.floor(factor).astype(int) + (rng.random(len(trace.arrival)) < factor % 1)
    idx = np.repeat(np.arange(len(trace.arrival)), copies)
    jitter = rng.uniform(0.0, 0.5, len(idx)) * (np.arange(len(idx)) > 0)
    jitter[np.r_[True, idx[1:] != idx[:-1]]] = 0.0  # the first copy keeps its time
    t = trace.arrival[idx] + jitter
    note = f"{trace.note}; rate x{factor:.2f}"
    return _sorted(trace.name, t, trace.prompt[idx], trace.output[idx], note)


def compress_bursts(trace: Trace, block_s: float = 120.0, squeeze: float = 4.0) -> Trace:
    """Every `block_s` of arrivals lands in the first block_s / squeeze of its block: the same
    requests, `squeeze` times the rate, then a quiet gap."""
    block = np.floor(trace.arrival / block_s)
    t = block * block_s + (trace.arrival - block * block_s) / squeeze
    note = f"{trace.note}; each {block_s:.0f} s of arrivals squeezed into {block_s / squeeze:.0f} s"
    return _sorted(trace.name, t, trace.prompt, trace.output, note)


def add_spike(trace: Trace, at_s: float, length_s: float = 60.0, times: float = 10.0) -> Trace:
    """`times` x the rate for `length_s` from `at_s`: the window's requests repeated, the copies
    spread uniformly over the window."""
    rng = np.random.default_rng(1)
    inside = np.flatnonzero((trace.arrival >= at_s) & (trace.arrival < at_s + length_s))
    extra = np.repeat(inside, int(times) - 1)
    t = np.concatenate([trace.arrival, rng.uniform(at_s, at_s + length_s, len(extra))])
    p = np.concatenate([trace.prompt, trace.prompt[extra]])
    o = np.concatenate([trace.output, trace.output[extra]])
    note = f"{trace.note}; {times:g}x spike for {length_s:.0f} s at {at_s:.0f} s"
    return _sorted(trace.name, t, p, o, note)
