"""Chained block hashes: full blocks only, chaining, salt isolation, incremental updates."""

from __future__ import annotations

import hashlib
import struct

import pytest

from tokenmill.engine.kv_cache import prefix_cache
from tokenmill.engine.kv_cache.prefix_cache import (
    RequestBlockHashes,
    hash_block_tokens,
    hash_request_tokens,
)


def test_only_full_blocks_are_hashed() -> None:
    assert len(hash_request_tokens(4, list(range(11)))) == 2
    assert len(hash_request_tokens(4, list(range(12)))) == 3
    assert hash_request_tokens(4, [1, 2, 3]) == []


def test_hashes_chain_over_the_prefix() -> None:
    tokens = list(range(100, 112))
    hashes = hash_request_tokens(4, tokens)
    h0 = hash_block_tokens(None, tokens[0:4])
    h1 = hash_block_tokens(h0, tokens[4:8])
    h2 = hash_block_tokens(h1, tokens[8:12])
    assert hashes == [h0, h1, h2]
    assert len(h0) == 32


def test_same_block_after_a_different_prefix_hashes_differently() -> None:
    a = hash_request_tokens(2, [1, 2, 5, 6])
    b = hash_request_tokens(2, [3, 4, 5, 6])
    assert a[0] != b[0]
    assert a[1] != b[1]
    # A shared prefix shares hashes up to the first difference.
    c = hash_request_tokens(2, [1, 2, 5, 7])
    assert c[0] == a[0]
    assert c[1] != a[1]


def test_salt_isolates_every_block() -> None:
    tokens = list(range(16))
    plain = hash_request_tokens(4, tokens)
    salted_a = hash_request_tokens(4, tokens, cache_salt="a")
    salted_b = hash_request_tokens(4, tokens, cache_salt="b")
    for i in range(4):
        assert len({plain[i], salted_a[i], salted_b[i]}) == 3
    assert hash_request_tokens(4, tokens, cache_salt="a") == salted_a
    # The salt enters the first block only; later blocks chain through it.
    assert salted_a[1] == hash_block_tokens(salted_a[0], tokens[4:8])


def test_empty_salt_differs_from_no_salt() -> None:
    assert hash_request_tokens(2, [1, 2], "") != hash_request_tokens(2, [1, 2], None)


def test_hash_is_sha256_of_the_documented_encoding() -> None:
    root = hashlib.sha256(b"tokenmill.kv_cache.prefix.root.v1").digest()
    tokens = [1, 2, 70000]
    payload = root + struct.pack("<I", 3) + struct.pack("<3q", *tokens) + b"\x01"
    payload += struct.pack("<I", 4) + b"salt"
    assert hash_block_tokens(None, tokens, "salt") == hashlib.sha256(payload).digest()


def test_incremental_update_hashes_only_new_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = prefix_cache.hash_block_tokens

    def counting(parent, token_ids, cache_salt=None):  # type: ignore[no-untyped-def]
        calls.append(token_ids[0])
        return real(parent, token_ids, cache_salt)

    monkeypatch.setattr(prefix_cache, "hash_block_tokens", counting)
    tokens = list(range(9))
    hashes = RequestBlockHashes(4, cache_salt="s")
    assert hashes.update(tokens) == 2
    assert calls == [0, 4]
    tokens += [9, 10]
    assert hashes.update(tokens) == 2
    assert calls == [0, 4]
    tokens.append(11)
    assert hashes.update(tokens) == 3
    assert calls == [0, 4, 8]
    monkeypatch.undo()
    assert hashes.hashes == hash_request_tokens(4, tokens, cache_salt="s")


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        RequestBlockHashes(0)
