"""The one place torch_npu ops are called: the version is read once, keywords follow it.

torch_npu is imported by ``load()`` only, the first time an npu tensor reaches an op (importing
it without CANN breaks ``import torch``). Its ``__version__`` (``2.1.0.post12``, ``2.5.1`` ...)
names an Ascend Extension for PyTorch release through the release table of the Ascend/pytorch
README (branch ``v{torch}-{release}``); the release decides the keyword spelling:

    release   npu_fused_infer_attention_score softmax scale keyword
    6.0.x     scale_value            (torch_npu 2.1.0.post4..post10, 2.2.0.*, 2.3.1..post4,
                                      2.4.0..post2)
    7.0.0+    scale                  (torch_npu 2.1.0.post12+, 2.3.1.post6+, 2.4.0.post4+,
                                      2.5.1 and every later torch line)

The other ops keep one signature across those releases (positional tensors, then
``epsilon=`` / ``dim=`` / ``reduce_op=`` / ``bias=`` / ``gather_output=`` keywords), checked
against the same API references (the MoE dispatch / combine pair: the 7.0.0 reference); an op missing from the installed torch_npu is reported by
``has`` so the backend runs its portable path instead. The MC2 ops take the group's HCCL
communicator name (``hcom``), which the caller resolves (kthena_comm ``CommGroup``).
UNVERIFIED ON HARDWARE: see docs/accelerators.md for what was checked against what.
"""

from __future__ import annotations

import functools
import importlib
import re
from types import ModuleType
from typing import Any

import attrs

__all__ = ["OPS", "NpuVersionError", "TorchNpuOps", "TorchNpuRelease", "load", "release_of"]

OPS = ("npu_fused_infer_attention_score", "npu_scatter_pa_kv_cache", "npu_rms_norm",
       "npu_add_rms_norm", "npu_swiglu", "npu_mm_all_reduce_base", "npu_all_gather_base_mm",
       "npu_mm_reduce_scatter_base", "npu_moe_distribute_dispatch",
       "npu_moe_distribute_combine")

# First torch_npu build of each torch line that belongs to Ascend Extension 7.0.0 (README table).
_FIRST_7_0 = {(2, 1, 0): 12, (2, 3, 1): 6, (2, 4, 0): 4, (2, 5, 1): 0}
_ONLY_6_X = {(2, 2, 0)}  # a torch line that ended with the 6.0 releases
_OLDEST = (2, 1, 0)


class NpuVersionError(RuntimeError):
    """The installed torch_npu is one whose op signatures this adapter does not know."""


@attrs.frozen
class TorchNpuRelease:
    """An installed torch_npu and the Ascend Extension release line it belongs to."""

    version: str
    line: str
    """``"6.0"`` or ``"7.0+"``."""

    @property
    def fia_scale_keyword(self) -> str:
        return "scale_value" if self.line == "6.0" else "scale"


def release_of(version: str) -> TorchNpuRelease:
    """The release line of a torch_npu ``__version__`` string.

    Raises:
        NpuVersionError: unparsable, or older than the 6.0 releases (torch line < 2.1).
    """
    match = re.match(r"(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?", version)
    if match is None:
        raise NpuVersionError(f"torch_npu version {version!r} is not MAJOR.MINOR.PATCH[.postN]")
    torch_line = tuple(int(g) for g in match.groups()[:3])
    post = int(match.group(4) or 0)
    if torch_line < _OLDEST:
        raise NpuVersionError(f"torch_npu {version} predates Ascend Extension 6.0 (torch 2.1 "
                              "line); install a torch_npu of release 6.0.0 or later")
    if torch_line in _ONLY_6_X:
        return TorchNpuRelease(version, "6.0")
    first = _FIRST_7_0.get(torch_line)
    if first is None:  # a torch line after 2.5.1: 7.x or later
        return TorchNpuRelease(version, "7.0+")
    return TorchNpuRelease(version, "7.0+" if post >= first else "6.0")


