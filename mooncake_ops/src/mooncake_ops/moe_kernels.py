"""The grouped expert matmul: rows sorted by expert, each expert's SwiGLU MLP run over its rows.

Every kernel here computes the same thing from the same input, rows already sorted by expert
(`mooncake_ops.moe.sort_pairs`) and the row count of each expert:

    rows   [ e0 e0 e0 | e1 | e3 e3 | ... ]        counts [3, 1, 0, 2, ...]
    out    [ MLP_e0(r) ... | MLP_e1(r) | ... ]    MLP_e(r) = down_e @ (silu(gate_e @ r) * (up_e @ r))

and they differ only in how the per-expert matmuls are issued:

    torch-loop          one F.linear pair per expert with rows (the dense weights as given)
    torch-padded-bmm    each expert's rows padded to the largest count, one torch.bmm per
                        matmul over the experts first..last with rows (dense weights)
    torch-grouped-mm    torch._grouped_mm over the sorted rows with per-expert offsets
                        (a private torch op; a candidate only where this torch has it)
    <linear kernel>     the per-expert loop over a `LinearKernel` of `mooncake_ops.linear`
                        (bf16 on the CPU): native-packed-bf16 (fused gate/up + SwiGLU),
                        onednn-packed-bf16 (each expert's weights re-ordered once) and
                        bf16-fp32-compute (dense bf16 weights, fp32 arithmetic)

`mooncake_ops.moe_selection` times them at a model's shapes and picks one per row class;
`pack_experts` lays one layer's experts out for the chosen kernels (once, at load) and
`ExpertWeights.run_sorted` runs them. A kernel's ``layout`` says which weights it runs on:
``dense`` ones run on the ``[E, 2I, H]`` / ``[E, H, I]`` tensors as given (no copy), the others
on a packed copy of their own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from mooncake_ops.errors import OpsDTypeError, OpsShapeError
from mooncake_ops.layers import silu_and_mul
from mooncake_ops.linear import (
    FP32_COMPUTE_BF16,
    NATIVE_PACKED_BF16,
    ONEDNN_PACKED_BF16,
    LinearKernel,
    native_bf16_linear_available,
    onednn_bf16_available,
)

__all__ = ["DENSE", "GROUPED_MM", "LOOP", "PADDED_BMM", "ExpertWeights", "GroupedKernel",
           "grouped_candidates", "grouped_kernel", "grouped_mm_available", "linear_loop",
           "pack_experts"]

DENSE = "dense"


@attrs.frozen
class GroupedKernel:
    """One way to run every expert's SwiGLU MLP over rows sorted by expert.

    Attributes:
        name: for reports and the kernel cache (``torch-loop``, ``native-packed-bf16`` ...).
        layout: ``dense`` (runs on the dense weights as given) or the name of its packed form;
            two kernels with the same layout share one copy of the weights.
        pack: ``(gate_up [E, 2I, H], down [E, H, I]) -> state``, once per layer at load.
        run: ``(rows [R, H] sorted by expert, counts per expert, state) -> [R, H]`` in rows'
            dtype (``sum(counts) == R``).
    """

    name: str
    layout: str
    pack: Callable[[torch.Tensor, torch.Tensor], Any]
    run: Callable[[torch.Tensor, Sequence[int], Any], torch.Tensor]


def _dense_state(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gate_up, down


def _loop_run(rows: torch.Tensor, counts: Sequence[int], state: Any) -> torch.Tensor:
    gate_up, down = state
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            seg = rows[start:start + count]
            out[start:start + count] = F.linear(silu_and_mul(F.linear(seg, gate_up[expert])),
                                                down[expert])
            start += count
    return out


LOOP = GroupedKernel("torch-loop", DENSE, _dense_state, _loop_run)


def _bmm_run(rows: torch.Tensor, counts: Sequence[int], state: Any) -> torch.Tensor:
    """Experts first..last with rows, each padded to the largest count (zero rows):

        padded [experts, C, H] @ gate_up^T [experts, H, 2I] -> SwiGLU -> @ down^T -> [.., H]
    """
    gate_up, down = state
    if not rows.shape[0]:
        return rows.clone()
    active = [e for e, c in enumerate(counts) if c]
    first, last = active[0], active[-1] + 1
    span = torch.tensor(counts[first:last], device=rows.device)
    expert_of_row = torch.repeat_interleave(torch.arange(last - first, device=rows.device), span)
    starts = torch.cumsum(span, 0) - span
    slot = torch.arange(rows.shape[0], device=rows.device) - starts[expert_of_row]
    padded = rows.new_zeros(last - first, int(span.max()), rows.shape[1])
    padded[expert_of_row, slot] = rows
    h = torch.bmm(padded, gate_up[first:last].transpose(1, 2))
    y = torch.bmm(silu_and_mul(h), down[first:last].transpose(1, 2))
    return y[expert_of_row, slot]


PADDED_BMM = GroupedKernel("torch-padded-bmm", DENSE, _dense_state, _bmm_run)


def grouped_mm_available() -> bool:
    """Whether this torch has ``torch._grouped_mm`` (private; torch 2.8 and later)."""
    return hasattr(torch, "_grouped_mm")


def _grouped_mm_run(rows: torch.Tensor, counts: Sequence[int], state: Any) -> torch.Tensor:
    gate_up, down = state
    if not rows.shape[0]:
        return rows.clone()
    ends = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32,
                        device=rows.device)
    h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends)
    return torch._grouped_mm(silu_and_mul(h), down.transpose(1, 2), offs=ends)


GROUPED_MM = GroupedKernel("torch-grouped-mm", DENSE, _dense_state, _grouped_mm_run)


def linear_loop(kernel: LinearKernel) -> GroupedKernel:
    """The per-expert loop over ``kernel``: each expert's gate/up weight packed for the
    kernel's fused SwiGLU input where it has one (else packed plainly), its down weight packed;
    a kernel that packs by copying nothing (a contiguous dense weight) keeps layout ``dense``."""
    def pack(gate_up: torch.Tensor, down: torch.Tensor) -> Any:
        fused = [None if kernel.pack_gate_up is None else kernel.pack_gate_up(w) for w in gate_up]
        firsts = [kernel.pack(w) if f is None else f for w, f in zip(gate_up, fused, strict=True)]
        return firsts, [f is not None for f in fused], [kernel.pack(w) for w in down]

    def run(rows: torch.Tensor, counts: Sequence[int], state: Any) -> torch.Tensor:
        firsts, fused, downs = state
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                seg, first = rows[start:start + count], firsts[expert]
                h = (kernel.gate_up_silu(seg, first) if fused[expert]
                     else silu_and_mul(kernel.linear(seg, first)))
                out[start:start + count] = kernel.linear(h, downs[expert])
                start += count
        return out

    dense = kernel.pack is FP32_COMPUTE_BF16.pack  # the dense pack: detach().contiguous()
    return GroupedKernel(kernel.name, DENSE if dense else kernel.name, pack, run)


_LINEAR_LOOPS = {k.name: linear_loop(k) for k in
                 (NATIVE_PACKED_BF16, ONEDNN_PACKED_BF16, FP32_COMPUTE_BF16)}
_ALL = {k.name: k for k in (LOOP, PADDED_BMM, GROUPED_MM, *_LINEAR_LOOPS.values())}


def grouped_kernel(name: str) -> GroupedKernel:
    """The kernel called ``name``.

    Raises:
        ValueError: no kernel has that name (the message lists them).
    """
    try:
        return _ALL[name]
    except KeyError:
        raise ValueError(f"{name!r} is not a grouped expert kernel; known: "
                         f"{', '.join(sorted(_ALL))}") from None


def grouped_candidates(weight: torch.Tensor) -> tuple[GroupedKernel, ...]:
    """The kernels that can run experts like ``weight`` here: the torch loop, padded bmm and
    (where torch has it) grouped mm for every dtype and device; on the CPU in bf16 also the
    packed linear kernels this CPU has (`mooncake_ops.linear`)."""
    found = [LOOP, PADDED_BMM] + ([GROUPED_MM] if grouped_mm_available() else [])
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
        if native_bf16_linear_available():
            found.append(_LINEAR_LOOPS[NATIVE_PACKED_BF16.name])
        if onednn_bf16_available():
            found.append(_LINEAR_LOOPS[ONEDNN_PACKED_BF16.name])
        found.append(_LINEAR_LOOPS[FP32_COMPUTE_BF16.name])
    return tuple(found)


@attrs.frozen
class ExpertWeights:
    """One layer's experts held by this rank, laid out for their grouped kernels.

    Calls of at most ``decode_max_rows`` rows run ``decode``, larger ones ``prefill``; the two
    share one state when their layouts match (`pack_experts` never holds two copies).

    Attributes:
        decode, prefill: the kernels per row class.
        num_experts: the experts held here (E_local).
        hidden, intermediate: H and I.
        expert_start: the global id of the first expert held here.
        dtype: the weights' dtype (rows must be of it).
        decode_max_rows: the largest row count that runs ``decode``.
    """

    decode: GroupedKernel
    prefill: GroupedKernel
    num_experts: int
    hidden: int
    intermediate: int
    expert_start: int
    dtype: torch.dtype
    decode_max_rows: int
    decode_state: Any = attrs.field(eq=False, repr=False)
    prefill_state: Any = attrs.field(eq=False, repr=False)

    def run_sorted(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Each expert's MLP over its rows: ``rows`` [R, H] sorted by local expert, ``counts``
        [E_local] summing to R -> [R, H] in the weights' dtype.

        Raises:
            OpsShapeError, OpsDTypeError: rows or counts that do not fit these experts.
        """
        if rows.dim() != 2 or rows.shape[1] != self.hidden:
            raise OpsShapeError(f"rows must be [num_rows, hidden={self.hidden}]; got "
                                f"{tuple(rows.shape)}")
        if rows.dtype != self.dtype:
            raise OpsDTypeError(f"rows are {rows.dtype} but the experts are {self.dtype}")
        if len(counts) != self.num_experts or sum(counts) != rows.shape[0]:
            raise OpsShapeError(f"counts must give each of the {self.num_experts} experts' row "
                                f"count, summing to {rows.shape[0]} rows; got {list(counts)}")
        if rows.shape[0] <= self.decode_max_rows:
            return self.decode.run(rows, counts, self.decode_state)
        return self.prefill.run(rows, counts, self.prefill_state)


def pack_experts(gate_up: torch.Tensor, down: torch.Tensor, *,
                 kernels: tuple[GroupedKernel, GroupedKernel] = (LOOP, LOOP),
                 decode_max_rows: int = 0, expert_start: int = 0) -> ExpertWeights:
    """One layer's experts laid out for ``kernels`` (decode, prefill), once at load.

    Args:
        gate_up: [E_local, 2I, H], each expert's gate rows then up rows.
        down: [E_local, H, I].
        kernels: (decode kernel, prefill kernel), e.g. ``MoEKernelChoice.kernels()``; both the
            torch loop by default.
        decode_max_rows: grouped calls of at most this many rows (token-expert pairs) run the
            decode kernel (``MoEKernelChoice.decode_max_rows``).
        expert_start: the global id of ``gate_up[0]``'s expert (expert parallelism).

    Raises:
        OpsShapeError: the weights are not [E, 2I, H] and [E, H, I].
        ValueError: the two kernels need different layouts (two copies of every expert).
    """
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2 or tuple(down.shape) != (
            gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2):
        raise OpsShapeError(f"gate_up must be [experts, 2 * intermediate, hidden] and down "
                            f"[experts, hidden, intermediate]; got {tuple(gate_up.shape)} and "
                            f"{tuple(down.shape)}")
    small, large = kernels
    if small.layout != large.layout:
        raise ValueError(f"kernels {small.name} ({small.layout}) and {large.name} "
                         f"({large.layout}) lay the experts out differently: that holds two "
                         "copies of every expert; choose kernels of one layout")
    state = small.pack(gate_up, down)
    other = state if large.pack is small.pack else large.pack(gate_up, down)
    num_experts, two_inter, hidden = gate_up.shape
    return ExpertWeights(small, large, num_experts, hidden, two_inter // 2, expert_start,
                         gate_up.dtype, decode_max_rows, state, other)
