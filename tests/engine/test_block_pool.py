from phasefleet.engine.block_pool import NULL_BLOCK_ID, BlockPool, hash_block
from phasefleet.engine.kv_cache_manager import KVCacheManager
from tests.engine.factories import make_requests


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    got = pool.allocate(4)
    assert NULL_BLOCK_ID not in got
    assert sorted(got) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0


def test_allocate_more_than_free_raises() -> None:
    pool = BlockPool(3)
    try:
        pool.allocate(3)
    except ValueError as e:
        assert "only 2 free" in str(e)
    else:
        raise AssertionError("expected ValueError")


def test_ref_counts_and_free() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache(b, 7, None, [1, 2])
    pool.touch([b])
    assert pool.blocks[b].ref_count == 2
    pool.free([b])
    assert not pool.is_free(b)
    pool.free([b])
    assert pool.is_free(b)
    assert pool.usage() == 0.0


def test_double_free_raises() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    try:
        pool.free([b])
    except ValueError as e:
        assert f"block {b}" in str(e)
    else:
        raise AssertionError("expected ValueError")


def test_freed_block_keeps_hash_until_reused_lru() -> None:
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.cache(a, hash_block(None, [1]), None, [1])
    pool.cache(b, hash_block(None, [2]), None, [2])
    pool.free([a])
    pool.free([b])
    # Both freed blocks still answer lookups.
    assert pool.lookup(hash_block(None, [1]), None, [1]) == a
    assert pool.lookup(hash_block(None, [2]), None, [2]) == b
    # Reuse takes the least recently freed first: a, and a loses its hash.
    assert pool.allocate(1) == [a]
    assert pool.lookup(hash_block(None, [1]), None, [1]) is None
    assert pool.lookup(hash_block(None, [2]), None, [2]) == b
    pool.free([c])


def test_lookup_verifies_tokens_and_parent() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    h = hash_block(5, [1, 2])
    pool.cache(a, h, 5, [1, 2])
    assert pool.lookup(h, 5, [1, 2]) == a
    assert pool.lookup(h, 5, [1, 3]) is None  # same hash key, other tokens
    assert pool.lookup(h, 6, [1, 2]) is None  # other parent


def test_caching_disabled_records_nothing() -> None:
    pool = BlockPool(4, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache(a, 1, None, [1])
    assert pool.lookup(1, None, [1]) is None


def test_prefix_hit_through_manager_and_full_hit_recomputes_last_token() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    (first,) = make_requests(1, 8)
    hit = kv.find_prefix(first)
    assert hit.block_ids == [] and hit.num_tokens == 0
    kv.admit(first, hit)
    first.num_computed_tokens = 8
    kv.cache_computed(first)
    table = list(kv.block_tables[first.request_id])
    kv.free(first)
    assert kv.pool.num_free_blocks == 9

    (again,) = make_requests(1, 8, prefix="again")
    hit = kv.find_prefix(again)
    assert hit.block_ids == table
    assert hit.num_tokens == 7  # the whole prompt is cached; its last token is recomputed
    assert kv.can_admit(again, hit)
    kv.admit(again, hit)
    assert kv.block_tables[again.request_id] == table
    assert kv.pool.num_free_blocks == 7


def test_partial_prefix_hit_stops_at_first_miss() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    (a,) = make_requests(1, 12)
    kv.admit(a, kv.find_prefix(a))
    a.num_computed_tokens = 12
    kv.cache_computed(a)
    (b,) = make_requests(1, 12, prefix="b")
    b.prompt_token_ids[5] = 9  # differs inside the second block
    hit = kv.find_prefix(b)
    assert hit.num_tokens == 4
    assert hit.block_ids == kv.block_tables[a.request_id][:1]


def test_can_admit_counts_free_hit_blocks_as_taken() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable
    (a,) = make_requests(1, 8)
    kv.admit(a, kv.find_prefix(a))
    a.num_computed_tokens = 8
    kv.cache_computed(a)
    kv.free(a)  # both cached blocks now free but hashed; 3 free in total
    (b,) = make_requests(1, 16, prefix="b")  # shares the 8 tokens, needs 2 more blocks
    hit = kv.find_prefix(b)
    assert len(hit.block_ids) == 2
    assert not kv.can_admit(b, hit)  # 2 new blocks needed, only 1 free beyond the hits
    (c,) = make_requests(1, 12, prefix="c")
    assert kv.can_admit(c, kv.find_prefix(c))
