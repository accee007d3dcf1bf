"""Read a GGUF file's metadata into a Hugging Face-style config dict (architecture only)."""

from __future__ import annotations

import os
from typing import Any

# GGUF metadata key suffix -> HF config key (the prefix is the file's general.architecture).
_KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "context_length": "max_position_embeddings",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
    "expert_count": "num_local_experts",
    "expert_used_count": "num_experts_per_tok",
}


class GGUFError(ValueError):
    """The file is not a readable GGUF model, or the `gguf` package is missing."""


def read_gguf_config(path: str) -> dict[str, Any]:
    """Return an HF-style config dict built from the GGUF metadata of `path`.

    Raises:
        GGUFError: the package is missing, the file is absent or not GGUF, or keys are missing.
    """
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError("reading GGUF needs the 'gguf' package: pip install 'kthena-core[gguf]'") from None
    if not os.path.isfile(path):
        raise GGUFError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises several types on malformed files
        raise GGUFError(f"{path} is not a readable GGUF file: {e}") from None
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = _value(fields, "general.architecture")
    config: dict[str, Any] = {"model_type": arch, "architectures": [f"{arch.capitalize()}ForCausalLM"]}
    for suffix, hf_key in _KEYS.items():
        key = f"{arch}.{suffix}"
        if key in fields:
            config[hf_key] = _value(fields, key)
    if "vocab_size" not in config:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        config["vocab_size"] = len(tokens.data) if tokens is not None else 0
    names = {t.name for t in reader.tensors}
    config["tie_word_embeddings"] = "output.weight" not in names
    config["_name_or_path"] = _value(fields, "general.name") if "general.name" in fields else os.path.basename(path)
    return config


def _value(fields: dict[str, Any], key: str) -> Any:
    if key not in fields:
        raise GGUFError(f"GGUF metadata lacks {key!r}")
    return fields[key].contents()
