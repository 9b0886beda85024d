"""The PersistentVolumeClaim the operator creates for `spec.model.cache.pvc` (pure).

Created once, owned by the InferenceService (the garbage collector deletes it with the service),
and never applied again: a claim cannot shrink, growing it depends on its StorageClass, and
re-creating it would throw the download away. So a live claim that differs from the spec is
reported (`claim_notice`: Degraded, the pods keep the claim they have), and a claim of that
name the service does not own is never used (`claim_conflict`: the pass stops there).
"""

from __future__ import annotations

from typing import Any

from phasefleet.api.base import quantity
from phasefleet.api.spec import CacheClaim, InferenceServiceSpec
from phasefleet.operator.meta import Owner, is_owned_by, metadata
from phasefleet.operator.model_cache import CLAIM_SUFFIX, claim_name
from phasefleet.operator.status import Problem

KIND = "PersistentVolumeClaim"


def cache_claim(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """The claim to create, or None when the spec asks for none."""
    cache = spec.model.cache
    if cache is None or cache.pvc is None:
        return None
    claim_spec: dict[str, Any] = {
        "accessModes": [cache.pvc.access_mode],
        "resources": {"requests": {"storage": str(cache.pvc.size)}},
    }
    if cache.pvc.storage_class_name is not None:
        claim_spec["storageClassName"] = cache.pvc.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": KIND,
        "metadata": metadata(owner, claim_name(owner.name), CLAIM_SUFFIX),
        "spec": claim_spec,
    }


def claim_conflict(owner: Owner, live: dict[str, Any]) -> Problem | None:
    """A claim of the cache's name that this service does not own: never mounted or changed."""
    if is_owned_by(live, owner):
        return None
    ref = f"{KIND} {owner.namespace}/{live['metadata']['name']}"
    if live["metadata"].get("deletionTimestamp"):
        why = "is being deleted (an earlier InferenceService of this name owned it)"
        fix = "the operator creates a new one once it is gone"
    else:
        why = f"exists and does not belong to InferenceService {owner.namespace}/{owner.name}"
        fix = (
            "delete it, or to use it as the cache set spec.model.cache.claimName to its name"
            " instead of spec.model.cache.pvc"
        )
    return Problem("ModelCacheConflict", f"{ref} {why}; {fix}")


def claim_notice(owner: Owner, cache: CacheClaim, live: dict[str, Any]) -> Problem | None:
    """How the service's own claim differs from spec.model.cache.pvc, if it does."""
    spec = live.get("spec") or {}
    asked = ((spec.get("resources") or {}).get("requests") or {}).get("storage")
    differences = []
    if quantity(asked) != quantity(cache.size):
        differences.append(f"size {asked} where spec.model.cache.pvc.size is {cache.size}")
    modes = spec.get("accessModes") or []
    if modes != [cache.access_mode]:
        differences.append(
            f"access modes {', '.join(modes) or 'none'} where spec.model.cache.pvc.accessMode"
            f" is {cache.access_mode}"
        )
    live_class = spec.get("storageClassName")
    if cache.storage_class_name is not None and live_class != cache.storage_class_name:
        differences.append(
            f"StorageClass {live_class!r} where spec.model.cache.pvc.storageClassName is"
            f" {cache.storage_class_name!r}"
        )
    if not differences:
        return None
    ref = f"{KIND} {owner.namespace}/{live['metadata']['name']}"
    return Problem(
        "ModelCacheDiffers",
        f"{ref} has {'; '.join(differences)}; the pods keep using it, as the operator never"
        " resizes or re-creates a cache: set the spec back, expand the claim yourself (kubectl"
        f" patch, if its StorageClass allows expansion), or delete it to have it re-created"
        " empty",
    )
