"""DecodeGraphs: decode-only steps through fixed-shape buffers, replayed as CUDA graphs.

A decode step of B requests is padded up to the next captured batch size. Padding lanes read
and write only the null block (slot 0, context length 1), and their logits are dropped. Block
tables are as wide as max_model_len allows; the Triton kernel reads only the blocks inside each
context, so the width costs nothing there (the torch path would gather all of it, which is why
graphs are meant for the Triton backend). `capture()` needs CUDA; without it the same buffers
run eagerly, which is how the CPU tests check the padding logic.
"""

from __future__ import annotations

import bisect

import torch

from phasefleet.engine.attention.metadata import AttentionMetadata, DecodeGroup, decode_mask
from phasefleet.engine.models.llama import CausalLM, KVCache
from phasefleet.engine.scheduler import SchedulerOutput


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: KVCache,
        block_size: int,
        max_model_len: int,
        max_batch: int,
        backend: str,
        sliding_window: int | None,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.sliding_window = sliding_window
        self.sizes = batch_sizes(max_batch)
        width = -(-max_model_len // block_size)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)  # [B_max]
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # [B_max]
        self.slots = torch.zeros(n, dtype=torch.long, device=device)  # [B_max]
        self.tables = torch.zeros(n, width, dtype=torch.long, device=device)  # [B_max, width]
        self.context_lens = torch.ones(n, dtype=torch.long, device=device)  # [B_max]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # batch size -> its logits [b, vocab]

    def fits(self, out: SchedulerOutput) -> bool:
        """Whether this step is decode-only (one sampled token each) and small enough."""
        return 0 < len(out.scheduled) <= self.sizes[-1] and all(
            s.num_tokens == 1 and s.sample for s in out.scheduled
        )

    def _forward(self, b: int) -> torch.Tensor:
        ctx = self.context_lens[:b]
        meta = AttentionMetadata(
            slot_mapping=self.slots[:b],
            num_decode_tokens=b,
            decode_block_tables=self.tables[:b],
            decode_context_lens=ctx,
            decode_groups=[]
            if self.backend == "triton"
            else [
                DecodeGroup(
                    0,
                    b,
                    self.tables[:b],
                    decode_mask(ctx, self.tables.shape[1] * self.block_size, self.sliding_window),
                )
            ],
            prefills=[],
            decode_backend=self.backend,
            sliding_window=self.sliding_window,
        )
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first, sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            self._forward(b)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """One decode step for len(token_ids) requests -> logits [n, vocab] float32."""
        n = len(token_ids)
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        pad = b - n
        self.input_ids[:b].copy_(torch.tensor(token_ids + [0] * pad))
        self.positions[:b].copy_(torch.tensor(positions + [0] * pad))
        self.slots[:b].copy_(torch.tensor(slots + [0] * pad))
        self.context_lens[:b].copy_(torch.tensor([p + 1 for p in positions] + [1] * pad))
        width = max(len(t) for t in block_tables)
        rows = torch.zeros(b, width, dtype=torch.long)
        for i, table in enumerate(block_tables):
            rows[i, : len(table)] = torch.tensor(table)
        self.tables[:b].zero_()
        self.tables[:b, :width].copy_(rows)
        graph = self.graphs.get(b)
        if graph is None:
            return self._forward(b)[:n]
        graph.replay()
        return self.outputs[b][:n]
