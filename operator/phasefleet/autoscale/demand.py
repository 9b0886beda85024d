"""How many replicas one pool needs, from its signals: the policy's per-pool recommendation.

Each signal gives a size ("term"); the pool needs the largest. Capacity terms (busy time,
prefill backlog, KV usage, queued requests) go both ways; latency terms (TTFT, TPOT) only push
up, because latency says little about how much smaller a pool could be. Sizes are computed on
the replicas that reported (`reporting`): replicas still loading add nothing yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phasefleet.api.spec import Role
from phasefleet.autoscale.signals import PoolSignals, Signals

BUSY_TARGET = 0.8  # share of wall time a prefill engine may spend in steps
BACKLOG_SHARE_OF_TTFT = 0.5  # prompt backlog allowed, in seconds, as a share of the TTFT target
DEFAULT_BACKLOG_S = 1.0  # backlog allowed when no TTFT target is set (seconds)
SLOTS_TARGET = 0.8  # share of a decode engine's batch slots (max_num_seqs) to keep in use
# The same at a pod's peak over the last 30 s (the peak gauges): the snapshot's target leaves
# room for what happens between samples; the peak has seen it, so it may come closer to full.
KV_PEAK_TARGET = 0.85  # or kvCacheTarget, when that is higher
SLOTS_PEAK_TARGET = 0.9
QUEUE_MIN_PER_REPLICA = 4.0  # fewer waiting requests per replica is a moment's noise
LATENCY_STEP = 1.25  # a latency over target asks for at most this many times the pool
HOT = 0.8  # latency above this share of its target: never scale down
EPSILON = 1e-6  # so that exactly on target is not one replica more


@dataclass(frozen=True)
class Term:
    """One signal's size for a pool, and the words that explain it."""

    replicas: int
    pressure: float  # signal / target: >1 means over target
    sentence: str  # e.g. "KV usage 0.91 > target 0.70"


@dataclass(frozen=True)
class Targets:
    ttft_s: float | None
    tpot_s: float | None
    percentile: float
    kv_cache_target: float


def largest(terms: list[Term]) -> Term:
    """The term that asks for the most replicas (the higher pressure on a tie)."""
    return max(terms, key=lambda t: (t.replicas, t.pressure))


def _size(reporting: int, ratio: float) -> int:
    return max(0, math.ceil(reporting * ratio - EPSILON))


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _allowance(seconds: float) -> str:
    """Seconds as the backlog sentence shows them: milliseconds below 10 ms (a 1 ms TTFT
    target allows 0.5 ms, which two decimals of a second would show as 0.00 s)."""
    return f"{seconds * 1000:.1f} ms" if seconds < 0.01 else f"{seconds:.2f} s"


def _cmp(value: float, target: float) -> str:
    return ">" if value > target else "<="


def quantile_name(percentile: float) -> str:
    return f"p{percentile * 100:g}"


def busy_term(pool: PoolSignals) -> Term | None:
    if pool.busy_fraction is None or pool.reporting == 0:
        return None
    busy = pool.busy_fraction
    return Term(
        _size(pool.reporting, busy / BUSY_TARGET),
        busy / BUSY_TARGET,
        f"busy {busy:.2f} {_cmp(busy, BUSY_TARGET)} target {BUSY_TARGET:.2f}",
    )


def backlog_term(pool: PoolSignals, targets: Targets, window_s: float) -> Term | None:
    """Prompt tokens waiting, in seconds of the pool's measured prefill capacity (throughput
    over busy fraction).

    Past the allowed backlog, the pool is sized to keep up with its current throughput and
    drain what is over the allowance within one window: N x (1 + (backlog_s - allowed) /
    window_s). A load that doubles for a window leaves one window of backlog, so the pool
    doubles (less the allowance). Draining all of it asked N x allowed / window_s more at the
    allowance: with a loose TTFT target (5 s allowed), a sixth more for a clump of long prompts.
    """
    tokens = pool.prefill_backlog_tokens
    if not tokens or pool.reporting == 0:
        return None
    allowed = targets.ttft_s * BACKLOG_SHARE_OF_TTFT if targets.ttft_s else DEFAULT_BACKLOG_S
    rate = pool.prompt_tokens_per_s
    if rate and pool.busy_fraction:
        # what the pool prefills per second of engine time: its capacity, where the rate
        # alone is only the demand (a half-idle pool clears its backlog twice as fast)
        rate /= min(1.0, max(pool.busy_fraction, 0.05))
    if not rate:
        waiting = f"prompt backlog {tokens:.0f} tokens, none prefilled yet"
        return Term(pool.reporting + 1, 2.0, waiting)
    backlog_s = tokens / rate
    if backlog_s <= allowed:
        return None  # a short backlog is normal; busy time sizes the pool then
    return Term(
        _size(pool.reporting, 1 + (backlog_s - allowed) / max(window_s, EPSILON)),
        backlog_s / allowed,
        f"prompt backlog {backlog_s:.1f} s > {_allowance(allowed)}",
    )


