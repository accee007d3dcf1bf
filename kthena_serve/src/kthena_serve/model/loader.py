"""Load a Hugging Face checkpoint folder into `LlamaForCausalLM`, sharded for this TP rank.

Each HF tensor is read (a slice of it, under TP) straight from the memory-mapped safetensors file
into its place in a fused parameter::

    qkv_weight     [ q rows of my q heads | k rows of my kv heads | v rows of my kv heads ]
    gate_up_weight [ gate rows of my columns | up rows of my columns ]
    o_weight, down_weight: the matching input columns (row-parallel)
    norms (Qwen3's per-head q_norm / k_norm too): whole, on every rank
    MLA (DeepSeek): this rank's heads' rows of q_b / q_proj and kv_b, its o_proj columns, the
    latent projections whole (`kthena_serve.model.mla_weights`)
    MoE layers: each expert's gate/up/down shard into its slot of the stacked expert tensors,
    the router whole (`kthena_serve.model.moe_weights`)

``quantization="gguf"`` loads the dense model the same way, then replaces each matmul weight by
the GGUF file's own blocks for the same rows (`gguf_matmul_blocks`): the same targets place each
tensor's block rows (Q/K un-permuted, a column shard cut at block boundaries) in its fused
weight, and the fused weight is packed (`mooncake_ops.pack_gguf_weight`) when its parts cover it
in one GGUF type; otherwise it stays in ``dtype`` (bf16: packed for the native bf16 matmul,
`LlamaForCausalLM.use_gguf_weights`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from kthena_serve.model._gguf_weights import iter_quantized_matmuls
from kthena_serve.model.config import ModelConfig
from kthena_serve.model.convert import default_cache_dir
from kthena_serve.model.errors import CheckpointError
from kthena_serve.model.llama import LlamaForCausalLM
from kthena_serve.model.mla_weights import mla_target, mla_weight_names
from kthena_serve.model.moe import SparseMoE
from kthena_serve.model.moe_weights import moe_target, moe_weight_names
from kthena_serve.model.pp import PipelineStage
from kthena_serve.model.source import resolve_checkpoint
from kthena_serve.model.sp import SequenceParallel
from kthena_serve.model.tokenizer import Tokenizer
from kthena_serve.model.tp import TensorParallel
from mooncake_ops import GGUF_TYPES, GGUFType, gguf_type, pack_gguf_weight
from mooncake_ops.selection import resolve_mode

# (destination tensor, dim the source is sliced on (None: whole), source range on that dim,
#  the source's full size on that dim)
_Target = tuple[torch.Tensor, int | None, range | None, int | None]
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP_KINDS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_LAYER_KINDS = (*_QKV, "self_attn.o_proj", *_MLP_KINDS, "input_layernorm",
                "post_attention_layernorm")
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")  # Qwen3: [head_dim], one per layer each
QUANTIZATIONS = (None, "int8", "gguf")


def load_model(path_or_default: str | os.PathLike[str] = "default", *, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cpu",
               tp: TensorParallel | None = None,
               stage: PipelineStage | None = None,
               pack_weights: bool = True,
               quantization: str | None = None,
               kernels: str = "auto",
               kv_block_size: int = 16,
               sp: SequenceParallel | None = None,
               expert_parallel: bool = False) -> tuple[LlamaForCausalLM, Tokenizer]:
    """Build the model (this rank's shard) and its tokenizer from a checkpoint folder.

    Args:
        path_or_default: ``"default"`` (SmolLM2-135M-Instruct, converted once from the embedded
            GGUF), a local Hugging Face checkpoint folder, a llama ``.gguf`` file or a Hub repo
            id ``ORG/NAME`` (`kthena_serve.model.source.resolve_checkpoint`).
        dtype: weight dtype (the checkpoint's values are cast to it).
        device: where the weights live.
        tp: this rank's tensor-parallel place; None means one rank.
        stage: this rank's pipeline stage (only its layers, and the embedding / LM head where
            it needs them, are read); None means the whole model.
        pack_weights: on CPU with bf16, pack the matmul weights for the kernel ``kernels``
            chooses (the packed model has no dense matmul weights left to save or slice).
        kernels: ``auto`` (time every kernel that can run this model here, once per machine:
            cached under `default_cache_dir`), ``native`` (by the CPU's features) or ``torch``
            (`mooncake_ops.selection`); no environment variable overrides it (``KTHENA_KERNELS``
            is only `EngineConfig.kernels`' default). The choice is ``model.kernel_choice``.
        kv_block_size: the KV cache's tokens per block (the attention timings use it).
        quantization: ``"int8"``: weight-only int8 matmul weights, one scale per output channel
            (`LlamaForCausalLM.quantize_linear_weights`; replaces packing); ``"gguf"``: a GGUF
            file's (``"default"`` or a ``.gguf`` path) Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K
            matmul weights as stored, the LM head too (`gguf_matmul_blocks`,
            `LlamaForCausalLM.use_gguf_weights`; replaces packing; the embedding and other
            types stay dense in ``dtype``); None: ``dtype``.
        sp: sequence parallelism over ``tp``'s group for long forwards
            (`kthena_serve.model.sp`); None: plain TP.
        expert_parallel: an MoE model's experts split whole over ``tp``'s ranks.

    Raises:
        ValueError: an unknown ``quantization`` or ``kernels``; ``"gguf"`` for a model that is
            not a GGUF file.
        CheckpointError: the folder is incomplete, or a weight is missing or mis-shaped.
        UnsupportedModelError: the architecture is not Llama-family.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: None or 'int8' (weight-only int8), "
                         "or 'gguf' (a GGUF file's own quantized weights)")
    gguf_file = gguf_source(path_or_default) if quantization == "gguf" else None
    mode = resolve_mode(kernels)
    folder = resolve_checkpoint(path_or_default)
    config = ModelConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp, stage, sp, expert_parallel=expert_parallel)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings and model.lm_head_weight is not None:
        model.lm_head_weight = model.embed_weight
    load_weights(model, folder)
    model.reset_rope_cache()
    if gguf_file is not None:
        model.use_gguf_weights(gguf_matmul_blocks(model, gguf_file), mode,
                               block_size=kv_block_size, cache_dir=default_cache_dir())
    elif quantization == "int8":
        model.quantize_linear_weights(mode, block_size=kv_block_size,
                                      cache_dir=default_cache_dir())
    elif pack_weights:
        model.pack_linear_weights(mode, block_size=kv_block_size, cache_dir=default_cache_dir())
    return model.eval(), Tokenizer.from_pretrained(folder)


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, folder: str | os.PathLike[str]) -> None:
    """Copy every checkpoint tensor's shard for this rank into `model`.

    Raises:
        CheckpointError: a tensor has the wrong shape, or a model weight is absent from the files.
    """
    from safetensors import safe_open

    seen: set[str] = set()
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                target = _target(model, name)
                if target is not None:
                    _copy(*target, f.get_slice(name), name)
                    seen.add(name)
    missing = sorted(expected_weight_names(model.config, model.stage, model.plan.experts) - seen)
    if missing:
        raise CheckpointError(f"the checkpoint in {folder} lacks {len(missing)} weights the model "
                              f"needs, e.g. {', '.join(missing[:3])}")


