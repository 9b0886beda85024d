"""One long-running component process: started in its own session with its output in a log
file, stopped with SIGTERM then SIGKILL, its log tail available for failure reports."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from phasefleet.local.fleet import free_port

__all__ = ["Component", "free_port", "process_group_alive", "stop_process_group"]


@dataclass
class Component:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own process group: stopped as a whole
            )

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def check_alive(self) -> None:
        """Raises with the log tail if the process has exited."""
        if self.popen is not None and self.popen.poll() is not None:
            code = self.popen.returncode
            raise RuntimeError(f"{self.name} exited with code {code}; log tail:\n{self.log_tail()}")

    def stop(self, grace_seconds: float = 10.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        stop_process_group(self.popen.pid, grace_seconds)
        self.popen.wait(timeout=grace_seconds)

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def stop_process_group(pid: int, grace_seconds: float = 10.0) -> None:
    """SIGTERM the process group led by pid, then SIGKILL whatever is left after the grace."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        if not process_group_alive(pid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader still counts as a group member until reaped; treat zombies as gone.
    try:
        stat = Path(f"/proc/{pgid}/stat").read_text()
    except FileNotFoundError:
        return _group_has_members(pgid)
    return stat.rsplit(")", 1)[1].split()[0] != "Z" or _group_has_members(pgid, exclude=pgid)


def _group_has_members(pgid: int, exclude: int | None = None) -> bool:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == exclude:
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
