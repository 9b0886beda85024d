"""The contract between the operator and the runtime, written once and imported by both.

The operator builds pod templates from these names; the worker and router CLIs and the
worker's metrics are defined with them. Importable without torch, kopf or kubernetes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

WORKER_PORT = 8000  # the worker's HTTP port: OpenAI API, /health, /metrics, /internal/*
ROUTER_PORT = 8000  # the router's HTTP port: OpenAI API, /health, /metrics
HEALTH_PATH = "/health"  # 200 when ready for new work; 503 while loading or draining
LIVENESS_PATH = "/health/live"  # 200 unless the process is broken or stuck (restart it)
METRICS_PATH = "/metrics"  # Prometheus text format

# The service's internal token, required on the workers' /internal/* endpoints: the operator
# creates it once, random, in the Secret `<name>-internal` (key `token`), and passes it to the
# router and workers in this variable.
INTERNAL_TOKEN_ENV = "PHASEFLEET_INTERNAL_TOKEN"
INTERNAL_TOKEN_KEY = "token"
INTERNAL_TOKEN_HEADER = "X-PhaseFleet-Internal-Token"
# API keys clients must send (`Authorization: Bearer <key>`) to the router and the workers,
# comma-separated; unset: none needed.
API_KEY_ENV = "PHASEFLEET_API_KEY"
# A file of keys (comma- or line-separated), re-read when it changes: the operator mounts
# spec.auth.apiKeySecret there, so a Secret edit reaches running pods (the kubelet's sync).
API_KEY_FILE_ENV = "PHASEFLEET_API_KEY_FILE"
API_KEY_MOUNT = "/etc/phasefleet/api-keys"
API_KEY_FILE = "keys"
# Set by the router (with the token) on a request to a decode worker: the prefill worker it
# picked. The decode worker prefills there, or locally when the uncached prompt is short.
PREFILL_URL_HEADER = "X-PhaseFleet-Prefill-Url"
# Set with it when the router has measured that prefill worker's throughput: its backlog of
# prompt tokens in milliseconds of that throughput (the adaptive phase boundary reads it).
PREFILL_BACKLOG_HEADER = "X-PhaseFleet-Prefill-Backlog-Ms"
PREFILL_SPEED_HEADER = "X-PhaseFleet-Prefill-Tokens-Per-S"  # and that throughput
# Set by the router on every request it forwards when the service has a TTFT target (late
# prompts last): the worker serves the prompt as if started with --late-after-ms this value, and
# a decode worker passes it on to the prefill worker. The router carries it, not the workers'
# flags, so that changing slo.ttftMs rolls the router only.
LATE_AFTER_HEADER = "X-PhaseFleet-Late-After-Ms"
# Set by the router (with the prefill URL) when the service has a TPOT target: the decode worker
# bounds its local prefill by it (the adaptive phase boundary), over its own --tpot-target-ms.
# The router carries it for the same reason: changing slo.tpotMs rolls the router, not the GPUs.
TPOT_TARGET_HEADER = "X-PhaseFleet-Tpot-Target-Ms"

# Labels on every child object and pod of an InferenceService.
ISVC_LABEL = "phasefleet.dev/inferenceservice"  # the owning InferenceService's name
ROLE_LABEL = "phasefleet.dev/role"  # the pool: prefill, decode, worker, or router


class EngineRole(StrEnum):
    """A worker's phase: its `--role` and the `role` label of its metrics."""

    BOTH = "both"  # aggregated: prefill and decode in one worker
    PREFILL = "prefill"
    DECODE = "decode"


ROUTER_ROLE = "router"  # the `role` label of the router's metrics and its pods' role label

# The pool a pod belongs to (its `phasefleet.dev/role` label) -> the engine role it runs.
POOL_ENGINE_ROLE = {
    "prefill": EngineRole.PREFILL,
    "decode": EngineRole.DECODE,
    "worker": EngineRole.BOTH,
}


