"""KVCacheManager: block tables, prefix hits capped before the last token, stats in tokens."""

from __future__ import annotations

from tokenmill.engine.kv_cache.manager import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus, SamplingParams

BLOCK = 4


def _req(req_id: str, tokens: list[int], *, salt: str | None = None, **params: object) -> Request:
    return Request(req_id, tokens, SamplingParams(**params), cache_salt=salt)  # type: ignore[arg-type]


def _admit(kv: KVCacheManager, request: Request, num_new_tokens: int | None = None) -> int:
    """Admit like the scheduler does; returns the cache-hit token count."""
    computed, num_hit = kv.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    assert kv.allocate_slots(request, num_new_tokens, computed) is not None
    request.num_computed_tokens = num_hit
    return num_hit


def _finish(kv: KVCacheManager, request: Request) -> None:
    request.status = RequestStatus.FINISHED_STOPPED
    kv.free(request)


def test_allocation_and_prefix_hit_share_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = _req("a", prompt)
    computed, num_hit = kv.get_computed_blocks(a)
    assert (len(computed), num_hit) == (0, 0)
    new = kv.allocate_slots(a, 10, computed)
    assert new is not None and new.block_ids == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2]

    b = _req("b", [*prompt[:8], 50, 51, 52])
    computed, num_hit = kv.get_computed_blocks(b)
    assert computed.block_ids == [0, 1]
    assert num_hit == 8
    new = kv.allocate_slots(b, 3, computed)
    assert new is not None and new.block_ids == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert kv.num_free_blocks == 6
    stats = kv.make_prefix_cache_stats()
    assert (stats.num_requests, stats.num_queries, stats.num_hits) == (2, 10 + 11, 8)


def test_hit_is_capped_so_the_last_token_is_computed() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    prompt = list(range(8))  # exactly 2 full blocks
    _admit(kv, _req("a", prompt))
    b = _req("b", prompt)
    computed, num_hit = kv.get_computed_blocks(b)
    assert computed.block_ids == [0]
    assert num_hit == 4
    new = kv.allocate_slots(b, 4, computed)
    # b recomputes its second block into a private copy.
    assert new is not None and new.block_ids == [2]


def test_get_computed_blocks_alone_counts_nothing() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    _admit(kv, _req("a", list(range(9))))
    b = _req("b", list(range(9)))
    kv.get_computed_blocks(b)
    kv.get_computed_blocks(b)
    stats = kv.make_prefix_cache_stats()
    assert (stats.num_requests, stats.num_queries, stats.num_hits) == (1, 9, 0)
    _admit(kv, b)
    stats = kv.make_prefix_cache_stats()
    assert (stats.num_requests, stats.num_queries, stats.num_hits) == (2, 18, 8)
    assert stats.hit_rate == 8 / 18


def test_shortfall_returns_none_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a = _req("a", list(range(12)))
    _admit(kv, a)  # blocks 0, 1, 2
    b = _req("b", [*range(8), 90, 91, 92, 93, 94])  # hits 0, 1; needs 2 more blocks
    computed, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.num_blocks_to_allocate(b, 5, computed) == 2
    assert kv.allocate_slots(b, 5, computed) is None
    assert kv.get_block_ids("b") == []
    assert kv.num_free_blocks == 1
    assert [blk.ref_cnt for blk in kv.pool.blocks] == [1, 1, 1, 0]
    assert kv.make_prefix_cache_stats().num_requests == 1


def test_free_cached_hit_blocks_count_against_the_free_queue() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a = _req("a", list(range(9)))
    _admit(kv, a)  # 0, 1, 2
    _finish(kv, a)
    assert kv.num_free_blocks == 4
    b = _req("b", [*range(8), 77])
    computed, _ = kv.get_computed_blocks(b)
    assert computed.block_ids == [0, 1]
    # Taking two free hit blocks plus one new block.
    assert kv.num_blocks_to_allocate(b, 1, computed) == 3
    new = kv.allocate_slots(b, 1, computed)
    # Block 2 (a's uncached tail) was put at the front of the free queue.
    assert new is not None and new.block_ids == [2]
    assert kv.get_block_ids("b") == [0, 1, 2]
    assert kv.num_free_blocks == 1


