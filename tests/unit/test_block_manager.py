"""The KV block pool: ref counts, LRU reuse, prefix caching by chained block hashes."""

from __future__ import annotations

import pytest

from engine_core.block_manager import NULL_BLOCK, BlockManager
from engine_core.request import Request
from protocol.messages import EngineCoreRequest, SamplingParams


def make_request(tokens: list[int], request_id: str = "r") -> Request:
    return Request(
        EngineCoreRequest(request_id, tokens, SamplingParams(max_tokens=8), 0.0), frozenset()
    )


def admit(bm: BlockManager, request: Request) -> int:
    """What the scheduler does on admission; returns the hit tokens."""
    hits = bm.find_cached_prefix(request)
    num_hit = len(hits) * bm.block_size
    assert bm.allocate(request, request.num_tokens - num_hit, hits)
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request)
    return num_hit


def test_null_block_is_never_handed_out():
    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=False)
    request = make_request(list(range(16)))
    assert bm.allocate(request, 16)
    assert NULL_BLOCK not in request.block_ids
    assert sorted(request.block_ids) == [1, 2, 3, 4]
    assert bm.num_free_blocks == 0


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    request = make_request(list(range(20)))
    assert not bm.allocate(request, 20)  # needs 5 blocks, 3 exist
    assert request.block_ids == []
    assert bm.num_free_blocks == 3


def test_blocks_are_allocated_for_the_scheduled_chunk_only():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    request = make_request(list(range(20)))
    assert bm.allocate(request, 6)
    assert len(request.block_ids) == 2
    request.num_computed_tokens = 6
    assert bm.allocate(request, 2)  # positions 6, 7 still fit block 2
    assert len(request.block_ids) == 2
    request.num_computed_tokens = 8
    assert bm.allocate(request, 1)
    assert len(request.block_ids) == 3


def test_free_returns_every_block():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    request = make_request(list(range(13)))
    admit(bm, request)
    assert bm.num_free_blocks == 9 - 4
    bm.free(request)
    assert bm.num_free_blocks == 9
    assert bm.usage == 0.0


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    bm = BlockManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    first = make_request(list(range(10)) + [100, 101], "a")
    admit(bm, first)
    second = make_request(list(range(10)) + [200, 201, 202], "b")
    hits = bm.find_cached_prefix(second)
    # Blocks [0..3] and [4..7] match; [8, 9, 100, 101] differs from [8, 9, 200, 201].
    assert hits == first.block_ids[:2]
    assert bm.allocate(second, second.num_tokens - 8, hits)
    assert bm.ref_counts[hits[0]] == 2
    bm.record_lookup(second.num_tokens, 8)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (13, 8)


def test_a_hit_never_covers_the_last_prompt_token():
    bm = BlockManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    admit(bm, make_request(list(range(8)), "a"))
    same = make_request(list(range(8)), "b")
    # Both blocks are cached, but the last token must be computed to sample from it.
    assert len(bm.find_cached_prefix(same)) == 1


def test_hash_chains_the_whole_prefix():
    bm = BlockManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    admit(bm, make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    # Same second block, different first block: no hit at all.
    other = make_request([0, 2, 3, 4, 5, 6, 7, 8, 9], "b")
    assert bm.find_cached_prefix(other) == []


def test_freed_blocks_stay_cached_until_reused_in_lru_order():
    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=True)
    old = make_request(list(range(9)), "old")
    admit(bm, old)  # blocks for [0..3], [4..7], [8]
    bm.free(old)
    assert bm.num_free_blocks == 4
    # Still a hit after free: the content is kept.
    assert len(bm.find_cached_prefix(make_request(list(range(9)), "again"))) == 2
    # Taking one block reuses the least recently freed: the tail, not the prefix.
    taker = make_request([50, 51], "taker")
    assert bm.allocate(taker, 2)
    assert len(bm.find_cached_prefix(make_request(list(range(9)), "again2"))) == 2
    taker2 = make_request([60] * 8, "taker2")
    assert bm.allocate(taker2, 8)  # two more: the first evicted is block [4..7]
    assert len(bm.find_cached_prefix(make_request(list(range(9)), "again3"))) == 1


def test_reviving_a_free_cached_block_counts_against_the_free_pool():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    old = make_request(list(range(8)) + [9], "old")
    admit(bm, old)
    bm.free(old)
    new = make_request(list(range(8)) + [1, 2, 3, 4, 5, 6, 7, 8, 9], "new")
    hits = bm.find_cached_prefix(new)
    assert len(hits) == 2
    # 3 free blocks: reviving 2 leaves 1, and the request needs 3 more.
    assert not bm.allocate(new, new.num_tokens - 8, hits)
    assert bm.num_free_blocks == 3
    assert bm.allocate(new, 4, hits)
    assert bm.num_free_blocks == 0


def test_reset_prefix_cache_refused_while_in_use():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    request = make_request(list(range(9)))
    admit(bm, request)
    assert bm.reset_prefix_cache() is False
    bm.free(request)
    assert bm.reset_prefix_cache() is True
    assert bm.find_cached_prefix(make_request(list(range(9)), "b")) == []


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    admit(bm, make_request(list(range(9)), "a"))
    assert bm.find_cached_prefix(make_request(list(range(9)), "b")) == []


def test_too_small_pool_is_refused():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockManager(num_blocks=1, block_size=16, enable_prefix_caching=True)


def test_a_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    parent = make_request(list(range(10)))  # 2 full blocks, 2 tokens in a third
    admit(bm, parent)
    child = make_request([], "child")
    assert bm.blocks_to_fork(parent) == 1
    source, copy = bm.fork(parent, child)
    assert child.block_ids[:2] == parent.block_ids[:2]
    assert (source, copy) == (parent.block_ids[2], child.block_ids[2])
    assert [bm.ref_counts[b] for b in parent.block_ids] == [2, 2, 1]
    assert bm.ref_counts[copy] == 1 and child.num_cached_blocks == 2
    bm.free(parent)
    assert [bm.ref_counts[b] for b in child.block_ids] == [1, 1, 1]
    bm.free(child)
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_a_fork_at_a_block_boundary_copies_nothing():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    parent = make_request(list(range(8)))
    admit(bm, parent)
    child = make_request([], "child")
    assert bm.blocks_to_fork(parent) == 0
    assert bm.fork(parent, child) is None
    assert child.block_ids == parent.block_ids
    bm.free(child)
    bm.free(parent)
    assert bm.num_free_blocks == bm.num_usable_blocks
