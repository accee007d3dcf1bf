"""ModelSpec: the architecture facts the planner needs (sizes, FLOPs, weight and KV bytes).

Built from a Hugging Face ``config.json`` (Llama, Qwen2, Qwen3, Mistral, Mixtral-style MoE,
DeepSeek MLA) or from GGUF metadata. KV bytes use ``num_key_value_heads`` (GQA), never the number
of attention heads, and under tensor parallelism the largest per-rank share of them
(`kthena_core.shape.kv_heads_per_rank`: 3 KV heads over tp=2 -> 2); ``head_dim`` is the config's
own where it gives one (Qwen3-0.6B: 128, not hidden_size / heads = 64)::

    kv_bytes/token = 2 (K and V) x num_layers x kv_heads_per_rank x head_dim x bytes/element
    Llama-2-70B, bf16, tp=1: 2 x 80 x 8 x 128 x 2 = 327,680 B = 320 KiB   (not 2.5 MB)

MLA (DeepSeek-V2/V3) caches one compressed latent per token and layer instead:
``num_layers x (kv_lora_rank + qk_rope_head_dim) x bytes``, the same on every TP rank.

A mixture-of-experts layer holds ``num_experts`` routed experts (``routed_params``), of which a
token uses ``num_experts_per_tok``, beside its attention, router and shared experts: weights
count every expert (``num_params()``), compute only the routed ones (``num_params(active=True)``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import attrs

from kthena_core._yaml import read_file
from kthena_core.architectures import config_architectures
from kthena_core.dtypes import canonical_dtype, dtype_bytes
from kthena_core.shape import (
    ModelShape,
    allowed_tp_sizes,
    check_tp,
    kv_heads_per_rank,
    tp_sizes_dividing_heads,
)

# The float32 scale the engine's int8 KV pool keeps per token per KV head, for K and for V.
INT8_KV_SCALE_BYTES = 4


class ModelSpecError(ValueError):
    """A model description is missing a field or holds an impossible value."""


class MissingKeyError(ModelSpecError):
    """A model config lacks a required key (named by `key`)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"model config lacks required key {key!r}")
        self.key = key


