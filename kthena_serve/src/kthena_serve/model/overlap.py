"""TP overlap: mooncake_ops' MC2 ops (a matmul fused with its collective) as a
`TensorParallel`'s ``fused`` collectives, so each row-parallel matmul's all-reduce (and, under
sequence parallelism, each all-gather + matmul and matmul + reduce-scatter) is one op whose
communication overlaps its compute::

    plain TP    mm ──────────────────▶ all_reduce ──────────▶     (the collective waits)
    MC2         mm0 │ mm1 │ mm2 │ mm3                             (cpu, cuda all-reduce: row
                    │ ar0 │ ar1 │ ar2 │ ar3                        tiles, async collectives)
                one fused kernel                                  (npu: torch_npu MC2; cuda
                                                                   gather/scatter: symm_mem)

What runs where is `mooncake_ops.mc2.require_fused`'s table; `mc2_overlap` checks it for the
device before any rank computes. The ops take matmul-convention weights [K, N], so a layer's
``[out, in]`` weight goes in as ``weight.t()`` (a view). Over gloo the collective runs on the
CPU cores the matmul needs, so CPU overlap is a correctness path more than a speed-up
(docs/kthena_serve.md, "TP overlap", has the measurement).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from kthena_serve.model.errors import TensorParallelError
from mooncake_ops import mc2
from mooncake_ops.dispatch import MC2_OPS

__all__ = ["MC2Overlap", "mc2_overlap"]


def _num_tiles(_inst: object, _attr: attrs.Attribute, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise TensorParallelError(f"MC2Overlap.num_tiles must be a positive int or None (the device's "
                         f"default), got {value!r}")


@attrs.frozen
class MC2Overlap:
    """The MC2 ops over one TP group (`kthena_serve.model.tp.FusedCollectives`).

    Attributes:
        group: the TP group: a kthena_comm ``CommGroup`` or a torch ``ProcessGroup``.
        num_tiles: row tiles of the tiled op (cpu; cuda's all-reduce); None: the device's
            default (`mooncake_ops.mc2`: 1 on cpu, where gloo gives no overlap, 4 elsewhere).
    """

    group: Any
    num_tiles: int | None = attrs.field(default=None, validator=_num_tiles)

    def matmul_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return mc2.matmul_all_reduce(x, weight.t(), self.group, num_tiles=self.num_tiles)

    def all_gather_matmul(self, x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
        out = mc2.all_gather_matmul(x, weight.t(), self.group, num_tiles=self.num_tiles,
                                    bias=bias)
        assert isinstance(out, torch.Tensor)
        return out

    def matmul_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return mc2.matmul_reduce_scatter(x, weight.t(), self.group, num_tiles=self.num_tiles)


def mc2_overlap(group: Any, device_type: str, *, num_tiles: int | None = None,
                sequence_parallel: bool = False) -> MC2Overlap:
    """TP overlap over ``group`` on ``device_type``, once the device is known to have the ops
    (the all-reduce form; with ``sequence_parallel`` the gather and scatter forms too).

    Raises:
        mooncake_ops.UnsupportedDeviceError: a fused op missing from this torch / torch_npu.
        TensorParallelError: a bad ``num_tiles``.
    """
    ops = MC2_OPS if sequence_parallel else ("matmul_all_reduce",)
    mc2.require_fused(device_type, ops)
    return MC2Overlap(group, num_tiles)