# How a model writes tool calls in free text (--tool-call-parser, spec.runtime.toolCallParser)
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
# How a reasoning model marks its thought (--reasoning-parser, spec.runtime.reasoningParser)
REASONING_PARSERS = ("qwen3", "deepseek_r1")
# The order waiting requests are served in (--scheduling-policy, spec.runtime.schedulingPolicy):
# first come, first served (late prompts last), or by each request's `priority`, lower first
SCHEDULING_POLICIES = ("fcfs", "priority")
# The KV pool's element type (--kv-cache-dtype, spec.runtime.kvCacheDtype, phasefleet plan's
# --kv-cache-dtype): the model's dtype, or float8 e4m3 (engine/kv_dtype.py)
KV_CACHE_DTYPES = ("auto", "fp8")


class WorkerFlag:
    """`phasefleet worker` flags the operator sets."""

    MODEL = "--model"
    SERVED_MODEL_NAME = "--served-model-name"
    DTYPE = "--dtype"
    MAX_MODEL_LEN = "--max-model-len"
    ROLE = "--role"
    MAX_NUM_SEQS = "--max-num-seqs"
    MAX_NUM_BATCHED_TOKENS = "--max-num-batched-tokens"
    BLOCK_SIZE = "--block-size"
    KV_CACHE_DTYPE = "--kv-cache-dtype"
    NO_PREFIX_CACHING = "--no-prefix-caching"
    HOST_KV_CACHE_GIB = "--host-kv-cache-gib"
    PORT = "--port"
    DRAIN_TIMEOUT = "--drain-timeout"
    KV_LEASE_SECONDS = "--kv-lease-seconds"
    REMOTE_PREFILL_MIN_TOKENS = "--remote-prefill-min-tokens"
    ADAPTIVE_PHASE_BOUNDARY = "--adaptive-phase-boundary"
    BOUNDARY_BUSY_BACKLOG_MS = "--boundary-busy-backlog-ms"
    BOUNDARY_IDLE_MIN_TOKENS = "--boundary-idle-min-tokens"
    BOUNDARY_LOCAL_MAX_TOKENS = "--boundary-local-max-tokens"
    TPOT_TARGET_MS = "--tpot-target-ms"
    LATE_AFTER_MS = "--late-after-ms"  # the TTFT target: late prompts last
    LATE_LIMIT_S = "--late-limit-s"
    TENSOR_PARALLEL_SIZE = "--tensor-parallel-size"
    LORA_MODULES = "--lora-modules"  # NAME=PATH ...
    MAX_LORAS = "--max-loras"
    MAX_LORA_RANK = "--max-lora-rank"
    ENABLE_RUNTIME_LORA = "--enable-runtime-lora"
    TOOL_CALL_PARSER = "--tool-call-parser"
    REASONING_PARSER = "--reasoning-parser"
    SCHEDULING_POLICY = "--scheduling-policy"
    NUM_SPECULATIVE_TOKENS = "--num-speculative-tokens"  # prompt-lookup drafts per step
    PROMPT_LOOKUP_MIN = "--prompt-lookup-min"
    PROMPT_LOOKUP_MAX = "--prompt-lookup-max"


class FetchModelFlag:
    """`phasefleet fetch-model` flags the operator sets (the model cache's init container)."""

    MODEL = "--model"
    CACHE = "--cache"
    ADAPTERS = "--adapters"  # LoRA adapter repositories, org/name[@revision]


# huggingface_hub's cache inside a model cache volume: where `phasefleet fetch-model` downloads
# and the worker reads (its HF_HUB_CACHE).
MODEL_CACHE_HUB = "hub"
# The CPU linear plans' folder inside a model cache volume: `phasefleet fetch-model` makes it, a
# CPU worker mounts it read-write (the rest of the cache read-only) and keeps its plans there, so
# only the first pod on a kind of node times its linears (engine/models/linear_plan.py).
MODEL_CACHE_PLANS = "cpu-linear-plans"
CPU_LINEAR_CACHE_ENV = "PHASEFLEET_CPU_LINEAR_CACHE"  # the plans file; empty: none


