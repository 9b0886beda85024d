"""One child process of a local fleet: started in its own session (so a terminal's Ctrl-C
reaches only the fleet, which stops children in order), killed with the fleet if the fleet dies,
drained with SIGTERM, and killed if it outlives its grace period."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PR_SET_PDEATHSIG = 1  # prctl option: signal this process when its parent dies


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the fleet process dies (no orphans)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: stop() still ends children on every orderly exit


@dataclass
class Child:
    """A worker or router process listening on 127.0.0.1:port."""

    name: str  # e.g. "prefill-0", "router"
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    started_at: float | None = None  # time.monotonic() at start()
    signalled: bool = False  # SIGTERM sent: a second one would cut its drain short

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def wait_healthy(self, timeout: float) -> None:
        """Returns once /health answers 200; RuntimeError with the log tail if the process
        exits or `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                raise RuntimeError(f"{self.name} exited before it was ready:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def terminate(self) -> None:
        """SIGTERM, once: the child drains (finishes in-flight requests) and exits."""
        if self.running() and self.popen is not None and not self.signalled:
            self.signalled = True
            self.popen.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        """Waits for exit; SIGKILL after `timeout` seconds."""
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""
