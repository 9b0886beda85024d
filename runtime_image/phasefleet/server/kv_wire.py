"""The KV hand-off on the wire: every message both sides exchange, defined once.

The decode worker asks for a prefill with one `POST /internal/prefill` whose body is a
`PrefillRequest`. The prefill worker answers with a stream of frames while it computes the
prompt, so the KV of each chunk travels while the next chunk is computed:

    frame   := u32 little-endian length of the header | header (JSON) | payload (header.nbytes)
    stream  := StartFrame KVFrame* FirstFrame KVFrame* EndFrame      (or ErrorFrame, anywhere)

- `StartFrame`: the sender's KV layout and the prompt's size, before any KV. The receiver
  converts another layout of the same model shape (engine/kv_convert.py).
- `KVFrame`: `num_blocks` consecutive blocks of the prompt from `first_block` on, as soon as a
  step has computed them; payload layer-major within the frame: for each layer the keys of the
  frame's blocks, then their values, each [num_blocks, block_size, kv_heads, head_dim] in the
  layout's dtype (with head_shards > 1: one such tensor per shard of the heads, in order). The
  sender's blocks wholly below `PrefillRequest.skip_tokens` (the decode worker's prefix-cache
  hits) are never sent, and blocks come in order, each once.
- `FirstFrame`: the first token (and its logprob), sent the moment it is sampled; KV frames of
  the last chunk may follow it.
- `EndFrame`: every block has been sent; the prefill worker has let its blocks go.

The HTTP body is sent with chunked transfer encoding; frame boundaries are independent of the
HTTP chunks.

Versions: the two pools roll to a new image one pod at a time, so for a while a decode worker
and a prefill worker of different releases talk. Two rules keep that working:
- Every message ignores fields it does not know. A field may be added to a message when a peer
  that ignores it still does the right thing: a hint (`late_after_s`), or a request the
  answer confirms (`skip_tokens`, confirmed by the start frame's `skip_blocks`).
- Anything else (a new frame kind, a field whose meaning changes, another payload layout)
  raises `WIRE_VERSION`. The decode worker sends, in every request, the lowest version that
  carries it (`PrefillRequest.of`); a prefill worker answers any version from
  `MIN_WIRE_VERSION` to its own, and refuses another (409, `wire_version_mismatch`), so the
  decode worker prefills locally.

Versions: 1, the first; 2 adds the sampling fields that change the first token
(`repetition_penalty`, `min_p`, `logit_bias`), which a prefill worker of version 1 would
ignore; 3 adds `grammar` (structured output), which a prefill worker of version 2 would ignore;
4 adds `lora` (the request's LoRA adapter), which a prefill worker of version 3 would ignore;
5 adds the grammar's `after` (structured output after a reasoning model's thought), which a
prefill worker of version 4 would ignore, shaping the first token; 6 adds `allowed_token_ids` and
`bad_words` (vLLM's token restrictions), which a prefill worker of version 5 would ignore.
A request goes as the lowest version that carries what it sets (`lowest_version`); the
penalties on the output (`presence_penalty`, `frequency_penalty`) travel as hints in any, as
they change nothing before the second token.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from phasefleet.engine.kv_transfer import KVLayout
from phasefleet.engine.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_GRAMMAR_AFTER,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    SEED_MAX,
    SEED_MIN,
    Grammar,
    GrammarKind,
    SamplingParams,
)

PREFILL_PATH = "/internal/prefill"
MEDIA_TYPE = "application/x-phasefleet-kv-stream"
WIRE_VERSION = 6
MIN_WIRE_VERSION = 1  # the oldest version this release still answers
BIAS_WIRE_VERSION = 2  # the version that added the bias, repetition penalty and min-p
GRAMMAR_WIRE_VERSION = 3  # the version that added the grammar
LORA_WIRE_VERSION = 4  # the version that added the LoRA adapter
AFTER_WIRE_VERSION = 5  # the version that added the grammar's `after` tokens
RULES_WIRE_VERSION = 6  # the version that added allowed_token_ids and bad_words
HEADER_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 20


class _Wire(BaseModel):
    # a peer of a later release may send fields this one does not know (the module's rules)
    model_config = ConfigDict(extra="ignore", frozen=True)


def lowest_version(params: SamplingParams, lora: str | None = None) -> int:
    """The lowest wire version that carries every setting of `params` (and the adapter) that
    changes the first token."""
    if params.allowed_token_ids is not None or params.bad_words:
        return RULES_WIRE_VERSION
    if params.grammar is not None and params.grammar.after:
        return AFTER_WIRE_VERSION
    if lora is not None:
        return LORA_WIRE_VERSION
    if params.grammar is not None:
        return GRAMMAR_WIRE_VERSION
    if params.changes_first_token:
        return BIAS_WIRE_VERSION
    return MIN_WIRE_VERSION


class GrammarWire(_Wire):
    kind: GrammarKind
    spec: str = Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)
    # AFTER_WIRE_VERSION
    after: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, max_length=MAX_GRAMMAR_AFTER
    )


class PrefillRequest(_Wire):
    """One prompt to prefill; the sampling fields choose the first token."""

    wire_version: int = Field(default=WIRE_VERSION, ge=1)
    request_id: str = Field(min_length=1, max_length=200)
    prompt_token_ids: list[int] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # BIAS_WIRE_VERSION
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(default=1.0, gt=0, le=MAX_REPETITION_PENALTY)
    min_p: float = Field(default=0.0, ge=0, le=1)
    logit_bias: dict[
        Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
    ] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS_TOKENS)
    # GRAMMAR_WIRE_VERSION
    grammar: GrammarWire | None = None
    # RULES_WIRE_VERSION
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS
    )
    bad_words: list[
        Annotated[
            list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_BAD_WORD_TOKENS)
        ]
    ] = Field(default_factory=list, max_length=MAX_BAD_WORDS)
    # LORA_WIRE_VERSION: the adapter the prompt is computed with (the prefill worker must have
    # it loaded under this name); None: the base model
    lora: str | None = Field(default=None, min_length=1, max_length=200)
    # prompt tokens the decode worker's prefix cache holds: the sender skips its whole blocks
    # below this (in its own block size)
    skip_tokens: int = Field(default=0, ge=0)
    # the TTFT target the router sent the decode worker (late prompts last); None: the
    # prefill worker's own --late-after-ms
    late_after_s: float | None = Field(default=None, gt=0)
    # the request's rank under the priority policy (lower first); a prefill worker that
    # schedules first come, first served serves it in its turn
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)

    @classmethod
    def of(
        cls,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        skip_tokens: int = 0,
        late_after_s: float | None = None,
        lora: str | None = None,
        priority: int = 0,
    ) -> PrefillRequest:
        return cls(
            wire_version=lowest_version(params, lora),
            request_id=request_id,
            prompt_token_ids=prompt,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens,
            logprobs=params.logprobs,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            min_p=params.min_p,
            logit_bias=dict(params.logit_bias),
            allowed_token_ids=params.allowed_token_ids,
            bad_words=[list(w) for w in params.bad_words],
            grammar=None
            if params.grammar is None
            else GrammarWire(
                kind=params.grammar.kind, spec=params.grammar.spec, after=list(params.grammar.after)
            ),
            skip_tokens=skip_tokens,
            late_after_s=late_after_s,
            lora=lora,
            priority=priority,
        )

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=self.logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            logit_bias=dict(self.logit_bias),
            allowed_token_ids=None
            if self.allowed_token_ids is None
            else list(self.allowed_token_ids),
            bad_words=[list(w) for w in self.bad_words],
            grammar=None
            if self.grammar is None
            else Grammar(self.grammar.kind, self.grammar.spec, tuple(self.grammar.after)),
        )


class LayoutWire(_Wire):
    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    block_size: int = Field(ge=1)
    dtype: Literal["float32", "bfloat16", "float16", "float8_e4m3fn"]
    head_shards: int = Field(default=1, ge=1)
    rope: str = Field(default="default", min_length=1, max_length=64)

    @model_validator(mode="after")
    def _shards_split_the_heads(self) -> LayoutWire:
        if self.num_kv_heads % self.head_shards:
            raise ValueError(
                f"head_shards {self.head_shards} must divide num_kv_heads {self.num_kv_heads}"
            )
        return self

    @classmethod
    def of(cls, layout: KVLayout) -> LayoutWire:
        return cls.model_validate(asdict(layout))

    def layout(self) -> KVLayout:
        return KVLayout(**self.model_dump())


class StartFrame(_Wire):
    kind: Literal["start"] = "start"
    nbytes: Literal[0] = 0
    layout: LayoutWire
    num_prompt_tokens: int = Field(ge=1)
    num_blocks: int = Field(ge=1)  # blocks covering the prompt, the last maybe partial
    skip_blocks: int = Field(ge=0)  # the first block that will be sent


class KVFrame(_Wire):
    kind: Literal["kv"] = "kv"
    first_block: int = Field(ge=0)
    num_blocks: int = Field(ge=1)
    nbytes: int = Field(ge=1)  # num_blocks x the layout's block bytes


class FirstFrame(_Wire):
    kind: Literal["first"] = "first"
    nbytes: Literal[0] = 0
    first_token_id: int = Field(ge=0)
    logprob: float | None = None  # when the request asked for logprobs
    top: list[tuple[int, float]] = Field(default_factory=list)  # the top logprobs, best first
    finish_reason: str  # 'handoff' (KV follows) or a final reason (stop, length)
    num_cached_tokens: int = Field(ge=0)  # prompt tokens the prefill worker had cached


class EndFrame(_Wire):
    kind: Literal["end"] = "end"
    nbytes: Literal[0] = 0
    num_blocks: int = Field(ge=0)  # blocks sent, from skip_blocks on


class ErrorFrame(_Wire):
    kind: Literal["error"] = "error"
    nbytes: Literal[0] = 0
    reason: str  # a kv_transfer_failures label
    detail: str


Frame = Annotated[
    StartFrame | KVFrame | FirstFrame | EndFrame | ErrorFrame, Field(discriminator="kind")
]
_FRAME: TypeAdapter[Any] = TypeAdapter(Frame)


def encode_header(frame: _Wire) -> bytes:
    """A frame's length-prefixed header; its payload (frame.nbytes bytes) follows it."""
    header = frame.model_dump_json().encode()
    return HEADER_LENGTH.pack(len(header)) + header


def decode_header(data: bytes) -> StartFrame | KVFrame | FirstFrame | EndFrame | ErrorFrame:
    """The frame a header's JSON bytes describe; ValueError when malformed."""
    try:
        frame: StartFrame | KVFrame | FirstFrame | EndFrame | ErrorFrame = _FRAME.validate_python(
            json.loads(data)
        )
        return frame
    except (ValueError, TypeError) as exc:
        raise ValueError(f"a malformed frame header: {exc}") from None
