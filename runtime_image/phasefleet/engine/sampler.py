"""Sampler: picks one token per request from its logits (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phasefleet.engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None  # the request's own generator when it has a seed


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """logits: [B, V] (any float dtype); one row per request. Returns B token ids."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if all(r.params.greedy for r in rows):
        return greedy.tolist()
    tokens = greedy.clone()
    idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    probs = _probs(logits[idx], [rows[i].params for i in idx])  # [b, V]
    unseeded = [j for j, i in enumerate(idx) if rows[i].generator is None]
    if unseeded:
        picked = torch.multinomial(probs[unseeded], 1).squeeze(1)
        tokens[[idx[j] for j in unseeded]] = picked
    for j, i in enumerate(idx):
        gen = rows[i].generator
        if gen is not None:
            tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
    return tokens.tolist()


def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p; logits: [b, V] float32 -> probabilities [b, V]."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temps
    vocab = logits.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        drop = ranks >= torch.tensor(top_ks, device=device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (keeps at least one).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_before >= torch.tensor(top_ps, device=device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits.softmax(dim=-1)
