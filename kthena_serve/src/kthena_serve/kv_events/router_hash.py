"""The Kthena router's chunk hash: the Redis keys its ``kvcache-aware`` plugin looks up.

The router tokenizes a prompt, cuts the ids into ``chunk_size``-token chunks (16 unless its
``blockSizeToHash`` says otherwise; at most ``maxBlocksToMatch`` = 128 chunks, the last one may
be partial) and hashes EACH chunk on its own, not chained to the one before::

    token ids   [t0 .. t15][t16 .. t31][t32 .. t47] ...
                  chunk 0     chunk 1     chunk 2
    hash(chunk) = SHA-256(t as big-endian uint32, for t in chunk)[0:8] as big-endian uint64,
                  top bit cleared (a 63-bit positive int)
    key         = "matrix:kv:block:{model}@{hash in decimal}"

A pod owns a key when its name ``pod.namespace`` is a field of that Redis hash; the value is
the unix second it was written. The router scores a pod by the longest run of leading chunks
it owns. Our KV block size need not equal the router's chunk size: ``chunks.py`` maps blocks
to the router's chunks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_MAX_CHUNKS",
    "FIELD_FRESH_SECONDS",
    "KEY_PREFIX",
    "ChunkHash",
    "chunk_hash",
    "prompt_chunk_hashes",
    "redis_key",
]

ChunkHash = NewType("ChunkHash", int)

KEY_PREFIX = "matrix:kv:block:"
DEFAULT_CHUNK_SIZE = 16  # the plugin's defaultBlockSizeToHash
DEFAULT_MAX_CHUNKS = 128  # the plugin's defaultMaxBlocksToMatch
FIELD_FRESH_SECONDS = 24 * 3600  # the plugin's GC drops fields older than this

_SIGN_BIT_CLEAR = (1 << 63) - 1


def chunk_hash(token_ids: Sequence[int]) -> ChunkHash:
    """The router's hash of one chunk of token ids (0 for an empty chunk, as the router's).

    Raises:
        struct.error: a token id outside ``[0, 2**32)``.
    """
    if not token_ids:
        return ChunkHash(0)
    digest = hashlib.sha256(struct.pack(f">{len(token_ids)}I", *token_ids)).digest()
    return ChunkHash(int.from_bytes(digest[:8], "big") & _SIGN_BIT_CLEAR)


def prompt_chunk_hashes(token_ids: Sequence[int], chunk_size: int = DEFAULT_CHUNK_SIZE,
                        max_chunks: int = DEFAULT_MAX_CHUNKS) -> list[ChunkHash]:
    """The hashes the router looks up for a prompt, in order (the last chunk may be partial)."""
    stop = min(len(token_ids), chunk_size * max_chunks)
    return [chunk_hash(token_ids[i : i + chunk_size]) for i in range(0, stop, chunk_size)]


def redis_key(model: str, chunk: ChunkHash) -> str:
    """``matrix:kv:block:{model}@{hash}``: the Redis hash whose fields are the chunk's owners."""
    return f"{KEY_PREFIX}{model}@{chunk}"
