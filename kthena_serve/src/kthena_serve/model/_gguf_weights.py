"""GGUF tensors and metadata -> Hugging Face Llama weights and ``config.json`` (private).

llama.cpp's converter renames every tensor and, for Llama, reorders the rows of ``attn_q`` /
``attn_k`` so that its RoPE kernel can rotate adjacent pairs (GPT-J style) instead of the two
halves of each head (NeoX style, which HF checkpoints use). Per head of ``head_dim`` rows::

    HF rows      [x0 x1 ... x31 | y0 y1 ... y31]     (half 0 | half 1)
    GGUF rows    [x0 y0 x1 y1 ... x31 y31]           (pairs interleaved)

``unpermute_rows`` undoes it, exactly as transformers' GGUF loader does, so the converted
checkpoint is the HF layout and the model uses NeoX RoPE. Quantized rows are whole blocks, so
the same row order applies to a tensor's raw bytes: `iter_quantized_matmuls` hands
``--quantization gguf`` each matmul tensor's blocks in HF row order.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from kthena_serve.model.errors import UnsupportedModelError

_RENAMES = (
    (r"^token_embd\.", "model.embed_tokens."),
    (r"^output_norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^blk\.(\d+)\.", r"model.layers.\1."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.attn_q\.", ".self_attn.q_proj."),
    (r"\.attn_k\.", ".self_attn.k_proj."),
    (r"\.attn_v\.", ".self_attn.v_proj."),
    (r"\.attn_output\.", ".self_attn.o_proj."),
    (r"\.ffn_gate\.", ".mlp.gate_proj."),
    (r"\.ffn_up\.", ".mlp.up_proj."),
    (r"\.ffn_down\.", ".mlp.down_proj."),
)
# GGUF metadata suffix (after "<arch>.") -> HF config key.
_CONFIG_KEYS = {
    "block_count": "num_hidden_layers", "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
}
_FLOAT32_KEYS = {"rope.freq_base": "rope_theta", "attention.layer_norm_rms_epsilon": "rms_norm_eps"}
_SKIPPED = ("rope_freqs.", "rope_factors")  # llama.cpp's precomputed RoPE tables: rebuilt at load
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The embedding too: a tied LM head reads it (the embedding itself stays dense).
_MATMUL_NAMES = ("lm_head.weight", "model.embed_tokens.weight")


def hf_name(gguf_name: str) -> str:
    """The HF tensor name of a GGUF tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3...``)."""
    name = gguf_name
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of Q/K rows (see the module docstring)."""
    rows = weight.shape[0]
    pairs = rows // num_heads // 2
    return weight.reshape(num_heads, pairs, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _float32(fields: dict[str, Any], key: str) -> float:
    # Shortest decimal that round-trips the file's float32 (1e-05, not 9.999999747378752e-06).
    return float(np.format_float_positional(np.float32(fields[key].contents()), unique=True, trim="-"))


def hf_config(reader: Any) -> dict[str, Any]:
    """An HF ``config.json`` dict from a GGUF reader's metadata (Llama architecture only).

    Raises:
        UnsupportedModelError: the file is not a Llama-architecture model.
    """
    fields = reader.fields
    arch = fields["general.architecture"].contents()
    if arch != "llama":
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; allowed: llama")
    config: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    for suffix, key in _CONFIG_KEYS.items():
        if f"llama.{suffix}" in fields:
            config[key] = fields[f"llama.{suffix}"].contents()
    for suffix, key in _FLOAT32_KEYS.items():
        config[key] = _float32(fields, f"llama.{suffix}")
    config.setdefault("vocab_size", len(fields["tokenizer.ggml.tokens"].data))
    config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if f"tokenizer.ggml.{key}" in fields:
            config[key.replace("padding", "pad")] = int(fields[f"tokenizer.ggml.{key}"].contents())
    config["torch_dtype"] = "float32"
    return config


def _dequantize(tensor: Any) -> torch.Tensor:
    from gguf import quants

    values = quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    # A copy: F32 tensors come back as read-only views of the memory-mapped file.
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def iter_hf_tensors(reader: Any, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every weight, dequantised and un-permuted.

    Dequantised values are exact in float32 (``d * q + m`` of fp16 scales and 4/8-bit ints).
    """
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        if tensor.name.startswith(_SKIPPED):
            continue
        name = hf_name(tensor.name)
        weight = _dequantize(tensor)
        proj = name.split(".")[-2]
        if proj in heads:
            weight = unpermute_rows(weight, heads[proj])
        yield name, weight


def iter_quantized_matmuls(reader: Any, config: dict[str, Any], types: Iterable[str]
                           ) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield ``(hf_name, GGUF type name, uint8 [rows, row_bytes])`` for every matmul weight (the
    projections, the LM head, and the embedding a tied LM head reads) whose GGUF type is in
    ``types``, its bytes as stored with Q/K rows un-permuted (a copy: the file stays mapped
    read-only). Tensors of other types (F16, F32, ...) are not yielded: they stay dense."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    allowed = set(types)
    for tensor in reader.tensors:
        name, kind = hf_name(tensor.name), tensor.tensor_type.name
        proj = name.split(".")[-2] if name.count(".") else ""
        if kind not in allowed or (proj not in _PROJECTIONS and name not in _MATMUL_NAMES):
            continue
        rows = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        yield name, kind, unpermute_rows(rows, heads[proj]) if proj in heads else rows
