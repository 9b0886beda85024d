"""The model cache in the pod template and the claim the operator creates for it (pure)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from phasefleet.api.spec import Role
from phasefleet.operator.cache_claim import cache_claim, claim_conflict, claim_notice
from phasefleet.operator.meta import SPEC_HASH_ANNOTATION
from phasefleet.operator.model_cache import IMAGE_GID
from phasefleet.operator.workloads import worker_deployment
from tests.operator.factories import NAMESPACE, make_owner, make_spec

ROOT = Path(__file__).resolve().parents[2]
HF = {"repoId": "org/m", "revision": "v2", "tokenSecret": {"name": "hf", "key": "tok"}}
PVC_CACHE = {"pvc": {"size": "20Gi", "storageClassName": "nfs"}}


def pod(cache: dict[str, Any] | None, **pool: Any) -> dict[str, Any]:
    model: dict[str, Any] = {"hf": HF} | ({"cache": cache} if cache is not None else {})
    spec = make_spec(model=model, decode={"replicas": 2, **pool})
    return dict(worker_deployment(make_owner(), spec, Role.DECODE, 2)["spec"]["template"])


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container["volumeMounts"]}


def test_without_a_cache_each_worker_downloads_into_its_own_empty_dir() -> None:
    spec = pod(None)["spec"]
    assert "initContainers" not in spec
    assert {"name": "cache", "emptyDir": {}} in spec["volumes"]
    (worker,) = spec["containers"]
    assert "HF_TOKEN" in env(worker) and "HF_HUB_OFFLINE" not in env(worker)
    assert "fsGroup" not in spec["securityContext"]


def test_an_init_container_downloads_into_the_claim_and_the_worker_reads_it_offline() -> None:
    spec = pod(PVC_CACHE)["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "model-cache")
    assert volume == {
        "name": "model-cache",
        "persistentVolumeClaim": {"claimName": "llm-model-cache"},
    }
    (fetch,) = spec["initContainers"]
    (worker,) = spec["containers"]
    assert fetch["command"] == ["phasefleet"]
    assert fetch["args"] == ["fetch-model", "--model", "org/m", "--cache", "/model-cache"]
    assert fetch["image"] == worker["image"]
    assert mounts(fetch)["/model-cache"]["readOnly"] is False
    assert mounts(worker)["/model-cache"]["readOnly"] is True
    # Triton, inductor and huggingface_hub's own files stay writable, per pod.
    assert (
        mounts(worker)["/cache"]["name"] == "cache" and "readOnly" not in mounts(worker)["/cache"]
    )
    assert env(worker)["HF_HUB_CACHE"] == "/model-cache/hub"
    assert env(worker)["HF_HUB_OFFLINE"] == "1"
    assert env(worker)["HF_REVISION"] == env(fetch)["HF_REVISION"] == "v2"
    # Only the container that downloads gets the token, and only by reference to the Secret.
    assert "HF_TOKEN" not in env(worker)
    assert env(fetch)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "tok"}}
    assert "HF_HUB_OFFLINE" not in env(fetch)
    assert "PHASEFLEET_INTERNAL_TOKEN" not in env(fetch)
    worker_args = worker["args"]
    assert worker_args[worker_args.index("--model") + 1] == "org/m"


def test_the_init_container_is_as_locked_down_as_the_worker_and_gets_no_gpu() -> None:
    resources = {
        "requests": {"cpu": "4", "memory": "32Gi"},
        "limits": {"memory": "32Gi", "nvidia.com/gpu": 1},
    }
    spec = pod(PVC_CACHE, resources=resources)["spec"]
    (fetch,) = spec["initContainers"]
    (worker,) = spec["containers"]
    assert fetch["securityContext"] == worker["securityContext"]
    assert fetch["securityContext"]["readOnlyRootFilesystem"] is True
    assert fetch["resources"] == {
        "requests": {"cpu": "4", "memory": "32Gi"},
        "limits": {"memory": "32Gi"},
    }
    assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert "runAsUser" not in spec["securityContext"]
    # A new claim's root is root's: the image's group may write it, checked once per mount.
    assert spec["securityContext"]["fsGroup"] == IMAGE_GID
    assert spec["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


def test_a_cpu_worker_keeps_its_linear_plans_in_the_cache_and_a_gpu_worker_does_not() -> None:
    spec = pod(PVC_CACHE)["spec"]
    (worker,) = spec["containers"]
    plans = mounts(worker)["/cpu-linear-plans"]
    assert plans == {
        "name": "model-cache",
        "mountPath": "/cpu-linear-plans",
        "subPath": "cpu-linear-plans",
    }
    assert mounts(worker)["/model-cache"]["readOnly"] is True  # the rest of the cache
    assert env(worker)["PHASEFLEET_CPU_LINEAR_CACHE"] == "/cpu-linear-plans/plans.json"

    gpu = pod(PVC_CACHE, resources={"limits": {"nvidia.com/gpu": 1}})["spec"]["containers"][0]
    assert "/cpu-linear-plans" not in mounts(gpu)
    assert "PHASEFLEET_CPU_LINEAR_CACHE" not in env(gpu)
    (no_cache,) = pod(None)["spec"]["containers"]
    assert "/cpu-linear-plans" not in mounts(no_cache)
    assert "PHASEFLEET_CPU_LINEAR_CACHE" not in env(no_cache)


def test_runtime_env_naming_a_plans_file_keeps_it() -> None:
    model = {"hf": HF, "cache": PVC_CACHE}
    own = {"env": [{"name": "PHASEFLEET_CPU_LINEAR_CACHE", "value": "/plans/mine.json"}]}
    spec = make_spec(model=model, decode={"replicas": 1}, runtime=own)
    (worker,) = worker_deployment(make_owner(), spec, Role.DECODE, 1)["spec"]["template"]["spec"][
        "containers"
    ]
    assert "/cpu-linear-plans" not in mounts(worker)
    named = [e for e in worker["env"] if e["name"] == "PHASEFLEET_CPU_LINEAR_CACHE"]
    assert named == [{"name": "PHASEFLEET_CPU_LINEAR_CACHE", "value": "/plans/mine.json"}]


def test_the_image_group_is_the_runtime_images() -> None:
    dockerfile = (ROOT / "runtime_image" / "Dockerfile").read_text()
    (user,) = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.MULTILINE)
    assert int(user[1]) == IMAGE_GID


def test_an_existing_claim_or_a_node_folder_can_be_the_cache() -> None:
    spec = pod({"claimName": "shared-models"})["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "model-cache")
    assert volume["persistentVolumeClaim"] == {"claimName": "shared-models"}
    assert spec["securityContext"]["fsGroup"] == IMAGE_GID

    spec = pod({"hostPath": {"path": "/var/cache/phasefleet"}})["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "model-cache")
    assert volume["hostPath"] == {"path": "/var/cache/phasefleet", "type": "DirectoryOrCreate"}
    assert "fsGroup" not in spec["securityContext"]  # a hostPath ignores it


def test_turning_the_cache_on_rolls_the_pods() -> None:
    def digest(cache: dict[str, Any] | None) -> str:
        return str(pod(cache)["metadata"]["annotations"][SPEC_HASH_ANNOTATION])

    assert len({digest(None), digest(PVC_CACHE), digest({"claimName": "x"})}) == 3


def test_the_claim_is_owned_by_the_service_and_asks_for_the_spec() -> None:
    spec = make_spec(model={"hf": HF, "cache": PVC_CACHE})
    claim = cache_claim(make_owner(), spec)
    assert claim is not None
    assert claim["metadata"]["name"] == "llm-model-cache"
    assert claim["metadata"]["namespace"] == NAMESPACE
    (ref,) = claim["metadata"]["ownerReferences"]
    assert ref["uid"] == "uid-llm" and ref["kind"] == "InferenceService"
    assert claim["metadata"]["labels"]["phasefleet.dev/inferenceservice"] == "llm"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "20Gi"}},
        "storageClassName": "nfs",
    }
    default_class = make_spec(model={"hf": HF, "cache": {"pvc": {"size": 10**10}}})
    claim = cache_claim(make_owner(), default_class)
    assert claim is not None and "storageClassName" not in claim["spec"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "10000000000"
    assert (
        cache_claim(make_owner(), make_spec(model={"hf": HF, "cache": {"claimName": "x"}})) is None
    )


def live_claim(**spec: Any) -> dict[str, Any]:
    body = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "20480Mi"}},
        "storageClassName": "nfs",
    } | spec
    meta = {"name": "llm-model-cache", "namespace": NAMESPACE}
    meta["ownerReferences"] = [{"uid": "uid-llm"}]  # type: ignore[assignment]
    return {"kind": "PersistentVolumeClaim", "metadata": meta, "spec": body}


def test_a_claim_as_specified_gets_no_notice_however_its_size_is_written() -> None:
    pvc = make_spec(model={"hf": HF, "cache": PVC_CACHE}).model.cache.pvc  # type: ignore[union-attr]
    assert pvc is not None
    assert claim_notice(make_owner(), pvc, live_claim()) is None


def test_a_claim_that_differs_is_reported_with_the_fix_never_changed() -> None:
    pvc = make_spec(model={"hf": HF, "cache": PVC_CACHE}).model.cache.pvc  # type: ignore[union-attr]
    assert pvc is not None
    live = live_claim(resources={"requests": {"storage": "10Gi"}}, accessModes=["ReadWriteOnce"])
    notice = claim_notice(make_owner(), pvc, live)
    assert notice is not None and notice.reason == "ModelCacheDiffers"
    assert "PersistentVolumeClaim team-a/llm-model-cache has size 10Gi" in notice.message
    assert "spec.model.cache.pvc.size is 20Gi" in notice.message
    assert "access modes ReadWriteOnce where spec.model.cache.pvc.accessMode" in notice.message
    assert "never resizes or re-creates" in notice.message
    other_class = claim_notice(make_owner(), pvc, live_claim(storageClassName="standard"))
    assert other_class is not None and "StorageClass 'standard'" in other_class.message


def test_a_claim_of_that_name_the_service_does_not_own_is_a_conflict() -> None:
    foreign = live_claim()
    foreign["metadata"]["ownerReferences"] = []
    conflict = claim_conflict(make_owner(), foreign)
    assert conflict is not None and conflict.reason == "ModelCacheConflict"
    assert "does not belong to InferenceService team-a/llm" in conflict.message
    assert "spec.model.cache.claimName" in conflict.message
    going = live_claim()
    going["metadata"]["ownerReferences"] = [{"uid": "uid-of-an-older-llm"}]
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    conflict = claim_conflict(make_owner(), going)
    assert conflict is not None and "creates a new one once it is gone" in conflict.message
    assert claim_conflict(make_owner(), live_claim()) is None


LORA = {
    "maxRank": 32,
    "adapters": [
        {"name": "sql", "hf": {"repoId": "org/sql-lora", "revision": "v1"}},
        {"name": "poet", "path": "/adapters/poet"},
    ],
}


def test_lora_adapters_go_to_every_pool_and_hub_ones_to_the_init_container() -> None:
    """Both pools get the same --lora-modules (a hand-off needs the adapter on both sides);
    with a cache the init container fetches the Hub adapters too, and the workers read them
    offline, still without the token."""
    from phasefleet.cli import build_parser

    model = {"hf": HF, "cache": PVC_CACHE}
    spec = make_spec(model=model, lora=LORA)
    for role in (Role.PREFILL, Role.DECODE):
        template = worker_deployment(make_owner(), spec, role, 1)["spec"]["template"]["spec"]
        (fetch,) = template["initContainers"]
        (worker,) = template["containers"]
        args = build_parser().parse_args(worker["args"])
        assert args.lora_modules == ["sql=org/sql-lora@v1", "poet=/adapters/poet"]
        assert args.max_lora_rank == 32 and args.max_loras is None
        assert fetch["args"][-2:] == ["--adapters", "org/sql-lora@v1"]
        assert "HF_TOKEN" not in env(worker) and env(worker)["HF_HUB_OFFLINE"] == "1"
    plain = make_spec(model={"hf": HF, "cache": PVC_CACHE})
    template = worker_deployment(make_owner(), plain, Role.DECODE, 1)["spec"]["template"]["spec"]
    assert "--adapters" not in template["initContainers"][0]["args"]
    assert "--lora-modules" not in template["containers"][0]["args"]
