"""The scaling policy: a pure function of (config, signals, current sizes, state, now).

No I/O and no clock of its own: the operator's timer, `phasefleet serve --autoscale` and the
simulator in bench/ all call `decide` with their own clock. The algorithm, its formulas and a
worked example are in docs/autoscaling.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from phasefleet.api.spec import (
    DEFAULT_INTERVAL_SECONDS,
    DEFAULT_MAX_STEP,
    DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS,
    DEFAULT_SIGNAL_WINDOW_SECONDS,
    InferenceServiceSpec,
    Role,
    pool_gpus,
    signal_window_seconds,
)
from phasefleet.autoscale import demand
from phasefleet.autoscale.budget import Ask, share
from phasefleet.autoscale.signals import NO_SAMPLES, MetricsUnavailable, PoolSignals, Signals
from phasefleet.autoscale.zero import to_and_from_zero

# After the down window an ask still holds the pool, at a share that falls linearly from 1 to
# this over a second window as long: a peak lets go gradually, not all at once.
TAIL_FLOOR = 0.5
# Burst memory keeps peakHeadroom only for a pool whose load-signal asks over the down window
# fell to this share of an earlier peak or below: on/off load, silent between bursts whose next
# one may be larger. A pool under steady load keeps its peak ask as it is (room there costs
# GPU-hours and, in the replay, bought no attainment: bench/RESULTS.md, "Peak gauges"), and so
# does one whose load rose from silence (a new service's first traffic) and has not fallen.
ON_OFF_SHARE = 0.1
EPSILON = 1e-6
NO_LOAD_SIGNAL = "no load signal"


@dataclass(frozen=True)
class PoolLimits:
    min_replicas: int
    max_replicas: int
    gpus_per_replica: int = 0
    max_num_seqs: int | None = None  # batch slots per replica (decode sizing); None: unknown


@dataclass(frozen=True)
class ScalingConfig:
    """Everything the policy needs from an InferenceService spec."""

    pools: Mapping[str, PoolLimits]  # by role value: prefill and decode, or worker
    ttft_s: float | None = None  # slo.ttftMs
    tpot_s: float | None = None  # slo.tpotMs
    percentile: float = 0.9
    kv_cache_target: float = 0.7
    interval_s: float = float(DEFAULT_INTERVAL_SECONDS)
    signal_window_s: float = float(DEFAULT_SIGNAL_WINDOW_SECONDS)  # the rates' and quantiles'
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    max_step: int = DEFAULT_MAX_STEP
    peak_headroom: float = 1.5  # burst memory: an on/off pool keeps this much over its peak ask
    gpu_budget: int | None = None
    startup_s: float = 60.0  # a new replica's time to load before it serves
    # idle seconds before a minReplicas-0 pool goes to 0
    scale_to_zero_after_s: float = float(DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS)

    @classmethod
    def from_spec(cls, spec: InferenceServiceSpec, startup_s: float = 60.0) -> ScalingConfig:
        pools = {
            role.value: PoolLimits(pool.min_size, pool.max_size, pool_gpus(pool), pool.max_num_seqs)
            for role, pool in spec.pools().items()
        }
        scaling, slo = spec.autoscaling, spec.slo
        return cls(
            pools=pools,
            ttft_s=slo.ttft_ms / 1000 if slo.ttft_ms else None,
            tpot_s=slo.tpot_ms / 1000 if slo.tpot_ms else None,
            percentile=slo.percentile,
            kv_cache_target=scaling.kv_cache_target,
            interval_s=float(scaling.interval_seconds),
            signal_window_s=signal_window_seconds(
                scaling.interval_seconds, scaling.signal_window_seconds
            ),
            scale_up_stabilization_s=float(scaling.scale_up_stabilization_seconds),
            scale_down_stabilization_s=float(scaling.scale_down_stabilization_seconds),
            max_step=scaling.max_step,
            peak_headroom=scaling.peak_headroom,
            gpu_budget=scaling.gpu_budget,
            startup_s=startup_s,
            scale_to_zero_after_s=float(scaling.scale_to_zero_after_seconds),
        )

    @property
    def aggregated(self) -> bool:
        return Role.WORKER.value in self.pools

    @property
    def targets(self) -> demand.Targets:
        return demand.Targets(self.ttft_s, self.tpot_s, self.percentile, self.kv_cache_target)

    @property
    def window_s(self) -> float:
        """How long asks are remembered: the up window, or the down window and its tail."""
        return max(self.scale_up_stabilization_s, 2 * self.scale_down_stabilization_s)


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between decisions (start with `PolicyState()`)."""

    # Per pool: (time, replicas the signals asked for, before the forecast) over window_s.
    history: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    last_scale_up_time: Mapping[str, float] = field(default_factory=dict)
    # Per pool: (time, replicas the signals asked for, before the forecast) over startup_s.
    asks: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    # Per pool: (time, ask with the forecast) over one start-up and one interval: a replica
    # added for the forecast is kept until it could have served, then the signals decide.
    forecasts: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    busy_at: float | None = None  # when a request was last seen in the service (zero.py)
    # Per pool: (time, ask) over the down window, only asks a load signal made (not a hold):
    # the peak that burst memory keeps room for.
    peaks: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Want:
    """What a pool's signals ask for this decision, before the windows and bounds."""

    replicas: int
    sentence: str  # the term that decided, as the reason's words
    pressure: float  # how far over its target that term is (the budget shares by it)


