"""Ascend backend: torch_npu's fused ops where documented. UNVERIFIED ON HARDWARE.

Loaded by the dispatch registry only when the first npu tensor arrives. Every torch_npu call
goes through ``torch_npu_api`` (the adapter that reads the torch_npu version once and spells
each keyword the way that version does); nothing here has run on an NPU. Calls outside the
documented constraints, or ops missing from the installed torch_npu, run the portable path:

    op                        torch_npu call                          falls back when
    write_kv                  npu_scatter_pa_kv_cache (in place)      int8 cache
    paged_decode_attention    npu_fused_infer_attention_score         int8 cache, float32
                              (BSH, block_table, actual_seq_lengths_kv)
    paged_prefill_attention   SDPA over gathered K/V (portable path)  always
    rms_norm                  npu_rms_norm / npu_add_rms_norm
    silu_and_mul              npu_swiglu
    matmul_all_reduce         npu_mm_all_reduce_base(x, w, hcom)      float32
    all_gather_matmul         npu_all_gather_base_mm(x, w, hcom, W)   float32, bias, K outside
    matmul_reduce_scatter     npu_mm_reduce_scatter_base(x, w, hcom, W)  [256, 65535), W not 2/4/8
    moe_distribute_dispatch   npu_moe_distribute_dispatch(x, ids, hcom,  float32, one rank,
                              W, rank, E)                             T outside 1..256, H not a
    moe_distribute_combine    npu_moe_distribute_combine(...,            multiple of 32 up to
                              tp_send_counts=)                        7168, top_k > 8

``hcom`` is the group's HCCL communicator name: ``CommGroup.hccl_comm_name``, which
``init_parallel_groups`` fills in on hccl (else looked up from the group's process group).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
import torch.nn.functional as F

from kthena_comm.hccl import hccl_comm_name
from mooncake_ops.backends import mc2_tiled, moe_a2a, sdpa
from mooncake_ops.backends import reference as ref
from mooncake_ops.backends.base import OpImpl
from mooncake_ops.backends.devices import NPU_OPS, reference_table
from mooncake_ops.backends.torch_npu_api import load

HALF_TYPES = (torch.float16, torch.bfloat16)


def write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    api = load()
    if k_scale is not None or not api.has("npu_scatter_pa_kv_cache"):
        return ref.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    api.scatter_pa_kv_cache(key, value, k_cache, v_cache, slot_mapping.to(torch.int32))


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                           k_scale=None, v_scale=None, out=None):
    api = load()
    if (k_scale is not None or q.dtype not in HALF_TYPES
            or not api.has("npu_fused_infer_attention_score")):
        return sdpa.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                           scale, k_scale, v_scale, out)
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    result, _ = api.fused_infer_attention_score(
        q.reshape(batch, 1, num_heads * head_dim),
        k_cache.reshape(num_blocks, block_size, num_kv_heads * head_dim),
        v_cache.reshape(num_blocks, block_size, num_kv_heads * head_dim),
        block_table=block_tables.to(torch.int32), actual_seq_lengths_kv=context_lens.tolist(),
        num_heads=num_heads, num_key_value_heads=num_kv_heads, scale=scale,
        input_layout="BSH", block_size=block_size)
    return ref.into(out, result.view(batch, num_heads, head_dim))


def rms_norm(x, weight, eps, residual=None):
    api = load()
    if residual is None:
        if not api.has("npu_rms_norm"):
            return ref.rms_norm(x, weight, eps)
        return api.rms_norm(x, weight, eps)[0]
    if not api.has("npu_add_rms_norm"):
        return ref.rms_norm(x, weight, eps, residual)
    y, _, summed = api.add_rms_norm(x, residual, weight, eps)
    return y, summed


def silu_and_mul(x):
    api = load()
    return api.swiglu(x, dim=-1) if api.has("npu_swiglu") else ref.silu_and_mul(x)


def _hcom(comm) -> str:
    if comm.hccl_comm_name is not None:
        return comm.hccl_comm_name
    return hccl_comm_name(comm.process_group, int(comm.rank))  # the global rank, as documented


def _mc2_fits(op, x, w, comm, bias=None, need_world=False) -> bool:
    return (load().has(op) and comm.size > 1 and x.dtype in HALF_TYPES and w.dtype == x.dtype
            and 256 <= x.shape[1] < 65535 and (not need_world or comm.size in (2, 4, 8))
            and (bias is None or not need_world))


def matmul_all_reduce(x, w, comm, num_tiles, bias=None, timeout_s=None):
    if not _mc2_fits("npu_mm_all_reduce_base", x, w, comm):
        return mc2_tiled.matmul_all_reduce(x, w, comm, num_tiles, bias, timeout_s)
    return load().mm_all_reduce_base(x, w, _hcom(comm), bias=bias)


def all_gather_matmul(x, w, comm, num_tiles, bias=None, timeout_s=None, return_gathered=False):
    if not _mc2_fits("npu_all_gather_base_mm", x, w, comm, bias, need_world=True):
        return mc2_tiled.all_gather_matmul(x, w, comm, num_tiles, bias, timeout_s,
                                           return_gathered)
    out, gathered = load().all_gather_base_mm(x, w, _hcom(comm), comm.size,
                                              gather_output=return_gathered)
    return (out, gathered) if return_gathered else out


def matmul_reduce_scatter(x, w, comm, num_tiles, bias=None, timeout_s=None):
    if not _mc2_fits("npu_mm_reduce_scatter_base", x, w, comm, bias, need_world=True):
        return mc2_tiled.matmul_reduce_scatter(x, w, comm, num_tiles, bias, timeout_s)
    return load().mm_reduce_scatter_base(x, w, _hcom(comm), comm.size)


# npu_moe_distribute_dispatch's documented shapes, on the narrower product line (Atlas A2):
# 0 < tokens <= 256, hidden a multiple of 32 up to 7168, 0 < top_k <= 8; x bf16 or fp16.
_MOE_MAX_TOKENS, _MOE_MAX_HIDDEN, _MOE_MAX_TOP_K = 256, 7168, 8


@attrs.frozen(eq=False)
class NpuMoEHandle:
    """torch_npu's dispatch outputs that its combine takes back (``ep_send_counts`` is the
    dispatch's ``ep_recv_counts``: combine returns along the path dispatch came)."""

    num_rows: int  # expand_x's rows (A, the buffer), not the rows filled
    expand_idx: torch.Tensor
    ep_recv_counts: torch.Tensor
    tp_recv_counts: torch.Tensor
    expert_ids: torch.Tensor  # int32 [T, top_k]
    expert_scales: torch.Tensor  # float32 [T, top_k]
    hcom: str
    num_experts: int