def _non_negative(_inst: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ModelSpecError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen
class ModelSpec:
    """Architecture of a decoder-only transformer, as far as sizing and planning need it.

    ``shape`` holds the tensor geometry (layers, heads, widths, vocabulary) and the checkpoint's
    declared weight dtype (config ``torch_dtype``, as a short key); the fields below add what
    only planning reads.
    """

    name: str
    architecture: str
    shape: ModelShape
    max_position_embeddings: int = 2048  # Hugging Face's LlamaConfig default
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float = 10000.0
    # An RMSNorm over head_dim on every query and key head before RoPE (Qwen3's q_norm / k_norm):
    # 2 x head_dim weights per layer.
    qk_norm: bool = False
    # Mixture of experts (0 = dense). Layers before `first_dense_layers` are dense.
    num_experts: int = attrs.field(default=0, validator=_non_negative)
    num_experts_per_tok: int = attrs.field(default=0, validator=_non_negative)
    num_shared_experts: int = attrs.field(default=0, validator=_non_negative)
    moe_intermediate_size: int = attrs.field(default=0, validator=_non_negative)
    first_dense_layers: int = attrs.field(default=0, validator=_non_negative)
    # Multi-head latent attention (DeepSeek); 0 = ordinary multi-head / grouped-query attention.
    kv_lora_rank: int = attrs.field(default=0, validator=_non_negative)
    q_lora_rank: int = attrs.field(default=0, validator=_non_negative)
    qk_rope_head_dim: int = attrs.field(default=0, validator=_non_negative)
    qk_nope_head_dim: int = attrs.field(default=0, validator=_non_negative)
    v_head_dim: int = attrs.field(default=0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelSpecError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..{self.num_experts}"
            )

    # ---- structure -------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def _attention_params(self) -> int:
        shape = self.shape
        h, nh, nkv, hd = (shape.hidden_size, shape.num_attention_heads, shape.num_kv_heads,
                          shape.head_dim)
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * self.q_lora_rank + self.q_lora_rank * nh * qk if self.q_lora_rank else h * nh * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * nh * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + nh * self.v_head_dim * h
        params = h * nh * hd + 2 * h * nkv * hd + nh * hd * h
        if self.attention_bias:
            params += nh * hd + 2 * nkv * hd
        return params

    def _mlp_params(self, layer: int, active: bool) -> int:
        h = self.shape.hidden_size
        if not self.is_moe_layer(layer):
            return 3 * h * self.shape.intermediate_size
        routed = self.num_experts_per_tok if active else self.num_experts
        return (routed + self.num_shared_experts) * self.expert_params() + h * self.num_experts

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes to experts (MoE models' layers from
        ``first_dense_layers`` on; DeepSeek-V3's first 3 are dense)."""
        return self.is_moe and layer >= self.first_dense_layers

    @property
    def num_moe_layers(self) -> int:
        """Decoder layers with routed experts (0 for a dense model)."""
        return max(0, self.shape.num_layers - self.first_dense_layers) if self.is_moe else 0

    def expert_params(self) -> int:
        """Parameters of one expert's gate, up and down projections (0 for a dense model)."""
        if not self.is_moe:
            return 0
        return 3 * self.shape.hidden_size * (self.moe_intermediate_size
                                             or self.shape.intermediate_size)

    def routed_params(self, layer: int | None = None) -> int:
        """The routed experts' parameters of decoder layer `layer` (every layer's when None):
        ``num_experts x expert_params()`` on a MoE layer, else 0. Expert parallelism splits
        these over instances; the rest of a layer (attention, norms, the router, shared
        experts, a dense MLP) is split by TP alone."""
        if layer is None:
            return self.num_moe_layers * self.num_experts * self.expert_params()
        return self.num_experts * self.expert_params() if self.is_moe_layer(layer) else 0

    def _layer_params(self, layer: int, active: bool) -> int:
        norms = 2 * self.shape.hidden_size + (2 * self.shape.head_dim if self.qk_norm else 0)
        return self._attention_params() + self._mlp_params(layer, active) + norms

    def layer_params(self, layer: int, *, active: bool = False) -> int:
        """Parameters of decoder layer `layer` (attention, MLP or its experts, the norms);
        `active=True` counts only the experts a token is routed to."""
        return self._layer_params(layer, active)

    def num_params(self, *, active: bool = False) -> int:
        """Parameter count; `active=True` counts only the experts a token is routed to."""
        embed = self.shape.vocab_size * self.shape.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        layers = sum(self._layer_params(i, active) for i in range(self.shape.num_layers))
        return embed + head + layers + self.shape.hidden_size

    # ---- compute ---------------------------------------------------------------------------

    def _attn_qk_dim(self) -> tuple[int, int]:
        if self.is_mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        return self.shape.head_dim, self.shape.head_dim

    def matmul_flops_per_token(self) -> float:
        """FLOPs of the weight matmuls for one token (2 per active weight; no embedding lookup)."""
        embed_lookup = self.shape.vocab_size * self.shape.hidden_size
        return 2.0 * (self.num_params(active=True) - embed_lookup * (0 if self.tie_word_embeddings else 1))

    def attention_flops(self, num_queries: int, context_len: int) -> float:
        """FLOPs of QK^T and PV for `num_queries` tokens that each attend to `context_len` keys."""
        qk, v = self._attn_qk_dim()
        layer_heads = self.shape.num_layers * self.shape.num_attention_heads
        return 2.0 * layer_heads * (qk + v) * num_queries * context_len

    def lm_head_flops(self) -> float:
        """FLOPs of the LM head for one token (vocab x hidden, tied or not)."""
        return 2.0 * self.shape.vocab_size * self.shape.hidden_size

    def prefill_flops(self, prompt_len: int, cached_len: int = 0) -> float:
        """FLOPs to prefill `prompt_len` new tokens after `cached_len` cached ones (causal).

        Only the last token goes through the LM head: the engine computes logits at the
        sampled positions only (``logits_indices``), one per prefilled sequence.
        """
        n = prompt_len
        # Token i (0-based among new tokens) attends to cached_len + i + 1 keys.
        attended = n * cached_len + n * (n + 1) / 2
        qk, v = self._attn_qk_dim()
        attn = 2.0 * self.shape.num_layers * self.shape.num_attention_heads * (qk + v) * attended
        body = self.matmul_flops_per_token() - self.lm_head_flops()
        return body * n + self.lm_head_flops() * min(n, 1) + attn

    def decode_flops(self, context_len: int) -> float:
        """FLOPs to generate one token with `context_len` tokens already in the KV cache."""
        return self.matmul_flops_per_token() + self.attention_flops(1, context_len + 1)

    # ---- memory ----------------------------------------------------------------------------

    def weight_bytes(self, dtype: str = "bf16") -> float:
        """Bytes of all weights stored in `dtype` (int4/int8 add one fp16 scale per 128 weights)."""
        key = canonical_dtype(dtype)
        per = dtype_bytes(key)
        if key in ("int4", "int8"):
            per += 2.0 / 128
        return self.num_params() * per

    def check_tp(self, tp: int) -> None:
        """Raise unless the engine can split this model's heads over `tp` ranks.

        The rule is `kthena_core.shape.check_tp`; MLA caches one latent replicated on every rank,
        so only its query heads are split.

        Raises:
            HeadSplitError: the message names the allowed tp values.
        """
        check_tp(self.shape.num_attention_heads, self.split_kv_heads, tp)

    def allowed_tp_sizes(self) -> tuple[int, ...]:
        """Every tp `check_tp` accepts, smallest first (SmolLM2-135M: 1, 2, 3, 6, 9)."""
        return allowed_tp_sizes(self.shape.num_attention_heads, self.split_kv_heads)

    def tp_sizes_dividing_heads(self) -> tuple[int, ...]:
        """The tp the planner proposes: accepted by `check_tp` and giving every rank as many
        heads (`kthena_core.shape.tp_sizes_dividing_heads`; DeepSeek-V3's 128: 1, 2, 4 ...)."""
        return tp_sizes_dividing_heads(self.shape.num_attention_heads, self.split_kv_heads)

    @property
    def split_kv_heads(self) -> int:
        """The heads TP splits as KV heads: the KV heads, or for MLA (one latent replicated on
        every rank) the query heads."""
        return self.shape.num_attention_heads if self.is_mla else self.shape.num_kv_heads

    def kv_heads_per_rank(self, tp: int = 1, rank: int | None = None) -> int:
        """KV heads one TP rank holds (`kthena_core.shape.kv_heads_per_rank`).

        Args:
            tp: tensor-parallel degree.
            rank: one rank, or None for the largest share (what each rank's pool is sized for).
        Returns:
            3 KV heads over tp=2: 2 for rank 0 and None, 1 for rank 1; 1 when replicated.
        Raises:
            HeadSplitError: tp is not positive, or exceeds the KV heads without being a multiple.
        """
        return kv_heads_per_rank(self.shape.num_kv_heads, tp, rank)

    def kv_bytes_per_token(self, dtype: str = "bf16", tp: int = 1) -> float:
        """KV-cache bytes one token occupies on the most loaded TP rank (all layers, K and V).

        int8 adds the float32 scale the engine's int8 pool keeps per token per KV head, beside
        K and V (``head_dim + 4`` bytes per head each); MLA's latent is counted without one.
        """
        per = dtype_bytes(dtype)
        if self.is_mla:
            return self.shape.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * per
        head = self.shape.head_dim * per + (INT8_KV_SCALE_BYTES
                                            if canonical_dtype(dtype) == "int8" else 0)
        return 2 * self.shape.num_layers * self.kv_heads_per_rank(tp) * head

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike[str], name: str | None = None) -> ModelSpec:
        """Build from a Hugging Face config (a dict, a config.json path, or a checkpoint folder).

        Raises:
            MissingKeyError: a required key (sizes, layers, heads, vocabulary) is absent.
            ModelSpecError: the file is missing or not JSON, or a value is impossible.
        """
        path = None
        if not isinstance(config, Mapping):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            config = _read_json(path)
        return _spec_from_hf(config, name or _name_from(config, path))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], name: str | None = None) -> ModelSpec:
        """Build from the metadata of a GGUF file (needs the `gguf` package: extra [gguf])."""
        from kthena_core._gguf import read_gguf_config

        config = read_gguf_config(os.fspath(path))
        return _spec_from_hf(config, name or config.get("_name_or_path", os.path.basename(path)))


