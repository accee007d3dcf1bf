"""mooncake_ops: the compute that touches the paged KV cache, and MC2 fused matmul+collective.

Functional ops over tensors and int block tables, dispatched per device type (`dispatch`):

* `write_kv`, `gather_blocks`, `scatter_blocks`      paged KV writes, block packing (kv_cache)
* `paged_decode_attention`, `paged_prefill_attention`  paged attention, GQA, int8 KV (attention)
* `write_latent`, `paged_mla_attention` (+ `_reference`): DeepSeek MLA over a latent cache (mla)
* `rms_norm`, `rotary_embedding`, `silu_and_mul`, `build_rope_cache`           (layers, rope)
* `matmul_all_reduce`, `all_gather_matmul`, `matmul_reduce_scatter`              (mc2)
* `select_linear_kernel`: the CPU matmul kernel for a weight (pre-packed oneDNN bf16)  (linear)
* `int8_linear`, `pack_int8_weight`, `INT8_WEIGHT_ONLY`: weight-only int8 matmul (linear_int8)
* `gguf_linear`, `pack_gguf_weight`, `dequantize_gguf`, `GGUF_WEIGHT_ONLY`: GGUF Q8_0 / Q4_0 /
  Q4_1 / Q4_K / Q5_K / Q6_K weights as stored, dequantised in registers (gguf_linear, gguf_quants)
* `route_experts`, `RoutingRule`, `fused_experts`: MoE routing and the grouped expert matmul (moe)
* `pack_experts`, `run_experts`: experts packed for measured grouped kernels (moe_kernels;
  the choice: `mooncake_ops.moe_selection.choose_moe_kernels`)
* `expert_range`, `ep_dispatch`, `ep_combine`: expert parallelism, unfused (ep)
* `moe_distribute_dispatch`, `moe_distribute_combine`, `ep_experts`, `replicated_ep_experts`:
  MC2-style fused EP dispatch and combine, the EP MoE layer (moe_distribute)
* `capabilities()`: what runs where, and what is verified (npu: unverified on hardware)
"""

from mooncake_ops.attention import paged_decode_attention, paged_prefill_attention
from mooncake_ops.dispatch import (
    Capability,
    capabilities,
    implementation_name,
    native_enabled,
    use_native,
)
from mooncake_ops.ep import (
    Dispatched,
    Traffic,
    ep_combine,
    ep_dispatch,
    expert_range,
    run_dispatched,
)
from mooncake_ops.errors import (
    BlockTableError,
    ExpertParallelError,
    NativeUnavailableError,
    OpsDeviceError,
    OpsDTypeError,
    OpsShapeError,
    OpsTypeError,
    RopeScalingError,
    UnsupportedDeviceError,
)
from mooncake_ops.gguf_linear import (
    GGUF_DEQUANT_DENSE,
    GGUF_WEIGHT_ONLY,
    dense_gguf_kernel,
    gguf_linear,
    gguf_linear_reference,
)
from mooncake_ops.gguf_quants import (
    GGUF_TYPES,
    GGUFType,
    dequantize_gguf,
    gguf_type,
    gguf_type_of,
    pack_gguf_weight,
)
from mooncake_ops.kv_cache import block_nbytes, gather_blocks, scatter_blocks, write_kv
from mooncake_ops.layers import rms_norm, rotary_embedding, silu_and_mul
from mooncake_ops.linear import LinearKernel, select_linear_kernel
from mooncake_ops.linear_int8 import (
    INT8_WEIGHT_ONLY,
    dequantize_int8_weight,
    int8_linear,
    pack_int8_weight,
)
from mooncake_ops.mc2 import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
from mooncake_ops.mla import paged_mla_attention, paged_mla_attention_reference, write_latent
from mooncake_ops.moe import (
    RoutingRule,
    fused_experts,
    fused_experts_reference,
    route_experts,
    run_experts,
)
from mooncake_ops.moe_distribute import (
    MoEDispatch,
    ep_experts,
    moe_distribute_combine,
    moe_distribute_dispatch,
    replicated_ep_experts,
)
from mooncake_ops.moe_kernels import ExpertWeights, GroupedKernel, pack_experts
from mooncake_ops.quant import dequantize_int8, quantize_int8
from mooncake_ops.rope import build_rope_cache

__all__ = [
    "GGUF_DEQUANT_DENSE",
    "GGUF_TYPES",
    "GGUF_WEIGHT_ONLY",
    "dense_gguf_kernel",
    "INT8_WEIGHT_ONLY",
    "BlockTableError",
    "Capability",
    "Dispatched",
    "GGUFType",
    "ExpertParallelError",
    "ExpertWeights",
    "GroupedKernel",
    "LinearKernel",
    "MoEDispatch",
    "NativeUnavailableError",
    "OpsDTypeError",
    "OpsDeviceError",
    "OpsShapeError",
    "OpsTypeError",
    "RopeScalingError",
    "RoutingRule",
    "Traffic",
    "UnsupportedDeviceError",
    "all_gather_matmul",
    "block_nbytes",
    "build_rope_cache",
    "capabilities",
    "dequantize_gguf",
    "dequantize_int8",
    "dequantize_int8_weight",
    "ep_combine",
    "ep_dispatch",
    "ep_experts",
    "expert_range",
    "fused_experts",
    "fused_experts_reference",
    "gather_blocks",
    "gguf_linear",
    "gguf_linear_reference",
    "gguf_type",
    "gguf_type_of",
    "implementation_name",
    "int8_linear",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "moe_distribute_combine",
    "moe_distribute_dispatch",
    "native_enabled",
    "pack_experts",
    "pack_gguf_weight",
    "pack_int8_weight",
    "paged_decode_attention",
    "paged_mla_attention",
    "paged_mla_attention_reference",
    "paged_prefill_attention",
    "quantize_int8",
    "replicated_ep_experts",
    "rms_norm",
    "rotary_embedding",
    "route_experts",
    "run_dispatched",
    "run_experts",
    "scatter_blocks",
    "select_linear_kernel",
    "silu_and_mul",
    "use_native",
    "write_kv",
    "write_latent",
]
