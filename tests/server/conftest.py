"""Fixtures for the worker tests: a tiny random model written once per session, and a worker
process on it per module (a module that needs other flags defines its own `worker`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.worker_proc import Worker, run_worker


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from phasefleet.engine.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama", seed=0)


@pytest.fixture(scope="module")
def worker(tiny_model: Path) -> Iterator[Worker]:
    with run_worker(tiny_model) as w:
        yield w


@pytest.fixture(scope="module")
def client(worker: Worker) -> openai.OpenAI:
    return worker.client(timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)
