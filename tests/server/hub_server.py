"""A local stand-in for the Hugging Face Hub's file API, for the real huggingface_hub client.

It speaks what `HfApi.model_info` and `hf_hub_download` use (huggingface_hub 0.36):
- `GET /api/models/{repo}[/revision/{rev}][?blobs=true]`: id, sha, siblings (with size,
  blobId and lfs when `blobs`), gated;
- `HEAD|GET /{repo}/resolve/{rev}/{file}`: X-Repo-Commit and ETag (the git blob id); LFS files
  (*.safetensors, *.bin) answer 302 to `/cdn/{sha256}` with X-Linked-Etag and X-Linked-Size,
  as the Hub redirects to its CDN;
- Range requests (`bytes=N-`) answered 206 with Content-Range, which resumes use;
- the Hub's error answers, classified by huggingface_hub's `hf_raise_for_status` from
  X-Error-Code / X-Error-Message: an unknown token 401 "Invalid credentials in Authorization
  header"; a missing repo RepoNotFound (401 without a token, 404 with one); a gated repo's
  files GatedRepo (401 without a token, 403 with one lacking access); RevisionNotFound and
  EntryNotFound 404.
Every request is recorded in `requests` (method, path, Range header) for tests to check;
`downloads()` counts the downloads of each repository file. While `gate` is clear, GETs of LFS
blobs wait (a download held in flight, so tests can race others against it).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin")
INFO_PATH = re.compile(r"^/api/models/(?P<repo>.+?)(?:/revision/(?P<rev>[^/]+))?$")
RESOLVE_PATH = re.compile(r"^/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
CDN_PATH = re.compile(r"^/cdn/(?P<sha>[0-9a-f]{64})$")
CHUNK = 64 * 1024


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def read_folder(folder: Path) -> dict[str, bytes]:
    """A folder's files by relative path, as a repository revision."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@dataclass
class FakeRepo:
    revisions: dict[str, dict[str, bytes]]  # branch or tag -> files (path -> bytes)
    gated: bool = False
    allowed_tokens: set[str] = field(default_factory=set)  # tokens granted access when gated

    def commit(self, revision: str) -> str | None:
        """The 40-hex commit of a branch, tag or commit hash; None when unknown."""
        for name, files in self.revisions.items():
            sha = hashlib.sha1(name.encode() + json.dumps(sorted(files)).encode()).hexdigest()
            if revision in (name, sha):
                return sha
        return None

    def files(self, revision: str) -> dict[str, bytes]:
        for name, files in self.revisions.items():
            if self.commit(name) == self.commit(revision):
                return files
        raise KeyError(revision)


@dataclass
class Recorded:
    method: str
    path: str
    range: str | None


