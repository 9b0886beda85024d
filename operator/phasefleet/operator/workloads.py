"""Pod templates and Deployments for the worker pools and the router (pure functions)."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from phasefleet.api.base import quantity
from phasefleet.api.contract import (
    API_KEY_FILE,
    API_KEY_FILE_ENV,
    API_KEY_MOUNT,
    CPU_LINEAR_CACHE_ENV,
    HEALTH_PATH,
    INTERNAL_TOKEN_ENV,
    INTERNAL_TOKEN_KEY,
    LIVENESS_PATH,
    POOL_ENGINE_ROLE,
    ROUTER_PORT,
    WORKER_PORT,
    RouterFlag,
    WorkerFlag,
    late_after_ms,
)
from phasefleet.api.spec import InferenceServiceSpec, PoolSpec, Role, pool_gpus
from phasefleet.operator.meta import (
    ROUTER,
    SPEC_HASH_ANNOTATION,
    Owner,
    child_name,
    labels,
    metadata,
    selector,
)
from phasefleet.operator.model_cache import (
    FETCH_CONTAINER,
    cache_mount,
    cache_volume,
    fetch_args,
    plans_env,
    plans_mount,
    pod_security_context,
    worker_cache_env,
)

MODEL_MOUNT = "/models"  # where a PVC source is mounted, read-only
CACHE_DIR = (
    "/cache"  # emptyDir: Hugging Face downloads (without spec.model.cache), Triton, inductor
)
PRESTOP_SLEEP_SECONDS = 5  # endpoints and the router drop the pod before SIGTERM arrives
DRAIN_MARGIN_SECONDS = 5  # between the worker giving up on requests and SIGKILL
WORKER_STARTUP_SECONDS = 900  # weights may take minutes to download and load
ROUTER_STARTUP_SECONDS = 60
IMAGE_PULL_SECONDS = 600  # allowance for pulling a CUDA-sized image before the startup probe
PROBE_PERIOD_SECONDS = 10  # startup and liveness
PROBE_TIMEOUT_SECONDS = 5  # an engine busy with a long step still answers /health within this
READINESS_PERIOD_SECONDS = 5
READINESS_TIMEOUT_SECONDS = 3
ROUTER_GRACE_SECONDS = 30
# /dev/shm per rank of a tensor-parallel GPU pod: NCCL's shared-memory transport between the
# pod's GPUs (its buffers, a few MB per channel and peer) with room to spare. A CPU pod gets no
# bound: its ranks' KV pools live there (rank 0 reads them), counted in its memory limit.
SHM_GIB_PER_RANK = 1
# A container's fatal error, one line (phasefleet.termination writes it), becomes its
# lastState.terminated.message, which status quotes in Degraded; a container that dies without
# writing one gets the tail of its log there instead.
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"

# Runs as the image's own user (runtime_image/Dockerfile: USER 10001:10001, numeric so the
# kubelet can check runAsNonRoot); setting a uid here would have to be kept in step with it.
POD_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
API_KEY_VOLUME = "api-keys"  # spec.auth.apiKeySecret, mounted at API_KEY_MOUNT


def spec_hash(*parts: Any) -> str:
    """Short stable hash of JSON-able inputs; a change rolls the pods."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def served_name(name: str, spec: InferenceServiceSpec) -> str:
    return spec.model.served_name or name


def model_argument(spec: InferenceServiceSpec) -> str:
    """What the worker gets as --model: a folder path or a Hugging Face repo id."""
    model = spec.model
    if model.pvc is not None:
        return f"{MODEL_MOUNT}/{model.pvc.path.strip('/')}".rstrip("/")
    if model.image is not None:
        return model.image.path
    if model.hf is None:
        raise ValueError("spec.model: set exactly one model source: pvc, image or hf")
    return model.hf.repo_id


def drain_timeout(pool: PoolSpec) -> int:
    """Seconds in-flight requests get after SIGTERM, inside the grace period."""
    left = pool.termination_grace_period_seconds - PRESTOP_SLEEP_SECONDS - DRAIN_MARGIN_SECONDS
    return max(left, 1)


