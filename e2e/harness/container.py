"""One container of a pod as a local process, the way a kubelet runs it: started in its own
session with output in a log file, in a memory cgroup holding it to its memory limit, probed
(startup, then readiness and liveness), restarted per the pod's restartPolicy with a doubling
back-off (CrashLoopBackOff), stopped with its preStop sleep, SIGTERM and, after the grace
period, SIGKILL. An exit is reported as the kubelet reports it: exit code (128 + signal for a
signal), reason (Completed, Error, OOMKilled when the kernel killed it at its limit) and the
message from its termination-message file (or its log's tail, FallbackToLogsOnError)."""

from __future__ import annotations

import contextlib
import datetime
import http.client
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.harness.memcg import MemoryCgroup
from e2e.harness.podspec import LaunchPlan, Probe
from e2e.harness.process import process_group_alive

BACKOFF_CAP_SECONDS = 300.0  # the kubelet's maximum restart back-off
BACKOFF_RESET_SECONDS = 600.0  # a container that ran this long starts its back-off over
MESSAGE_BYTES = 4096  # of the termination-message file, as the kubelet reads it
FALLBACK_LINES, FALLBACK_BYTES = 80, 2048  # of the log, for FallbackToLogsOnError


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def check(probe: Probe, host: str) -> bool:
    """One probe attempt: an HTTP GET answered 200-399, or a TCP connect."""
    try:
        if probe.kind == "tcp":
            with socket.create_connection((host, probe.port), timeout=probe.timeout):
                return True
        connection = http.client.HTTPConnection(host, probe.port, timeout=probe.timeout)
        try:
            connection.request("GET", probe.path, headers={"User-Agent": "kube-probe/1.33"})
            return 200 <= connection.getresponse().status < 400
        finally:
            connection.close()
    except OSError:
        return False


@dataclass
class ProbeState:
    """Consecutive results of one probe and when it runs next."""

    probe: Probe
    due: float  # monotonic seconds
    successes: int = 0
    failures: int = 0

    def run(self, host: str, now: float) -> bool | None:
        """Probes if due; returns True/False once a threshold is crossed, else None."""
        if now < self.due:
            return None
        self.due = now + self.probe.period
        if check(self.probe, host):
            self.successes, self.failures = self.successes + 1, 0
            return True if self.successes >= self.probe.success_threshold else None
        self.successes, self.failures = 0, self.failures + 1
        return False if self.failures >= self.probe.failure_threshold else None


def wrap_binds(plan: LaunchPlan) -> list[str]:
    """The argv, run in a private mount namespace with the plan's bind mounts (a tmpfs over
    /run makes room for /run/secrets/... without touching the host) and its read-only folders
    (each bound over itself, then remounted read-only; then its writable folders inside them
    bound again and remounted read-write), when it has any."""
    if not plan.binds and not plan.read_only:
        return plan.argv
    steps = ["mount -t tmpfs tmpfs /run"] if plan.binds else []
    for bind in plan.binds:
        target = "/run/" + bind.target.removeprefix("/var/run/").removeprefix("/run/")
        steps.append(f"mkdir -p {shlex.quote(target)}")
        steps.append(f"mount --bind {shlex.quote(str(bind.source))} {shlex.quote(target)}")
    # a missing subPath is made, as the kubelet makes it (before its volume turns read-only)
    steps += [f"mkdir -p {shlex.quote(str(folder))}" for folder in plan.writable]
    for folder in plan.read_only:
        quoted = shlex.quote(str(folder))
        steps.append(f"mkdir -p {quoted}")
        steps.append(f"mount --bind {quoted} {quoted}")
        steps.append(f"mount -o remount,bind,ro {quoted}")
    for folder in plan.writable:
        quoted = shlex.quote(str(folder))
        steps.append(f"mount --bind {quoted} {quoted}")
        steps.append(f"mount -o remount,bind,rw {quoted}")
    script = " && ".join([*steps, 'exec "$@"'])
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh"] + (
        plan.argv
    )


