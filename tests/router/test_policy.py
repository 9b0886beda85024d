"""Worker choice as pure functions: load snapshots in, an ordering of worker URLs out."""

from __future__ import annotations

import json

import pytest

from phasefleet.router.policy import (
    AFFINITY_SLACK,
    MAX_PREFIX_CHUNKS,
    PREFILL_TOKENS_PER_UNIT,
    PREFIX_CHUNK_CHARS,
    TYPICAL_PROMPT,
    Candidate,
    PrefixIndex,
    WorkerLoad,
    load_score,
    prefill_backlog_s,
    prefill_score,
    prefix_chunks,
    rank,
    rank_prefill,
)

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"


def worker(
    url: str, running: float = 0, waiting: float = 0, kv: float = 0.0, busy: bool = False
) -> Candidate:
    return Candidate(url, WorkerLoad(running, waiting, kv), inflight=0, busy=busy)


def test_least_loaded_picks_the_fewest_requests_and_orders_the_fallbacks() -> None:
    ranked = rank("least-loaded", [worker(A, running=5), worker(B, running=1), worker(C, 3)], 0)
    assert ranked == [B, C, A]


def test_waiting_and_a_full_kv_cache_count_extra() -> None:
    # Same number of requests, but A queues one and B's cache is nearly full.
    queued = [worker(A, running=3, waiting=1), worker(B, running=4)]
    assert rank("least-loaded", queued, 0)[0] == B
    full = [worker(A, running=2, kv=0.95), worker(B, running=3, kv=0.1)]
    assert rank("least-loaded", full, 0)[0] == B


def test_prompt_tokens_not_yet_computed_count_as_load() -> None:
    # A holds one long prompt still prefilling, B three short decodes: one request against
    # three, but A's prompt keeps its next steps busy for longer.
    long_prompt = WorkerLoad(1, 0, 0.1, prefill_pending=8 * PREFILL_TOKENS_PER_UNIT)
    pool = [Candidate(A, long_prompt, inflight=0), worker(B, running=3)]
    assert rank("least-loaded", pool, 0)[0] == B
    queued = WorkerLoad(1, 1, 0.0, prefill_waiting=2 * PREFILL_TOKENS_PER_UNIT)
    assert load_score(Candidate(A, queued, inflight=0)) == 1 + 1 + 1 + 2
    # a worker that exports neither gauge is scored on its requests alone, as before
    assert load_score(worker(C, running=2, waiting=1)) == 4


def test_own_inflight_requests_count_when_the_report_is_stale() -> None:
    stale = Candidate(A, WorkerLoad(0, 0, 0.0), inflight=4)
    assert load_score(stale) == 4
    assert rank("least-loaded", [stale, worker(B, running=2)], 0)[0] == B
    unpolled = Candidate(C, None, inflight=1)
    assert load_score(unpolled) == 1


def test_equal_loads_alternate_with_the_turn() -> None:
    idle = [worker(A), worker(B)]
    assert [rank("least-loaded", idle, t)[0] for t in range(4)] == [A, B, A, B]


def test_round_robin_ignores_load() -> None:
    pool = [worker(C, running=9), worker(A), worker(B)]
    assert [rank("round-robin", pool, t)[0] for t in range(4)] == [A, B, C, A]


def test_busy_workers_go_last_under_every_policy() -> None:
    pool = [worker(A, busy=True), worker(B, running=6)]
    for policy in ("least-loaded", "round-robin", "prefix-aware"):
        for turn in range(2):
            assert rank(policy, pool, turn, {A: 3}) == [B, A]


def test_prefix_aware_prefers_the_worker_that_served_the_longest_prefix() -> None:
    pool = [worker(A, running=1), worker(B), worker(C, running=2)]
    assert rank("prefix-aware", pool, 0, {C: 3, A: 1}) == [C, B, A]
    assert rank("prefix-aware", pool, 0, {}) == [B, A, C]


def test_prefix_aware_gives_up_affinity_when_the_owner_is_much_busier() -> None:
    busy_owner = worker(A, running=AFFINITY_SLACK + 1)
    assert rank("prefix-aware", [busy_owner, worker(B)], 0, {A: 10})[0] == B
    within_slack = worker(A, running=AFFINITY_SLACK)
    assert rank("prefix-aware", [within_slack, worker(B)], 0, {A: 10})[0] == A


def test_no_candidates_and_unknown_policy() -> None:
    assert rank("least-loaded", [], 0) == []
    with pytest.raises(ValueError, match="policy must be one of"):
        rank("random", [worker(A)], 0)


