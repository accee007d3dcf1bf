"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged latent cache, weights absorbed.

Each token of a layer caches one vector, ``D = kv_lora_rank + qk_rope_head_dim`` values:

    cache[block, row] = | c_kv (kv_lora_rank, after kv_a_layernorm) | k_pe (rope dim, RoPE'd) |
                        |<------------ value: first v_dim ---------->|
                        |<-------------------- key: all D ----------------------------------->|

    slot = block_id * block_size + row        (`write_latent`; a negative slot is skipped)

With W_UK absorbed into the query (the model does this), head h's query is
``q[t, h] = [q_nope[t, h] @ W_UK_h , q_pe[t, h]]`` (D values) and every head reads the same
entries: multi-query attention with K = the whole entry and V = its first ``v_dim`` values.
The model applies W_UV and o_proj to the [num_tokens, num_heads, v_dim] result.

`paged_mla_attention` takes a packed batch in `mooncake_kv.PagedBatch`'s terms, every new
token already written, so chunked prefill, prefix hits and decode are one call:

    sequence s: cached_lens[s] = c, query_lens[s] = n      (positions c .. c+n-1 are new)
    new token i of s  ──▶  keys/values at positions 0 .. c + i       (causal)

Paths, all pure PyTorch (figures: docs/mooncake_ops.md, "MLA attention"):

* `paged_mla_attention_reference`: per sequence, gathered entries in fp32, masked softmax.
* `paged_mla_attention` ("batched-decode" in `CANDIDATES`): two matmuls in the compute dtype
  with an fp32 softmax between them (scores are rounded to the compute dtype before the
  softmax, as transformers' eager attention rounds them). Decode sequences with short
  contexts run in padded groups, one batched matmul each (`_decode_groups`); every other
  sequence gathers its blocks once and runs on its own, long prefill chunks in slices of
  query rows (`_SCORE_ELEMENTS`).
* "per-sequence" (every sequence alone) and "sdpa" (torch's SDPA per sequence, which takes
  a V narrower than K but ran 1.1-4x slower here): the candidates it was chosen over by the
  benchmark (`python -m mooncake_ops.mla_bench`, JSON lines). The parity tests run all three.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mooncake_ops._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dim,
    check_lengths,
    check_rank,
    check_same_device,
    check_scale,
)
from mooncake_ops.errors import BlockTableError, OpsDTypeError, OpsShapeError, OpsTypeError

__all__ = ["paged_mla_attention", "paged_mla_attention_reference", "write_latent"]

_CACHE_LAYOUT = "[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]"
# A prefill chunk's scores are computed for at most this many (query row x key) elements at
# once (64 MiB in fp32): 4,096 new tokens over 4,096 keys with 16 heads would otherwise need 1 GiB.
_SCORE_ELEMENTS = 1 << 24


# ---- cache writes ------------------------------------------------------------------------------
def write_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new tokens' latent entries ``[c_kv | k_pe]`` into their cache slots (in place).

    Args:
        latent: [num_tokens, D], the cache's dtype (float32 / bfloat16 / float16).
        cache: [num_blocks, block_size, D], one layer's latent cache; a strided view of a
            larger pool is fine.
        slot_mapping: int64 (or int32) [num_tokens]; ``block_id * block_size + offset``, or a
            negative value to skip that token.

    Raises:
        OpsTypeError: an argument is not a tensor.
        OpsShapeError, OpsDTypeError, OpsDeviceError: inconsistent arguments.
        BlockTableError: a slot beyond ``num_blocks * block_size``.
    """
    check_rank("latent", latent, 2, "[num_tokens, kv_lora_rank + qk_rope_head_dim]",
               FLOAT_DTYPES)
    _check_cache(cache, "latent", latent)
    check_dim("latent", latent, 1, cache.shape[2], "the cache's entry size (cache.shape[2])")
    check_rank("slot_mapping", slot_mapping, 1, "[num_tokens]", INDEX_DTYPES[::-1])
    check_dim("slot_mapping", slot_mapping, 0, latent.shape[0], "num_tokens (latent.shape[0])")
    check_same_device(("latent", latent), ("cache", cache), ("slot_mapping", slot_mapping))
    block_size, slots = cache.shape[1], slot_mapping.long()
    num_slots = cache.shape[0] * block_size
    if slots.numel() and int(slots.max()) >= num_slots:
        raise BlockTableError(f"slot_mapping holds slot {int(slots.max())} but the cache has "
                              f"only {num_slots} slots (num_blocks x block_size)")
    keep = slots >= 0
    if not bool(keep.all()):
        latent, slots = latent[keep], slots[keep]
    cache[slots // block_size, slots % block_size] = latent


def _check_cache(cache: torch.Tensor, name: str, t: torch.Tensor) -> None:
    check_rank("cache", cache, 3, _CACHE_LAYOUT, FLOAT_DTYPES)
    if cache.dtype != t.dtype:
        raise OpsDTypeError(f"{name} is {t.dtype} but the cache is {cache.dtype}; the latent "
                            "cache holds the compute dtype (no int8 MLA cache)")


# ---- attention: public entry points ----------------------------------------------------------
def paged_mla_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                        cached_lens: torch.Tensor, query_lens: torch.Tensor, scale: float,
                        v_dim: int) -> torch.Tensor:
    """Causal MLA attention (weights absorbed) of a packed batch over its paged latent cache.

    Args:
        q: [num_tokens, num_heads, D], the absorbed queries ``[q_nope @ W_UK | q_pe]`` of the
            new tokens, sequence after sequence; the cache's dtype.
        cache: [num_blocks, block_size, D], every new token's entry already written
            (`write_latent`).
        block_tables: int32 / int64 [batch, max_blocks]; unused tail entries are never read.
        cached_lens: int32 / int64 [batch], tokens of each sequence cached before this step.
        query_lens: int32 / int64 [batch], new tokens per sequence, summing to num_tokens
            (decode: all 1).
        scale: softmax scale (DeepSeek: ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``,
            times the YaRN mscale squared when set).
        v_dim: values per head read from each entry's start (``kv_lora_rank``), 1..D.

    Returns:
        [num_tokens, num_heads, v_dim] in q's dtype: per head the softmax-weighted sum of the
        visible entries' first ``v_dim`` values (apply W_UV next).

    Raises:
        OpsTypeError: an argument is not a tensor, ``scale`` not a number, ``v_dim`` not an int.
        OpsShapeError, OpsDTypeError, OpsDeviceError: inconsistent arguments, or query_lens
            not summing to num_tokens.
        BlockTableError: a sequence longer than its block table, a used block id outside the
            cache, or a negative length.
    """
    lens = _check_attention(q, cache, block_tables, cached_lens, query_lens, scale, v_dim)
    return _batched_path(q, cache, block_tables, lens, scale, v_dim)


def paged_mla_attention_reference(q: torch.Tensor, cache: torch.Tensor,
                                  block_tables: torch.Tensor, cached_lens: torch.Tensor,
                                  query_lens: torch.Tensor, scale: float,
                                  v_dim: int) -> torch.Tensor:
    """`paged_mla_attention` restated plainly (per sequence, fp32, explicit masked softmax):
    what the parity tests hold the fast path to. Same arguments, result and errors."""
    lens = _check_attention(q, cache, block_tables, cached_lens, query_lens, scale, v_dim)
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    for seq, start, num_cached, num_new in lens:
        entries = _entries(cache, block_tables, seq, num_cached + num_new).float()
        scores = torch.einsum("nhd,td->nht", q[start:start + num_new].float(), entries) * scale
        position = num_cached + torch.arange(num_new, device=q.device)
        hidden = torch.arange(entries.shape[0], device=q.device) > position[:, None]
        scores.masked_fill_(hidden[:, None, :], -math.inf)
        probs = torch.softmax(scores, dim=-1)
        out[start:start + num_new] = torch.einsum("nht,tv->nhv", probs, entries[:, :v_dim])
    return out


# ---- validation ------------------------------------------------------------------------------
Lens = list[tuple[int, int, int, int]]  # (sequence, first packed row, cached, new), new > 0


def _check_attention(q, cache, block_tables, cached_lens, query_lens, scale, v_dim) -> Lens:
    """Metadata checks, then the value checks (lengths vs tables); the sequences to run."""
    check_rank("q", q, 3, "[num_tokens, num_heads, kv_lora_rank + qk_rope_head_dim]",
               FLOAT_DTYPES)
    _check_cache(cache, "q", q)
    check_dim("q", q, 2, cache.shape[2], "the cache's entry size (cache.shape[2])")
    check_rank("block_tables", block_tables, 2, "[batch, max_blocks_per_seq]", INDEX_DTYPES)
    batch = block_tables.shape[0]
    for name, lens in (("cached_lens", cached_lens), ("query_lens", query_lens)):
        check_rank(name, lens, 1, "[batch]", INDEX_DTYPES)
        check_dim(name, lens, 0, batch, "the batch size (block_tables.shape[0])")
    check_scale(scale)
    if not isinstance(v_dim, int) or isinstance(v_dim, bool):
        raise OpsTypeError(f"v_dim must be a Python int (kv_lora_rank); got "
                           f"{type(v_dim).__name__} {v_dim!r}")
    if not 0 < v_dim <= cache.shape[2]:
        raise OpsShapeError(f"v_dim {v_dim} must lie in 1..{cache.shape[2]} (the entry size "
                            "D = kv_lora_rank + qk_rope_head_dim); pass kv_lora_rank")
    check_same_device(("q", q), ("cache", cache), ("block_tables", block_tables),
                      ("cached_lens", cached_lens), ("query_lens", query_lens))
    return _sequences(q, cache, block_tables, cached_lens, query_lens)


def _sequences(q, cache, block_tables, cached_lens, query_lens) -> Lens:
    queries = query_lens.tolist()
    if any(n < 0 for n in queries) or sum(queries) != q.shape[0]:
        raise OpsShapeError(f"query_lens {queries} must be >= 0 and sum to num_tokens = "
                            f"{q.shape[0]} (q.shape[0], the packed new tokens)")
    if bool((cached_lens < 0).any()):
        raise BlockTableError(f"cached_lens has a negative entry ({int(cached_lens.min())}); "
                              "lengths must be >= 0")
    check_lengths("context (cached_lens + query_lens)", cached_lens.long() + query_lens.long(),
                  block_tables, cache.shape[1], cache.shape[0])
    found, start = [], 0
    for seq, (num_cached, num_new) in enumerate(zip(cached_lens.tolist(), queries, strict=True)):
        if num_new:
            found.append((seq, start, num_cached, num_new))
        start += num_new
    return found


def _entries(cache: torch.Tensor, block_tables: torch.Tensor, seq: int,
             length: int) -> torch.Tensor:
    """Entries 0..length-1 of sequence ``seq``, gathered: [length, D] in the cache's dtype."""
    ids = block_tables[seq, :math.ceil(length / cache.shape[1])].long()
    return cache.index_select(0, ids).flatten(0, 1)[:length]


# ---- fast path and the candidates it was chosen over -------------------------------------------
Path = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Lens, float, int], torch.Tensor]


