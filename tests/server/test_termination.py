"""The termination message: one line in the file Kubernetes reads, only where one is wanted."""

from __future__ import annotations

from pathlib import Path

import pytest

from phasefleet import termination
from phasefleet.termination import (
    MAX_BYTES,
    TERMINATION_LOG_ENV,
    fail,
    termination_log,
    write_termination_message,
)


def test_writes_one_line_to_the_file_the_env_names(tmp_path, monkeypatch):
    path = tmp_path / "termination-log"
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(path))
    path.write_text("an older message\n")
    write_termination_message("model /models/x has no config.json:\n  fix spec.model")
    assert path.read_text() == "model /models/x has no config.json: fix spec.model\n"


def test_cuts_at_the_kubelets_limit_on_a_character_boundary(tmp_path, monkeypatch):
    path = tmp_path / "termination-log"
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(path))
    write_termination_message("é" * MAX_BYTES)  # 2 bytes each
    written = path.read_text().rstrip("\n")
    assert written == "é" * (MAX_BYTES // 2)


def test_outside_a_pod_nothing_is_written(monkeypatch, tmp_path):
    monkeypatch.delenv(TERMINATION_LOG_ENV, raising=False)
    missing = tmp_path / "dev" / "termination-log"
    monkeypatch.setattr(termination, "DEFAULT_TERMINATION_LOG", str(missing))
    assert termination_log() is None
    write_termination_message("nothing to write to")
    assert not missing.exists()


def test_the_kubelets_file_is_used_when_it_exists(monkeypatch, tmp_path):
    monkeypatch.delenv(TERMINATION_LOG_ENV, raising=False)
    default = tmp_path / "termination-log"
    default.touch()
    monkeypatch.setattr(termination, "DEFAULT_TERMINATION_LOG", str(default))
    assert termination_log() == default


def test_an_unwritable_file_is_logged_not_raised(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(tmp_path / "no-such-dir" / "log"))
    write_termination_message("boom")
    assert "could not write the termination message" in caplog.text


def test_fail_prints_writes_and_returns_the_code(monkeypatch, tmp_path, capsys):
    path = tmp_path / "termination-log"
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(path))
    assert fail("phasefleet worker", "out of memory; lower --num-kv-blocks", code=3) == 3
    assert capsys.readouterr().err == "phasefleet worker: out of memory; lower --num-kv-blocks\n"
    assert Path(path).read_text() == "out of memory; lower --num-kv-blocks\n"


@pytest.mark.parametrize("value", ["", None])
def test_an_empty_env_falls_back_to_the_default(monkeypatch, tmp_path, value):
    if value is None:
        monkeypatch.delenv(TERMINATION_LOG_ENV, raising=False)
    else:
        monkeypatch.setenv(TERMINATION_LOG_ENV, value)
    monkeypatch.setattr(termination, "DEFAULT_TERMINATION_LOG", str(tmp_path / "absent"))
    assert termination_log() is None
