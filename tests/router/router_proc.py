"""Start a real `phasefleet router` process on a free localhost port."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.server.worker_proc import (
    Served,
    Worker,
    free_port,
    stop,
    wait_until_healthy,
)

STARTUP_TIMEOUT = 60.0  # seconds
ROUTER_COMMAND = [sys.executable, "-m", "phasefleet.cli", "router"]


class Router(Served):
    """A `phasefleet router` process."""


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
