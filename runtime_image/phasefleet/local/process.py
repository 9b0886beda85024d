"""One child process of a local fleet: started in its own session (so a terminal's Ctrl-C
reaches only the fleet, which stops children in order), killed with the fleet if the fleet dies,
drained with SIGTERM, and killed if it outlives its grace period. A restart is a new Child with
the same name and log file (appended to); `log_tail` reads only the current run's output."""

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
    restarts: int = 0  # how often this name was restarted before this process (its slot's count)
    started_at: float | None = None  # time.monotonic() at start()
    ready_at: float | None = None  # time.monotonic() when /health first answered 200
    log_start: int = 0  # bytes: where this run's output begins in the log file
    signalled: bool = False  # SIGTERM sent: a second one would cut its drain short

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        with self.log_path.open("ab") as log:
            self.log_start = log.tell()
            if self.restarts:
                header = f"--- phasefleet serve: restart {self.restarts} of {self.name} ---\n"
                log.write(header.encode())
                log.flush()
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

    def crashed(self) -> bool:
        """It was started and exited without being told to (SIGTERM), whatever its exit code."""
        return self.popen is not None and self.popen.poll() is not None and not self.signalled

    def exit_description(self) -> str:
        """E.g. "exit code 2" or "killed by SIGKILL"; "running" while it runs."""
        code = None if self.popen is None else self.popen.poll()
        if code is None:
            return "running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def has_served(self) -> bool:
        """It, or an earlier process of its name, answered /health: not a first load."""
        return self.ready_at is not None or self.restarts > 0

    def served_s(self, now: float) -> float:
        """Seconds from its first healthy answer to `now` (time.monotonic()); 0 if it had none."""
        return 0.0 if self.ready_at is None else max(now - self.ready_at, 0.0)

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
                self.ready_at = time.monotonic()
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def terminate(self) -> None:
        """SIGTERM, once: the child drains (finishes in-flight requests) and exits."""
        if self.running() and self.popen is not None and not self.signalled:
            self.signalled = True
            self.popen.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL, counted as a crash (not marked as told to stop): for a load that hangs."""
        if self.running() and self.popen is not None:
            self.popen.kill()

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
        """The end of this run's output (not an earlier run's)."""
        try:
            with self.log_path.open("rb") as log:
                end = log.seek(0, os.SEEK_END)
                log.seek(max(self.log_start, end - chars))
                return log.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
