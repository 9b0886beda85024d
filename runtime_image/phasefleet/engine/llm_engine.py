"""LLMEngine: the single-threaded engine loop (add requests, step, read outputs).

Failure isolation: whatever goes wrong for one request alone (a distribution that is not finite,
detokenizing, stop strings) finishes that request with finish_reason 'error' and frees its
blocks; the other requests of the step go on exactly as they would have. Only a failure of the
step as a whole (scheduling, the forward pass) raises from `step()`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from phasefleet.autoscale.peaks import WindowPeak
from phasefleet.engine.config import MAX_GRAPH_BATCH, EngineConfig
from phasefleet.engine.detokenizer import IncrementalDetokenizer, decoder
from phasefleet.engine.grammar import GrammarCompiler, GrammarMatcher
from phasefleet.engine.host_kv_store import memory_left
from phasefleet.engine.kv_cache_manager import KVCacheManager, cdiv
from phasefleet.engine.kv_import import KVImports
from phasefleet.engine.kv_transfer import KVChunk, KVLayout, Lease, LeaseTable
from phasefleet.engine.lora import NO_SLOT, LoadedAdapter, LoraError, read_adapter
from phasefleet.engine.model_runner import ModelRunner, resolve_device, resolve_dtype
from phasefleet.engine.models.rope import long_factors_from
from phasefleet.engine.models.traits import load_decoder_config
from phasefleet.engine.outputs import EngineStats, RequestOutput
from phasefleet.engine.request import Request, RequestStatus
from phasefleet.engine.sampler import SamplingRow
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.scheduler import Scheduler, SchedulerOutput
from phasefleet.engine.speculation import NgramProposer
from phasefleet.engine.startup import StartupTimes
from phasefleet.engine.tokenizer import eos_token_ids, load_tokenizer

__all__ = ["EngineStats", "LLMEngine", "RequestOutput"]


logger = logging.getLogger(__name__)


@dataclass
class _Live:
    """What the engine keeps for a request from its admission to its last output, beside the
    scheduler's Request."""

    row: SamplingRow
    detok: IncrementalDetokenizer
    drafts: NgramProposer | None = None  # its drafts, when the engine speculates


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        separate_device: bool | None = None,
        startup: StartupTimes | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """`separate_device`: see ModelRunner (tests run the GPU path's host side on the CPU).
        `startup` gets the time of each loading phase (engine/startup.py). `grammars`: the
        compiler of requests' grammars, shared with the server (else the engine makes one)."""
        config.validate()
        self.config = config
        self.startup = startup = startup or StartupTimes()
        folder = Path(config.model)
        if not (folder / "config.json").is_file():
            raise ValueError(f"model must be a Hugging Face folder with config.json, got {folder}")
        self.model_name = folder.resolve().name
        with startup.phase("config"):
            self.hf_config: Any = load_decoder_config(folder)
            self.tokenizer: Any = load_tokenizer(folder)
        # by skip_special_tokens: the output text without or with the special tokens
        self._decoders = {skip: decoder(self.tokenizer, skip) for skip in (True, False)}
        limit = int(self.hf_config.max_position_embeddings)
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(
                f"max_model_len must be <= the model's max_position_embeddings ({limit}), "
                f"got {config.max_model_len}"
            )
        self.max_model_len: int = config.max_model_len or limit
        short_up_to = long_factors_from(self.hf_config)
        if short_up_to is not None and self.max_model_len > short_up_to:
            logger.info(
                "LongRoPE: max_model_len %d passes original_max_position_embeddings %d, so every "
                "position uses the long factors (--max-model-len %d keeps the short ones)",
                self.max_model_len,
                short_up_to,
                short_up_to,
            )
        self.device = resolve_device(config.device)
        checkpoint_dtype = getattr(self.hf_config, "dtype", None)  # config.json's, may be absent
        self.dtype = resolve_dtype(config.dtype, checkpoint_dtype, self.device)
        self.runner = ModelRunner(
            folder,
            self.hf_config,
            self.dtype,
            self.device,
            config.block_size,
            self.max_model_len,
            config.max_num_seqs,
            separate_device,
            startup,
            tensor_parallel_size=config.tensor_parallel_size,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        if config.num_lora_slots:
            with startup.phase("lora"):
                self._load_adapters(config)
        with startup.phase("kv_cache"):
            num_blocks = config.num_kv_blocks or self.runner.auto_num_blocks(
                config.max_num_seqs, self.max_model_len, config.max_num_batched_tokens
            )
            self.runner.allocate_kv(num_blocks)
            host_slots = self._host_slots(config)
            if host_slots:
                self.runner.allocate_host_kv(host_slots)
        if (
            self.device.type == "cuda"
            and self.runner.decode_backend == "triton"
            and os.environ.get("PHASEFLEET_CUDA_GRAPHS", "1") != "0"
        ):
            with startup.phase("cuda_graphs"):
                self.runner.enable_decode_graphs(min(config.max_num_seqs, MAX_GRAPH_BATCH))
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, host_slots
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            self.max_model_len,
            eos_token_ids=eos_token_ids(folder, self.hf_config, self.tokenizer),
            late_after_s=config.late_after_s,
            late_limit_s=config.late_limit_s,
            policy=config.scheduling_policy,
        )
        self.kv_layout: KVLayout = self.runner.kv_layout()
        self.leases = LeaseTable(config.kv_lease_seconds)
        self.num_kv_lease_expiries_total = 0
        self.busy_seconds_total = 0.0  # wall time in steps that had work
        self.requests_peak = WindowPeak()  # running + waiting, after each step's admissions
        self.kv_usage_peak = WindowPeak()
        self.last_step_idle = False  # the last step computed nothing (importers wait for KV)
        self.imports = KVImports(self.runner, self.kv, self.kv_layout)
        self._live: dict[str, _Live] = {}
        self._aborted: list[RequestOutput] = []
        self.grammars = grammars or GrammarCompiler(
            self.tokenizer, int(self.hf_config.vocab_size), self.scheduler.eos_token_ids
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        *,
        prefill_only: bool = False,
        first_token_id: int | None = None,
        imported_kv: list[KVChunk] | None = None,
        importing_from: int | None = None,
        late_after_s: float | None = None,
        lora: str | None = None,
        priority: int = 0,
    ) -> None:
        """Queues a request; `lora`: the name of a loaded adapter to run it with (None: the base
        model); `priority`: its rank under the priority policy (lower first; ValueError unless
        the engine's policy is `priority`). `late_after_s`: its TTFT target for late prompts
        last (else the engine's `late_after_s`). Hand-off forms: `prefill_only` (prefill role)
        finishes with 'handoff' after the first token and keeps the prompt's KV under a lease;
        `first_token_id` (decode role) continues a request another worker prefilled, from
        `imported_kv` (consecutive chunks of its prompt's blocks, in this engine's layout: the
        prompt's tail past them, if any, is recomputed here) or, without it, recomputing.
        `importing_from` (a block): more chunks follow from `import_kv`, the first at that
        block, until `end_import`; the request is computed only then, and its first token may
        come with `end_import` instead."""
        params.validate()
        self._check_prompt(prompt_token_ids, params.max_tokens)
        vocab = self.hf_config.vocab_size
        listed = {
            "logit_bias": list(params.logit_bias),
            "allowed_token_ids": params.allowed_token_ids or [],
            "bad_words": [t for word in params.bad_words for t in word],
        }
        for name, ids in listed.items():
            if any(t >= vocab for t in ids):
                raise ValueError(f"{name} token ids must be in [0, {vocab}), got {max(ids)}")
        self._check_some_token_allowed(params)
        if first_token_id is not None:
            if not 0 <= first_token_id < vocab:
                raise ValueError(f"first_token_id must be in [0, {vocab}), got {first_token_id}")
            if params.max_tokens < 2:
                raise ValueError("a request continued from its first token needs max_tokens >= 2")
        self._check_queueing(late_after_s, priority)
        handed_off = first_token_id is not None or importing_from is not None
        if handed_off and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs needs the prompt computed here, not imported")
        imported_kv = imported_kv or []
        if imported_kv and importing_from is None and first_token_id is None:
            raise ValueError("imported_kv must come with first_token_id or importing_from")
        first_block = imported_kv[0].first_block if imported_kv else importing_from or 0
        if importing_from is not None and first_block != importing_from:
            raise ValueError(f"imported_kv must start at block {importing_from}")
        imported_tokens = self.imports.check(imported_kv, first_block, len(prompt_token_ids))
        adapter = None if lora is None else self._adapter(lora)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            output_token_ids=[] if first_token_id is None else [first_token_id],
            prefill_only=prefill_only,
            num_imported_tokens=imported_tokens,
            import_first_block=first_block,
            importing=importing_from is not None,
            late_after_s=late_after_s,
            priority=priority,
            lora_slot=NO_SLOT if adapter is None else adapter.slot,
            prefix_salt=None if adapter is None else adapter.salt,
        )
        # Everything that can fail comes before the scheduler sees the request: a request it
        # holds without a sampling row would fail every later step.
        matcher = None if params.grammar is None else self.grammars.matcher(params.grammar)
        if matcher is not None:
            matcher.open_if_in(prompt_token_ids)  # a template that closed the thought already
        if matcher is not None and first_token_id is not None:
            matcher.accept(first_token_id)
        decode = self._decoders[params.skip_special_tokens]
        detok = IncrementalDetokenizer(decode, params.stop, params.include_stop_str_in_output)
        if first_token_id is not None:
            detok.update([first_token_id])  # the text goes on from what the prefill worker sent
        self.scheduler.add_request(request)
        row = SamplingRow(params, output_ids=request.output_token_ids, matcher=matcher)
        if params.repeats_seen:
            row.prompt_ids = np.unique(np.asarray(prompt_token_ids, dtype=np.int64))
        if len(request.output_token_ids) < params.min_tokens:
            row.banned = self._min_tokens_banned(params)
        drafts = None
        k = self.config.num_speculative_tokens
        if k and not prefill_only:
            c = self.config
            drafts = NgramProposer(k, c.prompt_lookup_min, c.prompt_lookup_max)
        self._live[request_id] = _Live(row, detok, drafts)
        if imported_kv or importing_from is not None:
            self.imports.add(request_id, imported_kv)

    def add_embedding_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        arrival_time: float | None = None,
        *,
        late_after_s: float | None = None,
        lora: str | None = None,
        priority: int = 0,
    ) -> None:
        """Queues an embedding: the prompt is computed like any other (prefix-cache hits
        included), then the request finishes with 'embedded' and its output carries the last
        token's final hidden state (`RequestOutput.embedding`), sampling nothing."""
        self._check_prompt(prompt_token_ids, 0)
        self._check_queueing(late_after_s, priority)
        adapter = None if lora is None else self._adapter(lora)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=SamplingParams(max_tokens=1),  # never sampled
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            embed=True,
            late_after_s=late_after_s,
            priority=priority,
            lora_slot=NO_SLOT if adapter is None else adapter.slot,
            prefix_salt=None if adapter is None else adapter.salt,
        )
        self.scheduler.add_request(request)

    def _check_queueing(self, late_after_s: float | None, priority: int) -> None:
        if late_after_s is not None and late_after_s <= 0:
            raise ValueError(f"late_after_s must be > 0 seconds, got {late_after_s}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"priority {priority} needs the priority scheduling policy "
                f"(scheduling_policy is {self.config.scheduling_policy!r})"
            )

    def _check_prompt(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        """ValueError when the prompt and max_tokens cannot run here."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must contain at least one token, got an empty prompt")
        if n + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) plus max_tokens ({max_tokens}) must fit "
                f"max_model_len ({self.max_model_len}), got {n + max_tokens}"
            )
        needed = self.kv.blocks_needed(n + max_tokens)
        if needed > self.kv.pool.num_usable_blocks:
            raise ValueError(
                f"prompt plus max_tokens needs {needed} KV blocks, more than the whole pool "
                f"({self.kv.pool.num_usable_blocks}); lower max_tokens or raise num_kv_blocks"
            )
        vocab = self.hf_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {prompt_token_ids}")

    def _host_slots(self, config: EngineConfig) -> int:
        """The host tier's blocks (0: off); ValueError when its memory holds not even one."""
        if not config.host_kv_cache_gib:
            return 0
        block, wanted = self.runner.host_block_bytes(), int(config.host_kv_cache_gib * 2**30)
        slots = wanted // block
        if slots < 1:
            raise ValueError(
                f"host_kv_cache_gib {config.host_kv_cache_gib} holds no KV block of "
                f"{block} bytes; give at least {block / 2**30:.6f} GiB or 0 (off)"
            )
        left = memory_left()
        if left is not None and wanted > left:
            raise ValueError(
                f"host_kv_cache_gib {config.host_kv_cache_gib} is more than the "
                f"{left / 2**30:.1f} GiB of memory this worker has left after loading; lower it,"
                " or raise the memory limit (on Kubernetes the operator adds the tier to the"
                " pool's memory request and limit)"
            )
        logger.info("host KV tier: %d blocks of %.0f KiB", slots, block / 2**10)
        return slots

    def _load_adapters(self, config: EngineConfig) -> None:
        tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.runner.enable_lora(config.num_lora_slots, config.max_lora_rank, tokens)
        for name, folder in config.lora_adapters.items():
            self.load_lora(name, folder)

    def _adapter(self, name: str) -> LoadedAdapter:
        """A loaded adapter's slot and salt; LoraError when it is not loaded."""
        if self.runner.lora is None:
            raise LoraError(f"LoRA adapter {name!r} is not loaded")
        return self.runner.lora.get(name)

    def load_lora(self, name: str, folder: str) -> None:
        """Reads an adapter into a free slot; LoraError (nothing changed) when it cannot.
        Engine thread only."""
        if self.runner.lora is None:
            raise LoraError(f"LoRA adapter {name!r}: this engine has no adapter slots (max_loras)")
        self.runner.lora.load(read_adapter(name, folder))

    def unload_lora(self, name: str) -> None:
        """Empties an adapter's slot; LoraError when it is not loaded or a running or waiting
        request still uses it (a finished prefill's leased KV is computed already). Engine
        thread only."""
        slot = self._adapter(name).slot
        users = [r for r in self.scheduler.requests.values() if r.lora_slot == slot]
        if users:
            raise LoraError(
                f"LoRA adapter {name!r} is in use by {len(users)} request(s): unload it once "
                "they finish"
            )
        if self.runner.lora is not None:  # _adapter found it there
            self.runner.lora.unload(name)

    def import_kv(self, request_id: str, chunk: KVChunk) -> None:
        """The next chunk of an importing request's KV (written into its blocks now if it is
        admitted). Ignored once the import was dropped or the request is gone; ValueError if
        it is not the next chunk (nothing of it is used)."""
        req = self.scheduler.requests.get(request_id)
        if req is not None and req.importing:
            self.imports.arrive(req, chunk)

    def end_import(self, request_id: str, first_token_id: int | None = None) -> None:
        """No more KV comes: the request goes on from the last token whose KV arrived, after
        `first_token_id` if the prefill worker sent one (else it is sampled here). ValueError
        (the request unchanged) for a first token it cannot take."""
        req = self.scheduler.requests.get(request_id)
        if req is None or not req.importing:
            return
        if first_token_id is not None:
            self._check_first_token(req, first_token_id)
            live = self._live[request_id]
            if live.row.matcher is not None:
                live.row.matcher.accept(first_token_id)
            live.detok.update([first_token_id])
            if len(req.output_token_ids) + 1 >= req.params.min_tokens:
                live.row.banned = []
        self.scheduler.end_import(req, first_token_id)
        if req.status is RequestStatus.RUNNING:  # else what came loads at admission
            self.imports.dropped(request_id)

    def _check_first_token(self, req: Request, first_token_id: int) -> None:
        vocab = self.hf_config.vocab_size
        if not 0 <= first_token_id < vocab:
            raise ValueError(f"first_token_id must be in [0, {vocab}), got {first_token_id}")
        if req.output_token_ids or req.params.max_tokens < 2:
            raise ValueError("a request continued from its first token needs max_tokens >= 2")

    def _load_imports(self, out: SchedulerOutput) -> None:
        """Writes the KV that arrived into each admitted importer's blocks, past its prefix-cache
        hits; drops the imports the scheduler could not use."""
        for req, num_hit_blocks in out.imports:
            self.imports.admitted(req, num_hit_blocks)
            if not req.importing:
                self.imports.dropped(req.request_id)
        loaded = {req.request_id for req, _ in out.imports}
        for request_id in [*out.admitted, *out.preempted]:
            if request_id not in loaded:
                self.imports.dropped(request_id)  # a gap before it, hits, or its blocks gone

    def _check_some_token_allowed(self, params: SamplingParams) -> None:
        """ValueError when allowed_token_ids holds only tokens that are banned from the start:
        one-token bad words, and while min_tokens holds them back, the stop tokens."""
        if params.allowed_token_ids is None:
            return
        banned = {w[0] for w in params.bad_words if len(w) == 1}
        if params.min_tokens > 0:
            banned |= set(self._min_tokens_banned(params))
        if set(params.allowed_token_ids) <= banned:
            raise ValueError(
                "allowed_token_ids holds no token that may be sampled: each is a one-token bad"
                " word or, while min_tokens holds them back, an end-of-sequence or stop token"
            )

    def _min_tokens_banned(self, params: SamplingParams) -> list[int]:
        """The tokens that would end a request early: masked until it has min_tokens."""
        ends = set(params.stop_token_ids)
        if not params.ignore_eos:
            ends |= self.scheduler.eos_token_ids
        return sorted(t for t in ends if t < self.hf_config.vocab_size)

    def expire_leases(self) -> int:
        """Frees the blocks of leases that ran out; how many did. Engine thread only."""
        expired = self.leases.pop_expired()
        for lease in expired:
            self.kv.release(lease.request_id)
            logger.warning(
                "KV lease %s expired before a decode worker released it", lease.request_id
            )
        self.num_kv_lease_expiries_total += len(expired)
        return len(expired)

    def cached_prefix_tokens(self, prompt_token_ids: list[int], lora: str | None = None) -> int:
        """Leading prompt tokens the prefix cache holds now (for adapter `lora`), on the device
        or in host memory. An estimate when called off the engine thread (the cache may change
        meanwhile); takes no references."""
        loaded = self.runner.lora.loaded.get(lora or "") if self.runner.lora else None
        return self.kv.cached_tokens(prompt_token_ids, loaded.salt if loaded else None)

    def pin_kv(self, request_id: str) -> Lease | None:
        """The lease of a finished prefill, kept from expiring until `unpin_kv`; None when
        unknown or expired. Thread-safe: HTTP handlers call it while the engine steps."""
        return self.leases.pin(request_id)

    def read_kv(self, lease: Lease) -> Iterator[memoryview]:
        """A pinned lease's KV in wire layout, in chunks (safe off the engine thread: leased
        blocks are not written until released)."""
        return self.runner.read_kv(lease.block_ids)

    def unpin_kv(self, lease: Lease) -> None:
        self.leases.unpin(lease)

    def release_kv(self, request_id: str) -> bool:
        """Ends a lease and frees its blocks (the decode worker has its copy); False when
        unknown, expired or still being read. Engine thread only."""
        lease = self.leases.pop(request_id)
        if lease is None:
            return False
        self.kv.release(request_id)
        return True

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; its final output (finish_reason 'abort') comes
        from the next step(). A finished prefill's lease no pull is reading ends too (whoever
        would have read it left); any other unknown or finished id is a no-op."""
        req = self.scheduler.finish_request(request_id, "abort")
        if req is not None:
            live = self._live.get(request_id)
            text = live.detok.text(final=True) if live is not None else ""
            self._aborted.append(self._output(req, [], text))
            self._forget(request_id)
        elif self.leases.pop(request_id) is not None:
            self.kv.release(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        outputs, self._aborted = self._aborted, []
        self.expire_leases()
        out = self.scheduler.schedule()
        self.runner.move_kv(out.kv_moves)  # before the imports and the forward write the pool
        self.last_step_idle = not out.scheduled
        self._observe_peaks(time.monotonic())
        if out.is_empty:
            return outputs
        try:
            return self._run_step(out, outputs)
        finally:
            self.busy_seconds_total += time.perf_counter() - started

    def _observe_peaks(self, now: float) -> None:
        s = self.scheduler
        self.requests_peak.observe(len(s.running) + s.num_waiting, now)
        self.kv_usage_peak.observe(self.kv.pool.usage(), now)

    def peaks(self, now: float) -> tuple[float, float]:
        """(running + waiting, KV usage) at their highest of the PEAK_WINDOW_S seconds before
        `now` (time.monotonic), as observed after each step's admissions."""
        return self.requests_peak.peak(now), self.kv_usage_peak.peak(now)

    def _run_step(self, out: SchedulerOutput, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for request_id in out.preempted:
            self.runner.release(request_id)  # readmitted later with a new block table
        self._load_imports(out)
        if not out.scheduled:  # only admissions of importers, or preemptions
            return outputs
        executed = self.runner.execute(out, self._row_of)
        for s in out.scheduled:
            live = self._live.get(s.request.request_id)
            if s.sample and live is not None and live.row.error is not None:
                outputs.append(self._fail(s.request, live.row.error))
        changed = self.scheduler.update_from_output(out, executed.sampled, executed.verified)
        outputs += self._prefill_progress(out)
        for req in changed:
            if req.embed:
                outputs.append(self._embedded(req, executed.embeddings[req.request_id]))
                continue
            try:
                outputs.append(self._advance(req))
            except Exception as exc:  # a fault of this request alone (detokenizer, stop strings)
                logger.exception("request %s failed", req.request_id)
                outputs.append(self._fail(req, f"{type(exc).__name__}: {exc}"))
        return outputs

    def _row_of(self, request_id: str) -> SamplingRow:
        return self._live[request_id].row

    def _prefill_progress(self, out: SchedulerOutput) -> list[RequestOutput]:
        """For each prefill-only request that computed a chunk but sampled nothing this step,
        an output without tokens naming its blocks whose KV is now complete."""
        progress = []
        for s in out.scheduled:
            req = s.request
            if req.prefill_only and not s.sample and not req.is_finished:
                output = self._output(req, [], "")
                full = req.num_computed_tokens // self.config.block_size
                output.kv_blocks = self.kv.block_tables[req.request_id][:full]
                progress.append(output)
        return progress

    def _advance(self, req: Request) -> RequestOutput:
        """Detokenize the request's new tokens, apply stop strings, draft its next ones; its
        output for this step."""
        new = req.output_token_ids[-req.num_new_tokens :]
        live = self._live[req.request_id]
        detok, row = live.detok, live.row
        if row.matcher is not None:
            new = self._follow_grammar(req, row.matcher, new)
        if detok.stop and len(new) > 1:  # an accepted draft: a stop string may end it midway
            new = _update_until_stopped(detok, new)
        else:
            detok.update(new)
        if req.is_finished:
            detok.flush()  # the held-back tail may still hold a stop string
        if detok.stopped:
            self.scheduler.stop_at(req, len(new))
        output = self._output(req, new, detok.text(final=req.is_finished))
        if row.params.logprobs is not None:
            output.logprobs = row.logprobs[: len(new)]  # drafted: the accepted tokens' first
        if row.params.prompt_logprobs is not None and len(req.output_token_ids) == 1:
            output.prompt_logprobs = row.prompt_logprobs
        if len(req.output_token_ids) >= row.params.min_tokens:
            row.banned = []
        if req.is_finished:
            output.kv_blocks = self._settle_held_kv(req)
            self._forget(req.request_id)
        elif live.drafts is not None:
            self._draft(req, live.drafts)
        return output

    def _draft(self, req: Request, drafts: NgramProposer) -> None:
        """Guesses at req's next tokens for its next step (none before min_tokens: the eos
        ban is not applied where drafts are verified), cut to what its grammar takes."""
        drafts.extend(req.token_ids(drafts.size, req.num_tokens))
        if len(req.output_token_ids) < req.params.min_tokens:
            return
        left = req.params.max_tokens - len(req.output_token_ids) - 1  # the step adds one more
        draft = drafts.propose(left)
        matcher = self._live[req.request_id].row.matcher
        if matcher is not None and draft:
            draft = draft[: matcher.valid_prefix(draft)]
        req.draft_token_ids = draft

    def _embedded(self, req: Request, embedding: np.ndarray) -> RequestOutput:
        output = self._output(req, [], "")
        output.embedding = embedding
        self._forget(req.request_id)
        return output

    def _follow_grammar(self, req: Request, matcher: GrammarMatcher, new: list[int]) -> list[int]:
        """The grammar takes the request's new tokens (ValueError when it refuses one: the mask
        failed); one that completes it ends the request there, 'stop' (the accepted draft
        tokens after it taken back; also one that stopped on length or was to be handed off:
        there is nothing left to generate). Returns the new tokens kept."""
        for i, token in enumerate(new):
            if req.is_finished and i == len(new) - 1 and token in self.scheduler.eos_token_ids:
                break  # the end of the sequence, which a complete grammar allows
            matcher.accept(token)
            if matcher.done:
                self.scheduler.stop_at(req, i + 1)
                return new[: i + 1]
        return new

    def _settle_held_kv(self, req: Request) -> list[int] | None:
        """A finished prefill-only request: lease its prompt's blocks for the hand-off (and
        return them), or free them when it ended for good (eos, stop string, length)."""
        held = self.kv.held.get(req.request_id)
        if held is None:
            return None
        if req.finish_reason == "handoff":
            n = req.num_prompt_tokens
            return self.leases.add(
                req.request_id, held[: cdiv(n, self.config.block_size)], n
            ).block_ids
        self.kv.release(req.request_id)
        return None

    def _fail(self, req: Request, error: str) -> RequestOutput:
        """Finish one request with finish_reason 'error' (freeing its blocks); its last output."""
        if req.is_finished:
            req.finish_reason = "error"
            self.leases.pop(req.request_id)
            self.kv.release(req.request_id)  # blocks held for a hand-off, if any
        else:
            self.scheduler.finish_request(req.request_id, "error")
        self._forget(req.request_id)
        return self._output(req, [], "", error)

    def _output(
        self, req: Request, new: list[int], text: str, error: str | None = None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=list(new),
            output_token_ids=list(req.output_token_ids) if req.is_finished else [],
            text=text,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            first_scheduled_time=req.first_scheduled_time,
            error=error,
        )

    def _forget(self, request_id: str) -> None:
        self.runner.release(request_id)
        self._live.pop(request_id, None)
        self.imports.dropped(request_id)

    def stats(self) -> EngineStats:
        s, pool, lora = self.scheduler, self.kv.pool, self.runner.lora
        requests_peak, kv_usage_peak = self.peaks(time.monotonic())
        return EngineStats(
            num_running=len(s.running),
            num_waiting=s.num_waiting,
            kv_cache_usage=pool.usage(),
            num_requests_peak=requests_peak,
            kv_cache_usage_peak=kv_usage_peak,
            num_free_blocks=pool.num_free_blocks,
            num_total_blocks=pool.num_usable_blocks,
            prefill_tokens_pending=s.prefill_tokens_pending,
            prefill_tokens_waiting=s.prefill_tokens_waiting,
            num_preemptions_total=s.num_preemptions_total,
            late_prompts_total=s.late_prompts_total,
            prefix_cache_queries_total=s.prefix_cache_queries_total,
            prefix_cache_hits_total=s.prefix_cache_hits_total,
            prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
            spec_draft_tokens_total=s.draft_tokens_total,
            spec_accepted_tokens_total=s.accepted_tokens_total,
            num_kv_leases=len(self.leases),
            num_kv_lease_expiries_total=self.num_kv_lease_expiries_total,
            busy_seconds_total=self.busy_seconds_total,
            max_loras=lora.max_loras if lora is not None else 0,
            loaded_loras=tuple(sorted(lora.loaded)) if lora is not None else (),
            running_loras=self._adapters_of(s.running),
            waiting_loras=self._adapters_of([*s.waiting, *s.late]),
            host_kv_cache_hits_total=s.host_cache_hits_total,
            host_kv_cache_usage=self.kv.host.usage() if self.kv.host is not None else 0.0,
        )

    def _adapters_of(self, requests: Iterable[Request]) -> tuple[str, ...]:
        lora = self.runner.lora
        if lora is None or not lora.loaded:
            return ()
        names = {a.slot: name for name, a in lora.loaded.items()}
        return tuple(sorted({names[r.lora_slot] for r in requests if r.lora_slot in names}))

    def close(self) -> None:
        """Stops the engine's other tensor-parallel ranks (nothing else holds resources)."""
        self.runner.stop()

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        loras: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Offline: run every prompt to completion (with its LoRA adapter from `loras`, if
        given); final outputs in input order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(
                f"params must be one SamplingParams or one per prompt ({len(prompts)}), "
                f"got {len(plist)}"
            )
        base = f"generate-{time.monotonic_ns()}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        adapters = loras if loras is not None else [None] * len(prompts)
        for rid, prompt, p, lora in zip(ids, prompts, plist, adapters, strict=True):
            self.add_request(rid, prompt, p, lora=lora)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[rid] for rid in ids]


def _update_until_stopped(detok: IncrementalDetokenizer, new: list[int]) -> list[int]:
    """Feeds the tokens one at a time, as steps without drafts would; those up to the one
    that completes a stop string (all of them when none does)."""
    for i, token in enumerate(new):
        detok.update([token])
        if detok.stopped:
            return new[: i + 1]
    return new
