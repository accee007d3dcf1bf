"""Pure-PyTorch reference implementations of every op: short, fp32 math, any device.

These are what the parity tests hold the native and fused paths to, and what runs when nothing
faster is available. Arguments are already validated by the public wrappers (metadata only);
the checks that need values (lengths vs block tables, slot ranges) are made here.

Paged cache, as every op here reads it:

    block_tables[s] = [7, 2, 9, ...]          token t of sequence s lives in
    k_cache[7] = tokens 0..B-1                 block block_tables[s, t // B], row t % B
    k_cache[2] = tokens B..2B-1                (B = block_size)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mooncake_ops._validate import check_lengths
from mooncake_ops.errors import BlockTableError, OpsShapeError
from mooncake_ops.quant import quantize_int8, unpack_int8_rows


# ---- KV cache writes and block copies -------------------------------------------------------
def write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    block_size = k_cache.shape[1]
    slots = _valid_slots(slot_mapping, k_cache.shape[0] * block_size)
    keep = slots >= 0
    if not bool(keep.all()):
        key, value, slots = key[keep], value[keep], slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    for src, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        if scale is None:
            cache[blocks, offsets] = src
        else:
            q, s = quantize_int8(src)
            cache[blocks, offsets] = q
            scale[blocks, offsets] = s


def _valid_slots(slot_mapping: torch.Tensor, num_slots: int) -> torch.Tensor:
    slots = slot_mapping.long()
    if slots.numel() and int(slots.max()) >= num_slots:
        raise BlockTableError(f"slot_mapping holds slot {int(slots.max())} but the cache has "
                              f"only {num_slots} slots (num_blocks x block_size)")
    return slots


def gather_blocks(caches, block_ids, out=None) -> torch.Tensor:
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=caches[0].device)
    parts = [c.index_select(0, ids).reshape(len(ids), -1).view(torch.uint8) for c in caches]
    if out is None:
        return torch.cat(parts, dim=1)
    torch.cat(parts, dim=1, out=out.view(torch.uint8).view(len(ids), -1))
    return out


def scatter_blocks(staging, caches, block_ids) -> None:
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=caches[0].device)
    rows = staging.view(torch.uint8).view(len(ids), -1)
    offset = 0
    for c in caches:
        nbytes = c[0].numel() * c.element_size()
        part = rows[:, offset:offset + nbytes].contiguous().view(c.dtype)
        c.index_copy_(0, ids, part.view(len(ids), *c.shape[1:]))
        offset += nbytes


# ---- attention ------------------------------------------------------------------------------
def gather_tokens(cache: torch.Tensor, scale: torch.Tensor | None,
                  block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``block_ids`` [..., n] of ``cache`` as fp32 tokens [..., n * block_size, H, D]."""
    x = cache[block_ids].float()
    if scale is not None:
        x = x * scale[block_ids][..., None]
    return x.flatten(-4, -3)


