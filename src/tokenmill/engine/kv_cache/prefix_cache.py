"""Content addressing of full KV blocks, for prefix caching.

A full block's K/V depend on every token before it, so a block's identity is a hash chained
over the whole prefix:

    hash_0 = H(ROOT,   tokens[0:B],   extra keys: cache_salt)
    hash_i = H(hash_{i-1}, tokens[iB:(i+1)B], extra keys: none)

Two blocks share a hash only if their whole prefixes (and salts) are equal. The salt enters
the first block only; since every later hash chains through the first, requests with
different salts never share any entry. Only full blocks are hashed: a partial block is
still being written.

H is SHA-256 over an unambiguous byte encoding (length-prefixed fields, token ids as 8-byte
little-endian integers), kept whole (32 bytes). A collision would silently serve another
prompt's K/V, so a cryptographic hash is used rather than Python's `hash()` (64 bits,
salted per process, and trivially collidable for integer tuples).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import NewType

# 32 bytes of SHA-256, chained over the prefix.
BlockHash = NewType("BlockHash", bytes)

# Parent of the first block of every request.
_ROOT = BlockHash(hashlib.sha256(b"tokenmill.kv_cache.prefix.root.v1").digest())
_NO_SALT = b"\x00"
_SALT = b"\x01"


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    packed = array("q", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None = None
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block).

    `cache_salt` is an extra key; callers pass it for the first block only.
    """
    digest = hashlib.sha256()
    digest.update(_ROOT if parent_hash is None else parent_hash)
    digest.update(struct.pack("<I", len(token_ids)))
    digest.update(_encode_tokens(token_ids))
    if cache_salt is None:
        digest.update(_NO_SALT)
    else:
        salt = cache_salt.encode("utf-8")
        digest.update(_SALT + struct.pack("<I", len(salt)) + salt)
    return BlockHash(digest.digest())


def hash_request_tokens(
    block_size: int, token_ids: Sequence[int], cache_salt: str | None = None
) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block is skipped)."""
    hashes = RequestBlockHashes(block_size, cache_salt)
    hashes.update(token_ids)
    return hashes.hashes


class RequestBlockHashes:
    """One request's block hashes, extended incrementally as its tokens grow.

    `update(token_ids)` hashes only the blocks that became full since the previous call, so
    a request is never rehashed from the start. `token_ids` must extend what was seen
    before (a request's tokens only grow).
    """

    def __init__(self, block_size: int, cache_salt: str | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.cache_salt = cache_salt
        self._hashes: list[BlockHash] = []

    @property
    def hashes(self) -> list[BlockHash]:
        """Hashes of the full blocks seen so far (a copy)."""
        return list(self._hashes)

    def __len__(self) -> int:
        return len(self._hashes)

    def __getitem__(self, index: int) -> BlockHash:
        return self._hashes[index]

    def update(self, token_ids: Sequence[int]) -> int:
        """Hash the newly full blocks of `token_ids`; returns the number of full blocks."""
        size = self.block_size
        num_full = len(token_ids) // size
        for i in range(len(self._hashes), num_full):
            parent = self._hashes[-1] if self._hashes else None
            salt = self.cache_salt if i == 0 else None
            self._hashes.append(
                hash_block_tokens(parent, token_ids[i * size : (i + 1) * size], salt)
            )
        return num_full
