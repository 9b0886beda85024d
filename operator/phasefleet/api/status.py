"""InferenceService status: what the operator and the autoscaler observed."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from phasefleet.api.base import ApiModel

# Condition types; Ready is the one `kubectl get` shows.
READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
METRICS_AVAILABLE = "MetricsAvailable"
SCALING_LIMITED = "ScalingLimited"


class Condition(ApiModel):
    """As metav1.Condition."""

    type: str = Field(min_length=1)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(default="", description="CamelCase, machine-readable.")
    message: str = Field(default="", description="What happened and, if wrong, what to fix.")
    last_transition_time: str | None = Field(
        default=None, description="RFC 3339.", json_schema_extra={"format": "date-time"}
    )
    observed_generation: int | None = None


class PoolStatus(ApiModel):
    """One pool's Deployment as observed, plus the autoscaler's last decision."""

    replicas: int = Field(default=0, description="Pods that exist.")
    ready_replicas: int = Field(default=0, description="Pods that pass readiness.")
    desired_replicas: int = Field(default=0, description="Replicas the pool is scaled to.")
    last_scale_time: str | None = Field(default=None, description="RFC 3339.")
    last_scale_reason: str | None = None


class MetricsStatus(ApiModel):
    """Latest service metrics at the SLO percentile (written by the autoscaler)."""

    ttft_ms: float | None = Field(default=None, description="Time to first token (ms).")
    itl_ms: float | None = Field(default=None, description="Inter-token latency (ms).")
    tpot_ms: float | None = Field(default=None, description="Time per output token (ms).")
    kv_cache_usage: float | None = Field(default=None, description="Decode KV usage (0..1).")
    request_rate: float | None = Field(default=None, description="Requests per second.")


class InferenceServiceStatus(ApiModel):
    observed_generation: int | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    pools: dict[str, PoolStatus] = Field(
        default_factory=dict, description="By role: prefill, decode or worker."
    )
    prefill_ready: str | None = Field(
        default=None, description="Prefill pool: ready/desired, for kubectl get (disaggregated)."
    )
    decode_ready: str | None = Field(
        default=None, description="Decode pool: ready/desired, for kubectl get (disaggregated)."
    )
    workers_ready: str | None = Field(
        default=None, description="Worker pool: ready/desired, for kubectl get (aggregated)."
    )
    scale: str | None = Field(
        default=None,
        description="ScaledToZero (every worker pool at 0 replicas) or WakingFromZero (a pool"
        " starting its first replica while the router holds requests); absent otherwise.",
    )
    metrics: MetricsStatus | None = None
    endpoint: str | None = Field(default=None, description="The router's in-cluster URL.")

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)
