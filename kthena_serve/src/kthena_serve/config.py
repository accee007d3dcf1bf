"""EngineConfig: every knob of one engine, validated once, as a frozen value.

Only the CLI (``kthena serve``) reads argv or the environment; it builds one of these and the
engine, runner and server take it explicitly.
"""

from __future__ import annotations

import re

import attrs

__all__ = ["EngineConfig", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """``1073741824``, ``"1GiB"``, ``"512MiB"``, ``"2G"`` -> bytes.

    Raises:
        ValueError: an unknown unit or a non-positive size.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = _SIZE.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a size; write e.g. 1GiB, 512MiB or 2G")
        number, unit = float(match.group(1)), match.group(2).lower()
    num_bytes = int(number * _UNITS[unit])
    if num_bytes <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return num_bytes


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


def _optional_positive(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None:
        _positive(instance, attribute, value)


@attrs.frozen(kw_only=True)
class EngineConfig:
    """How one engine is built.

    Attributes:
        model: ``"default"`` (SmolLM2-135M-Instruct) or a Hugging Face checkpoint folder.
        dtype: weight and KV dtype (``"bfloat16"``, ``"float16"``, ``"float32"``).
        max_num_seqs: requests running at once (the decode batch size).
        max_num_batched_tokens: tokens one step may compute (prefill chunks + decodes).
        block_size: tokens per KV block.
        kv_cache_memory: bytes for the KV pool (``"1GiB"`` also accepted).
        num_kv_blocks: exact pool size; overrides ``kv_cache_memory`` (tests use tiny pools).
        max_model_len: context length; default the model's, capped by the pool.
        enable_prefix_caching: reuse cached prompt blocks across requests.
        tp: tensor-parallel degree (worker processes, one per core).
        num_threads: torch threads; default the cores this process may run on.
        max_n: largest ``n`` (choices per request) the server accepts.
        check_invariants: run the KV manager's self-check after every verb (tests).
    """

    model: str = "default"
    dtype: str = attrs.field(default="bfloat16", validator=attrs.validators.in_(
        ("bfloat16", "float16", "float32")))
    max_num_seqs: int = attrs.field(default=64, validator=_positive)
    max_num_batched_tokens: int = attrs.field(default=1024, validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    kv_cache_memory: int = attrs.field(default=1024**3, converter=parse_bytes)
    num_kv_blocks: int | None = attrs.field(default=None, validator=_optional_positive)
    max_model_len: int | None = attrs.field(default=None, validator=_optional_positive)
    enable_prefix_caching: bool = True
    tp: int = attrs.field(default=1, validator=_positive)
    num_threads: int | None = attrs.field(default=None, validator=_optional_positive)
    max_n: int = attrs.field(default=8, validator=_positive)
    check_invariants: bool = False

    @property
    def torch_dtype(self):  # noqa: ANN201 - torch imported lazily
        import torch

        return getattr(torch, self.dtype)