def kv_term(pool: PoolSignals, targets: Targets) -> Term | None:
    """KV usage now against kvCacheTarget, or at its peak over the last 30 s against
    KV_PEAK_TARGET, whichever asks for more: a burst of requests that filled the caches between
    two samples still counts."""
    if pool.kv_usage_sum is None or pool.reporting == 0:
        return None
    mean = pool.kv_usage_sum / pool.reporting
    target = targets.kv_cache_target
    now = Term(
        _size(1, pool.kv_usage_sum / target),
        mean / target,
        f"KV usage {mean:.2f} {_cmp(mean, target)} target {target:.2f}",
    )
    if pool.kv_usage_peak_sum is None:
        return now
    peak_target = max(KV_PEAK_TARGET, target)
    peak = pool.kv_usage_peak_sum / pool.reporting
    at_peak = Term(
        _size(1, pool.kv_usage_peak_sum / peak_target),
        peak / peak_target,
        f"KV usage peak {peak:.2f} {_cmp(peak, peak_target)} target {peak_target:.2f}",
    )
    return largest([now, at_peak])


def slots_term(pool: PoolSignals, slots: int | None) -> Term | None:
    """Requests running and waiting, in replicas' worth of batch slots (max_num_seqs): with
    many short sequences the slots fill long before the KV cache does. Now against
    SLOTS_TARGET, or at their peak over the last 30 s against SLOTS_PEAK_TARGET: answers of a
    few tokens come and go between two samples."""
    if not slots or pool.running is None or pool.reporting == 0:
        return None
    demand = pool.running + (pool.waiting or 0.0)
    mean = pool.running / (pool.reporting * slots)
    now = Term(
        _size(1, demand / (slots * SLOTS_TARGET)),
        mean / SLOTS_TARGET,
        f"batch slots {mean:.2f} {_cmp(mean, SLOTS_TARGET)} target {SLOTS_TARGET:.2f}",
    )
    if pool.requests_peak is None:
        return now
    peak = pool.requests_peak / (pool.reporting * slots)
    at_peak = Term(
        _size(1, pool.requests_peak / (slots * SLOTS_PEAK_TARGET)),
        peak / SLOTS_PEAK_TARGET,
        f"batch slots peak {peak:.2f} {_cmp(peak, SLOTS_PEAK_TARGET)} target"
        f" {SLOTS_PEAK_TARGET:.2f}",
    )
    return largest([now, at_peak])


def queue_term(pool: PoolSignals, targets: Targets, slots: int | None) -> Term | None:
    """Requests a decode engine could not admit (KV or max_num_seqs full). Requests waiting
    while the KV caches and batch slots have room are between two steps, not short of
    replicas: more replicas would not admit them sooner."""
    waiting, running = pool.waiting or 0.0, pool.running or 0.0
    if pool.reporting == 0 or not queued(pool) or not decode_full(pool, targets, slots):
        return None
    ratio = (running + waiting) / max(running, 1.0)
    return Term(
        _size(pool.reporting, ratio), ratio, f"{waiting:.0f} requests waiting for a batch slot"
    )


def latency_term(
    name: str, value: float | None, target: float | None, reporting: int, percentile: float
) -> Term | None:
    """Up only: a latency over target asks for replicas in proportion, at most LATENCY_STEP
    times the pool per decision. Latency says that more are needed; how many is for the
    capacity terms to measure (busy time, backlog, KV, batch slots, queue): asked in full
    proportion, one interval's queue (TTFT at 3x its target) asked for 3x the pool and, as
    the highest ask of the window, held it there for the whole window."""
    if value is None or target is None or reporting == 0 or value <= target:
        return None
    q = quantile_name(percentile)
    return Term(
        _size(reporting, min(value / target, LATENCY_STEP)),
        value / target,
        f"{name} {q} {_ms(value)} > target {_ms(target)}",
    )


