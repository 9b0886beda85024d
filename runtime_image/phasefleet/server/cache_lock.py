"""An exclusive lock on a folder that many pods, on many nodes, share: a directory made with
mkdir, kept alive by a heartbeat, broken by a waiter once the heartbeat stops.

Why mkdir and not fcntl/flock: a ReadWriteMany volume is often NFS, where flock() becomes a
byte-range lock through the NFS lock protocol. Mounted with `nolock` (or with lockd out of
reach), those locks are local to each node and two pods on two nodes both "hold" the lock,
silently; some FUSE-backed volumes do not lock at all. mkdir is one request the file server
answers atomically (EEXIST for all but one caller) on every shared filesystem we know of, and it
fails loudly where it fails. What mkdir lacks is release on death, hence the stale rule:

- The holder rewrites `heartbeat` (in place: a rename could hide behind NFS's name cache) every
  `heartbeat_s`, and exits at once if it finds that the lock is no longer its own.
- A waiter watches the heartbeat's content, not its timestamps (node and server clocks differ):
  content that has not changed for `stale_s` of the waiter's own clock means the holder is gone
  (killed, its node lost). The waiter renames the lock out of the way (atomic; only one waiter
  wins) after reading the heartbeat once more, then tries mkdir again.

A waiter that breaks a live holder's lock (a holder stalled for `stale_s`, then resumed) costs a
second download, not a corrupt one: the holder's next heartbeat finds the lock gone and ends
its process, and huggingface_hub moves each file into place by rename once it is whole.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("phasefleet.cache")

OWNER_FILE = "owner"  # JSON: who holds the lock (token, pod, host, pid, since)
HEARTBEAT_FILE = "heartbeat"  # a counter the holder rewrites while it lives


@dataclass(frozen=True)
class LockTiming:
    """How often the holder proves it lives, and how long waiters trust it."""

    heartbeat_s: float = 5.0  # seconds between the holder's heartbeats
    stale_s: float = 60.0  # seconds without a new heartbeat before a waiter breaks the lock
    poll_s: float = 1.0  # seconds between a waiter's looks at the lock
    report_s: float = 30.0  # seconds between a waiter's "still waiting" log lines

    def __post_init__(self) -> None:
        for name in ("heartbeat_s", "stale_s", "poll_s", "report_s"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"LockTiming.{name} must be > 0 seconds, got {getattr(self, name)}"
                )
        if not self.stale_s > 2 * self.heartbeat_s:
            raise ValueError(
                f"LockTiming.stale_s ({self.stale_s}) must exceed twice heartbeat_s"
                f" ({self.heartbeat_s}): a live holder's lock would be broken"
            )


@dataclass
class Holder:
    """Who holds a lock, as its owner file says."""

    token: str  # random, unique per acquisition
    pod: str  # $POD_NAME, else the host name
    host: str
    pid: int
    since: float  # wall-clock seconds (for people reading the log; never compared)

    def describe(self) -> str:
        return f"pod {self.pod} (host {self.host}, pid {self.pid})"


def _abandon(lock: CacheLock) -> None:
    """The default when a holder finds its lock taken from it: stop the process now, so two
    downloads do not go on side by side (the container restarts and waits its turn)."""
    from phasefleet.termination import write_termination_message

    message = (
        f"lost the model cache lock {lock.path} to another pod after a stall of over"
        f" {lock.timing.stale_s:.0f} s; exiting so that one download goes on (this pod retries)"
    )
    logger.error(message)
    write_termination_message(message)
    os._exit(75)  # EX_TEMPFAIL


@dataclass
class CacheLock:
    """`with CacheLock(path):` holds the lock at `path` (a directory that must not exist yet
    when free). `clock` and `sleep` are injectable so tests do not wait for real."""

    path: Path
    timing: LockTiming = field(default_factory=LockTiming)
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    on_lost: Callable[[CacheLock], None] = _abandon
    holder: Holder | None = None  # set while held
    waited_s: float = 0.0  # how long the last acquire waited (seconds)
    broke: list[str] = field(default_factory=list)  # holders whose stale lock this one broke
    _stop: threading.Event = field(default_factory=threading.Event)
    _beat: threading.Thread | None = None

    def __enter__(self) -> CacheLock:
        self.acquire()
        return self

    def __exit__(self, *_: object) -> None:
        self.release()

    # -- acquire ---------------------------------------------------------------------------

    def acquire(self) -> None:
        """Blocks until this process holds the lock."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        started = self.clock()
        seen: str | None = None  # the heartbeat content last seen
        seen_at = started  # when it last changed, on this process's clock
        reported = started
        while True:
            if self._try_mkdir():
                self.waited_s = self.clock() - started
                return
            now = self.clock()
            beat = _read(self.path / HEARTBEAT_FILE)
            if beat != seen:
                seen, seen_at = beat, now
            elif now - seen_at >= self.timing.stale_s:
                self._break(beat, now - seen_at)
                seen, seen_at = None, self.clock()
                continue
            if now - reported >= self.timing.report_s:
                reported = now
                logger.info(
                    "waiting for the model cache lock %s, held by %s (%.0f s so far)",
                    self.path, self._holder_text(), now - started,
                )  # fmt: skip
            self.sleep(self.timing.poll_s)

    def _try_mkdir(self) -> bool:
        try:
            os.mkdir(self.path)
        except FileExistsError:
            return False
        pod = os.environ.get("POD_NAME") or socket.gethostname()
        self.holder = Holder(
            secrets.token_hex(8), pod, socket.gethostname(), os.getpid(), time.time()
        )
        _write(self.path / OWNER_FILE, json.dumps(self.holder.__dict__))
        _write(self.path / HEARTBEAT_FILE, "0")
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="cache-lock", daemon=True)
        self._beat.start()
        return True

    def _break(self, beat: str | None, silent_s: float) -> None:
        """Moves a stale lock aside (one waiter's rename wins), unless it beat meanwhile."""
        if _read(self.path / HEARTBEAT_FILE) != beat:
            return
        who = self._holder_text()
        aside = self.path.with_name(f"{self.path.name}.broken-{secrets.token_hex(4)}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # released, or another waiter broke it first
        logger.warning(
            "broke the stale model cache lock %s held by %s: no heartbeat for %.0f s (it was"
            " killed, or its node is gone); its partial download is resumed",
            self.path, who, silent_s,
        )  # fmt: skip
        self.broke.append(who)
        shutil.rmtree(aside, ignore_errors=True)

    def _holder_text(self) -> str:
        holder = _owner(self.path)
        return holder.describe() if holder else "a process that has not written its name yet"

    # -- hold ------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        count = 0
        while not self._stop.wait(self.timing.heartbeat_s):
            if not self.still_mine():
                self.on_lost(self)
                return
            count += 1
            with contextlib.suppress(OSError):  # a slow server: the next beat tries again
                _write(self.path / HEARTBEAT_FILE, str(count))

    def still_mine(self) -> bool:
        owner = _owner(self.path)
        return self.holder is not None and owner is not None and owner.token == self.holder.token

    def release(self) -> None:
        """Ends the heartbeat and removes the lock, if it is still this process's."""
        self._stop.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join()
        self._beat = None
        if self.holder is None:
            return
        if self.still_mine():
            aside = self.path.with_name(f"{self.path.name}.released-{self.holder.token}")
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.path, aside)
                shutil.rmtree(aside, ignore_errors=True)
        self.holder = None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _write(path: Path, text: str) -> None:
    with path.open("w") as file:
        file.write(text)


def _owner(lock: Path) -> Holder | None:
    text = _read(lock / OWNER_FILE)
    if not text:
        return None
    try:
        return Holder(**json.loads(text))
    except (ValueError, TypeError):
        return None
