"""The pool of physical KV blocks: reference counts, a free queue and the hash table.

Every block is in exactly one of three states:

    in use        ref_cnt >= 1, not in the free queue (maybe hashed: shared prefix)
    free, cached  ref_cnt == 0, in the free queue, hashed: reusable by a cache hit
    free, empty   ref_cnt == 0, in the free queue, no hash

The free queue is also the eviction order. New blocks are taken from its front; a block
taken that still carries a hash is evicted (its hash entry dropped). Freed cached blocks
go to the back, in the order given, so the least recently freed cached block is evicted
first. The manager frees a request's blocks tail-first, so within one request the later
blocks (the least shareable: only prompts with the same longer prefix hit them) are
evicted before the earlier ones. Freed blocks without a hash hold nothing worth keeping
and go to the front, to be reused before any cached block is evicted.

    front (evicted first)                                       back (evicted last)
    [ empty ... empty | cached, freed long ago ... cached, freed just now ]

A cache hit (`touch`) pulls a free cached block out of the queue and bumps its ref_cnt.
The queue is an OrderedDict keyed by block id: O(1) take from the front, O(1) removal
from the middle, O(1) append at either end.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tokenmill.engine.kv_cache.prefix_cache import BlockHash


@dataclass(eq=False)
class KVBlock:
    """One physical block of `block_size` token slots in every layer's K and V cache."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the prefix cache (full, content-addressed).
    block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        tag = "" if self.block_hash is None else f", hash={self.block_hash.hex()[:8]}"
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}{tag})"


class BlockPool:
    """All KV blocks, with reference counting and (optionally) content-hash lookup."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (cached-but-free blocks count as free)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt >= 1)."""
        return 1.0 - len(self._free) / self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (front first). For tests and debugging."""
        return list(self._free)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks from the front of the free queue, evicting cached ones.

        The caller checks `can_allocate` first; asking for more is a bug.
        """
        if num_blocks > len(self._free):
            raise RuntimeError(
                f"asked for {num_blocks} blocks with {len(self._free)} free: check can_allocate"
            )
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0, block
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            assert block.block_hash is not None, f"touch of an uncached block {block}"
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue.

        `ordered_blocks` is in eviction order: the first block freed is evicted first.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_full_blocks(
        self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash]
    ) -> None:
        """Register full in-use blocks under their content hashes, pairwise.

        A hash that is already registered keeps its block: the new block stays unhashed
        (a private copy of the same content, freed like any other block).
        """
        if not self.enable_caching:
            return
        assert len(blocks) == len(block_hashes), (len(blocks), len(block_hashes))
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            assert block.ref_cnt > 0, f"caching a free block {block}"
            if block.block_hash is not None:
                assert block.block_hash == block_hash, f"{block} recached under another hash"
                continue
            if block_hash in self._cached:
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (False) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
