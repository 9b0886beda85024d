"""Host time of a step: what the Python side spends preparing a step's inputs, which a GPU would
wait for. The engine runs on the CPU here; only the host side is timed, by this thread's CPU
time (other processes on a shared machine do not inflate it), best of --repeats.

Cases, one line each:
- decode, eager path: `ModelRunner._prepare` for B decodes at context ctx (the torch attention
  path's inputs: tokens, positions, slots, block tables, decode groups and their masks);
- decode, graph path: `DecodeGraphs.run`'s staging of the same step into the captured graphs'
  fixed buffers (the replay itself is not run);
- prefill: `_prepare` for one 2048-token chunk at the end of a context of ctx tokens.

    .venv/bin/python bench/decode_host.py            # B = 1, 64, 256 x ctx = 2k, 32k, 128k

Nothing here needs a GPU, and no model is run: the model is a tiny random one whose only job is
to give the runner its shapes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from phasefleet.engine.cuda_graphs import DecodeGraphs
from phasefleet.engine.model_runner import ModelRunner
from phasefleet.engine.request import Request
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.scheduler import ScheduledRequest
from phasefleet.engine.tiny import make_tiny

BLOCK = 16
CHUNK = 2048


def scheduled(batch: int, ctx: int, num_tokens: int) -> list[ScheduledRequest]:
    """batch requests whose step computes num_tokens tokens ending at position ctx - 1, each
    with its own ctx / BLOCK blocks (ids past the pool are fine: nothing reads them)."""
    blocks = -(-ctx // BLOCK)
    out = []
    for i in range(batch):
        req = Request(f"r{i}", list(range(ctx)), SamplingParams(max_tokens=1), 0.0)
        ids = list(range(1 + i * blocks, 1 + (i + 1) * blocks))
        out.append(ScheduledRequest(req, ctx - num_tokens, num_tokens, ids, sample=True))
    return out


def best_cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--contexts", default="2048,32768,131072")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny(Path(tmp) / "m", max_position_embeddings=max(contexts))
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder)
        cpu = torch.device("cpu")
        runner = ModelRunner(folder, config, "float32", cpu, BLOCK, max(contexts))
        runner.allocate_kv(2)
        graphs = DecodeGraphs(
            runner.model, runner.kv_caches, BLOCK, max(contexts), max(batches), "triton", None, cpu
        )
        print(f"torch {torch.__version__}, one thread, CPU time, best of {args.repeats}")
        for ctx in contexts:
            for b in batches:
                batch = scheduled(b, ctx, 1)
                eager = best_cpu_ms(lambda: runner._prepare(batch), args.repeats)  # noqa: B023
                graph = best_cpu_ms(lambda: stage(graphs, batch), args.repeats)  # noqa: B023
                print(f"decode B={b} ctx={ctx} eager_host_ms={eager:.2f} graph_host_ms={graph:.2f}")
            prefill = scheduled(1, ctx, min(CHUNK, ctx))
            ms = best_cpu_ms(lambda: runner._prepare(prefill), args.repeats)  # noqa: B023
            print(f"prefill chunk={min(CHUNK, ctx)} ctx={ctx} host_ms={ms:.2f}")


def stage(graphs: DecodeGraphs, batch: list[ScheduledRequest]) -> None:
    """DecodeGraphs.run's input staging, without the replay (no graph is captured on CPU)."""
    graphs.graphs = {b: _NoReplay() for b in graphs.sizes}  # type: ignore[misc]
    graphs.outputs = {b: torch.empty(b, 1) for b in graphs.sizes}
    positions = [s.start for s in batch]
    graphs.run(
        token_ids=[s.request.token_ids(p, p + 1)[0] for s, p in zip(batch, positions, strict=True)],
        positions=positions,
        slots=[
            s.block_ids[p // BLOCK] * BLOCK + p % BLOCK
            for s, p in zip(batch, positions, strict=True)
        ],
        block_tables=[s.block_ids[: p // BLOCK + 1] for s, p in zip(batch, positions, strict=True)],
    )


class _NoReplay:
    def replay(self) -> None:
        pass


if __name__ == "__main__":
    main()
