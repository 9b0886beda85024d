"""InferenceService spec (serving.phasefleet.dev/v1alpha1): what a user asks for."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema, field_validator

from phasefleet.api.base import ApiModel, FreeForm, Quantity, Rule, quantity
from phasefleet.api.contract import DEFAULT_REMOTE_PREFILL_MIN_TOKENS, INTERNAL_TOKEN_ENV

GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_IMAGE = "ghcr.io/phasefleet/phasefleet:0.1.0"


class Mode(StrEnum):
    DISAGGREGATED = "disaggregated"
    AGGREGATED = "aggregated"


class Role(StrEnum):
    """A pool's role; also the worker's `--role` and the `phasefleet.dev/role` label."""

    PREFILL = "prefill"
    DECODE = "decode"
    WORKER = "worker"  # aggregated mode: one pool that does both phases (`--role both`)


class SecretKeyRef(ApiModel):
    """A key in a Secret in the InferenceService's namespace."""

    name: str = Field(min_length=1, description="Name of the Secret.")
    key: str = Field(default="token", min_length=1, description="Key in the Secret's data.")


class PvcSource(ApiModel):
    """A Hugging Face model folder (or a GGUF file) on a PersistentVolumeClaim, mounted
    read-only."""

    claim_name: str = Field(min_length=1, description="Name of the PersistentVolumeClaim.")
    path: str = Field(
        default="/",
        description="Folder inside the volume that holds config.json and the safetensors, or a"
        " .gguf file (or a folder holding one), converted once per pod into its cache.",
    )


class ImageSource(ApiModel):
    """A model folder (or a GGUF file) baked into the runtime image."""

    path: str = Field(
        min_length=1,
        pattern=r"^/",
        description="Absolute path of the model folder, or of a .gguf file (or a folder holding"
        " one), converted once per pod into its cache.",
    )


class HuggingFaceSource(ApiModel):
    """A Hugging Face Hub repository, downloaded by each worker at start (with spec.model.cache:
    once, into the cache)."""

    repo_id: str = Field(
        min_length=1, pattern=r"^[\w.-]+(/[\w.-]+)?$", description="Repository id, org/name."
    )
    revision: str | None = Field(default=None, description="Branch, tag or commit.")
    token_secret: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding an access token (env HF_TOKEN); never copied elsewhere.",
    )


# A number of bytes as a quantity ("20Gi"); checked by a rule whose message says what to write,
# where a bare schema pattern would quote a regular expression.
ByteQuantity = Annotated[
    int | str,
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "maxLength": 64,
        }
    ),
]
CACHE_PATH_CEL = "self.path.matches('^(/[^/]+)+/?$') && !self.path.matches('(^|/)[.][.]?(/|$)')"


def _positive_quantity(value: int | str) -> bool:
    amount = quantity(value)
    return amount is not None and amount > 0


def _cache_path(path: str) -> bool:
    return bool(re.fullmatch(r"(/[^/]+)+/?", path)) and not re.search(r"(^|/)\.\.?(/|$)", path)


class CacheClaim(ApiModel):
    """A PersistentVolumeClaim the operator creates for the cache, once: `<name>-model-cache`,
    owned by the InferenceService (deleted with it), never resized or recreated."""

    size: ByteQuantity = Field(
        description="Storage to ask for (bytes, a quantity such as 20Gi): room for the model's"
        " safetensors and tokenizer, for every revision the service will use."
    )
    storage_class_name: str | None = Field(
        default=None,
        max_length=253,
        description="StorageClass (default: the cluster's default class); it must offer"
        ' accessMode. "" binds to a PersistentVolume without a class.',
    )
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = Field(
        default="ReadWriteMany",
        description="ReadWriteMany: pods on every node share the claim (NFS, CephFS, EFS and"
        " the like). ReadWriteOnce: only pods on one node can mount it.",
    )

    rules = (
        Rule(
            cel="isQuantity(string(self.size))"
            " && quantity(string(self.size)).isGreaterThan(quantity('0'))",
            message="spec.model.cache.pvc.size must be a positive quantity of bytes, such as 20Gi",
            check=lambda c: _positive_quantity(c.size),
            field_path=".size",
        ),
    )


