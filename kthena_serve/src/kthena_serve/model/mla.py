"""`MLAttention`: DeepSeek-V2/V3's multi-head latent attention over a paged latent cache.

Per token (``MLAConfig`` names the widths)::

    q      = q_b(norm(q_a(x)))  or  q_proj(x)          [heads, nope + rope]   (this rank's heads)
    latent = kv_a(x) = [c_kv | k_pe]                   [kv_lora_rank + rope]  (every rank: whole)
    c_kv   = norm(c_kv);  q_pe, k_pe = RoPE(q_pe, k_pe)
    cache  <- [c_kv | k_pe]                            one vector per token and layer

Attention runs with kv_b's key half absorbed into the query (DeepSeek's decode form): head h's
query becomes ``[q_nope_h @ W_UK_h | q_pe_h]``, every head attends to the cached vectors
themselves (`mooncake_ops.paged_mla_attention`: K = the whole vector, V = c_kv), and the value
half ``W_UV_h`` maps the result back, before o_proj. This is the same sum as expanding each
cached latent into per-head keys and values, in another order, and it never materialises
them, so prefill chunks, prefix hits and decode all read the latent cache alone.

TP splits the heads (q_b / q_proj rows, kv_b rows, o_proj columns); q_a, kv_a and their norms
are replicated, so every rank caches the same latent and one all-reduce sums o_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kthena_serve.model.config import ModelConfig
from kthena_serve.model.tp import ShardPlan, TensorParallel
from mooncake_kv.paged import PagedBatch
from mooncake_ops import paged_mla_attention, rms_norm, rotary_embedding, write_latent


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class MLAttention(nn.Module):
    """Latent attention of one layer, for this rank's heads (see the module docs)."""

    def __init__(self, config: ModelConfig, plan: ShardPlan, tp: TensorParallel) -> None:
        super().__init__()
        mla, hidden = config.mla, config.shape.hidden_size
        assert mla is not None
        self.mla, self.eps, self.tp = mla, config.rms_norm_eps, tp
        self.num_heads = len(plan.q_heads)
        q_out = self.num_heads * mla.qk_head_dim
        if mla.q_lora_rank:
            self.q_a_weight = _empty(mla.q_lora_rank, hidden)
            self.q_a_norm = _empty(mla.q_lora_rank)
            self.q_b_weight = _empty(q_out, mla.q_lora_rank)
        else:
            self.q_weight = _empty(q_out, hidden)
        self.kv_a_weight = _empty(mla.latent_dim, hidden)
        self.kv_a_norm = _empty(mla.kv_lora_rank)
        self.kv_b_weight = _empty(self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                  mla.kv_lora_rank)
        self.o_weight = _empty(hidden, self.num_heads * mla.v_head_dim)
        self.matmul = F.linear  # replaced by a packed kernel on CPU (the model's packing)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank:
            q = rms_norm(self.matmul(x, self.q_a_weight), self.q_a_norm, self.eps)
            return self.matmul(q, self.q_b_weight)
        return self.matmul(x, self.q_weight)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: PagedBatch,
                kv_cache: tuple[torch.Tensor, ...], rope: torch.Tensor,
                context_lens: torch.Tensor | None, shards: object = None) -> torch.Tensor:
        mla, tokens, heads = self.mla, positions.shape[0], self.num_heads
        q = self._query(x).view(tokens, heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.matmul(x, self.kv_a_weight).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        c_kv = rms_norm(c_kv.contiguous(), self.kv_a_norm, self.eps)
        q_pe, k_pe = rotary_embedding(positions, q_pe.contiguous(),
                                      k_pe.reshape(tokens, 1, mla.qk_rope_head_dim), rope,
                                      is_neox=mla.rope_is_neox)
        cache = kv_cache[0].flatten(2)  # [blocks, block_size, 1, D] -> [blocks, block_size, D]
        write_latent(torch.cat([c_kv, k_pe.reshape(tokens, -1)], dim=-1), cache,
                     batch.slot_mapping)
        kv_b = self.kv_b_weight.view(heads, mla.qk_nope_head_dim + mla.v_head_dim,
                                     mla.kv_lora_rank)
        w_uk, w_uv = kv_b.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        q_abs = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, heads, lora]
        query = torch.cat([q_abs, q_pe], dim=-1)
        out = paged_mla_attention(query, cache, batch.block_tables, batch.cached_lens,
                                  batch.query_lens, mla.softmax_scale, mla.kv_lora_rank)
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))  # [heads, T, v]
        out = out.transpose(0, 1).reshape(tokens, heads * mla.v_head_dim)
        return self.tp.linear_all_reduce(out, self.o_weight, self.matmul)
