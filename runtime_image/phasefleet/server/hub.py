"""Fetches a model repository from the Hugging Face Hub into the local cache.

Uses huggingface_hub's cache (`$HF_HOME/hub`): files are content-addressed blobs, a killed
download leaves `<blob>.incomplete` and the next start resumes it with an HTTP Range request,
and a cached revision needs no network at all under `HF_HUB_OFFLINE=1`. Only the files the
engine reads are fetched (ENGINE_FILES); with a weight index, only the shards it names.
Every failure becomes a `ModelFetchError` whose text is one line: what is wrong and the fix.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from huggingface_hub import HfApi, constants, get_token, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import disable_progress_bars, filter_repo_objects

from phasefleet.server.adapters import ADAPTER_FILES
from phasefleet.server.hub_fetch import Fetcher, HubFile, human_size, repo_folder

logger = logging.getLogger("phasefleet.hub")

WEIGHTS = "*.safetensors"
WEIGHT_INDEX = "model.safetensors.index.json"
# config, generation defaults, every tokenizer format transformers reads, chat templates, weights,
# and a sentence-transformers model's pooling (server/pooling.py).
ENGINE_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    WEIGHTS,
    WEIGHT_INDEX,
    "modules.json",
    "*Pooling/config.json",
]
TRUE = ("1", "ON", "YES", "TRUE")  # how huggingface_hub reads a boolean variable


@dataclass(frozen=True)
class RepoKind:
    """What a repository holds, and so which of its files are fetched."""

    what: str  # in messages: "model", "LoRA adapter"
    config: str  # the file without which the repository is not one of these
    # (repo id, commit, the repository's files) -> the files to fetch; ModelFetchError
    choose: Callable[[str, str, list[HubFile]], list[HubFile]]


class ModelFetchError(Exception):
    """A model that cannot be fetched; str() is one line naming the cause and the fix."""


def fetch_model(
    repo_id: str, revision: str | None = None, *, cache_dir: str | Path | None = None
) -> Path:
    """The snapshot folder of `repo_id` at `revision` (default: main), downloaded if needed.

    Reads HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE and the cache's place (HF_HUB_CACHE, else
    HF_HOME/hub) when called; raises ModelFetchError."""
    return _fetch(MODEL, repo_id, revision, cache_dir or _cache_folder())


def fetch_adapter(
    repo_id: str, revision: str | None = None, *, cache_dir: str | Path | None = None
) -> Path:
    """A LoRA adapter repository's snapshot folder (adapter_config.json and
    adapter_model.safetensors only), as `fetch_model` fetches a model (the same cache, the
    same environment)."""
    return _fetch(ADAPTER, repo_id, revision, cache_dir or _cache_folder())


def _fetch(kind: RepoKind, repo_id: str, revision: str | None, cache_dir: str | Path) -> Path:
    endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    cache = str(cache_dir)
    where = f"{kind.what} {repo_id}" + (f" at revision {revision}" if revision else "")
    try:
        if offline():
            folder = _from_cache(kind, repo_id, revision, cache, endpoint)
        else:
            folder = _download(kind, repo_id, revision, cache, endpoint)
    except ModelFetchError:
        raise
    except GatedRepoError as exc:
        raise ModelFetchError(_gated_message(kind, repo_id, endpoint)) from exc
    except RevisionNotFoundError as exc:
        raise ModelFetchError(
            f"{where}: the repository has no revision {revision!r}: set spec.model.hf.revision"
            " (or $HF_REVISION) to one of its branches, tags or commit hashes"
        ) from exc
    except RepositoryNotFoundError as exc:
        token_note = "the token in HF_TOKEN has no access" if get_token() else "no HF_TOKEN set"
        raise ModelFetchError(
            f"{where}: no such local folder, and no such repository on {endpoint} (or it is"
            f" private: {token_note}): check the repo id (org/name) or the folder path"
        ) from exc
    except EntryNotFoundError as exc:
        raise ModelFetchError(
            f"{where}: a file listed by {endpoint} is missing from the repository"
            f" ({exc.response.url if exc.response is not None else 'unknown file'}): retry, or pin"
            " spec.model.hf.revision to a complete commit"
        ) from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status == 401:
            raise ModelFetchError(
                f"{where}: {endpoint} rejected the token in HF_TOKEN (invalid or expired): put a"
                " valid token in the Secret that spec.model.hf.tokenSecret names"
            ) from exc
        raise ModelFetchError(
            f"{where}: {endpoint} answered HTTP {status}: retry later, or pre-fill the cache"
            " and set HF_HUB_OFFLINE=1"
        ) from exc
    except requests.RequestException as exc:
        raise ModelFetchError(
            f"{where}: the download from {endpoint} kept failing ({type(exc).__name__}); what"
            " arrived is kept in the cache and the next start resumes it: check the network"
        ) from exc
    _check_folder(kind, folder, where)
    return folder


def _cache_folder() -> str:
    """huggingface_hub's cache, from the environment now (it reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return constants.HF_HUB_CACHE


