"""Per-setup latency summary: TTFT, ITL and TPOT percentiles and goodput."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from stream_client import RequestTiming


@dataclass(frozen=True)
class Targets:
    ttft: float  # seconds, per request
    tpot: float  # seconds per output token, per request


@dataclass(frozen=True)
class Summary:
    requests: int  # sent
    failed: int  # errors or no token
    ttft_p50: float  # seconds
    ttft_p99: float
    itl_p50: float  # seconds, over every gap between consecutive tokens of a request
    itl_p99: float
    itl_max: float
    tpot_p50: float  # seconds, over requests
    tpot_p99: float
    met: int  # requests meeting both targets
    goodput: float  # met / seconds from the first request sent to the last token
    throughput: float  # output tokens / the same seconds


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(rounds: list[list[RequestTiming]], targets: Targets) -> Summary:
    """Percentiles over every request of every round; goodput and throughput over the rounds'
    summed spans (each from its first request sent to its last token)."""
    timings = [t for r in rounds for t in r]
    done = [t for t in timings if t.ok]
    ttfts = [t.ttft for t in done]
    itls = [gap for t in done for _, gap in t.gaps()]
    tpots = [p for t in done if (p := t.tpot) is not None]
    met = sum(
        1 for t in done if t.ttft <= targets.ttft and (t.tpot is None or t.tpot <= targets.tpot)
    )
    span = 1e-9
    for r in rounds:
        start = min((t.sent for t in r), default=0.0)
        span += max((t.token_times[-1] for t in r if t.ok), default=start) - start
    return Summary(
        requests=len(timings),
        failed=len(timings) - len(done),
        ttft_p50=pct(ttfts, 50),
        ttft_p99=pct(ttfts, 99),
        itl_p50=pct(itls, 50),
        itl_p99=pct(itls, 99),
        itl_max=max(itls, default=float("nan")),
        tpot_p50=pct(tpots, 50),
        tpot_p99=pct(tpots, 99),
        met=met,
        goodput=met / span,
        throughput=sum(len(t.token_times) for t in done) / span,
    )