def _moe_fits(x, ids, comm) -> bool:
    api = load()
    tokens, hidden = x.shape
    return (api.has("npu_moe_distribute_dispatch") and api.has("npu_moe_distribute_combine")
            and comm.size > 1 and x.dtype in HALF_TYPES and 0 < tokens <= _MOE_MAX_TOKENS
            and hidden % 32 == 0 and hidden <= _MOE_MAX_HIDDEN
            and ids.shape[1] <= _MOE_MAX_TOP_K)


def moe_distribute_dispatch(x, weights, ids, comm, experts, num_experts):
    if not _moe_fits(x, ids, comm):
        return moe_a2a.moe_distribute_dispatch(x, weights, ids, comm, experts, num_experts)
    hcom, expert_ids = _hcom(comm), ids.to(torch.int32)
    expand_x, _, expand_idx, token_nums, ep_recv, tp_recv, _ = load().moe_distribute_dispatch(
        x, expert_ids, hcom, comm.size, comm.group_rank, num_experts)
    handle = NpuMoEHandle(expand_x.shape[0], expand_idx, ep_recv, tp_recv, expert_ids,
                          weights.float(), hcom, num_experts)
    return moe_a2a.MoEDispatch(expand_x, tuple(int(c) for c in token_nums.tolist()), experts,
                               x.shape[0], x.dtype, None, handle)


def moe_distribute_combine(out_rows, dispatch, comm):
    h = dispatch.handle
    if not isinstance(h, NpuMoEHandle):
        return moe_a2a.moe_distribute_combine(out_rows, dispatch, comm)
    expand = F.pad(out_rows, (0, 0, 0, h.num_rows - out_rows.shape[0]))  # back to A rows
    return load().moe_distribute_combine(expand, h.expert_ids, h.expand_idx, h.ep_recv_counts,
                                         h.expert_scales, h.hcom, comm.size, comm.group_rank,
                                         h.num_experts, tp_send_counts=h.tp_recv_counts)


class NpuBackend:
    """torch_npu fused ops where documented, the portable paths elsewhere (see module doc)."""

    device_type = "npu"

    def op_table(self, allow_native: bool) -> Mapping[str, OpImpl]:
        table = reference_table()
        table["paged_prefill_attention"] = OpImpl(sdpa.paged_prefill_attention, "torch-sdpa")
        for fn in (write_kv, paged_decode_attention, rms_norm, silu_and_mul, matmul_all_reduce,
                   all_gather_matmul, matmul_reduce_scatter, moe_distribute_dispatch,
                   moe_distribute_combine):
            table[fn.__name__] = OpImpl(fn, NPU_OPS[fn.__name__])
        return table