def offline() -> bool:
    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUE


def _from_cache(
    kind: RepoKind, repo_id: str, revision: str | None, cache: str, endpoint: str
) -> Path:
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=cache, local_files_only=True
        )
    except LocalEntryNotFoundError as exc:
        raise ModelFetchError(
            f"{kind.what} {repo_id}{f' at revision {revision}' if revision else ''} is not in the"
            " cache"
            f" ({cache}) and HF_HUB_OFFLINE=1 forbids downloading it from {endpoint}: unset"
            " HF_HUB_OFFLINE, or pre-fill the cache with one online start"
        ) from exc
    logger.info(
        "%s %s found in the cache: %s (offline, no network call)", kind.what, repo_id, folder
    )
    return Path(folder)


def _download(
    kind: RepoKind, repo_id: str, revision: str | None, cache: str, endpoint: str
) -> Path:
    disable_progress_bars()  # a tqdm bar is one endless line in a container log
    api = HfApi(endpoint=endpoint)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except (requests.ConnectionError, requests.Timeout) as exc:
        if isinstance(exc, requests.exceptions.SSLError | requests.exceptions.ProxyError):
            raise ModelFetchError(
                f"{kind.what} {repo_id}: cannot reach {endpoint} ({type(exc).__name__}): check the"
                " proxy and CA settings (HTTPS_PROXY, REQUESTS_CA_BUNDLE)"
            ) from exc
        logger.warning("%s is unreachable (%s); looking in the cache", endpoint, type(exc).__name__)
        try:
            return _from_cache(kind, repo_id, revision, cache, endpoint)
        except ModelFetchError:
            raise ModelFetchError(
                f"{kind.what} {repo_id} is not in the cache ({cache}) and {endpoint} is"
                " unreachable"
                f" ({type(exc).__name__}): check the pod's network egress, or pre-fill the cache"
                " and set HF_HUB_OFFLINE=1"
            ) from exc
    commit = str(info.sha)
    listed = [_hub_file(s) for s in info.siblings or []]
    wanted = kind.choose(repo_id, commit, listed)
    logger.info(
        "fetching %s %s (revision %s, commit %s) from %s",
        kind.what, repo_id, revision or constants.DEFAULT_REVISION, commit[:12], endpoint,
    )  # fmt: skip
    fetch = Fetcher(repo_id, commit, cache, endpoint)
    try:
        folder = fetch.files([f for f in wanted if not f.name.endswith(".safetensors")])
        weights = _weights(repo_id, commit, folder, wanted)
        logger.info(
            "%s: %d weight file(s), %s",
            repo_id,
            len(weights),
            human_size(sum(f.size for f in weights)),
        )
        fetch.files(weights)
    finally:
        fetch.stop()
    _write_ref(cache, repo_id, revision or constants.DEFAULT_REVISION, commit)
    logger.info("%s %s ready in %s", kind.what, repo_id, folder)
    return folder


