"""Block hashing: the stable key that names a full block *and its whole prefix*.

The key of block ``i`` of a token sequence is::

    hash_i = H(parent_i || tokens_i || extra_i)        parent_0 = root(block_size, extra keys)
                                                      parent_i = hash_{i-1}

    root ── hash_0 ── hash_1 ── hash_2 ...            each link covers block_size tokens
             │          │          │
          tokens_0   tokens_1   tokens_2 (+ extra_2 when a non-token input starts in block 2)

* ``tokens_i`` are the block's token ids packed as little-endian ``uint32`` (4 bytes each).
* ``root`` digests a version tag, the block size, the tenant ``cache_salt`` and the
  adapter/model id, so those enter the first block's hash and, through the chain, every
  later one: two tenants with different salts never share a block.
* ``extra_i`` is the concatenation of the digests of non-token inputs (e.g. an image) whose
  placeholder starts in block ``i``; blocks before it stay shareable.
* ``H`` is ``xxh3_128`` (16-byte keys, the default) or ``sha256`` (32-byte keys, for
  tenants that may craft collisions); both are deterministic across processes and
  machines, unlike Python's ``hash()``. More algorithms can be registered.

Only full blocks are hashed. ``BlockHasher.chain`` hashes a packed sequence in one pass
(one digest call per block, no per-token Python work): this is on the hot path.
"""

from __future__ import annotations

import hashlib
import operator
import struct
import sys
from array import array
from collections.abc import Callable, Sequence

import attrs
import xxhash

from mooncake_kv.types import BlockHash, UnknownIndexError

__all__ = [
    "DEFAULT_HASH_ALGO",
    "BlockChain",
    "BlockHasher",
    "ExtraKeys",
    "HashFn",
    "available_hash_algorithms",
    "get_hash_fn",
    "pack_tokens",
    "register_hash_algorithm",
]

HashFn = Callable[[bytes], bytes]
"""A digest function: bytes in, fixed-length bytes out."""

DEFAULT_HASH_ALGO = "xxh3_128"
_VERSION_TAG = b"mooncake_kv/v1\x00"
_BIG_ENDIAN = sys.byteorder == "big"
_UINT32 = "I" if array("I").itemsize == 4 else "L"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_HASH_ALGORITHMS: dict[str, HashFn] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": _sha256,
}


def register_hash_algorithm(name: str, fn: HashFn) -> None:
    """Register a digest function under ``name`` (it must be stable across processes)."""
    _HASH_ALGORITHMS[name] = fn


def available_hash_algorithms() -> tuple[str, ...]:
    """Names of the registered digest functions, sorted."""
    return tuple(sorted(_HASH_ALGORITHMS))


def get_hash_fn(name: str) -> HashFn:
    """Return the digest function registered as ``name``.

    Raises:
        UnknownIndexError: ``name`` is not registered; the message lists the known names.
    """
    try:
        return _HASH_ALGORITHMS[name]
    except KeyError:
        known = ", ".join(sorted(_HASH_ALGORITHMS))
        raise UnknownIndexError(f"unknown hash algorithm {name!r}; use one of: {known}") from None


def pack_tokens(token_ids: Sequence[int], count: int | None = None) -> bytes:
    """Pack token ids as little-endian uint32 bytes (the hash input format).

    Args:
        count: pack only the first ``count`` ids (default: all).

    Raises:
        ValueError: a token id is outside ``[0, 2**32)``; the message names its value and
            position.
    """
    try:
        packed = array(_UINT32, token_ids)
    except (OverflowError, TypeError):
        raise ValueError(_bad_token_message(token_ids)) from None
    if count is not None:
        del packed[count:]
    if _BIG_ENDIAN:  # pragma: no cover - keys are little-endian everywhere
        packed.byteswap()
    return packed.tobytes()


def _bad_token_message(token_ids: Sequence[int], offset: int = 0) -> str:
    """Name the first id that is not an integer in [0, 2**32) (error path only)."""
    for position, value in enumerate(token_ids, offset):
        try:
            is_valid = 0 <= operator.index(value) < 2**32
        except TypeError:
            is_valid = False
        if not is_valid:
            return (f"token ids must be integers in [0, 2**32); got {value!r} at position "
                    f"{position}")
    return "token ids must be integers in [0, 2**32)"