def in_cgroup(argv: list[str], cgroup: MemoryCgroup | None) -> list[str]:
    """The argv, first moving itself into `cgroup` (before it allocates anything)."""
    if cgroup is None:
        return argv
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup.procs), *argv]


def log_tail(path: Path, since: int) -> str:
    """What FallbackToLogsOnError reports: the last lines of the log written since `since`."""
    with path.open("rb") as log:
        log.seek(since)
        lines = log.read().decode(errors="replace").splitlines()[-FALLBACK_LINES:]
    return "\n".join(lines).encode()[-FALLBACK_BYTES:].decode(errors="ignore")


@dataclass
class Container:
    plan: LaunchPlan
    host: str  # the pod IP: probes go here
    log_path: Path
    pid_path: Path  # the process group id, for a sweep after a crash of the runner
    restart_policy: str  # Always, OnFailure, Never
    grace_seconds: float  # terminationGracePeriodSeconds
    backoff_base: float = 10.0  # seconds before the first restart; doubles each time
    message_path: Path | None = None  # its termination-message file (the env tells the program)
    fallback_to_logs: bool = False  # terminationMessagePolicy: FallbackToLogsOnError
    memory_limit: int | None = None  # bytes (resources.limits.memory)
    cgroup_name: str = ""  # its memory cgroup's folder name, unique on this machine
    clock: Callable[[], float] = time.monotonic
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    restart_count: int = 0
    started_at: str = ""
    started_mono: float = 0.0
    next_start: float = 0.0  # monotonic time the next (re)start may happen
    started: bool = False  # the startup probe passed (or there is none)
    ready: bool = False
    last_terminated: dict[str, Any] | None = None
    done: bool = False  # exited and not to be restarted
    probes: dict[str, ProbeState] = field(default_factory=dict)
    cgroup: MemoryCgroup | None = None
    log_start: int = 0  # the log's size when this run started

    # -- life --------------------------------------------------------------------------

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.message_path is not None:
            self.message_path.write_text("")  # each run gets an empty one, as from the kubelet
        if self.memory_limit is not None:
            self.cgroup = MemoryCgroup.create(self.cgroup_name, self.memory_limit)
        if self.cgroup is not None:  # for a sweep after a crash of the runner
            self.pid_path.with_suffix(".cgroup").write_text(str(self.cgroup.folder))
        with self.log_path.open("ab") as log:
            self.log_start = log.tell()
            self.popen = subprocess.Popen(
                in_cgroup(wrap_binds(self.plan), self.cgroup),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.plan.env,
                start_new_session=True,
            )
        self.pid_path.write_text(str(self.popen.pid))
        now = self.clock()
        self.started_at, self.started_mono = now_rfc3339(), now
        self.started = self.plan.startup is None
        self.ready = False
        self.probes = {
            kind: ProbeState(p, now + p.initial_delay)
            for kind, p in (
                ("startup", self.plan.startup),
                ("readiness", self.plan.readiness),
                ("liveness", self.plan.liveness),
            )
            if p is not None
        }

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def step(self, terminating: bool) -> None:
        """One tick: notice an exit, (re)start when due, run the probes that are due."""
        now = self.clock()
        if self.popen is not None and self.popen.poll() is not None:
            self._exited(self.popen.returncode, "Error", now)
        if self.popen is None:
            if not self.done and not terminating and now >= self.next_start:
                if self.last_terminated is not None:
                    self.restart_count += 1  # the kubelet counts restarts made, not planned
                self.start()
            return
        self._probe(now, terminating)

    def _exited(self, code: int, failed_reason: str, now: float) -> None:
        code = 128 - code if code < 0 else code  # killed by signal N: 128 + N, as runtimes say
        reason = "Completed" if code == 0 else failed_reason
        if code == 128 + signal.SIGKILL and self.cgroup is not None and self.cgroup.oom_killed():
            reason = "OOMKilled"
        self.last_terminated = {
            "exitCode": code,
            "reason": reason,
            "startedAt": self.started_at,
            "finishedAt": now_rfc3339(),
        }
        if message := self._message(code):
            self.last_terminated["message"] = message
        self._release_cgroup()
        self.popen, self.ready, self.started = None, False, False
        self.pid_path.unlink(missing_ok=True)
        restart = self.restart_policy == "Always" or (
            self.restart_policy == "OnFailure" and code != 0
        )
        if not restart:
            self.done = True
            return
        if now - self.started_mono >= BACKOFF_RESET_SECONDS:
            delay = self.backoff_base
        else:
            delay = min(self.backoff_base * 2 ** min(self.restart_count, 10), BACKOFF_CAP_SECONDS)
        self.next_start = now + delay

    def _message(self, code: int) -> str:
        """The termination message: the file's content, else (FallbackToLogsOnError and a
        failure) the log's tail."""
        text = ""
        if self.message_path is not None and self.message_path.exists():
            with self.message_path.open("rb") as file:
                text = file.read(MESSAGE_BYTES).decode(errors="replace").strip()
        if not text and self.fallback_to_logs and code != 0 and self.log_path.exists():
            text = log_tail(self.log_path, self.log_start).strip()
        return text

    def _release_cgroup(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
            self.pid_path.with_suffix(".cgroup").unlink(missing_ok=True)

    def _probe(self, now: float, terminating: bool) -> None:
        startup = self.probes.get("startup")
        if not self.started and startup is not None:
            result = startup.run(self.host, now)
            if result is False:
                self._kill_for_restart("startup probe failed")
            self.started = result is True
            return
        readiness = self.probes.get("readiness")
        if readiness is None:
            self.ready = True
        else:
            result = readiness.run(self.host, now)
            if result is not None:
                self.ready = result
        liveness = self.probes.get("liveness")
        if liveness is not None and not terminating and liveness.run(self.host, now) is False:
            self._kill_for_restart("liveness probe failed")

    def _kill_for_restart(self, why: str) -> None:
        with self.log_path.open("a") as log:
            log.write(f"[pod runner] {why}; stopping the container to restart it\n")
        code = self.stop()
        self._exited(code, "Error", self.clock())

    def stop(self, grace: float | None = None) -> int:
        """preStop sleep, SIGTERM to the process group, SIGKILL at the end of the grace
        period (counted from now, preStop included). Returns the exit code."""
        if self.popen is None:
            return 0
        grace = self.grace_seconds if grace is None else grace
        deadline = self.clock() + grace
        pre_stop_end = self.clock() + min(self.plan.pre_stop_sleep, grace)
        while self.clock() < pre_stop_end and self.popen.poll() is None:
            time.sleep(0.1)
        pgid = self.popen.pid
        _signal_group(pgid, signal.SIGTERM)
        while self.clock() < deadline and process_group_alive(pgid):
            self.popen.poll()
            time.sleep(0.1)
        _signal_group(pgid, signal.SIGKILL)
        code = self.popen.wait()
        self.pid_path.unlink(missing_ok=True)
        return code

    def release(self) -> None:
        """After a final stop: its cgroup goes (an exit noticed by `step` releases it too)."""
        self._release_cgroup()

    # -- status ------------------------------------------------------------------------

    def status(self, image: str) -> dict[str, Any]:
        """This container's entry in the pod's status.containerStatuses."""
        state: dict[str, Any]
        if self.popen is not None:
            state = {"running": {"startedAt": self.started_at}}
        elif self.done and self.last_terminated is not None:
            state = {"terminated": self.last_terminated}
        elif self.last_terminated is not None:
            delay = max(self.next_start - self.clock(), 0)
            message = f"back-off {delay:.0f}s restarting failed container={self.plan.name}"
            state = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}
        else:
            state = {"waiting": {"reason": "ContainerCreating"}}
        entry: dict[str, Any] = {
            "name": self.plan.name,
            "image": image,
            "imageID": "",
            "ready": self.ready and self.popen is not None,
            "started": self.started and self.popen is not None,
            "restartCount": self.restart_count,
            "state": state,
        }
        if self.popen is not None:
            entry["containerID"] = f"local://{self.popen.pid}"
        if self.last_terminated is not None and "terminated" not in state:
            entry["lastState"] = {"terminated": self.last_terminated}
        return entry


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
