"""Sampler: picks one token per request from its logits (greedy, temperature, top-k, top-p),
with the tokens a row bans masked out, and the logprobs of the rows that ask for them.

A row that cannot be sampled (non-finite logits or probabilities, a generator that raises) fails
alone: its `error` is set and it gets a placeholder token, which the engine never keeps; every
other row is sampled exactly as it would have been without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from phasefleet.engine.logprobs import token_logprobs
from phasefleet.engine.outputs import TokenLogprob
from phasefleet.engine.sampling_params import SamplingParams

FAILED = -1  # the placeholder token of a row whose `error` is set


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None  # the request's own generator when it has a seed
    error: str | None = None  # set by sample() when this row could not be sampled
    banned: list[int] = field(default_factory=list)  # token ids masked out (min_tokens)
    logprob: TokenLogprob | None = None  # set by sample() when params.logprobs is not None
    # Set by the model runner when params.prompt_logprobs is not None: prompt tokens 1.. so far
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """logits: [B, V] (any float dtype); one row per request. Returns B token ids (FAILED for a
    row whose `error` this call set)."""
    logits = logits.float()
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw = logits[asking] if asking else None  # [a, V], a copy taken before any mask
    for i, r in enumerate(rows):
        if r.banned:
            logits[i, r.banned] = float("-inf")
    tokens = logits.argmax(dim=-1)
    # argmax picks a NaN or +inf when there is one, so checking the picked logit covers the row
    # (-inf entries are fine: masked tokens).
    ok = torch.isfinite(logits.gather(1, tokens.unsqueeze(1)).squeeze(1))  # [B]
    idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    if idx:
        probs = _probs(logits[idx], [rows[i].params for i in idx])  # [b, V]
        ok_probs = torch.isfinite(probs).all(dim=-1)  # [b]
        ok[idx] &= ok_probs
        # A broken row draws from a one-hot instead, so multinomial never sees it.
        one_hot = torch.zeros_like(probs)
        one_hot[:, 0] = 1.0
        probs = torch.where(ok_probs.unsqueeze(1), probs, one_hot)
        unseeded = [j for j, i in enumerate(idx) if rows[i].generator is None]
        if unseeded:
            picked = torch.multinomial(probs[unseeded], 1).squeeze(1)
            tokens[[idx[j] for j in unseeded]] = picked
        for j, i in enumerate(idx):
            gen = rows[i].generator
            if gen is None:
                continue
            try:
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
            except Exception as exc:  # whatever the generator raises fails its row only
                rows[i].error = f"sampling failed: {exc}"
    result = tokens.masked_fill(~ok, FAILED).tolist()
    for i, token in enumerate(result):
        if token == FAILED and rows[i].error is None:
            rows[i].error = "sampling failed: the logits or probabilities are not finite"
    for i, r in enumerate(rows):
        if r.error is not None:
            result[i] = FAILED
    if raw is not None:
        chosen = [result[i] for i in asking]
        counts = [rows[i].params.logprobs or 0 for i in asking]
        for i, logprob in zip(asking, token_logprobs(raw, chosen, counts), strict=True):
            rows[i].logprob = logprob if result[i] != FAILED else None
    return result


def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p; logits: [b, V] float32 -> probabilities [b, V]."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    # Shifted so the best token is 0: a tiny temperature then sends the rest to -inf, never NaN;
    # a temperature below float32's range is clamped to its smallest normal number.
    logits = logits - logits.max(dim=-1, keepdim=True).values
    logits = logits / temps.clamp_min(torch.finfo(torch.float32).tiny)
    vocab = logits.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        drop = ranks >= torch.tensor(top_ks, device=device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p. The best token always
        # stays, also for a top_p that rounds to 0 in float32.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_before >= torch.tensor(top_ps, device=device).unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits.softmax(dim=-1)
