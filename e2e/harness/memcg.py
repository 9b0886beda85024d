"""A container's memory limit as a memory cgroup, and whether the kernel OOM-killed it.

The kubelet (through the container runtime) puts each container in a cgroup whose memory limit
is `resources.limits.memory`; when the kernel's OOM killer ends it there, the container is
reported `OOMKilled` with exit code 137. The pod runner does the same with a cgroup v1 memory
controller or a cgroup v2 hierarchy with `memory` enabled, under the runner's own cgroup. On a
machine with neither (or no right to make cgroups), limits are not enforced and the runner's
log says so once.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
REMOVE_TRIES = 20  # 0.1 s apart
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([KMGTPE]i?|k|m)?$")
_FACTORS: dict[str | None, float] = {
    None: 1,
    "m": 0.001,
    "k": 10**3,
    **{s: 1000 ** (i + 2) for i, s in enumerate("MGTPE")},
    **{f"{s}i": 1024 ** (i + 1) for i, s in enumerate("KMGTPE")},
}

log = logging.getLogger("podrunner")


def quantity_bytes(value: str) -> int:
    """A Kubernetes memory quantity ("2Gi", "512M", "1.5Gi", "1000") in bytes."""
    found = _QUANTITY.match(value.strip())
    if found is None:
        raise ValueError(f"not a memory quantity: {value!r}")
    return int(float(found.group(1)) * _FACTORS[found.group(2)])


def memory_limit(container: dict[str, object]) -> int | None:
    """`resources.limits.memory` in bytes, or None when the container has no limit."""
    resources = container.get("resources") or {}
    limits = resources.get("limits") if isinstance(resources, dict) else None
    value = limits.get("memory") if isinstance(limits, dict) else None
    return None if value is None else quantity_bytes(str(value))


def _own_cgroup_dir() -> tuple[Path, str] | None:
    """This process's memory cgroup folder and its version ("v1" or "v2"), if usable."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = CGROUP_ROOT / "memory" / path.lstrip("/")
            if (folder / "memory.limit_in_bytes").exists():
                return folder, "v1"
    for line in lines:
        if line.startswith("0::"):
            for root in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
                folder = root / line[3:].lstrip("/")
                subtree = folder / "cgroup.subtree_control"
                if subtree.exists() and "memory" in subtree.read_text().split():
                    return folder, "v2"
    return None


@dataclass
class MemoryCgroup:
    """One container's cgroup: made before each start, removed after its exit."""

    folder: Path
    version: str  # "v1" or "v2"
    limit: int  # bytes

    @classmethod
    def create(cls, name: str, limit: int) -> MemoryCgroup | None:
        found = _own_cgroup_dir()
        if found is None:
            log.warning("no writable memory cgroup here: memory limits are not enforced")
            return None
        parent, version = found
        folder = parent / name
        try:
            if folder.exists():
                folder.rmdir()
            folder.mkdir()
            knob = "memory.limit_in_bytes" if version == "v1" else "memory.max"
            (folder / knob).write_text(str(limit))
        except OSError as exc:
            log.warning("cannot make memory cgroup %s (%s): limit not enforced", folder, exc)
            return None
        return cls(folder, version, limit)

    @property
    def procs(self) -> Path:
        """Writing a pid here moves that process (and its later children) into the cgroup."""
        return self.folder / "cgroup.procs"

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer killed a process in this cgroup."""
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        try:
            text = (self.folder / name).read_text()
        except OSError:
            return False
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", "0")) > 0

    def remove(self) -> None:
        """Removes the cgroup; its last processes may take a moment to leave it."""
        remove_cgroup(self.folder)


def stray_cgroups(pods_dir: Path) -> list[Path]:
    """Cgroups a pod's `<container>.cgroup` file still names (after the runner itself died)."""
    return [Path(f.read_text().strip()) for f in pods_dir.glob("*/*.cgroup")]


def remove_cgroup(folder: Path) -> None:
    """Removes an (emptied) cgroup folder, retrying while its last processes leave it."""
    error: OSError | None = None
    for _ in range(REMOVE_TRIES):
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            error = exc
            time.sleep(0.1)
    log.warning("memory cgroup %s not removed: %s", folder, error)
