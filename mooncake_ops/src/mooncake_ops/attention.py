"""Paged attention: decode (one query token per sequence) and varlen prefill over the cache.

Sequence s's token t lives at ``cache[block_tables[s, t // block_size], t % block_size]``:

    block_tables[s] = [ 7 | 2 | 9 | x x x ]        (unused tail entries are arbitrary)
                        │   │   └─ tokens 2B..3B-1  (only context_lens[s] - 2B of them valid)
                        │   └───── tokens B..2B-1
                        └───────── tokens 0..B-1

GQA: query head h reads KV head ``h // (num_heads // num_kv_heads)``. Softmax runs in fp32.
Prefill, sequence s with c = cached_lens[s] and n = query_lens[s] new tokens (packed in q/k/v):

    keys = [ cached 0..c-1 (from the cache) | new 0..n-1 (from k, v) ]
    new token i attends to keys 0 .. c + i        (causal; the cache is not written here)
"""

from __future__ import annotations

import torch

from mooncake_ops._validate import (
    INDEX_DTYPES,
    check_cache,
    check_compute_dtype,
    check_dim,
    check_heads,
    check_rank,
    check_same_device,
    check_scale,
    check_tensor,
)
from mooncake_ops.dispatch import impl
from mooncake_ops.errors import OpsDTypeError, OpsShapeError

__all__ = ["paged_decode_attention", "paged_prefill_attention"]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           *, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    Args:
        q: [batch, num_heads, head_dim], float32 / bfloat16 / float16.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype or int8.
        block_tables: int32 [batch, max_blocks_per_seq].
        context_lens: int32 [batch]; tokens in the cache per sequence, the current one included
            (already written with `write_kv`). A length of 0 yields zeros.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        k_scale, v_scale: float32 [num_blocks, block_size, num_kv_heads] for int8 caches.
        out: optional contiguous buffer shaped and typed like q to write the result into.

    Returns:
        [batch, num_heads, head_dim] in q's dtype (``out`` when given).

    Raises:
        OpsTypeError: an argument is not a tensor (e.g. a list of lengths) or ``scale`` is not
            a number.
        OpsShapeError, OpsDTypeError, OpsDeviceError: inconsistent arguments.
        BlockTableError: a context longer than its block table, or a used block id outside
            the cache.
    """
    check_rank("q", q, 3, "[batch, num_heads, head_dim]")
    check_cache(k_cache, v_cache, k_scale, v_scale)
    check_compute_dtype("q", q, k_cache)
    check_heads("q", q, k_cache)
    _check_table(block_tables, q.shape[0])
    _check_lens("context_lens", context_lens, q.shape[0])
    check_scale(scale)
    if out is not None:
        _check_out(out, q)
    check_same_device(("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                      ("block_tables", block_tables), ("context_lens", context_lens),
                      ("k_scale", k_scale), ("v_scale", v_scale), ("out", out))
    return impl("paged_decode_attention", q.device.type)(
        q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, out)


def paged_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cached_lens: torch.Tensor,
                            query_lens: torch.Tensor, scale: float, *,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a packed varlen batch of new tokens over cached prefix + themselves.

    Args:
        q: [total_q, num_heads, head_dim]; k, v: [total_q, num_kv_heads, head_dim], the new
            tokens' K/V in sequence order (same dtype as q).
        k_cache, v_cache, k_scale, v_scale: as for `paged_decode_attention`.
        block_tables: int32 [batch, max_blocks] (may have 0 columns when nothing is cached).
        cached_lens: int32 [batch], tokens already in the cache (read from it).
        query_lens: int32 [batch], new tokens per sequence, summing to total_q.
        scale: softmax scale.
        out: optional contiguous buffer shaped and typed like q to write the result into.

    Returns:
        [total_q, num_heads, head_dim] in q's dtype (``out`` when given). The cache is not written (call
        `write_kv` too).

    Raises:
        OpsTypeError: an argument is not a tensor, or ``scale`` is not a number.
        OpsShapeError, OpsDTypeError, OpsDeviceError: inconsistent arguments, or query_lens
            not summing to total_q.
        BlockTableError: a cached length beyond its block table or a bad used block id.
    """
    check_rank("q", q, 3, "[total_q, num_heads, head_dim]")
    check_cache(k_cache, v_cache, k_scale, v_scale)
    check_compute_dtype("q", q, k_cache)
    check_heads("q", q, k_cache)
    _check_new_kv(q, k, v, k_cache)
    is_table = isinstance(block_tables, torch.Tensor) and block_tables.dim() == 2
    batch = block_tables.shape[0] if is_table else -1
    _check_table(block_tables, batch)
    _check_lens("cached_lens", cached_lens, batch)
    _check_lens("query_lens", query_lens, batch)
    check_scale(scale)
    if out is not None:
        _check_out(out, q)
    check_same_device(("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache),
                      ("block_tables", block_tables), ("cached_lens", cached_lens),
                      ("query_lens", query_lens), ("k_scale", k_scale), ("v_scale", v_scale),
                      ("out", out))
    return impl("paged_prefill_attention", q.device.type)(
        q, k, v, k_cache, v_cache, block_tables, cached_lens, query_lens, scale, k_scale, v_scale,
        out)


def _check_out(out, q) -> None:
    check_tensor("out", out, "shaped and typed like q")
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise OpsShapeError(f"out must be contiguous {tuple(q.shape)} {q.dtype} like q; got "
                            f"{tuple(out.shape)} {out.dtype}"
                            f"{'' if out.is_contiguous() else ' (non-contiguous)'}")


def _check_new_kv(q, k, v, k_cache) -> None:
    for name, t in (("k", k), ("v", v)):
        check_rank(name, t, 3, "[total_q, num_kv_heads, head_dim]")
        if t.dtype != q.dtype:
            raise OpsDTypeError(f"{name} is {t.dtype} but q is {q.dtype}; new K/V must be q's "
                                "dtype")
        check_dim(name, t, 0, q.shape[0], "total_q (q.shape[0])")
        if t.shape[1:] != k_cache.shape[2:]:
            raise OpsShapeError(f"{name} heads x head_dim {tuple(t.shape[1:])} must equal the "
                                f"cache's {tuple(k_cache.shape[2:])}")


def _check_table(block_tables, batch) -> None:
    check_rank("block_tables", block_tables, 2, "[batch, max_blocks_per_seq]", INDEX_DTYPES)
    check_dim("block_tables", block_tables, 0, batch, "the batch size")


def _check_lens(name, lens, batch) -> None:
    check_rank(name, lens, 1, "[batch]", INDEX_DTYPES)
    check_dim(name, lens, 0, batch, "the batch size (block_tables.shape[0])")
