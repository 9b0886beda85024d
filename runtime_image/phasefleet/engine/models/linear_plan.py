"""Which CPU linear path (oneDNN with a packed weight, or `F.linear`) runs one weight shape at
each row bucket, chosen by timing both at load and cached.

Plain Python: the timing is injected (`measure(path, rows) -> seconds`; cpu_linear.py times real
matmuls, tests pass a fake), so the choice rules are tested without timing anything.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from phasefleet.api.contract import CPU_LINEAR_CACHE_ENV

log = logging.getLogger(__name__)

PATHS = ("onednn", "torch")
# Row counts timed at load: every decode size up to 4, then doubling up to 128 (prefill chunks
# and big batches); above 128 rows the choice at 128 holds (the matmul itself dominates there;
# oneDNN was 1.15x faster at 2048 rows). Few, to keep loading short.
CALIBRATION_ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 128)
ROUNDS = 2  # timing rounds, alternating which path goes first; each side keeps its best
SWITCH_COST = 0.1  # using both paths must save this much (sum of relative slowdowns)
DEFAULT_CACHE_FILE = Path.home() / ".cache/phasefleet/cpu_linear_plans.json"
# A process about to time a shape another one is timing waits this long for its plan, then
# times it itself (the other may hang; a dead one's lock is gone at once).
TIMING_WAIT_S = 60.0

Measure = Callable[[str, int], float]  # (path, rows) -> seconds of one call


@dataclass(frozen=True)
class LinearPlan:
    """Both paths' timings for one weight shape, and the path per row count they imply: one
    path throughout, or one up to a row count and the other above it. At most one switch, so a
    timing spoilt by outside load cannot flip a lone row count in the middle."""

    rows: tuple[int, ...]  # calibration row counts, ascending
    onednn_s: tuple[float, ...]  # seconds per call of the packed oneDNN path at each
    torch_s: tuple[float, ...]  # seconds per call of F.linear at each

    def __post_init__(self) -> None:
        if not (len(self.rows) == len(self.onednn_s) == len(self.torch_s) > 0):
            raise ValueError(f"a LinearPlan needs equal, non-empty rows and timings, got {self}")
        if list(self.rows) != sorted(set(self.rows)) or self.rows[0] < 1:
            raise ValueError(f"LinearPlan rows must be ascending, distinct, >= 1: {self.rows}")

    @cached_property
    def choice(self) -> tuple[str, int, str]:
        """(first path, last row count it runs, path above). Each candidate costs the sum over
        the calibration rows of its relative slowdown against the faster path there; one that
        uses both paths (two weight copies) pays SWITCH_COST more. The cheapest wins; ties go
        to the earlier candidate (oneDNN throughout first)."""
        loss = {
            p: [t / min(o, f) - 1 for t, o, f in zip(ts, self.onednn_s, self.torch_s, strict=True)]
            for p, ts in (("onednn", self.onednn_s), ("torch", self.torch_s))
        }
        last = self.rows[-1]
        best, best_cost = ("onednn", last, "onednn"), sum(loss["onednn"])
        candidates: list[tuple[tuple[str, int, str], float]] = [
            (("torch", last, "torch"), sum(loss["torch"]))
        ]
        for k in range(1, len(self.rows)):
            below = (self.rows[k - 1] + self.rows[k]) // 2  # switch halfway between two rows
            for a, b in (PATHS, PATHS[::-1]):
                cost = sum(loss[a][:k]) + sum(loss[b][k:]) + SWITCH_COST
                candidates.append(((a, below, b), cost))
        for cand, cost in candidates:
            if cost < best_cost:
                best, best_cost = cand, cost
        return best

    def path_at(self, rows: int) -> str:
        first, upto, above = self.choice
        return first if rows <= upto else above

    def paths(self) -> set[str]:
        first, _, above = self.choice
        return {first, above}

    def describe(self) -> str:
        """e.g. 'torch 1, onednn 2+' or 'onednn 1+'."""
        first, upto, above = self.choice
        if first == above:
            return f"{first} 1+"
        head = f"{first} 1" if upto == 1 else f"{first} 1-{upto}"
        return f"{head}, {above} {upto + 1}+"

    def to_json(self) -> dict[str, list[float]]:
        return {
            "rows": list(self.rows),
            "onednn_s": list(self.onednn_s),
            "torch_s": list(self.torch_s),
        }

    @classmethod
    def from_json(cls, d: dict[str, list[float]]) -> LinearPlan:
        return cls(tuple(int(r) for r in d["rows"]), tuple(d["onednn_s"]), tuple(d["torch_s"]))


def calibrate(
    measure: Measure, rows: tuple[int, ...] = CALIBRATION_ROWS, rounds: int = ROUNDS
) -> LinearPlan:
    """Time both paths at every row count, `rounds` times, alternating which goes first (a
    burst of outside load then does not land on one side only); each keeps its best."""
    best = {p: [float("inf")] * len(rows) for p in PATHS}
    for rnd in range(rounds):
        order = PATHS if rnd % 2 == 0 else PATHS[::-1]
        for i, r in enumerate(rows):
            for p in order:
                best[p][i] = min(best[p][i], measure(p, r))
    return LinearPlan(tuple(rows), tuple(best["onednn"]), tuple(best["torch"]))


class PlanCache:
    """Plans by key, in memory and in a JSON file shared by later processes (keys name
    everything a timing depends on: torch version, CPU, threads, dtype, shape)."""

    def __init__(self, file: Path | None, memory: dict[str, LinearPlan]) -> None:
        self.file = file
        self.memory = memory  # shared by the loads of one process
        self.timed = 0  # shapes this cache timed (the rest came from memory or the file)

    def get(
        self, key: str, measure: Measure, rows: tuple[int, ...] = CALIBRATION_ROWS
    ) -> LinearPlan:
        plan = self.memory.get(key)
        if plan is None or plan.rows != rows:
            plan = self._stored(key, rows)
        if plan is None:
            # Pods of one kind of node starting together would each time the same shapes:
            # one times a shape while the others wait for its plan (and for the CPU).
            with self._timing(key):
                plan = self._stored(key, rows)
                if plan is None:
                    plan = calibrate(measure, rows)
                    self.timed += 1
                    self._write(key, plan)
        self.memory[key] = plan
        return plan

    def _stored(self, key: str, rows: tuple[int, ...]) -> LinearPlan | None:
        stored = self._read().get(key)
        plan = LinearPlan.from_json(stored) if stored is not None else None
        return plan if plan is not None and plan.rows == rows else None

    def timing_lock(self, key: str) -> Path | None:
        """The file whose lock a process holds while it times `key` (None without a file)."""
        if self.file is None:
            return None
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return self.file.with_name(f"{self.file.name}.timing") / f"{digest}.lock"

    @contextmanager
    def _timing(self, key: str) -> Iterator[None]:
        """Holds the shape's timing lock (one file per key, beside the plans file) for up to
        TIMING_WAIT_S; without a file, or when the lock cannot be had, times without one."""
        path = self.timing_lock(key)
        if path is None:
            yield
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = path.open("a")
        except OSError as err:
            log.warning("timing CPU linear plans without a lock (%s): %s", path, err)
            yield
            return
        with lock:
            deadline = time.monotonic() + TIMING_WAIT_S
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.warning("%s held over %g s: timing it here", path, TIMING_WAIT_S)
                        break
                    time.sleep(0.05)
                except OSError as err:  # e.g. a filesystem without locks
                    log.warning("timing CPU linear plans without a lock (%s): %s", path, err)
                    break
            yield  # the lock, if held, goes with the file

    def _read(self) -> dict[str, dict[str, list[float]]]:
        if self.file is None or not self.file.is_file():
            return {}
        try:
            data = json.loads(self.file.read_text())
            return {k: v for k, v in data.items() if _valid(v)} if isinstance(data, dict) else {}
        except (OSError, ValueError) as err:
            log.warning("ignoring the CPU linear plans in %s: %s", self.file, err)
            return {}

    def _write(self, key: str, plan: LinearPlan) -> None:
        """Adds the plan to the file. The file may be shared by pods on other nodes (a model
        cache volume), so the read-modify-write holds a lock: no writer drops another's key."""
        if self.file is None:
            return
        # unique across the pods sharing the file (their pids may be equal)
        tmp = self.file.with_name(f"{self.file.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            with self.file.with_name(f"{self.file.name}.lock").open("a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                data = {**self._read(), key: plan.to_json()}
                tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
                os.replace(tmp, self.file)  # atomic: a reader sees the old or the new file
        except OSError as err:
            log.warning("could not save CPU linear plans to %s: %s", self.file, err)


def _valid(d: object) -> bool:
    try:
        LinearPlan.from_json(d)  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError):
        return False
    return True


def cache_file_from_env() -> Path | None:
    value = os.environ.get(CPU_LINEAR_CACHE_ENV)  # the plans file; empty: no file
    if value is None:
        return DEFAULT_CACHE_FILE
    return Path(value).expanduser() if value else None