class HostPathCache(ApiModel):
    """A folder on each node: pods on one node share it, each node downloads once."""

    path: str = Field(
        max_length=4096,
        description="Absolute folder on the node, writable by the image's user (uid 10001);"
        " made if missing, but then owned by root: prepare it on every node.",
    )

    rules = (
        Rule(
            cel=CACHE_PATH_CEL,
            message="spec.model.cache.hostPath.path must be an absolute folder other than /,"
            " without . or .. parts, such as /var/cache/phasefleet",
            check=lambda h: _cache_path(h.path),
            field_path=".path",
        ),
    )


class ModelCache(ApiModel):
    """Where an hf model is kept between pods: downloaded once, under a lock, by an init
    container, and mounted read-only by the workers. Exactly one of pvc, claimName or hostPath."""

    pvc: CacheClaim | None = Field(default=None, description="A claim the operator creates.")
    claim_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="An existing PersistentVolumeClaim in the service's namespace (ReadWriteMany"
        " when pods run on several nodes); the operator creates nothing.",
    )
    host_path: HostPathCache | None = Field(default=None, description="A folder on each node.")

    rules = (
        Rule(
            cel="(has(self.pvc) ? 1 : 0) + (has(self.claimName) ? 1 : 0)"
            " + (has(self.hostPath) ? 1 : 0) == 1",
            message="spec.model.cache: set exactly one of pvc, claimName or hostPath (leave"
            " cache out for a download per pod into its own emptyDir)",
            check=lambda c: sum(k is not None for k in (c.pvc, c.claim_name, c.host_path)) == 1,
        ),
    )

    def kind(self) -> str:
        return "pvc" if self.pvc else "claimName" if self.claim_name else "hostPath"


class ModelSpec(ApiModel):
    """The model to serve: exactly one of pvc, image or hf."""

    pvc: PvcSource | None = None
    image: ImageSource | None = None
    hf: HuggingFaceSource | None = None
    cache: ModelCache | None = Field(
        default=None,
        description="hf only: keep the download between pods (one download, under a lock)."
        " Absent: each pod downloads into its own emptyDir.",
    )
    served_name: str | None = Field(
        default=None,
        description="Model name clients send in the OpenAI API (default: the object's name).",
    )
    max_model_len: int | None = Field(
        default=None, ge=16, le=1048576, description="Maximum tokens per sequence (tokens)."
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        default="auto",
        description=(
            "Weight and activation dtype. auto: on GPU the checkpoint's 16-bit dtype "
            "(bfloat16 for a float32 checkpoint), on CPU float32."
        ),
    )

    rules = (
        Rule(
            cel="(has(self.pvc) ? 1 : 0) + (has(self.image) ? 1 : 0) + (has(self.hf) ? 1 : 0) == 1",
            message="spec.model: set exactly one model source: pvc, image or hf",
            check=lambda m: sum(s is not None for s in (m.pvc, m.image, m.hf)) == 1,
        ),
        Rule(
            cel="!has(self.cache) || has(self.hf)",
            message="spec.model.cache is only for spec.model.hf: a pvc or image model is read"
            " where it is, with no download; remove spec.model.cache",
            check=lambda m: m.cache is None or m.hf is not None,
            field_path=".cache",
        ),
    )

    def source_kind(self) -> str:
        return "pvc" if self.pvc else "image" if self.image else "hf"


class LoraHubSource(ApiModel):
    """A LoRA adapter repository on the Hugging Face Hub (private ones: the token of
    spec.model.hf.tokenSecret)."""

    repo_id: str = Field(
        min_length=1,
        max_length=200,
        pattern=r"^[\w.-]+/[\w.-]+$",
        description="Repository id, org/name.",
    )
    revision: str | None = Field(
        default=None, max_length=200, pattern=r"^[\w./-]+$", description="Branch, tag or commit."
    )