class FakeHub:
    """Serves `repos` on 127.0.0.1 (a free port) in a thread; `url` goes into HF_ENDPOINT."""

    def __init__(self, repos: dict[str, FakeRepo], tokens: set[str] | None = None) -> None:
        self.repos = repos
        self.tokens = tokens or set()  # every token the Hub knows (others get 401)
        self.requests: list[Recorded] = []
        self.blobs: dict[str, bytes] = {}  # sha256 -> bytes, what /cdn serves
        # sha256 -> bytes to send before stalling the next GET of that blob (one-shot)
        self.stall_after: dict[str, int] = {}
        self.release = threading.Event()  # ends a stalled response (the connection is closed)
        self.gate = threading.Event()  # clear: GETs of LFS blobs wait until it is set again
        self.gate.set()
        for repo in repos.values():
            for files in repo.revisions.values():
                self.blobs.update({hashlib.sha256(d).hexdigest(): d for d in files.values()})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.release.set()
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def gets(self) -> list[str]:
        """Paths of the GET requests that fetched file contents (resolve or CDN)."""
        return [r.path for r in self.requests if r.method == "GET" and "/api/" not in r.path]

    def fetched_files(self) -> set[str]:
        """Repository files whose contents were downloaded (CDN blobs mapped back to names)."""
        return set(self.downloads())

    def downloads(self) -> Counter[str]:
        """How many times each repository file's contents were requested (a resumed download
        counts again)."""
        names = {}
        for repo in self.repos.values():
            for files in repo.revisions.values():
                names.update({hashlib.sha256(d).hexdigest(): n for n, d in files.items()})
        fetched: Counter[str] = Counter()
        for path in self.gets():
            cdn = CDN_PATH.match(path)
            resolve = RESOLVE_PATH.match(path)
            if cdn:
                fetched[names[cdn["sha"]]] += 1
            elif resolve and not resolve["file"].endswith(LFS_SUFFIXES):
                fetched[unquote(resolve["file"])] += 1
        return fetched


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = urlsplit(self.path).path
            hub.requests.append(Recorded(self.command, path, self.headers.get("Range")))
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ") or None
            if token is not None and token not in hub.tokens:
                return self._error(401, None, "Invalid credentials in Authorization header")
            if cdn := CDN_PATH.match(path):
                return self._bytes(hub.blobs[cdn["sha"]], body, {}, stall_key=cdn["sha"])
            if info := INFO_PATH.match(path):
                return self._info(info["repo"], unquote(info["rev"] or "main"), token)
            if resolve := RESOLVE_PATH.match(path):
                file = unquote(resolve["file"])
                return self._resolve(resolve["repo"], unquote(resolve["rev"]), file, token, body)
            self._error(404, None, "Not found")

        def _repo(self, repo_id: str, token: str | None) -> FakeRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404 if token else 401, "RepoNotFound", "Repository not found")
            return repo

        def _info(self, repo_id: str, revision: str, token: str | None) -> None:
            repo = self._repo(repo_id, token)
            if repo is None:
                return
            commit = repo.commit(revision)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            blobs = "blobs=true" in (urlsplit(self.path).query or "").lower()
            siblings = []
            for name, data in sorted(repo.files(commit).items()):
                sibling: dict[str, Any] = {"rfilename": name}
                if blobs:
                    sibling |= {"size": len(data), "blobId": git_blob_id(data)}
                    if name.endswith(LFS_SUFFIXES):
                        sha = hashlib.sha256(data).hexdigest()
                        sibling["lfs"] = {"size": len(data), "sha256": sha, "pointerSize": 134}
                siblings.append(sibling)
            gated: Any = "manual" if repo.gated else False
            document = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False}
            document |= {"gated": gated, "siblings": siblings}
            data = json.dumps(document).encode()
            self._bytes(data, True, {"Content-Type": "application/json"})

        def _resolve(
            self, repo_id: str, revision: str, file: str, token: str | None, body: bool
        ) -> None:
            repo = self._repo(repo_id, token)
            if repo is None:
                return
            if repo.gated and token not in repo.allowed_tokens:
                if token is None:
                    message = f"Access to model {repo_id} is restricted. You must be authenticated."
                    return self._error(401, "GatedRepo", message)
                message = f"Access to model {repo_id} is restricted and you are not in the list."
                return self._error(403, "GatedRepo", message)
            commit = repo.commit(revision)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            data = repo.files(commit).get(file)
            if data is None:
                headers = {"X-Repo-Commit": commit}
                return self._error(404, "EntryNotFound", "Entry not found", headers)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{git_blob_id(data)}"'}
            if file.endswith(LFS_SUFFIXES):
                sha = hashlib.sha256(data).hexdigest()
                headers |= {
                    "Location": f"{hub.url}/cdn/{sha}",
                    "X-Linked-Etag": f'"{sha}"',
                    "X-Linked-Size": str(len(data)),
                    "Content-Length": "0",
                }
                self.send_response(302)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                return
            self._bytes(data, body, headers)

        def _bytes(
            self, data: bytes, body: bool, headers: dict[str, str], stall_key: str | None = None
        ) -> None:
            start = 0
            ranged = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
            if ranged:
                start = int(ranged[1])
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(data) - start))
            self.send_header("Accept-Ranges", "bytes")
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if not body:
                return
            if stall_key is not None:
                hub.gate.wait(120)
            stall = hub.stall_after.pop(stall_key, None) if stall_key else None
            payload = data[start:] if stall is None else data[start : start + stall]
            for offset in range(0, len(payload), CHUNK):
                self.wfile.write(payload[offset : offset + CHUNK])
            if stall is not None:
                self.wfile.flush()
                hub.release.wait(60)  # the client is killed meanwhile; then the cut is seen
                self.close_connection = True

        def _error(
            self, status: int, code: str | None, message: str, headers: dict[str, str] | None = None
        ) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code is not None:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler
