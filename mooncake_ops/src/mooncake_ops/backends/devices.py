"""The cpu and cuda backends: which implementation each op runs on that device type.

The npu backend lives in `npu.py` (imported only for npu tensors); `NPU_OPS` names what it
calls so the capability report can list it without importing torch_npu.
"""

from __future__ import annotations

from collections.abc import Mapping

from mooncake_ops.backends import mc2_symm_mem, mc2_tiled, moe_a2a, sdpa
from mooncake_ops.backends import reference as ref
from mooncake_ops.backends.base import MC2_OPS, MOE_DISTRIBUTE_OPS, OP_NAMES, OpImpl

REFERENCE = "torch-reference"
SDPA = "torch-sdpa"
SDPA_CPU = "torch-sdpa (flash cpu, cached/new split)"
SDPA_CPU_NATIVE = ("native-cpp (bf16, AVX512_BF16); else torch-sdpa (flash cpu, cached/new split; "
                   "int8 prefix: native-cpp)")
NATIVE_CPU_PREFILL = ("native-cpp (fp32 arithmetic, AVX2); else torch-sdpa (flash cpu, cached/new "
                      "split; int8 prefix: native-cpp)")
SDPA_CPU_NATIVE_INT8 = "torch-sdpa (flash cpu, cached/new split; int8 prefix: native-cpp)"
TILED = "torch-tiled (kthena_comm async collectives)"
SYMM_MEM = "torch symm_mem.{op} (async-TP)"
A2A = "torch-a2a (kthena_comm async all-to-all, sort by expert fused)"
NATIVE = "native-cpp"

NPU_OPS: Mapping[str, str] = {
    "write_kv": "torch_npu.npu_scatter_pa_kv_cache (int8: torch-reference)",
    "paged_decode_attention": "torch_npu.npu_fused_infer_attention_score (block_table)",
    "paged_prefill_attention": SDPA,
    "rms_norm": "torch_npu.npu_rms_norm / npu_add_rms_norm",
    "rotary_embedding": REFERENCE,
    "silu_and_mul": "torch_npu.npu_swiglu",
    "int8_linear": REFERENCE,
    "gather_blocks": REFERENCE,
    "scatter_blocks": REFERENCE,
    "matmul_all_reduce": "torch_npu.npu_mm_all_reduce_base",
    "all_gather_matmul": "torch_npu.npu_all_gather_base_mm",
    "matmul_reduce_scatter": "torch_npu.npu_mm_reduce_scatter_base",
    "moe_distribute_dispatch": "torch_npu.npu_moe_distribute_dispatch",
    "moe_distribute_combine": "torch_npu.npu_moe_distribute_combine",
}


def reference_table() -> dict[str, OpImpl]:
    portable = (*MC2_OPS, *MOE_DISTRIBUTE_OPS)
    table = {op: OpImpl(getattr(ref, op), REFERENCE) for op in OP_NAMES if op not in portable}
    table |= {op: OpImpl(getattr(mc2_tiled, op), TILED) for op in MC2_OPS}
    return table | {op: OpImpl(getattr(moe_a2a, op), A2A) for op in MOE_DISTRIBUTE_OPS}


class CpuBackend:
    """Native C++ kernels where built (and the call fits them), else PyTorch."""

    device_type = "cpu"

    def candidates(self, op: str, allow_native: bool) -> dict[str, OpImpl]:
        """The implementations of ``op`` that a measurement may choose between, by short name
        (`mooncake_ops.selection`): the attention ops only; {} for the others."""
        found: dict[str, OpImpl] = {}
        if op == "paged_decode_attention":
            found = {"torch-reference": OpImpl(ref.paged_decode_attention, REFERENCE),
                     "torch-sdpa": OpImpl(sdpa.paged_decode_attention, SDPA)}
        elif op == "paged_prefill_attention":
            found = {"torch-sdpa": OpImpl(sdpa.paged_prefill_attention_cpu, SDPA_CPU)}
        else:
            return found
        default = self.op_table(allow_native)[op]
        if default.name not in (REFERENCE, SDPA, SDPA_CPU):  # the native build's adapter
            found["native"] = default
        return found

    def op_table(self, allow_native: bool) -> Mapping[str, OpImpl]:
        table = reference_table()
        table["paged_prefill_attention"] = OpImpl(sdpa.paged_prefill_attention_cpu, SDPA_CPU)
        if allow_native:
            from mooncake_ops.backends import native
            if native.is_available():
                table.update({op: OpImpl(fn, NATIVE) for op, fn in native.ops().items()})
                label = SDPA_CPU_NATIVE_INT8  # a build without the entry point
                if native.has("paged_prefill_attention"):
                    label = NATIVE_CPU_PREFILL if native.isa() == "avx2" else SDPA_CPU_NATIVE
                table["paged_prefill_attention"] = OpImpl(native.paged_prefill_attention, label)
        return table


class CudaBackend:
    """SDPA-based attention; torch's symmetric-memory async-TP ops for all-gather + matmul and
    matmul + reduce-scatter where torch has them (`mc2_symm_mem`); PyTorch for the rest."""

    device_type = "cuda"

    def op_table(self, allow_native: bool) -> Mapping[str, OpImpl]:
        table = reference_table()
        table["paged_decode_attention"] = OpImpl(sdpa.paged_decode_attention, SDPA)
        table["paged_prefill_attention"] = OpImpl(sdpa.paged_prefill_attention, SDPA)
        if mc2_symm_mem.available():  # matmul_all_reduce has no symm_mem op: tiled over NCCL
            for op, fused in zip(("all_gather_matmul", "matmul_reduce_scatter"),
                                 mc2_symm_mem.OPS, strict=True):
                table[op] = OpImpl(getattr(mc2_symm_mem, op), SYMM_MEM.format(op=fused))
        return table
