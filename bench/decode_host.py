"""Host time of a step: what the Python side spends preparing a step's inputs, which a GPU would
wait for. The engine runs on the CPU here with its GPU-path memory layout (`separate_device`:
block tables and step inputs in memory of their own, sent by one copy); only the host side is
timed, by this thread's CPU time (other processes on a shared machine do not inflate it), best
of --repeats, each repeat one step later (positions advance, a block is appended now and then).

Cases, one line each:
- decode, graph path (what CUDA runs for decode-only steps): the step's plan (`plan_step`), its
  sampling settings, the one upload, and `DecodeGraphs.run`'s device copies into the graphs'
  buffers (the replay itself is not run);
- decode, eager path: the same with decode groups, plus the attention metadata (`_metadata`;
  its device ops run on the CPU here, so this overstates the host time on a GPU);
- prefill: one 2048-token chunk at the end of a context of ctx tokens, eager path.

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

from phasefleet.engine.model_runner import ModelRunner
from phasefleet.engine.request import Request
from phasefleet.engine.sampler import SamplingBatch, SamplingRow
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.scheduler import ScheduledRequest
from phasefleet.engine.step_plan import plan_step
from phasefleet.engine.tiny import make_tiny

BLOCK = 16
CHUNK = 2048
GREEDY = SamplingParams(max_tokens=1, temperature=0)


def scheduled(batch: int, ctx: int, num_tokens: int, prefix: str) -> list[ScheduledRequest]:
    """batch requests whose step computes num_tokens tokens ending at position ctx - 1, each
    with its own blocks (ids past the pool are fine: nothing reads them), room for 64 more."""
    blocks = -(-(ctx + 64) // BLOCK)
    out = []
    for i in range(batch):
        req = Request(f"{prefix}{i}", list(range(ctx)), GREEDY, 0.0)
        ids = list(range(1 + i * blocks, 1 + (i + 1) * blocks))
        out.append(ScheduledRequest(req, ctx - num_tokens, num_tokens, ids, sample=True))
    return out


def advance(batch: list[ScheduledRequest]) -> None:
    """The next decode step of the same requests: one position on."""
    for s in batch:
        s.request.prompt_token_ids.append(7)
        s.start += 1


def host_step(runner: ModelRunner, batch: list[ScheduledRequest], graphs: bool) -> None:
    rows = [SamplingRow(GREEDY)] * len(batch)
    plan = plan_step(batch, runner.tables, runner.block_size, group=not graphs)
    sampling = SamplingBatch.from_rows(rows, [s.start + s.num_tokens for s in batch], 512)
    step = runner._upload(plan, runner.tables.pending_updates(), sampling)
    if graphs and runner.graphs is not None:
        runner.graphs.run(
            step.input_ids, step.positions, step.slots, step.decode_rows, step.decode_ctx
        )
    else:
        runner._metadata(plan, step)


def best_cpu_ms(fn: Callable[[], object], repeats: int, then: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
        then()
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--contexts", default="2048,32768,131072")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    max_len = max(contexts) + 128
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny(Path(tmp) / "m", max_position_embeddings=max_len)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder)
        cpu = torch.device("cpu")
        runner = ModelRunner(
            folder, config, "float32", cpu, BLOCK, max_len, max(batches), separate_device=True
        )
        runner.allocate_kv(2)
        runner.enable_decode_graphs(max(batches), capture=False)
        graphs = runner.graphs
        assert graphs is not None
        graphs.graphs = {b: _NoReplay() for b in graphs.sizes}  # type: ignore[misc]
        graphs.outputs = {b: torch.empty(b, 1) for b in graphs.sizes}
        print(f"torch {torch.__version__}, one thread, CPU time, best of {args.repeats}")
        for ctx in contexts:
            for b in batches:
                times = {}
                for path in ("graph", "eager"):
                    batch = scheduled(b, ctx, 1, f"{path}-{ctx}-{b}-")
                    host_step(runner, batch, path == "graph")  # rows written once
                    advance(batch)
                    times[path] = best_cpu_ms(
                        lambda: host_step(runner, batch, path == "graph"),  # noqa: B023
                        args.repeats,
                        lambda: advance(batch),  # noqa: B023
                    )
                    for s in batch:
                        runner.release(s.request.request_id)
                print(
                    f"decode B={b} ctx={ctx} graph_host_ms={times['graph']:.2f} "
                    f"eager_host_ms={times['eager']:.2f}"
                )
            chunk = min(CHUNK, ctx)
            times_p: list[float] = []
            for r in range(args.repeats):  # a new request each time: its rows are written too
                prefill = scheduled(1, ctx, chunk, f"p-{ctx}-{r}-")
                times_p.append(best_cpu_ms(lambda: host_step(runner, prefill, False), 1, _noop))  # noqa: B023
                runner.release(prefill[0].request.request_id)
            print(f"prefill chunk={chunk} ctx={ctx} host_ms={min(times_p):.2f}")


def _noop() -> None:
    pass


class _NoReplay:
    def replay(self) -> None:
        pass


if __name__ == "__main__":
    main()