@dataclass(frozen=True)
class PoolDecision:
    role: str
    current: int
    desired: int
    # One sentence, e.g. "decode 2->3: KV usage 0.91 > target 0.70 (TPOT p90 41 ms, target 50 ms)"
    reason: str
    limited: str | None = None  # why desired is below what the signals asked for, if it is

    @property
    def changed(self) -> bool:
        return self.desired != self.current


@dataclass(frozen=True)
class Decision:
    pools: Mapping[str, PoolDecision]
    state: PolicyState
    metrics_available: bool = True
    metrics_reason: str = "MetricsFresh"  # CamelCase, for the MetricsAvailable condition
    metrics_message: str = ""
    scaling_limited: str | None = None  # the ScalingLimited message when a bound or budget binds


def decide(
    config: ScalingConfig,
    signals: Signals | MetricsUnavailable,
    current: Mapping[str, int],
    state: PolicyState,
    now: float,
) -> Decision:
    """Desired replicas per pool, with a reason each.

    `current` is each pool's size now (replicas asked for, including ones still starting);
    `signals.pools[role].reporting` counts the ones already serving.
    """
    stale_after = max(2 * config.interval_s, config.signal_window_s)
    if isinstance(signals, Signals) and now - signals.sampled_at > stale_after:
        age = now - signals.sampled_at
        signals = MetricsUnavailable(
            "StaleMetrics",
            f"the newest sample is {age:.0f} s old, more than the signal window or two"
            f" intervals ({stale_after:.0f} s): check that Prometheus scrapes the pods",
        )
    if isinstance(signals, MetricsUnavailable):
        return _hold_all(config, signals, current, state, now)

    missing = [
        role for role in config.pools
        if current.get(role, 0) > 0 and _reporting(signals, role) == 0
    ]  # fmt: skip
    wanted: dict[str, Want] = {}
    for role in config.pools:
        size = current.get(role, 0)
        if role in missing:
            wanted[role] = Want(size, "no replica reports metrics yet", 0.0)
        else:
            wanted[role] = _recommend(config, role, signals, size)

    asks = {
        role: (*((t, n) for t, n in state.asks.get(role, ()) if now - t <= config.startup_s),
               (now, wanted[role].replicas))
        for role in config.pools
    }  # fmt: skip
    # An ask is remembered within the pool's bounds: a latency far over a tiny target can ask
    # for thousands, and the tail would otherwise hold a bounded pool for its whole length.
    bounded = {r: _bounded(config.pools[r], w.replicas) for r, w in wanted.items()}
    history = _remember(config, state, bounded, current, now)
    peaks = {
        role: _remember_peak(config, state, role, bounded[role], now)
        if role not in missing and wanted[role].sentence != NO_LOAD_SIGNAL
        else _remember_peak(config, state, role, None, now)
        for role in config.pools
    }
    memory = config.startup_s + config.interval_s
    forecasts = {
        role: tuple((t, n) for t, n in state.forecasts.get(role, ()) if now - t < memory)
        for role in config.pools
    }
    for role in config.pools:
        want = wanted[role]
        ask = want.replicas
        ahead = min(_ahead(asks[role], ask), max(ask, config.pools[role].max_replicas))
        if role not in missing and ask > current.get(role, 0) and ahead > ask:
            rising = f"{want.sentence}, rising to {ahead} by the time replicas load"
            wanted[role] = Want(ahead, rising, want.pressure)
            forecasts[role] += ((now, ahead),)
    desired: dict[str, int] = {}
    limits: dict[str, str] = {}
    for role, limits_ in config.pools.items():
        size = current.get(role, 0)
        target = _stabilized(
            config, history[role], forecasts[role], size, wanted[role].replicas, now,
            _peak_floor(config, peaks[role]),
        )  # fmt: skip
        if role not in missing and target < size and demand.hot(role, signals, config.targets):
            target = size  # latency near its target: not the moment to shrink
        if target < size and _loading(config, state, signals, role, size, now):
            target = size  # not before the replicas just added have had a chance to serve
        clamped = _bounded(limits_, target)
        if target > limits_.max_replicas and clamped >= size:
            limits[role] = f"{role} is at maxReplicas {limits_.max_replicas} (asked for {target})"
        desired[role] = clamped
    asked = dict(desired)
    desired, budget_message = _within_budget(config, current, desired, wanted)
    for role in config.pools:
        if budget_message and desired[role] < asked[role]:
            limits[role] = budget_message
    mins = {role: p.min_replicas for role, p in config.pools.items()}
    zero = to_and_from_zero(
        mins, config.scale_to_zero_after_s, signals, current, desired, state.busy_at, now
    )
    desired = zero.desired

    pools = {
        role: _explain(
            config,
            role,
            current.get(role, 0),
            desired[role],
            wanted[role],
            signals,
            limits.get(role),
            max(n for t, n in history[role] if now - t <= config.scale_down_stabilization_s),
            peaks[role],
            _peak_floor(config, peaks[role]),
        )
        for role in config.pools
    }
    for role, reason in zero.reasons.items():
        pools[role] = replace(pools[role], reason=reason)
    limited = list(dict.fromkeys(limits[r] for r in config.pools if r in limits))
    grown = dict(state.last_scale_up_time)
    grown.update({r: now for r, d in pools.items() if d.desired > d.current})
    no_samples = ", ".join(missing)
    return Decision(
        pools=pools,
        state=PolicyState(history, grown, asks, forecasts, zero.busy_at, peaks),
        metrics_available=not missing,
        metrics_reason=NO_SAMPLES if missing else "MetricsFresh",
        metrics_message=(
            f"no {no_samples} replica reports metrics: that pool holds its size until one does"
            if missing else "every pool reports fresh metrics"
        ),
        scaling_limited="; ".join(limited) or None,
    )  # fmt: skip


