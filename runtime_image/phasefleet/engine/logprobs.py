"""Logprobs: the log-softmax of the model's raw logits (before temperature, top-k, top-p and the
min_tokens mask, as vLLM's default `raw_logprobs`), for the rows that ask for them only."""

from __future__ import annotations

import torch

from phasefleet.engine.outputs import TokenLogprob


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: list[int], ranked: bool = False
) -> list[TokenLogprob]:
    """logits: [b, V] float32 raw; one chosen token and one top count per row. `ranked`: each
    chosen token's rank too (another pass over [b, V]: only prompt_logprobs report it)."""
    logprobs = logits.log_softmax(dim=-1)  # [b, V]
    index = torch.tensor(token_ids, device=logits.device).clamp_min(0).unsqueeze(1)
    chosen = logprobs.gather(1, index)  # [b, 1]
    if ranked:
        ranks = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1  # [b, 1]
        # One copy to the host for both (a rank is exact in float32: vocabularies are < 2**24).
        pairs = torch.cat([chosen, ranks.to(chosen.dtype)], dim=1).tolist()  # [b, 2]
    else:
        pairs = [[value, None] for value in chosen.squeeze(1).tolist()]
    k = min(max(num_top, default=0), logits.shape[-1])
    top_ids: list[list[int]] = [[] for _ in token_ids]
    top_values: list[list[float]] = [[] for _ in token_ids]
    if k:
        values, ids = logprobs.topk(k, dim=-1)  # [b, k], best first
        top_ids, top_values = ids.tolist(), values.tolist()
    return [
        TokenLogprob(
            token,
            value,
            list(zip(ids_row[:n], values_row[:n], strict=True)),
            None if rank is None else int(rank),
        )
        for token, (value, rank), ids_row, values_row, n in zip(
            token_ids, pairs, top_ids, top_values, num_top, strict=True
        )
    ]
