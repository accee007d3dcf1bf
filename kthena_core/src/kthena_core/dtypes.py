"""Element sizes of the data types the SDK reasons about (weights, activations, KV cache)."""

from __future__ import annotations

# Bytes per element. Sub-byte quantised formats count their packed size without block scales;
# `weight_bytes` adds scale overhead where it matters (see ModelSpec.weight_bytes).
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}

_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
}


def canonical_dtype(name: str) -> str:
    """Normalise a dtype name ("bfloat16", "torch.float16", "fp16" ...) to its short key.

    Raises:
        ValueError: the name is not a known dtype; the message lists the known ones.
    """
    key = str(name).lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        known = sorted(set(DTYPE_BYTES) | set(_ALIASES))
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(known)}")
    return key


def dtype_bytes(name: str) -> float:
    """Bytes per element of `name` (fractional for sub-byte formats)."""
    return DTYPE_BYTES[canonical_dtype(name)]