def _bounded(limits: PoolLimits, replicas: int) -> int:
    return min(max(replicas, limits.min_replicas), limits.max_replicas)


def _ahead(asks: tuple[tuple[float, int], ...], ask: int) -> int:
    """A linear forecast over one start-up: a replica asked for now serves `startup_s` later,
    so growth of the asks over the last start-up is carried on as far again."""
    oldest = asks[0][1]
    return ask + max(0, ask - oldest)


def _loading(
    config: ScalingConfig, state: PolicyState, signals: Signals, role: str, size: int, now: float
) -> bool:
    """Whether the pool grew less than a start-up ago and some replicas do not report yet."""
    since = now - state.last_scale_up_time.get(role, -math.inf)
    return since < config.startup_s and _reporting(signals, role) < size


def _reporting(signals: Signals, role: str) -> int:
    pool = signals.pools.get(role)
    return pool.reporting if pool else 0


def _recommend(config: ScalingConfig, role: str, signals: Signals, size: int) -> Want:
    """What the pool's load terms ask for: the largest term decides, the highest pressure
    counts."""
    pool = signals.pools.get(role) or PoolSignals(reporting=0)
    found = demand.terms(role, pool, signals, config.targets, config.pools[role].max_num_seqs)
    if not found:
        return Want(size, NO_LOAD_SIGNAL, 0.0)
    top = demand.largest(found)
    pressure = max(t.pressure for t in found)
    return Want(top.replicas, top.sentence, pressure)


