"""`phasefleet fetch-model`: a Hub model downloaded once into a cache that many pods share.

The operator runs it as the init container of every worker pod whose InferenceService has
`spec.model.cache`; the worker then reads the cache read-only and offline. Under the cache root
(the volume, e.g. /model-cache):

    hub/                                    huggingface_hub's cache (the worker's HF_HUB_CACHE)
    phasefleet/locks/models--org--name.lock the lock of one repository (cache_lock.py)
    phasefleet/complete/models--org--name@<revision>.json
                                            the marker: written last, once the files are whole
    cpu-linear-plans/                       made here; CPU workers keep their linear plans in it

A pod that finds the marker downloads nothing and takes no lock. Otherwise it waits for the
lock, looks for the marker again (the holder it waited for may have written it), downloads
what is missing (server/hub.py: a partial download of an earlier pod is resumed) and writes the
marker. A branch or tag is resolved once per cache: the marker pins the commit the first pod
got, so every pod of a service loads the same weights, however the branch moves later.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote

from phasefleet.api.contract import MODEL_CACHE_HUB, MODEL_CACHE_PLANS, FetchModelFlag
from phasefleet.server.adapters import hub_source
from phasefleet.server.cache_lock import CacheLock, LockTiming
from phasefleet.termination import fail

PROGRAM = "phasefleet fetch-model"
DEFAULT_REVISION = "main"  # huggingface_hub's, without importing it for --help

logger = logging.getLogger("phasefleet.cache")


@dataclass(frozen=True)
class Marker:
    """What the marker file holds: a complete download of one repository revision."""

    repo_id: str
    revision: str  # as asked for: a branch, tag or commit
    commit: str  # what it resolved to when downloaded
    snapshot: str  # the snapshot folder, relative to the cache root
    pod: str  # who downloaded it
    finished: float  # wall-clock seconds


@dataclass(frozen=True)
class Ensured:
    """The outcome of `ensure_model`."""

    marker: Marker
    downloaded: bool  # this process ran the download (False: the marker was there)
    waited_s: float  # seconds spent waiting for another pod's lock


def _repo_key(repo_id: str) -> str:
    return f"models--{repo_id.replace('/', '--')}"


def lock_path(root: Path, repo_id: str) -> Path:
    return root / "phasefleet" / "locks" / f"{_repo_key(repo_id)}.lock"


def marker_path(root: Path, repo_id: str, revision: str) -> Path:
    return (
        root / "phasefleet" / "complete" / f"{_repo_key(repo_id)}@{quote(revision, safe='')}.json"
    )


def read_marker(root: Path, repo_id: str, revision: str) -> Marker | None:
    """The marker of a complete download, or None (absent, or unreadable: download again)."""
    try:
        data = json.loads(marker_path(root, repo_id, revision).read_text())
        return Marker(**data)
    except (FileNotFoundError, ValueError, TypeError):
        return None


def write_marker(root: Path, marker: Marker) -> None:
    """Written beside its place and renamed: a reader sees no marker or a whole one."""
    path = marker_path(root, marker.repo_id, marker.revision)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    part.write_text(json.dumps(asdict(marker)))
    os.replace(part, path)


Fetch = Callable[[str, str, Path], Path]  # (repo id, revision, hub cache) -> snapshot folder


def adapter_from_hub(repo_id: str, revision: str, hub_cache: Path) -> Path:
    from phasefleet.server.hub import fetch_adapter

    return fetch_adapter(repo_id, revision, cache_dir=hub_cache)


def fetch_from_hub(repo_id: str, revision: str, hub_cache: Path) -> Path:
    from phasefleet.server.hub import fetch_model

    return fetch_model(repo_id, revision, cache_dir=hub_cache)


def ensure_model(
    root: Path,
    repo_id: str,
    revision: str = DEFAULT_REVISION,
    *,
    fetch: Fetch = fetch_from_hub,
    lock: CacheLock | None = None,
) -> Ensured:
    """Makes sure the cache holds `repo_id` at `revision`; raises ModelFetchError (one line)
    when the download fails, after releasing the lock (what arrived stays for the next try).
    `lock` defaults to the repository's lock in `root` (lock_path)."""
    found = read_marker(root, repo_id, revision)
    if found is not None:
        return Ensured(found, downloaded=False, waited_s=0.0)
    lock = lock or CacheLock(lock_path(root, repo_id))
    with lock:
        found = read_marker(root, repo_id, revision)  # the holder we waited for wrote it
        if found is not None:
            return Ensured(found, downloaded=False, waited_s=lock.waited_s)
        folder = fetch(repo_id, revision, root / MODEL_CACHE_HUB)
        pod = lock.holder.pod if lock.holder else ""
        marker = Marker(
            repo_id=repo_id,
            revision=revision,
            commit=folder.name,
            snapshot=str(folder.relative_to(root)),
            pod=pod,
            finished=time.time(),
        )
        write_marker(root, marker)
    return Ensured(marker, downloaded=True, waited_s=lock.waited_s)


