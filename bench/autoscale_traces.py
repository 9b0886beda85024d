"""The traces the autoscaling replay runs: arrival times and token counts, rate-scaled, and the
harder variants (bursts compressed in time, a 10x spike).

sharegpt_8k_stats.csv has no timestamps: its requests (in file order) get the arrival times of
azure2023_conv.csv, one per Azure arrival, cycling through the file.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import numpy as np

from phasefleet.plan.trace import Trace, from_arrays, read_trace

TRACES = Path(__file__).resolve().parents[2] / "shared/traces"
CONTEXT = 131072  # tokens, prompt + output (Llama 3.1 8B)
NAMES = ("azure2023_conv", "mooncake_conversation", "mooncake_synthetic", "sharegpt_8k")


def load(name: str, folder: Path = TRACES) -> Trace:
    if name == "azure2023_conv":
        return replace(read_trace(folder / "azure2023_conv.csv"), name=name, note="file as is")
    if name.startswith("mooncake"):
        trace = read_trace(folder / f"{name}.jsonl")
        # an 8B Llama's context; a few synthetic prompts are longer
        prompt = np.minimum(trace.prompt, CONTEXT - trace.output)
        note = f"prompts cut to {CONTEXT} - output tokens; prefix reuse (hash_ids) not modelled"
        return replace(trace, name=name, prompt=prompt, note=note)
    if name == "sharegpt_8k":
        with (folder / "sharegpt_8k_stats.csv").open() as f:
            rows = list(csv.DictReader(f))
        times = read_trace(folder / "azure2023_conv.csv").arrival
        n = len(times)
        p = np.array([int(rows[i % len(rows)]["num_prefill_tokens"]) for i in range(n)])
        o = np.array([int(rows[i % len(rows)]["num_decode_tokens"]) for i in range(n)])
        note = "no timestamps: azure2023_conv's arrival times, requests in file order"
        return from_arrays(name, times, p, o, note=note)
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
    return from_arrays(trace.name, t, trace.prompt[idx], trace.output[idx], note)


def compress_bursts(trace: Trace, block_s: float = 120.0, squeeze: float = 4.0) -> Trace:
    """Every `block_s` of arrivals lands in the first block_s / squeeze of its block: the same
    requests, `squeeze` times the rate, then a quiet gap."""
    block = np.floor(trace.arrival / block_s)
    t = block * block_s + (trace.arrival - block * block_s) / squeeze
    note = f"{trace.note}; each {block_s:.0f} s of arrivals squeezed into {block_s / squeeze:.0f} s"
    return from_arrays(trace.name, t, trace.prompt, trace.output, note)


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
    return from_arrays(trace.name, t, p, o, note)


def on_off(
    trace: Trace,
    seed: int = 0,
    period_s: tuple[float, float] = (60.0, 300.0),
    peak: tuple[float, float] = (4.0, 10.0),
) -> Trace:
    """On/off bursts: the trace cut into cycles of random length (uniform in `period_s`), each
    cycle's arrivals squeezed into its first cycle / p seconds (p uniform in `peak`, per cycle):
    the same requests, p times the cycle's mean rate while on, then silence."""
    rng = np.random.default_rng(seed)
    cycles = rng.uniform(*period_s, int(trace.duration / period_s[0]) + 2)
    starts = np.concatenate([[0.0], np.cumsum(cycles)])
    peaks = rng.uniform(*peak, len(cycles))
    k = np.searchsorted(starts, trace.arrival, side="right") - 1
    t = starts[k] + (trace.arrival - starts[k]) / peaks[k]
    note = (
        f"{trace.note}; on/off: cycles of {period_s[0]:.0f}-{period_s[1]:.0f} s, each on for "
        f"1/{peak[0]:g}-1/{peak[1]:g} of it (seed {seed})"
    )
    return from_arrays(trace.name, t, trace.prompt, trace.output, note)


def code_lengths(
    trace: Trace,
    donor: Trace,
    seed: int = 0,
    prompts: tuple[int, int] = (1000, 8192),
    max_answer: int = 30,
) -> Trace:
    """Code-completion lengths on `trace`'s arrivals: prompts drawn from `donor`'s that fall
    in `prompts` (thousands of tokens: Mooncake's conversations), answers uniform in
    1..max_answer."""
    rng = np.random.default_rng(seed)
    n = len(trace.arrival)
    pool = donor.prompt[(donor.prompt >= prompts[0]) & (donor.prompt <= prompts[1])]
    prompt = rng.choice(pool, n)
    output = rng.integers(1, max_answer + 1, n)
    note = (
        f"{trace.note}; code-completion lengths: {donor.name} prompts of {prompts[0]}-"
        f"{prompts[1]} tokens, answers 1-{max_answer}"
    )
    return from_arrays(trace.name, trace.arrival, prompt, output, note)
