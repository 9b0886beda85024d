"""Speculative decoding by prompt lookup: drafts from a request's own context, verified by the
model in the same step.

A request's next tokens are guessed from what it has seen: its last n tokens (n from
`max_ngram` down to `min_ngram`) are looked up in its prompt and output so far (the last
LOOKBACK tokens), and the tokens that followed their latest earlier occurrence, up to k, are the
draft. The scheduler computes the last known token and the draft together, one chunk of
1 + len(draft) positions, and the sampler draws a token at every position, as it would have one
step at a time (greedy: the argmax; sampled: with that position's noise, a seeded request's a
function of its seed and the position). The draft's longest prefix that matches the draws, then
the draw after it, are appended: 1 to k + 1 tokens a step. Greedy and seeded requests get
exactly the tokens they get without drafts; an unseeded one's tokens have the same distribution
(a draft token is kept with its probability, else the draw stands: rejection sampling with a
draft that is sure of its token).

Every request speculates once min_tokens is reached, whatever its sampling settings: penalties
on repeats count the draft tokens before each position as output there, a grammar's mask at
each position is the grammar's after them (a draft is cut where the grammar refuses a token or
completes). A stop string or a grammar completed inside an accepted draft ends the request at
that token, as one token a step would (the engine takes the later ones back). Plain Python and
numpy: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_SPECULATIVE_TOKENS = 16  # the most draft tokens a step verifies per request
LOOKBACK = 4096  # tokens of a request's context searched for its last n-gram


@dataclass
class NgramProposer:
    """Drafts for one request from its context (prompt and output), kept as a growing array."""

    num_tokens: int  # k: the longest draft
    min_ngram: int
    max_ngram: int
    context: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    size: int = 0  # tokens of context in use

    def extend(self, tokens: list[int]) -> None:
        """Appends the request's new tokens (its prompt first)."""
        end = self.size + len(tokens)
        if end > len(self.context):
            grown = np.zeros(max(end, 2 * len(self.context), 64), np.int64)
            grown[: self.size] = self.context[: self.size]
            self.context = grown
        self.context[self.size : end] = tokens
        self.size = end

    def propose(self, limit: int) -> list[int]:
        """At most min(k, limit) tokens that followed the latest earlier occurrence of the
        context's longest matching suffix; [] when no n-gram recurs.

        The earlier occurrences of the last token are found in one pass over the window; only
        they are extended backwards, one token at a time: a few microseconds a request, where
        comparing every n-gram of the window took 0.1-0.3 ms (a step's host time on a GPU)."""
        limit = min(self.num_tokens, limit)
        window = self.context[max(0, self.size - LOOKBACK) : self.size]
        longest = min(self.max_ngram, len(window) - 1)
        if limit <= 0 or longest < self.min_ngram:
            return []
        ends = np.flatnonzero(window[:-1] == window[-1])  # where earlier 1-grams end
        matched = np.ones(len(ends), np.int64)  # each one's match with the suffix, in tokens
        for back in range(1, longest):
            still = (ends >= back) & (window[np.maximum(ends - back, 0)] == window[-1 - back])
            still &= matched == back  # extends only a match unbroken so far
            matched += still
            if not still.any():
                break
        best = int(matched.max()) if len(matched) else 0
        if best < self.min_ngram:
            return []
        start = int(ends[matched == best][-1]) + 1  # after the latest longest occurrence
        return window[start : start + limit].tolist()


def accept(draft: list[int], targets: list[int]) -> list[int]:
    """The tokens a verified step appends: the draft's longest prefix the draws agree with,
    then the draw after it. targets[i]: the token drawn after the last known token and
    draft[:i] (len(draft) + 1 of them)."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return [*draft[:accepted], targets[accepted]]
