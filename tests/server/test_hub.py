"""Models from the Hugging Face Hub: the real huggingface_hub client against a local Hub
(tests/server/hub_server.py, via HF_ENDPOINT) serving make-tiny folders."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from phasefleet.server import hub_fetch
from phasefleet.server.hub import ModelFetchError, fetch_model
from phasefleet.server.model_source import resolve_model, served_name
from tests.server.hub_server import FakeHub, FakeRepo, read_folder
from tests.server.worker_proc import WORKER_COMMAND, run_worker

TOKEN = "hf_good"  # a token the local Hub knows and has granted the gated repo
OTHER_TOKEN = "hf_known_no_access"
# What a real repository carries beside the model; none of it may be fetched.
EXTRAS = {
    "README.md": b"# tiny\n",
    ".gitattributes": b"*.safetensors filter=lfs\n",
    "pytorch_model.bin": b"\0" * 4096,
    "original/consolidated.safetensors": b"\0" * 4096,
    "phasefleet-tiny.json": b"{}\n",
}
ENGINE_NAMES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture
def hf_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A clean Hugging Face environment; returns the hub cache folder ($HF_HOME/hub)."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_REVISION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv(
        "PHASEFLEET_TERMINATION_LOG", str(tmp_path / "termination-log")
    )  # fmt: skip
    return tmp_path / "hf" / "hub"


@pytest.fixture(scope="module")
def tiny_v1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from phasefleet.engine.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-v1", arch="llama", seed=1)


def sharded(folder: Path) -> dict[str, bytes]:
    """The make-tiny folder with its weights in two shards and an index, plus a consolidated
    copy the index does not name (as some repositories ship)."""
    files = read_folder(folder)
    state = load_file(str(folder / "model.safetensors"))
    names = sorted(state)
    half = len(names) // 2
    out = folder.parent / f"{folder.name}-shards"
    out.mkdir(exist_ok=True)
    shards = {"model-00001-of-00002.safetensors": names[:half]}
    shards["model-00002-of-00002.safetensors"] = names[half:]
    weight_map: dict[str, str] = {}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(out / shard))
        files[shard] = (out / shard).read_bytes()
        weight_map |= {k: shard for k in keys}
    files["consolidated.safetensors"] = files.pop("model.safetensors")
    index = {"metadata": {}, "weight_map": weight_map}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    return files


def local_hub(tiny_model: Path, tiny_v1: Path) -> FakeHub:
    main = read_folder(tiny_model) | EXTRAS
    no_weights = {k: v for k, v in main.items() if not k.endswith(".safetensors")}
    return FakeHub(
        {
            "org/tiny": FakeRepo({"main": main, "v1": read_folder(tiny_v1)}),
            "org/sharded": FakeRepo({"main": sharded(tiny_model)}),
            "org/gated": FakeRepo({"main": main}, gated=True, allowed_tokens={TOKEN}),
            "org/bin-only": FakeRepo({"main": no_weights}),
            "org/big": FakeRepo({"main": {"config.json": b"{}", "model.safetensors": BIG}}),
        },
        tokens={TOKEN, OTHER_TOKEN},
    )


BIG = hashlib.sha256(b"seed").digest() * (24 * 2**20 // 32)  # 24 MiB: over one 10 MB read


def test_worker_serves_a_completion_from_a_repo_id(
    tiny_model: Path, tiny_v1: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`phasefleet worker --model org/sharded`: downloads the index and the shards it names
    (not the consolidated copy, not the extras) and answers a real completion."""
    with local_hub(tiny_model, tiny_v1) as hub_server:
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        with run_worker(Path("org/sharded"), served_name="org/sharded") as worker:
            completion = worker.client().completions.create(
                model="org/sharded", prompt="The prefill worker", max_tokens=8, temperature=0
            )
            assert completion.usage is not None and completion.usage.completion_tokens == 8
            assert completion.choices[0].text
        expected = ENGINE_NAMES - {"model.safetensors"} | {
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        }
        assert hub_server.fetched_files() == expected
    snapshot = next((hf_env / "models--org--sharded" / "snapshots").iterdir())
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(expected)


def test_only_the_engine_files_are_fetched_and_logged_one_line_each(
    tiny_model: Path,
    tiny_v1: Path,
    hf_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="phasefleet.hub")
    with local_hub(tiny_model, tiny_v1) as hub_server:
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        folder = fetch_model("org/tiny", cache_dir=hf_env)
        assert hub_server.fetched_files() == ENGINE_NAMES
    assert {p.name for p in folder.iterdir()} == ENGINE_NAMES
    for name in ENGINE_NAMES:
        assert (folder / name).read_bytes() == (tiny_model / name).read_bytes()
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("fetching model org/tiny (revision main") for line in lines)
    for name in ENGINE_NAMES:
        assert sum(line.startswith(f"org/tiny: {name} (") for line in lines) == 1, lines
    assert not any("\r" in line or "it/s" in line for line in lines)  # no tqdm bars


