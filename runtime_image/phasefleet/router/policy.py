"""Worker choice: pure functions from what the router knows about each worker to an ordering.

`rank` puts the workers that may take a request in the order to try them: the first is the
choice, the rest are the fallbacks a retry walks through. Nothing here does I/O or reads a
clock; the caller passes the load snapshot, the turn counter and the prefix matches.

Policies (`spec.router.policy`, `phasefleet router --policy`):

- `least-loaded`: fewest requests (reported by the worker or open from this router, whichever
  is larger), a waiting queue, prompt tokens not yet computed and a full KV cache counting
  extra; ties rotate.
- `round-robin`: every request to the next worker in turn, load ignored.
- `prefix-aware`: the worker that served the longest prefix of this prompt before (its prefix
  cache likely still holds it), unless it is busier than the least-loaded worker by more than
  `AFFINITY_SLACK`; otherwise least-loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("least-loaded", "round-robin", "prefix-aware")

WAITING_WEIGHT = 1.0  # a waiting request counts this much on top of itself: the batch is full
KV_WEIGHT = 4.0  # requests' worth of a full KV cache (near preemption)
PREFILL_TOKENS_PER_UNIT = 1024.0  # prompt tokens not yet computed that count as one request:
# a request counts the same whatever its prompt, so without them one 100k-token prompt looks
# as light as a 100-token one and the next prompts queue behind it
AFFINITY_SLACK = 4.0  # load units a prefix owner may exceed the least-loaded worker by
TYPICAL_PROMPT = 512.0  # prompt tokens one unit of prefill backlog stands for (and a queued
# request's prompt, from a worker that does not export phasefleet_prefill_tokens_waiting)
PREFIX_CHUNK_CHARS = 64  # prompt characters per hashed chunk (about a 16-token KV block)
MAX_PREFIX_CHUNKS = 256  # chunks hashed per prompt (the first 16 Ki characters)
PREFIX_INDEX_CAPACITY = 200_000  # chunk hashes remembered, least recently used dropped first


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker reports on /metrics (docs/worker.md "Metrics")."""

    running: float  # phasefleet_num_requests_running
    waiting: float  # phasefleet_num_requests_waiting
    kv_usage: float  # phasefleet_kv_cache_usage_perc, 0..1
    prefill_pending: float = 0.0  # phasefleet_prefill_tokens_pending: prompt tokens admitted
    prefill_waiting: float | None = None  # phasefleet_prefill_tokens_waiting: of queued requests
    prompt_tokens_total: float | None = None  # phasefleet_prompt_tokens_total (counter)
    busy_seconds_total: float | None = None  # phasefleet_engine_busy_seconds_total (counter)


@dataclass(frozen=True)
class Candidate:
    """A worker that may take a new request."""

    url: str  # base URL, e.g. http://10.0.0.5:8000
    load: WorkerLoad | None  # latest report; None until the first successful poll
    inflight: int  # requests this router has open on it now
    busy: bool = False  # answered 429 recently: tried last
    prefill_rate: float | None = None  # prompt tokens per busy second, measured (prefill pool)


def load_score(c: Candidate) -> float:
    """Load in units of requests; lower is better."""
    if c.load is None:
        return float(c.inflight)
    requests = max(c.load.running + c.load.waiting, float(c.inflight))
    return (
        requests
        + WAITING_WEIGHT * c.load.waiting
        + KV_WEIGHT * c.load.kv_usage
        + prompt_tokens_left(c.load) / PREFILL_TOKENS_PER_UNIT
    )


def prompt_tokens_left(load: WorkerLoad) -> float:
    """Prompt tokens admitted or queued and not yet computed (the queued ones 0 from a worker
    without the gauge)."""
    return load.prefill_pending + (load.prefill_waiting or 0.0)


def _rotated(candidates: Sequence[Candidate], turn: int) -> list[Candidate]:
    ordered = sorted(candidates, key=lambda c: c.url)
    if not ordered:
        return []
    start = turn % len(ordered)
    return ordered[start:] + ordered[:start]


def _busy_last(ordered: list[Candidate]) -> list[str]:
    return [c.url for c in ordered if not c.busy] + [c.url for c in ordered if c.busy]


def rank_round_robin(candidates: Sequence[Candidate], turn: int) -> list[str]:
    return _busy_last(_rotated(candidates, turn))


