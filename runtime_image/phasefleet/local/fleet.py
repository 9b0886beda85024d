"""A local fleet: worker processes per pool and one router in front of them, on 127.0.0.1.

The fleet writes its membership to a JSON file ({pool: [url, ...]}) that the router re-reads on
every refresh, so workers added or drained while it runs (by a person or the autoscaler) join
or leave the router without a restart. Workers are added to the file only once healthy, and
removed from it before they are told to drain.

Every worker is in one of three lists: `starting` (loading, not in the file), `workers` (in the
file, serving) and `leaving` (out of the file, draining). One lock guards the lists and the file,
so the autoscaler's threads and Ctrl-C may change them at the same time; `stop` reaches all three.

Once a `phasefleet.local.supervisor.Supervisor` watches the fleet (`supervised`), a worker or
router whose process exits unasked is swapped, under that lock, for a replacement of the same
name that is listed as starting before it has a process (`replace_crashed`), and started by the
supervisor after its back-off (`launch`). A worker's first load is not restarted: a load that
failed once (a bad flag, no room on the device) fails again, so it fails `start` (serve stops)
or, for the autoscaler's new worker, `admit` (the next decision asks again).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from phasefleet.api.contract import INTERNAL_TOKEN_ENV, EngineRole, RouterFlag, WorkerFlag
from phasefleet.local.process import Child

logger = logging.getLogger("phasefleet.serve")

PHASEFLEET = [sys.executable, "-m", "phasefleet.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_port(host: str, port: int) -> None:
    """ValueError naming the port and the fix if the router could not listen on host:port.

    Binds each address the router would (with SO_REUSEADDR, as uvicorn does, so a port only in
    TIME_WAIT counts as free) and lets it go at once.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} does not resolve: {exc.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    why = f"port {port} on {host} is taken: stop what listens there, or choose"
                else:
                    why = f"cannot listen on {host}:{port} ({exc.strerror}): choose"
                raise ValueError(f"{why} another --port (--port 0 picks a free one)") from None


@dataclass
class FleetConfig:
    model: str  # Hugging Face model folder
    served_model_name: str
    port: int  # the router's port: the fleet's one endpoint
    pools: dict[str, int]  # pool -> workers: {"prefill": N, "decode": M} or {"worker": N}
    run_dir: Path  # logs and the membership file
    worker_args: list[str] = field(default_factory=list)  # passed to every worker
    tpot_target_ms: int | None = None  # the router sends it to decode workers (phase boundary)
    late_after_ms: int | None = None  # the TTFT target the router sends: late prompts last
    tensor_parallel: dict[str, int] = field(default_factory=dict)  # pool -> ranks per worker
    router_args: list[str] = field(default_factory=list)  # passed to the router
    host: str = "127.0.0.1"  # where the router listens
    startup_timeout: float = 300.0  # seconds a worker gets to load its model
    drain_timeout: float = 25.0  # seconds in-flight requests get on stop

    def validate(self) -> None:
        if set(self.pools) not in ({"prefill", "decode"}, {"worker"}):
            raise ValueError(
                f"pools must be prefill and decode, or worker, got {sorted(self.pools)}"
            )
        for pool, degree in self.tensor_parallel.items():
            if pool not in self.pools:
                raise ValueError(f"--{pool}-tp names no pool of this fleet ({sorted(self.pools)})")
            if degree < 1:
                raise ValueError(f"--{pool}-tp must be >= 1, got {degree}")
        for pool, count in self.pools.items():
            if count < 1:
                raise ValueError(f"--{pool} must be >= 1 worker, got {count}")
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model must be a Hugging Face model folder, got {self.model!r}")


class Fleet:
    def __init__(self, config: FleetConfig) -> None:
        config.validate()
        self.config = config
        self.token = secrets.token_urlsafe(32)  # the fleet's internal token (never logged)
        self.members_path = config.run_dir / "workers.json"
        self.workers: dict[str, list[Child]] = {pool: [] for pool in config.pools}  # serving
        self.starting: dict[str, list[Child]] = {pool: [] for pool in config.pools}  # loading
        self.leaving: list[Child] = []  # retired: draining or about to be
        self.load_seconds: list[float] = []  # each admitted worker's start-to-healthy time
        self.router: Child | None = None
        self._serial = 0
        self._lock = threading.RLock()
        self._stopping = False
        self.supervised = False  # set by the Supervisor: it restarts workers that die loading

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def _env(self) -> dict[str, str]:
        return {INTERNAL_TOKEN_ENV: self.token}

    def _new_worker(self, pool: str, name: str | None = None, restarts: int = 0) -> Child:
        """A worker not started yet: a new name, or a restart of `name` (on a new port: the
        router must not take the restarted worker, its caches empty, for the one it knew)."""
        if name is None:
            name = f"{pool}-{self._serial}"
            self._serial += 1
        port = free_port()
        role = EngineRole.BOTH if pool == "worker" else EngineRole(pool)
        argv = [
            *PHASEFLEET, "worker",
            WorkerFlag.MODEL, self.config.model,
            WorkerFlag.SERVED_MODEL_NAME, self.config.served_model_name,
            WorkerFlag.ROLE, role.value,
            "--host", "127.0.0.1",
            WorkerFlag.PORT, str(port),
            WorkerFlag.DRAIN_TIMEOUT, str(self.config.drain_timeout),
            *self.config.worker_args,
        ]  # fmt: skip
        degree = self.config.tensor_parallel.get(pool, 1)
        if degree > 1:
            argv += [WorkerFlag.TENSOR_PARALLEL_SIZE, str(degree)]
        log = self.config.run_dir / f"{name}.log"
        return Child(name, argv, port, log, self._env(), restarts=restarts)

    def _write_members(self) -> None:
        """Call with the lock held (or before any thread starts)."""
        members = {pool: [w.url for w in ws] for pool, ws in self.workers.items()}
        tmp = self.members_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(members))
        os.replace(tmp, self.members_path)  # the router never reads a half-written file

    def start(self) -> None:
        """Starts every worker, waits until all are healthy, then the router."""
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        self._write_members()
        started = [
            self.start_worker(pool) for pool, n in self.config.pools.items() for _ in range(n)
        ]
        with ThreadPoolExecutor(len(started)) as executor:
            for joined in [executor.submit(self.admit, child) for child in started]:
                if not joined.result():
                    raise RuntimeError("the fleet was stopped while its workers were starting")
        argv = self._router_argv()
        self.router = Child("router", argv, self.config.port, self.config.run_dir / "router.log")
        self.router.env = self._env()
        self.router.start()
        self.router.wait_healthy(60.0)

    def _router_argv(self) -> list[str]:
        argv = [
            *PHASEFLEET, "router",
            RouterFlag.SERVED_MODEL_NAME, self.config.served_model_name,
            "--host", self.config.host,
            RouterFlag.PORT, str(self.config.port),
            "--workers-file", str(self.members_path),
        ]  # fmt: skip
        if self.config.late_after_ms is not None:  # before router_args: theirs wins
            argv += [RouterFlag.LATE_AFTER_MS, str(self.config.late_after_ms)]
        if self.config.tpot_target_ms is not None:
            argv += [RouterFlag.TPOT_TARGET_MS, str(self.config.tpot_target_ms)]
        return argv + self.config.router_args

    def start_worker(self, pool: str) -> Child:
        """Starts one more worker process in `pool`, listed as starting; `admit` waits for it."""
        with self._lock:
            if self._stopping:
                raise RuntimeError(f"the fleet is stopping: no new {pool} worker")
            child = self._new_worker(pool)
            child.start()
            self.starting[pool].append(child)
            return child

    def admit(self, child: Child) -> bool:
        """Waits until a started worker is healthy, then adds it to the router's list. False if it
        was cancelled or the fleet stopped meanwhile. If it exited or timed out: RuntimeError
        (and the worker is stopped) on its first load; False on a supervised restart's load
        (it is killed if it hangs, and `replace_crashed` swaps it)."""
        try:
            child.wait_healthy(self.config.startup_timeout)
        except RuntimeError:
            with self._lock:
                pool = self._starting_pool(child)
                if pool is None or self._stopping:
                    return False  # cancelled or stopped: it exited because it was told to
                if self.supervised and child.restarts:
                    if child.running():
                        logger.warning(
                            "%s not ready after %.0fs: killing it, to be restarted",
                            child.name,
                            self.config.startup_timeout,
                        )
                        child.kill()
                    return False  # left listed as starting for `replace_crashed`
                self.starting[pool].remove(child)
            child.terminate()
            child.wait(5.0)
            raise
        with self._lock:
            pool = self._starting_pool(child)
            if pool is None or self._stopping:
                return False
            self.starting[pool].remove(child)
            self.workers[pool].append(child)
            self._write_members()
            if child.started_at is not None and child.ready_at is not None:
                self.load_seconds.append(child.ready_at - child.started_at)
            # logged under the lock: whoever sees it in the members has its line too
            restarted = f"; restart {child.restarts}" if child.restarts else ""
            logger.info("%s joined (%s%s)", child.name, child.url, restarted)
        return True

    def _starting_pool(self, child: Child) -> str | None:
        return next((pool for pool, cs in self.starting.items() if child in cs), None)

    def cancel(self, child: Child) -> None:
        """Stops a worker that is still loading; `admit` then returns False."""
        with self._lock:
            pool = self._starting_pool(child)
            if pool is None:
                return
            self.starting[pool].remove(child)
        child.terminate()

    def add_worker(self, pool: str) -> Child:
        """Starts one more worker in `pool`; it joins the router once healthy."""
        child = self.start_worker(pool)
        if not self.admit(child):
            raise RuntimeError(f"{child.name} was stopped before it joined")
        return child

    def remove_worker(self, child: Child, refresh_wait: float = 2.0) -> None:
        """Takes a worker out of the router's list, then drains it (its in-flight requests
        finish) and waits for it to exit."""
        self.retire(child)
        time.sleep(refresh_wait)  # the router re-reads the file at least this often
        self.drain(child)

    def retire(self, child: Child) -> None:
        """Out of the router's list: it gets no new requests, keeps serving those it has."""
        with self._lock:
            for workers in self.workers.values():
                if child in workers:
                    workers.remove(child)
                    self.leaving.append(child)
            self._write_members()

    def drain(self, child: Child) -> None:
        """SIGTERM: the worker finishes its in-flight requests and exits; waits for that."""
        child.terminate()
        child.wait(self.config.drain_timeout + 5.0)
        with self._lock:
            if child in self.leaving:
                self.leaving.remove(child)
        logger.info("%s drained and stopped", child.name)

    def members(self) -> dict[str, list[Child]]:
        """The serving workers per pool (a copy)."""
        with self._lock:
            return {pool: list(ws) for pool, ws in self.workers.items()}

    def starting_workers(self) -> dict[str, list[Child]]:
        """The workers still loading per pool (a copy), oldest first."""
        with self._lock:
            return {pool: list(cs) for pool, cs in self.starting.items()}

    def snapshot(self) -> tuple[dict[str, list[Child]], dict[str, list[Child]]]:
        """(serving, starting) per pool, read at one instant: a worker is in exactly one."""
        with self._lock:
            return self.members(), self.starting_workers()

    def replace_crashed(self) -> list[tuple[Child, Child]]:
        """(crashed, replacement) for each serving worker, restarted worker still loading, and
        the router whose process exited unasked (not one cancelled or draining: those are off
        these lists; nor a first load: `admit` reports it). A crashed worker leaves the router's
        file at once; its replacement (same name, not started) is listed as starting in the same
        step, so the pool never looks a worker short."""
        swaps: list[tuple[Child, Child]] = []
        with self._lock:
            if self._stopping:
                return swaps
            for pool in self.workers:
                for listing in (self.workers[pool], self.starting[pool]):
                    crashed = [c for c in listing if c.crashed() and c.has_served()]
                    for child in crashed:
                        replacement = self._new_worker(pool, child.name, child.restarts + 1)
                        listing.remove(child)
                        self.starting[pool].append(replacement)
                        swaps.append((child, replacement))
            if swaps:
                self._write_members()
            if self.router is not None and self.router.crashed():
                old = self.router
                self.router = Child(
                    old.name, old.argv, old.port, old.log_path, old.env, restarts=old.restarts + 1
                )  # the same port: it is the fleet's endpoint
                swaps.append((old, self.router))
        return swaps

    def launch(self, child: Child) -> bool:
        """Starts a replacement from `replace_crashed`; False if the fleet is stopping or the
        worker was cancelled while it waited (the autoscaler shrank its pool)."""
        with self._lock:
            if self._stopping or (child is not self.router and self._starting_pool(child) is None):
                return False
            child.start()
            return True

    def stop(self) -> None:
        """Drains the router (its open streams finish), then every worker, starting and leaving
        ones too; none is left. Workers already draining are not signalled twice."""
        with self._lock:
            self._stopping = True
            workers = [
                *(w for ws in self.workers.values() for w in ws),
                *(c for cs in self.starting.values() for c in cs),
                *self.leaving,
            ]
        if self.router is not None:
            self.router.terminate()
        for worker in workers:
            worker.terminate()
        grace = self.config.drain_timeout + 5.0
        if self.router is not None:
            self.router.wait(grace)
        for worker in workers:
            worker.wait(grace)
