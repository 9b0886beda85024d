"""Sampler: picks one token per request from its logits (greedy, temperature, top-k, top-p,
min-p), after its logit bias and its penalties on repeats (repetition, presence, frequency),
with the tokens a row bans (min_tokens' stop tokens, bad words) and those its grammar or its
allowed_token_ids do not allow masked out, and the logprobs
of the rows that ask for them (of the model's logits, before any of that).

Every row is sampled by the same few batched ops, with no loop over rows: the draw is an
exponential race, token = argmax(p / E) with E ~ Exp(1) per token, which picks token i with
probability p_i. A row with a seed draws its E from a counter-based hash of (seed, the position
of the token being sampled, token id), so a seeded request gets the same tokens whatever else is
in the batch, on whichever worker samples it (a hand-off included), and again after a
preemption; a row without one draws from torch's global generator.

A row that cannot be sampled (non-finite logits or probabilities) fails alone: its `error` is
set and it gets a placeholder token, which the engine never keeps; every other row is sampled
exactly as it would have been without it. The sampled ids reach the host in one copy, the
step's only wait on the device (rows asking for logprobs add their own).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Generic, TypeVar

import numpy as np
import torch

from phasefleet.engine.grammar import GrammarMatcher, fill_masks, mask_words
from phasefleet.engine.logprobs import token_logprobs
from phasefleet.engine.outputs import TokenLogprob
from phasefleet.engine.sampling_params import SamplingParams

FAILED = -1  # the placeholder token of a row whose `error` is set
_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # a 32-bit hash multiplier below 2**27: products stay inside int64
_GOLDEN = 0x9E3779B9


@dataclass
class SamplingRow:
    params: SamplingParams
    error: str | None = None  # set by sample() when this row could not be sampled
    banned: list[int] = field(default_factory=list)  # token ids masked out (min_tokens)
    # set by sample() when params.logprobs is not None: one per position the row drew at this
    # step (a drafted request's: its last known token's, then each draft token's)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Set by the model runner when params.prompt_logprobs is not None: prompt tokens 1.. so far
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    adjusts: bool = field(init=False)  # params.adjusts_logits, read at every step
    bias_ids: np.ndarray = field(init=False)  # params.logit_bias as arrays, made once
    bias_values: np.ndarray = field(init=False)
    allowed_ids: np.ndarray = field(init=False)  # params.allowed_token_ids as an array, or []
    # Set by the engine for a row that penalizes repeats: the prompt's tokens (each once, for
    # repetition_penalty) and the request's output, the list the scheduler appends to.
    prompt_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # prompt_ids on the logits' device, kept from the first step that samples the row (that
    # step's upload carries them; later steps' carry only the output's tokens)
    prompt_on_device: torch.Tensor | None = None
    output_ids: list[int] = field(default_factory=list)
    matcher: GrammarMatcher | None = None  # set by the engine when params.grammar is set
    # The output's distinct tokens and how often each occurs, kept as tokens arrive: [:n] of
    # two arrays that double when full (n = len(_slot)), so a step reads views, not a count.
    _slot: dict[int, int] = field(default_factory=dict)  # output token -> its index
    _ids: np.ndarray = field(default_factory=lambda: np.zeros(16, dtype=np.int64))
    _counts: np.ndarray = field(default_factory=lambda: np.zeros(16, dtype=np.float32))
    _counted: int = 0  # output_ids[:_counted] are counted

    def __post_init__(self) -> None:
        self.adjusts = self.params.adjusts_logits
        bias = self.params.logit_bias
        self.bias_ids = np.fromiter(bias, dtype=np.int64, count=len(bias))
        self.bias_values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        self.allowed_ids = np.unique(np.asarray(self.params.allowed_token_ids or [], np.int64))

    def bad_words_banned(self, drafted: list[int]) -> list[int]:
        """The last token of each bad word whose other tokens end the output so far (the
        output, then `drafted`: the draft tokens before this position); a one-token word's
        always."""
        words = self.params.bad_words
        longest = max(len(w) for w in words) - 1
        tail = (self.output_ids[-longest:] if longest else []) + drafted
        return [w[-1] for w in words if len(w) == 1 or tail[len(tail) - len(w) + 1 :] == w[:-1]]

    def output_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """The output's distinct tokens so far, [n] int64, and how often each occurs, [n]
        float32 (views, valid until the next call)."""
        for token in self.output_ids[self._counted :]:
            slot = self._slot.get(token)
            if slot is None:
                slot = self._slot[token] = len(self._slot)
                if slot == len(self._ids):
                    self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
                    self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
                self._ids[slot] = token
            self._counts[slot] += 1
        self._counted = len(self.output_ids)
        n = len(self._slot)
        return self._ids[:n], self._counts[:n]


def seed_halves(seed: int) -> tuple[int, int]:
    """A seed in [SEED_MIN, SEED_MAX] as two 32-bit halves of its unsigned 64-bit value."""
    unsigned = seed & ((1 << 64) - 1)
    return unsigned & _MASK32, unsigned >> 32


@dataclass
class SamplingBatch:
    """One step's sampling settings as arrays, one entry per sampled row, built on the host
    (`from_rows`) and moved to the device with the step's other inputs."""

    sampled: np.ndarray  # [B] bool: drawn at a temperature, not greedy
    temperature: np.ndarray  # [B] float32 (a greedy row's is not read)
    top_k: np.ndarray  # [B] int64; the vocabulary size when off
    top_p: np.ndarray  # [B] float32; 1 when off
    seeded: np.ndarray  # [B] bool
    seed_lo: np.ndarray  # [B] int64, < 2**32 (0 for unseeded rows)
    seed_hi: np.ndarray  # [B] int64, < 2**32
    position: np.ndarray  # [B] int64: the position of the token each row samples
    banned_rows: np.ndarray  # [N] int64: (row, token) pairs masked to -inf
    banned_ids: np.ndarray  # [N] int64
    adjustments: Adjustments[np.ndarray] | None  # None: no row sets any
    new_prompts: list[int]  # rows whose prompt tokens this upload carries (their first step)
    grammar: bool  # some row has a grammar (its masks come after the forward: grammar_masks)
    all_greedy: bool
    any_seeded: bool
    any_top: bool  # some row has top-k or top-p on

    @classmethod
    def from_rows(
        cls,
        rows: list[SamplingRow],
        positions: list[int],
        vocab: int,
        drafted: list[list[int]] | None = None,
    ) -> SamplingBatch:
        """`drafted[i]`: the draft tokens before row i's position in its request's chunk
        (speculation.py), which its penalties on repeats count as output; None: none."""
        params = [r.params for r in rows]
        seeds = [seed_halves(p.seed) if p.seed is not None else (0, 0) for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        banned = [(i, t) for i, r in enumerate(rows) for t in r.banned]
        banned += [
            (i, t)
            for i, r in enumerate(rows)
            if r.params.bad_words
            for t in r.bad_words_banned(drafted[i] if drafted is not None else [])
        ]
        greedy = [p.greedy for p in params]
        return cls(
            sampled=np.array([not g for g in greedy], dtype=np.bool_),
            temperature=np.array([p.temperature for p in params], dtype=np.float32),
            top_k=np.array(top_k, dtype=np.int64),
            top_p=np.array(top_p, dtype=np.float32),
            seeded=np.array([p.seed is not None for p in params], dtype=np.bool_),
            seed_lo=np.array([lo for lo, _ in seeds], dtype=np.int64),
            seed_hi=np.array([hi for _, hi in seeds], dtype=np.int64),
            position=np.array(positions, dtype=np.int64),
            banned_rows=np.array([i for i, _ in banned], dtype=np.int64),
            banned_ids=np.array([t for _, t in banned], dtype=np.int64),
            adjustments=Adjustments.of(rows, drafted) if any(r.adjusts for r in rows) else None,
            new_prompts=[i for i, r in enumerate(rows) if _prompt_to_send(r)],
            grammar=any(r.matcher is not None for r in rows),
            all_greedy=all(greedy),
            any_seeded=any(
                p.seed is not None and not g for p, g in zip(params, greedy, strict=True)
            ),
            any_top=any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p),
        )

    def arrays(self) -> list[np.ndarray]:
        """The arrays in a fixed order, for one upload; `DeviceSampling.take` reads them back."""
        return [
            self.sampled, self.temperature, self.top_k, self.top_p, self.seeded, self.seed_lo,
            self.seed_hi, self.position, self.banned_rows, self.banned_ids,
            *(self.adjustments.arrays() if self.adjustments is not None else []),
        ]  # fmt: skip