def worker_args(name: str, spec: InferenceServiceSpec, role: Role, pool: PoolSpec) -> list[str]:
    args = [
        "worker",
        WorkerFlag.MODEL, model_argument(spec),
        WorkerFlag.SERVED_MODEL_NAME, served_name(name, spec),
        WorkerFlag.ROLE, POOL_ENGINE_ROLE[role.value].value,
        WorkerFlag.PORT, str(WORKER_PORT),
        WorkerFlag.MAX_NUM_BATCHED_TOKENS, str(pool.max_num_batched_tokens),
        WorkerFlag.MAX_NUM_SEQS, str(pool.max_num_seqs),
        WorkerFlag.BLOCK_SIZE, str(spec.runtime.block_size),
        WorkerFlag.DRAIN_TIMEOUT, str(drain_timeout(pool)),
        WorkerFlag.KV_LEASE_SECONDS, str(spec.runtime.kv_lease_seconds),
        WorkerFlag.REMOTE_PREFILL_MIN_TOKENS, str(spec.runtime.remote_prefill_min_tokens),
    ]  # fmt: skip
    if spec.model.dtype != "auto":
        args += [WorkerFlag.DTYPE, spec.model.dtype]
    if spec.model.max_model_len is not None:
        args += [WorkerFlag.MAX_MODEL_LEN, str(spec.model.max_model_len)]
    if not spec.runtime.enable_prefix_caching:
        args.append(WorkerFlag.NO_PREFIX_CACHING)
    host_kv = host_kv_cache_bytes(spec)
    if host_kv:  # every pool: a prefill worker's prefix cache gains as a decode worker's does
        args += [WorkerFlag.HOST_KV_CACHE_GIB, repr(host_kv / 2**30)]
    if spec.runtime.kv_cache_dtype != "auto":  # every pool: a hand-off keeps the bytes as they are
        args += [WorkerFlag.KV_CACHE_DTYPE, spec.runtime.kv_cache_dtype]
    if pool.tensor_parallel_size > 1:
        args += [WorkerFlag.TENSOR_PARALLEL_SIZE, str(pool.tensor_parallel_size)]
    if role is Role.DECODE and spec.runtime.adaptive_phase_boundary:
        args.append(WorkerFlag.ADAPTIVE_PHASE_BOUNDARY)  # the decode worker's decision
    if spec.runtime.scheduling_policy != "fcfs":  # every pool: the prefill side ranks it too
        args += [WorkerFlag.SCHEDULING_POLICY, spec.runtime.scheduling_policy]
    if spec.runtime.num_speculative_tokens:  # a prefill-only request never takes drafts
        args += [WorkerFlag.NUM_SPECULATIVE_TOKENS, str(spec.runtime.num_speculative_tokens)]
    if spec.runtime.tool_call_parser is not None:  # every pool alike: one pod template shape
        args += [WorkerFlag.TOOL_CALL_PARSER, spec.runtime.tool_call_parser]
    if spec.runtime.reasoning_parser is not None:
        args += [WorkerFlag.REASONING_PARSER, spec.runtime.reasoning_parser]
    if spec.lora is not None:  # every pool: a hand-off needs the adapter on both sides
        args += [WorkerFlag.LORA_MODULES, *(f"{a.name}={a.source()}" for a in spec.lora.adapters)]
        args += [WorkerFlag.MAX_LORA_RANK, str(spec.lora.max_rank)]
        if spec.lora.max_loras is not None:
            args += [WorkerFlag.MAX_LORAS, str(spec.lora.max_loras)]
    return args + list(spec.runtime.extra_args)


def host_kv_cache_bytes(spec: InferenceServiceSpec) -> int:
    """Bytes of the prefix cache's host tier per worker (spec.runtime.hostKvCacheSize), 0: off."""
    size = spec.runtime.host_kv_cache_size
    amount = quantity(size) if size is not None else None
    return int(amount) if amount is not None else 0


def worker_resources(spec: InferenceServiceSpec, pool: PoolSpec) -> dict[str, Any]:
    """The pool's resources, with the host tier added to the memory it requests and limits
    where it sets them; a pool that requests no memory requests the tier alone, so that the
    scheduler reserves it on the node (no limit is invented)."""
    resources = pool.resources.to_wire()
    extra = host_kv_cache_bytes(spec)
    if extra:
        for kind in ("requests", "limits"):
            memory = quantity(resources.get(kind, {}).get("memory"))
            if memory is not None:
                resources[kind]["memory"] = str(int(memory) + extra)
        resources.setdefault("requests", {}).setdefault("memory", str(extra))
    return {k: v for k, v in resources.items() if v}