# A prompt with fewer uncached tokens than this is prefilled by the decode worker itself (a
# transfer would cost more than it saves): the worker flag's and the CRD field's one default.
DEFAULT_REMOTE_PREFILL_MIN_TOKENS = 512
# a prompt that has waited past the TTFT target goes behind on-time ones at most this long
# (engine/scheduler.py, late prompts last; the simulator's replicas alike). At 60 s a burst's
# late prompts came back all at once ahead of the next arrivals, which then missed too
# (bench/RESULTS.md, "Late prompts last").
DEFAULT_LATE_LIMIT_S = 300.0


def late_after_ms(ttft_ms: int | None) -> int | None:
    """The router's --late-after-ms for a TTFT target (it sends it with each request): the
    target, or None (first come, first served) without one or with one of DEFAULT_LATE_LIMIT_S
    or more, where it cannot apply."""
    if ttft_ms is None or ttft_ms >= DEFAULT_LATE_LIMIT_S * 1000:
        return None
    return ttft_ms


class RouterFlag:
    """`phasefleet router` flags the operator sets."""

    PORT = "--port"
    SERVED_MODEL_NAME = "--served-model-name"
    POLICY = "--policy"
    HOLD_SECONDS = "--hold-seconds"
    MAX_HELD_REQUESTS = "--max-held-requests"
    LATE_AFTER_MS = "--late-after-ms"  # the TTFT target, sent to the workers per request
    TPOT_TARGET_MS = "--tpot-target-ms"  # the TPOT target, sent to decode workers per request

    @staticmethod
    def pool_service(pool: str) -> str:
        """The flag naming a pool's headless Service, e.g. `--decode-service`."""
        return f"--{pool}-service"


PEAK_WINDOW_S = 30  # the span of a worker's peak gauges (Metric.*_PEAK*), in whole seconds


