"""The scaling policy: a pure function of (config, signals, current sizes, state, now).

No I/O and no clock of its own: the operator's timer, `phasefleet serve --autoscale` and the
simulator in bench/ all call `decide` with their own clock. The algorithm, its formulas and a
worked example are in docs/autoscaling.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from phasefleet.api.spec import InferenceServiceSpec, Role, pool_gpus
from phasefleet.autoscale.signals import MetricsUnavailable, Signals


@dataclass(frozen=True)
class PoolLimits:
    min_replicas: int
    max_replicas: int
    gpus_per_replica: int = 0


@dataclass(frozen=True)
class ScalingConfig:
    """Everything the policy needs from an InferenceService spec."""

    pools: Mapping[str, PoolLimits]  # by role value: prefill and decode, or worker
    ttft_s: float | None = None  # slo.ttftMs
    tpot_s: float | None = None  # slo.tpotMs
    percentile: float = 0.9
    kv_cache_target: float = 0.7
    interval_s: float = 15.0
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    max_step: int = 2
    gpu_budget: int | None = None
    startup_s: float = 60.0  # a new replica's time to load before it serves

    @classmethod
    def from_spec(cls, spec: InferenceServiceSpec, startup_s: float = 60.0) -> ScalingConfig:
        pools = {
            role.value: PoolLimits(pool.min_size, pool.max_size, pool_gpus(pool))
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
            scale_up_stabilization_s=float(scaling.scale_up_stabilization_seconds),
            scale_down_stabilization_s=float(scaling.scale_down_stabilization_seconds),
            max_step=scaling.max_step,
            gpu_budget=scaling.gpu_budget,
            startup_s=startup_s,
        )

    @property
    def aggregated(self) -> bool:
        return Role.WORKER.value in self.pools


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between decisions (start with `PolicyState()`)."""

    # Per pool: (time, recommended replicas) over the longer stabilization window.
    history: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    last_scale_time: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PoolDecision:
    role: str
    current: int
    desired: int
    reason: str  # one sentence, e.g. "decode 2->3: KV usage 0.91 > target 0.70 (TPOT p90 41 ms, target 50 ms)"
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
    raise NotImplementedError  # written next; see docs/autoscaling.md
