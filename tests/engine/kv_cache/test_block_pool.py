"""BlockPool: exact block ids, reference counts and eviction order."""

from __future__ import annotations

import pytest

from tokenmill.engine.kv_cache.block_pool import BlockPool
from tokenmill.engine.kv_cache.prefix_cache import BlockHash, hash_block_tokens


def _hash(i: int) -> BlockHash:
    return hash_block_tokens(None, [i])


def test_new_blocks_come_from_the_front_in_id_order() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 3
    assert pool.free_block_ids() == [3, 4, 5]
    assert pool.usage == pytest.approx(0.5)


def test_asking_past_can_allocate_is_a_bug() -> None:
    pool = BlockPool(2)
    assert pool.can_allocate(2)
    assert not pool.can_allocate(3)
    with pytest.raises(RuntimeError, match="can_allocate"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2  # nothing taken


def test_freed_cached_blocks_are_evicted_in_lru_order() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)  # 0, 1
    b = pool.get_new_blocks(2)  # 2, 3
    pool.cache_full_blocks(a, [_hash(0), _hash(1)])
    pool.cache_full_blocks(b, [_hash(2), _hash(3)])
    # Freed tail-first, as the manager does: b first, then a.
    pool.free_blocks(reversed(b))
    pool.free_blocks(reversed(a))
    assert pool.free_block_ids() == [4, 5, 3, 2, 1, 0]
    # Uncached blocks go first, then the cached ones, least recently freed first.
    taken = pool.get_new_blocks(4)
    assert [blk.block_id for blk in taken] == [4, 5, 3, 2]
    # Evicted blocks lost their hash entries; the rest are still hits.
    assert pool.get_cached_block(_hash(3)) is None
    assert pool.get_cached_block(_hash(2)) is None
    assert [blk.block_hash for blk in taken] == [None, None, None, None]
    hit = pool.get_cached_block(_hash(1))
    assert hit is not None and hit.block_id == 1
    assert pool.num_cached_blocks == 2


def test_freed_uncached_blocks_go_to_the_front() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)  # 0, 1, 2
    pool.cache_full_blocks(blocks[:2], [_hash(0), _hash(1)])
    pool.free_blocks(reversed(blocks))  # 2 (uncached), 1, 0
    assert pool.free_block_ids() == [2, 3, 4, 1, 0]


def test_touch_takes_free_cached_blocks_out_of_the_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [_hash(0), _hash(1)])
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 4
    hit = pool.get_cached_block(_hash(0))
    assert hit is not None
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_block_ids() == [2, 3, 1]
    # A hit on an in-use block only bumps its count.
    pool.touch([hit])
    assert hit.ref_cnt == 2
    assert pool.num_free_blocks == 3
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1
    assert pool.num_free_blocks == 3
    pool.free_blocks([hit])
    assert pool.free_block_ids() == [2, 3, 1, 0]


def test_double_free_is_an_assertion() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])


def test_a_hash_keeps_its_first_block() -> None:
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [_hash(7)])
    pool.cache_full_blocks([second], [_hash(7)])
    assert pool.get_cached_block(_hash(7)) is first
    assert second.block_hash is None
    # Caching a block again under the same hash is a no-op.
    pool.cache_full_blocks([first], [_hash(7)])
    assert pool.num_cached_blocks == 1


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [_hash(0), _hash(1)])
    assert pool.get_cached_block(_hash(0)) is None
    assert [b.block_hash for b in blocks] == [None, None]


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [_hash(0), _hash(1)])
    assert not pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 2
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert pool.get_cached_block(_hash(0)) is None
    assert [b.block_hash for b in pool.blocks] == [None, None, None]


def test_num_blocks_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
