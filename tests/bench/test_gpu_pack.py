"""bench/gpu_pack.py cuts a model file into two calls' parts that both fit, and joins them on
the GPU machine only when both are there and the sha256 agrees."""

from __future__ import annotations

import argparse
from pathlib import Path

import gpu_pack
import pytest

MIB = 2**20


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """gpu_pack's folders under tmp_path, and a 1 MiB limit per call."""
    for name, sub in [("PART_A", "pack/a"), ("PART_B", "pack/b"), ("STAGE", "stage")]:
        monkeypatch.setattr(gpu_pack, name, tmp_path / sub)
    monkeypatch.setattr(gpu_pack, "MODELS", tmp_path / "models")
    monkeypatch.setattr(gpu_pack, "REPO", tmp_path)
    monkeypatch.setattr(gpu_pack, "LIMIT", MIB)
    return tmp_path


def test_parts_leave_both_calls_the_same_room_and_join_to_the_file(places: Path) -> None:
    model = places / "m.gguf"
    model.write_bytes(bytes(range(256)) * 5000)  # 1.22 MiB: fits no single 1 MiB call
    tree, wheels = 100_000, 300_000
    gpu_pack.split_model(model, tree, wheels)
    a = (places / "pack/a/m.gguf.part").stat().st_size
    b = (places / "pack/b/m.gguf.part").stat().st_size
    assert a + b == model.stat().st_size
    assert abs((tree + a) - (tree + wheels + b)) <= 1  # the same room in both calls
    assert tree + wheels + b <= MIB

    assert gpu_pack.join(argparse.Namespace()) == 1  # call 2 on a fresh machine: no part a
    (places / "stage").mkdir()
    (places / "stage/m.gguf.part").write_bytes((places / "pack/a/m.gguf.part").read_bytes())
    assert gpu_pack.join(argparse.Namespace()) == 0
    joined = places / "models/m.gguf"
    assert joined.read_bytes() == model.read_bytes()


def test_a_stale_part_is_refused(places: Path) -> None:
    model = places / "m.gguf"
    model.write_bytes(b"x" * 400_000)
    gpu_pack.split_model(model, 100_000, 300_000)
    (places / "stage").mkdir()
    (places / "stage/m.gguf.part").write_bytes(b"y" * 100)
    assert gpu_pack.join(argparse.Namespace()) == 1
    assert not list((places / "models").iterdir())