def internal_token_secret_name(owner_name: str) -> str:
    return f"{owner_name}-internal"


def internal_token_env(owner_name: str) -> dict[str, Any]:
    """The service's internal token, from the Secret the operator created for it."""
    ref = {"name": internal_token_secret_name(owner_name), "key": INTERNAL_TOKEN_KEY}
    return {"name": INTERNAL_TOKEN_ENV, "valueFrom": {"secretKeyRef": ref}}


def api_key_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """Where the router and the workers read the service's API keys: the user's Secret,
    mounted (api_key_volume), so an edit reaches running pods without a restart."""
    if spec.auth is None:
        return []
    return [{"name": API_KEY_FILE_ENV, "value": f"{API_KEY_MOUNT}/{API_KEY_FILE}"}]


def api_key_volume(spec: InferenceServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): the Secret's one key as the file API_KEY_FILE, read-only; none
    without spec.auth."""
    if spec.auth is None:
        return [], []
    secret = spec.auth.api_key_secret
    items = [{"key": secret.key, "path": API_KEY_FILE}]
    volume = {"name": API_KEY_VOLUME, "secret": {"secretName": secret.name, "items": items}}
    return [volume], [{"name": API_KEY_VOLUME, "mountPath": API_KEY_MOUNT, "readOnly": True}]


def _hub_env(spec: InferenceServiceSpec, token: bool) -> list[dict[str, Any]]:
    """HF_REVISION, and HF_TOKEN by reference to its Secret (only for whoever downloads)."""
    hf = spec.model.hf
    env: list[dict[str, Any]] = []
    if hf is not None and hf.revision:
        env.append({"name": "HF_REVISION", "value": hf.revision})
    if token and hf is not None and hf.token_secret is not None:
        ref = {"name": hf.token_secret.name, "key": hf.token_secret.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    return env


def _home_env() -> list[dict[str, Any]]:
    return [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
    ]


def _env(owner_name: str, spec: InferenceServiceSpec, pool: PoolSpec) -> list[dict[str, Any]]:
    """The worker's environment. With a model cache it reads the cache offline and gets no
    token: the init container downloads (the model and the LoRA adapters from the Hub)."""
    cached = spec.model.cache is not None
    env: list[dict[str, Any]] = [
        *_home_env(),
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{CACHE_DIR}/inductor"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        internal_token_env(owner_name),
        *api_key_env(spec),
        *(worker_cache_env() if cached else []),
        *([plans_env()] if _shared_plans(spec, pool) else []),
        *_hub_env(spec, token=not cached),
    ]
    env += [e.to_wire() for e in spec.runtime.env]
    return env


def _shared_plans(spec: InferenceServiceSpec, pool: PoolSpec) -> bool:
    """A CPU pool with a model cache keeps its CPU linear plans there, unless runtime.env
    names its own plans file."""
    own = any(e.name == CPU_LINEAR_CACHE_ENV for e in spec.runtime.env)
    return spec.model.cache is not None and pool_gpus(pool) == 0 and not own


def shm_volume(pool: PoolSpec) -> dict[str, Any]:
    """The memory-backed /dev/shm; a tensor-parallel GPU pod's is bounded, per rank."""
    empty_dir: dict[str, Any] = {"medium": "Memory"}
    if pool.tensor_parallel_size > 1 and pool_gpus(pool) > 0:
        empty_dir["sizeLimit"] = f"{SHM_GIB_PER_RANK * pool.tensor_parallel_size}Gi"
    return {"name": "shm", "emptyDir": empty_dir}


