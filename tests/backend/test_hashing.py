"""Prefix-chained block hashes: chaining, partial blocks, namespaces, algorithms."""

from __future__ import annotations

import numpy as np
import pytest

from node_agent.backend.hashing import BlockHasher, HashAlgorithm


@pytest.mark.parametrize("algo", list(HashAlgorithm))
def test_hash_is_prefix_chained(algo: HashAlgorithm) -> None:
    h = BlockHasher(4, algo)
    toks = np.arange(20, dtype=np.int64)
    base = h.hashes(toks)
    assert len(base) == 5 and len(set(base)) == 5
    changed = toks.copy()
    changed[9] = 999  # inside block 2
    after = h.hashes(changed)
    assert after[:2] == base[:2]
    assert all(a != b for a, b in zip(after[2:], base[2:], strict=True))


@pytest.mark.parametrize("algo", list(HashAlgorithm))
def test_same_block_under_another_prefix_differs(algo: HashAlgorithm) -> None:
    h = BlockHasher(4, algo)
    a = h.hashes(np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int64))
    b = h.hashes(np.array([9, 9, 9, 9, 5, 6, 7, 8], dtype=np.int64))
    assert a[1] != b[1]


def test_trailing_partial_block_has_no_hash_and_limit_truncates() -> None:
    h = BlockHasher(16)
    toks = np.arange(16 * 3 + 15, dtype=np.int64)
    assert len(h.hashes(toks)) == 3
    assert h.hashes(toks, limit=2) == h.hashes(toks)[:2]
    assert h.hashes(toks[:15]) == []


@pytest.mark.parametrize("algo", list(HashAlgorithm))
def test_namespace_salts_every_block(algo: HashAlgorithm) -> None:
    h = BlockHasher(4, algo)
    toks = np.arange(12, dtype=np.int64)
    plain, lora_a, lora_b = h.hashes(toks), h.hashes(toks, "lora-a"), h.hashes(toks, "lora-b")
    assert not set(plain) & set(lora_a) and not set(lora_a) & set(lora_b)
    assert h.hashes(toks, "lora-a") == lora_a  # deterministic


def test_widths_follow_the_algorithm() -> None:
    toks = np.arange(64, dtype=np.int64)
    assert max(BlockHasher(16, "xxh3_64").hashes(toks)) < 2**64
    assert max(BlockHasher(16, "xxh3_128").hashes(toks)) >= 2**64  # overwhelmingly likely
    assert max(BlockHasher(16, "blake2b").hashes(toks)) >= 2**128


def test_unknown_algorithm_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'md5' is unknown.*xxh3_64"):
        BlockHasher(16, "md5")
