"""Paged KV cache bookkeeping: block pool, prefix hashing, and the manager."""

from tokenmill.engine.kv_cache.block_pool import BlockPool, KVBlock
from tokenmill.engine.kv_cache.manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from tokenmill.engine.kv_cache.prefix_cache import (
    BlockHash,
    RequestBlockHashes,
    hash_block_tokens,
    hash_request_tokens,
)

__all__ = [
    "BlockHash",
    "BlockPool",
    "KVBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "PrefixCacheStats",
    "RequestBlockHashes",
    "hash_block_tokens",
    "hash_request_tokens",
]