def test_prefix_chunks_are_chained_so_equal_hashes_mean_equal_prefixes() -> None:
    base = "x" * PREFIX_CHUNK_CHARS * 3
    assert len(prefix_chunks(base)) == 3
    assert len(prefix_chunks(base + "y" * (PREFIX_CHUNK_CHARS - 1))) == 3  # partial chunk
    changed_first = "z" + base[1:]
    assert prefix_chunks(changed_first)[2] != prefix_chunks(base)[2]
    assert (
        len(prefix_chunks("w" * PREFIX_CHUNK_CHARS * (MAX_PREFIX_CHUNKS + 5))) == MAX_PREFIX_CHUNKS
    )


def test_prefix_index_matches_records_and_forgets() -> None:
    index = PrefixIndex(capacity=100)
    shared = "s" * PREFIX_CHUNK_CHARS * 2
    index.record(prefix_chunks(shared + "a" * PREFIX_CHUNK_CHARS), A)
    assert index.match(prefix_chunks(shared + "b" * PREFIX_CHUNK_CHARS)) == {A: 2}
    index.record(prefix_chunks(shared + "b" * PREFIX_CHUNK_CHARS), B)
    # B now owns the shared chunks; A still owns its own third chunk, which no longer chains.
    assert index.match(prefix_chunks(shared + "a" * PREFIX_CHUNK_CHARS)) == {B: 2, A: 3}
    index.forget(B)
    assert index.match(prefix_chunks(shared)) == {}


def test_prefix_index_is_bounded() -> None:
    index = PrefixIndex(capacity=4)
    index.record(prefix_chunks("q" * PREFIX_CHUNK_CHARS * 6), A)
    assert len(index) == 4
    assert index.match(prefix_chunks("q" * PREFIX_CHUNK_CHARS * 6)) == {}  # the head fell out
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(capacity=0)


def test_prefill_backlog_counts_the_queued_prompts_tokens_when_the_worker_says_them() -> None:
    """A prefill worker with one 8k-token prompt queued carries more backlog than one with
    three 100-token prompts queued; without the gauge each queued request is a typical prompt."""
    long_one = Candidate(A, WorkerLoad(1, 1, 0.1, prefill_pending=512, prefill_waiting=8192), 0)
    short_ones = Candidate(B, WorkerLoad(1, 3, 0.1, prefill_pending=512, prefill_waiting=300), 0)
    assert rank_prefill("least-loaded", [long_one, short_ones], 0, {}) == [B, A]
    assert prefill_score(short_ones) == pytest.approx((512 + 300) / TYPICAL_PROMPT)
    older = Candidate(C, WorkerLoad(1, 3, 0.1, prefill_pending=512), inflight=1)
    assert prefill_score(older) == pytest.approx(1 + (512 + 3 * TYPICAL_PROMPT) / TYPICAL_PROMPT)


def test_prefill_backlog_in_seconds_needs_a_measured_throughput() -> None:
    load = WorkerLoad(1, 1, 0.1, prefill_pending=500, prefill_waiting=1500)
    assert prefill_backlog_s(Candidate(A, load, 0, prefill_rate=4000.0)) == pytest.approx(0.5)
    assert prefill_backlog_s(Candidate(A, load, 0)) is None  # no throughput measured yet
    assert prefill_backlog_s(Candidate(A, None, 0, prefill_rate=4000.0)) is None


def test_the_prefix_key_is_the_prompt_after_the_model_so_adapters_keep_their_own() -> None:
    from phasefleet.router.dispatch import RequestKey, request_key

    prompt = "p" * PREFIX_CHUNK_CHARS * 2

    def key(model: str, field: str = "prompt", value: object = prompt) -> list[int]:
        return prefix_chunks(
            request_key(json.dumps({"model": model, field: value}).encode()).prompt
        )

    assert key("llama") == key("llama") and key("llama") != key("sql")
    chat = [{"role": "user", "content": prompt}]
    longer = [*chat, {"role": "assistant", "content": "q" * PREFIX_CHUNK_CHARS}]
    assert key("sql", "messages", longer)[: len(key("sql", "messages", chat))] == key(
        "sql", "messages", chat
    )
    assert request_key(b"not json") == RequestKey(None, "")
    assert request_key(b'{"model": "x"}') == RequestKey("x", "")
    assert request_key(b'{"model": 3, "prompt": "p"}') == RequestKey(None, "p")
    # vLLM's priority, for the order of held requests; anything but an integer counts as 0
    assert request_key(b'{"model": "x", "priority": -3}') == RequestKey("x", "", -3)
    assert request_key(b'{"prompt": "p", "priority": 2}') == RequestKey(None, "p", 2)
    for odd in (b'"1"', b"true", b"1.5", b"null"):
        assert request_key(b'{"prompt": "p", "priority": ' + odd + b"}").priority == 0
