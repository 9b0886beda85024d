"""The host time of prompt-lookup drafting per request and step: NgramProposer.propose (the
last token's earlier occurrences found in one pass, only they extended backwards) against the
same rule computed by comparing every n-gram of the window (how it was first written), side by
side in one process, on the same contexts.

On a GPU this is host time the device waits on: a batch of 64 drafting requests pays it 64
times a step. Contexts of random tokens from a large vocabulary (few repeats: every n tried)
and from a small one (many partial matches to extend), of 256, 4096 and 32768 tokens (the
window is the last 4096).

    .venv/bin/python bench/draft_lookup.py
"""

from __future__ import annotations

import platform
import time

import numpy as np

from phasefleet.engine import speculation
from phasefleet.engine.speculation import NgramProposer

STEPS = 300  # lookups per case, the context growing by a token after each


def every_ngram_compared(p: NgramProposer, limit: int) -> list[int]:
    """The baseline: each n-gram of the window compared with the suffix, n from longest down."""
    limit = min(p.num_tokens, limit)
    window = p.context[max(0, p.size - speculation.LOOKBACK) : p.size]
    for n in range(min(p.max_ngram, len(window) - 1), p.min_ngram - 1, -1):
        grams = np.lib.stride_tricks.sliding_window_view(window[:-1], n)
        hits = np.flatnonzero((grams == window[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return window[start : start + limit].tolist()
    return []


def per_lookup(tokens: np.ndarray, appended: np.ndarray, lookup: str) -> tuple[float, list]:
    """Seconds per lookup, and the drafts (to check both ways agree)."""
    p = NgramProposer(4, 2, 4)
    p.extend(tokens.tolist())
    drafts = []
    start = time.perf_counter()
    for token in appended.tolist():
        drafts.append(p.propose(4) if lookup == "ours" else every_ngram_compared(p, 4))
        p.extend([token])
    return (time.perf_counter() - start) / len(appended), drafts


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"machine: {platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'vocab':>6} {'context':>8} {'every n-gram':>13} {'ours':>8} {'ratio':>7} same")
    for vocab in (32000, 50):
        for size in (256, 4096, 32768):
            tokens = rng.integers(0, vocab, size)
            appended = rng.integers(0, vocab, STEPS)
            baseline, expected = per_lookup(tokens, appended, "baseline")
            ours, drafts = per_lookup(tokens, appended, "ours")
            print(
                f"{vocab:>6} {size:>8} {baseline * 1e6:>10.0f} us {ours * 1e6:>5.0f} us "
                f"{baseline / ours:>6.1f}x {'yes' if drafts == expected else 'NO'}"
            )


if __name__ == "__main__":
    main()
