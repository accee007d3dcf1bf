"""Attention through ``torch.nn.functional.scaled_dot_product_attention`` (CUDA, CPU prefill).

The paged K/V are first gathered into contiguous per-sequence tensors (dequantised for int8),
then SDPA runs in q's dtype with GQA (``enable_gqa``); its fused kernels keep the softmax in fp32.

CPU prefill (`paged_prefill_attention_cpu`) passes no mask and makes few calls: sequences with
the same (cached, new) lengths run as one batch, and each batch is split into two calls of the
flash CPU kernel, which also returns the log-sum-exp per row:

    new token i ─┬─ cached keys 0..c-1   (no mask; the GQA group folded into the query rows)
                 └─ new keys 0..i        (square causal, ``is_causal=True``)
    out = lerp(o_new, o_cached, sigmoid(lse_cached - lse_new))     (the softmax-weighted merge)

The cached half is a parameter (``cached_attention``): by default the cached tokens are gathered
(int8 dequantised) and run through the flash kernel; the native backend passes a kernel that
reads the paged int8 blocks in place instead.
"""

from __future__ import annotations

import itertools
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


def paged_prefill_attention_cpu(q, k, v, k_cache, v_cache, block_tables, cached_lens, query_lens,
                                scale, k_scale=None, v_scale=None, out=None, *,
                                cached_attention=None) -> torch.Tensor:
    """The CPU prefill path: batched by (cached, new) lengths, flash kernel, LSE merge.

    ``cached_attention(queries, k_cache, v_cache, k_scale, v_scale, ids, num_cached, scale)``
    computes the cached half (see `flash_cached`, the default)."""
    if _FLASH_CPU is None:  # a torch without the op: the per-sequence SDPA path
        return paged_prefill_attention(q, k, v, k_cache, v_cache, block_tables, cached_lens,
                                       query_lens, scale, k_scale, v_scale, out)
    cached, queries = ref.prefill_lens(q, block_tables, cached_lens, query_lens, k_cache)
    out = torch.empty_like(q) if out is None else out
    starts = list(itertools.accumulate(queries, initial=0))
    groups: dict[tuple[int, int], list[int]] = {}
    for seq, lengths in enumerate(zip(cached, queries, strict=True)):
        if lengths[1]:
            groups.setdefault(lengths, []).append(seq)
    for (num_cached, num_new), seqs in groups.items():
        if seqs[-1] - seqs[0] == len(seqs) - 1:  # consecutive sequences: one slice of rows
            rows: slice | torch.Tensor = slice(starts[seqs[0]], starts[seqs[-1]] + num_new)
        else:
            rows = torch.cat([torch.arange(starts[s], starts[s] + num_new) for s in seqs])
        shape = (len(seqs), num_new)
        result = _uniform_batch(q[rows].reshape(*shape, *q.shape[1:]),
                                k[rows].reshape(*shape, *k.shape[1:]),
                                v[rows].reshape(*shape, *v.shape[1:]), seqs, num_cached, k_cache,
                                v_cache, block_tables, scale, k_scale, v_scale,
                                cached_attention or flash_cached)
        out[rows] = result.flatten(0, 1).to(out.dtype)
    return out


def _flash(q, k, v, causal, scale):
    """(out [b, h, n, d] in q's dtype, logsumexp [b, h, n] fp32) of the flash CPU kernel."""
    return _FLASH_CPU(q, k, v, 0.0, causal, scale=scale)


def _uniform_batch(q, k_new, v_new, seqs, num_cached, k_cache, v_cache, block_tables, scale,
                   k_scale, v_scale, cached_attention) -> torch.Tensor:
    """Sequences ``seqs`` that all have ``num_cached`` cached and q.shape[1] new tokens.

    q [b, n, H, D], k_new / v_new [b, n, KVH, D]; returns [b, n, H, D]."""
    batch, num_new, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[2]
    group = num_heads // num_kv_heads
    # the kernel reads KV head h // group for query head h itself (GQA)
    o_new, lse_new = _flash(q.transpose(1, 2), k_new.transpose(1, 2), v_new.transpose(1, 2),
                            True, scale)
    if num_cached == 0:
        return o_new.transpose(1, 2)
    cols = math.ceil(num_cached / k_cache.shape[1])
    ids = block_tables[seqs, :cols].long()  # only the columns the cached tokens occupy
    # Every query head of a GQA group reads the same KV head: fold the group into the query
    # rows. Sequences whose cached blocks are the same ones (a shared prompt prefix) read the
    # same keys: gather them once and fold the sequences into the rows too.
    shared = batch > 1 and bool((ids == ids[:1]).all())
    if shared:
        ids = ids[:1]
    split = q.reshape(batch, num_new, num_kv_heads, group, head_dim)
    order = (2, 0, 3, 1, 4) if shared else (0, 2, 3, 1, 4)  # [(1|b), kvh, (b|1) g n, d]
    queries = split.permute(order).reshape(ids.shape[0], num_kv_heads, -1, head_dim)
    o_cached, lse_cached = cached_attention(queries, k_cache, v_cache, k_scale, v_scale, ids,
                                            num_cached, scale)
    if shared:  # [1, kvh, b g n, ...] -> [b, kvh g, n, ...]
        o_cached = o_cached.reshape(num_kv_heads, batch, group * num_new, head_dim).transpose(0, 1)
        lse_cached = lse_cached.reshape(num_kv_heads, batch, group * num_new).transpose(0, 1)
    o_cached = o_cached.reshape(batch, num_heads, num_new, head_dim)
    weight = torch.sigmoid(lse_cached.reshape(batch, num_heads, num_new) - lse_new)[..., None]
    return torch.lerp(o_new.float(), o_cached.float(), weight).transpose(1, 2)


def flash_cached(queries, k_cache, v_cache, k_scale, v_scale, ids, num_cached, scale,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [rows, kvh, r, d], lse [rows, kvh, r]) of ``queries`` [rows, kvh, r, d] over the
    first ``num_cached`` tokens of blocks ``ids`` [rows, cols] (no mask): gathered, flash."""
    keys = _cached_tokens(k_cache, k_scale, ids, num_cached, queries.dtype).transpose(1, 2)
    values = _cached_tokens(v_cache, v_scale, ids, num_cached, queries.dtype).transpose(1, 2)
    return _flash(queries, keys, values, False, scale)


def _cached_tokens(cache, scale, ids, num_cached, dtype) -> torch.Tensor:
    """The first ``num_cached`` tokens of blocks ``ids`` [b, cols]: [b, num_cached, KVH, D]."""
    if scale is not None:
        return ref.gather_tokens(cache, scale, ids)[:, :num_cached].to(dtype)
    return cache[ids].flatten(1, 2)[:, :num_cached]


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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
    # 4-D [1, heads, tokens, dim]: SDPA sends 3-D inputs to its unfused math path
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
