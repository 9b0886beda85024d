"""Quantiles of a Prometheus histogram's cumulative buckets, computed as PromQL does.

The scrape source builds bucket counts from two scrapes' difference; Prometheus computes the same
with `histogram_quantile` over `rate()`, so both sources agree on what "p90 TTFT" means.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The q-quantile (0..1) of cumulative buckets `(upper bound, count)`, one of them +Inf.

    Linear interpolation inside the bucket that holds rank q * total, from the previous bucket's
    upper bound (0 below the first bucket); a rank in the +Inf bucket gives the highest finite
    bound. None when there are no observations (PromQL's NaN) or no +Inf bucket.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within 0..1, got {q}")
    ordered = sorted(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]):
        return None
    # Counts may dip where a target restarted between two scrapes; PromQL evens that out too.
    cumulative: list[tuple[float, float]] = []
    highest = 0.0
    for bound, count in ordered:
        highest = max(highest, count)
        cumulative.append((bound, highest))
    total = cumulative[-1][1]
    if total <= 0:
        return None
    rank = q * total
    index = next(i for i, (_, count) in enumerate(cumulative) if count >= rank)
    if index == len(cumulative) - 1:
        return cumulative[-2][0]
    upper, count = cumulative[index]
    if index == 0:
        if upper <= 0:
            return upper
        lower, below = 0.0, 0.0
    else:
        lower, below = cumulative[index - 1]
    if count == below:
        return upper
    return lower + (upper - lower) * (rank - below) / (count - below)