A = TypeVar("A", np.ndarray, torch.Tensor)


@dataclass
class Adjustments(Generic[A]):
    """The rows' logit bias, penalties on repeats and min-p, in a batch where some row sets one
    (uploaded only then): host arrays (`of`), or the same as device tensors."""

    min_p: A  # [B] float32; 0 when off
    bias_rows: A  # [L] int64: (row, token, bias) triples added to the logits
    bias_ids: A  # [L] int64
    bias_values: A  # [L] float32
    repetition: A  # [B] float32; 1 when off
    prompt_rows: A  # [P] int64: the rows repetition applies to with their prompts' tokens
    prompt_lengths: A  # [P] int64: the tokens of each (its prompt_ids, on the device)
    new_prompt_ids: A  # [Q] int64: the prompt_ids of the rows sent this step, one after another
    presence: A  # [B] float32; 0 when off
    frequency: A  # [B] float32; 0 when off
    count_rows: A  # [M] int64: (row, token, count) of the outputs of the rows with a penalty
    # on repeats (repetition reads which tokens occur; presence and frequency how often); a
    # (row, token) may repeat (a draft's tokens after its output's): the counts add up
    count_ids: A  # [M] int64
    count_values: A  # [M] float32
    grammar_rows: A  # [G] int64: the rows with a grammar (their masks: `grammar_masks`)
    allowed_rows: A  # [R] int64: the rows with allowed_token_ids (every other token masked)
    allowed_slots: A  # [N] int64: (slot in allowed_rows, token) pairs of the allowed tokens
    allowed_ids: A  # [N] int64

    @classmethod
    def of(
        cls, rows: list[SamplingRow], drafted: list[list[int]] | None = None
    ) -> Adjustments[np.ndarray]:
        params = [r.params for r in rows]
        biased = [(i, r) for i, r in enumerate(rows) if r.bias_ids.size]
        bias_rows, bias_ids = _pairs([(i, r.bias_ids) for i, r in biased])
        prompted = [(i, r) for i, r in enumerate(rows) if _prompted(r)]
        counted = [
            (i, r.output_counts())
            for i, r in enumerate(rows)
            if r.params.penalized or r.params.repeats_seen
        ]
        if drafted is not None:  # each draft token before a position counts once more there
            before = [(i, drafted[i]) for i, _ in counted if drafted[i]]
            counted += [
                (i, (np.array(t, np.int64), np.ones(len(t), np.float32))) for i, t in before
            ]
        count_rows, count_ids = _pairs([(i, ids) for i, (ids, _) in counted])
        allowed = [(i, r) for i, r in enumerate(rows) if r.allowed_ids.size]
        allowed_slots, allowed_ids = _pairs(
            [(k, r.allowed_ids) for k, (_, r) in enumerate(allowed)]
        )
        return Adjustments(
            min_p=np.array([p.min_p for p in params], dtype=np.float32),
            bias_rows=bias_rows,
            bias_ids=bias_ids,
            bias_values=_concat([r.bias_values for _, r in biased], np.float32),
            repetition=np.array([p.repetition_penalty for p in params], dtype=np.float32),
            prompt_rows=np.array([i for i, _ in prompted], dtype=np.int64),
            prompt_lengths=np.array([r.prompt_ids.size for _, r in prompted], dtype=np.int64),
            new_prompt_ids=_concat([r.prompt_ids for r in rows if _prompt_to_send(r)], np.int64),
            presence=np.array([p.presence_penalty for p in params], dtype=np.float32),
            frequency=np.array([p.frequency_penalty for p in params], dtype=np.float32),
            count_rows=count_rows,
            count_ids=count_ids,
            count_values=_concat([n for _, (_, n) in counted], np.float32),
            grammar_rows=np.array(
                [i for i, r in enumerate(rows) if r.matcher is not None], dtype=np.int64
            ),
            allowed_rows=np.array([i for i, _ in allowed], dtype=np.int64),
            allowed_slots=allowed_slots,
            allowed_ids=allowed_ids,
        )

    def arrays(self) -> list[A]:
        return [getattr(self, f.name) for f in fields(self)]