def _text_field(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode("utf-8")
    return b"\x01" + struct.pack("<I", len(raw)) + raw


def _check_input_hashes(instance: object, attribute: object, value: tuple) -> None:
    for item in value:
        ok = isinstance(item, tuple) and len(item) == 2
        if not (ok and isinstance(item[0], int) and item[0] >= 0 and isinstance(item[1], bytes)):
            raise ValueError(
                f"input_hashes must be (token_offset >= 0, digest bytes) pairs, got {item!r}"
            )


@attrs.frozen
class ExtraKeys:
    """Inputs besides the token ids that change what a block's KV contains.

    Attributes:
        cache_salt: tenant salt; tenants with different salts share nothing.
        adapter_id: LoRA adapter or model id; different adapters share nothing.
        input_hashes: ``(token_offset, digest)`` of non-token inputs (e.g. an image whose
            placeholder tokens start at ``token_offset``).
    """

    cache_salt: str | None = None
    adapter_id: str | None = None
    input_hashes: tuple[tuple[int, bytes], ...] = attrs.field(
        default=(), converter=tuple, validator=_check_input_hashes
    )

    def block_extras(self, block_size: int) -> dict[int, bytes]:
        """Map block index -> concatenated digests of the inputs that start in it."""
        extras: dict[int, bytes] = {}
        for offset, digest in sorted(self.input_hashes):
            index = offset // block_size
            extras[index] = extras.get(index, b"") + digest
        return extras


class BlockHasher:
    """Hashes full blocks of ``block_size`` tokens with one algorithm."""

    __slots__ = ("_fn", "_plain_root", "algo", "block_size")

    def __init__(self, block_size: int, algo: str = DEFAULT_HASH_ALGO) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.algo = algo
        self._fn = get_hash_fn(algo)
        self._plain_root = self._root(None)

    def root(self, extra_keys: ExtraKeys | None = None) -> BlockHash:
        """The parent of block 0: digests the block size, cache salt and adapter id."""
        if extra_keys is None:
            return self._plain_root
        return self._root(extra_keys)

    def _root(self, extra_keys: ExtraKeys | None) -> BlockHash:
        salt = extra_keys.cache_salt if extra_keys else None
        adapter = extra_keys.adapter_id if extra_keys else None
        head = _VERSION_TAG + struct.pack("<I", self.block_size)
        return BlockHash(self._fn(head + _text_field(salt) + _text_field(adapter)))

    def hash_block(
        self, parent: bytes, block_token_ids: Sequence[int], extra: bytes = b""
    ) -> BlockHash:
        """Reference hash of one full block (the definition; ``chain`` is the fast path)."""
        if len(block_token_ids) != self.block_size:
            raise ValueError(
                f"a block holds exactly {self.block_size} tokens, got {len(block_token_ids)}"
            )
        return BlockHash(self._fn(parent + pack_tokens(block_token_ids) + extra))

    def chain(
        self,
        data: bytes,
        parent: bytes,
        first_block: int = 0,
        extras: dict[int, bytes] | None = None,
    ) -> list[BlockHash]:
        """Hash every full block of packed tokens ``data``, chaining from ``parent``.

        Args:
            data: tokens packed by ``pack_tokens``; a trailing partial block is ignored.
            parent: hash of the block before ``data`` (or the root).
            first_block: index of ``data``'s first block in the sequence (for ``extras``).
            extras: block index -> extra bytes (see ``ExtraKeys.block_extras``).
        """
        fn = self._fn
        step = 4 * self.block_size
        stop = len(data) - len(data) % step
        out: list[BlockHash] = []
        append = out.append
        if not extras:
            for offset in range(0, stop, step):
                parent = fn(parent + data[offset : offset + step])
                append(parent)  # type: ignore[arg-type]
            return out
        for index, offset in enumerate(range(0, stop, step), first_block):
            parent = fn(parent + data[offset : offset + step] + extras.get(index, b""))
            append(parent)  # type: ignore[arg-type]
        return out

    def hash_tokens(
        self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
    ) -> list[BlockHash]:
        """Hashes of all full blocks of ``token_ids`` (what a router or store computes)."""
        extras = extra_keys.block_extras(self.block_size) if extra_keys else None
        full = len(token_ids) - len(token_ids) % self.block_size
        return self.chain(pack_tokens(token_ids, full), self.root(extra_keys), 0, extras)


class BlockChain:
    """The hash chain of one request's tokens, grown as its blocks fill.

    Holds the packed tokens of the full blocks hashed so far, their hashes, and the
    root; an index may key on hashes (``HashChainIndex``) or on page bytes
    (``RadixIndex``, via ``page_key``).
    """

    __slots__ = ("_hasher", "data", "extras", "hashes", "page_bytes", "root")

    def __init__(
        self,
        hasher: BlockHasher,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys | None = None,
    ) -> None:
        self._hasher = hasher
        self.page_bytes = 4 * hasher.block_size
        self.root = hasher.root(extra_keys)
        has_inputs = extra_keys is not None and extra_keys.input_hashes
        self.extras = extra_keys.block_extras(hasher.block_size) if has_inputs else None
        full = len(token_ids) - len(token_ids) % hasher.block_size
        self.data = pack_tokens(token_ids, full)
        self.hashes = hasher.chain(self.data, self.root, 0, self.extras)

    def __len__(self) -> int:
        return len(self.hashes)

    def extend(self, token_ids: Sequence[int]) -> int:
        """Hash the blocks of ``token_ids`` (the whole sequence) that filled since last time.

        The first ``len(self) * block_size`` tokens are trusted to be unchanged.
        Returns the number of newly hashed blocks.
        """
        size = self._hasher.block_size
        have = len(self.hashes)
        full = len(token_ids) // size
        if full <= have:
            return 0
        start, stop = have * size, full * size
        try:
            new = pack_tokens(token_ids[start:stop])
        except ValueError:  # name the position in the whole sequence, not in the slice
            raise ValueError(_bad_token_message(token_ids[start:stop], start)) from None
        parent = self.hashes[-1] if have else self.root
        self.hashes += self._hasher.chain(new, parent, have, self.extras)
        self.data += new
        return full - have

    def page_key(self, index: int) -> bytes:
        """Bytes identifying block ``index`` under its parent: its packed tokens (+ extras)."""
        step = self.page_bytes
        key = self.data[index * step : (index + 1) * step]
        if self.extras and index in self.extras:
            key += self.extras[index]
        return key

    def page_keys(self, start: int, stop: int) -> list[bytes]:
        """``page_key(i)`` for ``start <= i < stop``."""
        if self.extras:
            return [self.page_key(i) for i in range(start, stop)]
        data, step = self.data, self.page_bytes
        return [data[i * step : i * step + step] for i in range(start, stop)]
