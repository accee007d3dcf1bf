"""KV cache sizing: the bytes one token's K and V take, and how many blocks fit in a budget.

The figure that matters is

    bytes_per_token = 2 (K and V) x num_layers x num_key_value_heads x head_dim x bytes_per_element

with the number of *key/value* heads, not attention heads: grouped-query attention (GQA) shares
one K/V head between several query heads. Llama-2-70B has 64 attention heads but 8 KV heads, so
a token costs 2 x 80 x 8 x 128 x 2 = 327,680 bytes (320 KiB) in bf16 and 128 tokens cost 40 MiB;
counting attention heads instead overstates it eightfold. Under tensor parallelism a shape
describes one rank and takes that rank's head count, already split: how heads are split is
kthena_core's rule (`kthena_core.shape.kv_heads_per_rank`), which this layer does not import.

The int8 variant stores one float32 scale per token per head for K and for V, on top of the
one-byte elements.

Pure Python: no torch needed.
"""

from __future__ import annotations

import enum

import attrs

from mooncake_kv.types import KVCacheError

__all__ = [
    "KVDtype",
    "KVShape",
    "SizingError",
    "kv_cache_max_tokens",
    "max_num_blocks",
    "max_num_tokens",
]

SCALE_BYTES = 4  # float32 scale per token per head (int8 only)


class SizingError(KVCacheError, ValueError):
    """A KV shape or budget that cannot describe a real cache."""


class KVDtype(str, enum.Enum):
    """Element type of the K/V cache. INT8 carries per-token-per-head float32 scales."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    INT8 = "int8"

    @property
    def element_bytes(self) -> int:
        return _ELEMENT_BYTES[self]

    @property
    def is_quantized(self) -> bool:
        return self is KVDtype.INT8

    @classmethod
    def parse(cls, value: KVDtype | str) -> KVDtype:
        """Accept a KVDtype or one of its names/aliases ('bfloat16', 'half', 'float32', ...).

        Raises:
            SizingError: for any other spelling; the message lists the accepted ones.
        """
        if isinstance(value, KVDtype):
            return value
        found = _ALIASES.get(str(value).lower())
        if found is None:
            raise SizingError(
                f"unknown KV dtype {value!r}; use one of {sorted(_ALIASES)}"
            )
        return found


_ELEMENT_BYTES = {KVDtype.BF16: 2, KVDtype.FP16: 2, KVDtype.FP32: 4, KVDtype.INT8: 1}
_ALIASES = {
    "bf16": KVDtype.BF16, "bfloat16": KVDtype.BF16,
    "fp16": KVDtype.FP16, "float16": KVDtype.FP16, "half": KVDtype.FP16,
    "fp32": KVDtype.FP32, "float32": KVDtype.FP32, "float": KVDtype.FP32,
    "int8": KVDtype.INT8,
}


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SizingError(f"{attribute.name} must be a positive int, got {value!r}")


def _parts(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    if value not in (1, 2) or isinstance(value, bool):
        raise SizingError(f"{attribute.name} must be 2 (K and V) or 1 (one latent vector, "
                          f"MLA), got {value!r}")


@attrs.frozen
class KVShape:
    """The K/V geometry one rank's cache holds (heads already split by TP).

    Attributes:
        num_layers: decoder layers.
        num_kv_heads: K/V heads on this rank: the model's `num_key_value_heads` (not its attention
            heads) split by the TP rule, e.g. ``kthena_core.kv_heads_per_rank(nkv, tp)``.
        head_dim: elements per head.
        block_size: tokens per block.
        dtype: element type; INT8 adds float32 scales.
        num_parts: 2 (a K and a V per token and layer), or 1: one vector per token and layer,
            held where K is (MLA's compressed latent: ``num_kv_heads`` 1, ``head_dim``
            kv_lora_rank + qk_rope_head_dim).
    """

    num_layers: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    dtype: KVDtype = attrs.field(default=KVDtype.BF16, converter=KVDtype.parse)
    num_parts: int = attrs.field(default=2, validator=_parts)

    @property
    def element_bytes_per_token(self) -> int:
        """K and V (or the latent) of one token over all layers, in bytes (scales excluded)."""
        return (self.num_parts * self.num_layers * self.num_kv_heads * self.head_dim
                * self.dtype.element_bytes)

    @property
    def scale_bytes_per_token(self) -> int:
        """Per-token-per-head float32 scales for K and V (0 unless int8)."""
        if not self.dtype.is_quantized:
            return 0
        return self.num_parts * self.num_layers * self.num_kv_heads * SCALE_BYTES

    @property
    def bytes_per_token(self) -> int:
        return self.element_bytes_per_token + self.scale_bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def fingerprint(self) -> str:
        """A short readable id of the geometry, e.g. 'L30-H3-D64-B16-bf16'.

        Blocks stored under one fingerprint are only ever loaded into a cache with the same one.
        """
        latent = "-latent" if self.num_parts == 1 else ""
        return (
            f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}"
            f"-B{self.block_size}-{self.dtype.value}{latent}"
        )


def _non_negative_bytes(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SizingError(f"{name} must be a non-negative int of bytes, got {value!r}")


def max_num_blocks(shape: KVShape, num_bytes: int) -> int:
    """Whole blocks of `shape` that fit in `num_bytes` (0 when not even one fits)."""
    _non_negative_bytes("num_bytes", num_bytes)
    return num_bytes // shape.bytes_per_block


def max_num_tokens(shape: KVShape, num_bytes: int) -> int:
    """Tokens that fit in `num_bytes`, counted in whole blocks (a partial block holds none)."""
    return max_num_blocks(shape, num_bytes) * shape.block_size


def kv_cache_max_tokens(
    shape: KVShape,
    *,
    device_bytes: int,
    weight_bytes: int,
    memory_utilization: float = 0.9,
    reserved_bytes: int = 0,
) -> int:
    """Tokens of KV cache one device can hold after weights and working memory.

    usable = device_bytes x memory_utilization - weight_bytes - reserved_bytes, then counted
    in whole blocks. Weight and device figures are per rank (already split by TP).

    Args:
        shape: per-rank KV shape.
        device_bytes: the device's memory.
        weight_bytes: this rank's share of the weights.
        memory_utilization: fraction of device memory the engine may use, in (0, 1].
        reserved_bytes: activations, workspace, graphs.
    Returns:
        Tokens that fit (0 when the weights leave no room: a normal answer, not an error).
    Raises:
        SizingError: for a negative byte count or a utilization outside (0, 1].
    """
    for name, value in (("device_bytes", device_bytes), ("weight_bytes", weight_bytes),
                        ("reserved_bytes", reserved_bytes)):
        _non_negative_bytes(name, value)
    if not 0.0 < memory_utilization <= 1.0:
        raise SizingError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    usable = int(device_bytes * memory_utilization) - weight_bytes - reserved_bytes
    return max_num_tokens(shape, max(usable, 0))