def grammar_masks(
    rows: list[SamplingRow], vocab: int, drafted: list[list[int]] | None = None
) -> np.ndarray:
    """[G, mask_words(V)] int32: the tokens each grammar row (in `Adjustments.grammar_rows`'
    order) allows next; at a draft position, after the draft tokens before it (`drafted`, as
    from_rows takes it). A row whose grammar has failed gets its `error` set (and allows
    nothing). The runner computes them while the device runs the step's forward."""
    ruled = [(i, r.matcher) for i, r in enumerate(rows) if r.matcher is not None]
    words = np.zeros((len(ruled), mask_words(vocab)), dtype=np.int32)
    if drafted is not None and any(drafted[i] for i, _ in ruled):
        for k, (i, matcher) in enumerate(ruled):
            matcher.fill_after(drafted[i], words[k])
    else:
        fill_masks([matcher for _, matcher in ruled], words)
    for row in rows:
        if row.matcher is not None and row.matcher.error is not None:
            row.error = f"the response's grammar failed: {row.matcher.error}"
    return words


def _prompted(row: SamplingRow) -> bool:
    """Whether repetition_penalty covers the row's prompt tokens."""
    return row.params.repeats_seen and row.prompt_ids.size > 0


def _prompt_to_send(row: SamplingRow) -> bool:
    return _prompted(row) and row.prompt_on_device is None


