"""The worker reads a local model's weights ahead while it imports; never downloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from phasefleet.server import prefetch


def test_reads_every_weight_file_of_a_local_folder(tmp_path: Path) -> None:
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"a" * (3 * 2**20 + 5))
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"b" * 17)
    (tmp_path / "tokenizer.json").write_bytes(b"{}" * 1000)  # not a weight file
    assert prefetch.local_folder(str(tmp_path), None) == tmp_path
    assert prefetch.read_ahead(tmp_path) == 3 * 2**20 + 5 + 17


def test_a_repo_id_is_read_only_from_an_offline_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("phasefleet.server.hub.offline", lambda: False)
    assert prefetch.local_folder("org/model", None) is None  # online: the worker downloads
    monkeypatch.setattr("phasefleet.server.hub.offline", lambda: True)
    seen = []

    def fetch(repo: str, revision: str | None) -> Path:
        seen.append((repo, revision))
        return tmp_path

    monkeypatch.setattr("phasefleet.server.hub.fetch_model", fetch)
    assert prefetch.local_folder("org/model", "v1") == tmp_path
    assert seen == [("org/model", "v1")]
    assert prefetch.local_folder(str(tmp_path / "model.gguf"), None) is None
    assert prefetch.local_folder("not a repo id!", None) is None


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(prefetch.ENV, "0")
    assert prefetch.start(str(tmp_path), None) is None
    monkeypatch.setenv(prefetch.ENV, "1")
    thread = prefetch.start(str(tmp_path), None)
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive()
