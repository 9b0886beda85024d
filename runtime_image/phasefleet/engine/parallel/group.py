"""TPGroup: this rank's place in its worker's tensor-parallel group and the collectives the
model runs inside a step (all-reduce after row-parallel linears and the embedding, a gather of
the vocabulary-parallel logits). gloo on the CPU, NCCL on CUDA; every collective has the
group's timeout, so a rank that hangs fails the step instead of stalling it for ever."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from phasefleet.engine.parallel.shard import Shard


class TPGroup:
    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.pg: Any = None  # the process group (gloo or NCCL), set by join()
        self.store: Any = None  # kept alive with the group: rank 0's serves the others

    @property
    def size(self) -> int:
        return self.shard.size

    @classmethod
    def join(
        cls, rank: int, size: int, address: str, device: torch.device, timeout_s: float
    ) -> TPGroup:
        """Joins the worker's group at `address` (tcp://host:port; rank 0 listens there). A
        group of its own, not torch.distributed's default one: a process may hold several
        (the tests run a prefill and a decode engine side by side)."""
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg: Any = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        group = cls(Shard(rank, size))
        group.pg, group.store = pg, store
        return group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in place."""
        self.pg.allreduce([x]).wait()
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension (the same on every rank)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)
