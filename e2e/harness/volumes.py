"""A pod's volumes as local folders, made the way a kubelet makes them: emptyDirs under the
pod's folder, a PVC's bound PersistentVolume (hostPath or local), and the files of projected,
Secret and ConfigMap volumes (a ServiceAccount token comes from the TokenRequest API, bound to
the pod). Returns the container path -> local folder table (podspec.PathMap). While the pod
runs, `refresh_objects` rewrites its Secret and ConfigMap volumes' files that changed, each
replaced whole (a new file, renamed over the old), as the kubelet's sync does."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from e2e.harness.kubeapi import ApiError, KubeApi
from e2e.harness.podspec import ContainerConfigError, PathMap, field_value

DEFAULT_TOKEN_SECONDS = 3607  # what the ServiceAccount admission plugin asks for


def _get(api: KubeApi, path: str) -> Any | None:
    try:
        return api.get(path)
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def lookup_key(api: KubeApi, namespace: str, kind: str, name: str, key: str) -> str | None:
    """A Secret's or ConfigMap's value for key, or None when either is missing."""
    plural = "secrets" if kind == "Secret" else "configmaps"
    obj = _get(api, f"/api/v1/namespaces/{namespace}/{plural}/{name}")
    if obj is None:
        return None
    if kind == "Secret":
        raw = (obj.get("data") or {}).get(key)
        return None if raw is None else base64.b64decode(raw).decode()
    value = (obj.get("data") or {}).get(key)
    return None if value is None else str(value)


def _object_files(
    api: KubeApi, namespace: str, kind: str, source: dict[str, Any]
) -> dict[str, str]:
    plural = "secrets" if kind == "Secret" else "configmaps"
    name = source.get("secretName") or source.get("name")
    obj = _get(api, f"/api/v1/namespaces/{namespace}/{plural}/{name}")
    if obj is None:
        if source.get("optional"):
            return {}
        raise ContainerConfigError(f"{kind.lower()} {name!r} not found")
    data = dict(obj.get("data") or {})
    if kind == "Secret":
        data = {k: base64.b64decode(v).decode() for k, v in data.items()}
    items = source.get("items")
    if not items:
        return data
    return {item["path"]: data[item["key"]] for item in items if item["key"] in data}


def service_account_token(
    api: KubeApi, pod: dict[str, Any], audience: str | None, seconds: int
) -> str:
    meta = pod["metadata"]
    account = pod["spec"].get("serviceAccountName") or "default"
    spec: dict[str, Any] = {
        "expirationSeconds": seconds,
        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"]},
    }
    spec["boundObjectRef"]["uid"] = meta["uid"]
    if audience:
        spec["audiences"] = [audience]
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
    path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token"
    return str(api.post(path, body)["status"]["token"])


def _projected_files(api: KubeApi, pod: dict[str, Any], sources: list[Any]) -> dict[str, str]:
    namespace = pod["metadata"]["namespace"]
    files: dict[str, str] = {}
    for source in sources:
        if "serviceAccountToken" in source:
            token = source["serviceAccountToken"]
            seconds = int(token.get("expirationSeconds", DEFAULT_TOKEN_SECONDS))
            files[token["path"]] = service_account_token(api, pod, token.get("audience"), seconds)
        elif "configMap" in source:
            files.update(_object_files(api, namespace, "ConfigMap", source["configMap"]))
        elif "secret" in source:
            files.update(_object_files(api, namespace, "Secret", source["secret"]))
        elif "downwardAPI" in source:
            for item in source["downwardAPI"].get("items") or []:
                files[item["path"]] = field_value(pod, item["fieldRef"]["fieldPath"])
    return files


def _claim_folder(api: KubeApi, namespace: str, claim: str) -> Path:
    pvc = _get(api, f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
    volume = (pvc or {}).get("spec", {}).get("volumeName")
    if not volume:
        raise ContainerConfigError(f"persistentvolumeclaim {claim!r} is missing or not bound")
    pv = api.get(f"/api/v1/persistentvolumes/{volume}")["spec"]
    local = (pv.get("hostPath") or pv.get("local") or {}).get("path")
    if not local:
        raise ContainerConfigError(f"persistentvolume {volume!r} has no hostPath or local path")
    return Path(local)


def volume_folder(api: KubeApi, pod: dict[str, Any], volume: dict[str, Any], root: Path) -> Path:
    """The local folder of one pod volume, created and filled as needed."""
    namespace = pod["metadata"]["namespace"]
    folder = root / volume["name"]
    files: dict[str, str] | None = None
    if "emptyDir" in volume:
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    if "persistentVolumeClaim" in volume:
        return _claim_folder(api, namespace, volume["persistentVolumeClaim"]["claimName"])
    if "hostPath" in volume:
        return Path(volume["hostPath"]["path"])
    if "projected" in volume:
        files = _projected_files(api, pod, volume["projected"].get("sources") or [])
    elif "secret" in volume:
        files = _object_files(api, namespace, "Secret", volume["secret"])
    elif "configMap" in volume:
        files = _object_files(api, namespace, "ConfigMap", volume["configMap"])
    if files is None:
        kinds = sorted(set(volume) - {"name"})
        raise ContainerConfigError(f"volume {volume['name']!r}: {kinds} not supported")
    for relative, text in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def refresh_objects(api: KubeApi, pod: dict[str, Any], root: Path) -> int:
    """Rewrites the files of the pod's Secret and ConfigMap volumes whose content changed (a
    missing object or key leaves them as they are); returns how many."""
    namespace, changed = pod["metadata"]["namespace"], 0
    for volume in pod["spec"].get("volumes") or []:
        kind = "Secret" if "secret" in volume else "ConfigMap" if "configMap" in volume else None
        if kind is None or not (root / volume["name"]).is_dir():
            continue
        try:
            files = _object_files(api, namespace, kind, volume[kind[0].lower() + kind[1:]])
        except (ContainerConfigError, ApiError):
            continue
        for relative, text in files.items():
            path = root / volume["name"] / relative
            if path.is_file() and path.read_text() == text:
                continue
            fresh = path.with_name(f".{path.name}.new")
            fresh.write_text(text)
            fresh.replace(path)
            changed += 1
    return changed


def path_map(
    api: KubeApi,
    pod: dict[str, Any],
    container: dict[str, Any],
    volumes_root: Path,
    image_root: Path,
) -> PathMap:
    """The container's mountPath -> local folder table."""
    by_name = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    folders: dict[str, Path] = {}
    paths = PathMap(image_root)
    for mount in container.get("volumeMounts") or []:
        name = mount["name"]
        if name not in by_name:
            raise ContainerConfigError(f"volumeMount {name!r} names no volume of the pod")
        if name not in folders:
            folders[name] = volume_folder(api, pod, by_name[name], volumes_root)
        local = folders[name] / mount.get("subPath", "")
        paths.mounts[mount["mountPath"]] = local
    return paths
