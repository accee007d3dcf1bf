"""`ModelConfig`: the Hugging Face `config.json` fields a Llama-family decoder needs.

The sizes (layers, heads, widths, vocabulary, RoPE base, dtype) are parsed once, by
kthena_core's `ModelSpec.from_hf_config`, and held as its `ModelShape`; this module adds only
what the engine alone needs (norm epsilon, RoPE scaling, special tokens) and the Llama-family
architecture check, with the refusal of the options the model does not implement.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from kthena_core import kv_heads_per_rank
from kthena_core.architectures import SERVED_ARCHITECTURES, unserved_architecture
from kthena_core.dtypes import ENGINE_DTYPES, torch_dtype
from kthena_core.model_spec import MissingKeyError, ModelSpec, ModelSpecError
from kthena_core.shape import ModelShape
from kthena_serve.model.errors import CheckpointError, UnsupportedModelError
from kthena_serve.model.mla_config import MLAConfig, mla_config
from kthena_serve.model.moe_config import MoEConfig, moe_config

# The architectures the loader implements (kthena_core's one list, which the planner and
# deploy read too). Llama-family checkpoints share the Llama tensor names and maths (Qwen2 adds
# q/k/v biases, which `attention_bias` covers; Qwen3 an RMSNorm on each query and key head,
# which `qk_norm` covers).
SUPPORTED_ARCHITECTURES = SERVED_ARCHITECTURES


def _positive(_inst: Any, attribute: attrs.Attribute, value: int) -> None:
    if value <= 0:
        raise UnsupportedModelError(f"{attribute.name} must be > 0, got {value}")


def _eos_tuple(value: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


@attrs.frozen
class ModelConfig:
    """Architecture of a Llama-family decoder, as read from a checkpoint's ``config.json``.

    ``shape`` is the tensor geometry and the checkpoint's declared dtype (kthena_core's
    `ModelShape`, what the TP rule and sizing take). ``eos_token_id`` keeps the form of the file
    (an int or a tuple of ints); use ``eos_token_ids`` for the set. ``rope_scaling`` is the HF
    dict (or None) and is passed to the RoPE cache builder. ``qk_norm``: each query and key head
    goes through an RMSNorm over ``head_dim`` (weights ``q_norm`` / ``k_norm``, ``rms_norm_eps``)
    after the projections and before RoPE (Qwen3). ``moe``: the experts of an MoE family
    (`MoEConfig`: Mixtral, Qwen3-MoE, DeepSeek), None for a dense model. ``mla``: DeepSeek's
    latent attention (`MLAConfig`), None for ordinary grouped-query attention.
    """

    shape: ModelShape
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = attrs.field(default=None, hash=False)
    max_position_embeddings: int = attrs.field(default=2048, validator=_positive)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(_eos_tuple(self.eos_token_id))

    @property
    def kv_head_dim(self) -> int:
        """Values per cached head: head_dim, or MLA's latent width."""
        return self.shape.head_dim if self.mla is None else self.mla.latent_dim

    @property
    def kv_parts(self) -> int:
        """Cached tensors per layer: 2 (K and V), or 1 (MLA's latent)."""
        return 2 if self.mla is None else 1

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads a rank of ``tp`` caches at most (kthena_core's rule; MLA: its one latent,
        whole on every rank)."""
        return 1 if self.mla is not None else kv_heads_per_rank(self.shape.num_kv_heads, tp)

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint's declared dtype (bfloat16 unless the engine computes in it)."""
        key = self.shape.dtype
        return torch_dtype(key) if key in ENGINE_DTYPES else torch.bfloat16

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``.

        Raises:
            UnsupportedModelError: the architecture is not Llama-family, an option it sets is
                not implemented, or a size or the dtype is invalid.
            CheckpointError: a required key is missing.
        """
        _check_architecture(config)
        spec = _parse_spec(config)
        _check_options(spec)
        fields = _spec_fields(spec)
        window = _sliding_window(config)
        if window is not None and window < fields["max_position_embeddings"]:
            # attention here spans the whole context: within the window that is exactly what
            # sliding-window attention computes, past it not, so the context stops there
            fields["max_position_embeddings"] = window
        engine = _engine_fields(config)
        moe = moe_config(config, spec.shape.num_layers)
        mla = mla_config(config, spec, engine["rope_scaling"])
        return cls(**fields, **engine, moe=moe, mla=mla)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike[str]) -> ModelConfig:
        """Read ``folder/config.json``.

        Raises:
            CheckpointError: the folder or its config.json is missing or not valid JSON.
        """
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{folder} is not a checkpoint folder: {path.name} is missing")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def _check_architecture(config: Mapping[str, Any]) -> None:
    why = unserved_architecture(config.get("architectures") or ["LlamaForCausalLM"])
    if why is not None:
        raise UnsupportedModelError(why)
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {config['hidden_act']!r} is not supported; allowed: silu")


def _check_options(spec: ModelSpec) -> None:
    """Refuse, by name, an option of a supported architecture that the model does not implement."""
    if spec.attention_bias and spec.architecture != "Qwen2ForCausalLM":
        # transformers' Llama, Mistral and Qwen3 put the bias on o_proj too, which the model
        # has no place for (Qwen2's biases are on q/k/v only)
        raise UnsupportedModelError(
            f"{spec.architecture} with attention_bias=true (biases on q/k/v and o_proj) is not "
            "supported; allowed: attention_bias=false")


def _sliding_window(config: Mapping[str, Any]) -> int | None:
    """The sliding attention window config.json asks for (Mistral's ``sliding_window``;
    Qwen2's and Qwen3's only with ``use_sliding_window``, whichever layers
    ``max_window_layers`` makes slide), or None."""
    window = config.get("sliding_window")
    if "use_sliding_window" in config and not config["use_sliding_window"]:
        return None
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise UnsupportedModelError(f"sliding_window {window!r} is not supported; allowed: a "
                                    "positive integer or null")
    return window


def _parse_spec(config: Mapping[str, Any]) -> ModelSpec:
    try:
        return ModelSpec.from_hf_config(config)
    except MissingKeyError as e:
        raise CheckpointError(f"config.json lacks the required key {e.key!r}") from None
    except ModelSpecError as e:
        raise UnsupportedModelError(str(e)) from None


def _spec_fields(spec: ModelSpec) -> dict[str, Any]:
    """The fields kthena_core has already read from config.json."""
    return dict(
        shape=spec.shape, rope_theta=spec.rope_theta,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, attention_bias=spec.attention_bias,
        qk_norm=spec.qk_norm,
    )


def _engine_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fields only the engine needs, which kthena_core does not read."""
    eos = config.get("eos_token_id")
    return dict(
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        # transformers 5 writes the scaling into rope_parameters (with rope_theta), 4.x into
        # rope_scaling
        rope_scaling=_rope_scaling(config.get("rope_scaling") or config.get("rope_parameters")),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=eos if eos is None or isinstance(eos, int) else tuple(eos),
    )


def _rope_scaling(value: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    if not value or value.get("rope_type", value.get("type", "default")) == "default":
        return None
    return dict(value)
