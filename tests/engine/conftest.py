"""Session fixtures for the engine tests: tiny models on disk and a transformers reference."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phasefleet.engine.tiny import make_tiny
from tests.engine.factories import DEVICE, TINY_MODELS


def pytest_report_header() -> str:
    return f"engine tests run the engine on {DEVICE} (PHASEFLEET_TEST_DEVICE)"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_model(name) -> folder of that TINY_MODELS entry, written on first use."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            folder = tmp_path_factory.mktemp(f"model-{name}")
            cache[name] = make_tiny(folder, **TINY_MODELS[name])  # type: ignore[arg-type]
        return cache[name]

    return get


@pytest.fixture(scope="session")
def hf_greedy(tiny_model: Callable[[str], Path]) -> Callable[[str, list[int], int], list[int]]:
    """hf_greedy(model_name, prompt, n) -> n greedy tokens from transformers (no KV cache, one
    request at a time: the plainest reference there is)."""
    from transformers import AutoModelForCausalLM

    models: dict[str, torch.nn.Module] = {}

    def run(name: str, prompt: list[int], n: int) -> list[int]:
        if name not in models:
            # SDPA drops Gemma 2's score softcapping; eager applies it
            eager = {"attn_implementation": "eager"} if name.startswith("gemma2") else {}
            models[name] = AutoModelForCausalLM.from_pretrained(
                tiny_model(name), dtype=torch.float32, **eager
            ).eval()
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                logits = models[name](torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
        return ids[len(prompt) :]

    return run
