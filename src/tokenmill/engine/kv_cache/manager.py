"""KVCacheManager: the scheduler's only door to the KV block pool.

Each request owns an ordered list of blocks (its block table); token i of the request
lives in slot i % block_size of block i // block_size:

    tokens   [t0 ... t15][t16 ... t31][t32 t33 t34 _ _ ...]
    blocks   [   7      ][    3      ][    12              ]   block_size 16
             full, hashed  full, hashed  partial: private

With prefix caching, `get_computed_blocks` finds the longest run of leading full blocks
whose chained hashes are registered, and `allocate_slots` takes a reference on them
instead of computing them again. As soon as a request's allocation makes a block full
(for the tokens scheduled this step) the block is registered under its hash, so a request
scheduled later, even in the same step, can share it. This is safe because the runner
writes the whole batch's K/V of a layer before any attention of that layer reads it.

`free` returns a request's blocks tail-first, so its last blocks are evicted first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.engine.kv_cache.block_pool import BlockPool, KVBlock
from tokenmill.engine.kv_cache.prefix_cache import RequestBlockHashes
from tokenmill.engine.request import Request


class KVCacheBlocks:
    """An opaque run of blocks handed between the manager and the scheduler.

    Callers read block ids and a count; the blocks themselves stay the manager's.
    """

    __slots__ = ("_blocks",)

    def __init__(self, blocks: Sequence[KVBlock] = ()) -> None:
        self._blocks = tuple(blocks)

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self._blocks]

    def __len__(self) -> int:
        return len(self._blocks)

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.block_ids})"


@dataclass(frozen=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters; queries and hits count tokens."""

    num_requests: int = 0
    num_queries: int = 0
    num_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    """Block tables of all requests over one BlockPool, with prefix caching."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are registered in the cache (or were
        # offered for registration): the next one to register is at this index.
        self._num_cached_blocks: dict[str, int] = {}
        # Kept across preemption (the tokens do not change), dropped when finished.
        self._req_hashes: dict[str, RequestBlockHashes] = {}
        self._num_requests = 0
        self._num_queries = 0
        self._num_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(req_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached run of the request's leading full blocks, and its token count.

        Matches only within the first num_tokens - 1 tokens, so the last token is always
        computed (its logits give the next token). Requests asking for prompt logprobs
        skip the cache: every prompt position must be computed. Pure: the hit is counted
        (in tokens) by `allocate_slots` once the request is actually admitted, so a
        request that waits several steps for blocks is counted once.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return KVCacheBlocks(), 0
        hashes = self._hashes_of(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for i in range(min(max_blocks, len(hashes))):
            block = self.pool.get_cached_block(hashes[i])
            if block is None:
                break
            hit.append(block)
        return KVCacheBlocks(hit), len(hit) * self.block_size

    def num_blocks_to_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> int:
        """Free blocks that `allocate_slots` with these arguments would consume.

        Cache-hit blocks that are currently free count too: taking them shrinks the free
        queue.
        """
        computed = new_computed_blocks._blocks if new_computed_blocks is not None else ()
        num_tokens = (
            request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
            + num_lookahead_tokens
        )
        num_held = len(self._req_blocks.get(request.request_id, ())) + len(computed)
        num_new_blocks = max(0, _cdiv(num_tokens, self.block_size) - num_held)
        num_free_hits = sum(1 for b in computed if b.ref_cnt == 0)
        return num_new_blocks + num_free_hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Give the request slots for `num_new_tokens` more tokens after its computed ones.

        `new_computed_blocks` (from `get_computed_blocks`, for a request holding no blocks)
        are shared instead of computed. The new tokens may run past the request's tokens
        into its draft tokens (`request.spec_token_ids`, speculative decoding), and
        `num_lookahead_tokens` more slots are reserved after them (where a draft model
        writes the K/V of its next proposals). Returns the newly taken blocks, or None when
        there are not enough free blocks, in which case nothing changed. On success every
        block made full by the scheduled tokens is registered in the prefix cache; drafts
        are not tokens yet, so blocks holding drafts are not.
        """
        assert num_new_tokens > 0, num_new_tokens
        computed = new_computed_blocks._blocks if new_computed_blocks is not None else ()
        req_id = request.request_id
        if self.num_blocks_to_allocate(
            request, num_new_tokens, new_computed_blocks, num_lookahead_tokens
        ) > self.pool.num_free_blocks:
            return None
        is_admission = req_id not in self._req_blocks
        blocks = self._req_blocks.setdefault(req_id, [])
        if computed:
            assert not blocks, f"{req_id} got cache hits while holding blocks"
            self.pool.touch(computed)
            blocks.extend(computed)
            self._num_cached_blocks[req_id] = len(computed)
        if is_admission and self.enable_prefix_caching:
            self._count_query(request, len(computed) * self.block_size)

        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        assert num_tokens <= request.num_tokens + len(request.spec_token_ids), (num_tokens, request)
        num_slots = num_tokens + num_lookahead_tokens
        num_new_blocks = max(0, _cdiv(num_slots, self.block_size) - len(blocks))
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, min(num_tokens, request.num_tokens))
        return KVCacheBlocks(new_blocks)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks that hold the request's first `num_tokens` tokens; the
        rest (slots of rejected draft tokens, lookahead) go back to the pool, tail first.
        They were never registered in the prefix cache: they held no full block of tokens."""
        blocks = self._req_blocks.get(request.request_id)
        if blocks is None:
            return
        keep = _cdiv(num_tokens, self.block_size)
        if len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        assert self._num_cached_blocks.get(request.request_id, 0) <= keep, request
        self.pool.free_blocks(reversed(tail))

    def num_blocks_of(self, req_id: str) -> int:
        return len(self._req_blocks.get(req_id, ()))

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first. A finished request also drops its hashes."""
        req_id = request.request_id
        blocks = self._req_blocks.pop(req_id, [])
        self.pool.free_blocks(reversed(blocks))
        self._num_cached_blocks.pop(req_id, None)
        if request.is_finished:
            self._req_hashes.pop(req_id, None)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._num_requests, self._num_queries, self._num_hits)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content; refused (False) while any block is in use."""
        return self.pool.reset_prefix_cache()

    def _hashes_of(self, request: Request) -> RequestBlockHashes:
        hashes = self._req_hashes.get(request.request_id)
        if hashes is None:
            hashes = RequestBlockHashes(self.block_size, request.cache_salt)
            self._req_hashes[request.request_id] = hashes
        hashes.update(request.all_token_ids)
        return hashes

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        req_id = request.request_id
        num_full = num_tokens // self.block_size
        num_cached = self._num_cached_blocks.get(req_id, 0)
        if num_full <= num_cached:
            return
        hashes = self._hashes_of(request)
        blocks = self._req_blocks[req_id]
        self.pool.cache_full_blocks(
            blocks[num_cached:num_full], [hashes[i] for i in range(num_cached, num_full)]
        )
        self._num_cached_blocks[req_id] = num_full

    def _count_query(self, request: Request, num_hit_tokens: int) -> None:
        if request.sampling_params.prompt_logprobs is not None:
            return
        self._num_requests += 1
        self._num_queries += request.num_tokens
        self._num_hits += num_hit_tokens
