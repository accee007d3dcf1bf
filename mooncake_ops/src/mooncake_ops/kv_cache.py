"""Paged KV cache writes (`write_kv`) and block packing for transfer (`gather_blocks`).

Slot mapping: each new token names the flat slot it goes to, ``block_id * block_size + offset``.

    slot_mapping = [ 33, 34, -1, 5 ]        block_size = 16
                      │   │   │   └─▶ block 0,  row 5
                      │   │   └─────▶ skipped (padding)
                      │   └─────────▶ block 2,  row 2
                      └─────────────▶ block 2,  row 1

    k_cache[block, row, head, :] = key[token, head, :]      (int8: quantised, scale stored)

Staging layout of `gather_blocks` (block-major; one row of bytes per requested block):

    row i = block_ids[i]:  | caches[0][id] bytes | caches[1][id] bytes | ... |
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mooncake_ops._validate import (
    INDEX_DTYPES,
    check_cache,
    check_compute_dtype,
    check_dim,
    check_rank,
    check_same_device,
    check_tensor,
)
from mooncake_ops.dispatch import impl
from mooncake_ops.errors import BlockTableError, OpsShapeError, OpsTypeError

__all__ = ["block_nbytes", "gather_blocks", "scatter_blocks", "write_kv"]


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Store new tokens' K and V into their cache slots (in place).

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], the cache's dtype (or any float
            dtype for an int8 cache).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], possibly strided
            views of a larger pool.
        slot_mapping: int64 (or int32) [num_tokens]; ``block_id * block_size + offset``, or a
            negative value to skip that token.
        k_scale, v_scale: float32 [num_blocks, block_size, num_kv_heads], required for int8
            caches: each token's head vector is quantised with its own scale.

    Raises:
        OpsTypeError: an argument is not a tensor (e.g. a list of slots).
        OpsShapeError, OpsDTypeError, OpsDeviceError: inconsistent arguments.
        BlockTableError: a slot beyond ``num_blocks * block_size``.
    """
    _check_write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    impl("write_kv", key.device.type)(key, value, k_cache, v_cache, slot_mapping,
                                      k_scale, v_scale)


def _check_write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    check_rank("key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    check_tensor("value", value, "shaped and typed like key")
    if value.shape != key.shape or value.dtype != key.dtype:
        raise OpsShapeError(f"value {tuple(value.shape)} {value.dtype} must match key "
                            f"{tuple(key.shape)} {key.dtype}")
    check_cache(k_cache, v_cache, k_scale, v_scale)
    check_compute_dtype("key", key, k_cache)
    if key.shape[1:] != k_cache.shape[2:]:
        raise OpsShapeError(f"key heads x head_dim {tuple(key.shape[1:])} must equal the cache's "
                            f"num_kv_heads x head_dim {tuple(k_cache.shape[2:])}")
    check_rank("slot_mapping", slot_mapping, 1, "[num_tokens]", INDEX_DTYPES[::-1])
    check_dim("slot_mapping", slot_mapping, 0, key.shape[0], "num_tokens (key.shape[0])")
    check_same_device(("key", key), ("value", value), ("k_cache", k_cache),
                      ("v_cache", v_cache), ("slot_mapping", slot_mapping),
                      ("k_scale", k_scale), ("v_scale", v_scale))


def block_nbytes(caches: Sequence[torch.Tensor]) -> int:
    """Bytes one block occupies in a `gather_blocks` staging row (all ``caches`` together)."""
    return sum(c[0].numel() * c.element_size() for c in caches)


def gather_blocks(caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack blocks ``block_ids`` of every cache into one contiguous staging buffer.

    Args:
        caches: tensors [num_blocks, ...] (e.g. K and V of every layer, int8 scales too), any
            dtypes and strides, all on one device.
        block_ids: ids to pack, in staging-row order.
        out: optional contiguous buffer of ``len(block_ids) * block_nbytes(caches)`` bytes.

    Returns:
        ``out`` or a new uint8 tensor [len(block_ids), block_nbytes(caches)].

    Raises:
        BlockTableError: an id outside a cache; OpsShapeError: ``out`` of the wrong size.
    """
    ids = _check_blocks(caches, block_ids, out, "out")
    return impl("gather_blocks", caches[0].device.type)(caches, ids, out)


def scatter_blocks(staging: torch.Tensor, caches: Sequence[torch.Tensor],
                   block_ids: Sequence[int] | torch.Tensor) -> None:
    """Inverse of `gather_blocks`: write staging row i into block ``block_ids[i]`` of each cache."""
    ids = _check_blocks(caches, block_ids, staging, "staging")
    impl("scatter_blocks", caches[0].device.type)(staging, caches, ids)


def _check_blocks(caches, block_ids, buffer, name) -> torch.Tensor:
    if isinstance(caches, torch.Tensor):
        raise OpsTypeError("caches must be a sequence of [num_blocks, ...] tensors; got one "
                           "Tensor: wrap it in a list ([k_cache, v_cache, ...])")
    if not caches:
        raise OpsShapeError("caches is empty; pass at least one [num_blocks, ...] tensor")
    for i, c in enumerate(caches):
        check_tensor(f"caches[{i}]", c, "[num_blocks, ...]")
    num_blocks = caches[0].shape[0]
    for i, c in enumerate(caches):
        if c.shape[0] != num_blocks or c.device != caches[0].device:
            raise OpsShapeError(f"caches[{i}] has {c.shape[0]} blocks on {c.device}; every "
                                f"cache needs {num_blocks} blocks on {caches[0].device}")
    ids = torch.as_tensor(block_ids, dtype=torch.long).flatten()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise BlockTableError(f"block ids must lie in [0, {num_blocks}); got "
                              f"{int(ids.min())}..{int(ids.max())}")
    if buffer is not None:
        check_tensor(name, buffer, f"contiguous, {ids.numel()} x block_nbytes(caches) bytes")
    expected = ids.numel() * block_nbytes(caches)
    if buffer is not None and (buffer.numel() * buffer.element_size() != expected
                               or not buffer.is_contiguous()):
        raise OpsShapeError(f"{name} must be contiguous with {expected} bytes "
                            f"({ids.numel()} blocks x {block_nbytes(caches)}); got "
                            f"{buffer.numel() * buffer.element_size()} bytes")
    return ids