def writable_problem(root: Path) -> str | None:
    """Why this process cannot write the cache, with the fix; None when it can."""
    try:
        (root / "phasefleet" / "locks").mkdir(parents=True, exist_ok=True)
        probe = root / "phasefleet" / f".probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        return (
            f"model cache {root} is not writable by uid {os.getuid()} ({exc.strerror}): for"
            " spec.model.cache.hostPath make the folder on each node owned by that uid"
            f" (chown {os.getuid()} PATH); for a PersistentVolumeClaim the operator sets fsGroup,"
            " which the volume's driver must honour, or chown the volume's root once"
        )
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(FetchModelFlag.MODEL, required=True, help="Hub repo id, org/name")
    parser.add_argument(
        "--revision",
        default=os.environ.get("HF_REVISION") or DEFAULT_REVISION,
        help="branch, tag or commit (default: $HF_REVISION, else main)",
    )
    parser.add_argument(
        FetchModelFlag.CACHE,
        type=Path,
        required=True,
        help=f"the shared cache folder (huggingface_hub's cache is its {MODEL_CACHE_HUB}/)",
    )
    parser.add_argument(
        FetchModelFlag.ADAPTERS,
        nargs="+",
        default=[],
        metavar="ORG/NAME[@REVISION]",
        help="LoRA adapter repositories to fetch as well (--lora-modules' Hub sources)",
    )
    parser.add_argument(
        "--stale-seconds",
        type=float,
        default=LockTiming.stale_s,
        help="seconds without a heartbeat before another pod's lock counts as abandoned",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        stale = args.stale_seconds
        timing = LockTiming(heartbeat_s=min(LockTiming.heartbeat_s, stale / 4), stale_s=stale)
    except ValueError as exc:
        return fail(PROGRAM, str(exc), code=2)
    adapters: list[tuple[str, tuple[str, str | None]]] = []  # (source, (repo, revision))
    for source in args.adapters:
        parsed = hub_source(source)
        if parsed is None:
            message = f"--adapters takes Hub repo ids org/name[@revision], got {source!r}"
            return fail(PROGRAM, message, code=2)
        adapters.append((source, parsed))
    root: Path = args.cache
    problem = writable_problem(root)
    if problem is not None:
        return fail(PROGRAM, problem)
    (root / MODEL_CACHE_PLANS).mkdir(exist_ok=True)  # the CPU workers' subPath must exist
    lock = CacheLock(lock_path(root, args.model), timing=timing)

    def on_sigterm(*_: object) -> None:  # the pod is going: let the next pod in at once
        lock.release()
        os._exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    from phasefleet.server.hub import ModelFetchError

    try:
        got = ensure_model(root, args.model, args.revision, lock=lock)
        for source, (repo, revision) in adapters:
            adapter = ensure_model(
                root, repo, revision or DEFAULT_REVISION, fetch=adapter_from_hub,
                lock=CacheLock(lock_path(root, repo), timing=timing),
            )  # fmt: skip
            logger.info("LoRA adapter %s is complete in %s", source, root / adapter.marker.snapshot)
    except ModelFetchError as exc:
        return fail(PROGRAM, str(exc))
    marker = got.marker
    how = (
        f"downloaded by this pod after waiting {got.waited_s:.0f} s"
        if got.downloaded
        else f"downloaded by pod {marker.pod or '?'}; nothing to download"
    )
    logger.info(
        "model %s at %s (commit %s) is complete in %s: %s",
        marker.repo_id, marker.revision, marker.commit[:12], root / marker.snapshot, how,
    )  # fmt: skip
    return 0