def test_a_pinned_revision_is_what_gets_downloaded(
    tiny_model: Path, tiny_v1: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with local_hub(tiny_model, tiny_v1) as hub_server:
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        v1 = fetch_model("org/tiny", "v1", cache_dir=hf_env)
        main = fetch_model("org/tiny", cache_dir=hf_env)
        commit = hub_server.repos["org/tiny"].commit("v1")
        by_commit = fetch_model("org/tiny", commit, cache_dir=hf_env)
    weights = "model.safetensors"
    assert (v1 / weights).read_bytes() == (tiny_v1 / weights).read_bytes()
    assert (main / weights).read_bytes() == (tiny_model / weights).read_bytes()
    assert v1.name == commit and by_commit == v1 and main != v1
    assert (hf_env / "models--org--tiny" / "refs" / "v1").read_text() == commit


def test_offline_with_a_warm_cache_makes_no_request(
    tiny_model: Path, tiny_v1: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with local_hub(tiny_model, tiny_v1) as hub_server:
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        online = fetch_model("org/tiny", cache_dir=hf_env)
        seen = len(hub_server.requests)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert fetch_model("org/tiny", cache_dir=hf_env) == online
        with pytest.raises(ModelFetchError) as cold:
            fetch_model("org/tiny", "v1", cache_dir=hf_env)  # not cached
        assert len(hub_server.requests) == seen
    assert "not in the cache" in str(cold.value) and "HF_HUB_OFFLINE" in str(cold.value)


def test_an_unreachable_hub_falls_back_to_the_cache(
    tiny_model: Path, tiny_v1: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with local_hub(tiny_model, tiny_v1) as hub_server:
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        online = fetch_model("org/tiny", cache_dir=hf_env)
    assert fetch_model("org/tiny", cache_dir=hf_env) == online  # the server is gone
    with pytest.raises(ModelFetchError, match="unreachable"):
        fetch_model("org/other", cache_dir=hf_env)


def test_a_killed_download_resumes_where_it_stopped(
    tiny_model: Path, tiny_v1: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed mid-file (a pod restart keeps its cache volume) leaves a partial blob;
    the next fetch asks only for the rest (Range) and the file is whole."""
    sha = hashlib.sha256(BIG).hexdigest()
    partial = hf_env / "models--org--big" / "blobs" / f"{sha}.incomplete"
    with local_hub(tiny_model, tiny_v1) as hub_server:
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        hub_server.stall_after[sha] = 15 * 2**20  # the first GET stops sending after 15 MiB
        proc = subprocess.Popen(
            [*WORKER_COMMAND, "--model", "org/big"], stderr=subprocess.PIPE, env=dict(os.environ)
        )
        try:
            deadline = time.monotonic() + 60
            while not (partial.is_file() and partial.stat().st_size > 0):
                assert proc.poll() is None and time.monotonic() < deadline, "no partial blob"
                time.sleep(0.05)
        finally:
            proc.kill()
            proc.wait()
        kept = partial.stat().st_size
        assert 0 < kept < len(BIG)
        folder = fetch_model("org/big", cache_dir=hf_env)
        resumed = [r for r in hub_server.requests if r.path == f"/cdn/{sha}"][-1]
    assert resumed.range == f"bytes={kept}-"
    assert (folder / "model.safetensors").read_bytes() == BIG
    assert not partial.exists()


def test_progress_is_logged_in_steps_of_the_bytes(
    tiny_model: Path,
    tiny_v1: Path,
    hf_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While a file is partly down (the server stalls after 15 of 24 MiB), a percent line."""
    caplog.set_level(logging.INFO, logger="phasefleet.hub")
    monkeypatch.setattr(hub_fetch, "PROGRESS_POLL_SECONDS", 0.05)
    sha = hashlib.sha256(BIG).hexdigest()
    with local_hub(tiny_model, tiny_v1) as hub_server:
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        hub_server.stall_after[sha] = 15 * 2**20
        release = hub_server.release

        def release_when_logged() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if any("org/big: 41%" in r.getMessage() for r in list(caplog.records)):
                    break
                time.sleep(0.05)
            release.set()  # the server cuts the connection; the rest comes by a Range request

        helper = threading.Thread(target=release_when_logged)
        helper.start()
        folder = fetch_model("org/big", cache_dir=hf_env)
        helper.join()
    assert (folder / "model.safetensors").read_bytes() == BIG
    lines = [r.getMessage() for r in caplog.records]
    assert "org/big: 41% (10.5 MB of 25.2 MB)" in lines, lines
    assert any(line.startswith("org/big: model.safetensors broke off") for line in lines)
    ranged = [r.range for r in hub_server.requests if r.path == f"/cdn/{sha}"]
    assert ranged[0] is None and ranged[-1] is not None and ranged[-1].startswith("bytes=")


CASES = {
    "gated, no token": ("org/gated", {}, "is gated and no token was given"),
    "gated, token without access": (
        "org/gated",
        {"HF_TOKEN": OTHER_TOKEN},
        "is gated and the token in HF_TOKEN has no access",
    ),
    "wrong token": ("org/tiny", {"HF_TOKEN": "hf_wrong"}, "rejected the token in HF_TOKEN"),
    "missing repo": ("org/missing", {}, "no such repository on"),
    "missing revision": ("org/tiny", {"HF_REVISION": "v9"}, "has no revision 'v9'"),
    "no safetensors": ("org/bin-only", {}, "has no *.safetensors weights (it has"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_refused_download_exits_with_one_line(
    case: str,
    tiny_model: Path,
    tiny_v1: Path,
    hf_env: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo_id, env, expected = CASES[case]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with local_hub(tiny_model, tiny_v1) as hub_server:
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        run = subprocess.run(
            [*WORKER_COMMAND, "--model", repo_id, "--log-level", "warning"],
            capture_output=True,
            text=True,
            env=dict(os.environ),
            timeout=120,
        )
    assert run.returncode == 1, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"phasefleet worker: model {repo_id}") and expected in lines[0]
    message = lines[0].removeprefix("phasefleet worker: ")
    assert (tmp_path / "termination-log").read_text() == message + "\n"
    assert (
        TOKEN not in run.stderr and "hf_wrong" not in run.stderr and OTHER_TOKEN not in run.stderr
    )


def test_a_gated_repo_downloads_with_a_granted_token(
    tiny_model: Path, tiny_v1: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with local_hub(tiny_model, tiny_v1) as hub_server:
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        folder = fetch_model("org/gated", cache_dir=hf_env)
    assert (folder / "model.safetensors").read_bytes() == (
        tiny_model / "model.safetensors"
    ).read_bytes()


def test_an_existing_folder_wins_over_a_repo_id(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tiny_model.parent)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: no lookup
    assert resolve_model(tiny_model.name) == tiny_model.name
    assert resolve_model("/no/such/folder") == "/no/such/folder"  # left to the folder check
    with pytest.raises(ModelFetchError, match="unreachable"):
        resolve_model("org/not-here")  # shaped like a repo id and no such folder: the Hub


def test_serve_downloads_once_and_serves_under_the_repo_id(
    tiny_model: Path, tiny_v1: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`phasefleet serve --model org/name`: the fleet's folder is the downloaded snapshot
    (workers load it from there) and the served name is the repo id; a refusal is its line."""
    from phasefleet.local import cli as serve_cli

    with local_hub(tiny_model, tiny_v1) as hub_server:
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        monkeypatch.setenv("HF_REVISION", "v1")
        folder = serve_cli.resolve_model("org/tiny", [])  # the cache from $HF_HOME, as in a worker
        monkeypatch.delenv("HF_REVISION")
        with pytest.raises(ValueError, match="is gated and no token was given"):
            serve_cli.resolve_model("org/gated", [])
    assert Path(folder).name == hub_server.repos["org/tiny"].commit("v1")
    assert Path(folder).is_relative_to(hf_env)
    weights = "model.safetensors"
    assert (Path(folder) / weights).read_bytes() == (tiny_v1 / weights).read_bytes()
    # The default name, for serve and the worker alike: never a host path.
    assert served_name("org/tiny", folder) == "org/tiny"
    assert served_name(str(tiny_model), str(tiny_model)) == tiny_model.name
    assert served_name("tiny", "/cache/models/tiny-llama") == "tiny"


def test_bad_settings_are_refused_before_any_download(
    tiny_model: Path, tiny_v1: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with local_hub(tiny_model, tiny_v1) as hub_server:
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        run = subprocess.run(
            [*WORKER_COMMAND, "--model", "org/tiny", "--max-num-seqs", "0"],
            capture_output=True,
            text=True,
            env=dict(os.environ),
            timeout=120,
        )
    assert run.returncode == 2 and "max_num_seqs" in run.stderr, run.stderr
    assert hub_server.requests == []