def used_block_ids(block_tables: torch.Tensor, lens: torch.Tensor, num_cols: int,
                   block_size: int) -> torch.Tensor:
    """The first ``num_cols`` columns as int64, entries past each sequence's length set to 0
    (unused table entries are arbitrary and must not be dereferenced)."""
    cols = torch.arange(num_cols, device=block_tables.device)
    used = cols * block_size < lens[:, None]
    return torch.where(used, block_tables[:, :num_cols].long(), 0)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                           k_scale=None, v_scale=None, out=None) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = check_lengths("context_lens", context_lens, block_tables, block_size,
                            k_cache.shape[0])
    num_cols = max(1, math.ceil(max_len / block_size))
    if batch == 0 or block_tables.shape[1] == 0:
        return into(out, torch.zeros_like(q))
    ids = used_block_ids(block_tables, context_lens, min(num_cols, block_tables.shape[1]),
                         block_size)
    k, v = (gather_tokens(c, s, ids) for c, s in ((k_cache, k_scale), (v_cache, v_scale)))
    masked = torch.arange(k.shape[1], device=q.device) >= context_lens[:, None]
    v.masked_fill_(masked[:, :, None, None], 0.0)  # rows past the context may hold anything
    qg = q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k) * scale
    scores.masked_fill_(masked[:, None, None, :], -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # context 0 -> zeros
    result = torch.einsum("bhgt,bthd->bhgd", probs, v).reshape(batch, num_heads, head_dim)
    return into(out, result.to(q.dtype))


def into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """``result``, copied into ``out`` when the caller gave a buffer."""
    return result if out is None else out.copy_(result)


def prefill_lens(q, block_tables, cached_lens, query_lens, k_cache) -> tuple[list[int], list[int]]:
    """Value checks shared by the prefill paths; returns (cached, query) lengths as lists."""
    check_lengths("cached_lens", cached_lens, block_tables, k_cache.shape[1], k_cache.shape[0])
    queries = query_lens.tolist()
    if any(n < 0 for n in queries) or sum(queries) != q.shape[0]:
        raise OpsShapeError(f"query_lens {queries} must be >= 0 and sum to total_q = "
                            f"{q.shape[0]} (the packed q/k/v length)")
    return cached_lens.tolist(), queries


def paged_prefill_attention(q, k, v, k_cache, v_cache, block_tables, cached_lens, query_lens,
                            scale, k_scale=None, v_scale=None, out=None) -> torch.Tensor:
    cached, queries = prefill_lens(q, block_tables, cached_lens, query_lens, k_cache)
    out = torch.empty_like(q) if out is None else out
    start = 0
    for seq, (num_cached, num_new) in enumerate(zip(cached, queries, strict=True)):
        end = start + num_new
        if num_new:
            keys, values = cached_and_new(seq, num_cached, k[start:end], v[start:end], k_cache,
                                          v_cache, block_tables, k_scale, v_scale)
            out[start:end] = _causal(q[start:end], keys, values, num_cached, scale)
        start = end
    return out


def cached_and_new(seq, num_cached, k_new, v_new, k_cache, v_cache, block_tables, k_scale,
                   v_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 K and V of one sequence: its ``num_cached`` cached tokens, then the new ones."""
    if num_cached == 0:
        return k_new.float(), v_new.float()
    ids = block_tables[seq, :math.ceil(num_cached / k_cache.shape[1])].long()
    k = gather_tokens(k_cache, k_scale, ids)[:num_cached]
    v = gather_tokens(v_cache, v_scale, ids)[:num_cached]
    return torch.cat([k, k_new.float()]), torch.cat([v, v_new.float()])


def _causal(q, keys, values, num_cached, scale) -> torch.Tensor:
    """Query i (absolute position num_cached + i) sees keys 0..num_cached + i."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    qg = q.float().view(num_q, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("qhgd,thd->hgqt", qg, keys) * scale
    rows = torch.arange(num_q, device=q.device)[:, None] + num_cached
    masked = torch.arange(keys.shape[0], device=q.device)[None, :] > rows
    scores.masked_fill_(masked, -math.inf)
    out = torch.einsum("hgqt,thd->qhgd", torch.softmax(scores, dim=-1), values)
    return out.reshape(num_q, num_heads, head_dim).to(q.dtype)


# ---- layer ops ------------------------------------------------------------------------------
def rms_norm(x, weight, eps, residual=None):
    if residual is not None:
        residual = (x.float() + residual.float()).to(x.dtype)
        x_in = residual
    else:
        x_in = x
    xf = x_in.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return out if residual is None else (out, residual)


def rotary_embedding(positions, q, k, cos_sin_cache, is_neox=True):
    try:
        cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [t, rot/2] each
    except IndexError:
        raise BlockTableError(f"positions must lie in [0, {cos_sin_cache.shape[0]}) (the rope "
                              f"cache length); got max {int(positions.max())}") from None
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)


def _rotate(x, cos, sin, is_neox):
    rot = cos.shape[-1] * 2
    xr = x[..., :rot].float()
    if is_neox:
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:  # GPT-J style: pairs (2i, 2i+1)
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    if rot == x.shape[-1]:
        return out.to(x.dtype)
    return torch.cat([out.to(x.dtype), x[..., rot:]], dim=-1)


def silu_and_mul(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


# ---- weight-only int8 linear ------------------------------------------------------------------
def int8_linear(x, weight, bias=None):
    """``x @ (q * scale)^T + bias`` in fp32, in x's dtype; weight: int8 [N, K + 4] (each row K
    values, then its float32 scale's 4 bytes: see mooncake_ops.linear)."""
    q, scale = unpack_int8_rows(weight)
    dense = q.float() * scale
    return F.linear(x.float(), dense, None if bias is None else bias.float()).to(x.dtype)
