"""The shared model cache: `phasefleet fetch-model` downloads a repository once, under a lock
that concurrent processes respect, and writes a marker last; a stale lock is broken; the worker
then reads the cache offline. Downloads come from the local Hub (tests/server/hub_server.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from phasefleet.api.contract import MODEL_CACHE_PLANS
from phasefleet.server.cache_lock import CacheLock, LockTiming
from phasefleet.server.hub import ModelFetchError, fetch_model
from phasefleet.server.model_cache import (
    Ensured,
    Marker,
    ensure_model,
    lock_path,
    marker_path,
    read_marker,
    write_marker,
)
from tests.server.hub_server import FakeHub, FakeRepo, read_folder

REPO = "org/tiny"
FETCH_COMMAND = [sys.executable, "-m", "phasefleet.cli", "fetch-model", "--model", REPO]
FAST = LockTiming(heartbeat_s=0.05, stale_s=0.5, poll_s=0.02, report_s=0.2)


@pytest.fixture
def hf_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_REVISION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("PHASEFLEET_TERMINATION_LOG", str(tmp_path / "termination-log"))


@pytest.fixture
def hub(tiny_model: Path, hf_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    files = read_folder(tiny_model) | {"README.md": b"# tiny\n"}
    with FakeHub({REPO: FakeRepo({"main": files, "v1": files})}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def fetch_process(cache: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*FETCH_COMMAND, "--cache", str(cache), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )


def wait_until(predicate: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def blob_requested(hub: FakeHub) -> bool:
    return any(path.startswith("/cdn/") for path in hub.gets())


class FakeClock:
    """A clock that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_first_pod_downloads_and_a_later_one_finds_the_marker(
    hub: FakeHub, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    first = ensure_model(cache, REPO, "v1")
    assert first.downloaded
    commit = hub.repos[REPO].commit("v1")
    assert first.marker.commit == commit
    assert (cache / first.marker.snapshot / "model.safetensors").is_file()
    assert not lock_path(cache, REPO).exists()  # released
    asked = len(hub.requests)

    again = ensure_model(cache, REPO, "v1")
    assert not again.downloaded and again.marker == first.marker
    assert len(hub.requests) == asked  # no request at all, not even the repository's info
    assert set(hub.downloads().values()) == {1}


def test_two_processes_racing_download_each_file_once(hub: FakeHub, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    hub.gate.clear()  # the winner's weights wait in flight while the other process arrives
    first = fetch_process(cache)
    wait_until(lambda: blob_requested(hub), 60, "the first process to fetch the weights")
    second = fetch_process(cache)
    time.sleep(1.0)  # long enough for the second to reach the lock
    assert first.poll() is None and second.poll() is None
    assert lock_path(cache, REPO).is_dir()
    hub.gate.set()
    outputs = [p.communicate(timeout=120)[0] for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outputs

    downloads = hub.downloads()
    assert "model.safetensors" in downloads
    assert set(downloads.values()) == {1}, downloads  # every file once, not once per process
    infos = [r for r in hub.requests if r.path.startswith("/api/models/")]
    assert len(infos) == 1  # only the lock holder asked the Hub anything
    assert sum("downloaded by this pod" in out for out in outputs) == 1, outputs
    assert sum("nothing to download" in out for out in outputs) == 1, outputs
    assert read_marker(cache, REPO, "main") is not None
    assert (cache / MODEL_CACHE_PLANS).is_dir()  # the CPU workers' plans folder (subPath)


def test_a_killed_holders_lock_is_broken_and_its_download_finished(
    hub: FakeHub, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    hub.gate.clear()
    holder = fetch_process(cache)
    wait_until(lambda: blob_requested(hub), 60, "the holder to fetch the weights")
    holder.kill()  # SIGKILL: no handler runs, the lock stays behind
    holder.communicate(timeout=30)
    assert lock_path(cache, REPO).is_dir()
    assert read_marker(cache, REPO, "main") is None
    hub.gate.set()

    started = time.monotonic()
    waiter = subprocess.run(
        [*FETCH_COMMAND, "--cache", str(cache), "--stale-seconds", "1"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ),
    )  # fmt: skip
    assert waiter.returncode == 0, waiter.stderr
    assert "broke the stale model cache lock" in waiter.stderr
    assert "downloaded by this pod" in waiter.stderr
    assert time.monotonic() - started < 60
    assert read_marker(cache, REPO, "main") is not None


def test_a_lock_without_heartbeats_is_broken_after_stale_seconds_of_the_waiters_clock(
    tmp_path: Path,
) -> None:
    path = tmp_path / "locks" / "repo.lock"
    path.mkdir(parents=True)
    (path / "heartbeat").write_text("41")  # a holder that died long ago
    (path / "owner").write_text(
        '{"token": "t", "pod": "gone-pod", "host": "n1", "pid": 7, "since": 0}'
    )
    clock = FakeClock()
    lock = CacheLock(path, LockTiming(heartbeat_s=5, stale_s=60), clock=clock, sleep=clock.sleep)
    lock.acquire()
    try:
        assert lock.broke == ["pod gone-pod (host n1, pid 7)"]
        assert 60 <= lock.waited_s <= 62  # the stale period, not a moment longer
        assert lock.still_mine()
    finally:
        lock.release()
    assert not path.exists()


def test_a_live_holders_lock_is_never_broken(tmp_path: Path) -> None:
    path = tmp_path / "repo.lock"
    holder = CacheLock(path, FAST)
    holder.acquire()
    waiter = CacheLock(path, FAST)
    done = threading.Event()

    def wait_for_it() -> None:
        waiter.acquire()
        done.set()

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    held_for = 4 * FAST.stale_s  # the holder outlives the stale period many times over
    assert not done.wait(held_for)
    holder.release()
    assert done.wait(10)
    thread.join()
    assert waiter.broke == [] and waiter.waited_s >= held_for
    waiter.release()


def test_a_holder_whose_lock_was_taken_gives_up(tmp_path: Path) -> None:
    path = tmp_path / "repo.lock"
    lost = threading.Event()
    holder = CacheLock(path, FAST, on_lost=lambda _: lost.set())
    holder.acquire()
    path.rename(tmp_path / "taken")  # a waiter judged it stale and moved it aside
    path.mkdir()  # and took its own
    assert lost.wait(5)
    holder.release()
    assert path.is_dir()  # the other process's lock is left alone


def test_a_failed_download_releases_the_lock_and_writes_no_marker(tmp_path: Path) -> None:
    def refuse(repo_id: str, revision: str, hub_cache: Path) -> Path:
        raise ModelFetchError(f"model {repo_id}: the Hub answered HTTP 503")

    with pytest.raises(ModelFetchError, match="503"):
        ensure_model(tmp_path, REPO, "main", fetch=refuse)
    assert not lock_path(tmp_path, REPO).exists()
    assert read_marker(tmp_path, REPO, "main") is None


def test_a_waiter_finds_the_marker_its_holder_wrote(tmp_path: Path) -> None:
    holder = CacheLock(lock_path(tmp_path, REPO), FAST)
    holder.acquire()

    def must_not_fetch(repo_id: str, revision: str, hub_cache: Path) -> Path:
        raise AssertionError("the waiter downloaded although the holder finished")

    result: list[Ensured] = []
    waiter = CacheLock(lock_path(tmp_path, REPO), FAST)
    thread = threading.Thread(
        target=lambda: result.append(
            ensure_model(tmp_path, REPO, "feature/x", fetch=must_not_fetch, lock=waiter)
        )
    )
    thread.start()
    time.sleep(0.2)
    marker = Marker(REPO, "feature/x", "c" * 40, "hub/x", "pod-a", 0.0)
    write_marker(tmp_path, marker)
    holder.release()
    thread.join(10)
    (ensured,) = result
    assert ensured.marker == marker and not ensured.downloaded
    assert marker_path(tmp_path, REPO, "feature/x").name == "models--org--tiny@feature%2Fx.json"


def test_the_worker_reads_the_cache_offline_without_writing(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    ensured = ensure_model(cache, REPO, "v1")
    asked = len(hub.requests)
    before = sorted((str(p), p.stat().st_mtime_ns) for p in cache.rglob("*"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = fetch_model(REPO, "v1", cache_dir=cache / "hub")
    assert folder == cache / ensured.marker.snapshot
    assert len(hub.requests) == asked
    assert sorted((str(p), p.stat().st_mtime_ns) for p in cache.rglob("*")) == before


def test_a_cache_that_cannot_be_written_is_one_line_naming_the_fix(
    tmp_path: Path, hf_env: None
) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    run = subprocess.run(
        [*FETCH_COMMAND, "--cache", str(not_a_folder)],
        capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )  # fmt: skip
    assert run.returncode == 1
    message = (tmp_path / "termination-log").read_text()
    assert message.startswith(f"model cache {not_a_folder} is not writable")
    assert "spec.model.cache.hostPath" in message and message.count("\n") == 1


def test_an_adapter_that_is_no_hub_repo_id_exits_2_naming_it(tmp_path: Path, hf_env: None) -> None:
    run = subprocess.run(
        [*FETCH_COMMAND, "--cache", str(tmp_path / "cache"), "--adapters", "org/a", "a b c"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "--adapters takes Hub repo ids org/name[@revision], got 'a b c'" in run.stderr
    assert not (tmp_path / "cache").exists()  # refused before anything is written


def test_lora_adapters_are_fetched_once_with_the_model_and_read_offline(
    tiny_model: Path, hf_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fetch-model --adapters org/sql@v1 org/poet`: the adapters' two files each, once, under
    their own markers; a second pod downloads nothing; a worker finds them offline."""
    from phasefleet.engine.tiny_lora import make_tiny_lora
    from phasefleet.server.adapters import resolve_adapters

    adapter = read_folder(make_tiny_lora(tmp_path / "adapter", tiny_model, rank=2))
    repos = {
        REPO: FakeRepo({"main": read_folder(tiny_model)}),
        "org/sql": FakeRepo({"main": {"README.md": b"no"}, "v1": adapter | {"README.md": b"x"}}),
        "org/poet": FakeRepo({"main": adapter}),
    }
    cache = tmp_path / "cache"
    with FakeHub(repos) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        for _ in range(2):
            pod = fetch_process(cache, "--adapters", "org/sql@v1", "org/poet")
            output, _ = pod.communicate(timeout=120)
            assert pod.returncode == 0, output
        adapter_files = {"adapter_config.json", "adapter_model.safetensors"}
        fetched = server.downloads()
        # one per repository (both hold the same two files), over both pods; no README
        assert {name: fetched[name] for name in adapter_files} == dict.fromkeys(adapter_files, 2)
        assert "README.md" not in fetched
        assert read_marker(cache, "org/sql", "v1") is not None
        asked = len(server.requests)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_HUB_CACHE", str(cache / "hub"))
        folders = resolve_adapters({"sql": "org/sql@v1", "poet": "org/poet"})
        assert len(server.requests) == asked
    for folder in folders.values():
        assert {p.name for p in Path(folder).iterdir()} == adapter_files