class TorchNpuOps:
    """The torch_npu ops the npu backend calls, with this version's keyword names.

    Args:
        module: the imported ``torch_npu`` (tests pass a recording double).
    """

    def __init__(self, module: ModuleType) -> None:
        self._npu = module
        self.release = release_of(str(module.__version__))
        self.missing = frozenset(op for op in OPS if not hasattr(module, op))

    def has(self, op: str) -> bool:
        return op not in self.missing

    def fused_infer_attention_score(self, query: Any, key: Any, value: Any, *, block_table: Any,
                                    actual_seq_lengths_kv: list[int], num_heads: int,
                                    num_key_value_heads: int, scale: float, input_layout: str,
                                    block_size: int) -> Any:
        scale_kw = {self.release.fia_scale_keyword: scale}
        return self._npu.npu_fused_infer_attention_score(
            query, key, value, block_table=block_table,
            actual_seq_lengths_kv=actual_seq_lengths_kv, num_heads=num_heads,
            num_key_value_heads=num_key_value_heads, input_layout=input_layout,
            block_size=block_size, **scale_kw)

    def scatter_pa_kv_cache(self, key: Any, value: Any, key_cache: Any, value_cache: Any,
                            slot_mapping: Any) -> None:
        self._npu.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    def rms_norm(self, x: Any, gamma: Any, eps: float) -> Any:
        return self._npu.npu_rms_norm(x, gamma, epsilon=eps)

    def add_rms_norm(self, x: Any, residual: Any, gamma: Any, eps: float) -> Any:
        return self._npu.npu_add_rms_norm(x, residual, gamma, epsilon=eps)

    def swiglu(self, x: Any, dim: int = -1) -> Any:
        return self._npu.npu_swiglu(x, dim=dim)

    def mm_all_reduce_base(self, x1: Any, x2: Any, hcom: str, *, bias: Any = None) -> Any:
        return self._npu.npu_mm_all_reduce_base(x1, x2, hcom, reduce_op="sum", bias=bias)

    def all_gather_base_mm(self, x1: Any, x2: Any, hcom: str, world_size: int, *,
                           gather_output: bool) -> Any:
        return self._npu.npu_all_gather_base_mm(x1, x2, hcom, world_size,
                                                gather_output=gather_output)

    def mm_reduce_scatter_base(self, x1: Any, x2: Any, hcom: str, world_size: int) -> Any:
        return self._npu.npu_mm_reduce_scatter_base(x1, x2, hcom, world_size, reduce_op="sum")

    def moe_distribute_dispatch(self, x: Any, expert_ids: Any, group_ep: str,
                                ep_world_size: int, ep_rank_id: int,
                                moe_expert_num: int) -> tuple:
        """(expand_x, dynamic_scales, expand_idx, expert_token_nums, ep_recv_counts,
        tp_recv_counts, expand_scales); no quantisation, no TP domain, no shared-expert
        ranks, expert_token_nums as counts (``expert_token_nums_type=1``)."""
        return self._npu.npu_moe_distribute_dispatch(
            x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
            quant_mode=0, shared_expert_rank_num=0, expert_token_nums_type=1)

    def moe_distribute_combine(self, expand_x: Any, expert_ids: Any, expand_idx: Any,
                               ep_send_counts: Any, expert_scales: Any, group_ep: str,
                               ep_world_size: int, ep_rank_id: int, moe_expert_num: int, *,
                               tp_send_counts: Any) -> Any:
        return self._npu.npu_moe_distribute_combine(
            expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep,
            ep_world_size, ep_rank_id, moe_expert_num, tp_send_counts=tp_send_counts,
            shared_expert_rank_num=0)


@functools.cache
def load() -> TorchNpuOps:
    """Import torch_npu and check its version, once per process (``load.cache_clear`` resets)."""
    return TorchNpuOps(importlib.import_module("torch_npu"))
