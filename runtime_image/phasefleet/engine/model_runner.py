"""ModelRunner: all device code. Owns the model and the KV pool, turns a SchedulerOutput into
batched tensors, runs the forward pass and samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from phasefleet.engine.attention.metadata import AttentionMetadata, PrefillSeq
from phasefleet.engine.models.llama import KVCache, head_dim
from phasefleet.engine.models.loader import load_model
from phasefleet.engine.sampler import SamplingRow, sample
from phasefleet.engine.scheduler import ScheduledRequest, SchedulerOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BUDGET_BYTES = 1 << 30  # KV pool cap on CPU when num_kv_blocks is not given
GPU_MEMORY_FRACTION = 0.85  # share of the free GPU memory the KV pool may take


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
        self.model = load_model(folder, hf_config, self.dtype, device, max_model_len)
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = hf_config.num_key_value_heads or hf_config.num_attention_heads
        self.head_dim = head_dim(hf_config)
        if getattr(hf_config, "use_sliding_window", False):
            # Qwen2 slides only on some layers; not implemented, and its checkpoints leave it off.
            raise ValueError(
                f"{hf_config.model_type} with use_sliding_window=true is not supported"
            )
        window = getattr(hf_config, "sliding_window", None)
        self.sliding_window: int | None = (
            window if hf_config.model_type == "mistral" and window else None
        )
        self.kv_caches: KVCache = []

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

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, rows: dict[str, SamplingRow]) -> dict[str, int]:
        """One forward pass over the scheduled tokens; returns request_id -> sampled token for
        the requests whose `sample` flag is set."""
        # One-token queries first: they share one batched attention call.
        batch = [s for s in out.scheduled if s.num_tokens == 1]
        batch += [s for s in out.scheduled if s.num_tokens > 1]
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        last, sampled_rows, ids = [], [], []
        offset = 0
        for s in batch:
            offset += s.num_tokens
            if s.sample:
                last.append(offset - 1)
                sampled_rows.append(rows[s.request.request_id])
                ids.append(s.request.request_id)
        if not ids:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(last, device=self.device)])
        return dict(zip(ids, sample(logits, sampled_rows), strict=True))

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
                    mask=self._prefill_mask(s.start, end),
                )
            )
        dev = self.device
        ctx = torch.tensor(ctx_lens, dtype=torch.long).unsqueeze(1)  # [B_dec, 1]
        key_pos = torch.arange(max_blocks * bs).unsqueeze(0)  # [1, S]
        decode_mask = key_pos < ctx
        if self.sliding_window is not None:
            decode_mask &= key_pos > ctx - 1 - self.sliding_window
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode_tokens=len(decodes),
            decode_block_tables=torch.tensor(tables, dtype=torch.long, device=dev).view(
                len(decodes), max_blocks
            ),
            decode_mask=decode_mask[:, None, None, :].to(dev),
            prefills=prefills,
        )
        input_ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        return input_ids, torch.tensor(pos, dtype=torch.long, device=dev), meta

    def _prefill_mask(self, start: int, end: int) -> torch.Tensor | None:
        """[q_len, end] causal mask aligned to the bottom right (the chunk's queries are the last
        q_len positions); None when plain top-left causal is the same thing."""
        if start == 0 and self.sliding_window is None:
            return None
        q_pos = torch.arange(start, end).unsqueeze(1)
        k_pos = torch.arange(end).unsqueeze(0)
        mask = k_pos <= q_pos
        if self.sliding_window is not None:
            mask &= k_pos > q_pos - self.sliding_window
        return mask.to(self.device)