def queued(pool: PoolSignals) -> bool:
    """Whether requests wait in a queue: QUEUE_MIN_PER_REPLICA or more per replica. A few
    waiting at the moment of a scrape are arrivals meeting, not a pool short of replicas."""
    return (pool.waiting or 0.0) >= QUEUE_MIN_PER_REPLICA * max(pool.reporting, 1)


def prefill_loaded(pool: PoolSignals) -> bool:
    """Whether more prefill replicas could lower TTFT: prompts queue, or the engines are as busy
    as their target. Otherwise a high TTFT is the prompts' own length, which no replica count
    shortens."""
    return queued(pool) or (pool.busy_fraction or 0.0) >= BUSY_TARGET


def decode_full(pool: PoolSignals, targets: Targets, slots: int | None) -> bool:
    """Whether the decode engines are as full as a target: KV usage, or batch slots in use."""
    n = max(pool.reporting, 1)
    kv = (pool.kv_usage_sum or 0.0) / n
    in_use = (pool.running or 0.0) / (n * slots) if slots else 0.0
    return kv >= targets.kv_cache_target or in_use >= SLOTS_TARGET


def decode_loaded(pool: PoolSignals, targets: Targets) -> bool:
    """Whether more decode replicas could lower TPOT: requests queue for a batch slot, or the KV
    caches are as full as their target. Otherwise a high TPOT is the KV hand-off before the
    second token (long prompts with short answers), which no decode replica count shortens."""
    return queued(pool) or decode_full(pool, targets, slots=None)  # KV usage only


def terms(
    role: str, pool: PoolSignals, signals: Signals, targets: Targets, slots: int | None = None
) -> list[Term]:
    """Every signal's size for this pool: prefill-side, decode-side, or both (aggregated).
    In a prefill or decode pool a latency term counts only while the pool is loaded (see
    prefill_loaded, decode_loaded); an aggregated pool's latency is also its phases'
    interference, which more replicas do relieve."""
    prefill_side = role in (Role.PREFILL.value, Role.WORKER.value)
    decode_side = role in (Role.DECODE.value, Role.WORKER.value)
    aggregated = prefill_side and decode_side
    n, p = pool.reporting, targets.percentile
    found: list[Term | None] = []
    if prefill_side:
        ttft = signals.ttft_s if aggregated or prefill_loaded(pool) else None
        found += [
            latency_term("TTFT", ttft, targets.ttft_s, n, p),
            backlog_term(pool, targets, signals.window_s),
            busy_term(pool),
        ]
    if decode_side:
        tpot = signals.tpot_s if aggregated or decode_loaded(pool, targets) else None
        found += [
            latency_term("TPOT", tpot, targets.tpot_s, n, p),
            kv_term(pool, targets),
            slots_term(pool, slots),
            queue_term(pool, targets, slots),
        ]
    return [t for t in found if t is not None]


def hot(role: str, signals: Signals, targets: Targets) -> bool:
    """Whether the pool's own latency is near its target: no scale-down then. As for the
    latency terms, a prefill or decode pool's latency counts only while that pool is loaded."""
    pool = signals.pools.get(role) or PoolSignals(reporting=0)
    pairs = []
    if role == Role.WORKER.value or (role == Role.PREFILL.value and prefill_loaded(pool)):
        pairs.append((signals.ttft_s, targets.ttft_s))
    if role == Role.WORKER.value or (role == Role.DECODE.value and decode_loaded(pool, targets)):
        pairs.append((signals.tpot_s, targets.tpot_s))
    return any(v is not None and t is not None and v > HOT * t for v, t in pairs)


def context(role: str, signals: Signals, targets: Targets, sentence: str) -> str:
    """The pool's latencies against their targets, for the decision's sentence (those the
    sentence already names are left out)."""
    q = quantile_name(targets.percentile)
    latencies = []
    if role in (Role.PREFILL.value, Role.WORKER.value):
        latencies.append(("TTFT", signals.ttft_s, targets.ttft_s))
    if role in (Role.DECODE.value, Role.WORKER.value):
        latencies.append(("TPOT", signals.tpot_s, targets.tpot_s))
    parts = [
        f"{name} {q} {_ms(value)}" + (f", target {_ms(target)}" if target else "")
        for name, value, target in latencies
        if value is not None and name not in sentence
    ]
    return f" ({'; '.join(parts)})" if parts else ""