def _volumes(
    owner_name: str, spec: InferenceServiceSpec, pool: PoolSpec
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        shm_volume(pool),
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    if spec.model.pvc is not None:
        claim = {"claimName": spec.model.pvc.claim_name, "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    if spec.model.cache is not None:
        volumes.append(cache_volume(owner_name, spec.model.cache))
        mounts.append(cache_mount(read_only=True))
    if _shared_plans(spec, pool):
        mounts.append(plans_mount())
    key_volumes, key_mounts = api_key_volume(spec)
    return volumes + key_volumes, mounts + key_mounts


def fetch_container(owner_name: str, spec: InferenceServiceSpec, pool: PoolSpec) -> dict[str, Any]:
    """The init container that fills the model cache (once per cache, under its lock). It gets
    the pool's CPU and memory (so the pod asks for no more than its worker does), no GPU, and
    the token; a failed download is its termination message, which status quotes."""
    env = [
        *_home_env(),
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        *_hub_env(spec, token=True),
        *(e.to_wire() for e in spec.runtime.env),
    ]
    resources = pool.resources.to_wire()
    kept = {
        kind: {k: v for k, v in values.items() if k in ("cpu", "memory")}
        for kind, values in resources.items()
    }
    return {
        "name": FETCH_CONTAINER,
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["phasefleet"],
        "args": fetch_args(spec),
        "env": env,
        "resources": {k: v for k, v in kept.items() if v},
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": CACHE_DIR},
            cache_mount(read_only=False),
        ],
        "securityContext": CONTAINER_SECURITY_CONTEXT,
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
    }


# Startup and readiness wait for /health (ready for work); liveness asks only whether the
# process is broken or stuck, so a loading or draining pod is never restarted.
STARTUP_PATH = READINESS_PATH = HEALTH_PATH


def _probes(startup_seconds: int) -> dict[str, Any]:
    """Startup, readiness and liveness probes, each with an explicit timeout.

    Liveness starts once the startup probe passes and is not stretched by the grace period:
    the kubelet stops liveness probes once a pod is terminating, so a draining worker (503 on
    /health) is never restarted; a wedged one is restarted after 3 x 10 s.
    """

    def probe(path: str, period: int, timeout: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": path, "port": "http"},
            "periodSeconds": period,
            "timeoutSeconds": timeout,
            "failureThreshold": failures,
        }

    startup_failures = math.ceil(startup_seconds / PROBE_PERIOD_SECONDS)
    return {
        "startupProbe": probe(
            STARTUP_PATH, PROBE_PERIOD_SECONDS, PROBE_TIMEOUT_SECONDS, startup_failures
        ),
        "readinessProbe": probe(
            READINESS_PATH, READINESS_PERIOD_SECONDS, READINESS_TIMEOUT_SECONDS, 2
        ),
        "livenessProbe": probe(LIVENESS_PATH, PROBE_PERIOD_SECONDS, PROBE_TIMEOUT_SECONDS, 3),
    }


def progress_deadline(startup_seconds: int) -> int:
    """Seconds before a rollout counts as stuck: an image pull plus the whole startup budget.

    Kubernetes' default (600 s) is shorter than a worker's startup probe allows, so a slow
    but healthy model load would be reported as ProgressDeadlineExceeded.
    """
    return IMAGE_PULL_SECONDS + startup_seconds


def _pod_template(
    owner: Owner,
    role: str,
    container: dict[str, Any],
    pod_spec: dict[str, Any],
    template_hash: str,
    port: int,
) -> dict[str, Any]:
    annotations = {
        SPEC_HASH_ANNOTATION: template_hash,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }
    container = {
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "securityContext": CONTAINER_SECURITY_CONTEXT,
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
        **container,
    }
    return {
        "metadata": {"labels": labels(owner.name, role), "annotations": annotations},
        "spec": {
            "securityContext": POD_SECURITY_CONTEXT,  # pod_spec may widen it (model_cache)
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            **pod_spec,
            "containers": [container],
        },
    }


def _deployment(
    owner: Owner,
    role: str,
    replicas: int | None,
    template: dict[str, Any],
    rollout: tuple[int, int],
    startup_seconds: int,
) -> dict[str, Any]:
    name = child_name(owner.name, role)
    meta = metadata(owner, name, role)
    meta["annotations"] = {
        SPEC_HASH_ANNOTATION: template["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            **({} if replicas is None else {"replicas": replicas}),
            "selector": {"matchLabels": selector(owner.name, role)},
            "progressDeadlineSeconds": progress_deadline(startup_seconds),
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": rollout[0], "maxUnavailable": rollout[1]},
            },
            "template": template,
        },
    }