def expected_weight_names(config: ModelConfig, stage: PipelineStage | None = None,
                          experts: range | None = None) -> set[str]:
    """The HF tensor names a checkpoint of `config` must contain (for `stage` only, and of an
    MoE model's routed experts those in `experts` only, if given)."""
    stage = stage or PipelineStage.of(config.shape.num_layers)
    names = set()
    if stage.is_first or (stage.is_last and config.tie_word_embeddings):
        names.add("model.embed_tokens.weight")
    if stage.is_last:
        names.add("model.norm.weight")
        if not config.tie_word_embeddings:
            names.add("lm_head.weight")
    per_layer = [f"{kind}.weight" for kind in _LAYER_KINDS]
    if config.mla is not None:
        attention = {f"{kind}.weight" for kind in (*_QKV, "self_attn.o_proj")}
        per_layer = [n for n in per_layer if n not in attention] + mla_weight_names(config.mla)
    if config.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if config.qk_norm:
        per_layer += [f"{kind}.weight" for kind in _QK_NORMS]
    moe, dense = config.moe, set(_MLP_KINDS)
    sparse = [n for n in per_layer if n.removesuffix(".weight") not in dense]
    sparse += [] if moe is None else moe_weight_names(moe, experts)
    return names | {f"model.layers.{i}.{n}" for i in stage.layers
                    for n in (sparse if moe is not None and moe.is_sparse(i) else per_layer)}