class LoraAdapter(ApiModel):
    """One LoRA adapter, served under `name` (a request's `model`): exactly one of hf or path."""

    name: str = Field(
        max_length=100,
        pattern=r"^[A-Za-z0-9][\w.:-]{0,99}$",
        description="The name clients send as `model` to use this adapter.",
    )
    hf: LoraHubSource | None = Field(default=None, description="Fetched by each worker at start.")
    path: str | None = Field(
        default=None,
        max_length=1000,
        pattern=r"^/",
        description="Absolute path of a PEFT adapter folder in the worker (in the image, or on a"
        " volume the model's PVC provides).",
    )

    rules = (
        Rule(
            cel="has(self.hf) != has(self.path)",
            message="each spec.lora.adapters entry needs exactly one source: hf or path",
            check=lambda a: (a.hf is None) != (a.path is None),
        ),
    )

    def source(self) -> str:
        """What --lora-modules takes after `name=`."""
        if self.hf is not None:
            return self.hf.repo_id + (f"@{self.hf.revision}" if self.hf.revision else "")
        return str(self.path)


class LoraSpec(ApiModel):
    """LoRA adapters served beside the model by every worker, mixed in one batch."""

    adapters: list[LoraAdapter] = Field(
        min_length=1,
        max_length=32,
        # a map keyed by name: the API server refuses a name given twice
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    max_rank: int = Field(
        default=16, ge=1, le=256, description="The largest adapter rank (--max-lora-rank)."
    )
    max_loras: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="Adapter slots on the device (default: one per adapter).",
    )

    @field_validator("adapters")
    @classmethod
    def _names_differ(cls, adapters: list[LoraAdapter]) -> list[LoraAdapter]:
        names = [a.name for a in adapters]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"Duplicate value: adapter name {', '.join(twice)} is given twice")
        return adapters

    rules = (
        Rule(
            cel="!has(self.maxLoras) || self.maxLoras >= size(self.adapters)",
            message="spec.lora.maxLoras must be at least the number of adapters",
            check=lambda s: s.max_loras is None or s.max_loras >= len(s.adapters),
            field_path=".maxLoras",
        ),
    )


# Variables the operator sets in the worker containers itself; spec.runtime.env may not set
# them (a second entry with the same name would silently win or lose).
OPERATOR_ENV = (
    "HOME",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "POD_NAME",
    "HF_REVISION",
    "HF_TOKEN",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    INTERNAL_TOKEN_ENV,
)


class EnvVar(ApiModel):
    """An environment variable for the worker containers."""

    name: str = Field(min_length=1, max_length=256)
    value: str | None = None
    value_from: FreeForm | None = Field(default=None, description="As in a core/v1 EnvVar.")


