"""KVCacheManager with speculative decoding: slots for draft tokens and lookahead, only
verified tokens hashed into the prefix cache, rejected drafts' blocks given back."""

from __future__ import annotations

from tokenmill.engine.kv_cache.manager import KVCacheManager
from tokenmill.engine.request import Request, SamplingParams

BLOCK = 4


def test_drafts_and_lookahead_get_slots_but_only_verified_tokens_are_cached() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    a = Request("a", list(range(7)), SamplingParams())
    assert kv.allocate_slots(a, 6) is not None  # prompt minus its last token: blocks 0, 1
    a.num_computed_tokens = 6
    a.spec_token_ids = [70, 71, 72, 73, 74]
    # Last token + 5 drafts = positions 6..11, plus 2 lookahead slots: 14 slots, 4 blocks.
    new = kv.allocate_slots(a, 6, None, num_lookahead_tokens=2)
    assert new is not None and new.block_ids == [2, 3]
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    # Only block 0 (tokens 0-3) is full of verified tokens: positions 4-6 are the prompt's
    # rest, 7-11 drafts.
    b = Request("b", [*range(7), 70, 71, 72, 73, 74], SamplingParams())
    _, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4


def test_truncate_gives_back_the_blocks_past_the_verified_tokens() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    a = Request("a", list(range(7)), SamplingParams())
    a.spec_token_ids = [9, 9, 9, 9, 9, 9]
    assert kv.allocate_slots(a, 13) is not None  # 13 tokens: 4 blocks
    free = kv.num_free_blocks
    a.spec_token_ids = []
    for token in (1, 2):  # two drafts accepted: 9 tokens, 3 blocks
        a.append_output_token(token)
    kv.truncate(a, a.num_tokens)
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == free + 1
    kv.truncate(a, a.num_tokens)  # idempotent
    assert kv.num_blocks_of("a") == 3
