"""From a pod's container spec to a local process (pure functions, no API calls).

A container path becomes a local path through one table, `PathMap`: each volume mount's
`mountPath` maps to that volume's local folder (an emptyDir under the pod's folder, a PVC's
hostPath PersistentVolume, ...); any other absolute path is a file of the image and maps under
the image root. The table is applied to every argument and env value that is an absolute path
(or `--flag=/path`), so `--model /models/tiny-llama` reads `<image root>/models/tiny-llama` and
`HOME=/tmp` is the pod's own tmp emptyDir. Programs that find a file by a fixed path of their
own (the ServiceAccount token) get it by a bind mount instead (`BindMount`). A `readOnly` mount's
local folder is read-only for that process (a read-only bind over itself in its own mount
namespace), so a program that writes there fails as it would in a pod; a writable mount
inside it (a subPath of the same volume) is bound writable again over it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The `command[0]` values the runner can run, and the local argv that replaces each.
# `phasefleet` is the console script; `python -m phasefleet.cli` is the same entry point.
PROGRAM_ARGV: dict[str, Callable[[str], list[str]]] = {
    "phasefleet": lambda python: [python, "-m", "phasefleet.cli"],
}
# Subcommands of `phasefleet` that listen: each gets `--host <pod IP>` appended (argparse keeps
# the last value), so every pod listens on its own address at its container port.
LISTENING_SUBCOMMANDS = frozenset({"worker", "router"})
# Where programs look by fixed path; mounted there (in the process's own mount namespace).
BIND_PREFIXES = ("/var/run/secrets/", "/run/secrets/")

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class ContainerConfigError(ValueError):
    """The container cannot be started as configured (the kubelet's
    CreateContainerConfigError): a missing Secret key, an unsupported volume or command."""


@dataclass(frozen=True)
class BindMount:
    source: Path  # local folder
    target: str  # the container path


@dataclass
class PathMap:
    image_root: Path  # the image's files: container path /x is image_root/x
    mounts: dict[str, Path] = field(default_factory=dict)  # container mountPath -> local folder

    def local(self, path: str) -> Path:
        """The local path of an absolute container path: longest mount prefix wins."""
        for prefix in sorted(self.mounts, key=len, reverse=True):
            root = prefix.rstrip("/")
            if path == root or path.startswith(f"{root}/"):
                return self.mounts[prefix] / path[len(root) :].lstrip("/")
        return self.image_root / path.lstrip("/")

    def rewrite(self, value: str) -> str:
        """An absolute path (alone or after `--flag=`) becomes local; anything else is kept."""
        if value.startswith("/"):
            return str(self.local(value))
        flag, sep, rest = value.partition("=")
        if sep and flag.startswith("-") and rest.startswith("/"):
            return f"{flag}={self.local(rest)}"
        return value


@dataclass(frozen=True)
class Probe:
    kind: str  # "http" or "tcp"
    port: int
    path: str  # http only
    period: float  # seconds between probes
    timeout: float  # seconds per probe
    failure_threshold: int
    success_threshold: int
    initial_delay: float  # seconds after the container starts


@dataclass(frozen=True)
class LaunchPlan:
    name: str  # the container's name
    argv: list[str]
    env: dict[str, str]
    binds: list[BindMount]
    startup: Probe | None
    readiness: Probe | None
    liveness: Probe | None
    pre_stop_sleep: float  # seconds of a `preStop: sleep` hook, else 0
    read_only: list[Path] = field(default_factory=list)  # readOnly mounts' local folders
    # writable mounts' local folders inside a read-only one (a subPath of a volume also mounted
    # read-only), made writable again after it
    writable: list[Path] = field(default_factory=list)


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` references: a defined variable is replaced, `$$` is a `$`, an
    undefined reference stays as written."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(replace, value)


def field_value(pod: dict[str, Any], path: str) -> str:
    """A downward API `fieldRef.fieldPath` of the pod."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.podIP": status.get("podIP", ""),
    }
    if path in simple:
        return str(simple[path])
    found = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if found:
        return str((meta.get(found.group(1)) or {}).get(found.group(2), ""))
    raise ContainerConfigError(f"fieldRef {path!r} is not supported by the pod runner")


KeyLookup = Callable[[str, str, str], str | None]  # (kind, name, key) -> value or None


