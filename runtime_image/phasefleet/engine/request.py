"""Request: one prompt's state as it moves through the scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from phasefleet.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (prefix-cache hits included)."""
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first admission; -1 until admitted."""
    first_scheduled_time: float | None = None
    """time.monotonic() of the first admission."""
    finish_reason: str | None = None
    """'stop' | 'length' | 'abort' | 'error' once finished."""
    num_preemptions: int = 0
    prefill_only: bool = False
    """Prefill role: finish with 'handoff' after the first token, its KV blocks held."""
    num_imported_tokens: int = 0
    """Decode role: leading prompt tokens whose KV came from another worker (so far)."""
    import_first_block: int = 0
    """The first block that KV covers; the blocks before it must be prefix-cache hits here,
    else the import is dropped and the prompt recomputed from the last hit."""
    importing: bool = False
    """More of that KV is on its way: admitted (blocks reserved) but computed only once the
    import ends (engine/kv_import.py)."""
    lora_slot: int = -1
    """Its LoRA adapter's slot (engine/lora.py); -1: the base model."""
    prefix_salt: int | None = None
    """The root of its prefix-cache block hashes (its adapter's); None: the base model's."""
    embed: bool = False
    """An embedding: finish with 'embedded' once the prompt is computed, sampling nothing."""
    priority: int = 0
    """The priority policy's rank: lower is served first (engine/scheduler.py)."""
    late_after_s: float | None = None
    """This prompt's TTFT target for late prompts last (the router's); None: the scheduler's."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Guesses at its next tokens, verified in its next step (engine/speculation.py)."""
    num_new_tokens: int = 0
    """Output tokens its last step appended (1, or more with a draft accepted)."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without copying the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