def _batched_path(q, cache, block_tables, lens, scale, v_dim) -> torch.Tensor:
    """Decode sequences (one new token) in groups of similar context, each group one padded
    batched matmul for scores and one for values; every other sequence on its own
    (`_sequence_matmul`). Both compute in q's dtype with an fp32 softmax."""
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    for group in _decode_groups([item for item in lens if item[3] == 1]):
        if len(group) > 1:
            _decode_group(q, cache, block_tables, group, scale, v_dim, out)
        else:  # the same arithmetic without the padding and index bookkeeping
            _sequence_matmul(q, cache, block_tables, group[0], scale, v_dim, out)
    for item in lens:
        if item[3] > 1:
            _sequence_matmul(q, cache, block_tables, item, scale, v_dim, out)
    return out


# Decode sequences of at most _BATCH_CONTEXT keys run in groups whose contexts are all at least
# _GROUP_FILL of the group's longest (the padded batch does at most 1 / _GROUP_FILL times the
# work of the sequences alone), at most _GROUP_KEYS padded keys per group. Batching saves the
# ~0.1 ms of calls per sequence, which matters at short contexts only: 32 x 128 keys ran in
# 4.4 ms grouped vs 8.3 ms one by one, 8 x 512 in 4.0 vs 3.7 ms (bf16, caches flushed, one
# thread, Zen 4). Longer contexts run alone: a sequence's gathered entries then stay in L2.
_BATCH_CONTEXT = 256
_GROUP_FILL = 0.75
_GROUP_KEYS = 2048


