"""EngineConfig: every knob of one engine instance, with its unit."""

from __future__ import annotations

from dataclasses import dataclass, field

from phasefleet.api.contract import DEFAULT_LATE_LIMIT_S, KV_CACHE_DTYPES, SCHEDULING_POLICIES
from phasefleet.engine.speculation import MAX_SPECULATIVE_TOKENS

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda", "auto")
MAX_GRAPH_BATCH = 256  # largest decode batch captured as a CUDA graph


@dataclass
class EngineConfig:
    # -- model --
    model: str
    """Path to a Hugging Face model folder (config.json, *.safetensors, tokenizer files)."""
    dtype: str = "auto"
    """Weight and activation dtype: auto | float32 | bfloat16 | float16. auto: float32 on CPU;
    on CUDA the checkpoint's 16-bit dtype, or bfloat16 for a float32 checkpoint."""
    device: str = "auto"
    """cpu | cuda | auto (cuda when available, else cpu)."""
    max_model_len: int | None = None
    """Longest request, prompt plus output, in tokens; default: the model's
    max_position_embeddings from config.json. A LongRoPE model uses its long factors when this
    passes original_max_position_embeddings, its short ones otherwise."""

    tensor_parallel_size: int = 1
    """Ranks the model is split over, one process and one device each (Megatron-style: heads,
    MLP width and vocabulary split; see engine/parallel). Must divide the attention heads and
    the MLP width, and divide or be a multiple of the KV heads. On CUDA: one GPU per rank."""

    # -- LoRA adapters (engine/lora.py) --
    lora_adapters: dict[str, str] = field(default_factory=dict)
    """name -> PEFT adapter folder, loaded at start; a request names one to use it."""
    max_loras: int | None = None
    """Adapter slots (every slot's weights stay on the device); None: one per adapter given."""
    max_lora_rank: int = 16
    """The largest adapter rank a slot holds."""

    # -- KV cache --
    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """KV blocks in the pool (block 0 is the reserved null block); None: sized automatically,
    on GPU from free memory after loading the model, on CPU from a fixed memory budget."""
    kv_cache_dtype: str = "auto"
    """auto | fp8. auto: the model's dtype; fp8: keys and values stored as float8 e4m3, unscaled
    (one byte each: twice the blocks of a 16-bit pool in the same memory)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    host_kv_cache_gib: float = 0.0
    """Host memory for the prefix cache's second tier, GiB: cached blocks the pool evicts are
    copied there, and a later prompt that starts with them loads them back instead of
    computing them (engine/host_prefix_cache.py); 0: off. Needs prefix caching."""

    # -- scheduler --
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decode tokens plus prefill-chunk tokens)."""
    max_num_seqs: int = 64
    """Most requests in the running batch at once."""
    scheduling_policy: str = "fcfs"
    """fcfs (first come, first served, late prompts last) | priority (by each request's
    priority, lower first; see engine/scheduler.py)."""

    # -- speculative decoding (engine/speculation.py) --
    num_speculative_tokens: int = 0
    """Draft tokens a request may verify per step, guessed by prompt lookup; 0: off."""
    prompt_lookup_min: int = 2
    """Shortest n-gram of a request's last tokens looked up in its context, tokens."""
    prompt_lookup_max: int = 4
    """Longest such n-gram, tried first, tokens."""

    # -- hand-off (prefill role) --
    kv_lease_seconds: float = 30.0
    """How long a finished prefill keeps its KV blocks for the decode worker to pull, seconds."""

    # -- late prompts last (engine/scheduler.py) --
    late_after_s: float | None = None
    """The TTFT target: a prompt that has waited longer goes behind those that have not;
    None: first come, first served."""
    late_limit_s: float = DEFAULT_LATE_LIMIT_S
    """After this long waiting, a late prompt is served in its turn again, seconds."""

    @property
    def num_lora_slots(self) -> int:
        """0: LoRA off."""
        return len(self.lora_adapters) if self.max_loras is None else self.max_loras

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value cannot work."""
        if not self.model:
            raise ValueError(f"model must be a path to a model folder, got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.max_loras is not None and self.max_loras < len(self.lora_adapters):
            raise ValueError(
                f"max_loras ({self.max_loras}) must be at least the number of LoRA adapters "
                f"given ({len(self.lora_adapters)})"
            )
        _positive("max_lora_rank", self.max_lora_rank)
        if self.num_lora_slots and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not supported with tensor_parallel_size > 1")
        _positive("block_size", self.block_size)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(
                f"num_kv_blocks must be >= 2 (one is the null block) or None, "
                f"got {self.num_kv_blocks}"
            )
        if not (isinstance(self.host_kv_cache_gib, int | float) and self.host_kv_cache_gib >= 0):
            raise ValueError(
                f"host_kv_cache_gib must be a number of GiB >= 0, got {self.host_kv_cache_gib!r}"
            )
        if self.host_kv_cache_gib and not self.enable_prefix_caching:
            raise ValueError(
                "host_kv_cache_gib needs enable_prefix_caching: the host tier holds blocks the"
                " prefix cache evicts"
            )
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens!r}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}"
            )
        if not self.kv_lease_seconds > 0:
            raise ValueError(f"kv_lease_seconds must be > 0, got {self.kv_lease_seconds!r}")
        if self.late_after_s is not None and not self.late_after_s > 0:
            raise ValueError(f"late_after_s must be > 0 or None, got {self.late_after_s!r}")
        if not self.late_limit_s > (self.late_after_s or 0.0):
            raise ValueError(
                f"late_limit_s must be > late_after_s ({self.late_after_s}),"
                f" got {self.late_limit_s!r}"
            )


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