def test_free_returns_blocks_tail_first() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    a = _req("a", list(range(12)))
    b = _req("b", list(range(100, 112)))
    _admit(kv, a)  # 0, 1, 2 (2 is full but holds the last token: still cached)
    _admit(kv, b)  # 3, 4, 5
    _finish(kv, a)
    _finish(kv, b)
    assert kv.pool.free_block_ids() == [6, 7, 2, 1, 0, 5, 4, 3]
    c = _req("c", list(range(200, 220)))
    computed, _ = kv.get_computed_blocks(c)
    new = kv.allocate_slots(c, 20, computed)
    # Uncached first, then a's blocks tail-first (a was freed before b).
    assert new is not None and new.block_ids == [6, 7, 2, 1, 0]
    # a's prefix is gone from the cache; b's is intact.
    assert kv.get_computed_blocks(_req("a2", list(range(12))))[1] == 0
    assert kv.get_computed_blocks(_req("b2", list(range(100, 113))))[1] == 12


def test_decode_fills_blocks_that_later_requests_hit() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    a = _req("a", [1, 2, 3])
    _admit(kv, a)
    assert kv.get_block_ids("a") == [0]
    # Decode: the sampled token joins; the step computes it into slot 3.
    a.num_computed_tokens = 3
    a.append_output_token(4)
    new = kv.allocate_slots(a, 1)
    assert new is not None and new.block_ids == []
    a.num_computed_tokens = 4
    a.append_output_token(5)
    new = kv.allocate_slots(a, 1)
    assert new is not None and new.block_ids == [1]
    # The first block is now full and registered while a still runs.
    b = _req("b", [1, 2, 3, 4, 9])
    computed, num_hit = kv.get_computed_blocks(b)
    assert (computed.block_ids, num_hit) == ([0], 4)


def test_siblings_share_the_prompt_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    params = SamplingParams(n=3, max_tokens=4)
    prompt = list(range(10))
    children = [Request(f"r-{i}", prompt, params.child(i)) for i in range(3)]
    hits = [_admit(kv, child) for child in children]
    assert hits == [0, 8, 8]
    assert [kv.get_block_ids(c.request_id) for c in children] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:2]] == [3, 3]


def test_salt_prevents_sharing() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    prompt = list(range(9))
    _admit(kv, _req("a", prompt, salt="tenant-a"))
    assert kv.get_computed_blocks(_req("b", prompt, salt="tenant-b"))[1] == 0
    assert kv.get_computed_blocks(_req("c", prompt))[1] == 0
    assert kv.get_computed_blocks(_req("d", prompt, salt="tenant-a"))[1] == 8


def test_prompt_logprobs_requests_skip_the_cache() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    prompt = list(range(9))
    _admit(kv, _req("a", prompt))
    b = _req("b", prompt, prompt_logprobs=1)
    assert kv.get_computed_blocks(b)[1] == 0
    _admit(kv, b)
    assert kv.make_prefix_cache_stats().num_requests == 1


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK, enable_prefix_caching=False)
    prompt = list(range(9))
    _admit(kv, _req("a", prompt))
    b = _req("b", prompt)
    assert kv.get_computed_blocks(b)[1] == 0
    _admit(kv, b)
    assert kv.get_block_ids("b") == [3, 4, 5]
    stats = kv.make_prefix_cache_stats()
    assert (stats.num_requests, stats.num_queries, stats.num_hits) == (0, 0, 0)


def test_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    a = _req("a", [1, 2, 3, 4, 5, 6])
    _admit(kv, a)
    a.num_computed_tokens = 6
    for token in (7, 8, 9):  # three decodes
        a.append_output_token(token)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    a.append_output_token(10)
    assert kv.get_block_ids("a") == [0, 1, 2]
    a.status = RequestStatus.PREEMPTED
    kv.free(a)
    a.num_computed_tokens = 0
    assert kv.num_free_blocks == 10
    # Resumed: prompt and generated tokens, 10 in all; 2 full blocks come from the cache.
    computed, num_hit = kv.get_computed_blocks(a)
    assert (computed.block_ids, num_hit) == ([0, 1], 8)


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    a = _req("a", list(range(9)))
    _admit(kv, a)
    assert not kv.reset_prefix_cache()
    _finish(kv, a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(_req("b", list(range(9))))[1] == 0


def test_usage() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    _admit(kv, _req("a", list(range(9))))
    assert kv.usage == 3 / 8
    assert kv.get_block_ids("nobody") == []
