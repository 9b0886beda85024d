"""Fixtures for the real-model tests: SmolLM2-135M-Instruct, fetched from PyPI and converted
once into $PHASEFLEET_CACHE (a warm run fetches nothing), and `phasefleet serve` run on it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from phasefleet.server.named_models import SMOLLM2, models_dir, named_model_folder, wheel_gguf

STARTUP_TIMEOUT = 300.0  # seconds: three processes load 540 MB each on a shared 2-core machine
DEVICE = os.environ.get("PHASEFLEET_TEST_DEVICE", "cpu")  # cuda: the workers run on the GPU
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"PHASEFLEET_TEST_DEVICE must be cpu or cuda, got {DEVICE!r}")
# float32 on either device, as the reference runs (auto would be bfloat16 on CUDA)
WORKER_ARGS = f"--device {DEVICE} --dtype float32"


@pytest.fixture(scope="session")
def smollm2() -> Path:
    folder = named_model_folder(SMOLLM2.name)
    assert folder is not None and folder == models_dir() / SMOLLM2.folder_name
    return folder


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2: Path) -> Path:
    return wheel_gguf(SMOLLM2)


@contextmanager
def serve(run_dir: Path, *argv: str) -> Iterator[str]:
    """`phasefleet serve ARGV --port 0` until its banner; yields the router's base URL; Ctrl-C
    on exit, which must end it with 0."""
    cmd = [sys.executable, "-m", "phasefleet.cli", "serve", *argv, "--port", "0"]
    cmd += ["--run-dir", str(run_dir)]
    out = run_dir / "serve.out"
    with out.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while (found := re.search(r"serving \S+ at (http://\S+)/v1", out.read_text())) is None:
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.5)
        yield found.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, out.read_text()