def _write_ref(cache: str, repo_id: str, revision: str, commit: str) -> None:
    """Points `revision` at `commit` in the cache, as huggingface_hub does, so an offline start
    finds it; written after the files, so the ref only ever names a complete snapshot."""
    if revision == commit:
        return
    ref = repo_folder(cache, repo_id) / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)


def _hub_file(sibling: Any) -> HubFile:
    lfs = sibling.lfs
    size = lfs.size if lfs is not None else sibling.size
    return HubFile(sibling.rfilename, int(size or 0), lfs.sha256 if lfs else sibling.blob_id or "")


def _engine_files(repo_id: str, commit: str, listed: list[HubFile]) -> list[HubFile]:
    names = {f.name for f in listed if "/" not in f.name}  # the engine reads the top level only
    chosen = set(filter_repo_objects(sorted(names), allow_patterns=ENGINE_FILES))
    if "config.json" not in chosen:
        raise ModelFetchError(
            f"model {repo_id} (commit {commit[:12]}) has no config.json at its top level: it is"
            " not a transformers model repository; check the repo id"
        )
    if not any(name.endswith(".safetensors") for name in chosen):
        others = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".gguf", ".h5")))
        found = f" (it has {', '.join(others[:3])})" if others else ""
        raise ModelFetchError(
            f"model {repo_id} (commit {commit[:12]}) has no *.safetensors weights{found}: the"
            " engine loads safetensors only; use a revision or repository that has them"
        )
    return [f for f in listed if f.name in chosen]


def _weights(repo_id: str, commit: str, folder: Path, wanted: list[HubFile]) -> list[HubFile]:
    """The shards the index names, or every top-level *.safetensors when there is no index
    (a repository with both sharded and consolidated weights would load them twice)."""
    weights = [f for f in wanted if f.name.endswith(".safetensors")]
    index = folder / WEIGHT_INDEX
    if not index.is_file():
        return weights
    named = set(json.loads(index.read_text()).get("weight_map", {}).values())
    missing = named - {f.name for f in weights}
    if missing:
        raise ModelFetchError(
            f"model {repo_id} (commit {commit[:12]}): {WEIGHT_INDEX} names shards the repository"
            f" lacks ({', '.join(sorted(missing)[:3])}): use a complete revision"
        )
    return [f for f in weights if f.name in named]


def _check_folder(kind: RepoKind, folder: Path, where: str) -> None:
    """A cached snapshot may hold fewer files than a download would (another process's
    subset): say so instead of failing later inside transformers."""
    if not (folder / kind.config).is_file() or not any(folder.glob(WEIGHTS)):
        raise ModelFetchError(
            f"{where}: the cached snapshot {folder} lacks {kind.config} or *.safetensors: unset"
            " HF_HUB_OFFLINE for one start to complete it"
        )


def _gated_message(kind: RepoKind, repo_id: str, endpoint: str) -> str:
    if get_token() is None:
        return (
            f"{kind.what} {repo_id} is gated and no token was given: set"
            " spec.model.hf.tokenSecret to a Secret holding a token (HF_TOKEN) of an account"
            f" that was granted access at {endpoint}/{repo_id}"
        )
    return (
        f"{kind.what} {repo_id} is gated and the token in HF_TOKEN has no access to it: request"
        f" access at {endpoint}/{repo_id} with the token's account, or use a token that has it"
    )


def _adapter_files(repo_id: str, commit: str, listed: list[HubFile]) -> list[HubFile]:
    chosen = [f for f in listed if f.name in ADAPTER_FILES]
    if len(chosen) < len(ADAPTER_FILES):
        raise ModelFetchError(
            f"LoRA adapter {repo_id} (commit {commit[:12]}) lacks "
            f"{' or '.join(ADAPTER_FILES)} at its top level: it is not a PEFT LoRA adapter "
            "repository (saved with save_pretrained, safetensors); check the repo id"
        )
    return chosen


MODEL = RepoKind("model", "config.json", _engine_files)
ADAPTER = RepoKind("LoRA adapter", ADAPTER_FILES[0], _adapter_files)