def _copy(dest: torch.Tensor, dim: int | None, src: range | None, full: int | None,
          source: Any, name: str) -> None:
    if dim is not None and source.get_shape()[dim] != full:
        raise CheckpointError(f"checkpoint tensor {name} has shape {tuple(source.get_shape())} but the "
                              f"model expects {full} along dim {dim}; does config.json match the weights?")
    if dim is None:
        value = source[:]
    elif dim == 0:
        value = source[src.start:src.stop]
    else:
        value = source[:, src.start:src.stop]
    if tuple(value.shape) != tuple(dest.shape):
        raise CheckpointError(f"checkpoint tensor {name} gives shape {tuple(value.shape)} but the "
                              f"model expects {tuple(dest.shape)}; does config.json match the weights?")
    dest.copy_(value)


def _target(model: LlamaForCausalLM, name: str) -> _Target | None:
    if name == "model.embed_tokens.weight":
        return None if model.embed_weight is None else (model.embed_weight, None, None, None)
    if name == "lm_head.weight" and not model.config.tie_word_embeddings:
        return None if model.lm_head_weight is None else (model.lm_head_weight, None, None, None)
    if name == "model.norm.weight":
        return None if model.norm is None else (model.norm, None, None, None)
    match = _LAYER.match(name)
    if match is None or not model.stage.holds(int(match.group(1))):
        return None  # not a layer, or another pipeline stage's
    kind, _, suffix = match.group(2).rpartition(".")
    layer = model.layers[int(match.group(1)) - model.stage.layers.start]
    mla = model.config.mla
    if mla is not None and kind.startswith("self_attn."):
        return None if suffix != "weight" else mla_target(
            layer.self_attn, model.plan, mla, model.config.shape.num_attention_heads, kind)
    if suffix == "bias" and kind in _QKV and layer.self_attn.qkv_bias is not None:
        return _qkv_target(model, layer.self_attn.qkv_bias, kind)
    if suffix == "weight" and kind in _QK_NORMS and model.config.qk_norm:
        # per head, so each rank applies the whole (replicated) weight to its own heads
        return getattr(layer.self_attn, kind.removeprefix("self_attn.")), None, None, None
    if isinstance(layer.mlp, SparseMoE) and (kind.startswith(f"{model.config.moe.prefix}.")):
        return moe_target(layer.mlp, model.plan, model.config.moe, match.group(2))
    if suffix != "weight" or kind not in _LAYER_KINDS:
        return None
    if kind in _QKV:
        return _qkv_target(model, layer.self_attn.qkv_weight, kind)
    return _other_target(model, layer, kind)


def _qkv_target(model: LlamaForCausalLM, fused: torch.Tensor, kind: str) -> _Target:
    plan, shape = model.plan, model.config.shape
    hd = shape.head_dim
    q, kv = len(plan.q_heads) * hd, len(plan.kv_heads) * hd
    if kind == "self_attn.q_proj":
        q_rows = range(plan.q_heads.start * hd, plan.q_heads.stop * hd)
        return fused[:q], 0, q_rows, shape.num_attention_heads * hd
    rows = range(plan.kv_heads.start * hd, plan.kv_heads.stop * hd)
    dest = fused[q:q + kv] if kind == "self_attn.k_proj" else fused[q + kv:]
    return dest, 0, rows, shape.num_kv_heads * hd


def _other_target(model: LlamaForCausalLM, layer: Any, kind: str) -> _Target | None:
    plan, shape = model.plan, model.config.shape
    hd = shape.head_dim
    q_cols = range(plan.q_heads.start * hd, plan.q_heads.stop * hd)
    if kind == "input_layernorm":
        return layer.input_norm, None, None, None
    if kind == "post_attention_layernorm":
        return layer.post_attention_norm, None, None, None
    if kind == "self_attn.o_proj":
        return layer.self_attn.o_weight, 1, q_cols, shape.num_attention_heads * hd
    if isinstance(layer.mlp, SparseMoE):
        return None  # a dense MLP's name in a sparse layer: not this model's tensor
    width, gate_up = len(plan.intermediate), layer.mlp.gate_up_weight
    inter = shape.intermediate_size
    return {
        "mlp.gate_proj": (gate_up[:width], 0, plan.intermediate, inter),
        "mlp.up_proj": (gate_up[width:], 0, plan.intermediate, inter),
        "mlp.down_proj": (layer.mlp.down_weight, 1, plan.intermediate, inter),
    }[kind]