def _remember(
    config: ScalingConfig,
    state: PolicyState,
    recommended: Mapping[str, int],
    current: Mapping[str, int],
    now: float,
) -> dict[str, tuple[tuple[float, int], ...]]:
    """Recommendations within the longer window; a pool seen for the first time starts with
    its current size, so nothing shrinks before one whole window of evidence."""
    kept = {}
    for role in config.pools:
        past = state.history.get(role) or ((now, current.get(role, 0)),)
        recent = tuple((t, n) for t, n in past if now - t < config.window_s)
        kept[role] = (*recent, (now, recommended[role]))
    return kept


def _stabilized(
    config: ScalingConfig,
    history: tuple[tuple[float, int], ...],
    forecasts: tuple[tuple[float, int], ...],
    size: int,
    recommended: int,
    now: float,
    floor: int = 0,
) -> int:
    """Up at once, by at most maxStep a decision (with an up window, to the lowest ask over
    it). Down to the highest of: the asks over the down window, the asks of the window before
    it at a fading share (see TAIL_FLOOR), and the recent forecasts. Either way at least
    `floor`, the burst memory (`_peak_floor`): a burst met once finds room when it returns."""
    latest = recommended
    if recommended > size and config.scale_up_stabilization_s > 0:
        earlier = [n for t, n in history[:-1] if now - t <= config.scale_up_stabilization_s]
        latest = min([*earlier, recommended])
    if latest > size or floor > size:
        return min(max(latest, floor), size + config.max_step)
    window = config.scale_down_stabilization_s
    held = [n for _, n in forecasts]
    for t, n in history:
        fade = max(0.0, now - t - window) / max(window, EPSILON)
        if fade <= 1.0:
            held.append(math.ceil(n * (1.0 - (1.0 - TAIL_FLOOR) * fade) - EPSILON))
    return max(min(size, max(held)), floor)


def _remember_peak(
    config: ScalingConfig, state: PolicyState, role: str, ask: int | None, now: float
) -> tuple[tuple[float, int], ...]:
    """The load signals' asks over the down window, with `ask` (None: this one was a hold).
    With an up window, an ask counts as the lowest over it, as a scale-up would."""
    window = config.scale_down_stabilization_s
    kept = tuple((t, n) for t, n in state.peaks.get(role, ()) if now - t <= window)
    if ask is None:
        return kept
    if config.scale_up_stabilization_s > 0:
        up = config.scale_up_stabilization_s
        ask = min([ask, *(n for t, n in kept if now - t <= up)])
    return (*kept, (now, ask))


def _on_off(peaks: tuple[tuple[float, int], ...]) -> bool:
    """Whether an ask fell to ON_OFF_SHARE of an earlier one or below over the window. Low asks
    before the peak are a rise from silence, which says nothing yet of bursts to come."""
    top = 0
    for _, n in peaks:
        if top and n <= top * ON_OFF_SHARE:
            return True
        top = max(top, n)
    return False


def _headroom(config: ScalingConfig, peaks: tuple[tuple[float, int], ...]) -> float:
    """peakHeadroom for on/off load, 1 for steady load."""
    return config.peak_headroom if _on_off(peaks) else 1.0


