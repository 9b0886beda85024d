"""The ranks of a tensor-parallel worker: rank 0 (the worker's own process: scheduler, HTTP
server, sampling) starts ranks 1..N-1 as processes of their own and drives them.

Rank 0 sends each call every rank must make at the same time (allocate the KV pool, capture the
decode graphs, run a step) down a pipe per rank, then makes it itself; inside the call the ranks
meet in the model's collectives (group.py). The pipes, not a collective, carry the calls, so an
idle worker waits on nothing that can time out, and a rank whose rank 0 is gone reads EOF and
exits. Each rank sends its KV pool back once allocated, as shared memory (CPU) or a CUDA IPC
handle: rank 0 reads and writes every rank's blocks for the hand-off without a collective.

A rank that exits is seen by rank 0 before its next call (`check`) and by the worker's liveness
(`failure`); one that hangs inside a collective fails the others' collective at the group's
timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing as mp

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = float(os.environ.get("PHASEFLEET_TP_TIMEOUT", "120"))
START_TIMEOUT_S = 600.0  # a rank loads its weights meanwhile


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to build its part of the model (the ModelRunner's arguments)."""

    folder: str
    dtype: str
    device: str  # rank 0's device type; rank r takes cuda:r on CUDA
    block_size: int
    max_model_len: int
    max_num_seqs: int
    address: str  # tcp://host:port where the group meets
    size: int
    threads: int  # torch threads per rank on the CPU
    kv_cache_dtype: str = "auto"  # EngineConfig's


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


class RankSet:
    """Rank 0's handle on ranks 1..N-1."""

    def __init__(self, spec: RankSpec) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self.pipes: list[Connection] = []
        for rank in range(1, spec.size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=follow, args=(rank, spec, theirs), name=f"tp-rank-{rank}", daemon=True
            )
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.pipes.append(mine)

    def failure(self) -> str | None:
        """None while every rank lives, else a one-line reason."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                code = proc.exitcode
                how = f"signal {-code}" if code < 0 else f"code {code}"
                return f"tensor-parallel rank {rank} exited ({how})"
        return None

    def check(self) -> None:
        why = self.failure()
        if why is not None:
            raise RuntimeError(why)

    def call(self, name: str, *args: Any) -> None:
        """Has every rank start runner.<name>(*args); rank 0 then makes the same call."""
        self.check()
        for pipe in self.pipes:
            try:
                pipe.send((name, args))
            except (BrokenPipeError, ConnectionResetError, OSError):
                self.check()
                raise

    def receive(self) -> list[Any]:
        """Each rank's answer to the last call that has one (their KV pools), by rank."""
        out = []
        for pipe in self.pipes:
            if not pipe.poll(START_TIMEOUT_S):
                self.check()
                raise RuntimeError("a tensor-parallel rank did not answer")
            try:
                out.append(pipe.recv())
            except EOFError:
                self.check()
                raise
        return out

    def stop(self, timeout: float = 10.0) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(("stop", ()))
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()


def follow(rank: int, spec: RankSpec, pipe: Connection) -> None:
    """A rank's process: builds its part of the model, then runs what rank 0 sends."""
    # Imported here: the spawned process starts bare.
    from phasefleet.engine.model_runner import ModelRunner
    from phasefleet.engine.parallel.group import TPGroup

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 stops us; a Ctrl-C is for it
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(message)s")
    if spec.device == "cpu":
        torch.set_num_threads(spec.threads)
    device = rank_device(spec.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = TPGroup.join(rank, spec.size, spec.address, device, COLLECTIVE_TIMEOUT_S)
    from phasefleet.engine.models.traits import load_decoder_config

    runner = ModelRunner(
        spec.folder,
        load_decoder_config(spec.folder),
        spec.dtype,
        device,
        spec.block_size,
        spec.max_model_len,
        spec.max_num_seqs,
        separate_device=True,
        tp=tp,
        kv_cache_dtype=spec.kv_cache_dtype,
    )
    while True:
        try:
            name, args = pipe.recv()
        except EOFError:  # rank 0 is gone
            break
        if name == "stop":
            break
        answer = getattr(runner, name)(*args)
        if name == "allocate_kv":
            pipe.send(runner.kv_caches)
        elif name == "auto_num_blocks":
            pipe.send(answer)