class RuntimeSpec(ApiModel):
    """The engine image and engine-wide knobs."""

    image: str = Field(default=DEFAULT_IMAGE, min_length=1, description="Engine image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    env: list[EnvVar] = Field(default_factory=list, max_length=64)
    block_size: int = Field(default=16, ge=1, le=256, description="KV cache block (tokens).")
    enable_prefix_caching: bool = Field(default=True, description="Reuse KV of shared prefixes.")
    host_kv_cache_size: ByteQuantity | None = Field(
        default=None,
        description=(
            "Host memory per worker for the prefix cache's second tier (bytes, a quantity such"
            " as 16Gi): KV blocks the GPU pool evicts are kept there and loaded back for a"
            " prompt that starts with them (multi-turn chat, shared system prompts), instead"
            " of being computed again. Added to each worker's memory request and limit, where"
            " the pool sets them (--host-kv-cache-gib). Unset: off."
        ),
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        default="auto",
        description=(
            "KV cache element type, every pool alike: auto (the model's dtype) or fp8 (float8"
            " e4m3, unscaled: twice the KV blocks of a bfloat16 pool in the same memory, the"
            " hand-off half the bytes; keys and values rounded to 8 bits) (--kv-cache-dtype)."
        ),
    )
    extra_args: list[str] = Field(
        default_factory=list, max_length=64, description="Appended to `phasefleet worker`."
    )
    remote_prefill_min_tokens: int = Field(
        default=DEFAULT_REMOTE_PREFILL_MIN_TOKENS,
        ge=0,
        le=1048576,
        description=(
            "Disaggregated mode: a prompt with fewer uncached tokens than this is prefilled by"
            " the decode worker itself, not handed off (tokens; 0: hand off every prompt,"
            " whatever the load)."
        ),
    )
    adaptive_phase_boundary: bool = Field(
        default=False,
        description=(
            "Disaggregated mode: move that threshold with the load (off by default: it gains in"
            " the simulator, not yet on a real fleet). A decode worker with room"
            " (its TPOT with that prefill under 0.8 of slo.tpotMs, 4096 prompt tokens of its"
            " own) prefills prompts of any length while the prefill worker is 0.5 s behind;"
            " prompts from 128 tokens go to an idle prefill worker."
        ),
    )
    late_prompts_last: bool = Field(
        default=True,
        description=(
            "With slo.ttftMs (under 300 s): a prompt that has waited longer than the target"
            " (it has missed it) goes behind the prompts that can still meet it, for up to"
            " 5 min; none is dropped. false: first come, first served."
        ),
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="fcfs",
        description=(
            "The order waiting requests are served in: fcfs (first come, first served, with"
            " late prompts last) or priority (by each request's priority field, lower first,"
            " arrival breaking ties; the least urgent running request is preempted first)."
            " Under fcfs a request with a priority other than 0 is a 400"
            " (--scheduling-policy)."
        ),
    )
    num_speculative_tokens: int = Field(
        default=0,
        ge=0,
        le=16,
        description=(
            "Speculative decoding by prompt lookup: every request (greedy or sampled, any"
            " setting) guesses up to this many next"
            " tokens from its own prompt and output and verifies them in one step, its output"
            " unchanged (the same tokens greedy or seeded, the same distribution unseeded);"
            " it pays where answers repeat their context (code edits, quoting, summaries)."
            " 0: off (--num-speculative-tokens)."
        ),
    )
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        default=None,
        description=(
            "How the model writes tool calls in free text, so that chat's tool_choice 'auto' is"
            " served: hermes (<tool_call> blocks: Hermes, Qwen2.5, Qwen3) or llama3_json"
            " (Llama 3.1-3.3); unset: 'auto' is a 400 (--tool-call-parser)."
        ),
    )
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        default=None,
        description=(
            "How a reasoning model marks its thought, returned apart as reasoning_content:"
            " qwen3 (the model writes <think>) or deepseek_r1 (the chat template opens it:"
            " DeepSeek-R1, QwQ, Qwen3 Thinking-2507); unset: the thought is content"
            " (--reasoning-parser)."
        ),
    )
    kv_lease_seconds: int = Field(
        default=30,
        ge=1,
        le=3600,
        description=(
            "How long a prefill worker keeps a prompt's KV for the decode worker to pull"
            " (seconds); an unpulled lease expires and the decode worker recomputes."
        ),
    )

    rules = (
        Rule(
            cel=(
                "!has(self.env) || self.env.all(e, !(e.name in ["
                + ", ".join(f"'{n}'" for n in OPERATOR_ENV)
                + "]))"
            ),
            message=(
                f"spec.runtime.env may not set {', '.join(OPERATOR_ENV)}: the operator sets them"
                " (HF_TOKEN comes from spec.model.hf.tokenSecret, HF_REVISION from"
                " spec.model.hf.revision, the cache folders are volumes it mounts: see"
                " spec.model.cache)"
            ),
            check=lambda r: not any(e.name in OPERATOR_ENV for e in r.env),
            field_path=".env",
        ),
        Rule(
            cel="!has(self.hostKvCacheSize) || (isQuantity(string(self.hostKvCacheSize))"
            " && quantity(string(self.hostKvCacheSize)).isGreaterThan(quantity('0')))",
            message="spec.runtime.hostKvCacheSize must be a positive quantity of bytes, such as"
            " 16Gi (leave it out to turn the host tier off)",
            check=lambda r: (
                r.host_kv_cache_size is None or _positive_quantity(r.host_kv_cache_size)
            ),
            field_path=".hostKvCacheSize",
        ),
        Rule(
            cel="!has(self.hostKvCacheSize) || !has(self.enablePrefixCaching)"
            " || self.enablePrefixCaching",
            message="spec.runtime.hostKvCacheSize needs enablePrefixCaching: the host tier keeps"
            " the blocks the prefix cache evicts",
            check=lambda r: r.host_kv_cache_size is None or r.enable_prefix_caching,
            field_path=".hostKvCacheSize",
        ),
    )