def worker_deployment(
    owner: Owner, spec: InferenceServiceSpec, role: Role, replicas: int | None
) -> dict[str, Any]:
    """The Deployment of one worker pool; `replicas` comes from `pool_replicas` (None: left
    out, the autoscaler owns it)."""
    pool = spec.pools()[role]
    volumes, mounts = _volumes(owner.name, spec, pool)
    container = {
        "name": "engine",
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["phasefleet"],
        "args": worker_args(owner.name, spec, role, pool),
        "env": _env(owner.name, spec, pool),
        "resources": worker_resources(spec, pool),
        "volumeMounts": mounts,
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        **_probes(WORKER_STARTUP_SECONDS),
    }
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": pool.termination_grace_period_seconds,
        "volumes": volumes,
    }
    if spec.model.cache is not None:
        pod_spec["securityContext"] = pod_security_context(POD_SECURITY_CONTEXT, spec.model.cache)
        pod_spec["initContainers"] = [fetch_container(owner.name, spec, pool)]
    if pool.node_selector:
        pod_spec["nodeSelector"] = pool.node_selector
    if pool.tolerations:
        pod_spec["tolerations"] = [t.to_wire() for t in pool.tolerations]
    if pool.affinity:
        pod_spec["affinity"] = pool.affinity
    unrolled = {"replicas", "min_replicas", "max_replicas", "max_surge", "max_unavailable"}
    if pool.tensor_parallel_size == 1:  # as before the field existed: an upgrade rolls nothing
        unrolled.add("tensor_parallel_size")
    pool_inputs = pool.model_dump(exclude=unrolled)
    digest = spec_hash(spec.model.model_dump(), spec.runtime.model_dump(), pool_inputs)
    template = _pod_template(owner, role.value, container, pod_spec, digest, WORKER_PORT)
    return _deployment(
        owner, role.value, replicas, template, pool.rollout(), WORKER_STARTUP_SECONDS
    )


def worker_service_address(owner: Owner, role: Role) -> str:
    """host:port of a pool's headless Service; its DNS name lists every ready worker."""
    return f"{child_name(owner.name, role.value)}.{owner.namespace}.svc:{WORKER_PORT}"


def router_args(owner: Owner, spec: InferenceServiceSpec) -> list[str]:
    args = [
        "router",
        RouterFlag.PORT, str(ROUTER_PORT),
        RouterFlag.SERVED_MODEL_NAME, served_name(owner.name, spec),
        RouterFlag.POLICY, spec.router.policy,
        RouterFlag.HOLD_SECONDS, str(spec.router.hold_seconds),
        RouterFlag.MAX_HELD_REQUESTS, str(spec.router.max_held_requests),
    ]  # fmt: skip
    for role in spec.pools():
        args += [RouterFlag.pool_service(role.value), worker_service_address(owner, role)]
    late_after = late_after_ms(spec.slo.ttft_ms)
    if spec.runtime.late_prompts_last and late_after is not None:
        args += [RouterFlag.LATE_AFTER_MS, str(late_after)]  # per request: no worker rolls
    tpot = spec.slo.tpot_ms if spec.runtime.adaptive_phase_boundary else None
    if Role.DECODE in spec.pools() and tpot is not None:  # the decode workers' phase boundary
        args += [RouterFlag.TPOT_TARGET_MS, str(tpot)]
    return args


def router_deployment(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    key_volumes, key_mounts = api_key_volume(spec)
    container = {
        "name": "router",
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["phasefleet"],
        "args": router_args(owner, spec),
        "env": [
            {"name": "HOME", "value": "/tmp"},
            internal_token_env(owner.name),
            *api_key_env(spec),
        ],
        "resources": {
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"memory": "1Gi"},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *key_mounts],
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        **_probes(ROUTER_STARTUP_SECONDS),
    }
    pod_spec = {
        "terminationGracePeriodSeconds": ROUTER_GRACE_SECONDS,
        "volumes": [{"name": "tmp", "emptyDir": {}}, *key_volumes],
        # The router reads its pools' EndpointSlices with this account's token (and only it).
        "serviceAccountName": child_name(owner.name, ROUTER),
        "automountServiceAccountToken": True,
    }
    digest = spec_hash(container)
    template = _pod_template(owner, ROUTER, container, pod_spec, digest, ROUTER_PORT)
    return _deployment(
        owner, ROUTER, spec.router.replicas, template, (1, 0), ROUTER_STARTUP_SECONDS
    )
