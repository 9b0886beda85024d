"""ModelRunner: all device code. Owns the model and the KV pool, turns a SchedulerOutput into
batched tensors, runs the forward pass and samples."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from phasefleet.engine.attention import triton_decode
from phasefleet.engine.attention.metadata import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSeq,
    decode_mask,
    mask_to_bias,
)
from phasefleet.engine.cuda_graphs import DecodeGraphs
from phasefleet.engine.kv_transfer import KVLayout
from phasefleet.engine.logprobs import token_logprobs
from phasefleet.engine.models.llama import KVCache, head_dim
from phasefleet.engine.models.loader import load_model
from phasefleet.engine.sampler import SamplingRow, sample
from phasefleet.engine.scheduler import ScheduledRequest, SchedulerOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BUDGET_BYTES = 1 << 30  # KV pool cap on CPU when num_kv_blocks is not given
GPU_MEMORY_FRACTION = 0.85  # share of the free GPU memory the KV pool may take
DECODE_PAD_SLACK = 1.25  # torch path: a decode group may gather this much more than it needs


def choose_decode_backend(device: torch.device, block_size: int) -> str:
    """The decode attention backend: Triton on CUDA when Triton is installed and the block size
    suits the kernel, else torch; PHASEFLEET_ATTENTION=torch|triton forces one."""
    forced = os.environ.get("PHASEFLEET_ATTENTION", "auto")
    if forced not in ("auto", "torch", "triton"):
        raise ValueError(f"PHASEFLEET_ATTENTION must be auto, torch or triton, got {forced!r}")
    usable = triton_decode.available() and triton_decode.supports(block_size)
    if forced == "triton" and not usable:
        raise ValueError(
            "PHASEFLEET_ATTENTION=triton needs Triton and a power-of-two block_size, "
            f"got block_size {block_size}"
        )
    if forced == "auto":
        return "triton" if device.type == "cuda" and usable else "torch"
    return forced


def resolve_dtype(name: str, checkpoint_dtype: Any, device: torch.device) -> str:
    """The dtype `auto` stands for: float32 on CPU (every CPU runs it at full accuracy); on CUDA
    the checkpoint's dtype (config.json) if it is 16-bit, else bfloat16, or float16 on a GPU
    without bfloat16. Any other name is returned as is."""
    if name != "auto":
        return name
    if device.type != "cuda":
        return "float32"
    saved = str(checkpoint_dtype).removeprefix("torch.")
    if saved in ("bfloat16", "float16"):
        return saved
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device must be cpu or auto on a machine without CUDA, got 'cuda'")
    return torch.device(name)


class ModelRunner:
    def __init__(
        self,
        folder: str | Path,
        hf_config: Any,
        dtype: str,
        device: torch.device,
        block_size: int,
        max_model_len: int,
    ) -> None:
        self.device = device
        self.dtype = DTYPES[dtype]
        self.block_size = block_size
        if getattr(hf_config, "use_sliding_window", False):
            # Qwen2 slides only on some layers; not implemented, and its checkpoints leave it off.
            raise ValueError(
                f"{hf_config.model_type} with use_sliding_window=true is not supported"
            )
        self.model = load_model(folder, hf_config, self.dtype, device, max_model_len)
        self.max_model_len = max_model_len
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = hf_config.num_key_value_heads or hf_config.num_attention_heads
        self.head_dim = head_dim(hf_config)
        window = getattr(hf_config, "sliding_window", None)
        self.sliding_window: int | None = (
            window if hf_config.model_type == "mistral" and window else None
        )
        self.kv_caches: KVCache = []
        self.decode_backend = choose_decode_backend(device, block_size)
        # SDPA's CPU kernel is slow for 16-bit one-token queries: decode groups run as matmuls.
        self.decode_as_matmuls = device.type == "cpu" and self.dtype != torch.float32
        self.graphs: DecodeGraphs | None = None

    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers, keys and values."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def auto_num_blocks(self, max_num_seqs: int, max_model_len: int) -> int:
        """Pool size when the config leaves it open: most of the free GPU memory, or on CPU
        enough for every sequence at full length, capped by CPU_KV_BUDGET_BYTES."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(2, int(free * GPU_MEMORY_FRACTION) // self.block_bytes())
        wanted = max_num_seqs * -(-max_model_len // self.block_size) + 1
        return max(2, min(wanted, CPU_KV_BUDGET_BYTES // self.block_bytes()))

    def allocate_kv(self, num_blocks: int) -> None:
        # Zeros, not empty: masked-out slots are still multiplied by 0 and must not be NaN.
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.num_layers)
        ]

    def kv_layout(self) -> KVLayout:
        dtype = next(name for name, value in DTYPES.items() if value == self.dtype)
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, dtype)

    @torch.inference_mode()
    def read_kv(self, block_ids: list[int]) -> Iterator[memoryview]:
        """The blocks' KV as raw bytes, layer-major (kv_transfer's wire order), one layer's keys
        or values per chunk. The caller keeps the blocks from being reused meanwhile."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for keys, values in self.kv_caches:
            for cache in (keys, values):
                chunk = cache.index_select(0, index).cpu()  # [n, block_size, kv_heads, head_dim]
                yield chunk.view(torch.uint8).numpy().data.cast("B")

    @torch.inference_mode()
    def write_kv(self, block_ids: list[int], payload: torch.Tensor, first_block: int = 0) -> None:
        """Loads a pulled payload (uint8, wire order, covering `len(block_ids)` blocks from block
        `first_block` of the sender's list on) into our blocks."""
        n = len(block_ids)
        shape = (self.num_layers, 2, -1, self.block_size, self.num_kv_heads, self.head_dim)
        blocks = payload.view(self.dtype).view(shape)  # [layers, k/v, sent blocks, bs, H, D]
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, (keys, values) in enumerate(self.kv_caches):
            for which, cache in enumerate((keys, values)):
                part = blocks[layer, which, first_block : first_block + n]
                cache.index_copy_(0, index, part.to(self.device, non_blocking=True))

    def enable_decode_graphs(self, max_batch: int, capture: bool = True) -> None:
        """Run decode-only steps of up to max_batch requests through fixed-shape buffers, captured
        as CUDA graphs when `capture` (CUDA only); capture=False runs the same path eagerly."""
        self.graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.block_size,
            self.max_model_len,
            max_batch,
            self.decode_backend,
            self.sliding_window,
            self.device,
        )
        if capture:
            self.graphs.capture()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, rows: dict[str, SamplingRow]) -> dict[str, int]:
        """One forward pass over the scheduled tokens; returns request_id -> sampled token for
        the requests whose `sample` flag is set."""
        if self.graphs is not None and self.graphs.fits(out):
            return self._execute_graph(out, rows)
        # One-token queries first, shortest context first (decode groups are runs of them).
        batch = sorted((s for s in out.scheduled if s.num_tokens == 1), key=lambda s: s.start)
        batch += [s for s in out.scheduled if s.num_tokens > 1]
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        last, sampled_rows, ids = [], [], []
        offset = 0
        for s in batch:
            if s.request.params.prompt_logprobs is not None:
                self._prompt_logprobs(s, hidden[offset : offset + s.num_tokens], rows)
            offset += s.num_tokens
            if s.sample:
                last.append(offset - 1)
                sampled_rows.append(rows[s.request.request_id])
                ids.append(s.request.request_id)
        if not ids:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(last, device=self.device)])
        return dict(zip(ids, sample(logits, sampled_rows), strict=True))

    def _prompt_logprobs(
        self, s: ScheduledRequest, hidden: torch.Tensor, rows: dict[str, SamplingRow]
    ) -> None:
        """Appends the logprobs of the prompt tokens this chunk predicts (position p predicts
        token p + 1) to the request's row; hidden: [num_tokens, hidden]. A chunk computed
        again after a preemption adds nothing."""
        row, req = rows[s.request.request_id], s.request
        end = min(s.start + s.num_tokens, req.num_prompt_tokens - 1)
        if end <= s.start or s.start != len(row.prompt_logprobs):
            return
        logits = self.model.compute_logits(hidden[: end - s.start])  # [end - start, V]
        targets = req.token_ids(s.start + 1, end + 1)
        counts = [row.params.prompt_logprobs or 0] * len(targets)
        row.prompt_logprobs.extend(token_logprobs(logits, targets, counts))

    def _execute_graph(self, out: SchedulerOutput, rows: dict[str, SamplingRow]) -> dict[str, int]:
        if self.graphs is None:
            raise RuntimeError("decode graphs are not enabled")
        bs = self.block_size
        reqs = [s.request for s in out.scheduled]
        positions = [s.start for s in out.scheduled]
        logits = self.graphs.run(
            token_ids=[r.token_ids(p, p + 1)[0] for r, p in zip(reqs, positions, strict=True)],
            positions=positions,
            slots=[s.block_ids[s.start // bs] * bs + s.start % bs for s in out.scheduled],
            block_tables=[s.block_ids[: s.start // bs + 1] for s in out.scheduled],
        )
        tokens = sample(logits, [rows[r.request_id] for r in reqs])
        return {r.request_id: t for r, t in zip(reqs, tokens, strict=True)}

    def _prepare(
        self, batch: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        tokens: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        decodes = [s for s in batch if s.num_tokens == 1]
        max_blocks = max((s.start // bs + 1 for s in decodes), default=1)
        tables, ctx_lens = [], []
        for s in decodes:
            p = s.start
            tokens.extend(s.request.token_ids(p, p + 1))
            pos.append(p)
            slots.append(s.block_ids[p // bs] * bs + p % bs)
            table = s.block_ids[: p // bs + 1]
            tables.append(table + [0] * (max_blocks - len(table)))
            ctx_lens.append(p + 1)
        prefills = []
        for s in batch[len(decodes) :]:
            end = s.start + s.num_tokens
            tokens.extend(s.request.token_ids(s.start, end))
            chunk = torch.arange(s.start, end)
            pos.extend(range(s.start, end))
            nb = -(-end // bs)
            block_table = torch.tensor(s.block_ids[:nb], dtype=torch.long)
            slots.extend((block_table[chunk // bs] * bs + chunk % bs).tolist())
            prefills.append(
                PrefillSeq(
                    start=len(tokens) - s.num_tokens,
                    q_len=s.num_tokens,
                    ctx_len=end,
                    block_table=block_table.to(self.device),
                )
            )
        dev = self.device
        ctx = torch.tensor(ctx_lens, dtype=torch.long, device=dev)
        block_tables = torch.tensor(tables, dtype=torch.long).view(len(decodes), max_blocks)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode_tokens=len(decodes),
            decode_block_tables=block_tables.to(dev),
            decode_context_lens=ctx,
            decode_groups=[]
            if self.decode_backend == "triton"
            else self._decode_groups(block_tables, ctx_lens),
            prefills=prefills,
            decode_backend=self.decode_backend,
            sliding_window=self.sliding_window,
        )
        input_ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        return input_ids, torch.tensor(pos, dtype=torch.long, device=dev), meta

    def _decode_groups(self, tables: torch.Tensor, ctx_lens: list[int]) -> list[DecodeGroup]:
        """Split decodes (sorted by context length) into runs whose padded gather stays within
        DECODE_PAD_SLACK of what they actually need; tables: [B_dec, max_blocks] on the CPU."""
        bs = self.block_size
        blocks = [-(-c // bs) for c in ctx_lens]
        groups = []
        i = 0
        while i < len(blocks):
            j, needed = i + 1, blocks[i]
            while j < len(blocks) and (j - i + 1) * blocks[j] <= DECODE_PAD_SLACK * (
                needed + blocks[j]
            ):
                needed += blocks[j]
                j += 1
            width = blocks[j - 1]
            ctx = torch.tensor(ctx_lens[i:j], dtype=torch.long)
            first = None
            if j - i == 1:
                row = tables[i, :width].tolist()
                if row == list(range(row[0], row[0] + width)):
                    first = row[0]
            mask = decode_mask(ctx, width * bs, self.sliding_window).to(self.device)
            groups.append(
                DecodeGroup(
                    start=i,
                    size=j - i,
                    block_tables=tables[i:j, :width].contiguous().to(self.device),
                    mask=mask,
                    first_block=first,
                    bias=mask_to_bias(mask) if self.decode_as_matmuls else None,
                )
            )
            i = j
        return groups
