"""DecodeGraphs: decode-only steps through fixed-shape buffers, replayed as CUDA graphs.

A decode step of B requests is padded up to the next captured batch size. Its inputs (token
ids, positions, slots, block-table rows, context lengths) arrive on the device with the step's
one upload and are copied into the graphs' fixed buffers by device copies; padding lanes read
and write only the null block (slot 0, the all-null row 0, context length 1), and their logits
are dropped. Each graph gathers its lanes' rows of the persistent device block tables itself,
as wide as max_model_len allows; the Triton kernel reads only the blocks inside each context, so
the width costs nothing there (the torch path would gather all of it, which is why graphs are
meant for the Triton backend). `capture()` needs CUDA; without it the same buffers run eagerly,
which is how the CPU tests check the padding logic.
"""

from __future__ import annotations

import bisect

import torch

from phasefleet.engine.attention import triton_decode
from phasefleet.engine.attention.metadata import AttentionMetadata, DecodeGroup, decode_masks
from phasefleet.engine.models.llama import CausalLM, KVCache
from phasefleet.engine.models.rope import head_dim
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
        block_tables: torch.Tensor,
        block_size: int,
        max_batch: int,
        backend: str,
        windows: set[int | None],
        as_matmuls: bool,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_tables = block_tables  # [rows, max_blocks] int32, the persistent tables
        self.block_size = block_size
        self.backend = backend
        self.windows = windows  # the layers' sliding windows (None: none)
        self.as_matmuls = as_matmuls  # torch decode groups carry biases (see ModelRunner)
        self.sizes = batch_sizes(max_batch)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)  # [B_max]
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # [B_max]
        self.slots = torch.zeros(n, dtype=torch.long, device=device)  # [B_max]
        self.rows = torch.zeros(n, dtype=torch.long, device=device)  # [B_max], row 0: null
        self.context_lens = torch.ones(n, dtype=torch.long, device=device)  # [B_max]
        # The split kernel's scratch for every captured batch size (triton only)
        self.workspace: triton_decode.DecodeWorkspace | None = None
        if backend == "triton":
            self.workspace = triton_decode.DecodeWorkspace.for_batches(
                n,
                model.num_heads,  # this rank's heads
                model.num_kv_heads,
                head_dim(model.config),
                block_tables.shape[1] * block_size,
                device,
            )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # batch size -> its logits [b, vocab]

    def fits(self, out: SchedulerOutput) -> bool:
        """Whether this step is decode-only (one sampled token each, no embedding) and small
        enough."""
        return 0 < len(out.scheduled) <= self.sizes[-1] and all(
            s.num_tokens == 1 and s.sample and not s.request.embed for s in out.scheduled
        )

    def _forward(self, b: int) -> torch.Tensor:
        ctx = self.context_lens[:b]
        tables = self.block_tables.index_select(0, self.rows[:b])  # [b, max_blocks]
        groups = []
        if self.backend != "triton":
            num_keys = tables.shape[1] * self.block_size
            masks, biases = decode_masks(ctx, num_keys, self.windows, self.as_matmuls)
            groups = [DecodeGroup(0, b, tables.long(), masks, biases=biases)]
        meta = AttentionMetadata(
            slot_mapping=self.slots[:b],
            num_decode_tokens=b,
            decode_block_tables=tables,
            decode_context_lens=ctx,
            decode_groups=groups,
            prefills=[],
            decode_backend=self.backend,
            decode_workspace=self.workspace,
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
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        rows: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """One decode step for n requests ([n] int64 tensors on the device, from the step's
        upload) -> logits [n, vocab]. Device copies only: nothing here waits for the device."""
        n = input_ids.shape[0]
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        for buffer, values, pad in (
            (self.input_ids, input_ids, 0),
            (self.positions, positions, 0),
            (self.slots, slots, 0),
            (self.rows, rows, 0),
            (self.context_lens, context_lens, 1),
        ):
            buffer[:n].copy_(values)
            buffer[n:b].fill_(pad)
        graph = self.graphs.get(b)
        if graph is None:
            return self._forward(b)[:n]
        graph.replay()
        return self.outputs[b][:n]
