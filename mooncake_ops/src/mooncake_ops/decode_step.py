"""A dense Llama-family model's decode step through its layers in one native call.

Per layer the native ``DecodeStep`` (native/csrc/decode_step.h) runs norm (+ residual), the
qkv matmul (+ bias), Qwen3's q/k norms, RoPE, the KV write, paged decode attention, the o
matmul, norm (+ residual), the gate/up matmul with SiLU-and-mul, and the down matmul, with no
Python between the ops and one parallel region for the whole step: what CUDA graphs are to
vLLM's decode, on the CPU. Its tasks call the kernels the ops themselves run (the native bf16
matmul, RMSNorm, RoPE, the bf16 decode attention), each output element computed in the same
order, so the step is bit-equal to the op chain (`reference_layers` below runs that chain
through the public ops, for tests).

Both native builds have it, each over its own kernels:

* AVX-512 (a CPU with AVX512_BF16): bf16 weights packed for ``native-packed-bf16`` (gate/up
  with SiLU-and-mul in one kernel);
* AVX2 (e.g. AMD Zen 3): bf16 weights dense, computed in fp32 as ``bf16-fp32-compute`` runs
  them there (the AVX2 build's ``dense_linear``).

In both, int8 weights (``--quantization int8``: the native int8 matmul of decode rows) or GGUF
weights (``--quantization gguf``: the native GGUF matmul) work too; gate/up outputs other than
the packed bf16 kernel's take SiLU-and-mul as a phase of its own. bf16 activations and KV
cache, head_dim 64 / 128 / 256, one rank; up to `max_fused_rows` decode rows, where the op
chain's matmuls run the parts the step runs. Whether a model uses it is the model's choice
(`kthena_serve.model.llama`): timed against the op chain under ``--kernels auto``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from mooncake_ops.attention import paged_decode_attention
from mooncake_ops.dispatch import native_enabled
from mooncake_ops.gguf_linear import GGUF_BF16_MAX_OP_ROWS, GGUF_WEIGHT_ONLY
from mooncake_ops.gguf_quants import gguf_type_of
from mooncake_ops.kv_cache import write_kv
from mooncake_ops.layers import rms_norm, rotary_embedding, silu_and_mul
from mooncake_ops.linear import (
    FP32_COMPUTE_BF16,
    NATIVE_PACKED_BF16,
    LinearKernel,
    native_bf16_linear_available,
    native_module,
)
from mooncake_ops.linear_int8 import INT8_PANEL_MIN_ROWS, INT8_WEIGHT_ONLY

__all__ = ["DecodeHead", "DecodeLayer", "FusedDecode", "fused_decode_available",
           "max_fused_rows", "reference_layers", "reference_logits", "step_bf16_kernel"]

# Batches of at most this many decode rows take the AVX-512 step when it is chosen (measured:
# docs/mooncake_ops.md, "Fused decode step").
FUSED_MAX_ROWS = 16
# The AVX2 build's dense and int8 matmuls take up to 2 rows by the dot products the step runs
# (more by weight panels: native/csrc_avx2/linear_avx2.cpp).
_AVX2_DOT_ROWS = 2


@attrs.frozen
class DecodeLayer:
    """One layer's tensors as the fused step takes them.

    The matmul weights are bf16 as `step_bf16_kernel` packs them (AVX-512: ``NATIVE_PACKED_BF16``,
    ``gate_up`` by its SwiGLU packing, gate and up blocks interleaved; AVX2:
    ``FP32_COMPUTE_BF16``'s dense [N, K]), ``INT8_WEIGHT_ONLY``'s int8 rows with their scales,
    or packed GGUF weights as ``GGUF_WEIGHT_ONLY`` takes them (every ``gate_up`` but the packed
    bf16 one: [gate; up] rows); norms and the bias are bf16; ``q_norm`` / ``k_norm``
    ([head_dim], Qwen3) come together or not at all. ``k_cache`` / ``v_cache``: bf16
    [blocks, block_size, num_kv_heads, head_dim]."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


@attrs.frozen
class DecodeHead:
    """What follows the layers for logits: the final norm (bf16 [hidden]) and the LM head
    weight, in one of the forms a layer's matmul weights take ([vocab, hidden] outputs)."""

    norm: torch.Tensor
    weight: torch.Tensor


def _isa() -> str | None:
    from mooncake_ops.backends import native

    return native.isa() if native_enabled() else None


def fused_decode_available() -> bool:
    """Whether the native build here has the fused step and the CPU runs its kernels (the
    AVX-512 build's need AVX512_BF16; the AVX2 build loads only where they run)."""
    isa = _isa()
    if isa is None or not hasattr(native_module(), "DecodeStep"):
        return False
    return isa == "avx2" or native_bf16_linear_available()


def step_bf16_kernel() -> LinearKernel:
    """The bf16 matmul whose weights and parts the fused step takes on this build."""
    return FP32_COMPUTE_BF16 if _isa() == "avx2" else NATIVE_PACKED_BF16


def max_fused_rows(kernel: str) -> int:
    """The most decode rows the fused step takes with matmul kernel ``kernel`` (a
    ``LinearKernel`` name): up to where the op chain's kernel for those rows runs the parts
    the step's tasks run (int8: below its panel kernel's rows; GGUF: the native GGUF matmul
    for bf16 rows)."""
    avx2 = _isa() == "avx2"
    if kernel == INT8_WEIGHT_ONLY.name:
        return _AVX2_DOT_ROWS if avx2 else INT8_PANEL_MIN_ROWS - 1
    if kernel == GGUF_WEIGHT_ONLY.name:
        return GGUF_BF16_MAX_OP_ROWS
    if kernel == step_bf16_kernel().name:
        return _AVX2_DOT_ROWS if avx2 else FUSED_MAX_ROWS
    raise ValueError(f"the fused step does not run matmul kernel {kernel!r} on this build; it "
                     f"runs {step_bf16_kernel().name}, {INT8_WEIGHT_ONLY.name} and "
                     f"{GGUF_WEIGHT_ONLY.name}")


class FusedDecode:
    """The native step over fixed layers and KV caches, and with ``head`` on to the logits
    (`logits`).

    Raises:
        ValueError: a tensor the step cannot take (the message names the layer and tensor).
        RuntimeError: no native build with the fused step here (`fused_decode_available`).
    """

    def __init__(self, layers: Sequence[DecodeLayer], *, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, scale: float, head: DecodeHead | None = None) -> None:
        if not fused_decode_available():
            raise RuntimeError("no native build with the fused decode step runs here (the "
                               "AVX-512 one needs AVX512_BF16; the AVX2 one AVX2)")
        self.num_layers = len(layers)
        self._step = native_module().DecodeStep(
            [y.input_norm for y in layers], [y.post_norm for y in layers],
            [y.qkv for y in layers], [y.qkv_bias for y in layers],
            [y.q_norm for y in layers], [y.k_norm for y in layers], [y.o for y in layers],
            [y.gate_up for y in layers], [y.down for y in layers],
            [y.k_cache for y in layers], [y.v_cache for y in layers],
            [[_kind(w) for w in (y.qkv, y.o, y.gate_up, y.down)] for y in layers],
            num_heads, num_kv_heads, head_dim, eps, scale)
        self.has_head = False
        if head is not None:
            self.set_head(head)

    def set_head(self, head: DecodeHead) -> None:
        """Go on to the logits (`logits`) with this final norm and LM head.

        Raises:
            ValueError: a norm or head weight the step cannot take (the message names it).
        """
        self._step.set_head(head.norm, head.weight, _kind(head.weight))
        self.has_head = True

    def run(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor,
            rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's ``(x, residual)`` for one decode token per sequence.

        Args:
            x: the embedded tokens, bf16 [batch, hidden].
            positions, slot_mapping: int64 [batch]; block_tables: int32 [batch, max_blocks];
            context_lens: int32 [batch], counting the new token. rope: the float32 cos | sin
            table. Each new token's K/V is written to its slot before attention reads it.
        """
        out, residual = self._step.run(x, positions, slot_mapping, block_tables, context_lens,
                                       rope)
        return out, residual

    def logits(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor,
               rope: torch.Tensor) -> torch.Tensor:
        """`run`, then the final norm (+ residual) and the LM head in the same native call:
        float32 logits [batch, vocab] (the head's bf16 outputs widened, as the model's head
        matmul and ``.float()``).

        Raises:
            ValueError: this step was built without a ``head``.
        """
        if not self.has_head:
            raise ValueError("this fused step has no LM head: build it with head=DecodeHead(...)")
        return self._step.run_logits(x, positions, slot_mapping, block_tables, context_lens, rope)


def _kind(weight: torch.Tensor) -> int:
    """What the native step reads a weight as: ggml's type number for packed GGUF blocks
    (uint8), -2 for `pack_int8_weight`'s int8 rows, -1 for the native packed bf16 layout
    ([N/16, K/2, 16, 2]), -3 for a dense bf16 [N, K]."""
    if weight.dtype == torch.uint8:
        return gguf_type_of(weight).type_id
    if weight.dtype == torch.int8:
        return -2
    return -3 if weight.dim() == 2 else -1


def _kernel(weight: torch.Tensor) -> LinearKernel:
    if weight.dtype in (torch.uint8, torch.int8):
        return GGUF_WEIGHT_ONLY if weight.dtype == torch.uint8 else INT8_WEIGHT_ONLY
    return FP32_COMPUTE_BF16 if weight.dim() == 2 else NATIVE_PACKED_BF16


def _linear(x: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    return _kernel(weight).linear(x, weight, bias)


def _gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """gate/up + SiLU as the model runs it for decode rows: the packed bf16 kernel's fused form,
    the matmul then `silu_and_mul` for the rest (int8's fused form runs only from
    `INT8_PANEL_MIN_ROWS` rows)."""
    kernel = _kernel(weight)
    if kernel is NATIVE_PACKED_BF16:
        return NATIVE_PACKED_BF16.gate_up_silu(x, weight)
    return silu_and_mul(kernel.linear(x, weight))


def reference_layers(layers: Sequence[DecodeLayer], x: torch.Tensor, positions: torch.Tensor,
                     slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, rope: torch.Tensor, *, num_heads: int,
                     num_kv_heads: int, head_dim: int, eps: float,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same step as the chain of public ops (`FusedDecode.run`'s yardstick)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    tokens, residual = x.shape[0], None
    for y in layers:
        if residual is None:
            residual, h = x, rms_norm(x, y.input_norm, eps)
        else:
            h, residual = rms_norm(x, y.input_norm, eps, residual)
        qkv = _linear(h, y.qkv, y.qkv_bias)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(tokens, num_heads, head_dim)
        k = k.view(tokens, num_kv_heads, head_dim)
        v = v.view(tokens, num_kv_heads, head_dim)
        if y.q_norm is not None:
            q, k = rms_norm(q, y.q_norm, eps), rms_norm(k, y.k_norm, eps)
        q, k = rotary_embedding(positions, q, k, rope, is_neox=True)
        write_kv(k, v, y.k_cache, y.v_cache, slot_mapping)
        out = paged_decode_attention(q, y.k_cache, y.v_cache, block_tables, context_lens, scale)
        x = _linear(out.reshape(tokens, q_size), y.o)
        h, residual = rms_norm(x, y.post_norm, eps, residual)
        x = _linear(_gate_up_silu(h, y.gate_up), y.down)
    return x, residual


def reference_logits(layers: Sequence[DecodeLayer], head: DecodeHead, x: torch.Tensor,
                     *args: torch.Tensor, eps: float, **shape: float) -> torch.Tensor:
    """`reference_layers`, then the final norm and the head as ops (`FusedDecode.logits`'s
    yardstick)."""
    out, residual = reference_layers(layers, x, *args, eps=eps, **shape)
    h, _ = rms_norm(out, head.norm, eps, residual)
    return _linear(h, head.weight).float()
