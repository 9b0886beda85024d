"""The model cache in a worker pod (pure): its volume, the init container's command, and what
the worker is told, for an InferenceService with `spec.model.cache`.

The init container (`phasefleet fetch-model`) mounts the cache read-write at CACHE_MOUNT and
downloads the repository once, under a lock every pod respects (server/model_cache.py); the
worker mounts it read-only and loads the snapshot with HF_HUB_OFFLINE=1, so it never downloads
and never writes there. Triton, inductor and huggingface_hub's other files stay in the pod's own
`/cache` emptyDir, which they must be able to write. A CPU worker (no GPU asked) also mounts the
cache's plans folder read-write at PLANS_MOUNT, where it keeps the CPU linear plans it timed,
so the pods after the first on a kind of node time nothing.
"""

from __future__ import annotations

from typing import Any

from phasefleet.api.contract import (
    CPU_LINEAR_CACHE_ENV,
    MODEL_CACHE_HUB,
    MODEL_CACHE_PLANS,
    FetchModelFlag,
)
from phasefleet.api.spec import InferenceServiceSpec, ModelCache

CACHE_VOLUME = "model-cache"
CACHE_MOUNT = "/model-cache"
PLANS_MOUNT = "/cpu-linear-plans"
PLANS_FILE = "plans.json"
CLAIM_SUFFIX = "model-cache"  # the claim the operator creates: <name>-model-cache
FETCH_CONTAINER = "fetch-model"
# The image's group (runtime_image/Dockerfile: USER 10001:10001): a cache claim gets it as the
# pod's fsGroup, so the non-root init container can write a freshly provisioned volume.
IMAGE_GID = 10001


def claim_name(owner_name: str) -> str:
    return f"{owner_name}-{CLAIM_SUFFIX}"


def cache_volume(owner_name: str, cache: ModelCache) -> dict[str, Any]:
    if cache.pvc is not None:
        return {
            "name": CACHE_VOLUME,
            "persistentVolumeClaim": {"claimName": claim_name(owner_name)},
        }
    if cache.claim_name is not None:
        return {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}}
    if cache.host_path is None:
        raise ValueError("spec.model.cache: set exactly one of pvc, claimName or hostPath")
    # Made (as root, mode 0755) where missing: the init container then says it cannot write it.
    return {
        "name": CACHE_VOLUME,
        "hostPath": {"path": cache.host_path.path, "type": "DirectoryOrCreate"},
    }


def cache_mount(read_only: bool) -> dict[str, Any]:
    return {"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT, "readOnly": read_only}


def plans_mount() -> dict[str, Any]:
    """The cache's plans folder, read-write, for a CPU worker."""
    return {"name": CACHE_VOLUME, "mountPath": PLANS_MOUNT, "subPath": MODEL_CACHE_PLANS}


def plans_env() -> dict[str, Any]:
    return {"name": CPU_LINEAR_CACHE_ENV, "value": f"{PLANS_MOUNT}/{PLANS_FILE}"}


def fetch_args(spec: InferenceServiceSpec) -> list[str]:
    """`phasefleet fetch-model` for the hf model (its revision comes in $HF_REVISION)."""
    if spec.model.hf is None:
        raise ValueError("spec.model.cache is only for spec.model.hf")
    args = [
        "fetch-model",
        FetchModelFlag.MODEL,
        spec.model.hf.repo_id,
        FetchModelFlag.CACHE,
        CACHE_MOUNT,
    ]
    hub_adapters = [a.source() for a in spec.lora.adapters if a.hf] if spec.lora else []
    if hub_adapters:  # the workers read them offline from the cache too
        args += [FetchModelFlag.ADAPTERS, *hub_adapters]
    return args


def worker_cache_env() -> list[dict[str, Any]]:
    """The worker reads the snapshot the init container completed, offline."""
    return [
        {"name": "HF_HUB_CACHE", "value": f"{CACHE_MOUNT}/{MODEL_CACHE_HUB}"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]


def pod_security_context(base: dict[str, Any], cache: ModelCache | None) -> dict[str, Any]:
    """A claim's volume is made group-writable for the image's group (only where the root
    does not already match: a 16 GB cache is not re-chowned at every start). A hostPath
    ignores fsGroup."""
    if cache is None or cache.host_path is not None:
        return base
    return {**base, "fsGroup": IMAGE_GID, "fsGroupChangePolicy": "OnRootMismatch"}
