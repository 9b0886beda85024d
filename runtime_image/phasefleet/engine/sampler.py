"""Sampler: picks one token per request from its logits (greedy, temperature, top-k, top-p),
with the tokens a row bans masked out, and the logprobs of the rows that ask for them.

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

from dataclasses import dataclass, field

import numpy as np
import torch

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
    logprob: TokenLogprob | None = None  # set by sample() when params.logprobs is not None
    # Set by the model runner when params.prompt_logprobs is not None: prompt tokens 1.. so far
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


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
    all_greedy: bool
    any_seeded: bool
    any_top: bool  # some row has top-k or top-p on

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], positions: list[int], vocab: int) -> SamplingBatch:
        params = [r.params for r in rows]
        seeds = [seed_halves(p.seed) if p.seed is not None else (0, 0) for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        banned = [(i, t) for i, r in enumerate(rows) for t in r.banned]
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
        ]  # fmt: skip


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

    @classmethod
    def take(cls, batch: SamplingBatch, tensors: list[torch.Tensor]) -> DeviceSampling:
        return cls(batch, *tensors)

    @classmethod
    def direct(cls, batch: SamplingBatch, device: torch.device) -> DeviceSampling:
        """Without a shared upload (tests, the rare step that samples nothing else)."""
        return cls.take(batch, [torch.from_numpy(a).to(device) for a in batch.arrays()])


def sample(logits: torch.Tensor, rows: list[SamplingRow], s: DeviceSampling) -> list[int]:
    """logits: [B, V] (any float dtype); one row per request. Returns B token ids (FAILED for a
    row whose `error` this call set). One device-to-host copy, plus one for logprobs when a
    row asks for them."""
    logits = logits.float()
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw = logits[asking] if asking else None  # [a, V], a copy taken before any mask
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
        if token == FAILED:
            rows[i].error = "sampling failed: the logits or probabilities are not finite"
    if raw is not None:
        chosen = [result[i] for i in asking]
        counts = [rows[i].params.logprobs or 0 for i in asking]
        for i, logprob in zip(asking, token_logprobs(raw, chosen, counts), strict=True):
            rows[i].logprob = logprob if result[i] != FAILED else None
    return result


def _probs(logits: torch.Tensor, s: DeviceSampling) -> torch.Tensor:
    """Temperature, then top-k, then top-p; logits: [B, V] float32 -> probabilities [B, V].
    Greedy rows get a temperature of 1 here; their draw is not used."""
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
    return logits.softmax(dim=-1)


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
