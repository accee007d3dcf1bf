"""`LlamaForCausalLM`: a Llama-family decoder over a paged KV cache (Llama 2/3, Mistral, Qwen2,
Qwen3 dense, SmolLM2), and the MoE families built on the same attention (Mixtral, Qwen3-MoE),
whose sparse layers run `SparseMoE` in place of the MLP.

One forward takes the packed new tokens of a step (see mooncake_kv's `PagedBatch`) and returns
the logits of each sequence's last new token. Attention, norms, RoPE and the KV write go through
mooncake_ops.
Q/K/V and gate/up are fused into one weight each (one matmul instead of three / two), the
residual add is fused into RMSNorm, and nothing in the forward reads a tensor's value back on the
host, so a decode step is ~10 kernel launches per layer and no synchronisation. Qwen3 adds an
RMSNorm over ``head_dim`` on each query and key head between the projection and RoPE
(``qk_norm``); it acts per head, so every TP rank holds the same weights for its own heads.

The model holds only its own rank's shard (`plan_shards`); the two row-parallel matmuls hand
their partial sums to ``tp.all_reduce``, or, in a forward that sequence parallelism splits
(`SequenceParallel`, `TokenShards`), to a reduce-scatter over tokens, with an all-gather before
each column-parallel matmul. Under pipeline parallelism it holds one stage's layers
(`PipelineStage`): `forward_stage` takes token ids (first stage) or the previous stage's
(hidden, residual) pair and returns the next pair, or logits on the last stage. Nothing here
knows about process groups.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from kthena_core.layout import sp_with_pp_refusal
from kthena_serve.model.config import ModelConfig
from kthena_serve.model.errors import BatchError, TensorParallelError, UnsupportedModelError
from kthena_serve.model.mla import MLAttention
from kthena_serve.model.moe import SparseMoE
from kthena_serve.model.pp import PipelineStage
from kthena_serve.model.sp import SequenceParallel, TokenShards
from kthena_serve.model.tp import ShardPlan, TensorParallel, plan_shards
from mooncake_kv.paged import PagedBatch
from mooncake_ops import (
    GGUF_DEQUANT_DENSE,
    GGUF_WEIGHT_ONLY,
    INT8_WEIGHT_ONLY,
    LinearKernel,
    build_rope_cache,
    dense_gguf_kernel,
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    write_kv,
)
from mooncake_ops.decode_step import (
    FUSED_MAX_ROWS,
    DecodeHead,
    DecodeLayer,
    FusedDecode,
    fused_decode_available,
    max_fused_rows,
    step_bf16_kernel,
)
from mooncake_ops.dispatch import implementation_name
from mooncake_ops.kernel_timing import AttentionShape, MatmulWeight
from mooncake_ops.moe_selection import choose_moe_kernels
from mooncake_ops.selection import KernelChoice, choose_kernels

# One layer's cache: (k_cache, v_cache) in the compute dtype, or for an int8 pool
# (k_cache, v_cache, k_scale, v_scale): int8 K/V and a float32 scale per token per KV head.
KVCache = tuple[torch.Tensor, ...]
Hidden = tuple[torch.Tensor, torch.Tensor]  # (hidden states, residual), both [num_tokens, hidden]
LayerHook = Callable[[int], None]  # called with a layer's model-wide index once it has run
# Every matmul weight a module may own (biases stay dense: the packed kernel takes them as they are).
_MATMUL_WEIGHTS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight", "lm_head_weight",
                   "q_weight", "q_a_weight", "q_b_weight", "kv_a_weight")  # the last four: MLA


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Attention(nn.Module):
    """Self-attention of one layer, for this rank's heads (with Qwen3's per-head q/k norms,
    ``q_norm`` / ``k_norm`` [head_dim], when ``config.qk_norm``; else they are None)."""

    def __init__(self, config: ModelConfig, plan: ShardPlan, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = len(plan.q_heads), len(plan.kv_heads)
        self.head_dim = config.shape.head_dim
        self.eps = config.rms_norm_eps
        self.q_norm = _empty(self.head_dim) if config.qk_norm else None
        self.k_norm = _empty(self.head_dim) if config.qk_norm else None
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_weight = _empty(self.q_size + 2 * self.kv_size, config.shape.hidden_size)
        self.qkv_bias = _empty(self.q_size + 2 * self.kv_size) if config.attention_bias else None
        self.o_weight = _empty(config.shape.hidden_size, self.q_size)
        self.tp = tp
        self.matmul = F.linear  # replaced by a packed kernel on CPU (see pack_linear_weights)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: PagedBatch,
                kv_cache: KVCache, rope: torch.Tensor, context_lens: torch.Tensor | None,
                shards: TokenShards | None = None) -> torch.Tensor:
        qkv = self.matmul(x, self.qkv_weight, self.qkv_bias) if shards is None else \
            shards.gather_linear(x, self.qkv_weight, self.qkv_bias, self.matmul)
        num_tokens = positions.shape[0]
        q, k, v = qkv[:num_tokens].split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # per head: over the last dim of [tokens, heads, head_dim]
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q, k = rotary_embedding(positions, q, k, rope, is_neox=True)
        k_cache, v_cache, *scales = kv_cache
        # int8 pool: the ops quantise on write and read the scales inside attention
        quant = {"k_scale": scales[0], "v_scale": scales[1]} if scales else {}
        write_kv(k, v, k_cache, v_cache, batch.slot_mapping, **quant)
        if context_lens is not None:  # decode only: K/V of the new token are in the cache now
            out = paged_decode_attention(q, k_cache, v_cache, batch.block_tables, context_lens,
                                         self.scale, **quant)
        else:
            out = paged_prefill_attention(q, k, v, k_cache, v_cache, batch.block_tables,
                                          batch.cached_lens, batch.query_lens, self.scale, **quant)
        out = out.reshape(num_tokens, self.q_size)
        if shards is not None:  # the pad rows go in here: the reduce-scatter takes tp*s rows
            return shards.linear_scatter_sum(shards.pad(out), self.o_weight, self.matmul)
        return self.tp.linear_all_reduce(out, self.o_weight, self.matmul)


class MLP(nn.Module):
    """SwiGLU feed-forward for this rank's intermediate columns: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, plan: ShardPlan, tp: TensorParallel) -> None:
        super().__init__()
        width = len(plan.intermediate)
        self.gate_up_weight = _empty(2 * width, config.shape.hidden_size)
        self.down_weight = _empty(config.shape.hidden_size, width)
        self.tp = tp
        self.matmul = F.linear
        # silu_and_mul(matmul(x, gate_up)) in one kernel, when the packing kernel has one
        self.gate_up_silu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, shards: TokenShards | None = None) -> torch.Tensor:
        if self.gate_up_silu is not None:  # packed weights: never with TP overlap (dense there)
            hidden = self.gate_up_silu(x if shards is None else shards.gather(x),
                                       self.gate_up_weight)
        elif shards is not None:
            hidden = silu_and_mul(shards.gather_linear(x, self.gate_up_weight, None, self.matmul))
        else:
            hidden = silu_and_mul(self.matmul(x, self.gate_up_weight))
        if shards is not None:
            return shards.linear_scatter_sum(hidden, self.down_weight, self.matmul)
        return self.tp.linear_all_reduce(hidden, self.down_weight, self.matmul)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); residual adds fused into the norms."""

    def __init__(self, config: ModelConfig, plan: ShardPlan, tp: TensorParallel,
                 index: int = 0) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_norm = _empty(config.shape.hidden_size)
        self.post_attention_norm = _empty(config.shape.hidden_size)
        self.self_attn: Attention | MLAttention = (
            MLAttention(config, plan, tp) if config.mla is not None else
            Attention(config, plan, tp))
        moe = config.moe
        self.mlp: MLP | SparseMoE = (
            SparseMoE(moe, config.shape.hidden_size, plan, tp)
            if moe is not None and moe.is_sparse(index) else MLP(config, plan, tp))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                batch: PagedBatch, kv_cache: KVCache, rope: torch.Tensor,
                context_lens: torch.Tensor | None,
                shards: TokenShards | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, rms_norm(x, self.input_norm, self.eps)
        else:
            x, residual = rms_norm(x, self.input_norm, self.eps, residual)
        x = self.self_attn(positions, x, batch, kv_cache, rope, context_lens, shards)
        x, residual = rms_norm(x, self.post_attention_norm, self.eps, residual)
        return self.mlp(x, shards), residual


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache; holds rank ``tp.rank``'s shard only.

    Args:
        config: the architecture.
        tp: this rank's tensor-parallel place; None means a single rank.
        stage: this rank's pipeline stage; None means the whole model. Only the first stage
            has ``embed_weight`` (and the last, for a tied LM head); only the last has ``norm``
            and ``lm_head_weight`` (others hold None there).
        sp: sequence parallelism over ``tp``'s group for long forwards (`SequenceParallel`);
            None: plain TP always.
        expert_parallel: an MoE model's experts split whole over ``tp``'s ranks
            (`plan_shards`).

    Raises:
        TensorParallelError: ``sp`` with pipeline stages (not wired: a stage would hand the
            next one a sharded residual stream).

    Parameters are created empty; `kthena_serve.model.load_model` fills them.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None,
                 stage: PipelineStage | None = None, sp: SequenceParallel | None = None, *,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel()
        self.stage = stage or PipelineStage.of(config.shape.num_layers)
        why = sp_with_pp_refusal(self.stage.size)
        if sp is not None and why is not None:
            raise TensorParallelError(f"{why}; use sp with pp=1")
        if sp is not None and config.mla is not None:
            raise TensorParallelError("sequence parallelism with latent attention (MLA) is not "
                                      "wired: its latent projections are replicated, not "
                                      "column-parallel; use sp=1")
        self.sp = sp
        self.plan = plan_shards(config, self.tp, expert_parallel=expert_parallel)
        first, last = self.stage.is_first, self.stage.is_last
        embed = first or (last and config.tie_word_embeddings)
        vocab, hidden = config.shape.vocab_size, config.shape.hidden_size
        self.embed_weight = _empty(vocab, hidden) if embed else None
        self.layers = nn.ModuleList(DecoderLayer(config, self.plan, self.tp, index)
                                    for index in self.stage.layers)
        self.norm = _empty(hidden) if last else None
        self.lm_head_weight = None
        if last:
            self.lm_head_weight = self.embed_weight if config.tie_word_embeddings else _empty(
                vocab, hidden)
        self.matmul = F.linear
        self.register_buffer("rope_cache", torch.empty(0), persistent=False)
        self.reset_rope_cache()
        self.decode_step = DecodeStepChoice("ops", "weights not packed")
        self._fused: tuple[tuple[int, ...], FusedDecode] | None = None

    @property
    def num_kv_heads_per_rank(self) -> int:
        """KV heads this rank caches (MLA: 1, its latent)."""
        return 1 if self.config.mla is not None else len(self.plan.kv_heads)

    @property
    def head_dim(self) -> int:
        """Values per cached head (MLA: the latent's kv_lora_rank + qk_rope_head_dim)."""
        return self.config.kv_head_dim

    @property
    def kv_parts(self) -> int:
        """Cached tensors per layer: 2 (K and V) or 1 (MLA's latent)."""
        return self.config.kv_parts

    def reset_rope_cache(self) -> None:
        """(Re)build the float32 RoPE cos/sin table on the model's device (on the CPU first,
        whatever default device is in force: the loader builds the model under
        ``torch.device("meta")``, where the table's ops would run torch's Python references
        and import torch._dynamo: 1.3 s of a 3.5 s engine start, for a table the loader
        rebuilds)."""
        c = self.config
        device = next(self.parameters()).device
        rotary = c.shape.head_dim if c.mla is None else c.mla.qk_rope_head_dim
        with torch.device("cpu"):
            table = build_rope_cache(rotary, c.max_position_embeddings, c.rope_theta,
                                     rope_scaling=c.rope_scaling)
        self.rope_cache = table.to(device=device, dtype=torch.float32)

    def quantize_linear_weights(self, kernels: str = "native", *, block_size: int = 16,
                                cache_dir: str | os.PathLike[str] | None = None
                                ) -> KernelChoice:
        """Weight-only int8: every matmul weight (the LM head too; the embedding keeps its
        dense table) becomes mooncake_ops' packed int8 form, one scale per output channel,
        and each owning module's ``matmul`` the int8 path chosen as ``pack_linear_weights``
        chooses (``auto``: the int8 paths timed at this model's shapes, per row class;
        ``native``: `INT8_WEIGHT_ONLY`'s fixed row counts; ``torch``: the weight dequantised
        into F.linear). Decode reads half the bytes of bf16; activations, norms, attention
        and the KV cache keep the compute dtype. Like packing, the last step of loading
        (after sharding: each rank quantises its shard).

        Raises:
            TensorParallelError: TP overlap is on (its fused ops take dense weights)."""
        if self.tp.fused is not None:
            raise TensorParallelError("int8 weights with TP overlap are not wired: the fused "
                                      "matmul + collective ops take dense weights; drop one")
        if self.config.moe is not None:
            raise UnsupportedModelError("int8 weights for an MoE model are not wired: the "
                                        "grouped expert matmul takes dense weights; allowed: "
                                        "quantization none (the model's dtype)")
        return self.pack_linear_weights(kernels, block_size=block_size, cache_dir=cache_dir,
                                        quantization="int8")

    def use_gguf_weights(self, blocks: Mapping[str, torch.Tensor], kernels: str = "native", *,
                         block_size: int = 16, cache_dir: str | os.PathLike[str] | None = None
                         ) -> KernelChoice:
        """GGUF weights as the file quantized them (``--quantization gguf``): each matmul weight
        named in ``blocks`` (``layers.3.self_attn.qkv_weight``, ``lm_head_weight``: packed GGUF
        blocks of this rank's shard, `mooncake_ops.pack_gguf_weight`) replaces the dense one,
        and every module owning a matmul weight runs `GGUF_WEIGHT_ONLY` (``torch``:
        `GGUF_DEQUANT_DENSE`). Weights absent from ``blocks`` (a GGUF F16 / F32 tensor, a type
        the native matmul does not read such as Q5_0, or a fused weight whose parts differ in
        type, as Q4_K_M's Q6_K ``attn_v`` beside Q4_K q / k) are bf16 as the loader dequantised
        them: packed for the native bf16 matmul where it is the fused step's (`dense_gguf_kernel`),
        so the fused decode step takes the model; else dense, run by F.linear. The embedding
        keeps its dense table. Attention is chosen as
        ``pack_linear_weights`` chooses it; the matmul kernel is fixed (it has no dense
        candidates to time against on the same weights).

        Raises:
            TensorParallelError: TP overlap is on (its fused ops take dense weights).
            UnsupportedModelError: an MoE or MLA model (their weights are not wired)."""
        if self.tp.fused is not None:
            raise TensorParallelError("GGUF weights with TP overlap are not wired: the fused "
                                      "matmul + collective ops take dense weights; drop one")
        if self.config.moe is not None or self.config.mla is not None:
            raise UnsupportedModelError("GGUF weights are wired for dense Llama-family models; "
                                        "allowed for MoE / MLA: quantization none or int8")
        attention = self._attention_shape(block_size)
        choice = choose_kernels(kernels, [], None, attention, cache_dir=cache_dir)
        kernel = GGUF_DEQUANT_DENSE if choice.mode == "torch" else GGUF_WEIGHT_ONLY
        dense = None if kernel is GGUF_DEQUANT_DENSE else dense_gguf_kernel(next(self.parameters()))
        self._swap_matmul_weights(kernel, blocks, dense)
        if attention is not None:
            choice.apply()
        self.kernel_choice = attrs.evolve(choice, linear_decode=kernel.name,
                                          linear_prefill=kernel.name)
        self.decode_step = choose_decode_step(self, kernels, block_size)
        return self.kernel_choice

    def _attention_shape(self, block_size: int) -> AttentionShape | None:
        """The attention shape the kernel choice times (None off the CPU, and for MLA)."""
        sample = next(self.parameters())
        if sample.device.type != "cpu" or self.config.mla is not None:  # MLA: its own op
            return None
        return AttentionShape(len(self.plan.q_heads), self.num_kv_heads_per_rank,
                              self.head_dim, block_size, sample.dtype)

    def pack_linear_weights(self, kernels: str = "native", *, block_size: int = 16,
                            cache_dir: str | os.PathLike[str] | None = None,
                            quantization: str | None = None) -> KernelChoice:
        """Re-lay every matmul weight out for the CPU linear kernel chosen here, when there is one.

        The choice (`mooncake_ops.selection.choose_kernels`): ``auto`` times every kernel that
        can run this model's own weights and attention shape on this machine (cached under
        ``cache_dir``), ``native`` picks by the CPU's features, ``torch`` keeps F.linear and
        SDPA. The chosen attention is applied process-wide. Each module owning one of the
        weights gets the kernel's ``linear`` as its ``matmul``; a tied LM head gets its own
        packed copy (the embedding keeps the dense table). The packed tensors cannot be sliced
        or saved, so this is the last step of loading, after sharding.

        Returns:
            The choice (kept as ``self.kernel_choice``; its ``linear_decode`` is None when no
            packed kernel runs this dtype and device: F.linear stays).
        """
        layers = [[MatmulWeight(getattr(module, name), name == "gate_up_weight")
                   for module in (layer.self_attn, layer.mlp, getattr(layer.mlp, "shared", None))
                   for name in _MATMUL_WEIGHTS
                   if isinstance(getattr(module, name, None), torch.Tensor)]
                  for layer in self.layers]
        head = None if self.lm_head_weight is None else MatmulWeight(self.lm_head_weight)
        attention = self._attention_shape(block_size)
        choice = choose_kernels(kernels, layers, head, attention, cache_dir=cache_dir,
                                quantization=quantization)
        kernel = choice.linear_kernel()
        if kernel is None and quantization == "int8":
            kernel = INT8_WEIGHT_ONLY  # off the CPU: the int8 op's device implementation
        if kernel is not None:
            self._swap_matmul_weights(kernel)
        if attention is not None:
            choice.apply()
        self.kernel_choice = choice
        self._pack_experts(kernels, cache_dir)
        self.decode_step = choose_decode_step(self, kernels, block_size)
        return choice

    def _pack_experts(self, kernels: str, cache_dir: str | os.PathLike[str] | None) -> None:
        """An MoE model's experts packed for the grouped kernels chosen here for their shape
        (`mooncake_ops.moe_selection.choose_moe_kernels`: timed once per machine under
        ``auto``); the choice is ``self.moe_kernel_choice`` (None for a dense model)."""
        layers = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
        self.moe_kernel_choice = None
        if not layers:
            return
        first = layers[0]
        self.moe_kernel_choice = choose_moe_kernels(
            kernels, first.experts_gate_up, first.experts_down, first.rule.top_k,
            cache_dir=cache_dir)
        for layer in layers:
            layer.pack(self.moe_kernel_choice)

    def _fused_weights(self) -> frozenset[str]:
        """The matmul weights that TP overlap's fused ops take (``tp.fused``), which stay dense:
        the row-parallel ones, and under SP the column-parallel ones after an all-gather."""
        if self.tp.fused is None:
            return frozenset()
        gathered = ("qkv_weight", "gate_up_weight") if self.sp is not None else ()
        return frozenset(("o_weight", "down_weight", *gathered))

    def _swap_matmul_weights(self, kernel: LinearKernel,
                             sources: Mapping[str, torch.Tensor] | None = None,
                             unsourced: LinearKernel | None = None) -> None:
        """Every matmul weight -> ``kernel.pack(weight)`` (a non-persistent buffer), and each
        owning module's ``matmul`` -> ``kernel.linear``; an MLP's gate/up weight goes to the
        kernel's fused SwiGLU input instead where it has one (``pack_gate_up``). ``sources``
        (by qualified name) replaces a weight with what ``kernel.pack`` takes instead (GGUF
        blocks); a weight not in ``sources`` goes to ``unsourced``'s packing instead where
        given (``kernel.linear`` runs what it packs, `dense_gguf_kernel`). The weights TP
        overlap's fused ops take stay dense (`_fused_weights`): those ops take plain
        ``[out, in]`` tensors."""
        dense, sources = self._fused_weights(), sources or {}
        for prefix, module in self.named_modules():
            owned = [name for name in _MATMUL_WEIGHTS if name not in dense
                     and isinstance(getattr(module, name, None), torch.Tensor)]
            for name in owned:
                weight = sources.get(f"{prefix}.{name}" if prefix else name)
                packer = kernel
                if weight is None:
                    weight = getattr(module, name)
                    packer = unsourced or kernel
                packed = None
                if name == "gate_up_weight" and packer.pack_gate_up is not None:
                    packed = packer.pack_gate_up(weight)  # fused SwiGLU input
                    if packed is not None:
                        module.gate_up_silu = packer.gate_up_silu
                if packed is None:
                    packed = packer.pack(weight)
                module._parameters.pop(name, None)
                module.__dict__.pop(name, None)
                module.register_buffer(name, packed, persistent=False)
            if owned:
                module.matmul = kernel.linear

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch,
                kv_caches: Sequence[KVCache], on_layer: LayerHook | None = None, *,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step of the whole model; float32 logits [num_seqs, vocab] at
        ``batch.logits_indices`` (or [len(logits_index), vocab] at the packed token positions
        ``logits_index``: prompt logprobs want every position of a chunk). ``on_layer(layer)``
        (see `forward_stage`) runs after each layer.

        Raises:
            BatchError: the token count or the number of KV caches does not match, or this
                model holds one stage of several (use `forward_stage`).
        """
        if self.stage.size > 1:
            raise BatchError(f"this model holds pipeline stage {self.stage.rank} of "
                             f"{self.stage.size}; run it with forward_stage")
        out = self.forward_stage(input_ids, positions, batch, kv_caches, on_layer=on_layer,
                                 logits_index=logits_index)
        assert isinstance(out, torch.Tensor)
        return out

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      batch: PagedBatch, kv_caches: Sequence[KVCache],
                      hidden: Hidden | None = None, *, on_layer: LayerHook | None = None,
                      logits_index: torch.Tensor | None = None) -> torch.Tensor | Hidden:
        """Run this stage's layers: from the token ids (first stage) or the previous stage's
        ``hidden`` pair; returns logits (last stage, as `forward`) or the pair for the next.

        ``on_layer(layer)`` is called with the model-wide index of each layer as soon as it
        has run, i.e. once this step's K/V of that layer are in ``kv_caches`` (on an
        accelerator, once they are queued on its stream: the hook synchronises as it needs).
        The model makes no other call through it; a PD prefill worker injects one that pushes
        the layer's blocks to the decode worker while the next layers compute.

        Raises:
            BatchError: as `forward`, or ``hidden`` given to the first stage / missing on others.
        """
        self._check_inputs(input_ids, positions, batch, kv_caches)
        if self.stage.is_first != (hidden is None):
            raise BatchError(f"pipeline stage {self.stage.rank}: the first stage takes token ids "
                             "only, every later stage the previous stage's (hidden, residual)")
        context_lens = batch.context_lens if batch.is_decode_only else None  # cached + 1
        shards = None if self.sp is None else self.sp.shards(self.tp, batch.num_tokens,
                                                             batch.is_decode_only)
        if hidden is None:
            ids = input_ids if shards is None else shards.local(input_ids)
            x, residual = F.embedding(ids, self.embed_weight), None
        else:
            x, residual = hidden
        fused = None
        if context_lens is not None and on_layer is None and residual is None \
                and batch.num_tokens <= self.decode_step.max_rows:
            fused = self._fused_decode(kv_caches)
        if fused is not None and fused.has_head and logits_index is None:
            # the layers, the final norm and the LM head in one native call (decode: every
            # row, in order; mooncake_ops.decode_step)
            return fused.logits(x, positions, batch.slot_mapping, batch.block_tables,
                                batch.context_lens, self.rope_cache)
        if fused is not None:  # the layers in one native call
            x, residual = fused.run(x, positions, batch.slot_mapping, batch.block_tables,
                                    batch.context_lens, self.rope_cache)
        else:
            for index, layer, kv_cache in zip(self.stage.layers, self.layers, kv_caches,
                                              strict=True):
                x, residual = layer(positions, x, residual, batch, kv_cache, self.rope_cache,
                                    context_lens, shards)
                if on_layer is not None:
                    on_layer(index)
        if not self.stage.is_last:
            return x, residual
        index = batch.logits_indices if logits_index is None else logits_index
        if shards is not None:
            x, residual = shards.rows(x, residual, index)
        elif logits_index is not None or not batch.is_decode_only:  # decode: every row, in order
            x, residual = x[index], residual[index]
        x, _ = rms_norm(x, self.norm, self.config.rms_norm_eps, residual)
        return self.matmul(x, self.lm_head_weight).float()

    def _fused_decode(self, kv_caches: Sequence[KVCache]) -> FusedDecode | None:
        """The fused step over these caches (built on first use, again when the caches are
        other tensors), or None when `decode_step` did not choose it."""
        if self.decode_step.name != "fused" or any(
                len(cache) != 2 or cache[0].dtype != torch.bfloat16 for cache in kv_caches):
            return None  # an int8 pool: the ops (the step reads a bf16 cache)
        key = tuple(cache[0].data_ptr() for cache in kv_caches)
        if self._fused is None or self._fused[0] != key:
            try:
                fused = FusedDecode(_decode_layers(self, kv_caches), **_shape(self))
            except ValueError as error:  # a tensor the step does not take: the ops, said once
                logging.getLogger(__name__).warning("decode steps run as ops: %s", error)
                self.decode_step = DecodeStepChoice("ops", str(error))
                return None
            if self.stage.is_last and self.lm_head_weight is not None:
                try:  # on to the logits in the same call
                    fused.set_head(DecodeHead(self.norm, self.lm_head_weight))
                except ValueError as error:  # a head the step does not take: the head as ops
                    logging.getLogger(__name__).warning("the LM head runs after the fused step: "
                                                        "%s", error)
            self._fused = (key, fused)
        return self._fused[1]

    def _check_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      batch: PagedBatch, kv_caches: Sequence[KVCache]) -> None:
        if input_ids.shape != positions.shape or input_ids.shape[0] != batch.num_tokens:
            raise BatchError(f"input_ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)} "
                             f"and slot_mapping ({batch.num_tokens},) must all be [num_tokens]")
        if len(kv_caches) != len(self.layers):
            raise BatchError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers; "
                             f"pass one (k_cache, v_cache) pair per layer (int8: and k_scale, v_scale)")


# ---- the fused decode step -----------------------------------------------------------------------
@attrs.frozen
class DecodeStepChoice:
    """How decode steps run the layers: ``fused`` (one native call, `FusedDecode`) or ``ops``
    (one call per op), why, and the timings that chose it (ms per batch-1 step; empty when
    not timed)."""

    name: str
    reason: str
    timings_ms: Mapping[str, float] = attrs.field(factory=dict)
    max_rows: int = FUSED_MAX_ROWS


def fused_decode_refusal(model: LlamaForCausalLM) -> str | None:
    """Why the fused step cannot run this model's decode here (None: it can)."""
    if not fused_decode_available():
        return ("no native build with the fused step on this CPU (the AVX-512 one needs "
                "AVX512_BF16; the AVX2 one AVX2)")
    c = model.config
    if c.mla is not None or any(isinstance(layer.mlp, SparseMoE) for layer in model.layers):
        return "an MLA or MoE model (the step chains dense Llama layers)"
    if model.tp.world_size > 1 or model.sp is not None or model.stage.size > 1:
        return "more than one rank (the step has no collectives)"
    choice = getattr(model, "kernel_choice", None)
    matmuls = (step_bf16_kernel().name, INT8_WEIGHT_ONLY.name, GGUF_WEIGHT_ONLY.name)
    if choice is None or choice.split or choice.linear_decode not in matmuls:
        return f"the matmul kernel is not one of {', '.join(matmuls)}"
    if model.layers[0].input_norm.dtype != torch.bfloat16:
        return "activations are not bf16"
    if implementation_name("paged_decode_attention", "cpu") != "native-cpp":
        return "decode attention is not the native kernel"
    shape, attn = c.shape, model.layers[0].self_attn
    if attn.head_dim not in (64, 128, 256) or attn.num_heads // attn.num_kv_heads > 16:
        return "head_dim is not 64, 128 or 256, or a KV head has more than 16 query heads"
    if shape.hidden_size % 32 or (model.rope_cache.shape[1] // 2) % 16:
        return "hidden size not a multiple of 32, or rotary dim not of 32"
    # bf16 weights: packed with gate/up for the fused SwiGLU (AVX-512), or dense (AVX2)
    packed = step_bf16_kernel().pack_gate_up is not None
    quantized = (torch.uint8, torch.int8)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights = (attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight)
        if not all(w.dtype in quantized or w.dim() == (4 if packed else 2) for w in weights) or (
                packed and mlp.gate_up_weight.dtype not in quantized and mlp.gate_up_silu is None):
            return (f"a matmul weight is not bf16 as {step_bf16_kernel().name} lays it out, int8 "
                    "rows or GGUF blocks")
    return None


def _decode_layers(model: LlamaForCausalLM, kv_caches: Sequence[KVCache]) -> list[DecodeLayer]:
    return [DecodeLayer(layer.input_norm, layer.post_attention_norm, layer.self_attn.qkv_weight,
                        layer.self_attn.qkv_bias, layer.self_attn.q_norm, layer.self_attn.k_norm,
                        layer.self_attn.o_weight, layer.mlp.gate_up_weight, layer.mlp.down_weight,
                        cache[0], cache[1])
            for layer, cache in zip(model.layers, kv_caches, strict=True)]


def _shape(model: LlamaForCausalLM) -> dict:
    attn = model.layers[0].self_attn
    return {"num_heads": attn.num_heads, "num_kv_heads": attn.num_kv_heads,
            "head_dim": attn.head_dim, "eps": model.config.rms_norm_eps, "scale": attn.scale}


def choose_decode_step(model: LlamaForCausalLM, kernels: str, block_size: int) -> DecodeStepChoice:
    """``torch``: the ops; ``native``: fused wherever it can run; ``auto``: both timed on this
    model's weights (batch-1 steps over a 128-token context in a scratch cache, interleaved
    rounds, medians), the faster kept."""
    if kernels == "torch":
        return DecodeStepChoice("ops", "--kernels torch")
    why = fused_decode_refusal(model)
    if why is not None:
        return DecodeStepChoice("ops", why)
    rows = max_fused_rows(model.kernel_choice.linear_decode)
    if kernels != "auto":
        return DecodeStepChoice("fused", "the fused step runs here (chosen by features)",
                                max_rows=rows)
    try:
        timings = time_decode_step(model, block_size)
    except ValueError as error:  # a tensor the native step does not take
        return DecodeStepChoice("ops", str(error))
    name = "fused" if timings["fused"] < timings["ops"] else "ops"
    return DecodeStepChoice(name, "timed: the faster at batch 1", timings, rows)


def time_decode_step(model: LlamaForCausalLM, block_size: int, *, context: int = 128,
                     rounds: int = 15) -> dict[str, float]:
    """Median ms of a batch-1 decode step through the layers, fused and as ops."""
    import statistics
    import time

    from mooncake_ops.decode_step import reference_layers

    attn = model.layers[0].self_attn
    blocks = context // block_size + 1
    caches = [tuple(torch.zeros(blocks, block_size, attn.num_kv_heads, attn.head_dim,
                                dtype=torch.bfloat16) for _ in range(2)) for _ in model.layers]
    layers, shape = _decode_layers(model, caches), _shape(model)
    fused = FusedDecode(layers, **shape)
    x = model.embed_weight[:1].clone()
    positions = torch.tensor([context - 1])
    slots = torch.tensor([context - 1])
    tables = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    lens = torch.tensor([context], dtype=torch.int32)
    args = (x, positions, slots, tables, lens, model.rope_cache)
    runs = {"fused": lambda: fused.run(*args),
            "ops": lambda: reference_layers(layers, *args, **shape)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(rounds + 2):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if round_ >= 2:  # two warm-up rounds
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: round(statistics.median(t), 4) for name, t in times.items()}
