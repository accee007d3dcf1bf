"""Dtypes: the one table of the data types the SDK names (weights, activations, KV cache).

Every layer above spells a dtype through this table: its short key ("bf16"), the other names
users and checkpoints write ("bfloat16", "torch.bfloat16", "half" ...), its bytes per element,
and its torch dtype. torch is imported only when `torch_dtype` is called, so kthena_core stays
importable without it. (mooncake_kv, which imports no other layer, keeps the four KV dtypes it
stores in its own `KVDtype`.)

    key    bytes  torch name       other names
    fp32   4      float32          float32, float
    bf16   2      bfloat16         bfloat16
    fp16   2      float16          float16, half
    fp8    1      float8_e4m3fn    float8, float8_e4m3fn
    int8   1      int8
    int4   0.5    (none)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_BYTES", "ENGINE_DTYPES", "canonical_dtype", "dtype_bytes", "dtype_key",
           "torch_dtype", "torch_name"]

# key: (bytes per element, torch attribute name, other names). Sub-byte quantised formats count
# their packed size without block scales; `ModelSpec.weight_bytes` adds scale overhead.
_TABLE: dict[str, tuple[float, str | None, tuple[str, ...]]] = {
    "fp32": (4.0, "float32", ("float32", "float")),
    "bf16": (2.0, "bfloat16", ("bfloat16",)),
    "fp16": (2.0, "float16", ("float16", "half")),
    "fp8": (1.0, "float8_e4m3fn", ("float8", "float8_e4m3fn")),
    "int8": (1.0, "int8", ()),
    "int4": (0.5, None, ()),
}

DTYPE_BYTES: dict[str, float] = {key: row[0] for key, row in _TABLE.items()}
"""Bytes per element of each key (fractional for sub-byte formats)."""

ENGINE_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
"""The keys the serving engine computes in (weights, activations, and KV unless int8)."""

_ALIASES = {alias: key for key, (_, _, aliases) in _TABLE.items() for alias in aliases}


def dtype_key(name: object) -> str:
    """The short key of a dtype name without checking that the table holds it: "bfloat16",
    "torch.bfloat16" and "BF16" -> "bf16"; an unknown name comes back lower-cased, so tables
    keyed by other formats too (peak FLOP/s per "tf32") can look it up."""
    key = str(name).lower().removeprefix("torch.")
    return _ALIASES.get(key, key)


def canonical_dtype(name: object) -> str:
    """Normalise a dtype name ("bfloat16", "torch.float16", a ``torch.dtype``, "fp16" ...) to its
    short key.

    Raises:
        ValueError: the name is not a known dtype; the message lists the known ones.
    """
    key = dtype_key(name)
    if key not in _TABLE:
        known = sorted(set(_TABLE) | set(_ALIASES))
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(known)}")
    return key


def dtype_bytes(name: object) -> float:
    """Bytes per element of `name` (fractional for sub-byte formats).

    Raises:
        ValueError: as `canonical_dtype`.
    """
    return DTYPE_BYTES[canonical_dtype(name)]


def torch_name(name: object) -> str:
    """The torch (and Hugging Face ``torch_dtype``) name of a dtype: "bf16" -> "bfloat16".

    Raises:
        ValueError: an unknown dtype, or one torch has no dtype for (int4).
    """
    key = canonical_dtype(name)
    found = _TABLE[key][1]
    if found is None:
        raise ValueError(f"dtype {key!r} has no torch dtype; allowed: "
                         f"{', '.join(k for k, row in _TABLE.items() if row[1])}")
    return found


def torch_dtype(name: object) -> torch.dtype:
    """The ``torch.dtype`` of a dtype name ("bf16", "bfloat16" -> ``torch.bfloat16``); imports
    torch on first use.

    Raises:
        ValueError: as `torch_name`.
    """
    import torch

    return getattr(torch, torch_name(name))