def _read_json(path: str) -> dict[str, Any]:
    data = read_file(path, json.load, ModelSpecError, "model config", "JSON",
                     json.JSONDecodeError)
    if not isinstance(data, dict):
        raise ModelSpecError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _name_from(config: Mapping[str, Any], path: str | None) -> str:
    if config.get("_name_or_path"):
        return str(config["_name_or_path"])
    if path:
        return os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    return str(config.get("model_type", "model"))


def _require(config: Mapping[str, Any], key: str) -> Any:
    if key not in config:
        raise MissingKeyError(key)
    return config[key]


def _spec_from_hf(config: Mapping[str, Any], name: str) -> ModelSpec:
    """Map the HF field names of the supported families onto ModelSpec."""
    text = config.get("text_config")
    if isinstance(text, Mapping):  # multimodal wrappers keep the LM under text_config
        config = {**config, **text}
    heads = int(_require(config, "num_attention_heads"))
    hidden = int(_require(config, "hidden_size"))
    kv_lora = int(config.get("kv_lora_rank") or 0)
    num_experts = int(config.get("num_local_experts") or config.get("n_routed_experts") or config.get("num_experts") or 0)
    arch = config_architectures(config)  # as the engine's loader reads it
    head_dim = _head_dim(config, arch, hidden // heads)
    sizes = {
        "num_layers": int(_require(config, "num_hidden_layers")),
        "hidden_size": hidden,
        "intermediate_size": int(_require(config, "intermediate_size")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(head_dim),
        "vocab_size": int(_require(config, "vocab_size")),
    }
    return ModelSpec(
        name=name,
        architecture=str(arch[0]),
        shape=_shape(sizes, str(config.get("torch_dtype") or config.get("dtype") or "bf16")),
        max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", _is_qwen2(config, arch))),
        rope_theta=_rope_theta(config),
        qk_norm=_is_qwen3(config, arch),
        num_experts=num_experts,
        num_experts_per_tok=int(config.get("num_experts_per_tok") or 0) if num_experts else 0,
        num_shared_experts=int(config.get("n_shared_experts") or 0),
        moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
        first_dense_layers=int(config.get("first_k_dense_replace") or 0),
        kv_lora_rank=kv_lora,
        q_lora_rank=int(config.get("q_lora_rank") or 0),
        qk_rope_head_dim=int(config.get("qk_rope_head_dim") or 0) if kv_lora else 0,
        qk_nope_head_dim=int(config.get("qk_nope_head_dim") or 0) if kv_lora else 0,
        v_head_dim=int(config.get("v_head_dim") or 0) if kv_lora else 0,
    )


def _shape(sizes: Mapping[str, int], dtype: str) -> ModelShape:
    """The `ModelShape` of a config's sizes (by their config names) and dtype; a refused one is
    a ModelSpecError naming the config's field.

    Raises:
        ModelSpecError: an unknown dtype, a size that is not positive, or query heads that are
            not a multiple of the KV heads.
    """
    try:
        dtype = canonical_dtype(dtype)
    except ValueError as e:
        raise ModelSpecError(f"dtype: {e}") from None
    for key, value in sizes.items():
        if value <= 0:
            raise ModelSpecError(f"{key} must be > 0, got {value!r}")
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if heads % kv_heads:
        raise ModelSpecError(f"num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads}")
    return ModelShape(
        num_layers=sizes["num_layers"], num_attention_heads=heads, num_kv_heads=kv_heads,
        head_dim=sizes["head_dim"], hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"], vocab_size=sizes["vocab_size"],
        dtype=dtype)


def _rope_theta(config: Mapping[str, Any]) -> float:
    rope = config.get("rope_parameters") or {}  # transformers 5 nests rope_theta here
    return float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)


def _is_qwen2(config: Mapping[str, Any], architectures: list[str]) -> bool:
    """Qwen2 has q/k/v biases even when its config does not say `attention_bias`."""
    return config.get("model_type") == "qwen2" or "Qwen2ForCausalLM" in architectures


def _is_qwen3(config: Mapping[str, Any], architectures: list[str]) -> bool:
    """Qwen3 and Qwen3-MoE normalise each query and key head (q_norm / k_norm)."""
    return (config.get("model_type") in ("qwen3", "qwen3_moe")
            or bool({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}.intersection(architectures)))


def _head_dim(config: Mapping[str, Any], architectures: list[str], even_split: int) -> int:
    """The config's ``head_dim``; else MLA's ``v_head_dim``; else transformers' default for the
    family: 128 for Qwen3 dense (``Qwen3Config.head_dim``), ``hidden_size / heads`` otherwise."""
    if config.get("head_dim"):
        return int(config["head_dim"])
    if config.get("kv_lora_rank") and config.get("v_head_dim"):
        return int(config["v_head_dim"])
    qwen3_dense = config.get("model_type") == "qwen3" or "Qwen3ForCausalLM" in architectures
    return 128 if qwen3_dense else even_split


def human_bytes(num: float) -> str:
    """1536 -> '1.5 KiB'; an unbounded capacity (inf, a CPU host's memory) -> 'unbounded'."""
    if math.isinf(num):
        return "unbounded"
    if num < 1024:
        return f"{num:.0f} B"
    exp = min(int(math.log(num, 1024)), 5)
    return f"{num / 1024**exp:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'][exp]}"
