"""Fixtures for the autoscaler tests: a tiny random model written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from phasefleet.engine.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama", seed=0)