def gguf_source(path_or_default: str | os.PathLike[str]) -> Path:
    """The GGUF file ``quantization="gguf"`` reads: the default model's, or a ``.gguf`` file.

    Raises:
        ValueError: ``path_or_default`` is neither (a checkpoint folder has no GGUF blocks).
    """
    text = os.fspath(path_or_default)
    if text == "default":
        from kthena_core.known_models import default_gguf_path

        return Path(default_gguf_path())
    if text.endswith(".gguf") and Path(text).is_file():
        return Path(text)
    raise ValueError(f"quantization='gguf' serves a GGUF file's own quantized weights: the "
                     f"model must be 'default' or a .gguf file; got {text!r} (for a checkpoint "
                     "folder use quantization None or 'int8')")


# (row offset in the fused weight, type, block rows [rows, blocks, block_bytes])
_Part = tuple[int, GGUFType, torch.Tensor]


def gguf_matmul_blocks(model: LlamaForCausalLM, gguf_path: str | os.PathLike[str]
                       ) -> dict[str, torch.Tensor]:
    """This rank's matmul weights as packed GGUF blocks, by qualified name (the model's
    ``layers.3.self_attn.qkv_weight``, ``lm_head_weight``): what `use_gguf_weights` takes.

    A fused weight is packed when its parts cover it in one GGUF type; a part of another type
    (e.g. Q4_K_M's Q6_K ``attn_v`` beside Q4_K q / k) or a dense part leaves it dense.

    Raises:
        CheckpointError: a tensor's shape does not match the model, or a column shard (TP)
            would split a GGUF block.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    hf = {"num_attention_heads": model.config.shape.num_attention_heads,
          "num_key_value_heads": model.config.shape.num_kv_heads}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    parts: dict[str, list[_Part]] = {}
    for name, kind, rows in iter_quantized_matmuls(reader, hf, GGUF_TYPES):
        placed = _gguf_part(model, names, name, gguf_type(kind), rows)
        if placed is not None:
            parts.setdefault(placed[0], []).append(placed[1])
    packed = {}
    for qualified, found in parts.items():
        found.sort(key=lambda part: part[0])
        kinds = {part[1] for part in found}
        rows = torch.cat([part[2] for part in found])
        size = _param(model, qualified).shape
        if len(kinds) == 1 and rows.shape[0] == size[0]:
            packed[qualified] = pack_gguf_weight(rows, kinds.pop(), size[1])
    return packed


def _param(model: LlamaForCausalLM, qualified: str) -> torch.Tensor:
    module, _, name = qualified.rpartition(".")
    return getattr(model.get_submodule(module) if module else model, name)


def _gguf_part(model: LlamaForCausalLM, names: dict[int, str], name: str, kind: GGUFType,
               rows: torch.Tensor) -> tuple[str, _Part] | None:
    """Where a GGUF matmul tensor's blocks go: (qualified weight, part); None for a tensor this
    rank does not hold (another stage's, or the embedding of an untied LM head)."""
    tied = model.config.tie_word_embeddings and name == "model.embed_tokens.weight"
    if name == "lm_head.weight" or tied:
        head = model.lm_head_weight
        target = None if head is None else (head, None, None, None)
    else:
        target = None if name == "model.embed_tokens.weight" else _target(model, name)
    if target is None:
        return None
    dest, dim, src, full = target
    blocks = rows.reshape(rows.shape[0], -1, kind.block_bytes)
    if dim is not None and (blocks.shape[0] if dim == 0 else blocks.shape[1] * kind.block_size) != full:
        raise CheckpointError(f"GGUF tensor {name} has {tuple(blocks.shape)} {kind.name} blocks but "
                              f"the model expects {full} along dim {dim}")
    if dim == 0:
        blocks = blocks[src.start:src.stop]
    elif dim == 1:
        if src.start % kind.block_size or src.stop % kind.block_size:
            raise CheckpointError(f"{name}: this rank's columns {src.start}..{src.stop} split "
                                  f"{kind.name} blocks of {kind.block_size}; use a tp whose "
                                  "shards are whole blocks, or quantization None / int8")
        blocks = blocks[:, src.start // kind.block_size:src.stop // kind.block_size]
    if (blocks.shape[0], blocks.shape[1] * kind.block_size) != tuple(dest.shape):
        raise CheckpointError(f"GGUF tensor {name} gives {blocks.shape[0]} x "
                              f"{blocks.shape[1] * kind.block_size} but the model expects "
                              f"{tuple(dest.shape)}; does the file match config.json?")
    fused = dest if dest._base is None else dest._base
    offset = (dest.data_ptr() - fused.data_ptr()) // (fused.stride(0) * fused.element_size())
    qualified = "lm_head_weight" if target[0] is model.lm_head_weight else names[id(fused)]
    return qualified, (offset, kind, blocks)