def container_env(
    pod: dict[str, Any], container: dict[str, Any], lookup: KeyLookup
) -> dict[str, str]:
    """The container's `env`, in order, each `valueFrom` resolved; `lookup` reads a Secret's
    or ConfigMap's key (None when the object or key is missing)."""
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        name = item["name"]
        source = item.get("valueFrom")
        if source is None:
            env[name] = expand(item.get("value", ""), env)
            continue
        if "fieldRef" in source:
            env[name] = field_value(pod, source["fieldRef"]["fieldPath"])
            continue
        for ref_key, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
            if ref_key in source:
                ref = source[ref_key]
                value = lookup(kind, ref["name"], ref["key"])
                if value is not None:
                    env[name] = value
                elif not ref.get("optional"):
                    raise ContainerConfigError(
                        f"{kind.lower()} {ref['name']!r} has no key {ref['key']!r} "
                        f"(env {name} of container {container['name']})"
                    )
                break
        else:
            raise ContainerConfigError(f"env {name}: valueFrom {sorted(source)} not supported")
    return env


def _port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for item in container.get("ports") or []:
        if item.get("name") == port:
            return int(item["containerPort"])
    raise ContainerConfigError(f"probe port {port!r} names no port of {container['name']}")


def probe(container: dict[str, Any], key: str, max_period: float) -> Probe | None:
    """One probe of the container; its period is capped at max_period seconds (tests). A
    startup or liveness probe's failures restart the container, so its failure threshold grows
    with the cap: the time it allows (period x threshold) stays what the kubelet allows."""
    spec = container.get(key)
    if not spec:
        return None
    if "httpGet" in spec:
        kind, target = "http", spec["httpGet"]
    elif "tcpSocket" in spec:
        kind, target = "tcp", spec["tcpSocket"]
    else:
        raise ContainerConfigError(f"{key} of {container['name']}: only httpGet and tcpSocket")
    period = float(spec.get("periodSeconds", 10))
    failures = int(spec.get("failureThreshold", 3))
    capped = min(period, max_period)
    if key in ("startupProbe", "livenessProbe"):
        failures = math.ceil(failures * period / capped)
    return Probe(
        kind=kind,
        port=_port(container, target["port"]),
        path=target.get("path", "/"),
        period=capped,
        timeout=float(spec.get("timeoutSeconds", 1)),
        failure_threshold=failures,
        success_threshold=int(spec.get("successThreshold", 1)),
        initial_delay=min(float(spec.get("initialDelaySeconds", 0)), max_period),
    )


def program_argv(
    container: dict[str, Any], python: str, pod_ip: str, transform: Callable[[str], str]
) -> list[str]:
    """command + args as a local argv (each word after the program through `transform`),
    with `--host <pod IP>` for a listening subcommand."""
    command = list(container.get("command") or [])
    args = list(container.get("args") or [])
    if not command:
        raise ContainerConfigError(
            f"container {container['name']} has no command; the image's entrypoint is unknown "
            "to the pod runner"
        )
    local = PROGRAM_ARGV.get(command[0])
    if local is None:
        raise ContainerConfigError(
            f"the pod runner has no local program for command {command[0]!r} "
            f"(known: {sorted(PROGRAM_ARGV)})"
        )
    words = [transform(word) for word in [*command[1:], *args]]
    argv = [*local(python), *words]
    subcommand = words[:1]
    if subcommand and subcommand[0] in LISTENING_SUBCOMMANDS:
        argv += ["--host", pod_ip]
    return argv


def launch_plan(
    pod: dict[str, Any],
    container: dict[str, Any],
    env: dict[str, str],
    paths: PathMap,
    python: str,
    base_env: Mapping[str, str],
    max_probe_period: float,
) -> LaunchPlan:
    """The local process for one container: env already resolved (container_env)."""
    pod_ip = pod["status"]["podIP"]
    full_env = {**base_env, **env}
    argv = program_argv(
        container, python, pod_ip, lambda word: paths.rewrite(expand(word, full_env))
    )
    binds = [
        BindMount(local, target)
        for target, local in paths.mounts.items()
        if target.startswith(BIND_PREFIXES)
    ]
    mounts = [
        (paths.local(mount["mountPath"]), bool(mount.get("readOnly")))
        for mount in container.get("volumeMounts") or []
        if not mount["mountPath"].startswith(BIND_PREFIXES)
    ]
    read_only = [folder for folder, ro in mounts if ro]
    writable = [
        folder
        for folder, ro in mounts
        if not ro and any(folder.is_relative_to(other) for other in read_only)
    ]
    hook = ((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}
    return LaunchPlan(
        name=container["name"],
        argv=argv,
        env={**base_env, **{k: paths.rewrite(v) for k, v in env.items()}},
        binds=binds,
        read_only=read_only,
        writable=writable,
        startup=probe(container, "startupProbe", max_probe_period),
        readiness=probe(container, "readinessProbe", max_probe_period),
        liveness=probe(container, "livenessProbe", max_probe_period),
        pre_stop_sleep=float(hook.get("seconds", 0)),
    )
