"""ModelRunner: all device code. Owns the model, the KV pool and the block tables on the device;
sends a step's plan (`step_plan`) there in one copy, runs the forward pass and samples, with one
wait on the device per step: the sampled token ids.

With tensor_parallel_size N > 1 this runner is rank 0 of N (parallel/ranks.py): it starts the
other ranks, sends them each step (`run_step`), which every rank runs on its part of the model,
and samples from the gathered logits. It reads and writes every rank's KV blocks itself."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phasefleet.engine.attention import triton_decode
from phasefleet.engine.attention.metadata import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSeq,
    decode_masks,
)
from phasefleet.engine.block_table import BlockTables
from phasefleet.engine.config import MAX_GRAPH_BATCH
from phasefleet.engine.cuda_graphs import DecodeGraphs
from phasefleet.engine.host_kv_store import HostKVStore
from phasefleet.engine.host_prefix_cache import KVMove
from phasefleet.engine.kv_dtype import FLOAT8, as_rows, kv_dtype
from phasefleet.engine.kv_export import KVExporter
from phasefleet.engine.kv_transfer import KVLayout
from phasefleet.engine.logprobs import token_logprobs
from phasefleet.engine.lora import LoraSet
from phasefleet.engine.models.cpu_linear import choose_cpu_linear
from phasefleet.engine.models.llama import KVCache
from phasefleet.engine.models.loader import load_model
from phasefleet.engine.models.moe_shape import activation_width
from phasefleet.engine.models.rope import head_dim, rope_variant
from phasefleet.engine.parallel.group import TPGroup
from phasefleet.engine.parallel.ranks import COLLECTIVE_TIMEOUT_S, RankSet, RankSpec, free_address
from phasefleet.engine.parallel.shard import Shard, unsupported
from phasefleet.engine.sampler import (
    DeviceSampling,
    SamplingBatch,
    SamplingRow,
    grammar_masks,
    sample,
)
from phasefleet.engine.scheduler import SchedulerOutput
from phasefleet.engine.staging import HostStaging
from phasefleet.engine.startup import StartupTimes
from phasefleet.engine.step_plan import RankStep, StepArrays, StepPlan, plan_step

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BUDGET_BYTES = 1 << 30  # KV pool cap on CPU when num_kv_blocks is not given
GPU_MEMORY_FRACTION = 0.85  # share of the free GPU memory the KV pool and the reserve may take

logger = logging.getLogger(__name__)


def choose_decode_backend(
    device: torch.device, block_size: int, softcap: bool = False, float8_kv: bool = False
) -> str:
    """The decode attention backend: Triton on CUDA when Triton is installed, the block size
    suits the kernel, the model has no attention softcapping (Gemma 2) and, with a float8 KV
    pool, the GPU converts float8 (sm89 and later: Triton has no float8 e4m3 before), else
    torch; PHASEFLEET_ATTENTION=torch|triton forces one."""
    forced = os.environ.get("PHASEFLEET_ATTENTION", "auto")
    if forced not in ("auto", "torch", "triton"):
        raise ValueError(f"PHASEFLEET_ATTENTION must be auto, torch or triton, got {forced!r}")
    float8_unread = (
        float8_kv and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)
    )
    usable = (
        triton_decode.available()
        and triton_decode.supports(block_size)
        and not softcap
        and not float8_unread
    )
    if forced == "triton" and not usable:
        raise ValueError(
            "PHASEFLEET_ATTENTION=triton needs Triton, a power-of-two block_size and a model "
            f"without attention softcapping, got block_size {block_size}"
            + (" and a softcapped model" if softcap else "")
            + (" and a float8 KV pool on a GPU before sm89" if float8_unread else "")
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
        max_num_seqs: int = 64,
        separate_device: bool | None = None,
        startup: StartupTimes | None = None,
        tensor_parallel_size: int = 1,
        tp: TPGroup | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """`separate_device`: keep the block tables and the step's inputs in device memory of
        their own, sent by copies as on a GPU (default: on CUDA only); tests set it on the CPU
        to run the GPU path's host side (always set with tensor parallelism). `startup` gets the
        device_init, weights and cpu_linear_plan phases. `tensor_parallel_size` > 1: this
        runner is rank 0 and starts the others; `tp`: this runner is a rank the rank 0 started
        (ranks.py). `kv_cache_dtype`: EngineConfig's (kv_dtype.py)."""
        startup = startup or StartupTimes()
        self.ranks: RankSet | None = None
        if tp is None and tensor_parallel_size > 1:
            why = unsupported(hf_config, tensor_parallel_size)
            if why is not None:
                raise ValueError(why)
            if device.type == "cuda" and torch.cuda.device_count() < tensor_parallel_size:
                raise ValueError(
                    f"tensor_parallel_size {tensor_parallel_size} needs as many GPUs, "
                    f"this machine has {torch.cuda.device_count()}"
                )
            threads = max(1, torch.get_num_threads() // tensor_parallel_size)
            spec = RankSpec(
                str(folder), dtype, device.type, block_size, max_model_len, max_num_seqs,
                free_address(), tensor_parallel_size, threads, kv_cache_dtype,
            )  # fmt: skip
            self.ranks = RankSet(spec)  # they load while this process does
            if device.type == "cpu":
                torch.set_num_threads(threads)
            tp = TPGroup.join(0, tensor_parallel_size, spec.address, device, COLLECTIVE_TIMEOUT_S)
        self.tp = tp
        if tp is not None:
            separate_device = True
        self.device = device
        self.dtype = DTYPES[dtype]
        self.kv_dtype = kv_dtype(kv_cache_dtype, self.dtype)  # the pool's
        self.block_size = block_size
        if device.type == "cuda":
            # SDPA's backends, pinned: torch 2.9 tries cuDNN first on sm90, whose bundled 9.10
            # has a reported bug with sequence lengths not divisible by 128 and builds a plan
            # per new shape. Flash (16-bit) first, then mem-efficient, then math (float32).
            torch.backends.cuda.enable_cudnn_sdp(False)
        if device.type == "cuda":
            with startup.phase("device_init"):  # the CUDA context, apart from the weights' copy
                torch.empty(1, device=device)
                torch.cuda.synchronize(device)
        with startup.phase("weights"):
            self.model = load_model(folder, hf_config, self.dtype, device, max_model_len, tp)
        if choose_cpu_linear(device, self.dtype) == "onednn":
            with startup.phase("cpu_linear_plan"):
                self.model.pack_for_cpu()
        self.max_model_len = max_model_len
        self.vocab_size = int(hf_config.vocab_size)
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = self.model.num_kv_heads  # this rank's
        self.head_dim = head_dim(hf_config)
        self.windows = set(self.model.traits.windows)  # the layers' sliding windows (None: none)
        self.kv_caches: KVCache = []
        self.rank_caches: list[KVCache] = []  # every rank's pool, by rank (rank 0: all of them)
        self.exporter: KVExporter | None = None  # reads leased blocks for a pull
        self.host_kv: HostKVStore | None = None  # the prefix cache's host tier
        softcap = self.model.traits.attn_softcap is not None  # no fused kernel takes it
        self.decode_backend = choose_decode_backend(
            device, block_size, softcap, float8_kv=self.kv_dtype == FLOAT8
        )
        # SDPA's CPU kernel is slow for 16-bit one-token queries: decode groups run as matmuls.
        self.decode_as_matmuls = softcap or (device.type == "cpu" and self.dtype != torch.float32)
        separate = device.type != "cpu" if separate_device is None else separate_device
        self.tables = BlockTables(
            max_num_seqs, -(-max_model_len // block_size), device, separate=separate
        )
        self.staging = HostStaging(device, copy=separate)
        # the grammar masks' own copy, made while the forward runs (the step's inputs' buffer
        # may still be in flight then)
        self.mask_staging = HostStaging(device, copy=separate)
        self.graphs: DecodeGraphs | None = None
        self.lora: LoraSet | None = None

    def enable_lora(self, max_loras: int, max_rank: int, max_tokens: int) -> LoraSet:
        """Adapter slots on every adapted linear (before the KV pool is sized and the decode
        graphs are captured: both must see them)."""
        if self.ranks is not None or self.tp is not None:
            raise ValueError("LoRA adapters are not supported with tensor parallelism")
        self.lora = LoraSet(self.model, max_loras, max_rank, max_tokens)
        return self.lora

    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers, keys and values."""
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def auto_num_blocks(
        self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int
    ) -> int:
        """Pool size when the config leaves it open. On a GPU: GPU_MEMORY_FRACTION of the memory
        free after loading (what the allocator caches is given back first), less
        an explicit reserve for a step's activations, logits and graphs; logged. On the CPU:
        enough for every sequence at full length, capped by CPU_KV_BUDGET_BYTES. With several
        ranks, the fewest any rank has room for."""
        if self.ranks is not None:
            args = (max_num_seqs, max_model_len, max_num_batched_tokens)
            self.ranks.call("auto_num_blocks", *args)
            mine = self._auto_num_blocks(*args)
            return min([mine, *self.ranks.receive()])
        return self._auto_num_blocks(max_num_seqs, max_model_len, max_num_batched_tokens)

    def _auto_num_blocks(
        self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int
    ) -> int:
        if self.device.type != "cuda":
            wanted = max_num_seqs * -(-max_model_len // self.block_size) + 1
            return max(2, min(wanted, CPU_KV_BUDGET_BYTES // self.block_bytes()))
        torch.cuda.empty_cache()  # the allocator still caches what loading freed
        free, _ = torch.cuda.mem_get_info(self.device)
        reserve = self.activation_reserve(max_num_seqs, max_num_batched_tokens)
        budget = int(free * GPU_MEMORY_FRACTION) - reserve
        blocks = max(2, budget // self.block_bytes())
        logger.info(
            "KV pool: %d blocks of %.0f KiB in %s (%.2f GiB) = %.0f%% of the %.2f GiB free after "
            "loading, less %.2f GiB reserved for activations, logits and graphs",
            blocks, self.block_bytes() / 2**10, str(self.kv_dtype).removeprefix("torch."),
            blocks * self.block_bytes() / 2**30, 100 * GPU_MEMORY_FRACTION, free / 2**30,
            reserve / 2**30,
        )  # fmt: skip
        return blocks

    def activation_reserve(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """Bytes a step may need besides weights and KV (an estimate, twice the sum): per token
        of a full step the residual stream, q/k/v and the MLP's gate, up and activation; float32
        logits, probabilities and sampling noise for every sequence; the decode graphs' own
        activations at their largest batch."""
        c = self.model.config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        size = self.tp.size if self.tp is not None else 1
        qkv = (self.model.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_token = (4 * c.hidden_size + qkv + activation_width(c) // size) * elem
        logits = 4 * max_num_seqs * self.vocab_size * 4
        graph_token = per_token + activation_width(c, every_expert=True) // size * elem
        graphs = min(max_num_seqs, MAX_GRAPH_BATCH) * graph_token
        return 2 * (max_num_batched_tokens * per_token + logits + graphs)

    def allocate_kv(self, num_blocks: int) -> None:
        """This rank's pool (every rank's, from rank 0); rank 0 gets the others' back as shared
        memory."""
        if self.ranks is not None:
            self.ranks.call("allocate_kv", num_blocks)
        # Zeros, not empty: masked-out slots are still multiplied by 0 and must not be NaN.
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
            )
            for _ in range(self.num_layers)
        ]
        self.rank_caches = [self.kv_caches]
        if self.ranks is not None:
            self.rank_caches += self.ranks.receive()
        self.exporter = KVExporter(self._shard_caches())

    def host_block_bytes(self) -> int:
        """Bytes of one block in the host tier: every group of KV heads' part of it."""
        return self.block_bytes() * self.kv_head_shards()

    def allocate_host_kv(self, num_slots: int) -> None:
        """Host memory for `num_slots` blocks: the prefix cache's second tier (after
        allocate_kv)."""
        if self.tp is None:
            ranks = [(self.kv_caches, 0)]
        else:
            ranks = [(caches, self._kv_shard_of(r)) for r, caches in enumerate(self.rank_caches)]
        self.host_kv = HostKVStore(self._shard_caches(), ranks, num_slots)

    def move_kv(self, moves: list[KVMove]) -> None:
        """Runs the host tier's copies (engine/host_prefix_cache.py), in order."""
        if moves:
            if self.host_kv is None:
                raise RuntimeError("KV moves without host memory (allocate_host_kv)")
            self.host_kv.apply(moves)

    def _shard_caches(self) -> list[KVCache]:
        """One pool per group of KV heads, in head order (the first rank holding each)."""
        if self.tp is None:
            return [self.kv_caches]
        shards: dict[int, KVCache] = {}
        for rank, caches in enumerate(self.rank_caches):
            shards.setdefault(self._kv_shard_of(rank), caches)
        return [shards[s] for s in sorted(shards)]

    def _kv_shard_of(self, rank: int) -> int:
        """Which group of KV heads `rank` holds."""
        return Shard(rank, len(self.rank_caches)).kv_shard(self.model.config)

    def kv_head_shards(self) -> int:
        return self.tp.shard.kv_shards(self.model.config) if self.tp is not None else 1

    def kv_layout(self) -> KVLayout:
        """The wire layout: every KV head, in one group per shard of this worker's heads."""
        dtype = str(self.kv_dtype).removeprefix("torch.")
        shards = self.kv_head_shards()
        return KVLayout(
            self.num_layers, self.num_kv_heads * shards, self.head_dim, self.block_size, dtype,
            head_shards=shards, rope=rope_variant(self.model.config, self.max_model_len),
        )  # fmt: skip

    def read_kv(self, block_ids: list[int], chunk_bytes: int | None = None) -> Iterator[memoryview]:
        """The blocks' KV as raw bytes in kv_transfer's wire order, in bounded chunks gathered on
        a stream of their own (kv_export.py); each chunk's memory is reused by the next. The
        caller keeps the blocks from being reused meanwhile."""
        if self.exporter is None:
            raise RuntimeError("the KV pool is not allocated")
        return self.exporter.read(block_ids, chunk_bytes)

    @torch.inference_mode()
    def write_kv(self, block_ids: list[int], payload: torch.Tensor, first_block: int = 0) -> None:
        """Loads a pulled payload (uint8, in kv_layout(), covering `len(block_ids)` blocks from
        block `first_block` of the sender's list on) into our blocks: each group of heads into
        the ranks that hold it."""
        n, shards = len(block_ids), self.kv_head_shards()
        shape = (self.num_layers, 2, shards, -1, self.block_size, self.num_kv_heads, self.head_dim)
        # [layers, k/v, shard, blocks, bs, H, D] (a float8 pool's as bytes: kv_dtype.as_rows)
        blocks = as_rows(payload.view(self.kv_dtype)).view(shape)
        for rank, caches in enumerate(self.rank_caches):
            device = caches[0][0].device
            index = torch.tensor(block_ids, dtype=torch.long, device=device)
            shard = self._kv_shard_of(rank)
            for layer, (keys, values) in enumerate(caches):
                for which, cache in enumerate((keys, values)):
                    part = blocks[layer, which, shard, first_block : first_block + n]
                    as_rows(cache).index_copy_(0, index, part.to(device, non_blocking=True))

    def enable_decode_graphs(self, max_batch: int, capture: bool = True) -> None:
        """Run decode-only steps of up to max_batch requests through fixed-shape buffers, captured
        as CUDA graphs when `capture` (CUDA only); capture=False runs the same path eagerly."""
        if self.ranks is not None:
            self.ranks.call("enable_decode_graphs", max_batch, capture)
        self.graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.tables.device_table,
            self.block_size,
            max_batch,
            self.decode_backend,
            self.windows,
            self.decode_as_matmuls,
            self.device,
        )
        if capture:
            if self.lora is not None:  # the graphs hold every slot's deltas
                self.lora.step.active, self.lora.step.used = True, None
            self.graphs.capture()

    def release(self, request_id: str) -> None:
        """The request finished or was preempted: its block-table row goes back."""
        self.tables.release(request_id)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, row_of: Callable[[str], SamplingRow]) -> Executed:
        """One forward pass over the scheduled tokens: the tokens sampled for the requests whose
        `sample` flag is set, and the embeddings of the embedding requests among them.
        `row_of(request_id)`: its sampling row."""
        graph = self.graphs is not None and self.graphs.fits(out)
        group = self.decode_backend == "torch" and not graph
        plan = plan_step(out.scheduled, self.tables, self.block_size, group)
        # a row per sampled position: a drafted request's draft positions draw too, each with
        # its position's seed, and the draft is kept while the draws agree (speculation.py)
        sampled_rows: list[SamplingRow] = []
        positions: list[int] = []
        starts: list[int] = []  # each request's first row
        for s in plan.sampled:
            row, first = row_of(s.request.request_id), s.start + s.num_tokens - len(s.draft)
            starts.append(len(sampled_rows))
            sampled_rows += [row] * (1 + len(s.draft))
            positions += range(first, first + 1 + len(s.draft))
        drafted = None  # the draft tokens before each row's position, in a step with drafts
        if any(s.draft for s in plan.sampled):
            drafted = [s.draft[:j] for s in plan.sampled for j in range(1 + len(s.draft))]
        sampling = SamplingBatch.from_rows(sampled_rows, positions, self.vocab_size, drafted)
        spans = _prompt_logprob_spans(plan, row_of)
        step = RankStep(
            plan.arrays(), self.tables.pending_updates(), graph, [(a, b) for a, b, *_ in spans]
        )
        if self.ranks is not None:
            self.ranks.call("run_step", step)
        forward = self.run_step(step, sampling)
        for (_, _, row, targets), span in zip(spans, forward.span_logits, strict=True):
            counts = [row.params.prompt_logprobs or 0] * len(targets)
            row.prompt_logprobs.extend(token_logprobs(span, targets, counts, ranked=True))
        embeddings = {}
        if forward.pooled is not None:
            vectors = forward.pooled.cpu().numpy()
            embeddings = {
                s.request.request_id: v for s, v in zip(plan.pooled, vectors, strict=True)
            }
        if forward.logits is None or forward.sampling is None:
            return Executed({}, embeddings)
        settings = forward.sampling
        if sampling.grammar:  # on the host while the device runs the forward
            words = grammar_masks(sampled_rows, self.vocab_size, drafted)
            self.mask_staging.add(words)
            settings.grammar_words = self.mask_staging.upload()[0].view(words.shape)
        tokens = sample(forward.logits, sampled_rows, settings)
        sampled, verified = {}, {}  # a request's last token; a drafted one's tokens before it
        for s, start in zip(plan.sampled, starts, strict=True):
            sampled[s.request.request_id] = tokens[start + len(s.draft)]
            if s.draft:
                verified[s.request.request_id] = tokens[start : start + len(s.draft)]
        return Executed(sampled, embeddings, verified)

    @torch.inference_mode()
    def run_step(self, step: RankStep, sampling: SamplingBatch | None = None) -> Forward:
        """The forward pass of a step, as every rank runs it. The other ranks run it for the
        collectives and drop the result."""
        a = step.arrays
        t = self._upload(a, step.table_updates, sampling)
        if self.lora is not None:  # a graph always runs every slot's deltas
            adapted = a.lora_slots[a.lora_slots >= 0]
            used = None if step.graph else np.unique(adapted).tolist()
            self.lora.step.set(t.lora_slots, used, uniform=len(adapted) == len(a.lora_slots))
        if step.graph and self.graphs is not None:
            logits = self.graphs.run(t.input_ids, t.positions, t.slots, t.decode_rows, t.decode_ctx)
            return Forward(logits, [], t.sampling, None)
        meta = self._metadata(a, t)
        hidden = self.model(t.input_ids, t.positions, self.kv_caches, meta)
        spans = [self.model.compute_logits(hidden[s:e]) for s, e in step.logit_spans]
        pooled = hidden.index_select(0, t.pool_index).float() if len(a.pool_index) else None
        if not len(a.sample_index):
            return Forward(None, spans, t.sampling, pooled)
        logits = self.model.compute_logits(hidden.index_select(0, t.sample_index))
        return Forward(logits, spans, t.sampling, pooled)

    def _upload(
        self,
        arrays: StepArrays,
        updates: tuple[np.ndarray, np.ndarray] | None,
        sampling: SamplingBatch | None,
    ) -> StepTensors:
        """The step's arrays, the sampling settings and the block-table updates on the device,
        in one copy; the updates applied to the device tables."""
        names = [f.name for f in fields(StepTensors) if f.name != "sampling"]
        inputs = [getattr(arrays, name) for name in names]
        settings = sampling.arrays() if sampling is not None else []
        for array in [*inputs, *settings, *(updates or ())]:
            self.staging.add(array)
        t = self.staging.upload()  # in the order added
        k = len(inputs) + len(settings)
        if updates is not None:
            self.tables.apply(t[k], t[k + 1])
        on_device = (
            DeviceSampling.take(sampling, t[len(inputs) : k]) if sampling is not None else None
        )
        return StepTensors(**dict(zip(names, t[: len(names)], strict=True)), sampling=on_device)

    def _metadata(self, plan: StepArrays, step: StepTensors) -> AttentionMetadata:
        """Attention metadata for the eager path: device ops on the uploaded inputs only."""
        table = self.tables.device_table
        n_dec = plan.num_decodes
        # As wide as the step's longest decode needs (the Triton kernel plans its splits on it)
        width = -(-int(plan.decode_ctx.max()) // self.block_size) if n_dec else 0
        dec_tables = table[:, :width].index_select(0, step.decode_rows)
        groups = []
        for g in plan.groups:
            ctx = step.decode_ctx[g.start : g.start + g.size]
            num_keys = g.width * self.block_size
            masks, biases = decode_masks(ctx, num_keys, self.windows, self.decode_as_matmuls)
            groups.append(
                DecodeGroup(
                    start=g.start,
                    size=g.size,
                    block_tables=dec_tables[g.start : g.start + g.size, : g.width].long(),
                    masks=masks,
                    first_block=g.first_block,
                    biases=biases,
                )
            )
        prefills = [
            PrefillSeq(
                start=p.start,
                q_len=p.q_len,
                ctx_len=p.ctx_len,
                block_table=table[p.row, : p.num_blocks].long(),
            )
            for p in plan.prefills
        ]
        return AttentionMetadata(
            slot_mapping=step.slots,
            num_decode_tokens=n_dec,
            decode_block_tables=dec_tables,
            decode_context_lens=step.decode_ctx,
            decode_groups=groups,
            prefills=prefills,
            decode_backend=self.decode_backend,
        )

    def stop(self) -> None:
        """Stops the other ranks (tensor parallelism); nothing to do otherwise."""
        if self.ranks is not None:
            self.ranks.stop()
            self.ranks = None


def _prompt_logprob_spans(
    plan: StepPlan, row_of: Callable[[str], SamplingRow]
) -> list[tuple[int, int, SamplingRow, list[int]]]:
    """For each request that asks for prompt logprobs and has prompt tokens this step, the rows
    [start, end) of the step's hidden states predicting its prompt tokens (position p predicts
    token p + 1), its SamplingRow, and those tokens. A chunk computed again after a preemption
    adds nothing."""
    spans = []
    offset = 0
    for s in plan.batch:
        start = offset
        offset += s.num_tokens
        req = s.request
        if req.params.prompt_logprobs is None:
            continue
        row = row_of(req.request_id)
        end = min(s.start + s.num_tokens, req.num_prompt_tokens - 1)
        if end <= s.start or s.start != len(row.prompt_logprobs):
            continue
        spans.append((start, start + end - s.start, row, req.token_ids(s.start + 1, end + 1)))
    return spans


@dataclass
class StepTensors:
    """A StepPlan's arrays on the device (see StepPlan for each)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    decode_rows: torch.Tensor
    decode_ctx: torch.Tensor
    sample_index: torch.Tensor
    pool_index: torch.Tensor
    lora_slots: torch.Tensor
    sampling: DeviceSampling | None  # rank 0's


@dataclass
class Forward:
    """What a step's forward pass gives rank 0."""

    logits: torch.Tensor | None  # [S, vocab] float32: the sampled rows'; None: nothing samples
    span_logits: list[torch.Tensor]  # each logit span's [end - start, vocab] (prompt logprobs)
    sampling: DeviceSampling | None  # the sampling settings on the device
    pooled: torch.Tensor | None  # [P, hidden] float32: the embedding requests' last final
    # hidden states; None: none this step


@dataclass
class Executed:
    """A step's results, by request id."""

    sampled: dict[str, int]  # the token each sampling request drew
    embeddings: dict[str, np.ndarray]  # [hidden] float32: each finished embedding request's
    # the token drawn at each draft position but the last, of each request with a draft
    verified: dict[str, list[int]] = field(default_factory=dict)