class Toleration(ApiModel):
    """As in a core/v1 Toleration."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Resources(ApiModel):
    """Container resources; GPUs go in limits as nvidia.com/gpu (whole numbers)."""

    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16)
    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16)


def _whole(value: int | str) -> bool:
    return str(value).isdigit()


def pool_gpus(pool: PoolSpec | None) -> int:
    """GPUs one replica of the pool asks for: its tensorParallelSize in a GPU pool (the rule
    on PoolSpec holds the two equal), 0 in a CPU pool."""
    if pool is None:
        return 0
    value = pool.resources.limits.get(GPU_RESOURCE, 0)
    return int(value) if _whole(value) else 0


def _can_roll(surge: int | None, unavailable: int | None) -> bool:
    return surge is None or unavailable is None or surge + unavailable >= 1


# The tensor-parallel degrees a pool may ask for: a power of two, at most 64 (8 nodes of 8).
# Whether a degree divides the model's attention heads the CRD cannot know; the worker refuses
# one that does not at start-up, with a one-line termination message.
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _gpus_match_degree(pool: PoolSpec) -> bool:
    value = pool.resources.limits.get(GPU_RESOURCE)
    if value is None or not _whole(value):  # no GPUs, or the whole-number rule's to report
        return True
    return int(value) in (0, pool.tensor_parallel_size)


def _cel_tensor_parallel(pool: str) -> str:
    return (
        f"(has(self.{pool}) && has(self.{pool}.tensorParallelSize)"
        f" ? self.{pool}.tensorParallelSize : 1)"
    )


def _cel_pool_gpus(pool: str) -> str:
    limit = f"self.{pool}.resources.limits['{GPU_RESOURCE}']"
    return (
        f"(has(self.{pool}) && has(self.{pool}.resources) && has(self.{pool}.resources.limits)"
        f" && '{GPU_RESOURCE}' in self.{pool}.resources.limits"
        f" ? (has(self.{pool}.minReplicas) ? self.{pool}.minReplicas : self.{pool}.replicas)"
        f" * int(string({limit})) : 0)"
    )


class PoolSpec(ApiModel):
    """One pool of engine workers (a Deployment)."""

    replicas: int = Field(default=1, ge=0, le=1000, description="Replicas to start with.")
    min_replicas: int | None = Field(
        default=None, ge=0, le=1000, description="Autoscaling lower bound (default: replicas)."
    )
    max_replicas: int | None = Field(
        default=None, ge=0, le=1000, description="Autoscaling upper bound (default: replicas)."
    )
    resources: Resources = Field(default_factory=Resources, json_schema_extra={"default": {}})
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    affinity: FreeForm | None = Field(default=None, description="As in a core/v1 Affinity.")
    max_num_batched_tokens: int = Field(
        default=2048, ge=1, le=1048576, description="Token budget per engine step (tokens)."
    )
    max_num_seqs: int = Field(default=64, ge=1, le=4096, description="Max running sequences.")
    termination_grace_period_seconds: int = Field(
        default=60, ge=0, le=3600, description="Drain time before a worker is killed (seconds)."
    )
    max_surge: int | None = Field(
        default=None,
        ge=0,
        le=1000,
        description=(
            "Extra pods a rollout may start (default: 0 for GPU pools, so a full cluster can"
            " roll; 1 otherwise)."
        ),
    )
    max_unavailable: int | None = Field(
        default=None,
        ge=0,
        le=1000,
        description=(
            "Pods a rollout may take down before their replacements are ready (default: 1 for"
            " GPU pools, 0 otherwise)."
        ),
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "Ranks each worker splits the model over, one process and one GPU each (1, 2, 4,"
            " ..., 64; it must divide the model's attention heads). A GPU pool's"
            " nvidia.com/gpu limit must equal it; a pool without one runs its ranks on CPU."
        ),
    )

    rules = (
        Rule(
            cel="!has(self.minReplicas) || self.minReplicas <= self.replicas",
            message="minReplicas must be less than or equal to replicas",
            check=lambda p: p.min_replicas is None or p.min_replicas <= p.replicas,
            field_path=".minReplicas",
        ),
        Rule(
            cel="!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
            message="maxReplicas must be greater than or equal to replicas",
            check=lambda p: p.max_replicas is None or p.replicas <= p.max_replicas,
            field_path=".maxReplicas",
        ),
        Rule(
            cel=(
                f"!has(self.resources) || !has(self.resources.limits)"
                f" || !('{GPU_RESOURCE}' in self.resources.limits)"
                f" || string(self.resources.limits['{GPU_RESOURCE}']).matches('^[0-9]+$')"
            ),
            message=f"resources.limits['{GPU_RESOURCE}'] must be a whole number of GPUs",
            check=lambda p: _whole(p.resources.limits.get(GPU_RESOURCE, 0)),
            field_path=".resources.limits",
        ),
        Rule(
            cel="!has(self.tensorParallelSize) || self.tensorParallelSize in ["
            + ", ".join(str(n) for n in TENSOR_PARALLEL_SIZES)
            + "]",
            message="tensorParallelSize must be a power of two from 1 to 64 (1, 2, 4, 8, 16,"
            " 32 or 64) that divides the model's attention heads",
            check=lambda p: p.tensor_parallel_size in TENSOR_PARALLEL_SIZES,
            field_path=".tensorParallelSize",
        ),
        Rule(
            cel=(
                f"!has(self.resources) || !has(self.resources.limits)"
                f" || !('{GPU_RESOURCE}' in self.resources.limits)"
                f" || !string(self.resources.limits['{GPU_RESOURCE}']).matches('^[0-9]+$')"
                f" || int(string(self.resources.limits['{GPU_RESOURCE}'])) in [0,"
                " (has(self.tensorParallelSize) ? self.tensorParallelSize : 1)]"
            ),
            message=f"resources.limits['{GPU_RESOURCE}'] must equal tensorParallelSize (default"
            " 1; one GPU per rank): set both to the same number, or leave the GPU limit out for"
            " a pool that runs its ranks on CPU",
            check=_gpus_match_degree,
            field_path=".resources.limits",
        ),
        Rule(
            cel="!has(self.maxSurge) || !has(self.maxUnavailable)"
            " || self.maxSurge + self.maxUnavailable >= 1",
            message="maxSurge and maxUnavailable may not both be 0: a rollout could never start",
            check=lambda p: _can_roll(p.max_surge, p.max_unavailable),
            field_path=".maxUnavailable",
        ),
    )

    def rollout(self) -> tuple[int, int]:
        """(maxSurge, maxUnavailable) for the Deployment.

        A GPU pool replaces pods in place by default (0, 1): surging needs a spare GPU, and on
        a full cluster the surge pod would stay Pending and stall the rollout for good.
        """
        default = (0, 1) if pool_gpus(self) > 0 else (1, 0)
        surge, unavailable = self.max_surge, self.max_unavailable
        if surge is None and unavailable is None:
            return default
        if surge is None:
            return (0 if unavailable else 1), int(unavailable or 0)
        if unavailable is None:
            return surge, (0 if surge else 1)
        return surge, unavailable

    @property
    def min_size(self) -> int:
        return self.replicas if self.min_replicas is None else self.min_replicas

    @property
    def max_size(self) -> int:
        return self.replicas if self.max_replicas is None else self.max_replicas


class RouterSpec(ApiModel):
    """The router: the service's OpenAI-compatible endpoint."""

    replicas: int = Field(default=1, ge=1, le=100)
    policy: Literal["least-loaded", "round-robin", "prefix-aware"] = Field(
        default="least-loaded", description="How the router picks a worker for a request."
    )
    hold_seconds: int = Field(
        default=120,
        ge=0,
        le=3600,
        description="Seconds a request waits for a ready worker in a pool that has none (scaled"
        " to zero, waking) before a 503 with Retry-After (0: 503 at once).",
    )
    max_held_requests: int = Field(
        default=256,
        ge=1,
        le=100000,
        description="Requests held per pool at once while it has no ready worker; more get 503.",
    )


