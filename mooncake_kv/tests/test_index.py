"""Prefix index conformance: both implementations answer the same, through the Protocol."""

from __future__ import annotations

import pytest

from mooncake_kv import (
    BlockHasher,
    ExtraKeys,
    HashChainIndex,
    PrefixIndex,
    RadixIndex,
    UnknownIndexError,
    available_indexes,
)
from mooncake_kv.hashing import BlockChain
from mooncake_kv.index import create_index, register_index

HASHER = BlockHasher(2)
INDEXES = ["hash", "radix"]


def chain(tokens: list[int], extra: ExtraKeys | None = None) -> BlockChain:
    return BlockChain(HASHER, tokens, extra)


def refs_for(index: PrefixIndex, referenced: set[int], size: int = 64) -> list[int]:
    return [1 if b in referenced else 0 for b in range(size)]


@pytest.fixture(params=INDEXES)
def index(request: pytest.FixtureRequest) -> PrefixIndex:
    return create_index(request.param)


def test_registry_knows_both_and_rejects_unknown_names() -> None:
    assert {"hash", "radix"} <= set(available_indexes())
    assert isinstance(create_index("hash"), HashChainIndex)
    assert isinstance(create_index("radix"), RadixIndex)
    with pytest.raises(UnknownIndexError, match="hash, radix"):
        create_index("btree")


def test_registered_factory_is_used(monkeypatch) -> None:  # noqa: ANN001
    from mooncake_kv import index as index_module

    # the registry is global: this test's entry must not outlive it (config errors list it)
    monkeypatch.setattr(index_module, "_INDEXES", dict(index_module._INDEXES))
    register_index("hash-copy", HashChainIndex)
    assert isinstance(create_index("hash-copy"), HashChainIndex)


def test_implementations_satisfy_the_protocol(index: PrefixIndex) -> None:
    assert isinstance(index, PrefixIndex)


def test_longest_prefix_match_and_max_blocks(index: PrefixIndex) -> None:
    base = chain([1, 2, 3, 4, 5, 6])
    assert index.insert(base, 0, [10, 11, 12], None) == [10, 11, 12]
    assert index.match(chain([1, 2, 3, 4, 9, 9]), 3) == [10, 11]
    assert index.match(chain([1, 2, 3, 4, 5, 6, 7]), 3) == [10, 11, 12]
    assert index.match(chain([1, 2, 3, 4, 5, 6]), 2) == [10, 11]
    assert index.match(chain([2, 2]), 1) == []
    assert len(index) == 3


def test_insert_reports_existing_holders_for_duplicates(index: PrefixIndex) -> None:
    index.insert(chain([1, 2, 3, 4]), 0, [0, 1], None)
    other = chain([1, 2, 3, 4, 7, 7])
    assert index.insert(other, 0, [5, 6, 7], None) == [0, 1, 7]
    assert index.match(other, 3) == [0, 1, 7]


def test_branching_below_the_middle_of_a_run(index: PrefixIndex) -> None:
    index.insert(chain([1, 1, 2, 2, 3, 3, 4, 4]), 0, [0, 1, 2, 3], None)
    # share two blocks, then branch: the radix tree splits its run after block 1
    branch = chain([1, 1, 2, 2, 8, 8, 9, 9])
    assert index.insert(branch, 2, [4, 5], 1) == [4, 5]
    assert index.match(branch, 4) == [0, 1, 4, 5]
    assert index.match(chain([1, 1, 2, 2, 3, 3, 4, 4]), 4) == [0, 1, 2, 3]
    index.check_invariants(refs_for(index, {0, 1, 2, 3, 4, 5}))


def test_removing_tails_shrinks_the_match(index: PrefixIndex) -> None:
    whole = chain([1, 1, 2, 2, 3, 3])
    index.insert(whole, 0, [0, 1, 2], None)
    index.unprotect([2, 1, 0])
    index.remove([(2, whole.hashes[2])])
    assert index.match(whole, 3) == [0, 1]
    index.remove([(1, whole.hashes[1]), (0, whole.hashes[0])])
    assert index.match(whole, 3) == [] and len(index) == 0
    index.check_invariants(refs_for(index, set()))


def test_salts_do_not_share(index: PrefixIndex) -> None:
    tokens = [1, 2, 3, 4]
    index.insert(chain(tokens, ExtraKeys(cache_salt="a")), 0, [0, 1], None)
    assert index.match(chain(tokens, ExtraKeys(cache_salt="b")), 2) == []
    assert index.match(chain(tokens, ExtraKeys(cache_salt="a")), 2) == [0, 1]


def test_clear_forgets_everything(index: PrefixIndex) -> None:
    index.insert(chain([1, 2, 3, 4]), 0, [0, 1], None)
    index.clear()
    assert len(index) == 0 and list(index.entries()) == []
    assert index.match(chain([1, 2, 3, 4]), 2) == []


def test_entries_pair_hashes_with_blocks(index: PrefixIndex) -> None:
    whole = chain([5, 5, 6, 6])
    index.insert(whole, 0, [3, 7], None)
    assert sorted(index.entries(), key=lambda e: e[1]) == [
        (whole.hashes[0], 3),
        (whole.hashes[1], 7),
    ]


def test_radix_lock_ref_accounting() -> None:
    radix = RadixIndex()
    whole = chain([1, 1, 2, 2, 3, 3])
    radix.insert(whole, 0, [0, 1, 2], None)
    assert (radix.evictable_size, radix.protected_size, radix.total_size) == (0, 3, 3)
    radix.unprotect([2, 1])
    assert (radix.evictable_size, radix.protected_size) == (2, 1)
    radix.check_invariants(refs_for(radix, {0}))
    radix.protect([1])
    assert radix.evictable_size + radix.protected_size == radix.total_size == 3
    radix.check_invariants(refs_for(radix, {0, 1}))
    with pytest.raises(AssertionError, match="protected|lock_ref|locked"):
        radix.check_invariants(refs_for(radix, {0}))


def test_radix_compares_token_bytes_not_only_hashes() -> None:
    """A forged hash collision cannot make the radix index return foreign blocks."""
    radix = RadixIndex()
    real = chain([1, 1, 2, 2])
    radix.insert(real, 0, [0, 1], None)
    forged = chain([9, 9, 8, 8])
    forged.hashes = list(real.hashes)  # pretend the hashes collide
    assert radix.match(forged, 2) == []
    hashed = HashChainIndex()
    hashed.insert(real, 0, [0, 1], None)
    assert hashed.match(forged, 2) == [0, 1]  # why 128-bit keys (or sha256) matter