def _pairs(rows: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(row, token ids) -> the flat (row indices, token ids) arrays of every pair."""
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    index = np.repeat(np.array([i for i, _ in rows], np.int64), [len(ids) for _, ids in rows])
    return index, _concat([ids for _, ids in rows], np.int64)


def _concat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


@dataclass
class DeviceSampling:
    """A SamplingBatch's arrays as tensors on the logits' device."""

    batch: SamplingBatch
    sampled: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeded: torch.Tensor
    seed_lo: torch.Tensor
    seed_hi: torch.Tensor
    position: torch.Tensor
    banned_rows: torch.Tensor
    banned_ids: torch.Tensor
    adjustments: Adjustments[torch.Tensor] | None = field(default=None, kw_only=True)
    # [G, W] int32: the grammar rows' masks (`grammar_masks`), set once computed
    grammar_words: torch.Tensor | None = field(default=None, kw_only=True)

    @classmethod
    def take(cls, batch: SamplingBatch, tensors: list[torch.Tensor]) -> DeviceSampling:
        if batch.adjustments is None:
            return cls(batch, *tensors)
        base = len(tensors) - len(fields(Adjustments))  # the adjustments' tensors come last
        return cls(batch, *tensors[:base], adjustments=Adjustments(*tensors[base:]))

    def prompt_pairs(self, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (row, token) pairs of the rows whose prompts repetition_penalty covers, from
        each row's copy on the device; the rows sent this step keep theirs (a copy out of the
        upload, which the next step reuses). No wait on the device, no upload."""
        a = self.adjustments
        if a is None or not len(a.prompt_rows):
            return None
        start = 0
        for i in self.batch.new_prompts:
            row = rows[i]
            end = start + row.prompt_ids.size
            row.prompt_on_device = a.new_prompt_ids[start:end].clone()
            start = end
        prompts = [r.prompt_on_device for r in rows if _prompted(r)]
        ids = torch.cat([p for p in prompts if p is not None])
        index = torch.repeat_interleave(a.prompt_rows, a.prompt_lengths, output_size=len(ids))
        return index, ids

    @classmethod
    def direct(
        cls, batch: SamplingBatch, device: torch.device, rows: list[SamplingRow], vocab: int
    ) -> DeviceSampling:
        """Without a shared upload, the grammar masks included (tests)."""
        s = cls.take(batch, [torch.from_numpy(a).to(device) for a in batch.arrays()])
        if batch.grammar:
            s.grammar_words = torch.from_numpy(grammar_masks(rows, vocab)).to(device)
        return s


def sample(logits: torch.Tensor, rows: list[SamplingRow], s: DeviceSampling) -> list[int]:
    """logits: [B, V] (any float dtype); one row per request. Returns B token ids (FAILED for a
    row that could not be sampled: its `error` says why). One device-to-host copy, plus one
    for logprobs when a row asks for them."""
    logits = logits.float()
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw = logits[asking] if asking else None  # [a, V], a copy taken before any mask
    if s.adjustments is not None:
        logits = _biased_and_penalized(logits, s.adjustments, s.prompt_pairs(rows))
    if s.batch.grammar:
        if s.adjustments is None or s.grammar_words is None:
            raise ValueError("a batch with grammar rows needs their masks (grammar_words)")
        logits = _grammar_masked(logits, s.adjustments.grammar_rows, s.grammar_words)
    if s.adjustments is not None and len(s.adjustments.allowed_rows):
        logits = _allowed_only(logits, s.adjustments)
    if len(s.batch.banned_rows):
        logits[s.banned_rows, s.banned_ids] = float("-inf")
    tokens = logits.argmax(dim=-1)  # [B]
    # argmax picks a NaN or +inf when there is one, so checking the picked logit covers the row
    # (-inf entries are fine: masked tokens).
    ok = torch.isfinite(logits.gather(1, tokens.unsqueeze(1)).squeeze(1))  # [B]
    if not s.batch.all_greedy:
        probs = _probs(logits, s)  # [B, V]; greedy rows' are computed and not used
        ok &= torch.isfinite(probs).all(dim=-1) | ~s.sampled
        drawn = (probs / _exponentials(probs, s)).argmax(dim=-1)
        tokens = torch.where(s.sampled, drawn, tokens)
    result = tokens.masked_fill(~ok, FAILED).tolist()  # the step's one wait on the device
    for i, token in enumerate(result):
        if rows[i].error is not None:  # its grammar failed before the draw
            result[i] = FAILED
        elif token == FAILED:
            why = "the logits or probabilities are not finite"
            if rows[i].matcher is not None or rows[i].allowed_ids.size:
                why += (
                    " (or min_tokens, bad_words, allowed_token_ids and the grammar together"
                    " leave no token)"
                )
            rows[i].error = f"sampling failed: {why}"
    if raw is not None:
        chosen = [result[i] for i in asking]
        counts = [rows[i].params.logprobs or 0 for i in asking]
        for i in asking:
            rows[i].logprobs = []
        for i, logprob in zip(asking, token_logprobs(raw, chosen, counts), strict=True):
            if result[i] != FAILED:
                rows[i].logprobs.append(logprob)
    return result


def _biased_and_penalized(
    logits: torch.Tensor,
    a: Adjustments[torch.Tensor],
    prompts: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """logits [B, V] float32 with each row's logit bias added, then its penalties on repeats:
    repetition (prompt and output tokens' logits divided by it when positive, multiplied when
    not; `prompts`: the prompts' (row, token) pairs), frequency (x each output token's count)
    and presence (once per output token) taken off, as vLLM orders them. Rows without any are
    unchanged."""
    if a.bias_rows.numel():
        logits = logits.index_put((a.bias_rows, a.bias_ids), a.bias_values, accumulate=True)
    counts = None
    if a.count_rows.numel():
        counts = torch.zeros_like(logits)
        counts.index_put_((a.count_rows, a.count_ids), a.count_values, accumulate=True)
    if counts is not None or prompts is not None:
        seen = counts > 0 if counts is not None else torch.zeros_like(logits, dtype=torch.bool)
        if prompts is not None:
            seen[prompts] = True
        penalty = a.repetition.unsqueeze(1)
        seen &= penalty != 1  # rows counted for presence or frequency alone stay as they are
        # a penalty below float32's range (a valid 1e-300 becomes 0) divides to inf: kept finite
        big = torch.finfo(torch.float32).max
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty).clamp(-big, big)
        logits = torch.where(seen, penalized, logits)
    if counts is not None:
        logits = logits - counts * a.frequency.unsqueeze(1)
        logits = logits - (counts > 0).float() * a.presence.unsqueeze(1)
    return logits


def _allowed_only(logits: torch.Tensor, a: Adjustments[torch.Tensor]) -> torch.Tensor:
    """logits [B, V] with -inf at every token outside each restricted row's allowed_token_ids."""
    keep = torch.zeros(
        (len(a.allowed_rows), logits.shape[-1]), dtype=torch.bool, device=logits.device
    )
    keep[a.allowed_slots, a.allowed_ids] = True
    restricted = logits[a.allowed_rows].masked_fill(~keep, float("-inf"))
    return logits.index_put((a.allowed_rows,), restricted)


def _grammar_masked(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with -inf where a row's grammar does not allow the token; rows: [G] int64,
    words: [G, W] int32, bit t % 32 of word t // 32 set for an allowed token t."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [G, V]
    ruled = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits.index_put((rows,), ruled)


def _probs(logits: torch.Tensor, s: DeviceSampling) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then min-p (transformers' order); logits: [B, V]
    float32 -> probabilities [B, V]. Greedy rows get a temperature of 1 here; their draw is not
    used."""
    temps = torch.where(s.sampled, s.temperature, 1.0).unsqueeze(1)
    # Shifted so the best token is 0: a tiny temperature then sends the rest to -inf, never NaN;
    # a temperature below float32's range is clamped to its smallest normal number.
    logits = logits - logits.max(dim=-1, keepdim=True).values
    logits = logits / temps.clamp_min(torch.finfo(torch.float32).tiny)
    if s.batch.any_top:
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= s.top_k.unsqueeze(1), float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p. The best token always
        # stays, also for a top_p that rounds to 0 in float32.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_before >= s.top_p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    adjusted = s.batch.adjustments
    if s.adjustments is not None and adjusted is not None and adjusted.min_p.any():
        # min-p; the most likely token always stays (min_p <= 1)
        floor = s.adjustments.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = logits.masked_fill(probs < floor, float("-inf")).softmax(dim=-1)
    return probs


def _exponentials(probs: torch.Tensor, s: DeviceSampling) -> torch.Tensor:
    """Exp(1) noise [B, V]: from the seed hash for seeded rows, torch's generator otherwise.
    Kept above 0, so a token of probability 0 never wins by 0 / 0."""
    noise = torch.empty_like(probs).exponential_().clamp_min_(torch.finfo(torch.float32).tiny)
    if s.batch.any_seeded:
        seeded = -torch.log(_seeded_uniform(s, probs.shape[-1]))
        noise = torch.where(s.seeded.unsqueeze(1), seeded, noise)
    return noise


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) in int64 arithmetic; x in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK32
    return x ^ (x >> 16)


def _seeded_uniform(s: DeviceSampling, vocab: int) -> torch.Tensor:
    """[B, V] float32 in (0, 1), a function of (seed, position, token id) alone."""
    row_key = _mix32(s.seed_lo ^ _mix32(s.seed_hi ^ _mix32(s.position & _MASK32)))  # [B]
    ids = _mix32((torch.arange(vocab, device=s.seed_lo.device) * _GOLDEN) & _MASK32)  # [V]
    bits = _mix32(row_key.unsqueeze(1) ^ ids.unsqueeze(0)) >> 8  # [B, V], 24 random bits
    return (bits.float() + 0.5) / float(1 << 24)