class SloSpec(ApiModel):
    """Latency targets the autoscaler sizes the pools for."""

    ttft_ms: int | None = Field(default=None, ge=1, description="Time to first token (ms).")
    tpot_ms: int | None = Field(default=None, ge=1, description="Time per output token (ms).")
    percentile: float = Field(
        default=0.9, ge=0.5, le=0.999, description="Quantile the targets apply to, e.g. 0.9."
    )


DEFAULT_INTERVAL_SECONDS = 5  # the autoscaler's decision interval (seconds)
DEFAULT_SIGNAL_WINDOW_SECONDS = 30  # the span of the autoscaler's rates and latency quantiles
# (or two intervals, when that is longer)
DEFAULT_MAX_STEP = 1  # most replicas a pool grows by per decision
DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS = 600  # idle seconds before a minReplicas-0 pool goes to 0


class AutoscalingSpec(ApiModel):
    """Per-pool autoscaling between minReplicas and maxReplicas."""

    enabled: bool = False
    interval_seconds: int = Field(
        default=DEFAULT_INTERVAL_SECONDS, ge=1, le=3600, description="Seconds per decision."
    )
    signal_window_seconds: int | None = Field(
        default=None,
        ge=2,
        le=3600,
        description="Seconds the rates and latency quantiles cover (at least intervalSeconds;"
        " hold at least four Prometheus scrapes). Unset: 30, or two intervals if longer.",
    )
    kv_cache_target: float = Field(
        default=0.7, ge=0.05, le=1.0, description="Decode KV-cache usage to aim for (0..1)."
    )
    scale_up_stabilization_seconds: int = Field(
        default=0,
        ge=0,
        le=3600,
        description="Seconds over which a pool grows only to its lowest ask (0: at once).",
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="Seconds of lower asks before a pool shrinks; a peak then fades to half"
        " over as long again.",
    )
    max_step: int = Field(
        default=DEFAULT_MAX_STEP, ge=1, le=100, description="Most replicas added per decision."
    )
    peak_headroom: float = Field(
        default=1.5,
        ge=1.0,
        le=3.0,
        description="A pool under on/off load (an ask over the down window fell to a tenth"
        " of an earlier one) keeps at least its highest ask times this (burst memory; 1: no room"
        " over that ask). A pool under steady load keeps its highest ask as it is.",
    )
    gpu_budget: int | None = Field(
        default=None,
        ge=0,
        description="Most GPUs all pools together may use (GPUs: a replica of a GPU pool"
        " counts its tensorParallelSize).",
    )
    scale_to_zero_after_seconds: int = Field(
        default=DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS,
        ge=1,
        le=86400,
        description="Seconds without requests (running, waiting or held at the router) after"
        " which a pool with minReplicas 0 goes to zero replicas.",
    )

    rules = (
        Rule(
            cel="(has(self.scaleToZeroAfterSeconds) ? self.scaleToZeroAfterSeconds :"
            f" {DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS}) >= (has(self.intervalSeconds) ?"
            f" self.intervalSeconds : {DEFAULT_INTERVAL_SECONDS})",
            message="scaleToZeroAfterSeconds must be at least intervalSeconds: idleness is"
            " seen one decision at a time",
            check=lambda a: a.scale_to_zero_after_seconds >= a.interval_seconds,
            field_path=".scaleToZeroAfterSeconds",
        ),
        Rule(
            cel="!has(self.signalWindowSeconds) || self.signalWindowSeconds >="
            f" (has(self.intervalSeconds) ? self.intervalSeconds : {DEFAULT_INTERVAL_SECONDS})",
            message="signalWindowSeconds must be at least intervalSeconds: a shorter window"
            " would skip the load between two decisions",
            check=lambda a: (
                a.signal_window_seconds is None or a.signal_window_seconds >= a.interval_seconds
            ),
            field_path=".signalWindowSeconds",
        ),
    )