def _decode_groups(decode: Lens) -> list[Lens]:
    """``decode`` sorted by context, longest first, cut where a context drops below
    `_GROUP_FILL` of its group's longest or the group would pass `_GROUP_KEYS` padded keys;
    a context above `_BATCH_CONTEXT` is a group of its own."""
    groups: list[Lens] = []
    for item in sorted(decode, key=lambda it: it[2], reverse=True):
        longest = groups[-1][0][2] + 1 if groups else _BATCH_CONTEXT + 1
        if (longest <= _BATCH_CONTEXT and item[2] + 1 >= _GROUP_FILL * longest
                and (len(groups[-1]) + 1) * longest <= _GROUP_KEYS):
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


def _decode_group(q, cache, block_tables, group, scale, v_dim, out) -> None:
    """One new token per sequence of ``group``, padded to its longest context:

    entries [g, cols * block_size, D] ◀── index_select of each sequence's used blocks
    scores  [g, heads, keys] = q[rows] @ entries^T      (keys past a context: -inf)
    out[rows] = softmax(scores) @ entries[..., :v_dim]
    """
    device, block_size = q.device, cache.shape[1]
    seqs = torch.tensor([it[0] for it in group], device=device)
    rows = torch.tensor([it[1] for it in group], device=device)
    context = torch.tensor([it[2] + 1 for it in group], device=device)
    num_cols = math.ceil((group[0][2] + 1) / block_size)  # group[0]: the longest context
    cols = torch.arange(num_cols, device=device)
    ids = torch.where(cols * block_size < context[:, None],
                      block_tables.index_select(0, seqs)[:, :num_cols].long(), 0)
    entries = cache.index_select(0, ids.flatten()).view(len(group), -1, cache.shape[2])
    hidden = torch.arange(entries.shape[1], device=device) >= context[:, None]
    if bool(hidden.any()):
        entries[hidden] = 0  # rows past a context may hold anything, NaN included
    scores = torch.bmm(q.index_select(0, rows), entries.transpose(1, 2)).float().mul_(scale)
    scores.masked_fill_(hidden[:, None, :], -math.inf)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out.index_copy_(0, rows, torch.bmm(probs, entries[..., :v_dim]))


