"""Start a real `phasefleet worker` process on a free localhost port, and read its metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from phasefleet.local.fleet import free_port

STARTUP_TIMEOUT = 120.0  # seconds; the CPU is shared with other test processes
# `phasefleet worker`, through the console script's own entry point.
WORKER_COMMAND = [sys.executable, "-m", "phasefleet.cli", "worker"]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {sample name with labels: value}."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


@dataclass
class Served:
    """A `phasefleet` process serving HTTP on localhost: its address, log and metrics."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, timeout: float = 60.0) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=timeout
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels) -> value, e.g. 'phasefleet_kv_cache_usage_perc{...}'."""
        return parse_metrics(httpx.get(f"{self.base_url}/metrics", timeout=10).text)

    def counter(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples whose labels include `labels` (e.g. reason="...")."""
        total = 0.0
        for key, value in self.metrics().items():
            if key.split("{", 1)[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
                total += value
        return total


@dataclass
class Worker(Served):
    model: str

    def metric(self, name: str) -> float:
        """The value of an unlabelled-by-le sample, by bare name."""
        for key, value in self.metrics().items():
            if key.split("{", 1)[0] == name:
                return value
        raise KeyError(name)

    def wait_until(self, condition: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.05)
        raise AssertionError(f"condition not met in {timeout}s; worker log:\n{self.log()[-3000:]}")


@contextmanager
def run_worker(
    model: Path, *extra: str, served_name: str = "tiny", wait_healthy: bool = True
) -> Iterator[Worker]:
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="phasefleet-worker-", suffix=".log")[1])
    cmd = [
        *WORKER_COMMAND,
        "--model", str(model), "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    worker = Worker(proc, port, log_path, served_name)
    try:
        if wait_healthy:
            wait_until_healthy(proc, worker.base_url, worker.log, "worker", STARTUP_TIMEOUT)
        yield worker
    finally:
        stop(proc)
        log_path.unlink(missing_ok=True)


def wait_until_healthy(
    proc: subprocess.Popen[bytes], base_url: str, log: Callable[[], str], what: str, timeout: float
) -> None:
    """Returns once `base_url`/health answers 200; AssertionError with the log if the process
    exits or `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}:\n{log()}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what} not healthy after {timeout}s:\n{log()}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Ctrl-C, then SIGKILL after 20 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
