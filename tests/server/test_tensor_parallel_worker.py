"""A `phasefleet worker --tensor-parallel-size 2` process: it serves, reports its ranks, and
exits with a one-line reason when one of its ranks dies (no half-alive worker)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from tests.server.worker_proc import run_worker


def _rank_pids(worker_pid: int) -> list[int]:
    """The worker's rank processes (spawned children running multiprocessing's spawn main; the
    resource tracker is another child)."""
    children = [  # listed under the thread that started them: the engine thread
        pid for task in Path(f"/proc/{worker_pid}/task").iterdir()
        for pid in (task / "children").read_text().split()
    ]  # fmt: skip
    ranks = []
    for pid in map(int, children):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            ranks.append(pid)
    return ranks


def test_a_worker_at_two_ranks_serves_and_exits_when_a_rank_dies(tiny_model: Path) -> None:
    with run_worker(tiny_model, "--device", "cpu", "--tensor-parallel-size", "2") as worker:
        reply = worker.client().completions.create(
            model="tiny", prompt="PhaseFleet serves", max_tokens=5, temperature=0
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 5
        (rank,) = _rank_pids(worker.proc.pid)
        os.kill(rank, signal.SIGKILL)
        code = worker.proc.wait(timeout=30)  # idle: found by the engine's rank check
        assert code != 0
        assert "tensor-parallel rank 1 exited (signal 9)" in worker.log()
        try:
            httpx.get(f"{worker.base_url}/health/live", timeout=2)
            raise AssertionError("the worker still answers")
        except httpx.TransportError:
            pass
