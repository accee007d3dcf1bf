"""Block hashing: definition, golden values, stability across processes, extra keys."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from mooncake_kv import (
    BlockHasher,
    ExtraKeys,
    UnknownIndexError,
    available_hash_algorithms,
    pack_tokens,
)
from mooncake_kv.hashing import BlockChain

GOLDEN_XXH3 = ["a84f19c70022847bab98bcdec291656b", "c5b1fbd0e1f9a2ddf1b5fd9ecc9f6a74"]
GOLDEN_SHA256_0 = "a0f9520cdd10424a47c9d57bddc3571765421df5093f3e1804578d98cd26b868"

tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=60)


def test_golden_values_pin_the_key_format() -> None:
    assert [h.hex() for h in BlockHasher(4).hash_tokens(list(range(10)))] == GOLDEN_XXH3
    assert BlockHasher(4, "sha256").hash_tokens(list(range(10)))[0].hex() == GOLDEN_SHA256_0


def test_definition_parent_tokens_little_endian() -> None:
    root = xxhash.xxh3_128_digest(b"mooncake_kv/v1\x00" + struct.pack("<I", 4) + b"\x00\x00")
    block0 = xxhash.xxh3_128_digest(root + struct.pack("<4I", 0, 1, 2, 3))
    block1 = xxhash.xxh3_128_digest(block0 + struct.pack("<4I", 4, 5, 6, 7))
    assert BlockHasher(4).hash_tokens(list(range(10))) == [block0, block1]
    sha_root = hashlib.sha256(b"mooncake_kv/v1\x00" + struct.pack("<I", 4) + b"\x00\x00").digest()
    sha0 = hashlib.sha256(sha_root + struct.pack("<4I", 0, 1, 2, 3)).digest()
    assert BlockHasher(4, "sha256").hash_tokens(list(range(4))) == [sha0]


def test_same_hashes_in_a_process_with_another_hash_seed() -> None:
    code = (
        "from mooncake_kv import BlockHasher, ExtraKeys;"
        "h = BlockHasher(4).hash_tokens(list(range(10)), ExtraKeys(cache_salt='t'));"
        "print(','.join(x.hex() for x in h))"
    )
    expected = ",".join(
        x.hex() for x in BlockHasher(4).hash_tokens(list(range(10)), ExtraKeys(cache_salt="t"))
    )
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected


def test_key_lengths_per_algorithm() -> None:
    assert len(BlockHasher(2).hash_tokens([1, 2])[0]) == 16
    assert len(BlockHasher(2, "sha256").hash_tokens([1, 2])[0]) == 32


def test_only_full_blocks_are_hashed() -> None:
    hasher = BlockHasher(4)
    assert hasher.hash_tokens([1, 2, 3]) == []
    assert len(hasher.hash_tokens(list(range(11)))) == 2


def test_salt_and_adapter_change_every_block() -> None:
    hasher = BlockHasher(4)
    tokens = list(range(12))
    plain = hasher.hash_tokens(tokens)
    for extra in (ExtraKeys(cache_salt="a"), ExtraKeys(adapter_id="lora-1")):
        keyed = hasher.hash_tokens(tokens, extra)
        assert all(a != b for a, b in zip(plain, keyed, strict=True))
    salted = hasher.hash_tokens(tokens, ExtraKeys(cache_salt="a"))
    assert salted != hasher.hash_tokens(tokens, ExtraKeys(cache_salt="b"))
    assert salted == hasher.hash_tokens(tokens, ExtraKeys(cache_salt="a"))
    # None and "" are different salts
    assert hasher.hash_tokens(tokens, ExtraKeys(cache_salt="")) != plain


def test_input_hash_changes_its_block_and_later_ones_only() -> None:
    hasher = BlockHasher(4)
    tokens = list(range(16))
    plain = hasher.hash_tokens(tokens)
    image = hasher.hash_tokens(tokens, ExtraKeys(input_hashes=((9, b"image-a"),)))
    other = hasher.hash_tokens(tokens, ExtraKeys(input_hashes=((9, b"image-b"),)))
    assert image[:2] == plain[:2] == other[:2]
    assert all(a != b != c for a, b, c in zip(plain[2:], image[2:], other[2:], strict=True))


def test_available_hash_algorithms_lists_the_registry() -> None:
    names = available_hash_algorithms()
    assert {"sha256", "xxh3_128"} <= set(names) and list(names) == sorted(names)


def test_bad_input_is_rejected_with_a_message() -> None:
    with pytest.raises(UnknownIndexError, match="xxh3_128"):
        BlockHasher(4, "md5")
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\); got -1 at position 1$"):
        pack_tokens([1, -1])
    with pytest.raises(ValueError, match=r"got 'a' at position 0$"):
        pack_tokens(["a"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"got 4294967296 at position 6$"):
        BlockChain(BlockHasher(2), [0, 1, 2, 3]).extend([0, 1, 2, 3, 4, 5, 2**32, 7])
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        pack_tokens([2**32])
    with pytest.raises(ValueError, match="input_hashes"):
        ExtraKeys(input_hashes=((-1, b"x"),))
    with pytest.raises(ValueError, match="exactly 4"):
        BlockHasher(4).hash_block(b"", [1, 2])


@given(tokens=tokens_st, block_size=st.integers(1, 8), algo=st.sampled_from(["xxh3_128", "sha256"]))
def test_fast_chain_equals_the_reference_definition(
    tokens: list[int], block_size: int, algo: str
) -> None:
    hasher = BlockHasher(block_size, algo)
    parent = hasher.root()
    expected = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hasher.hash_block(parent, tokens[start : start + block_size])
        expected.append(parent)
    assert hasher.hash_tokens(tokens) == expected


@given(tokens=tokens_st, cut=st.integers(0, 60), block_size=st.integers(1, 6))
def test_growing_chain_equals_hashing_the_whole_sequence(
    tokens: list[int], cut: int, block_size: int
) -> None:
    hasher = BlockHasher(block_size)
    extra = ExtraKeys(cache_salt="s", input_hashes=((3, b"x"),))
    chain = BlockChain(hasher, tokens[:cut], extra)
    added = chain.extend(tokens)
    full = hasher.hash_tokens(tokens, extra)
    assert chain.hashes == full
    assert added == max(0, len(full) - len(tokens[:cut]) // block_size)
    assert chain.page_keys(0, len(chain)) == [chain.page_key(i) for i in range(len(chain))]
