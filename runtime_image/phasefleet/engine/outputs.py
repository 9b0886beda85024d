"""What the engine hands back: RequestOutput per request per step, and EngineStats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the router reads these outputs' shape without numpy
    import numpy as np


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    """log-probability of token_id under the raw logits (phasefleet.engine.logprobs)."""
    top: list[tuple[int, float]]
    """The most likely (token id, logprob), best first."""
    rank: int | None = None
    """1 + the number of tokens more likely than token_id; None: not computed (only prompt
    logprobs are ranked)."""


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    """Tokens produced by this step."""
    output_token_ids: list[int]
    """All output tokens, on the request's last output (`finished`); empty on the outputs before
    it, which carry their step's tokens in `new_token_ids` (a copy of the whole list at every
    step would cost each step time that grows with the answer)."""
    text: str
    """Detokenized output so far. Only ever grows between steps: an incomplete UTF-8 tail and any
    trailing text that could start a stop string are held back; a stop string is excluded."""
    finished: bool
    finish_reason: str | None
    """'stop' (eos, stop string or stop token) | 'length' | 'abort' | 'error' (this request alone
    failed; see `error`) | 'handoff' (a prefill-only request has its first token; its KV is held
    under a lease for a decode worker) | 'embedded' (an embedding request: see `embedding`);
    None while running."""
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    first_scheduled_time: float | None
    """time.monotonic() when first scheduled (for the queue-time metric)."""
    error: str | None = None
    """What went wrong, when finish_reason is 'error' (then `text` is empty)."""
    logprobs: list[TokenLogprob] | None = None
    """One per new token, when the request asked (SamplingParams.logprobs)."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """Prompt tokens 1.. (the first has none), in the request's first output, when it asked
    (SamplingParams.prompt_logprobs)."""
    kv_blocks: list[int] | None = None
    """A prefill-only request: the ids of its prompt's blocks whose KV is complete, in order, as
    of this step (full blocks while it runs, then every block once finished with 'handoff'), so
    the hand-off can send each chunk's KV as soon as it is computed. Its steps that sample no
    token give an output too, with no new tokens."""
    embedding: np.ndarray | None = None
    """An embedding request's last output: [hidden] float32, the final hidden state (after the
    model's last norm) of its last prompt token, not normalized."""


@dataclass
class EngineStats:
    num_running: int
    """Requests in the running batch."""
    num_waiting: int
    """Requests queued, not yet scheduled (preempted ones included)."""
    kv_cache_usage: float
    """Used KV blocks / all usable KV blocks, 0..1."""
    num_free_blocks: int
    num_total_blocks: int
    """Usable blocks (the null block is not counted)."""
    prefill_tokens_pending: int
    """Prompt tokens admitted but not yet prefilled."""
    num_preemptions_total: int
    prefix_cache_queries_total: int
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits_total: int
    """Prompt tokens found in the prefix cache."""
    prompt_tokens_total: int
    generation_tokens_total: int
    num_kv_leases: int = 0
    """Finished prefills whose KV blocks are held for a decode worker to pull."""
    num_kv_lease_expiries_total: int = 0
    """Leases that ran out before the decode worker released them (their blocks were freed)."""
    busy_seconds_total: float = 0.0
    """Wall seconds spent in steps that had work (its rate is the busy fraction, 0..1)."""
    prefill_tokens_waiting: int = 0
    """Prompt tokens of the queued requests, not yet admitted (prefix-cache hits not known yet)."""
    late_prompts_total: int = 0
    """Prompts moved behind on-time ones, having waited past the TTFT target (each once)."""
    spec_draft_tokens_total: int = 0
    """Draft tokens verified (engine/speculation.py)."""
    spec_accepted_tokens_total: int = 0
    """Of them, those the model agreed with."""
    num_requests_peak: float = 0.0
    """The highest running + waiting of the last PEAK_WINDOW_S seconds (autoscale/peaks.py)."""
    kv_cache_usage_peak: float = 0.0
    """The highest KV usage of the last PEAK_WINDOW_S seconds, 0..1."""
    max_loras: int = 0
    """LoRA adapter slots; 0: no adapters."""
    loaded_loras: tuple[str, ...] = ()
    """The adapters loaded in those slots, sorted."""
    running_loras: tuple[str, ...] = ()
    """The adapters of the running requests, sorted."""
    waiting_loras: tuple[str, ...] = ()
    """The adapters of the waiting requests, sorted."""
    host_kv_cache_hits_total: int = 0
    """Prompt tokens loaded from the prefix cache's host tier (part of prefix_cache_hits)."""
    host_kv_cache_usage: float = 0.0
    """Used slots / all slots of the host tier, 0..1; 0 without one."""
