"""Start a real `phasefleet router` process on a free localhost port."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from tests.server.worker_proc import (
    Worker,
    free_port,
    parse_metrics,
    stop,
    wait_until_healthy,
)

STARTUP_TIMEOUT = 60.0  # seconds
ROUTER_COMMAND = [sys.executable, "-m", "phasefleet.cli", "router"]


@dataclass
class Router:
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
        return parse_metrics(httpx.get(f"{self.base_url}/metrics", timeout=10).text)


def worker_list(*workers: Worker) -> str:
    return ",".join(w.base_url for w in workers)


@contextmanager
def run_router(*args: str, served_name: str = "tiny") -> Iterator[Router]:
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="phasefleet-router-", suffix=".log")[1])
    cmd = [
        *ROUTER_COMMAND, "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port), *args,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    router = Router(proc, port, log_path)
    try:
        wait_until_healthy(proc, router.base_url, router.log, "router", STARTUP_TIMEOUT)
        yield router
    finally:
        stop(proc)
        log_path.unlink(missing_ok=True)