def _peak_floor(config: ScalingConfig, peaks: tuple[tuple[float, int], ...]) -> int:
    """The highest remembered ask times its headroom (`_headroom`), to the nearest replica,
    except that a peak of 1 keeps 1 (one request after an idle window starts no second
    replica); 0 without one."""
    peak = max((n for _, n in peaks), default=0)
    if peak <= 1:
        return peak
    return math.floor(peak * _headroom(config, peaks) + 0.5)


def _within_budget(
    config: ScalingConfig,
    current: Mapping[str, int],
    desired: dict[str, int],
    wanted: Mapping[str, Want],
) -> tuple[dict[str, int], str | None]:
    budget = config.gpu_budget
    if budget is None:
        return desired, None
    gpus = sum(desired[r] * p.gpus_per_replica for r, p in config.pools.items())
    if gpus <= budget:
        return desired, None
    asks = {
        role: Ask(current.get(role, 0), desired[role], p.gpus_per_replica, wanted[role].pressure)
        for role, p in config.pools.items()
    }
    granted = share(budget, asks)
    short = [
        f"{r} gets {granted[r]} of {desired[r]} replicas"
        f" ({granted[r] * p.gpus_per_replica} of {desired[r] * p.gpus_per_replica} GPUs)"
        for r, p in config.pools.items()
        if granted[r] < desired[r]
    ]
    message = f"gpuBudget {budget} binds ({gpus} GPUs asked): {', '.join(short)}"
    return granted, message


def _explain(
    config: ScalingConfig,
    role: str,
    size: int,
    desired: int,
    wanted: Want,
    signals: Signals,
    limited: str | None,
    window_max: int,  # the highest ask over the down window
    peaks: tuple[tuple[float, int], ...],  # the load signals' asks over it (burst memory)
    floor: int,  # what the burst memory holds: _peak_floor
) -> PoolDecision:
    ask, sentence = wanted.replicas, wanted.sentence
    context = demand.context(role, signals, config.targets, sentence)
    if ask < desired <= floor:  # the burst memory decided (at 1: the peak ask itself)
        window = config.scale_down_stabilization_s
        peak, headroom = max(n for _, n in peaks), _headroom(config, peaks)
        load = "on/off load" if _on_off(peaks) else "steady load"
        sentence += (
            f"; held at {floor}: peak ask {peak} over {window:.0f} s x {headroom:g} ({load})"
        )

    if desired > size:
        reason = f"{role} {size}->{desired}: {sentence}{context}"
    elif desired < size:
        window = config.scale_down_stabilization_s
        held = ""
        if window_max < desired and desired > config.pools[role].min_replicas:
            held = f", older asks still hold {desired}"  # the tail, or a recent forecast
        reason = (
            f"{role} {size}->{desired}: {sentence}; no ask above {min(window_max, desired)} for"
            f" {window:.0f} s{held}{context}"
        )
    else:
        reason = f"{role} stays at {size}: {sentence}{context}"
    return PoolDecision(role, size, desired, reason, limited)


def _hold_all(
    config: ScalingConfig,
    unavailable: MetricsUnavailable,
    current: Mapping[str, int],
    state: PolicyState,
    now: float,
) -> Decision:
    """No usable metrics: every pool keeps its size (moved into [minReplicas, maxReplicas] if
    the bounds changed), and the hold counts as a recommendation, so no pool shrinks until a
    whole window of fresh metrics says it may."""
    sizes = {role: current.get(role, 0) for role in config.pools}
    history = _remember(config, state, sizes, current, now)
    pools = {}
    for role, size in sizes.items():
        limits = config.pools[role]
        bounded = _bounded(limits, size)
        if bounded == size:
            reason = f"{role} stays at {size}: {unavailable.message}"
        else:
            reason = (
                f"{role} {size}->{bounded}: within minReplicas {limits.min_replicas} .."
                f" maxReplicas {limits.max_replicas} (metrics unavailable: {unavailable.message})"
            )
        pools[role] = PoolDecision(role, size, bounded, reason)
    return Decision(
        pools=pools,
        state=replace(state, history=history),
        metrics_available=False,
        metrics_reason=unavailable.reason,
        metrics_message=unavailable.message,
    )