def _sequence_matmul(q, cache, block_tables, item, scale, v_dim, out) -> None:
    """One sequence: its entries gathered once, then slices of its new tokens (the score
    matrix under `_SCORE_ELEMENTS`), each two matmuls in q's dtype with an fp32 softmax."""
    seq, start, num_cached, num_new = item
    num_heads = q.shape[1]
    entries = _entries(cache, block_tables, seq, num_cached + num_new)
    keys_t, values = entries.t(), entries[:, :v_dim]
    step = max(1, _SCORE_ELEMENTS // (num_heads * entries.shape[0]))
    for first in range(0, num_new, step):
        count = min(num_new, first + step) - first
        rows = slice(start + first, start + first + count)
        scores = (q[rows].reshape(count * num_heads, -1) @ keys_t).float().mul_(scale)
        if num_new > 1:  # new token i sees positions <= num_cached + i
            _mask_future(scores.view(count, num_heads, -1), num_cached + first)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[rows] = (probs @ values).view(count, num_heads, v_dim)


def _mask_future(scores: torch.Tensor, first_position: int) -> None:
    """scores [rows, heads, keys]: row r (position first_position + r) sees keys <= it."""
    position = first_position + torch.arange(scores.shape[0], device=scores.device)
    hidden = torch.arange(scores.shape[2], device=scores.device) > position[:, None]
    scores.masked_fill_(hidden[:, None, :], -math.inf)


def _per_sequence_path(q, cache, block_tables, lens, scale, v_dim) -> torch.Tensor:
    """Every sequence on its own (`_sequence_matmul`), decode ones too."""
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    for item in lens:
        _sequence_matmul(q, cache, block_tables, item, scale, v_dim, out)
    return out


def _sdpa_path(q, cache, block_tables, lens, scale, v_dim) -> torch.Tensor:
    """Per sequence: torch's SDPA, the heads folded into the query rows (one KV head), V a
    slice of K (SDPA takes Ev != E)."""
    num_heads = q.shape[1]
    out = q.new_empty(q.shape[0], num_heads, v_dim)
    for seq, start, num_cached, num_new in lens:
        entries = _entries(cache, block_tables, seq, num_cached + num_new)[None, None]
        mask = None
        if num_new > 1:
            position = num_cached + torch.arange(num_new, device=q.device)
            mask = torch.arange(entries.shape[2], device=q.device) <= position[:, None]
            mask = mask.repeat_interleave(num_heads, dim=0)
        rows = q[start:start + num_new].reshape(1, 1, num_new * num_heads, -1)
        result = F.scaled_dot_product_attention(rows, entries, entries[..., :v_dim],
                                                attn_mask=mask, scale=scale)
        out[start:start + num_new] = result.view(num_new, num_heads, v_dim)
    return out


# name -> path over checked arguments; `paged_mla_attention` runs "batched-decode" (chosen by
# the benchmark, mooncake_ops.mla_bench, which times them all; the parity tests run every one)
CANDIDATES: dict[str, Path] = {"batched-decode": _batched_path,
                               "per-sequence": _per_sequence_path, "sdpa": _sdpa_path}