def rank_least_loaded(candidates: Sequence[Candidate], turn: int) -> list[str]:
    # sorted() is stable: equally loaded workers keep the rotated order, so they alternate.
    return _busy_last(sorted(_rotated(candidates, turn), key=load_score))


def rank_prefix_aware(
    candidates: Sequence[Candidate], turn: int, matched: dict[str, int]
) -> list[str]:
    """`matched`: url -> prompt chunks that worker served last (from PrefixIndex.match)."""
    by_load = rank_least_loaded(candidates, turn)
    if not by_load:
        return by_load
    scores = {c.url: load_score(c) for c in candidates}
    busy = {c.url for c in candidates if c.busy}
    lightest = scores[by_load[0]]
    owners = [
        url
        for url in by_load
        if matched.get(url, 0) > 0 and url not in busy and scores[url] <= lightest + AFFINITY_SLACK
    ]
    if not owners:
        return by_load
    best = max(owners, key=lambda url: matched[url])  # max() keeps the first of equals
    return [best] + [url for url in by_load if url != best]


def prefill_score(c: Candidate) -> float:
    """A prefill worker's backlog in units of typical prompts; lower is better."""
    if c.load is None:
        return float(c.inflight)
    queued = c.load.prefill_waiting
    if queued is None:  # a worker without the gauge: each queued request a typical prompt
        queued = c.load.waiting * TYPICAL_PROMPT
    return c.inflight + (c.load.prefill_pending + queued) / TYPICAL_PROMPT


def prefill_backlog_s(c: Candidate) -> float | None:
    """A prefill worker's prompt tokens waiting or admitted, in seconds of its measured
    throughput; None until both are known."""
    if c.load is None or not c.prefill_rate:
        return None
    return prompt_tokens_left(c.load) / c.prefill_rate


def rank_prefill(
    policy: str, candidates: Sequence[Candidate], turn: int, matched: dict[str, int]
) -> list[str]:
    """Prefill workers in the order to try: round-robin as asked, else the one whose prefix
    cache holds the longest prefix of this prompt unless its backlog exceeds the lightest by
    more than AFFINITY_SLACK prompts, else the smallest backlog of prompt tokens."""
    if policy == "round-robin":
        return rank_round_robin(candidates, turn)
    rotated = _rotated(candidates, turn)
    by_backlog = _busy_last(sorted(rotated, key=prefill_score))
    if not by_backlog or policy == "least-loaded":
        return by_backlog
    scores = {c.url: prefill_score(c) for c in candidates}
    lightest = scores[by_backlog[0]]
    owners = [
        u for u in by_backlog if matched.get(u, 0) > 0 and scores[u] <= lightest + AFFINITY_SLACK
    ]
    if not owners:
        return by_backlog
    best = max(owners, key=lambda url: matched[url])
    return [best] + [url for url in by_backlog if url != best]


def rank(
    policy: str, candidates: Sequence[Candidate], turn: int, matched: dict[str, int] | None = None
) -> list[str]:
    if policy == "round-robin":
        return rank_round_robin(candidates, turn)
    if policy == "least-loaded":
        return rank_least_loaded(candidates, turn)
    if policy == "prefix-aware":
        return rank_prefix_aware(candidates, turn, matched or {})
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")


def prefix_chunks(text: str) -> list[int]:
    """Chained hashes of the prompt's leading chunks: equal lists mean equal prefixes."""
    hashes = []
    parent = 0
    usable = min(len(text) // PREFIX_CHUNK_CHARS, MAX_PREFIX_CHUNKS)
    for i in range(usable):
        parent = hash((parent, text[i * PREFIX_CHUNK_CHARS : (i + 1) * PREFIX_CHUNK_CHARS]))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Which worker last served each prompt prefix chunk (bounded, least recently used out)."""

    def __init__(self, capacity: int = PREFIX_INDEX_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def match(self, chunks: Sequence[int]) -> dict[str, int]:
        """url -> how many leading chunks of this prompt it served last."""
        matched: dict[str, int] = {}
        for depth, h in enumerate(chunks, start=1):
            url = self._owner.get(h)
            if url is None:
                break
            matched[url] = depth
        return matched

    def record(self, chunks: Sequence[int], url: str) -> None:
        for h in chunks:
            self._owner[h] = url
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, url: str) -> None:
        """Drop a worker that left the pool (its cache left with it)."""
        for h in [h for h, owner in self._owner.items() if owner == url]:
            del self._owner[h]