def signal_window_seconds(interval_s: float, window_s: float | None) -> float:
    """The autoscaler's signal window: as set, else 30 s or two intervals if longer."""
    if window_s is not None:
        return float(window_s)
    return float(max(DEFAULT_SIGNAL_WINDOW_SECONDS, 2 * interval_s))


def _min_gpus(spec: InferenceServiceSpec) -> int:
    pools = (spec.prefill, spec.decode, spec.worker)
    return sum(p.min_size * pool_gpus(p) for p in pools if p is not None)


class AuthSpec(ApiModel):
    """Who may call the service's OpenAI API."""

    api_key_secret: SecretKeyRef = Field(
        description="Secret key holding the API keys clients must send as 'Authorization:"
        " Bearer <key>' (comma-separated: several are accepted, to replace one without a"
        " gap). The router and every worker read it (env PHASEFLEET_API_KEY); probes,"
        " /metrics and the hand-off between workers need no key."
    )


class InferenceServiceSpec(ApiModel):
    """A model served by prefill and decode pools (or one aggregated pool) behind a router."""

    model: ModelSpec
    mode: Mode = Field(default=Mode.DISAGGREGATED, description="disaggregated or aggregated.")
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec, json_schema_extra={"default": {}})
    prefill: PoolSpec | None = Field(default=None, description="Disaggregated: prompt pool.")
    decode: PoolSpec | None = Field(default=None, description="Disaggregated: token pool.")
    worker: PoolSpec | None = Field(default=None, description="Aggregated: the single pool.")
    router: RouterSpec = Field(default_factory=RouterSpec, json_schema_extra={"default": {}})
    slo: SloSpec = Field(default_factory=SloSpec, json_schema_extra={"default": {}})
    autoscaling: AutoscalingSpec = Field(
        default_factory=AutoscalingSpec, json_schema_extra={"default": {}}
    )
    lora: LoraSpec | None = Field(
        default=None, description="LoRA adapters every worker serves beside the model."
    )
    auth: AuthSpec | None = Field(
        default=None, description="API keys the router and the workers require; none: open."
    )

    rules = (
        Rule(
            cel="self.mode != 'disaggregated' || (has(self.prefill) && has(self.decode))",
            message="spec.prefill and spec.decode are required when mode is disaggregated",
            check=lambda s: s.mode != Mode.DISAGGREGATED or (s.prefill and s.decode),
        ),
        Rule(
            cel="self.mode != 'disaggregated' || !has(self.worker)",
            message="spec.worker is only allowed when mode is aggregated",
            check=lambda s: s.mode != Mode.DISAGGREGATED or s.worker is None,
            field_path=".worker",
        ),
        Rule(
            cel="self.mode != 'aggregated' || has(self.worker)",
            message="spec.worker is required when mode is aggregated",
            check=lambda s: s.mode != Mode.AGGREGATED or s.worker is not None,
        ),
        Rule(
            cel="self.mode != 'aggregated' || (!has(self.prefill) && !has(self.decode))",
            message="spec.prefill and spec.decode are only allowed when mode is disaggregated",
            check=lambda s: s.mode != Mode.AGGREGATED or (s.prefill is None and s.decode is None),
        ),
        Rule(
            cel="!has(self.lora) || ["
            + ", ".join(_cel_tensor_parallel(p) for p in ("prefill", "decode", "worker"))
            + "].all(tp, tp == 1)",
            message="spec.lora cannot be used with tensorParallelSize > 1 (adapters run on"
            " single-GPU workers only)",
            check=lambda s: (
                s.lora is None or all(p.tensor_parallel_size == 1 for p in s.pools().values())
            ),
            field_path=".lora",
        ),
        Rule(
            cel=(
                "!has(self.autoscaling) || !has(self.autoscaling.gpuBudget)"
                " || self.autoscaling.gpuBudget >= "
                + " + ".join(_cel_pool_gpus(p) for p in ("prefill", "decode", "worker"))
            ),
            message="spec.autoscaling.gpuBudget must cover the GPUs of all pools at minReplicas"
            " (each GPU pool: minReplicas x its nvidia.com/gpu limit, the tensorParallelSize)",
            check=lambda s: (
                s.autoscaling.gpu_budget is None or s.autoscaling.gpu_budget >= _min_gpus(s)
            ),
            field_path=".autoscaling.gpuBudget",
        ),
    )

    def pools(self) -> dict[Role, PoolSpec]:
        """The worker pools this spec asks for, by role."""
        candidates = {
            Role.PREFILL: self.prefill,
            Role.DECODE: self.decode,
            Role.WORKER: self.worker,
        }
        return {role: pool for role, pool in candidates.items() if pool is not None}

    def min_gpus(self) -> int:
        return _min_gpus(self)


def parse_spec(spec: dict[str, Any]) -> InferenceServiceSpec:
    """Validate a spec as read from the API server (camelCase)."""
    return InferenceServiceSpec.model_validate(spec)
