"""Downloads files of one commit of a Hub repository into huggingface_hub's cache: a few at a
time, each resumed after a broken connection, with a log line per file and per PROGRESS_STEP
percent of the bytes (no tqdm bars: in a container log they are one endless line)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import requests
from huggingface_hub import hf_hub_download

logger = logging.getLogger("phasefleet.hub")

PARALLEL_FILES = 4  # files downloaded at once
ATTEMPTS = 5  # per file; each resumes from the bytes already on disk
# A connection cut mid-file: huggingface_hub resumes some of these itself, not all.
BROKEN_DOWNLOAD = (
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
)
PROGRESS_STEP = 10  # percent of the bytes between two progress lines
PROGRESS_POLL_SECONDS = 2.0


@dataclass(frozen=True)
class HubFile:
    name: str  # path in the repository
    size: int  # bytes
    blob: str  # the cache's blob name: the LFS sha256, else the git blob id


def repo_folder(cache: str | Path, repo_id: str) -> Path:
    """huggingface_hub's folder for a model repository inside its cache."""
    return Path(cache) / f"models--{repo_id.replace('/', '--')}"


class Fetcher:
    """Downloads files of one commit a few at a time; logs a line per file and per PROGRESS_STEP
    percent of the bytes (partly downloaded blobs included)."""

    def __init__(self, repo_id: str, commit: str, cache: str, endpoint: str) -> None:
        self.repo_id, self.commit, self.cache, self.endpoint = repo_id, commit, cache, endpoint
        self.blobs = repo_folder(cache, repo_id) / "blobs"
        self.pending: list[HubFile] = []
        self.done_bytes = 0
        self.logged_step = 0
        self.total = 0
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="hub-progress", daemon=True)

    def files(self, files: list[HubFile]) -> Path:
        """Downloads `files`; returns the snapshot folder. Progress counts this call's bytes."""
        with self.lock:
            self.pending = list(files)
            self.total = sum(f.size for f in files)
            self.done_bytes = self.logged_step = 0
        if not self.watcher.is_alive():
            self.watcher.start()
        folder = repo_folder(self.cache, self.repo_id) / "snapshots" / self.commit
        with ThreadPoolExecutor(PARALLEL_FILES, thread_name_prefix="hub-download") as pool:
            futures = {pool.submit(self._one, f): f for f in files}
            for future in as_completed(futures):
                future.result()
        return folder

    def stop(self) -> None:
        self.stopped.set()
        if self.watcher.is_alive():
            self.watcher.join()

    def _one(self, file: HubFile) -> None:
        cached = (self.blobs / file.blob).is_file()
        started = time.monotonic()
        for attempt in range(1, ATTEMPTS + 1):
            try:
                hf_hub_download(
                    self.repo_id, file.name, revision=self.commit, cache_dir=self.cache,
                    endpoint=self.endpoint,
                )  # fmt: skip
                break
            except BROKEN_DOWNLOAD as exc:
                if attempt == ATTEMPTS:
                    raise
                kept = _partial_size(self.blobs / f"{file.blob}.incomplete")
                logger.warning(
                    "%s: %s broke off (%s, %s kept); resuming, attempt %d of %d",
                    self.repo_id, file.name, type(exc).__name__, human_size(kept), attempt + 1,
                    ATTEMPTS,
                )  # fmt: skip
        with self.lock:
            self.pending.remove(file)
            self.done_bytes += file.size
        how = "in the cache" if cached else f"in {time.monotonic() - started:.1f}s"
        logger.info("%s: %s (%s) %s", self.repo_id, file.name, human_size(file.size), how)

    def _watch(self) -> None:
        while not self.stopped.wait(PROGRESS_POLL_SECONDS):
            with self.lock:
                partial = sum(
                    _partial_size(self.blobs / f"{f.blob}.incomplete") for f in self.pending
                )
                got = self.done_bytes + partial
                total = self.total
                percent = int(100 * got / total) if total else 100
                step = percent // PROGRESS_STEP * PROGRESS_STEP
                if step <= self.logged_step or percent >= 100:
                    continue  # the per-file lines say when it is done
                self.logged_step = step
            logger.info(
                "%s: %d%% (%s of %s)", self.repo_id, percent, human_size(got), human_size(total)
            )


def _partial_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
