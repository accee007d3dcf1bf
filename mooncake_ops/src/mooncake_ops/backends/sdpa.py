"""Attention through ``torch.nn.functional.scaled_dot_product_attention`` (CUDA, CPU prefill).

The paged K/V are first gathered into contiguous per-sequence tensors (dequantised for int8),
then SDPA runs in q's dtype with GQA (``enable_gqa``); its fused kernels keep the softmax in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mooncake_ops._validate import check_lengths
from mooncake_ops.backends import reference as ref


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                           k_scale=None, v_scale=None, out=None) -> torch.Tensor:
    block_size = k_cache.shape[1]
    max_len = check_lengths("context_lens", context_lens, block_tables, block_size,
                            k_cache.shape[0])
    if q.shape[0] == 0 or max_len == 0:
        return ref.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                          k_scale, v_scale, out)
    ids = ref.used_block_ids(block_tables, context_lens, math.ceil(max_len / block_size),
                             block_size)
    visible = torch.arange(ids.shape[1] * block_size, device=q.device) < context_lens[:, None]
    hidden = ~visible[:, :, None, None]  # rows past the context may hold anything, even NaN
    k = _tokens(k_cache, k_scale, ids, q.dtype).masked_fill_(hidden, 0).transpose(1, 2)
    v = _tokens(v_cache, v_scale, ids, q.dtype).masked_fill_(hidden, 0).transpose(1, 2)
    result = F.scaled_dot_product_attention(q[:, :, None, :], k, v,
                                            attn_mask=visible[:, None, None], scale=scale,
                                            enable_gqa=True)[:, :, 0, :]
    empty = context_lens == 0  # SDPA gives NaN for a fully masked row; the contract is zeros
    if bool(empty.any()):
        result = result.masked_fill(empty[:, None, None], 0.0)
    return ref.into(out, result)


def _tokens(cache, scale, ids, dtype) -> torch.Tensor:
    if scale is not None:
        return ref.gather_tokens(cache, scale, ids).to(dtype)
    return cache[ids].flatten(1, 2)


def paged_prefill_attention(q, k, v, k_cache, v_cache, block_tables, cached_lens, query_lens,
                            scale, k_scale=None, v_scale=None, out=None) -> torch.Tensor:
    cached, queries = ref.prefill_lens(q, block_tables, cached_lens, query_lens, k_cache)
    out = torch.empty_like(q) if out is None else out
    start = 0
    for seq, (num_cached, num_new) in enumerate(zip(cached, queries, strict=True)):
        end = start + num_new
        if num_new:
            out[start:end] = _sequence(seq, num_cached, q[start:end], k[start:end], v[start:end],
                                       k_cache, v_cache, block_tables, scale, k_scale, v_scale)
        start = end
    return out


def _sequence(seq, num_cached, q, k_new, v_new, k_cache, v_cache, block_tables, scale, k_scale,
              v_scale) -> torch.Tensor:
    if num_cached == 0:
        keys, values, mask = k_new, v_new, None
    else:
        keys, values = ref.cached_and_new(seq, num_cached, k_new, v_new, k_cache, v_cache,
                                          block_tables, k_scale, v_scale)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        rows = torch.arange(q.shape[0], device=q.device)[:, None] + num_cached
        mask = torch.arange(keys.shape[0], device=q.device)[None, :] <= rows
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1),
                                         values.transpose(0, 1), attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