class Metric:
    """Prometheus names of the worker, the router and the autoscaler (docs/architecture.md)."""

    PREFIX = "phasefleet_"
    NUM_REQUESTS_RUNNING = "phasefleet_num_requests_running"
    NUM_REQUESTS_WAITING = "phasefleet_num_requests_waiting"
    KV_CACHE_USAGE_PERC = "phasefleet_kv_cache_usage_perc"
    # the highest running + waiting, and KV usage, of any step over the last PEAK_WINDOW_S
    NUM_REQUESTS_PEAK = "phasefleet_num_requests_peak"
    KV_CACHE_USAGE_PEAK_PERC = "phasefleet_kv_cache_usage_peak_perc"
    PREFILL_TOKENS_PENDING = "phasefleet_prefill_tokens_pending"
    PREFILL_TOKENS_WAITING = "phasefleet_prefill_tokens_waiting"
    TIME_TO_FIRST_TOKEN = "phasefleet_time_to_first_token_seconds"
    INTER_TOKEN_LATENCY = "phasefleet_inter_token_latency_seconds"
    TIME_PER_OUTPUT_TOKEN = "phasefleet_time_per_output_token_seconds"
    E2E_REQUEST_LATENCY = "phasefleet_e2e_request_latency_seconds"
    REQUEST_QUEUE_TIME = "phasefleet_request_queue_time_seconds"
    PROMPT_TOKENS_TOTAL = "phasefleet_prompt_tokens_total"
    GENERATION_TOKENS_TOTAL = "phasefleet_generation_tokens_total"
    NUM_PREEMPTIONS_TOTAL = "phasefleet_num_preemptions_total"
    LATE_PROMPTS_TOTAL = "phasefleet_late_prompts_total"  # moved behind on-time prompts
    PREFIX_CACHE_QUERIES_TOTAL = "phasefleet_prefix_cache_queries_total"
    PREFIX_CACHE_HITS_TOTAL = "phasefleet_prefix_cache_hits_total"
    # the prefix cache's host tier (--host-kv-cache-gib): prompt tokens loaded from host
    # memory (part of the hits above), and its slots in use, 0..1
    HOST_KV_CACHE_HITS_TOTAL = "phasefleet_host_kv_cache_hits_total"
    HOST_KV_CACHE_USAGE_PERC = "phasefleet_host_kv_cache_usage_perc"
    SPEC_DECODE_DRAFT_TOKENS_TOTAL = "phasefleet_spec_decode_num_draft_tokens_total"
    SPEC_DECODE_ACCEPTED_TOKENS_TOTAL = "phasefleet_spec_decode_num_accepted_tokens_total"
    KV_TRANSFER_SECONDS = "phasefleet_kv_transfer_seconds"  # one hand-off's stream, decode side
    KV_TRANSFER_BYTES_TOTAL = "phasefleet_kv_transfer_bytes_total"
    KV_TRANSFER_FAILURES_TOTAL = "phasefleet_kv_transfer_failures_total"  # label `reason`
    KV_LEASES = "phasefleet_kv_leases"  # prefill worker: prompts whose KV awaits a pull
    KV_LEASE_EXPIRIES_TOTAL = "phasefleet_kv_lease_expiries_total"
    PREFILLS_TOTAL = "phasefleet_prefills_total"  # decode worker: label `where`, local | remote
    # decode worker: prompts the adaptive phase boundary placed other than the fixed rule
    # would, label `to`: local (prefill pool backlogged) | remote (prefill pool idle)
    PHASE_BOUNDARY_MOVES_TOTAL = "phasefleet_phase_boundary_moves_total"
    ENGINE_BUSY_SECONDS_TOTAL = "phasefleet_engine_busy_seconds_total"  # wall time in steps
    # workers with LoRA slots: 1, labelled with the adapters of the running and of the waiting
    # requests (comma-separated) and the slot count, as vLLM's vllm:lora_requests_info
    LORA_REQUESTS_INFO = "phasefleet_lora_requests_info"
    # workers with LoRA slots: 1 per loaded adapter, label `lora_name` (the router sends an
    # adapter's requests only to workers that have it)
    LORA_ADAPTER_LOADED = "phasefleet_lora_adapter_loaded"
    WORKER_STARTUP_SECONDS = "phasefleet_worker_startup_seconds"  # label `phase`
    # router: requests waiting for a pool with no ready worker, label `worker_pool` (the
    # chart's PodMonitor sets `pool` to the scraped pod's own role)
    ROUTER_REQUESTS_HELD = "phasefleet_router_requests_held"
    ROUTER_HELD_POOL_LABEL = "worker_pool"
    # The operator's autoscaler, on the operator's own /metrics (--metrics-port). Its own
    # labels `namespace`, `inferenceservice` and `pool` name the service: scrape with
    # honorLabels (the chart's operator PodMonitor does).
    AUTOSCALER_SCALING_LIMITED = "phasefleet_autoscaler_scaling_limited"  # 1: ScalingLimited
    AUTOSCALER_DESIRED_REPLICAS = "phasefleet_autoscaler_desired_replicas"  # last decision
    AUTOSCALER_METRICS_AVAILABLE = "phasefleet_autoscaler_metrics_available"  # 1: usable
    LABELS = ("model_name", "role")


@dataclass(frozen=True)
class ChildKind:
    """A kind of object the operator creates for an InferenceService."""

    api_version: str  # "v1" or "group/version"
    kind: str
    plural: str  # the REST resource name, as RBAC rules and watches name it
    router_only: bool = False  # one for the router (its API identity), not one per pool

    def names(self, owner: str, pools: list[str]) -> list[str]:
        """The names of this kind's children of InferenceService `owner` with these pools."""
        roles = [ROUTER_ROLE] if self.router_only else [*pools, ROUTER_ROLE]
        return [f"{owner}-{role}" for role in roles]

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]


# Every child kind, in apply order: drives apply, watches and the RBAC the chart must grant.
# The router reads its pools' EndpointSlices under its own ServiceAccount, bound to a Role that
# allows only that, in its namespace.
CHILD_KINDS = (
    ChildKind("v1", "ServiceAccount", "serviceaccounts", router_only=True),
    ChildKind("rbac.authorization.k8s.io/v1", "Role", "roles", router_only=True),
    ChildKind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings", router_only=True),
    ChildKind("v1", "Service", "services"),
    ChildKind("apps/v1", "Deployment", "deployments"),
    ChildKind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
)
